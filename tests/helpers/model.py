"""A built model's logits and losses on tokens in one call: its forward, then `GPTModel.logits` or the
language-model loss that the schedule applies (model/loss.py)."""

import torch

from megalite.model.loss import LanguageModelLoss


def logits(model, tokens: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
    """Logits `[b, s, real_vocab]` of token ids `[b, s]`."""
    return model.logits(model(tokens, position_ids))


def token_losses(model, tokens: torch.Tensor, labels: torch.Tensor, loss_mask: torch.Tensor | None = None,
                 position_ids: torch.Tensor | None = None, hidden_states: torch.Tensor | None = None) -> torch.Tensor:
    """Per-token fp32 losses `[b, s]` (times loss_mask) of the last stage `model` on tokens (or on the previous
    stage's hidden_states `[s, b, h]`)."""
    hidden = model(tokens, position_ids, hidden_states=hidden_states)
    return LanguageModelLoss.of(model)(model, hidden, labels, loss_mask)
