"""The training loop: `pretrain(run)` builds a run's data, model, optimizer and checkpoint, then iterates.

An iteration is one global batch: its micro-batches run forward and backward, gradients accumulate in fp32
and the optimizer steps once. The loss is the mean over every unmasked token of the global batch, so the
number of micro-batches changes no arithmetic. Every early stop happens at an iteration boundary all ranks
agree on, saves when --save is set and returns normally, so the same command resumes (docs/reliability.md).
"""

import contextlib
import dataclasses
import math
import os
import random
import signal
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from megalite import parallel_state
from megalite.checkpoint.checkpointer import Checkpointer, json_able
from megalite.config import RunConfig, describe_model, num_parameters
from megalite.data.loader import build_data_loader, iterate, next_global_batch
from megalite.data_parallel.ddp import ParallelModel, global_token_count
from megalite.data_parallel.optimizer import DistributedOptimizer, DynamicLossScaler, MixedPrecisionOptimizer
from megalite.errors import UserError
from megalite.parallel_state import ONE_PROCESS, ParallelState
from megalite.kernels import check_kernels
from megalite.run.flops import DTYPE_NAMES
from megalite.run.housekeeping import ManualGC, StepProfiler, empty_unused_memory, profile_folder
from megalite.run.logger import TrainingLogger
from megalite.run.parallelize import parallelize
from megalite.run.tracking import exit_code_of, start_tracking
from megalite.run.lr_schedule import LRSchedule
from megalite.run.data import build_datasets, final_run_config
from megalite.run.resilience import (LossSpikeDetector, PeerWatch, SkippedSteps, check_token_dtypes, checked_token_ids,
                                     divergence_message, exit_reason, is_collective_failure, owned_signals)
from megalite.pipeline_parallel.comm import PipelineComm
from megalite.pipeline_parallel.schedules import ScheduleRunner, schedule_steps
from megalite.model.loss import LanguageModelLoss
from megalite.model.moe import (moe_routers, reset_global_aux_loss, set_aux_loss_scale, take_moe_statistics,
                                update_expert_bias)
from megalite.pipeline_parallel.stages import ModelChunks, build_model_chunks
from megalite.tensor_parallel.random import model_parallel_seed


@dataclass
class TrainState:
    """What a checkpoint must restore besides tensors, and what a run reports at the end."""

    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    losses: list[float] = field(default_factory=list)  # this process's iterations only
    exit_reason: str = "finished"


@dataclass
class PendingIteration:
    """An iteration whose results are still on the device: the loop reads them at its next log line, or
    where it must decide before that (an evaluation, a save, the end)."""

    iteration: int
    consumed_samples: int
    seconds: float
    lr: float
    global_batch_size: int
    results: torch.Tensor  # Trainer.train_step's


def print_flushed(line: str) -> None:
    """Console lines appear at once, also when stdout is a file or a pipe (tee, SLURM logs)."""
    print(line, flush=True)


def build_optimizer(model: ParallelModel, run: RunConfig) -> MixedPrecisionOptimizer:
    """The mixed-precision optimizer on the model's parameter-and-grad buffer, or the distributed one when the
    optimizer state is sharded (ZeRO-1/2/3); fp16 gets a dynamic loss scaler."""
    train, layout = run.train, run.parallel
    kind = DistributedOptimizer if layout.sharding.optimizer_state else MixedPrecisionOptimizer
    scaler = None
    if train.fp16:
        scaler = DynamicLossScaler(initial_scale=train.initial_loss_scale, min_scale=train.min_loss_scale,
                                   growth_interval=train.loss_scale_window, hysteresis=train.hysteresis,
                                   device=model.parallel.device)
    return kind(model, lr=train.lr, weight_decay=train.weight_decay, betas=(train.adam_beta1, train.adam_beta2),
                eps=train.adam_eps, clip_grad=train.clip_grad, loss_scaler=scaler)


