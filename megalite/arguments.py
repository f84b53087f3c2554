"""The command line: Megatron-LM's flag names -> a validated RunConfig.

`parse_args(argv, world_size)` is the one place flags are read and checked. Every
problem stops the run with one sentence naming the flags involved and the fix, before
any data is built or any process group is formed.

Model flags start from the preset named by `--model` (default `tiny`); any model flag
given on the command line overrides the preset's value. The model's vocabulary comes
from the tokenizer, which is known only once the data is resolved, so `RunConfig.model`
carries the preset's vocabulary until `with_tokenizer_vocab` replaces it.
"""

import argparse
import dataclasses
import importlib.util
import math
import os

from megalite.config import (
    MODEL_PRESETS, CheckpointConfig, DataConfig, LoggingConfig, ModelConfig, ParallelConfig, RunConfig,
    TrainConfig, model_config_from_preset, num_parameters, pad_vocab_size,
)
from megalite.data.tokenizer import TOKENIZER_TYPES
from megalite.errors import UserError
from megalite.tracking import WANDB_MODES, default_wandb_mode

DEFAULT_TRAIN_ITERS = 200
LR_DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")

# Model flags whose dest is a ModelConfig field of the same name.
MODEL_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
               "kv_channels", "seq_length", "max_position_embeddings", "position_embedding_type",
               "rotary_base", "normalization", "norm_epsilon", "swiglu", "hidden_dropout",
               "attention_dropout", "init_method_std", "make_vocab_size_divisible_by",
               "untie_embeddings_and_output_weights", "openai_gelu", "use_rope_scaling",
               "rope_scaling_factor", "z_loss_weight", "fused_output_cross_entropy")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pretrain_gpt.py", description="Pretrain a GPT / LLaMA model with Megatron-LM's flags.",
        argument_default=None)
    _add_model_args(parser.add_argument_group("model (defaults: the --model preset)"))
    _add_training_args(parser.add_argument_group("training"))
    _add_data_args(parser.add_argument_group("data"))
    _add_checkpoint_args(parser.add_argument_group("checkpoints"))
    _add_logging_args(parser.add_argument_group("logging and evaluation"))
    _add_tracking_args(parser.add_argument_group("experiment tracking (wandb, TensorBoard)"))
    _add_parallel_args(parser.add_argument_group("parallelism"))
    _add_dry_run_args(parser.add_argument_group("planning"))
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    return parser


def _add_model_args(group) -> None:
    group.add_argument("--model", default="tiny", metavar="NAME",
                       help="named architecture (see --list-models); default tiny")
    group.add_argument("--list-models", action="store_true", help="print the presets and exit")
    for flag, kind in [("--num-layers", int), ("--hidden-size", int), ("--ffn-hidden-size", int),
                       ("--num-attention-heads", int), ("--num-query-groups", int), ("--kv-channels", int),
                       ("--seq-length", int), ("--max-position-embeddings", int), ("--rotary-base", float),
                       ("--norm-epsilon", float), ("--hidden-dropout", float), ("--attention-dropout", float),
                       ("--init-method-std", float), ("--make-vocab-size-divisible-by", int),
                       ("--rope-scaling-factor", float), ("--z-loss-weight", float)]:
        group.add_argument(flag, type=kind)
    group.add_argument("--group-query-attention", action="store_true",
                       help="use --num-query-groups key/value heads")
    group.add_argument("--position-embedding-type", choices=("learned_absolute", "rope"))
    group.add_argument("--normalization", choices=("LayerNorm", "RMSNorm"))
    group.add_argument("--swiglu", action="store_true", default=None)
    group.add_argument("--openai-gelu", action="store_true", default=None)
    group.add_argument("--use-rope-scaling", action="store_true", default=None)
    group.add_argument("--untie-embeddings-and-output-weights", action="store_true", default=None)
    group.add_argument("--disable-bias-linear", action="store_true", default=None)
    group.add_argument("--recompute-activations", action="store_true",
                       help="selective recomputation (attention core); same as --recompute-granularity selective")
    group.add_argument("--recompute-granularity", choices=("full", "selective"))
    group.add_argument("--fused-output-cross-entropy", action="store_true", default=None,
                       help="output layer + loss in token chunks, never the full logits (TP = 1); "
                            "costs one more output-layer matmul")


