"""The Checkpointer's policy: which checkpoint a run resumes from and how much of it it loads
(--load, --finetune, --no-load-optim, --no-load-rng, another layout), when it saves, and which
old checkpoints it removes."""

import dataclasses
import os

import pytest
import torch

from megalite.arguments import parse_args
from megalite.checkpoint import Checkpointer, read_metadata
from megalite.data_parallel.ddp import ParallelModel
from megalite.data_parallel.optimizer import MixedPrecisionOptimizer
from megalite.errors import UserError
from megalite.model.gpt import build_model
from megalite.parallel_state import build_parallel_state
from megalite.run.lr_schedule import LRSchedule
from megalite.run.training import TrainState
from tests.helpers.model import token_losses

FLAGS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--num-layers", "1",
         "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
         "--global-batch-size", "2", "--train-iters", "20", "--lr-warmup-iters", "2"]


class Run:
    """One process's model, optimizer, LR schedule and Checkpointer for `flags`, with its log lines."""

    def __init__(self, *flags, seed=1, layout=None, dtype=torch.float32):
        self.run = parse_args([*FLAGS, *flags])
        if layout is not None:  # what the saved run record says about the parallel layout
            self.run = dataclasses.replace(self.run, parallel=dataclasses.replace(self.run.parallel, **layout))
        self.model = build_model(self.run.model, seed=seed, dtype=dtype)
        self.ddp = ParallelModel(self.model)
        self.optimizer = MixedPrecisionOptimizer(self.ddp, lr=1e-2)
        self.schedule = LRSchedule(**self.run.train.lr_schedule_settings())
        self.lines = []
        self.checkpointer = Checkpointer(self.run, build_parallel_state(), log=self.lines.append)

    def step(self):
        tokens = torch.randint(0, 99, (2, 16), generator=torch.Generator().manual_seed(0))
        self.optimizer.zero_grad()
        self.ddp.start_iteration(1)
        loss = token_losses(self.model, tokens, tokens.roll(-1, dims=1)).float().mean()
        self.optimizer.scale_loss(loss).backward()
        self.ddp.finish_grad_sync()
        self.optimizer.step(1e-2)

    def save(self, iteration, evaluation_pending=False):
        state = TrainState(iteration=iteration, consumed_train_samples=2 * iteration,
                           consumed_valid_samples=iteration)
        return self.checkpointer.save(state, self.ddp, self.optimizer, self.schedule, evaluation_pending)

    def load(self):
        return self.checkpointer.load(self.ddp, self.optimizer, self.schedule)


def same_weights(first, second) -> bool:
    return all(torch.equal(a, b) for a, b in zip(first.model.state_dict().values(),
                                                  second.model.state_dict().values()))


def iters(folder) -> list[str]:
    return sorted(name for name in os.listdir(folder) if name.startswith("iter_"))


def test_resume_restores_counters_schedule_optimizer_and_names_the_folder(tmp_path):
    saved = Run("--save", str(tmp_path))
    saved.step()
    saved.schedule.lr_at(3)
    path = saved.save(3, evaluation_pending=True)
    assert path == str(tmp_path / "iter_0000003") and saved.checkpointer.last_checkpoint == path
    assert saved.lines[0].startswith(f"saved checkpoint {path} in ")
    assert read_metadata(path)["extra"]["lr_schedule"] == saved.schedule.state_dict()

    resumed = Run("--load", str(tmp_path), seed=2)
    loaded = resumed.load()
    assert (loaded.path, loaded.iteration, loaded.consumed_train_samples, loaded.consumed_valid_samples,
            loaded.evaluation_pending) == (path, 3, 6, 3, True)
    assert (resumed.checkpointer.last_checkpoint, resumed.checkpointer.resumed_from) == (path, 3)
    assert resumed.lines == [f"loaded checkpoint {path} at iteration 3 (6 samples consumed)"]
    assert same_weights(saved, resumed)
    assert resumed.optimizer.state_dict()["meta"]["step"] == 1
    assert resumed.schedule.state_dict() == saved.schedule.state_dict()


def test_load_defaults_to_save_and_a_missing_checkpoint_is_a_start_or_an_error(tmp_path):
    assert Run("--save", str(tmp_path / "new")).load() is None  # no folder yet: a fresh start, quietly
    os.makedirs(tmp_path / "empty")
    empty = Run("--save", str(tmp_path / "empty"))
    assert empty.load() is None and empty.lines == []
    both = Run("--save", str(tmp_path / "empty"), "--load", str(tmp_path / "empty"))
    assert both.load() is None and both.lines == [f"no checkpoint in {tmp_path / 'empty'} yet: starting from scratch"]
    with pytest.raises(UserError, match=r"--load .*other holds no checkpoint .*drop --load"):
        os.makedirs(tmp_path / "other")
        Run("--load", str(tmp_path / "other")).load()

    Run("--save", str(tmp_path)).save(2)
    restarted = Run("--save", str(tmp_path), seed=2)
    assert restarted.load().iteration == 2
    assert restarted.lines[-1].endswith("(--load defaults to --save, which holds it)")


