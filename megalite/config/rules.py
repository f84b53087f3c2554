"""The rules behind several flags, written once and checked when the config is validated; the runtime trusts a
validated config. The same sentences serve the public entries used without a config (the batch sampler, the pipeline
schedule, the Hugging Face import's model) and the LR schedule a checkpoint's settings are adopted into."""

from itertools import accumulate

from megalite.errors import UserError

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")

def schedule_fields(unit: str = "iterations") -> dict[str, str]:
    """Each LR schedule setting (megalite/run/lr_schedule.py) and the TrainConfig field, so the flag, that sets
    it; a schedule counted in samples (--train-samples) is set by the -samples fields."""
    length = "iters" if unit == "iterations" else "samples"
    return {"lr": "lr", "min_lr": "min_lr", "warmup_iters": f"lr_warmup_{length}", "decay_iters": f"lr_decay_{length}",
            "decay_style": "lr_decay_style", "wsd_decay_style": "lr_wsd_decay_style",
            "wsd_decay_iters": f"lr_wsd_decay_{length}", "decoupled_lr": "decoupled_lr",
            "decoupled_min_lr": "decoupled_min_lr"}


def schedule_flags(unit: str = "iterations") -> dict[str, str]:
    """schedule_fields' flags, for error messages."""
    return {key: "--" + field.replace("_", "-") for key, field in schedule_fields(unit).items()}


def check_schedule_settings(lr, min_lr, warmup_iters, decay_iters, decay_style, wsd_decay_style,
                            wsd_decay_iters, unit: str = "iterations", decoupled_lr=None,
                            decoupled_min_lr=None) -> None:
    """Raise a UserError naming the flag for the first invalid setting; the lengths count `unit`s. The decoupled LR
    (embeddings and output layer) decays from `decoupled_lr` to `decoupled_min_lr`, or to `min_lr` when that is None."""
    flags = schedule_flags(unit)
    if decay_style not in DECAY_STYLES:
        raise UserError(f"--lr-decay-style {decay_style!r} is unknown; use one of {', '.join(DECAY_STYLES)}")
    if wsd_decay_style not in WSD_DECAY_STYLES:
        raise UserError(f"--lr-wsd-decay-style {wsd_decay_style!r} is unknown; "
                        f"use one of {', '.join(WSD_DECAY_STYLES)}")
    for key, value in (("lr", lr), ("min_lr", min_lr), ("warmup_iters", warmup_iters),
                       ("decay_iters", decay_iters), ("wsd_decay_iters", wsd_decay_iters),
                       ("decoupled_lr", decoupled_lr), ("decoupled_min_lr", decoupled_min_lr)):
        if value is not None and not value >= 0:  # `not >=` also rejects nan
            raise UserError(f"{flags[key]} is {value} but must not be negative; pass a value >= 0")
    if min_lr > lr:
        raise UserError(f"--min-lr {min_lr} is larger than --lr {lr}; pass a --min-lr of at most {lr}")
    if decoupled_min_lr is not None and decoupled_lr is None:
        raise UserError("--decoupled-min-lr needs --decoupled-lr, the peak it decays from; add it or drop "
                        "--decoupled-min-lr")
    floor_flag, floor = ("--min-lr", min_lr) if decoupled_min_lr is None else ("--decoupled-min-lr", decoupled_min_lr)
    if decoupled_lr is not None and floor > decoupled_lr:
        raise UserError(f"{floor_flag} {floor} (the embeddings' and output layer's final learning rate) is larger "
                        f"than --decoupled-lr {decoupled_lr}; pass a --decoupled-min-lr of at most {decoupled_lr}")
    if warmup_iters > decay_iters:
        raise UserError(f"{flags['warmup_iters']} {warmup_iters} is larger than {flags['decay_iters']} "
                        f"{decay_iters}; warm up for at most {decay_iters} {unit} or decay over more")
    if decay_style == "WSD":
        if wsd_decay_iters is None:
            raise UserError(f"--lr-decay-style WSD needs {flags['wsd_decay_iters']}, the length of the final "
                            f"anneal; pass it")
        if wsd_decay_iters > decay_iters:
            raise UserError(f"{flags['wsd_decay_iters']} {wsd_decay_iters} is larger than {flags['decay_iters']} "
                            f"{decay_iters}; anneal over at most {decay_iters} {unit}")