def _add_training_args(group) -> None:
    group.add_argument("--micro-batch-size", type=int, default=8)
    group.add_argument("--global-batch-size", type=int, default=16)
    group.add_argument("--train-iters", type=int, help=f"default {DEFAULT_TRAIN_ITERS}")
    group.add_argument("--train-samples", type=int, help="instead of --train-iters: samples / global batch")
    group.add_argument("--lr", type=float, default=1e-3)
    group.add_argument("--min-lr", type=float, default=1e-4)
    group.add_argument("--lr-decay-style", default="cosine", choices=LR_DECAY_STYLES)
    group.add_argument("--lr-wsd-decay-style", default="exponential", choices=WSD_DECAY_STYLES)
    group.add_argument("--lr-wsd-decay-iters", type=int)
    group.add_argument("--lr-warmup-iters", type=int, help="default 10%% of the decay iterations")
    group.add_argument("--lr-warmup-fraction", type=float)
    group.add_argument("--lr-decay-iters", type=int, help="default: --train-iters")
    group.add_argument("--override-opt_param-scheduler", "--override-opt-param-scheduler",
                       dest="override_opt_param_scheduler", action="store_true",
                       help="on --load, keep this run's LR schedule flags")
    group.add_argument("--use-checkpoint-opt_param-scheduler", "--use-checkpoint-opt-param-scheduler",
                       dest="use_checkpoint_opt_param_scheduler", action="store_true",
                       help="on --load, take the LR schedule from the checkpoint")
    group.add_argument("--weight-decay", type=float, default=0.1)
    group.add_argument("--adam-beta1", type=float, default=0.9)
    group.add_argument("--adam-beta2", type=float, default=0.95)
    group.add_argument("--adam-eps", type=float, default=1e-8)
    group.add_argument("--clip-grad", type=float, default=1.0, help="0 turns clipping off")
    group.add_argument("--seed", type=int, default=1234)
    group.add_argument("--bf16", action="store_true",
                       help="bf16 params and compute, fp32 main params (the default on GPUs with bf16 units)")
    group.add_argument("--fp16", action="store_true", help="fp16 params and compute with dynamic loss scaling")
    group.add_argument("--fp32", action="store_true",
                       help="fp32 params and compute (the default on CPUs and on GPUs without bf16 units)")
    group.add_argument("--initial-loss-scale", type=float, help="fp16 only; default 2^32")
    group.add_argument("--min-loss-scale", type=float, default=1.0, help="fp16: the scale never goes below")
    group.add_argument("--loss-scale-window", type=int, default=1000, help="fp16: clean steps before the scale grows")
    group.add_argument("--hysteresis", type=int, default=2, help="fp16: overflows tolerated before backing off")
    group.add_argument("--compile", action="store_true",
                       help="torch.compile each transformer layer (regional; off by default: no faster on CPUs)")
    group.add_argument("--kernels", choices=("auto", "triton", "torch"), default="auto",
                       help="fused Triton kernels: auto = on CUDA GPUs; triton on a CPU needs TRITON_INTERPRET=1")
    group.add_argument("--exit-interval", type=int, help="stop (and save) when the iteration is a multiple")
    group.add_argument("--exit-duration-in-mins", type=float, help="stop (and save) after this many minutes")
    group.add_argument("--exit-signal-handler", action="store_true", default=None,
                       help="on SIGTERM or SIGINT (any rank), all ranks save at the next iteration boundary and "
                            "exit 0; on by default whenever --save is set")
    group.add_argument("--no-exit-signal-handler", dest="exit_signal_handler", action="store_false",
                       help="let SIGTERM and SIGINT stop the run at once, without saving")
    group.add_argument("--check-for-nan-in-loss-and-grad", action="store_true", default=True,
                       help="stop at a NaN/Inf loss or grad norm (bf16, fp32), naming the last good checkpoint "
                            "(the default)")
    group.add_argument("--no-check-for-nan-in-loss-and-grad", dest="check_for_nan_in_loss_and_grad",
                       action="store_false", help="skip such steps instead of stopping")
    group.add_argument("--loss-spike-threshold", type=float, default=1.5,
                       help="warn when an iteration's loss exceeds this multiple of the median of the "
                            "previous 20; 0 turns it off")


