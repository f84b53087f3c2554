"""Without a TP group (or TP=1) every collective is the identity and cross-entropy is plain.
(With 2 and 4 ranks: test_tp_worlds.py.)"""

import torch
import torch.nn.functional as F

from megalite.tensor_parallel import comm
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy


def test_collectives_are_identities_without_a_group():
    x = torch.randn(4, 2, 6, requires_grad=True)
    for function in (comm.copy_to_tensor_parallel_region, comm.reduce_from_tensor_parallel_region,
                     comm.gather_from_tensor_parallel_region, comm.scatter_to_sequence_parallel_region,
                     comm.gather_from_sequence_parallel_region, comm.reduce_scatter_to_sequence_parallel_region):
        assert function(x, None) is x
    parameter = torch.nn.Parameter(torch.zeros(2))
    parameter.sequence_parallel, parameter.grad = True, torch.ones(2)
    comm.allreduce_sequence_parallel_grads([parameter], None)
    assert parameter.grad.eq(1).all()


def test_cross_entropy_of_one_shard_equals_f_cross_entropy_without_padding_logits():
    logits = torch.randn(5, 3, 12) * 4
    logits[..., 10:] = 100.0  # padding columns: ignored whatever their value
    labels = torch.randint(0, 10, (5, 3))
    grad = torch.rand(5, 3)
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
        ours = logits.to(dtype).clone().requires_grad_()
        reference = logits.to(dtype).clone().requires_grad_()
        losses = vocab_parallel_cross_entropy(ours, labels, None, 0, real_vocab_size=10)
        expected = F.cross_entropy(reference[..., :10].float().flatten(0, 1), labels.flatten(),
                                   reduction="none").view(5, 3)
        torch.testing.assert_close(losses, expected, rtol=tolerance, atol=tolerance)
        losses.backward(grad)
        expected.backward(grad)
        assert ours.grad.dtype == dtype and ours.grad[..., 10:].eq(0).all()
        torch.testing.assert_close(ours.grad.float(), reference.grad.float(), rtol=tolerance, atol=tolerance)