def check_loss_scale_settings(initial_scale: float, min_scale: float, growth_interval: int, hysteresis: int) -> None:
    """UserError naming the fp16 loss-scale flag whose value DynamicLossScaler cannot take."""
    if not 0 < min_scale <= initial_scale:
        raise UserError(f"--initial-loss-scale {initial_scale} and --min-loss-scale {min_scale} must satisfy "
                        f"0 < min <= initial; pass a smaller --min-loss-scale")
    for flag, value in [("--loss-scale-window", growth_interval), ("--hysteresis", hysteresis)]:
        if value < 1:
            raise UserError(f"{flag} is {value} but must be at least 1; pass 1 or more")


def check_batch_sizes(global_batch_size: int, micro_batch_size: int, data_parallel_size: int) -> int:
    """Number of micro-batches per DP rank per iteration; a clear error if G does not split."""
    per_step = micro_batch_size * data_parallel_size
    if micro_batch_size < 1 or global_batch_size < 1 or global_batch_size % per_step:
        raise UserError(f"--global-batch-size {global_batch_size} is not a multiple of --micro-batch-size "
                        f"{micro_batch_size} x data-parallel size {data_parallel_size} = {per_step}; "
                        f"use a global batch size such as {max(1, global_batch_size // per_step) * per_step}")
    return global_batch_size // per_step


def check_rampup(rampup: list[int], global_batch_size: int) -> None:
    """UserError when --rampup-batch-size START INCREMENT RAMPUP_SAMPLES cannot ramp up to the global batch."""
    if len(rampup) != 3:
        raise UserError(f"--rampup-batch-size takes three numbers, START INCREMENT RAMPUP_SAMPLES (e.g. 16 16 "
                        f"5859375), but got {len(rampup)}; pass all three")
    start, increment, samples = rampup
    if start < 1 or increment < 1 or samples < 0:
        raise UserError(f"--rampup-batch-size {start} {increment} {samples} needs START and INCREMENT of at least "
                        f"1 and RAMPUP_SAMPLES of at least 0; pass such values")
    if start > global_batch_size or (global_batch_size - start) % increment:
        raise UserError(f"--rampup-batch-size START {start} plus a whole number of INCREMENT {increment} steps "
                        f"must reach --global-batch-size {global_batch_size}; pick a START of at most "
                        f"{global_batch_size} whose distance to it is a multiple of INCREMENT")