def _add_data_args(group) -> None:
    group.add_argument("--data-path", nargs="+", help="token file prefixes, optionally weighted; "
                       "default: the built-in corpus")
    group.add_argument("--split", default="969,30,1")
    group.add_argument("--train-data-path", nargs="+")
    group.add_argument("--valid-data-path", nargs="+")
    group.add_argument("--test-data-path", nargs="+")
    group.add_argument("--data-cache-path")
    group.add_argument("--mock-data", action="store_true")
    group.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    group.add_argument("--tokenizer-model")
    group.add_argument("--vocab-size", type=int, help="NullTokenizer's vocabulary")
    group.add_argument("--eod-mask-loss", action="store_true")
    group.add_argument("--reset-position-ids", action="store_true")
    group.add_argument("--num-workers", type=int, default=0, help="data loader worker processes")


def _add_checkpoint_args(group) -> None:
    group.add_argument("--save", help="checkpoint folder; the default run uses runs/default")
    group.add_argument("--load", help="resume from the latest checkpoint in this folder; default: --save when "
                       "it holds one")
    group.add_argument("--save-interval", type=int, help="default: save only at the end")
    group.add_argument("--keep-last-n-checkpoints", type=int,
                       help="after each save, delete all but the newest N checkpoints (never the one resumed "
                            "from); default: keep all")
    group.add_argument("--save-retain-interval", type=int,
                       help="with --keep-last-n-checkpoints: also keep checkpoints at multiples of this iteration")
    group.add_argument("--no-load-optim", action="store_true")
    group.add_argument("--no-load-rng", action="store_true")
    group.add_argument("--finetune", action="store_true",
                       help="load only the model weights and start at iteration 0")


def _add_logging_args(group) -> None:
    group.add_argument("--log-interval", type=int, default=10)
    group.add_argument("--eval-interval", type=int, default=100, help="0: only at the end")
    group.add_argument("--eval-iters", type=int, default=5)
    group.add_argument("--metrics-file", help="JSONL metrics; default <save>/metrics.jsonl")
    group.add_argument("--debug-pipeline-schedule", action="store_true",
                       help="print each rank's sends, receives, forwards and backwards as they happen")


def _add_tracking_args(group) -> None:
    group.add_argument("--wandb-project", help="track the run in this wandb project (wandb is off without it)")
    group.add_argument("--wandb-exp-name", help="the wandb run name; default: model, layout and start time")
    group.add_argument("--wandb-entity", help="wandb team or user; default: the account's default entity")
    group.add_argument("--wandb-save-dir", help="where wandb writes its files; default <save>/wandb")
    group.add_argument("--wandb-mode", choices=WANDB_MODES,
                       help="default: WANDB_MODE, else online when an API key is configured, else offline")
    group.add_argument("--tensorboard-dir", help="also write the scalars as TensorBoard events here "
                       "(needs the tensorboard package)")


def _add_parallel_args(group) -> None:
    group.add_argument("--tensor-model-parallel-size", type=int, default=1)
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    group.add_argument("--num-virtual-stages-per-pipeline-rank", type=int)
    group.add_argument("--decoder-first-pipeline-num-layers", type=int,
                       help="layers on the first pipeline stage (the rest split evenly)")
    group.add_argument("--decoder-last-pipeline-num-layers", type=int,
                       help="layers on the last pipeline stage (the rest split evenly)")
    group.add_argument("--sequence-parallel", action="store_true")
    group.add_argument("--use-distributed-optimizer", action="store_true")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="start each bucket's data-parallel reduction during the last backward")
    group.add_argument("--ddp-bucket-size", type=int, default=40_000_000,
                       help="gradient elements per data-parallel bucket")
    group.add_argument("--distributed-backend", choices=("nccl", "gloo"))
    group.add_argument("--distributed-timeout-minutes", type=float, default=10,
                       help="a collective that waits longer (a dead or hung rank) fails the run")


def _add_dry_run_args(group) -> None:
    group.add_argument("--dry-run", action="store_true",
                       help="validate the flags and print each rank's parameters, memory and FLOPs for the "
                            "layout, then exit: no processes, GPUs or data (megalite/dry_run.py)")
    group.add_argument("--world-size", type=int,
                       help="with --dry-run: the number of ranks to plan for; default TP x PP (DP 1)")


def parse_args(argv, world_size: int = 1) -> RunConfig:
    """Parse and validate; `--list-models` prints the presets and exits."""
    args = build_parser().parse_args(argv)
    if args.list_models:
        print(list_models())
        raise SystemExit(0)
    if args.dry_run:
        world_size = _dry_run_world_size(args)
    elif args.world_size is not None:
        raise UserError("--world-size only applies to --dry-run; a real run's world size is what torchrun "
                        "launches, so drop it (or add --dry-run)")
    run = run_config_from_args(args, world_size)
    run.dry_run = args.dry_run
    return run


