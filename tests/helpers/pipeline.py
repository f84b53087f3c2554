"""The pipeline worlds' model and batch, shared with the tests that compare against them: a
4-layer LLaMA-style config, one seeded global batch of micro-batches, and grads by global name."""

import torch

from megalite.checkpoint import tensor_parallel_pieces
from megalite.config import ModelConfig

SEQ, MICRO, MICRO_BATCHES = 8, 2, 4


def config(tied: bool) -> ModelConfig:
    return ModelConfig.of(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2,
                          ffn_hidden_size=64, seq_length=SEQ, vocab_size=128, tokenizer_vocab_size=100,
                          untie_embeddings_and_output_weights=not tied, swiglu=True, normalization="RMSNorm",
                          position_embedding_type="rope", add_bias_linear=False, hidden_dropout=0.0,
                          attention_dropout=0.0)


def micro_batches() -> list[dict]:
    generator = torch.Generator().manual_seed(3)
    batches = []
    for _ in range(MICRO_BATCHES):
        tokens = torch.randint(0, 100, (MICRO, SEQ + 1), generator=generator)
        mask = (torch.rand(MICRO, SEQ, generator=generator) > 0.2).float()
        batches.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask,
                        "position_ids": torch.arange(SEQ).expand(MICRO, SEQ)})
    return batches


def full_grads(model, parallel) -> dict[str, torch.Tensor]:
    """Each parameter's grad by global name; TP shards gathered back into the full tensor."""
    grads = {}
    for name, param in model.named_parameters():
        grad = param.grad if param.grad is not None else torch.zeros_like(param)
        if parallel.tp_size > 1 and getattr(param, "tensor_model_parallel", False):
            parts = [torch.empty_like(grad) for _ in range(parallel.tp_size)]
            torch.distributed.all_gather(parts, grad.contiguous(), group=parallel.tp_group)
            full = None
            for rank, part in enumerate(parts):
                for piece in tensor_parallel_pieces(part, param, rank, parallel.tp_size):
                    full = torch.zeros(piece.global_shape) if full is None else full
                    full[tuple(slice(o, o + n) for o, n in zip(piece.offsets, piece.tensor.shape))] = piece.tensor
            grad = full
        grads[name] = grad.clone()
    return grads