def forward_backward(model, micro_batches, optimizer=None, parallel: ParallelState = ONE_PROCESS, comm=None,
                     log=None, loss_fn: LanguageModelLoss | None = None) -> torch.Tensor:
    """Mean loss over the global batch's unmasked tokens, on every pipeline rank, as a 0-dim float64 tensor on
    the device (not waited for); with `optimizer`, backward too. model: a GPTModel, or this pipeline rank's
    ModelChunks. micro_batches: dicts of [b, s] tensors, this DP rank's part of the global batch (under CP this
    CP rank's [b, s / CP] chunks of it); each one's loss is divided by the whole global batch's token count, so
    the gradients summed over DP x CP are those of the global mean. loss_fn: the last stage's loss on its hidden
    states (default: the model config's)."""
    chunks = list(model) if isinstance(model, ModelChunks) else [model]
    loss_fn = loss_fn if loss_fn is not None else LanguageModelLoss.of(chunks[-1])
    device = next(chunks[0].parameters()).device
    total_tokens = global_token_count(micro_batches, parallel, device)
    if total_tokens == 0:
        raise UserError("a global batch has no tokens that count towards the loss (every loss_mask "
                        "is zero); check --eod-mask-loss and the data")
    micro_batches = [{key: value.to(device, non_blocking=True) for key, value in mb.items()} for mb in micro_batches]
    steps = schedule_steps(parallel.pp_size, len(chunks), len(micro_batches), parallel.pp_rank,
                           forward_only=optimizer is None)
    scale_loss = optimizer.scale_loss if optimizer is not None else None
    # The MoE balancing losses' gradients, scaled as the language-model loss's: Megatron's mean over the
    # micro-batches of the whole global batch (all DP ranks, whose grads are summed), times the loss scale.
    if moe_routers(model):
        loss_scale = scale_loss(torch.ones((), device=device)) if scale_loss is not None else 1.0
        set_aux_loss_scale(model, loss_scale / (len(micro_batches) * parallel.dp_size))
        reset_global_aux_loss(model)  # global_aux_loss averages the counts of this global batch's micro-batches
    runner = ScheduleRunner(chunks, micro_batches, total_tokens,
                            lambda chunk, mb, hidden: chunk(mb["tokens"], mb["position_ids"], hidden_states=hidden),
                            lambda chunk, hidden, mb: loss_fn(chunk, hidden, mb["labels"], mb["loss_mask"]),
                            comm, scale_loss, log, parallel.rank)
    loss = runner.run(steps)
    total_loss = loss if loss is not None else torch.zeros((), dtype=torch.float64, device=device)
    # The last stage's loss to every stage, summed over the DP x CP ranks, which hold the global batch's
    # tokens (each already divided by the global token count): every rank gets the global mean and decides alike.
    for group, size in ((parallel.pp_group, parallel.pp_size), (parallel.dp_cp_group, parallel.dp_cp_size)):
        if size > 1:
            torch.distributed.all_reduce(total_loss, group=group)
    return total_loss


