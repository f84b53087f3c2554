"""Gradient-accumulation fusion: the linear layers' weight grads added into the fp32 buffer by their backward."""

import copy

import pytest
import torch

from megalite.data_parallel.grad_buffer import GradBuffer
from megalite.kernels.gemm import add_product, mixed_gemm
from megalite.model.gpt import GPTModel
from megalite.model.options import apply_options
from megalite.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from tests.helpers.configs import gpt2_config, llama_config
from tests.helpers.model import token_losses

# An untied output layer; a tied one and biases; the output layer and loss fused (its weight grad fused too).
MODELS = {"llama": llama_config, "gpt": gpt2_config,
          "llama-fused-ce": lambda: llama_config(fused_output_cross_entropy=True),
          "gpt-fused-ce": lambda: gpt2_config(fused_output_cross_entropy=True)}


def micro_batch(seed: int, vocab: int = 256, b: int = 2, s: int = 16):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s), generator=generator)
    return tokens, tokens.roll(-1, dims=1)


def linear_weights(model) -> set:
    """The weights whose grads the fusion adds: the linears' own (the untied output layer's too, whatever the loss)."""
    return {id(module.weight) for module in model.modules()
            if isinstance(module, (ColumnParallelLinear, RowParallelLinear)) and module.weight is not None}


def train_micro_batches(model, dtype: torch.dtype, fuse: bool, sharded: bool = False):
    """Two micro-batches' backwards into a grad buffer over `model` (in `dtype`). Returns (the buffer, per parameter
    the autograd grads its hooks saw, how often each was reported ready)."""
    model = model.to(dtype)
    seen: dict[str, list] = {name: [] for name, _ in model.named_parameters()}
    for name, param in model.named_parameters():  # registered before the buffer's hook, which frees the grad
        param.register_post_accumulate_grad_hook(lambda p, name=name: seen[name].append(p.grad is not None))
    buffer = GradBuffer([list(model.parameters())], bucket_size=5000, sharded=sharded, fuse_weight_grads=fuse)
    ready: dict[int, int] = {}
    buffer.on_grad_ready = lambda param: ready.__setitem__(id(param), ready.get(id(param), 0) + 1)
    for seed in (1, 2):
        tokens, labels = micro_batch(seed)
        token_losses(model, tokens, labels).mean().backward()
    return buffer, seen, ready


@pytest.mark.parametrize("name,recompute", [("llama", None), ("gpt", None), ("llama", "full"),
                                            ("llama-fused-ce", None), ("gpt-fused-ce", None)])
def test_fused_weight_grads_equal_autograd_grads_summed_over_micro_batches(name, recompute):
    """Under recomputation the backward's saved weight is a recomputed alias: the fusion must still find the
    buffer."""
    model = GPTModel(MODELS[name](), seed=3)
    reference = copy.deepcopy(model)
    apply_options(model, recompute_granularity=recompute)
    buffer, seen, ready = train_micro_batches(model, torch.float32, fuse=True)
    for seed in (1, 2):
        tokens, labels = micro_batch(seed)
        token_losses(reference, tokens, labels).mean().backward()
    fused = linear_weights(model)
    expected = dict(reference.named_parameters())
    assert len(fused) >= 4 * model.config.num_layers  # qkv, proj, fc1, fc2 of every layer at least
    for param_name, param in model.named_parameters():
        assert param.grad is None, param_name
        torch.testing.assert_close(param.main_grad, expected[param_name].grad, rtol=1e-5, atol=1e-7)
        assert param.main_grad.abs().sum() > 0, param_name
        assert ready[id(param)] == 2, param_name  # once per backward, fused or not
        # The fused weights never hold an autograd grad; every other parameter does (the tied embedding too).
        assert seen[param_name] == ([False, False] if id(param) in fused else [True, True]), param_name


@pytest.mark.parametrize("sharded", [False, True], ids=["whole", "sharded"])
def test_fusion_changes_nothing_but_rounding_in_bf16_and_fp32(sharded):
    """bf16 on a CPU (no mixed-dtype GEMM): the product rounded to bf16 as autograd's is, then added, so within
    one bf16 rounding of each micro-batch's product (autograd forms its transpose, which a CPU's GEMM may sum in
    another order); fp32: one addmm instead of mm + add. Sharded buffers (ZeRO-2/3) allocate a bucket before its
    first add."""
    for dtype in (torch.bfloat16, torch.float32):
        fused, _, _ = train_micro_batches(GPTModel(llama_config(), seed=5), dtype, fuse=True, sharded=sharded)
        plain, _, _ = train_micro_batches(GPTModel(llama_config(), seed=5), dtype, fuse=False, sharded=sharded)
        for bucket_fused, bucket_plain in zip(fused.buckets, plain.buckets):
            grads_fused, grads_plain = fused.bucket_grads(bucket_fused), plain.bucket_grads(bucket_plain)
            assert grads_fused.abs().sum() > 0
            if dtype == torch.bfloat16 and mixed_gemm(grads_fused.device) != "addmm":
                torch.testing.assert_close(grads_fused, grads_plain, rtol=2 ** -7, atol=1e-6)
            else:
                torch.testing.assert_close(grads_fused, grads_plain, rtol=1e-5, atol=1e-7)


def test_without_a_buffer_or_without_fusion_a_linear_is_plain_autograd():
    layer = ColumnParallelLinear(8, 6)
    layer.init_weights(seed=0, prefix="layer")
    layer(torch.randn(3, 8)).sum().backward()
    assert layer.weight.grad is not None and layer.bias.grad is not None
    GradBuffer([list(layer.parameters())], fuse_weight_grads=False)
    assert layer.weight.add_to_main_grad is None  # a buffer built again without fusion drops an earlier one's


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("exact", [False, True], ids=["weight-grad", "exact"])
def test_on_cuda_a_16_bit_product_is_added_in_fp32_where_torch_can(dtype, exact):
    """With "addmm" (newer torch) the weight grad is never rounded to 16 bits, nor is an exact sum; else a weight grad
    is the 16-bit product (autograd's rounding) and an exact sum is formed in fp32."""
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=generator).to(dtype) for shape in ((96, 512), (512, 80)))
    accumulator = torch.randn(96, 80, generator=generator)
    on_device = accumulator.cuda()
    add_product(on_device, a.cuda(), b.cuda(), exact=exact)
    way = mixed_gemm(on_device.device)
    print(f"mixed_gemm on this torch: {way}")
    if way == "addmm" or exact:
        expected = accumulator.double() + a.double() @ b.double()
        torch.testing.assert_close(on_device.double().cpu(), expected, rtol=1e-5, atol=1e-4)
    else:
        expected = accumulator + (a.cuda() @ b.cuda()).float().cpu()
        torch.testing.assert_close(on_device.cpu(), expected, rtol=1e-6, atol=1e-6)