def _dry_run_world_size(args) -> int:
    """--world-size, or TP x PP; it must be a positive multiple of TP x PP."""
    # Sizes below 1 are reported by _parallel_config, with the flag named.
    tp, pp = max(args.tensor_model_parallel_size, 1), max(args.pipeline_model_parallel_size, 1)
    if args.world_size is None:
        return tp * pp
    if args.world_size < 1 or args.world_size % (tp * pp):
        raise UserError(f"--world-size {args.world_size} is not a positive multiple of --tensor-model-parallel-size "
                        f"{tp} x --pipeline-model-parallel-size {pp} = {tp * pp}; use e.g. {tp * pp * 2}")
    return args.world_size


def run_config_from_args(args: argparse.Namespace, world_size: int = 1) -> RunConfig:
    parallel = _parallel_config(args, world_size)
    model = _model_config(args, parallel.tensor_model_parallel_size)
    _check_tensor_parallel(model, parallel)
    _check_pipeline_parallel(model, parallel)
    data = _data_config(args)
    train = _train_config(args, parallel)
    checkpoint = _checkpoint_config(args, data)
    if args.exit_signal_handler is None:  # on by default, where there is a --save to save to
        train.exit_signal_handler = checkpoint.save is not None
    logging = _logging_config(args, checkpoint)
    # The schedule and the loss scaler check their own flags; build them once to do it now,
    # before any data is built.
    from megalite.training import build_lr_schedule, build_loss_scaler

    run = RunConfig(args.model, model, parallel, train, data, checkpoint, logging)
    build_lr_schedule(run)
    build_loss_scaler(run)
    return run


def _model_config(args, tensor_model_parallel_size: int) -> ModelConfig:
    if args.model not in MODEL_PRESETS:
        model_config_from_preset(args.model)  # raises the unknown-preset message
    overrides = {name: getattr(args, name) for name in MODEL_FLAGS if getattr(args, name) is not None}
    if args.num_query_groups is not None and not args.group_query_attention:
        raise UserError("--num-query-groups needs --group-query-attention; add it "
                        "(or drop --num-query-groups for multi-head attention)")
    if args.group_query_attention and args.num_query_groups is None:
        raise UserError("--group-query-attention needs --num-query-groups N (key/value heads)")
    if args.disable_bias_linear:
        overrides["add_bias_linear"] = False
    if args.recompute_activations and args.recompute_granularity == "full":
        raise UserError("--recompute-activations means selective recomputation; drop it or "
                        "--recompute-granularity full")
    if args.recompute_activations or args.recompute_granularity:
        overrides["recompute_granularity"] = args.recompute_granularity or "selective"
    if args.vocab_size is not None and args.tokenizer_type == "NullTokenizer":
        overrides["vocab_size"] = args.vocab_size + 1  # NullTokenizer adds EOD as id V
    preset = MODEL_PRESETS[args.model]
    rope = overrides.get("position_embedding_type", preset.get("position_embedding_type")) == "rope"
    seq_length = args.seq_length or preset.get("seq_length") or 0
    if rope and args.max_position_embeddings is not None and seq_length > args.max_position_embeddings:
        raise UserError(f"--seq-length {seq_length} exceeds --max-position-embeddings "
                        f"{args.max_position_embeddings}, the model's stated context length; raise "
                        f"--max-position-embeddings or lower --seq-length")
    if rope and args.seq_length is not None and args.max_position_embeddings is None \
            and args.seq_length > (preset.get("max_position_embeddings") or 0):
        # Rotary positions have no table: a longer --seq-length moves the preset's stated limit along.
        overrides["max_position_embeddings"] = args.seq_length
    return model_config_from_preset(args.model, tensor_model_parallel_size, **overrides)