class Trainer:
    """One run's objects: `with Trainer(run) as trainer: trainer.train()`. Entering opens them in the order the
    checkpoint and the data need (signals, process groups, model, optimizer, checkpoint, data, logger, tracking);
    leaving closes what was opened, in the reverse order, however the block ended."""

    def __init__(self, run: RunConfig, log=print_flushed):
        self.run, self._print = run, log

    def __enter__(self) -> "Trainer":
        with contextlib.ExitStack() as opened:
            self._open(opened)
            self._close = opened.pop_all()  # all opened: from now on __exit__ closes them
        return self

    def __exit__(self, *exc_info) -> bool:
        return self._close.__exit__(*exc_info)

    def _open(self, opened: contextlib.ExitStack) -> None:
        """Build the run's objects; `opened` closes each resource taken, if a later one fails or at exit.
        `self.run` becomes `run` completed once by `final_run_config` (the built-in corpus, the tokenizer's
        vocabulary, a resumed LR schedule): the config the run uses and its checkpoints save, never replaced."""
        run, train = self.run, self.run.train
        self.signals = opened.enter_context(owned_signals(train.exit_signal_handler))  # before wandb starts
        self.parallel = parallel_state.initialize(run.parallel)
        opened.callback(parallel_state.destroy, self.parallel)
        self.peers = PeerWatch(self.parallel)  # to name a rank that dies later
        self.stop_signal = 0  # an exit signal every rank has agreed on
        self.evaluation_pending = False  # this iteration's evaluation was cut short by a signal
        self.evaluations_logged = set()  # the splits evaluated and logged at this iteration
        self.gc = ManualGC(train.manual_gc, train.manual_gc_interval, train.manual_gc_eval)  # on in train()
        # Python, numpy and torch RNGs alike on every TP rank (dropout outside TP regions must match), offset
        # per pipeline stage as Megatron does; the TP-region RNG differs per TP rank.
        random.seed(train.seed + 100 * self.parallel.pp_rank)
        np.random.seed(train.seed + 100 * self.parallel.pp_rank)
        model_parallel_seed(train.seed, self.parallel.tp_rank, self.parallel.pp_rank, self.parallel.device,
                            self.parallel.cp_rank)
        check_kernels(train.kernels)  # before any work: --kernels triton on a machine that cannot run it
        run, self.tokenizer = final_run_config(run)  # every rank
        self.run = run
        self.device = self.parallel.device
        metrics_file = run.logging.metrics_file
        if metrics_file is None and run.checkpoint.save:
            metrics_file = os.path.join(run.checkpoint.save, "metrics.jsonl")
        self.logger = TrainingLogger(run.model, train.global_batch_size, run.model.seq_length, train.train_iters,
                                     run.logging.log_interval, metrics_file, device=self.device,
                                     dtype=train.params_dtype, num_devices=self.parallel.world_size,
                                     is_logging_rank=self.parallel.is_logging_rank,
                                     print_fn=None if self._print is print_flushed else self._print)
        opened.callback(self.logger.close)
        # The logger's method, not a closure over the Trainer: that reference cycle would keep the process groups
        # alive until interpreter exit, where gloo aborts the process.
        self.log = self.logger.print
        layout = run.parallel
        self.model = build_model_chunks(run.model, train.seed, self.device, train.params_dtype, self.parallel,
                                        layout.virtual_pipeline_model_parallel_size,
                                        layout.decoder_first_pipeline_num_layers,
                                        layout.decoder_last_pipeline_num_layers, train.kernels)
        self.parallel_model = parallelize(self.model, run, self.parallel)
        self.loss_fn = LanguageModelLoss(run.model, self.parallel, train.kernels)
        self.comm = None
        if self.parallel.pp_size > 1:
            # A stage's activations: this CP rank's S/CP tokens, split over TP under SP.
            tokens = run.model.seq_length // self.parallel.cp_size // (
                self.parallel.tp_size if layout.sequence_parallel else 1)
            self.comm = PipelineComm(self.parallel, (tokens, train.micro_batch_size, run.model.hidden_size),
                                     train.params_dtype)
        self.schedule_log = print_flushed if run.logging.debug_pipeline_schedule else None  # on every rank
        self.optimizer = build_optimizer(self.parallel_model, run)
        self.schedule = LRSchedule(**run.train.lr_schedule_settings())
        self.state = TrainState()
        self.checkpointer = Checkpointer(run, self.parallel, log=self.log)
        # The checkpoint the Checkpointer picks: --load, or --save when it holds one.
        resumed = self.checkpointer.load(self.parallel_model, self.optimizer, self.schedule)
        if resumed is not None:
            self.state = TrainState(resumed.iteration, resumed.consumed_train_samples, resumed.consumed_valid_samples)
            self.evaluation_pending = resumed.evaluation_pending
            self.evaluations_logged = set(resumed.evaluations_logged)
        self.train_ds, self.valid_ds, self.test_ds = build_datasets(run, self.tokenizer)
        check_token_dtypes((self.train_ds, self.valid_ds, self.test_ds), self.tokenizer.vocab_size)
        self.train_iterator = self._iterator(self.train_ds, self.state.consumed_train_samples,
                                             train.rampup_batch_size)
        self.valid_iterator = self._iterator(self.valid_ds, self.state.consumed_valid_samples)
        self.logger.start(self.state.iteration, self.evaluations_logged)
        if run.train.rampup_batch_size is not None:  # said once
            start, increment, samples = run.train.rampup_batch_size
            self.log(f"batch-size ramp-up: the global batch starts at {start} and grows by {increment} over the "
                     f"first {samples} samples to {run.train.global_batch_size}")
        self.profiler = self._build_profiler(run)
        opened.callback(self.profiler.close)
        self.tracker = start_tracking(run, json_able(dataclasses.asdict(run)), self.logger,
                                      self.parallel.is_logging_rank, warn=self.log)
        opened.push(self._finish_tracking)

    def _finish_tracking(self, _kind, error, _traceback) -> None:
        """Close the tracking run with the run's exit code and why it ended (the error, if one ends it)."""
        reason = f"{type(error).__name__}: {error}" if error is not None else self.state.exit_reason
        self.tracker.finish(0 if error is None else exit_code_of(error),
                            {"exit_reason": reason, "final_iteration": self.state.iteration})

    def _build_profiler(self, run: RunConfig) -> StepProfiler:
        """--profile's profiler for this rank, said once at start-up with where the traces go."""
        folder = profile_folder(run.logging.tensorboard_dir, run.checkpoint.save)
        profiler = StepProfiler(run.train, self.parallel.rank, self.parallel.world_size, folder, self.device)
        train = run.train
        if train.profile:
            ranks = "all ranks" if train.profile_ranks is None else f"ranks {' '.join(map(str, train.profile_ranks))}"
            late = (f" (this run starts after iteration {self.state.iteration}, so it writes none)"
                    if self.state.iteration > train.profile_step_start else "")
            self.log(f"--profile: a PyTorch profiler trace of iterations {train.profile_step_start + 1}-"
                     f"{train.profile_step_end} on {ranks} goes to {os.path.join(folder, 'rank-<rank>.json')}{late}")
        return profiler

    def _iterator(self, dataset, consumed_samples: int, rampup: list[int] | None = None):
        """Micro-batches of `dataset` from `consumed_samples` on; `rampup` for training only (evaluation
        uses whole global batches throughout, as Megatron's)."""
        if dataset is None:
            return None
        train, data = self.run.train, self.run.data
        parallel = self.parallel  # the dense DP's rank and size: the CP ranks of a DP rank read the same samples
        loader = build_data_loader(dataset, consumed_samples, train.global_batch_size, train.micro_batch_size,
                                   parallel.dp_rank, parallel.dp_size, num_workers=data.num_workers, rampup=rampup,
                                   context_parallel_rank=parallel.cp_rank, context_parallel_size=parallel.cp_size)
        source = ("the mock data" if data.mock_data else f"--data-path {' '.join(data.data_path)}" if data.data_path
                  else "the --train/valid/test-data-path files")
        return checked_token_ids(iterate(loader), self.tokenizer.vocab_size, source)

    def save(self) -> None:
        """Save a checkpoint into --save (nothing without it) and tell the tracking run."""
        if self.checkpointer.save(self.state, self.parallel_model, self.optimizer, self.schedule,
                                  self.evaluation_pending, self.evaluations_logged):
            self.tracker.log_checkpoint(self.state.iteration)

    def train_step(self) -> tuple[torch.Tensor, float]:
        """One iteration on `run.global_batch_at(consumed samples)`, without waiting for the device: (results,
        lr). results: float64 [4] on the device, the lm loss, the grad norm (nan when skipped), 1.0 when the
        step was applied (else 0.0) and the loss scale after it."""
        consumed = self.state.consumed_train_samples
        num_microbatches = self.run.num_microbatches_at(consumed)
        position = (self.state.iteration, consumed, self.run.global_batch_at(consumed))
        lr = self.schedule.lr_at(*position)
        self.optimizer.zero_grad()
        self.parallel_model.start_iteration(num_microbatches)
        batch = next_global_batch(self.train_iterator, num_microbatches)
        loss = forward_backward(self.model, batch, self.optimizer, self.parallel, self.comm, self.schedule_log,
                                self.loss_fn)
        empty_unused_memory(self.run.train.empty_unused_memory_level, 1)  # Megatron's two points, by level
        # Once per iteration, after the last backward: tied embedding over PP, DP, SP grads over TP.
        self.parallel_model.finish_grad_sync()
        # Every rank holds the same global loss and grad norm, so all ranks skip (and stop) alike. The NaN check
        # skips a step with a non-finite loss too; `_account` stops the run when it reads the results.
        skip = ~torch.isfinite(loss) if self._stops_on_nan() else None
        updated, grad_norm = self.optimizer.step(lr, self.schedule.decoupled_lr_at(*position), skip)
        if self.run.model.moe_router_enable_expert_bias:
            update_expert_bias(self.model, self.parallel.dp_group if self.parallel.dp_size > 1 else None)
        empty_unused_memory(self.run.train.empty_unused_memory_level, 2)
        scaler = self.optimizer.loss_scaler
        scale = scaler.scale if scaler is not None else torch.ones_like(loss)
        return torch.stack([loss, grad_norm.double(), updated.double(), scale]), lr

    def _stops_on_nan(self) -> bool:
        """--check-for-nan-in-loss-and-grad stops the run at a skipped step, unless a loss scaler skips it (fp16)."""
        return self.run.train.check_for_nan_in_loss_and_grad and self.optimizer.loss_scaler is None

    def _account(self, pending: list[PendingIteration], spikes: LossSpikeDetector, skipped: SkippedSteps) -> None:
        """Read the `pending` iterations' results (one wait for the device) and account for each in turn, as if
        it had just run: the NaN check, the log, the skipped steps in a row and loss spikes. Empties `pending`."""
        if not pending:
            return
        start = time.perf_counter()
        rows = torch.stack([done.results for done in pending]).tolist()
        pending[-1].seconds += time.perf_counter() - start  # the device's queued work, finished during the wait
        for done, (loss, grad_norm, updated, scale) in zip(pending, rows):
            if self._stops_on_nan() and not updated:  # the step was not applied, and no later one is saved
                what = f"the lm loss is {loss}" if not math.isfinite(loss) else "the gradient norm is not finite"
                raise UserError(divergence_message(what, done.iteration, self.checkpointer.last_checkpoint))
            self.state.losses.append(loss)
            # MoE routing since the last line, over the whole job (a collective: every rank logs_at alike).
            moe = (take_moe_statistics(self.model, self.run.model, self.parallel)
                   if self.logger.logs_at(done.iteration) else None)
            self.logger.log_iteration(done.iteration, done.consumed_samples, done.seconds, done.lr, loss, scale,
                                      grad_norm, skipped=not updated, global_batch_size=done.global_batch_size,
                                      moe=moe)
            skipped.check(updated, self.optimizer.loss_scaler, scale, done.iteration,
                          self.checkpointer.last_checkpoint)
            warning = spikes.check(done.iteration, loss)
            if warning:
                self.log(warning)
        pending.clear()

    def agreed_stop(self, start_time: float | None = None) -> tuple[int, bool]:
        """(the exit signal any rank has received, 0 for none; whether any rank's clock is past
        --exit-duration-in-mins, asked only with the loop's `start_time`), the same on every rank.
        One all-reduce, none without an exit signal handler and a time limit; a signal once agreed stays."""
        train = self.run.train
        timed = start_time is not None and bool(train.exit_duration_in_mins)
        overtime = timed and (time.time() - start_time) / 60 > train.exit_duration_in_mins
        if self.stop_signal or not (self.signals.save_and_exit or timed):
            return self.stop_signal, overtime
        received = self.signals.received or 0
        if self.parallel.world_size > 1:  # a signal reaches one rank, clocks differ: every rank must decide alike
            flags = torch.tensor([received, int(overtime)], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX)
            received, overtime = flags.tolist()
        self.stop_signal = received
        return received, bool(overtime)

    def evaluate_split(self, split: str, iterator) -> bool:
        """Evaluate `split` (the mean of --eval-iters global batches' mean token loss, dropout off) and log it;
        False when an exit signal cut it short (nothing logged or counted: a resumed run evaluates it again)."""
        train = self.run.train
        if iterator is None or train.eval_iters == 0:
            return True
        losses = []
        self.model.eval()
        self.gc.before_evaluation()
        try:
            with torch.no_grad():
                for _ in range(train.eval_iters):
                    if self.agreed_stop()[0]:  # before each batch, a boundary every rank reaches
                        return False
                    batch = next_global_batch(iterator, self.run.num_microbatches)
                    losses.append(forward_backward(self.model, batch, parallel=self.parallel, comm=self.comm,
                                                   loss_fn=self.loss_fn))
                    empty_unused_memory(train.empty_unused_memory_level, 1)
        finally:
            self.model.train()
            self.gc.after_evaluation()
        if split == "valid":
            self.state.consumed_valid_samples += train.eval_iters * train.global_batch_size
        self.logger.log_evaluation(self.state.iteration, split, sum(torch.stack(losses).tolist()) / len(losses))
        self.evaluations_logged.add(split)
        return True

    def train(self) -> TrainState:
        """Train from the loaded state to --train-iters or an early stop (with --manual-gc's collector off)."""
        with self.gc:
            return self._train()

    def _train(self) -> TrainState:
        run, state = self.run, self.state
        start_time = time.time()
        saved_at = state.iteration if state.iteration else None  # a loaded checkpoint is saved already
        spikes, skipped = LossSpikeDetector(run.train.loss_spike_threshold), SkippedSteps()
        pending: list[PendingIteration] = []  # the iterations since the results were last read
        # The iteration a failure stops: the step of the next one, else the one that has just been counted (its
        # evaluation and save, the checks before the next step, and the end of the run).
        running = state.iteration
        try:
            if self.evaluation_pending:  # the checkpoint's own evaluation was cut short by a signal
                self.evaluation_pending = not self.evaluate_split("valid", self.valid_iterator)
            reason = "finished" if state.iteration >= run.train.train_iters else None
            if reason and self.checkpointer.resumed_from is not None:
                self.log(f"the checkpoint is at iteration {state.iteration} of --train-iters {run.train.train_iters}: "
                         f"nothing to train; raise --train-iters to go on, or --save to a new folder to start afresh")
            while reason is None:
                self.profiler.at_iteration(state.iteration)
                step_start = time.perf_counter()
                global_batch = run.global_batch_at(state.consumed_train_samples)
                running = state.iteration + 1
                results, lr = self.train_step()
                state.iteration += 1
                state.consumed_train_samples += global_batch
                self.evaluations_logged = set()
                pending.append(PendingIteration(state.iteration, state.consumed_train_samples,
                                                time.perf_counter() - step_start, lr, global_batch, results))
                evaluate = run.train.eval_interval and state.iteration % run.train.eval_interval == 0
                save = self.checkpointer.due(state.iteration)
                if evaluate or save or self.logger.logs_at(state.iteration):  # else nothing waits for the device
                    self._account(pending, spikes, skipped)
                if evaluate:
                    # Cut short by a signal: the checkpoint below says so, and the resumed run evaluates first.
                    self.evaluation_pending = not self.evaluate_split("valid", self.valid_iterator)
                if save:
                    self.save()
                    saved_at = state.iteration
                self.gc.after_iteration(state.iteration)
                reason = exit_reason(run.train, state.iteration, *self.agreed_stop(start_time))
            self._account(pending, spikes, skipped)  # a stop between log lines: before the last evaluation and save
            self.profiler.close()  # a run that ends before --profile-step-end: the iterations it had
            self.parallel_model.finish_param_sync()  # whoever reads the weights after the loop gets the whole ones
            if reason == "finished":  # validation, then test, each unless logged at this iteration (by the loop or a
                # finished run this one resumed: a re-run adds nothing); a signal stops them
                if "valid" in self.evaluations_logged or self.evaluate_split("valid", self.valid_iterator):
                    if "test" not in self.evaluations_logged:
                        self.evaluate_split("test", self._iterator(self.test_ds, 0))
            if saved_at != state.iteration:
                self.save()
            if self.agreed_stop()[0]:  # a signal up to the last save: say that it was heard
                reason = signal.Signals(self.stop_signal).name
            self.signals.close()  # a signal from now on has nothing left to stop (said at exit)
            state.exit_reason = reason
            if reason != "finished":
                self.log(f"exiting at iteration {state.iteration}: {reason}")
        except BaseException as error:
            if is_collective_failure(error):
                # A peer died or hangs: say so in one sentence instead of a traceback from deep in torch.
                raise self.peers.failure(error, running, self.checkpointer.last_checkpoint) from error
            raise
        return state


