"""Sampling a continuation from a model: temperature, top-k and top-p (nucleus) filtering."""

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Sampling:
    """How a continuation is sampled, tools/generate.py's defaults and pretrain_gpt.py's closing sample's alike.
    Top-k and top-p cut the unlikely tail that makes a small model's samples read as noise."""

    max_new_tokens: int = 64
    temperature: float = 0.8  # 0: greedy
    top_k: int = 40  # 0: no top-k filter
    top_p: float = 0.95  # 1.0: no nucleus filter
    seed: int = 1234

    def describe(self) -> str:
        return f"temperature {self.temperature:g}, top-k {self.top_k}, top-p {self.top_p:g}, seed {self.seed}"


SAMPLING = Sampling()


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Set to -inf every logit outside the top-k and outside the top-p probability mass: the smallest set of
    most likely tokens whose probability reaches top_p (at least one). logits: [vocab] fp32."""
    logits = logits.clone()
    if 0 < top_k < logits.numel():
        threshold = torch.topk(logits, top_k).values[-1]
        logits[logits < threshold] = float("-inf")
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        drop = (probs.cumsum(dim=-1) - probs) >= top_p  # the mass before the token already reaches top_p
        logits[order[drop]] = float("-inf")
    return logits


@torch.no_grad()
def generate(model, tokens: list[int], max_new_tokens: int = SAMPLING.max_new_tokens,
             temperature: float = SAMPLING.temperature, top_k: int = SAMPLING.top_k, top_p: float = SAMPLING.top_p,
             eod: int | None = None, generator: torch.Generator | None = None) -> list[int]:
    """`tokens` followed by up to `max_new_tokens` sampled ids (stops after `eod`); temperature 0 is greedy.
    The context is the last `seq_length` tokens, without a KV cache: this checks a run, it serves none."""
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    seq_length = model.config.seq_length
    out = list(tokens)
    for _ in range(max_new_tokens):
        context = torch.tensor([out[-seq_length:]], device=device)
        logits = model.logits(model(context))[0, -1].float().cpu()  # [vocab]
        if temperature <= 0:
            next_id = int(logits.argmax())
        else:
            probs = torch.softmax(filter_logits(logits / temperature, top_k, top_p), dim=-1)
            next_id = int(torch.multinomial(probs, 1, generator=generator))
        out.append(next_id)
        if next_id == eod:
            break
    model.train(was_training)
    return out
