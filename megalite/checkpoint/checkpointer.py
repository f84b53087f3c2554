"""A run's checkpoint policy, which the Trainer (megalite/run/training.py) calls: what to resume
from and how much of it to load, when to save, and which old checkpoints to remove."""

import dataclasses
import json
import os
import time
from dataclasses import dataclass

from megalite.checkpoint.folder import choose_checkpoint, remove_old_checkpoints
from megalite.checkpoint.format import context_changes, read_metadata
from megalite.checkpoint.loading import load_checkpoint
from megalite.checkpoint.saving import save_checkpoint
from megalite.config import CheckpointConfig, RunConfig
from megalite.errors import UserError


@dataclass
class Resumed:
    """Where a resumed run continues: the checkpoint loaded and the counters it restored."""

    path: str
    iteration: int
    consumed_train_samples: int
    consumed_valid_samples: int
    evaluation_pending: bool  # the saved run's evaluation was cut short by a signal: evaluate first
    evaluations_logged: tuple[str, ...]  # the splits evaluated and logged at `iteration` before the save


class Checkpointer:
    """Loads and saves one run's checkpoints as its flags say; every rank calls `load` and `save`.
    `last_checkpoint`: the newest complete one (None before any); `resumed_from`: the iteration the run
    resumed at (None: it did not), which --keep-last-n-checkpoints never deletes."""

    def __init__(self, run: RunConfig, parallel, log=print):
        self.run, self.parallel, self.log = run, parallel, log
        self.last_checkpoint: str | None = None
        self.resumed_from: int | None = None

    def load(self, model, optimizer, schedule) -> Resumed | None:
        """Restore `model` (a ParallelModel: its chunks, or ZeRO-3's shards of them), `optimizer`, `schedule`
        (an LRSchedule) and the RNG states from the checkpoint `choose_checkpoint` picks; None when the run starts
        at iteration 0 (no checkpoint, or --finetune); `resume_folder` says where it looks."""
        ckpt = self.run.checkpoint
        load, implicit = resume_folder(ckpt)
        if load is None:
            return None
        path, note = choose_checkpoint(load)
        if path is None:
            if implicit:
                return None
            if load != ckpt.save or ckpt.finetune:
                raise UserError(f"--load {load} holds no checkpoint (no latest_checkpointed_iteration.txt); "
                                "check the folder, or drop --load to start from scratch")
            self.log(f"no checkpoint in {load} yet: starting from scratch")
            return None
        if note:
            self.log(f"warning: {load}: {note}")
        metadata = read_metadata(path)
        load_optim = not (ckpt.finetune or ckpt.no_load_optim)
        loaded = load_checkpoint(load, model.model, optimizer if load_optim else None, model_config=self.run.model,
                                 iteration=metadata["iteration"], rank=self.parallel.rank, parallel=self.parallel,
                                 load_rng=not (ckpt.finetune or ckpt.no_load_rng) and self._same_layout_as(metadata),
                                 finetune=ckpt.finetune, param_shards=model.param_shards)
        if not load_optim:
            optimizer.reload_model_params()  # the fp32 main params start from the loaded weights
        if ckpt.finetune:
            changes = context_changes(metadata["model_config"], self.run.model)
            self.log(f"loaded the model weights of {loaded['path']} iteration {loaded['iteration']} (--finetune): "
                     f"starting at iteration 0" + (f", with {changes}" if changes else ""))
            return None
        self.last_checkpoint, self.resumed_from = loaded["path"], loaded["iteration"]
        extra = loaded["extra"]
        pending = bool(extra.get("evaluation_pending"))
        logged = extra.get("evaluations_logged")
        if logged is None:  # saved before the field existed: the in-loop validation, where it was due and done
            interval = self.run.train.eval_interval
            logged = ["valid"] if interval and loaded["iteration"] % interval == 0 and not pending else []
        resumed = Resumed(loaded["path"], loaded["iteration"], loaded["consumed_samples"],
                          loaded["consumed_valid_samples"] or 0, pending, tuple(logged))
        if "lr_schedule" in extra:
            train = self.run.train
            schedule.load_state_dict(extra["lr_schedule"], override=train.override_opt_param_scheduler,
                                     use_checkpoint=train.use_checkpoint_opt_param_scheduler)
        self.log(f"loaded checkpoint {resumed.path} at iteration {resumed.iteration} "
                 f"({resumed.consumed_train_samples} samples consumed)"
                 + (" (--load defaults to --save, which holds it)" if implicit else ""))
        return resumed

    def _same_layout_as(self, metadata: dict) -> bool:
        """Whether the checkpoint was saved by this parallel layout; if not, say that RNG states stay
        behind. They are per rank, and under another layout a rank's dropout masks cover other
        activations anyway."""
        saved = metadata["extra"].get("run", {}).get("parallel", {})  # none in a Hugging Face import
        saved = {"context_parallel_size": 1, **saved}  # a checkpoint from before CP existed ran at CP 1
        keys = ("world_size", "tensor_model_parallel_size", "context_parallel_size", "pipeline_model_parallel_size",
                "virtual_pipeline_model_parallel_size")
        now = dataclasses.asdict(self.run.parallel)
        if all(saved.get(key) == now[key] for key in keys):
            return True
        self.log(f"the checkpoint was saved by another layout ({', '.join(f'{k}={saved.get(k)}' for k in keys)}); "
                 f"model, optimizer and data position carry over, RNG states are seeded afresh")
        return False

    def due(self, iteration: int) -> bool:
        """Whether the loop saves after `iteration` (a multiple of --save-interval)."""
        interval = self.run.checkpoint.save_interval
        return bool(interval) and iteration % interval == 0

    def save(self, state, model, optimizer, schedule, evaluation_pending: bool = False,
             evaluations_logged=()) -> str | None:
        """Save the run at `state` (a TrainState) and `model` (a ParallelModel), with the LR schedule and
        the run config, into --save; then remove old checkpoints. Return the folder written, None without --save.
        evaluations_logged: the splits logged at this iteration so far (a resumed run logs the others)."""
        ckpt = self.run.checkpoint
        if ckpt.save is None:
            return None
        start = time.perf_counter()
        model.finish_param_sync()  # --overlap-param-gather: the weights saved must be the whole ones
        extra = {"lr_schedule": schedule.state_dict(), "model_name": self.run.model_name,
                 "run": json_able(dataclasses.asdict(self.run)), "evaluation_pending": evaluation_pending,
                 "evaluations_logged": sorted(evaluations_logged)}
        path = save_checkpoint(ckpt.save, state.iteration, model.model, optimizer,
                               consumed_samples=state.consumed_train_samples,
                               consumed_valid_samples=state.consumed_valid_samples,
                               model_config=self.run.model, extra=extra, rank=self.parallel.rank,
                               parallel=self.parallel, param_shards=model.param_shards)
        self.last_checkpoint = path
        self.log(f"saved checkpoint {path} in {time.perf_counter() - start:.1f} s")
        if ckpt.keep_last_n_checkpoints and self.parallel.rank == 0:
            keep = {self.resumed_from} if self.resumed_from is not None else set()
            for removed in remove_old_checkpoints(ckpt.save, ckpt.keep_last_n_checkpoints, ckpt.save_retain_interval,
                                                  keep):
                self.log(f"removed old checkpoint {removed} (--keep-last-n-checkpoints {ckpt.keep_last_n_checkpoints})")
        return path


def resume_folder(ckpt: CheckpointConfig) -> tuple[str | None, bool]:
    """The folder a run resumes from (None: it starts afresh), and whether that is implicit: --load
    defaults to --save when that exists, so a restarted job resumes by itself."""
    implicit = ckpt.load is None and ckpt.save is not None and os.path.isdir(ckpt.save)
    return (ckpt.save if implicit else ckpt.load), implicit


def saved_lr_schedule(ckpt: CheckpointConfig) -> dict | None:
    """The LR schedule settings of the checkpoint a run with `ckpt` resumes from (Checkpointer.load's choice);
    None when it resumes none (no checkpoint, --finetune) or that checkpoint holds none."""
    folder, _ = resume_folder(ckpt)
    path = None if folder is None or ckpt.finetune else choose_checkpoint(folder)[0]
    return None if path is None else read_metadata(path)["extra"].get("lr_schedule")


def json_able(value):
    """dataclasses.asdict output with anything JSON cannot hold turned into its string."""
    return json.loads(json.dumps(value, default=str))