def _check_tensor_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Every dimension TP splits must divide by it; SP also splits the sequence."""
    tp = parallel.tensor_model_parallel_size
    for flag, value in [("--num-attention-heads", model.num_attention_heads),
                        ("--num-query-groups", model.query_groups), ("--ffn-hidden-size", model.ffn_hidden_size)]:
        if value % tp:
            raise UserError(f"{flag} {value} is not divisible by --tensor-model-parallel-size {tp}; "
                            f"use a tensor-parallel size that divides it")
    if model.fused_output_cross_entropy and tp > 1:
        raise UserError(f"--fused-output-cross-entropy works at --tensor-model-parallel-size 1 (got {tp}); under "
                        f"TP the vocab-parallel cross-entropy already keeps only a 1/TP slice of the logits, "
                        f"so drop the flag")
    if parallel.sequence_parallel and tp == 1:
        raise UserError("--sequence-parallel splits the sequence over tensor-parallel ranks, so it needs "
                        "--tensor-model-parallel-size 2 or more; drop --sequence-parallel")
    if parallel.sequence_parallel and model.seq_length % tp:
        raise UserError(f"--seq-length {model.seq_length} is not divisible by --tensor-model-parallel-size {tp}, "
                        f"which --sequence-parallel needs; use a multiple of {tp}")


def _check_pipeline_parallel(model: ModelConfig, parallel: ParallelConfig) -> None:
    """Virtual stages need a pipeline; the layers must split over every virtual stage."""
    from megalite.pipeline_parallel.stages import virtual_stage_layers

    pp, per_stage = parallel.pipeline_model_parallel_size, parallel.num_layers_per_virtual_pipeline_stage
    chunks = parallel.num_virtual_stages_per_pipeline_rank
    if per_stage is not None and chunks is not None:
        raise UserError("--num-layers-per-virtual-pipeline-stage and --num-virtual-stages-per-pipeline-rank "
                        "both given; pick one")
    if per_stage is not None:
        if per_stage < 1 or model.num_layers % (per_stage * pp):
            raise UserError(f"--num-layers {model.num_layers} is not divisible by --num-layers-per-virtual-"
                            f"pipeline-stage {per_stage} x --pipeline-model-parallel-size {pp}; pick values whose "
                            f"product divides the layer count")
        chunks = model.num_layers // (per_stage * pp)
    chunks = 1 if chunks is None else chunks
    if chunks < 1:
        raise UserError(f"--num-virtual-stages-per-pipeline-rank must be at least 1, got {chunks}")
    if chunks > 1 and pp == 1:
        raise UserError("virtual pipeline stages interleave model chunks across pipeline ranks, so they need "
                        "--pipeline-model-parallel-size 2 or more; drop the virtual-stage flag")
    if chunks > 1 and (parallel.decoder_first_pipeline_num_layers or parallel.decoder_last_pipeline_num_layers):
        raise UserError("--decoder-first/last-pipeline-num-layers work without virtual stages only; drop "
                        "one or the other")
    parallel.virtual_pipeline_model_parallel_size = chunks
    virtual_stage_layers(model.num_layers, pp, chunks, parallel.decoder_first_pipeline_num_layers,
                         parallel.decoder_last_pipeline_num_layers)


def with_tokenizer_vocab(model: ModelConfig, tokenizer_vocab_size: int,
                         tensor_model_parallel_size: int = 1) -> ModelConfig:
    """`model` with the tokenizer's vocabulary, padded per --make-vocab-size-divisible-by x TP."""
    padded = pad_vocab_size(tokenizer_vocab_size, model.make_vocab_size_divisible_by, tensor_model_parallel_size)
    return dataclasses.replace(model, vocab_size=padded, tokenizer_vocab_size=tokenizer_vocab_size).validate()


def _parallel_config(args, world_size: int) -> ParallelConfig:
    parallel = ParallelConfig(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        num_layers_per_virtual_pipeline_stage=args.num_layers_per_virtual_pipeline_stage,
        num_virtual_stages_per_pipeline_rank=args.num_virtual_stages_per_pipeline_rank,
        decoder_first_pipeline_num_layers=args.decoder_first_pipeline_num_layers,
        decoder_last_pipeline_num_layers=args.decoder_last_pipeline_num_layers,
        sequence_parallel=args.sequence_parallel, use_distributed_optimizer=args.use_distributed_optimizer,
        overlap_grad_reduce=args.overlap_grad_reduce, ddp_bucket_size=args.ddp_bucket_size,
        distributed_backend=args.distributed_backend,
        distributed_timeout_minutes=args.distributed_timeout_minutes, world_size=world_size)
    tp, pp = parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
    for flag, size in [("--tensor-model-parallel-size", tp), ("--pipeline-model-parallel-size", pp)]:
        if size < 1:
            raise UserError(f"{flag} must be at least 1, got {size}")
    if world_size % (tp * pp):
        raise UserError(
            f"--tensor-model-parallel-size {tp} x --pipeline-model-parallel-size {pp} = {tp * pp} does "
            f"not divide the world size {world_size}; launch a multiple of {tp * pp} processes")
    if not parallel.distributed_timeout_minutes > 0:
        raise UserError(f"--distributed-timeout-minutes must be positive, got {parallel.distributed_timeout_minutes}")
    if parallel.ddp_bucket_size < 1:
        raise UserError(f"--ddp-bucket-size must be at least 1 (gradient elements), got {parallel.ddp_bucket_size}")
    return parallel


