"""What the training loop does around its steps besides training, as Megatron's loop does it: manual garbage
collection (--manual-gc), returning the CUDA allocator's cache (--empty-unused-memory-level) and a PyTorch
profiler trace of chosen iterations (--profile); docs/training.md says when each acts, and why."""

import gc
import os

import torch

from megalite.config import TrainConfig
from megalite.errors import UserError


class ManualGC:
    """--manual-gc: Python's automatic collector off while the loop runs, collecting at fixed points instead.
    Use as a context manager: leaving restores the state found."""

    def __init__(self, enabled: bool, interval: int = 0, around_evaluation: bool = True):
        self.enabled, self.interval, self.around_evaluation = enabled, interval, around_evaluation
        self._was_enabled = None

    def __enter__(self) -> "ManualGC":
        if self.enabled:
            self._was_enabled = gc.isenabled()
            gc.disable()
            gc.collect()
        return self

    def __exit__(self, *exc_info) -> None:
        if self._was_enabled:
            gc.enable()
        self._was_enabled = None

    def after_iteration(self, iteration: int) -> None:
        """`iteration`: the 1-based number of the iteration just finished."""
        if self.enabled and self.interval and iteration % self.interval == 0:
            gc.collect()

    def before_evaluation(self) -> None:
        if self.enabled and self.around_evaluation:
            gc.collect()

    def after_evaluation(self) -> None:
        if self.enabled and self.around_evaluation:
            gc.collect(generation=0)  # what the evaluation made and dropped


def empty_unused_memory(level: int, at_level: int) -> None:
    """--empty-unused-memory-level: from `at_level` on, hand the CUDA caching allocator's unused blocks back
    (fewer fragmentation OOMs, slower steps). A no-op where CUDA is not initialized, as on a CPU."""
    if level >= at_level:
        torch.cuda.empty_cache()


class StepProfiler:
    """--profile: a torch.profiler trace of the iterations after --profile-step-start up to --profile-step-end
    on the ranks of --profile-ranks; `at_iteration` at the top of every loop pass, `close()` after the loop."""

    def __init__(self, train: TrainConfig, rank: int, world_size: int, folder: str, device: torch.device):
        ranks = train.profile_ranks
        if ranks is not None and max(ranks) >= world_size:
            raise UserError(f"--profile-ranks {' '.join(map(str, ranks))} names a rank the run does not have (it "
                            f"has ranks 0-{world_size - 1}); pick ranks below {world_size}")
        self.enabled = train.profile and (ranks is None or rank in ranks)
        self.start, self.end = train.profile_step_start, train.profile_step_end
        self.path = os.path.join(folder, f"rank-{rank}.json")
        self.activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            self.activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = None

    def at_iteration(self, iteration: int) -> None:
        """`iteration`: the iterations done so far (the loop's counter)."""
        if self._profiler is not None:
            if iteration >= self.end:
                self.close()
            else:
                self._profiler.step()  # ends one ProfilerStep span, starts the next
        elif self.enabled and iteration == self.start:
            record = torch.profiler.ProfilerAction.RECORD  # a schedule, so that steps get their spans
            self._profiler = torch.profiler.profile(activities=self.activities, schedule=lambda step: record)
            self._profiler.step_num = iteration + 1  # span names follow the log lines' iteration numbers
            self._profiler.start()

    def close(self) -> None:
        """Stop and write the trace (a run that ends early writes the iterations it had)."""
        if self._profiler is None:
            return
        self._profiler.stop()
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._profiler.export_chrome_trace(self.path)
        self._profiler = None


def profile_folder(tensorboard_dir: str | None, save: str | None) -> str:
    """Where --profile's traces go: a profile/ folder under --tensorboard-dir, else under --save, else here."""
    return os.path.join(tensorboard_dir or save or ".", "profile")