def pretrain(run: RunConfig, log=print_flushed) -> tuple[Trainer, TrainState]:
    """Build everything for `run` and train; returns the trainer (model, tokenizer) and final state."""
    with Trainer(run, log) as trainer:
        # The most parameters any rank's model chunks hold (its TP and PP part), for the start-up line.
        count = torch.tensor(sum(param.numel() for param in trainer.model.parameters()), device=trainer.device)
        if trainer.parallel.world_size > 1:
            torch.distributed.all_reduce(count, op=torch.distributed.ReduceOp.MAX)
        trainer.log(startup_line(trainer.run, int(count), trainer.device))
        return trainer, trainer.train()


def startup_line(run: RunConfig, largest_rank_params: int, device: torch.device) -> str:
    """The line a run starts with, once per world: the model (named by its preset only when it is the preset),
    its parameters and the most any rank holds, its shape, dtype, device and threads, and the layout."""
    model, layout = run.model, run.parallel
    dtype = DTYPE_NAMES[run.train.params_dtype]
    if run.train.bf16_default:
        dtype += " (the default on a GPU with bf16 units; --fp32 for fp32)"
    threads = torch.get_num_threads()
    threads = f"{threads} thread{'s' * (threads > 1)}" + (" per rank" if layout.world_size > 1 else "")
    params = f"{num_parameters(model):,} parameters"  # the whole model's, a tied output layer's weight once
    if layout.world_size > 1:
        params += f" (up to {largest_rank_params:,} per rank)"
    line = (f"{describe_model(run.model_name, model)}: {params}, {model.num_layers} layers, hidden "
            f"{model.hidden_size}, vocab {model.real_vocab_size} (padded {model.vocab_size}), seq {model.seq_length}, "
            f"{dtype} on {device.type} with {threads}")
    return line if layout.world_size == 1 else f"{line}; {layout.describe()}"