def _data_config(args) -> DataConfig:
    per_split = args.train_data_path or args.valid_data_path or args.test_data_path
    if args.mock_data and (args.data_path or per_split):
        raise UserError("--mock-data and --data-path/--train-data-path both given; pick one")
    if args.data_path and per_split:
        raise UserError("--data-path and --train/valid/test-data-path both given; use --data-path "
                        "with --split, or the per-split paths")
    builtin = not (args.mock_data or args.data_path or per_split)
    if builtin and (args.tokenizer_type or args.tokenizer_model):
        raise UserError("--tokenizer-type/--tokenizer-model given without --data-path; the built-in "
                        "corpus has its own tokenizer, so pass --data-path too (or drop them)")
    if not builtin and args.tokenizer_type is None:
        raise UserError("--tokenizer-type is required with --data-path or --mock-data "
                        "(e.g. --tokenizer-type NullTokenizer --vocab-size 1000 with --mock-data)")
    if args.vocab_size is not None and args.tokenizer_type != "NullTokenizer":
        raise UserError("--vocab-size only applies to --tokenizer-type NullTokenizer; drop it (the "
                        "tokenizer sets the vocabulary, padded per --make-vocab-size-divisible-by)")
    if args.num_workers < 0:
        raise UserError(f"--num-workers must be 0 or more, got {args.num_workers}")
    return DataConfig(
        data_path=args.data_path, split=args.split, train_data_path=args.train_data_path,
        valid_data_path=args.valid_data_path, test_data_path=args.test_data_path,
        data_cache_path=args.data_cache_path, mock_data=args.mock_data, tokenizer_type=args.tokenizer_type,
        tokenizer_model=args.tokenizer_model, vocab_size=args.vocab_size, eod_mask_loss=args.eod_mask_loss,
        reset_position_ids=args.reset_position_ids, num_workers=args.num_workers, builtin_corpus=builtin)


