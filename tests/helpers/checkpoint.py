"""Shared by the checkpoint tests: a small model config, an AdamW with megalite's optimizer
checkpoint API, a few training steps, and saves as one rank or as several."""

import threading

import torch

from megalite.checkpoint import (Piece, begin_save, checkpoint_dir, finalize_save, save_checkpoint,
                                 write_rank_files)
from megalite.config import ModelConfig
from tests.helpers.model import token_losses


def small_config(**overrides) -> ModelConfig:
    values = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
                  hidden_dropout=0.0, attention_dropout=0.0)
    values.update(overrides)
    return ModelConfig.of(**values).validate()


class FakeAdamW:
    """AdamW on fp32 main params, written without torch.optim, with megalite's optimizer checkpoint API.

    state_dict() -> {"tensors": {"<param>.main_param" | ".exp_avg" | ".exp_avg_sq": Tensor},
    "meta": {"step", "lr"}}; load_state_dict takes the same and copies main params into the model.
    """

    def __init__(self, model, lr=1e-2, betas=(0.9, 0.95), eps=1e-8):
        self.params = dict(model.named_parameters())
        self.lr, self.betas, self.eps, self.step_count = lr, betas, eps, 0
        self.main = {name: p.detach().float().clone() for name, p in self.params.items()}
        self.exp_avg = {name: torch.zeros_like(main) for name, main in self.main.items()}
        self.exp_avg_sq = {name: torch.zeros_like(main) for name, main in self.main.items()}

    def step(self):
        self.step_count += 1
        beta1, beta2 = self.betas
        for name, param in self.params.items():
            grad = param.grad.float()
            self.exp_avg[name].mul_(beta1).add_(grad, alpha=1 - beta1)
            self.exp_avg_sq[name].mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            m_hat = self.exp_avg[name] / (1 - beta1 ** self.step_count)
            v_hat = self.exp_avg_sq[name] / (1 - beta2 ** self.step_count)
            self.main[name].add_(-self.lr * m_hat / (v_hat.sqrt() + self.eps))
        self._copy_to_model()

    def _copy_to_model(self):
        with torch.no_grad():
            for name, param in self.params.items():
                param.copy_(self.main[name])

    def state_dict(self):
        tensors = {}
        for name in self.params:
            tensors[f"{name}.main_param"] = self.main[name]
            tensors[f"{name}.exp_avg"] = self.exp_avg[name]
            tensors[f"{name}.exp_avg_sq"] = self.exp_avg_sq[name]
        return {"tensors": tensors, "meta": {"step": self.step_count, "lr": self.lr}}

    def load_state_dict(self, state):
        tensors = state["tensors"]
        for name in self.params:
            self.main[name].copy_(tensors[f"{name}.main_param"])
            self.exp_avg[name].copy_(tensors[f"{name}.exp_avg"])
            self.exp_avg_sq[name].copy_(tensors[f"{name}.exp_avg_sq"])
        self.step_count = state["meta"]["step"]
        self._copy_to_model()


class ShardedOptimizer:
    """A ZeRO-like optimizer state: rank r of 2 holds rows [3r, 3r+3) of a [6, 4] moment, as a Piece."""

    def __init__(self, rank, values=None):
        self.rank = rank
        self.shard = torch.zeros(3, 4) if values is None else values[3 * rank:3 * rank + 3].clone()

    def state_dict(self):
        return {"tensors": {"w.exp_avg": Piece(self.shard, (6, 4), (3 * self.rank, 0))}, "meta": {"step": 1}}

    def load_state_dict(self, state):
        piece = state["tensors"]["w.exp_avg"]
        assert isinstance(piece, Piece) and piece.offsets == (3 * self.rank, 0)
        self.shard.copy_(piece.tensor)


class WholeOptimizer:
    """The same state unsharded, as one process holds it."""

    def __init__(self, values=None):
        self.moment = torch.zeros(6, 4) if values is None else values.clone()

    def state_dict(self):
        return {"tensors": {"w.exp_avg": self.moment}, "meta": {"step": 1}}

    def load_state_dict(self, state):
        self.moment.copy_(state["tensors"]["w.exp_avg"])


def train(model, optimizer, first_step, steps):
    """`steps` AdamW steps on fixed per-step batches; returns the losses (dropout draws the global RNG)."""
    losses = []
    for step in range(first_step, first_step + steps):
        tokens = torch.randint(0, model.config.vocab_size, (2, model.config.seq_length),
                               generator=torch.Generator().manual_seed(step))
        loss = token_losses(model, tokens, tokens.roll(-1, dims=1)).mean()
        model.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def assert_same_tensors(first: dict, second: dict):
    assert first.keys() == second.keys()
    for name in first:
        assert first[name].dtype == second[name].dtype, name
        assert torch.equal(first[name], second[name]), name


def save(path, iteration, model, optimizer=None, config=None, **kwargs):
    kwargs.setdefault("consumed_samples", iteration * 4)
    return save_checkpoint(str(path), iteration, model, optimizer, model_config=config or model.config, **kwargs)


def save_pieces(save_dir, iteration, pieces_per_rank: list[dict]):
    """Save as if each entry of `pieces_per_rank` were one rank's model pieces."""
    staging = begin_save(str(save_dir), iteration)
    reports = [write_rank_files(staging, rank, pieces) for rank, pieces in enumerate(pieces_per_rank)]
    finalize_save(str(save_dir), iteration, {"iteration": iteration, "model_config": {}, "extra": {}}, reports)
    return checkpoint_dir(str(save_dir), iteration)


def run_ranks(world_size, rank_main):
    """Run `rank_main(world)` on `world_size` threads, as ranks of one save; re-raise errors. `world`:
    `save_checkpoint`'s `rank`, `failed_ranks` (this rank's own failure, after a barrier) and `gather`
    (every rank's report on rank 0)."""
    barrier = threading.Barrier(world_size)
    reports, errors = [None] * world_size, []

    def gatherer(rank):
        def gather(report):
            reports[rank] = report
            barrier.wait()
            gathered = list(reports) if rank == 0 else None
            barrier.wait()  # no rank overwrites its report before rank 0 has copied them
            return gathered
        return gather

    def own_failures(rank):
        def failed_ranks(ok):
            if ok:  # a failed rank raises at once; the others must not wait for it at the barrier
                barrier.wait()
            return [] if ok else [rank]
        return failed_ranks

    def guarded(rank):
        try:
            rank_main({"rank": rank, "failed_ranks": own_failures(rank), "gather": gatherer(rank)})
        except Exception as error:  # surfaced below; a dead thread would otherwise hang the others
            errors.append(error)
            barrier.abort()

    threads = [threading.Thread(target=guarded, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
