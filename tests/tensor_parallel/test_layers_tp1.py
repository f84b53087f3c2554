"""The parallel layers at TP=1 equal nn.Linear / nn.Embedding; the init helpers are layout-free."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from megalite.parallel_state import ONE_PROCESS
from megalite.tensor_parallel.layers import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                             init_full_tensor, initialize, shard_full_tensor, tensor_parallel_group)


def check_against_linear(layer, x):
    """Output, input grad, weight grad and bias grad equal nn.Linear with the same weights."""
    reference = torch.nn.Linear(layer.input_size, layer.output_size, bias=layer.bias is not None)
    with torch.no_grad():
        reference.weight.copy_(layer.weight)
        if layer.bias is not None:
            reference.bias.copy_(layer.bias)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    out, expected = layer(x1), reference(x2)
    torch.testing.assert_close(out, expected, atol=0, rtol=0)
    grad = torch.randn_like(out)
    out.backward(grad)
    expected.backward(grad)
    torch.testing.assert_close(x1.grad, x2.grad, atol=0, rtol=0)
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad, atol=0, rtol=0)
    if layer.bias is not None:
        torch.testing.assert_close(layer.bias.grad, reference.bias.grad, atol=0, rtol=0)


@pytest.mark.parametrize("bias", [True, False])
def test_column_and_row_parallel_linear_equal_nn_linear(bias):
    x = torch.randn(5, 3, 8)
    for layer in (ColumnParallelLinear(8, 12, bias=bias), RowParallelLinear(8, 12, bias=bias)):
        initialize(layer, seed=0, prefix="layer")
        if bias:
            with torch.no_grad():
                layer.bias.normal_()
        assert layer.weight.shape == (12, 8)  # nn.Linear's [out, in]
        check_against_linear(layer, x)


def test_column_parallel_linear_takes_an_external_weight():
    layer = ColumnParallelLinear(8, 12, bias=False, skip_weight_param=True)
    assert layer.weight is None and not list(layer.parameters())
    weight, x = torch.randn(12, 8), torch.randn(4, 8)
    torch.testing.assert_close(layer(x, weight), x @ weight.t())


def test_vocab_parallel_embedding_equals_f_embedding():
    layer = VocabParallelEmbedding(10, 4, init_std=1.0)
    initialize(layer, seed=0, prefix="emb")
    ids = torch.tensor([[0, 9, 3], [3, 3, 1]])
    out = layer(ids)
    torch.testing.assert_close(out, F.embedding(ids, layer.weight.detach()), atol=0, rtol=0)
    out.sum().backward()
    assert layer.weight.grad[3].eq(3).all() and layer.weight.grad[2].eq(0).all()


def test_init_full_tensor_is_a_function_of_seed_name_and_shape_only():
    a = init_full_tensor((6, 4), 0.02, 1234, "layers.0.mlp.linear_fc1.weight")
    torch.manual_seed(999)  # the global RNG plays no part
    b = init_full_tensor((6, 4), 0.02, 1234, "layers.0.mlp.linear_fc1.weight")
    assert torch.equal(a, b) and a.dtype == torch.float32
    assert not torch.equal(a, init_full_tensor((6, 4), 0.02, 1235, "layers.0.mlp.linear_fc1.weight"))
    assert not torch.equal(a, init_full_tensor((6, 4), 0.02, 1234, "layers.1.mlp.linear_fc1.weight"))
    # The seed comes from sha256, not Python's salted hash: fixed across processes. The
    # drawn values are pinned, so a change of the seed or of torch's sampler shows up here.
    torch.testing.assert_close(init_full_tensor((2, 3), 1.0, 1234, "x"), torch.tensor(
        [[1.7327677011489868, -0.380985289812088, -1.5173431634902954],
         [-1.4285054206848145, -1.4973044395446777, 1.1427996158599854]]), atol=0, rtol=0)


def test_padding_rows_are_zero_and_do_not_change_the_drawn_rows():
    unpadded = init_full_tensor((10, 4), 1.0, 7, "w")
    padded = init_full_tensor((16, 4), 1.0, 7, "w", real_rows=10)
    assert torch.equal(padded[:10], unpadded) and padded[10:].eq(0).all()


def test_shards_reassemble_the_full_tensor():
    full = torch.arange(48.0).view(8, 6)
    shards = [shard_full_tensor(full, 0, rank, 4) for rank in range(4)]
    assert torch.equal(torch.cat(shards), full)
    columns = [shard_full_tensor(full, 1, rank, 2) for rank in range(2)]
    assert torch.equal(torch.cat(columns, dim=1), full)
    # Two blocks (SwiGLU's [gate; up]): each rank holds its gate rows then its up rows.
    gate_up = [shard_full_tensor(full, 0, rank, 2, chunks=2) for rank in range(2)]
    assert torch.equal(gate_up[0], full[[0, 1, 4, 5]]) and torch.equal(gate_up[1], full[[2, 3, 6, 7]])


def test_parallel_state_accessors_and_size_checks():
    assert tensor_parallel_group(ONE_PROCESS) is None and not ONE_PROCESS.sequence_parallel
    assert ONE_PROCESS.tp_size == ONE_PROCESS.pp_size == ONE_PROCESS.dp_size == ONE_PROCESS.world_size == 1
    two = SimpleNamespace(tp_rank=1, tp_size=2, tp_group=None, sequence_parallel=True)
    with pytest.raises(ValueError, match="tensor-parallel size 2 needs a process group"):
        tensor_parallel_group(two)
    # Sizes that do not divide are refused when the layer is built (no collective runs then).
    four = SimpleNamespace(tp_rank=0, tp_size=4, tp_group=object(), sequence_parallel=False)
    with pytest.raises(ValueError, match="output size 10 is not divisible by the tensor-parallel size 4"):
        ColumnParallelLinear(8, 10, parallel=four)
    with pytest.raises(ValueError, match="output size 12 .2 equal blocks. is not divisible"):
        ColumnParallelLinear(8, 12, output_chunks=2, parallel=four)
    with pytest.raises(ValueError, match="input size 6 is not divisible"):
        RowParallelLinear(6, 8, parallel=four)
    with pytest.raises(ValueError, match="vocabulary size 10 is not divisible"):
        VocabParallelEmbedding(10, 8, parallel=four)