def check_rampup_layout(global_batch_size: int, rampup: list[int], micro_batch_size: int, data_parallel_size: int,
                        pp: int, vp: int) -> None:
    """UserError when a global batch of the ramp-up does not split into micro-batches, or into a count the
    interleaved pipeline schedule can run."""
    per_step = micro_batch_size * data_parallel_size
    for size in range(rampup[0], global_batch_size + 1, rampup[1]):  # every global batch the ramp-up uses
        if size % per_step:
            raise UserError(f"--rampup-batch-size {' '.join(map(str, rampup))} reaches a global batch of {size}, "
                            f"which is not a multiple of --micro-batch-size {micro_batch_size} x data-parallel "
                            f"size {data_parallel_size} = {per_step}; use a START and INCREMENT that are multiples "
                            f"of {per_step}")
        check_microbatches(size // per_step, pp, vp)


def global_batch_at(consumed_samples: int, global_batch_size: int, rampup: list[int] | None = None) -> int:
    """The global batch of the iteration that starts after `consumed_samples` samples: Megatron's
    RampupBatchsizeNumMicroBatchesCalculator. The ramp START INCREMENT RAMPUP_SAMPLES takes
    (global_batch_size - START) / INCREMENT equal steps of RAMPUP_SAMPLES / steps samples each."""
    if rampup is None:
        return global_batch_size
    start, increment, samples = rampup
    increments = (global_batch_size - start) // increment
    if consumed_samples > samples or increments == 0 or samples == 0:
        return global_batch_size
    return min(global_batch_size, start + int(consumed_samples / (samples / increments)) * increment)


def iterations_for_samples(train_samples: int, global_batch_size: int, rampup: list[int] | None = None) -> int:
    """The iterations --train-samples means, as Megatron's update_train_iters counts them: the ramp's iterations while
    at most RAMPUP_SAMPLES are consumed, then whole global batches (a partial last one is dropped)."""
    if rampup is None:
        return train_samples // global_batch_size
    iterations = consumed = 0
    while consumed <= rampup[2] and consumed <= train_samples:
        consumed += global_batch_at(consumed, global_batch_size, rampup)
        iterations += 1
    return iterations + max(0, train_samples - consumed) // global_batch_size


def check_microbatches(num_microbatches: int, pp: int, vp: int) -> None:
    """UserError when the interleaved schedule cannot run `num_microbatches` micro-batches."""
    if vp > 1 and num_microbatches % pp:
        working = ", ".join(str(pp * k) for k in range(1, 4))
        raise UserError(
            f"the interleaved pipeline schedule needs the micro-batch count (--global-batch-size / "
            f"(--micro-batch-size x data-parallel size)) to be a multiple of --pipeline-model-parallel-size {pp}, "
            f"but it is {num_microbatches}; use a global batch giving {working}, ... micro-batches")


def virtual_stage_layers(num_layers: int, pp: int, vp: int = 1, first: int | None = None,
                         last: int | None = None) -> list[list[int]]:
    """The global layer ids of each of the `pp * vp` virtual stages, in pipeline order; UserError,
    naming the flags, when the layers cannot be split that way."""
    stages = pp * vp
    given = {stage: value for stage, value in [(0, first), (stages - 1, last)] if value is not None}
    if stages == 1 and given:
        raise UserError("--decoder-first/last-pipeline-num-layers need --pipeline-model-parallel-size 2 or "
                        "more; drop them")
    for flag, value in [("--decoder-first-pipeline-num-layers", first), ("--decoder-last-pipeline-num-layers", last)]:
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    rest_layers, rest_stages = num_layers - sum(given.values()), stages - len(given)
    if rest_layers < rest_stages or (rest_stages and rest_layers % rest_stages) or (not rest_stages and rest_layers):
        split = f"--pipeline-model-parallel-size x virtual stages = {stages} stage(s)"
        if given:
            raise UserError(
                f"--num-layers {num_layers} minus the first/last stage layers ({sum(given.values())}) leaves "
                f"{rest_layers}, which does not split evenly over the other {rest_stages} of {split} with at "
                f"least one layer each; change --decoder-first/last-pipeline-num-layers or --num-layers")
        raise UserError(f"--num-layers {num_layers} is not divisible by {split}; use a multiple of {stages} "
                        f"layers, or --decoder-first/last-pipeline-num-layers for uneven ends")
    sizes = [given.get(stage, rest_layers // rest_stages if rest_stages else 0) for stage in range(stages)]
    bounds = [0, *accumulate(sizes)]
    return [list(range(start, stop)) for start, stop in zip(bounds, bounds[1:])]


def check_tensor_parallel_split(num_attention_heads: int, query_groups: int, ffn_hidden_size: int, tp: int) -> None:
    """UserError naming the flag when TP does not divide a dimension it splits."""
    for flag, value in [("--num-attention-heads", num_attention_heads), ("--num-query-groups", query_groups),
                        ("--ffn-hidden-size", ffn_hidden_size)]:
        if value % tp:
            raise UserError(f"{flag} {value} is not divisible by --tensor-model-parallel-size {tp}; "
                            f"use a tensor-parallel size that divides it")


def check_rope_context(seq_length: int, max_position_embeddings: int) -> None:
    """UserError when a rotary model's sequence exceeds its stated context length (a learned position
    table's fit is ModelConfig.validate's)."""
    if seq_length > max_position_embeddings:
        raise UserError(f"--seq-length {seq_length} exceeds --max-position-embeddings {max_position_embeddings}, "
                        f"the model's stated context length; raise --max-position-embeddings or lower --seq-length")


def check_sequence_split(seq_length: int, cp: int, tp: int = 1, sequence_parallel: bool = False) -> None:
    """UserError unless the sequence cuts into the 2 x CP load-balanced chunks of context parallelism (each CP rank
    holds 2 of them, S/CP tokens) and, under sequence parallelism, those S/CP tokens split over TP."""
    if cp > 1 and seq_length % (2 * cp):
        raise UserError(f"--seq-length {seq_length} is not divisible by 2 x --context-parallel-size {cp} = "
                        f"{2 * cp}, the load-balanced chunks each sequence is cut into; use a multiple of {2 * cp}")
    if sequence_parallel and seq_length % (cp * tp):
        sizes = f"--tensor-model-parallel-size {tp}" + (f" x --context-parallel-size {cp}" if cp > 1 else "")
        raise UserError(f"--seq-length {seq_length} is not divisible by {sizes}, which --sequence-parallel needs; "
                        f"use a multiple of {cp * tp}")


def check_a2a_heads(num_heads: int, size: int) -> None:
    """UserError unless the attention heads per TP rank divide by the CP ranks exchanging them all-to-all (a2a: CP;
    a2a+p2p: its first level)."""
    if num_heads % size:
        raise UserError(f"--cp-comm-type a2a needs the attention heads per tensor-parallel rank ({num_heads}) "
                        f"divisible by the {size} context-parallel ranks exchanging them (--context-parallel-size, "
                        "or a2a+p2p's first --hierarchical-context-parallel-sizes): change one of them, or use "
                        "--cp-comm-type p2p or all_gather")
