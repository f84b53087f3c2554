"""GradBuffer: layout, fp32 accumulation over micro-batches, tied parameters, hooks."""

import copy

import pytest
import torch
from torch import nn

from megalite.config import ModelConfig
from megalite.data_parallel.grad_buffer import GradBuffer
from megalite.model.gpt import GPTModel
from tests.helpers.model import token_losses


def tiny_gpt2(seed: int = 0) -> GPTModel:
    """A 1-layer GPT-2-style model with tied embeddings (the word embedding is used twice)."""
    config = ModelConfig.of(num_layers=1, hidden_size=16, num_attention_heads=2, seq_length=8,
                            vocab_size=32, openai_gelu=True, hidden_dropout=0.0, attention_dropout=0.0).validate()
    return GPTModel(config, seed=seed)


def micro_batch(seed: int, vocab: int = 32, b: int = 2, s: int = 8):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (b, s), generator=generator)
    return tokens, tokens.roll(-1, dims=1)


def loss_of(model, seed: int) -> torch.Tensor:
    tokens, labels = micro_batch(seed)
    return token_losses(model, tokens, labels).mean()


def test_layout_is_reverse_registration_order_contiguous_and_padded_to_the_shard_count():
    a, b, c = (nn.Parameter(torch.randn(shape)) for shape in ((3, 2), (5,), (1, 4)))
    buffer = GradBuffer([[a, b, c]], shard_count=8)
    assert buffer.params == [c, b, a]
    assert buffer.offsets[c] == (0, 4) and buffer.offsets[b] == (4, 5) and buffer.offsets[a] == (9, 6)
    assert buffer.numel == 15 and buffer.data.shape == (16,) and buffer.data.dtype == torch.float32
    for param in (a, b, c):
        start, numel = buffer.offsets[param]
        assert param.main_grad.shape == param.shape
        assert param.main_grad.data_ptr() == buffer.data[start:].data_ptr()  # a view, not a copy
    a.main_grad.fill_(1.0)
    assert buffer.data[9:15].eq(1).all() and buffer.data[:9].eq(0).all() and buffer.data[15] == 0
    buffer.zero()
    assert buffer.data.eq(0).all()


def test_two_micro_batches_accumulate_to_the_summed_grads_and_free_param_grads():
    model = tiny_gpt2()
    reference = copy.deepcopy(model)
    buffer = GradBuffer([list(model.parameters())])
    for seed in (1, 2):
        loss_of(model, seed).backward()
        loss_of(reference, seed).backward()  # plain autograd: .grad sums the micro-batches
    named_reference = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        assert param.grad is None, name
        assert torch.equal(param.main_grad, named_reference[name].grad), name
        assert param.main_grad.abs().sum() > 0, name  # every parameter really got a gradient


def test_a_tied_parameter_appears_once_and_gets_both_uses():
    model = tiny_gpt2()
    tied = model.embedding.word_embeddings.weight
    buffer = GradBuffer([list(model.parameters()) + [tied]])  # even listed twice
    assert sum(param is tied for param in buffer.params) == 1
    assert buffer.numel == sum(param.numel() for param in model.parameters())

    embedding = nn.Embedding(5, 3)
    GradBuffer([list(embedding.parameters())])
    ids = torch.tensor([0, 2, 2, 4])
    weight = embedding.weight

    def loss(input_use: torch.Tensor, output_use: torch.Tensor) -> torch.Tensor:
        logits = nn.functional.embedding(ids, input_use) @ output_use.t()  # [4, 5]
        return (logits * torch.arange(20.0).view(4, 5)).sum()

    loss(weight, weight).backward()
    input_grad, = torch.autograd.grad(loss(weight, weight.detach()), weight)
    output_grad, = torch.autograd.grad(loss(weight.detach(), weight), weight)
    assert input_grad.abs().sum() > 0 and output_grad.abs().sum() > 0
    assert torch.equal(weight.main_grad, input_grad + output_grad)


def test_bf16_grads_accumulate_in_fp32():
    weight = nn.Parameter(torch.ones(2, dtype=torch.bfloat16))
    buffer = GradBuffer([[weight]])
    # bf16 keeps 8 significant bits: 1 + 2**-10 rounds to 1 in bf16 but not in fp32.
    for coefficients in ([1.0, 1.0], [2.0 ** -10, 3.0]):
        (weight * torch.tensor(coefficients, dtype=torch.bfloat16)).sum().backward()
    assert weight.grad is None
    assert buffer.data.dtype == torch.float32
    assert weight.main_grad.tolist() == [1.0 + 2.0 ** -10, 4.0]
    bf16_sum = torch.tensor(1.0, dtype=torch.bfloat16) + torch.tensor(2.0 ** -10, dtype=torch.bfloat16)
    assert float(bf16_sum) == 1.0  # what accumulating in the param's dtype would have lost


def test_frozen_parameters_and_bad_padding_are_refused():
    with pytest.raises(ValueError, match="trainable"):
        GradBuffer([[nn.Parameter(torch.ones(2), requires_grad=False)]])
    with pytest.raises(ValueError, match="shard_count"):
        GradBuffer([[nn.Parameter(torch.ones(2))]], shard_count=0)


def test_buckets_close_at_parameter_boundaries_per_chunk_and_pad_to_equal_shards():
    first = [nn.Parameter(torch.randn(shape)) for shape in ((3, 2), (5,), (1, 4))]  # 6, 5, 4 elements
    second = [nn.Parameter(torch.randn(7))]
    buffer = GradBuffer([first, second], bucket_size=8, shard_count=4)
    # chunk 1 in backward order: [4 + 5] closes a bucket at 9 -> padded to 12; [6] -> 8; chunk 2: [7] -> 8
    assert [(b.start, b.end) for b in buffer.buckets] == [(0, 12), (12, 20), (20, 28)]
    assert [b.params for b in buffer.buckets] == [[first[2], first[1]], [first[0]], [second[0]]]
    assert buffer.offsets[second[0]] == (20, 7) and buffer.data.numel() == 28
    assert buffer.buckets[0].shard(1, 4) == (3, 6) and buffer.buckets[2].shard(3, 4) == (26, 28)
    assert buffer.bucket_of[first[0]] is buffer.buckets[1]
