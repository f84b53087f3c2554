"""The single-process training loop: global batches of micro-batches, AdamW, eval, sample.

First step of the training issue: one process, fp32, no checkpoints yet. The loss of
an iteration is the mean over every unmasked token of the global batch, so gradient
accumulation over micro-batches changes no arithmetic.
"""

import math
import time

import torch

from megalite.data.loader import next_global_batch


def lr_at(iteration: int, lr: float, min_lr: float, warmup_iters: int, decay_iters: int) -> float:
    """Linear warmup to `lr`, then cosine decay to `min_lr` at `decay_iters`."""
    if iteration < warmup_iters:
        return lr * (iteration + 1) / warmup_iters
    progress = min(1.0, (iteration - warmup_iters) / max(1, decay_iters - warmup_iters))
    return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))


def build_optimizer(model, lr: float, weight_decay: float, betas=(0.9, 0.95), eps: float = 1e-8):
    """AdamW; weight decay only on matrices (not on norm weights and biases)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=True)


def global_batch_loss(model, micro_batches, backward: bool) -> float:
    """Mean loss over the global batch's unmasked tokens; accumulates grads when `backward`."""
    total_tokens = sum(float(mb["loss_mask"].sum()) for mb in micro_batches)
    total_loss = 0.0
    for mb in micro_batches:
        losses = model(mb["tokens"], mb["position_ids"], mb["labels"], mb["loss_mask"])  # [b, s]
        loss = losses.sum() / total_tokens
        if backward:
            loss.backward()
        total_loss += float(loss.detach())
    return total_loss


@torch.no_grad()
def evaluate(model, micro_batch_iterator, num_microbatches: int, eval_iters: int) -> float:
    model.eval()
    losses = [global_batch_loss(model, next_global_batch(micro_batch_iterator, num_microbatches), False)
              for _ in range(eval_iters)]
    model.train()
    return sum(losses) / len(losses)


@torch.no_grad()
def generate(model, tokens: list[int], max_new_tokens: int, temperature: float = 0.8, top_k: int = 40,
             generator: torch.Generator | None = None) -> list[int]:
    """Sample a continuation of `tokens` (no KV cache: the model is small)."""
    model.eval()
    seq_length = model.config.seq_length
    out = list(tokens)
    for _ in range(max_new_tokens):
        context = torch.tensor([out[-seq_length:]])
        logits = model(context)[0, -1].float() / max(temperature, 1e-5)  # [vocab]
        top = torch.topk(logits, min(top_k, logits.numel()))
        probs = torch.softmax(top.values, dim=-1)
        out.append(int(top.indices[torch.multinomial(probs, 1, generator=generator)]))
    model.train()
    return out


def train(model, optimizer, args, train_iterator, valid_iterator, num_microbatches: int, log=print):
    """Run `args.train_iters` iterations; returns the list of per-iteration losses."""
    tokens_per_iter = args.global_batch_size * args.seq_length
    losses = []
    for iteration in range(args.train_iters):
        start = time.perf_counter()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(iteration, args.lr, args.min_lr, args.lr_warmup_iters, args.train_iters)
        optimizer.zero_grad(set_to_none=True)
        loss = global_batch_loss(model, next_global_batch(train_iterator, num_microbatches), True)
        grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad))
        optimizer.step()
        losses.append(loss)
        elapsed = time.perf_counter() - start
        if (iteration + 1) % args.log_interval == 0 or iteration == 0:
            log(f" iteration {iteration + 1:6d}/{args.train_iters} | consumed samples: "
                f"{(iteration + 1) * args.global_batch_size:9d} | elapsed time per iteration (ms): "
                f"{elapsed * 1000:.1f} | tokens/s: {tokens_per_iter / elapsed:.0f} | learning rate: "
                f"{optimizer.param_groups[0]['lr']:.3e} | global batch size: {args.global_batch_size} | "
                f"lm loss: {loss:.4f} | grad norm: {grad_norm:.3f}")
        if valid_iterator is not None and args.eval_interval and (iteration + 1) % args.eval_interval == 0:
            valid_loss = evaluate(model, valid_iterator, num_microbatches, args.eval_iters)
            log(f" validation loss at iteration {iteration + 1} | lm loss: {valid_loss:.4f} | "
                f"lm loss PPL: {math.exp(min(valid_loss, 50)):.2f}")
    return losses