def _train_config(args, parallel: ParallelConfig) -> TrainConfig:
    _check_positive(("--micro-batch-size", args.micro_batch_size), ("--global-batch-size", args.global_batch_size))
    train_iters = _train_iters(args)
    precisions = [flag for flag in ("--bf16", "--fp16", "--fp32") if getattr(args, flag[2:])]
    if len(precisions) > 1:
        raise UserError(f"{' and '.join(precisions)} {'both' if len(precisions) == 2 else 'all'} given; pick one")
    from megalite.parallel_state import bf16_is_default

    bf16_default = not precisions and bf16_is_default(parallel.distributed_backend)
    if args.initial_loss_scale is not None and not args.fp16:
        raise UserError("--initial-loss-scale only applies with --fp16; add --fp16 or drop it")
    if args.initial_loss_scale is not None and args.initial_loss_scale <= 0:
        raise UserError(f"--initial-loss-scale must be positive, got {args.initial_loss_scale}")
    decay_iters = args.lr_decay_iters if args.lr_decay_iters is not None else train_iters
    warmup_iters = _warmup_iters(args, decay_iters)
    if args.lr <= 0:
        raise UserError(f"--lr must be positive, got {args.lr}")
    if args.override_opt_param_scheduler and args.use_checkpoint_opt_param_scheduler:
        raise UserError("--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler both "
                        "given; pick one")
    if not 0 <= args.adam_beta1 < 1 or not 0 <= args.adam_beta2 < 1:
        raise UserError(f"--adam-beta1 {args.adam_beta1} and --adam-beta2 {args.adam_beta2} must be in [0, 1)")
    for flag, value in [("--adam-eps", args.adam_eps), ("--weight-decay", args.weight_decay),
                        ("--clip-grad", args.clip_grad), ("--eval-interval", args.eval_interval),
                        ("--eval-iters", args.eval_iters)]:
        if value < 0:
            raise UserError(f"{flag} must be 0 or more, got {value}")
    if args.loss_spike_threshold != 0 and not args.loss_spike_threshold > 1:
        raise UserError(f"--loss-spike-threshold must be above 1 (a multiple of the recent median loss) or 0 to turn "
                        f"the warning off, got {args.loss_spike_threshold}")
    if args.exit_interval is not None and args.exit_interval < 1:
        raise UserError(f"--exit-interval must be at least 1, got {args.exit_interval}")
    if args.exit_duration_in_mins is not None and args.exit_duration_in_mins <= 0:
        raise UserError(f"--exit-duration-in-mins must be positive, got {args.exit_duration_in_mins}")
    if args.compile and (args.recompute_activations or args.recompute_granularity):
        raise UserError("--compile with --recompute-* is not supported; drop one of them")
    from megalite.data.loader import check_batch_sizes
    from megalite.kernels import check_kernels

    check_kernels(args.kernels)

    check_batch_sizes(args.global_batch_size, args.micro_batch_size, parallel.data_parallel_size)
    from megalite.pipeline_parallel.schedules import check_microbatches

    check_microbatches(args.global_batch_size // (args.micro_batch_size * parallel.data_parallel_size),
                       parallel.pipeline_model_parallel_size, parallel.virtual_pipeline_model_parallel_size)
    return TrainConfig(
        micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
        train_iters=train_iters, lr=args.lr, min_lr=args.min_lr, lr_decay_style=args.lr_decay_style,
        lr_wsd_decay_style=args.lr_wsd_decay_style, lr_wsd_decay_iters=args.lr_wsd_decay_iters,
        lr_warmup_iters=warmup_iters, lr_decay_iters=decay_iters,
        override_opt_param_scheduler=args.override_opt_param_scheduler,
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        weight_decay=args.weight_decay, adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2,
        adam_eps=args.adam_eps, clip_grad=args.clip_grad, seed=args.seed, bf16=args.bf16 or bf16_default,
        bf16_default=bf16_default, fp16=args.fp16,
        initial_loss_scale=args.initial_loss_scale or 2.0 ** 32, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis, compile=args.compile,
        kernels=args.kernels,
        eval_interval=args.eval_interval, eval_iters=args.eval_iters, exit_interval=args.exit_interval,
        exit_duration_in_mins=args.exit_duration_in_mins, exit_signal_handler=bool(args.exit_signal_handler),
        check_for_nan_in_loss_and_grad=args.check_for_nan_in_loss_and_grad,
        loss_spike_threshold=args.loss_spike_threshold)


def _train_iters(args) -> int:
    if args.train_iters is not None and args.train_samples is not None:
        raise UserError("--train-iters and --train-samples both given; pick one")
    if args.train_samples is not None:
        if args.train_samples < 1 or args.train_samples % args.global_batch_size:
            raise UserError(
                f"--train-samples {args.train_samples} is not a positive multiple of --global-batch-size "
                f"{args.global_batch_size}; use e.g. {max(1, args.train_samples // args.global_batch_size) * args.global_batch_size}")
        return args.train_samples // args.global_batch_size
    train_iters = DEFAULT_TRAIN_ITERS if args.train_iters is None else args.train_iters
    if train_iters < 1:
        raise UserError(f"--train-iters must be at least 1, got {train_iters}")
    return train_iters