@pytest.mark.parametrize("flag", ["--finetune", "--no-load-optim"])
def test_finetune_and_no_load_optim_restart_the_optimizer_from_the_loaded_weights(tmp_path, flag):
    # bf16: the fp32 main params are copies, which must start from the loaded weights
    saved = Run("--save", str(tmp_path), dtype=torch.bfloat16)
    saved.step()
    saved.save(4)
    other = Run("--load", str(tmp_path), flag, seed=2, dtype=torch.bfloat16)
    loaded = other.load()
    assert same_weights(saved, other)
    assert other.optimizer.state_dict()["meta"]["step"] == 0  # a fresh optimizer ...
    assert all(torch.equal(main, param.detach().float())  # ... on these weights
               for main, param in zip(other.optimizer.main_params, other.optimizer.model_params))
    if flag == "--finetune":  # weights only: the run starts at iteration 0 and never counts as resumed
        assert loaded is None and other.checkpointer.resumed_from is None
        assert other.lines == [f"loaded the model weights of {tmp_path / 'iter_0000004'} iteration 4 (--finetune): "
                               f"starting at iteration 0"]
    else:
        assert loaded.iteration == 4 and other.checkpointer.resumed_from == 4


@pytest.mark.parametrize("case", ["same layout", "--no-load-rng", "another layout", "another CP layout"])
def test_rng_states_load_only_from_the_same_layout_unless_told_not_to(tmp_path, case):
    torch.manual_seed(7)
    layout = {"another layout": {"tensor_model_parallel_size": 2},
              "another CP layout": {"context_parallel_size": 2}}.get(case)  # the same world size and TP
    Run("--save", str(tmp_path), layout=layout).save(1)
    expected = torch.rand(3)
    flags = ["--no-load-rng"] if case == "--no-load-rng" else []
    resumed = Run("--load", str(tmp_path), *flags, seed=2)
    torch.manual_seed(8)
    here = torch.get_rng_state()
    resumed.load()
    if case == "same layout":
        assert torch.equal(torch.rand(3), expected)
    else:
        assert torch.equal(torch.get_rng_state(), here)
    moved = [line for line in resumed.lines if "saved by another layout" in line]
    assert len(moved) == (layout is not None)
    if moved:
        assert f"{next(iter(layout))}=2" in moved[0] and "RNG states are seeded afresh" in moved[0]


def test_save_is_due_at_multiples_of_the_interval_and_only_with_save(tmp_path):
    every = Run("--save", str(tmp_path), "--save-interval", "3").checkpointer
    assert [iteration for iteration in range(1, 10) if every.due(iteration)] == [3, 6, 9]
    assert not any(Run("--save", str(tmp_path)).checkpointer.due(iteration) for iteration in range(1, 10))
    assert Run().save(1) is None and not os.listdir(tmp_path)


def test_every_checkpoint_file_gets_the_permissions_of_the_umask(tmp_path):
    """safetensors' save_file makes its files owner-only (0600); teammates on a shared cluster must be able to
    read and convert a checkpoint as they read its metadata.json (0644 under the usual umask 022)."""
    folder = Run("--save", str(tmp_path)).save(1)
    modes = {name: os.stat(os.path.join(folder, name)).st_mode & 0o777 for name in os.listdir(folder)}
    umask = os.umask(0o022)
    os.umask(umask)
    assert any(name.endswith(".safetensors") for name in modes)
    assert modes == dict.fromkeys(modes, 0o666 & ~umask), modes


def test_retention_keeps_the_newest_the_retained_multiples_and_the_one_resumed_from(tmp_path):
    first = Run("--save", str(tmp_path))
    for iteration in (1, 2):
        first.save(iteration)
    retained = ["--save", str(tmp_path), "--keep-last-n-checkpoints", "2", "--save-retain-interval", "4"]
    resumed = Run(*retained, seed=2)
    assert resumed.load().iteration == 2
    for iteration in range(3, 8):
        resumed.save(iteration)
    assert iters(tmp_path) == ["iter_0000002", "iter_0000004", "iter_0000006", "iter_0000007"]
    assert f"removed old checkpoint {tmp_path / 'iter_0000001'} (--keep-last-n-checkpoints 2)" in resumed.lines
