"""Cross-entropy: the Triton kernels and the PyTorch path against float64.

Covers z-loss, the ignore index (including a batch where every target is ignored),
vocabulary padding, odd vocabulary sizes spanning several blocks, bf16 inputs, and the
vocab-sharded case in a 4-rank gloo world whose last shard is all padding (a CPU world,
Triton in its interpreter, on any machine). The one-process kernel tests run on `device`
(tests/kernels/conftest.py: the GPU when there is one, else the CPU with the interpreter).
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite import kernels
from megalite.kernels import cross_entropy as ce_module
from megalite.kernels.cross_entropy import IGNORE_INDEX
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from tests.helpers.cross_entropy import losses_and_grad as run, reference_losses
from tests.helpers.distributed import run_world

pytestmark = pytest.mark.skipif(not kernels.triton_available(), reason="triton is not installed")

FLOOR = {torch.float32: 1e-6, torch.bfloat16: 4e-3}


@pytest.fixture
def small_blocks(monkeypatch):
    """64-column blocks, so that tiny vocabularies still take several loop steps."""
    monkeypatch.setattr(ce_module, "BLOCK", 64)


def relative_error(actual, expected):
    return float((actual - expected).norm() / expected.norm())


def problem(rows, vocab, seed, ignored=2):
    generator = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=generator, dtype=torch.float64) * 3
    labels = torch.randint(0, vocab - 3, (rows,), generator=generator)
    labels[:ignored] = IGNORE_INDEX
    grad = torch.rand(rows, generator=generator, dtype=torch.float64)
    return logits, labels, grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,real_vocab,z_loss_weight", [(1000, 1000, 0.0), (1003, 997, 1e-3), (7, 5, 0.1)])
def test_triton_cross_entropy_matches_float64_within_twice_torch_error(vocab, real_vocab, z_loss_weight, dtype,
                                                                       small_blocks, one_thread, device):
    logits, labels, grad = (t.to(device) for t in problem(6, vocab, seed=vocab))
    logits[:, real_vocab:] = 40.0  # padding would dominate if it were not excluded
    expected = run(logits, labels, grad, torch.float64, real_vocab, z_loss_weight, use_reference=True)
    torch_path = run(logits, labels, grad, dtype, real_vocab, z_loss_weight, kernels="torch")
    triton_path = run(logits, labels, grad, dtype, real_vocab, z_loss_weight, kernels="triton")
    for name, reference, ours, theirs in zip(("losses", "dlogits"), expected, triton_path, torch_path):
        assert relative_error(ours, reference) <= 2 * max(relative_error(theirs, reference), FLOOR[dtype]), name
    for path in (torch_path, triton_path):
        assert torch.all(path[0][:2] == 0) and torch.all(path[1][:2] == 0)  # ignored rows
        assert torch.all(path[1][:, real_vocab:] == 0)  # padding columns get no grad


@pytest.mark.parametrize("kernel_mode", ["torch", "triton"])
def test_every_target_ignored_gives_pytorch_semantics(kernel_mode, one_thread, device):
    """reduction="none" losses are 0 with zero grads; the mean over no tokens is NaN, as in PyTorch."""
    logits = torch.randn(4, 33, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
    labels = torch.full((4,), IGNORE_INDEX, device=device)
    losses = vocab_parallel_cross_entropy(logits, labels, None, 0, 33, 1e-4, kernels=kernel_mode)
    assert torch.equal(losses, torch.zeros(4, device=device))
    mask = labels != IGNORE_INDEX
    mean = losses.sum() / mask.sum()
    expected = F.cross_entropy(logits.detach(), labels, ignore_index=IGNORE_INDEX)
    assert torch.isnan(mean) and torch.isnan(expected)
    losses.sum().backward()
    assert torch.equal(logits.grad, torch.zeros_like(logits))


def test_triton_saves_no_softmax(one_thread, device):
    """The Triton path keeps the logits (no copy) and one fp32 number per row, nothing vocab-sized else."""
    logits = torch.randn(5, 40, generator=torch.Generator().manual_seed(0)).to(device).requires_grad_()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        vocab_parallel_cross_entropy(logits, torch.arange(5, device=device), None, 0, kernels="triton")
    vocab_sized = [t for t in saved if t.numel() >= logits.numel()]
    assert len(vocab_sized) == 1 and vocab_sized[0].data_ptr() == logits.data_ptr()
    assert sum(t.numel() for t in saved) == logits.numel() + 2 * 5  # logits, labels, lse


def check_sharded(rank, world_size):
    """Both paths on 4 shards of 16 columns (11 real: the last shard is all padding) equal float64."""
    ce_module.BLOCK = 2  # several blocks per shard
    group = dist.group.WORLD
    per_rank = 16 // world_size
    start = rank * per_rank
    logits, labels, grad = problem(9, 16, seed=5)
    labels = labels.clamp(max=10).masked_fill(labels == IGNORE_INDEX, IGNORE_INDEX)
    logits[:, 11:] = 40.0
    results = {}
    for kernel_mode in ("torch", "triton"):
        for dtype in (torch.float32, torch.bfloat16):
            leaf = logits[:, start:start + per_rank].to(dtype).requires_grad_()
            losses = vocab_parallel_cross_entropy(leaf, labels, group, start, 11, 1e-2, kernels=kernel_mode)
            losses.backward(grad.float())
            results[kernel_mode, dtype] = (losses.detach().double().numpy(), leaf.grad.double().numpy())  # by value
    return results


@pytest.mark.slow
@pytest.mark.interpreter
def test_sharded_cross_entropy_in_a_four_rank_world():
    logits, labels, grad = problem(9, 16, seed=5)
    labels = labels.clamp(max=10).masked_fill(labels == IGNORE_INDEX, IGNORE_INDEX)
    logits[:, 11:] = 40.0
    leaf = logits.clone().requires_grad_()
    expected_losses = reference_losses(leaf, labels, 11, 1e-2)
    expected_losses.backward(grad)
    results = [{key: tuple(torch.from_numpy(a) for a in value) for key, value in r.items()}
               for r in run_world(4, check_sharded)]
    for key in results[0]:
        tolerance = 1e-5 if key[1] == torch.float32 else 3e-2
        losses = results[0][key][0]
        assert all(torch.equal(r[key][0], losses) for r in results), key  # every rank has the whole loss
        torch.testing.assert_close(losses, expected_losses, rtol=tolerance, atol=tolerance)
        grads = torch.cat([r[key][1] for r in results], dim=1)
        torch.testing.assert_close(grads, leaf.grad, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2])
def test_inplace_torch_path_equals_the_copying_one_and_reuses_the_logits(z_loss_weight, one_thread):
    """inplace=True (the model's own logits): same losses and grads, bitwise; the grad is the logits' storage."""
    logits, labels, grad = problem(6, 50, seed=3)
    logits[:, 45:] = 40.0
    results = []
    for inplace in (False, True):
        produced = logits.float().requires_grad_()
        private = produced * 1.0  # a non-leaf nothing else reads, as the output layer's logits
        storage = private.data_ptr()
        losses = vocab_parallel_cross_entropy(private, labels, None, 0, 45, z_loss_weight, inplace=inplace,
                                              kernels="torch")
        seen = []
        private.register_hook(lambda g: seen.append(g.data_ptr()))
        losses.backward(grad.float())
        results.append((losses.detach(), produced.grad))
        assert (seen[0] == storage) == inplace
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


def test_inplace_torch_path_refuses_logits_another_op_saved(one_thread):
    """Were the logits saved for another backward, autograd stops loudly instead of using clobbered values."""
    logits = torch.randn(4, 9, requires_grad=True)
    private = logits * 1.0
    other = private.sin()  # saves `private` for its backward
    losses = vocab_parallel_cross_entropy(private, torch.arange(4), None, 0, inplace=True, kernels="torch")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (losses.sum() + other.sum()).backward()


@pytest.mark.parametrize("z_loss_weight, real_vocab", [(0.0, 45), (1e-2, 45), (0.0, 50)])
def test_inplace_pass_with_padding_and_an_ignored_token(z_loss_weight, real_vocab, one_thread):
    """inplace=True (the model's own logits): with and without vocabulary padding and with an ignored
    token, the grad is written over the logits, zero on the padding and the ignored row, and the
    losses match float64."""
    logits, labels, grad = problem(6, 50, seed=5, ignored=1)
    labels = torch.where(labels >= real_vocab, labels - 10, labels)  # ids below the real vocabulary
    labels[2] = IGNORE_INDEX
    produced = logits.float().requires_grad_()
    private = produced * 1.0
    storage = private.data_ptr()
    losses = vocab_parallel_cross_entropy(private, labels, None, 0, real_vocab, z_loss_weight, inplace=True,
                                          kernels="torch")
    seen = []
    private.register_hook(lambda g: seen.append(g.data_ptr()))
    losses.backward(grad.float())
    assert seen == [storage]
    assert produced.grad[:, real_vocab:].count_nonzero() == 0 and produced.grad[2].count_nonzero() == 0
    expected = reference_losses(logits, labels, real_vocab, z_loss_weight)
    torch.testing.assert_close(losses.detach().double(), expected, rtol=1e-5, atol=1e-5)