def _warmup_iters(args, decay_iters: int) -> int:
    if args.lr_warmup_iters is not None and args.lr_warmup_fraction is not None:
        raise UserError("--lr-warmup-iters and --lr-warmup-fraction both given; pick one")
    if args.lr_warmup_fraction is not None:
        if not 0 <= args.lr_warmup_fraction <= 1:
            raise UserError(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
        return int(math.floor(args.lr_warmup_fraction * decay_iters))
    if args.lr_warmup_iters is not None:
        return args.lr_warmup_iters
    return decay_iters // 10


def _checkpoint_config(args, data: DataConfig) -> CheckpointConfig:
    save = args.save
    if save is None and data.builtin_corpus:
        save = "runs/default"
    if args.save_interval is not None:
        if save is None:
            raise UserError("--save-interval needs --save DIR (where to write checkpoints)")
        if args.save_interval < 1:
            raise UserError(f"--save-interval must be at least 1, got {args.save_interval}")
    if args.exit_signal_handler and save is None:
        raise UserError("--exit-signal-handler saves a checkpoint on SIGTERM, so it needs --save DIR")
    for flag, value in [("--keep-last-n-checkpoints", args.keep_last_n_checkpoints),
                        ("--save-retain-interval", args.save_retain_interval)]:
        if value is not None and value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")
    if args.keep_last_n_checkpoints is not None and save is None:
        raise UserError("--keep-last-n-checkpoints needs --save DIR (the folder whose old checkpoints it deletes)")
    if args.save_retain_interval is not None and args.keep_last_n_checkpoints is None:
        raise UserError("--save-retain-interval only matters with --keep-last-n-checkpoints N (every checkpoint "
                        "is kept otherwise); add it or drop --save-retain-interval")
    if (args.finetune or args.no_load_optim or args.no_load_rng) and args.load is None:
        flag = "--finetune" if args.finetune else "--no-load-optim" if args.no_load_optim else "--no-load-rng"
        raise UserError(f"{flag} needs --load DIR (the checkpoint to start from)")
    return CheckpointConfig(save=save, load=args.load, save_interval=args.save_interval,
                            keep_last_n_checkpoints=args.keep_last_n_checkpoints,
                            save_retain_interval=args.save_retain_interval,
                            no_load_optim=args.no_load_optim, no_load_rng=args.no_load_rng,
                            finetune=args.finetune)


def _logging_config(args, checkpoint: CheckpointConfig) -> LoggingConfig:
    if args.log_interval < 1:
        raise UserError(f"--log-interval must be at least 1, got {args.log_interval}")
    if args.wandb_project is None:
        for flag in ("--wandb-exp-name", "--wandb-entity", "--wandb-save-dir", "--wandb-mode"):
            if getattr(args, flag[2:].replace("-", "_")) is not None:
                raise UserError(f"{flag} needs --wandb-project NAME (wandb tracks a run only when a project "
                                f"is given); add it or drop {flag}")
    elif not args.wandb_project.strip():
        raise UserError("--wandb-project is empty; give a project name (or drop the flag)")
    mode = args.wandb_mode or default_wandb_mode()
    if args.wandb_project and mode != "disabled" and importlib.util.find_spec("wandb") is None:
        raise UserError("--wandb-project needs the wandb package, which is not installed; "
                        "pip install -r requirements.txt (or use --wandb-mode disabled)")
    if args.tensorboard_dir is not None and importlib.util.find_spec("tensorboard") is None:
        raise UserError("--tensorboard-dir needs the tensorboard package, which is not installed; "
                        "pip install tensorboard (or drop --tensorboard-dir)")
    save_dir = args.wandb_save_dir
    if save_dir is None and checkpoint.save is not None:
        save_dir = os.path.join(checkpoint.save, "wandb")
    return LoggingConfig(log_interval=args.log_interval, metrics_file=args.metrics_file,
                         debug_pipeline_schedule=args.debug_pipeline_schedule,
                         wandb_project=args.wandb_project, wandb_exp_name=args.wandb_exp_name,
                         wandb_entity=args.wandb_entity, wandb_save_dir=save_dir, wandb_mode=mode,
                         tensorboard_dir=args.tensorboard_dir)


def _check_positive(*flags_values) -> None:
    for flag, value in flags_values:
        if value < 1:
            raise UserError(f"{flag} must be at least 1, got {value}")


def list_models() -> str:
    """A table of the presets: shape, vocabulary, sequence length and parameter count."""
    header = f"{'name':<12} {'layers':>6} {'hidden':>6} {'ffn':>6} {'heads':>5} {'kv':>3} {'vocab':>6} " \
             f"{'seq':>5}  {'norm':<9} {'pos':<16} {'params':>8}"
    rows = [header]
    for name in MODEL_PRESETS:
        config = model_config_from_preset(name)
        params = num_parameters(dataclasses.replace(config, vocab_size=config.real_vocab_size))
        rows.append(f"{name:<12} {config.num_layers:>6} {config.hidden_size:>6} {config.ffn_hidden_size:>6} "
                    f"{config.num_attention_heads:>5} {config.query_groups:>3} {config.real_vocab_size:>6} "
                    f"{config.seq_length:>5}  {config.normalization:<9} {config.position_embedding_type:<16} "
                    f"{_human(params):>8}")
    return "\n".join(rows)


def _human(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e9 else f"{count / 1e6:.1f}M"
