"""The command line: Megatron-LM's flag names -> a validated, frozen RunConfig (`parse_args`). The
parser is generated from the config dataclasses, plus `NON_FIELD_FLAGS`. The vocabulary is the
preset's (or NullTokenizer's) until the Trainer knows the tokenizer (`RunConfig.with_tokenizer_vocab`)."""

import argparse
import dataclasses
import math

from megalite.config import (MODEL_PRESETS, CheckpointConfig, DataConfig, LoggingConfig, ModelConfig, ParallelConfig,
                             RunConfig, TrainConfig, model_config_from_preset, num_parameters)
from megalite.config.options import Option, flags_of, option_fields, value_type
from megalite.config.rules import check_rampup, check_rope_context, iterations_for_samples
from megalite.errors import UserError
from megalite.parallel_state import bf16_is_default
from megalite.run.tracking import with_wandb_defaults

MODEL_GROUP = "model (defaults: the --model preset's values)"
# The config classes on the command line, each one argument group, in --help order.
GROUPS = [(ModelConfig, MODEL_GROUP), (TrainConfig, "training"), (DataConfig, "data"),
          (CheckpointConfig, "checkpoints"), (LoggingConfig, "logging and experiment tracking (wandb, TensorBoard)"),
          (ParallelConfig, "parallelism")]

# Flags that are not config fields: (group title, flags, argparse keywords), read by parse_args
# and run_config_from_args.
NON_FIELD_FLAGS = [
    (MODEL_GROUP, ("--model",), dict(default="tiny", metavar="NAME", help="named architecture (see --list-models) "
                                                                          "(default: tiny)")),
    (MODEL_GROUP, ("--list-models",), dict(action="store_true", help="print the presets and exit")),
    (MODEL_GROUP, ("--group-query-attention",), dict(action="store_true", help="use --num-query-groups key/value "
                                                                                "heads")),
    (MODEL_GROUP, ("--recompute-activations",), dict(action="store_true", help="same as --recompute-granularity "
                                                                                "selective (the attention core)")),
    ("training", ("--train-samples",), dict(type=int, help="instead of --train-iters: samples / global batch "
                                                           "(default: none)")),
    ("training", ("--lr-warmup-fraction",), dict(type=float, help="instead of --lr-warmup-iters: a fraction of "
                                                                   "the decay iterations (default: none)")),
    ("training", ("--fp32",), dict(action="store_true", help="fp32 params and compute (the default on CPUs and "
                                                             "on GPUs without bf16 units)")),
    ("planning", ("--dry-run",), dict(action="store_true", help="print each rank's parameters, memory and FLOPs "
                                                                "for the layout, then exit: no processes, GPUs or "
                                                                "data (megalite/plan/dry_run.py)")),
    ("planning", ("--world-size",), dict(type=int, help="with --dry-run: the number of ranks to plan for "
                                                        "(default: TP x PP, DP 1)")),
    (None, ("--debug",), dict(action="store_true", help="show tracebacks of user errors")),
]


def build_parser() -> argparse.ArgumentParser:
    """The pretrain_gpt.py parser: one flag per option field (default None: not given), then the
    non-field flags. --help shows each flag's default."""
    parser = argparse.ArgumentParser(prog="pretrain_gpt.py",
                                     description="Pretrain a GPT / LLaMA model with Megatron-LM's flags.")
    groups = {title: parser.add_argument_group(title) for _, title in GROUPS}
    for title, flags, kwargs in NON_FIELD_FLAGS:
        if title is not None and title not in groups:
            groups[title] = parser.add_argument_group(title)
        (parser if title is None else groups[title]).add_argument(*flags, **kwargs)
    for cls, title in GROUPS:
        preset = MODEL_PRESETS["tiny"] if cls is ModelConfig else None
        for field, spec in option_fields(cls):
            _add_option(groups[title], cls, field, spec, preset)
    return parser


def _add_option(group, cls, field: dataclasses.Field, spec: Option, preset: dict | None) -> None:
    flags = flags_of(field)
    own = flags[:-1] if spec.off_flag else flags
    kind, is_list = value_type(cls, field)
    if preset is not None:  # a model flag: the preset decides what is not given
        tiny = preset.get(field.name, field.default)
        default = f"the --model preset's; tiny: {spec.default_text if tiny is None else _shown(tiny)}"
    else:
        default = _shown(field.default) if spec.default_text is None else spec.default_text
    text = f"{spec.help} (default: {default})".replace("%", "%%")
    common = dict(dest=field.name, default=None)
    if kind is bool:
        group.add_argument(*own, action="store_const", const=not spec.inverted, help=text, **common)
        if spec.off_flag:
            group.add_argument(spec.off_flag, action="store_const", const=False, help=f"turn {own[0]} off", **common)
        return
    group.add_argument(*own, type=kind, choices=spec.choices, nargs="+" if is_list else None, help=text, **common)


def _shown(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def _given(cls, args: argparse.Namespace) -> dict:
    """The option fields of `cls` the command line set."""
    return {field.name: getattr(args, field.name) for field, _ in option_fields(cls)
            if getattr(args, field.name) is not None}


def parse_args(argv, world_size: int = 1) -> RunConfig:
    """Parse and validate; `--list-models` prints the presets and exits."""
    args = build_parser().parse_args(argv)
    if args.list_models:
        print(list_models())
        raise SystemExit(0)
    if args.dry_run:  # --world-size, or TP x PP (sizes below 1 are ParallelConfig.validate's to report)
        tp, pp = max(args.tensor_model_parallel_size or 1, 1), max(args.pipeline_model_parallel_size or 1, 1)
        world_size = tp * pp if args.world_size is None else args.world_size
        if world_size < 1 or world_size % (tp * pp):
            raise UserError(f"--world-size {world_size} is not a positive multiple of --tensor-model-parallel-size "
                            f"{tp} x --pipeline-model-parallel-size {pp} = {tp * pp}; use e.g. {tp * pp * 2}")
    elif args.world_size is not None:
        raise UserError("--world-size only applies to --dry-run; a real run's world size is what torchrun "
                        "launches, so drop it (or add --dry-run)")
    return run_config_from_args(args, world_size)


def run_config_from_args(args: argparse.Namespace, world_size: int = 1) -> RunConfig:
    """The frozen RunConfig of parsed `args`: each group validated, defaults that depend on other
    groups filled in before the group is built, then the cross-group checks."""
    parallel = ParallelConfig(**_given(ParallelConfig, args), world_size=world_size).validate()
    model = _model_config(args, parallel.tensor_model_parallel_size)
    parallel = dataclasses.replace(parallel, virtual_pipeline_model_parallel_size=parallel.virtual_stages(
        model.num_layers))
    data_given = _given(DataConfig, args)
    builtin = not (data_given.get("mock_data") or any(
        key in data_given for key in ("data_path", "train_data_path", "valid_data_path", "test_data_path")))
    data = DataConfig(**data_given, builtin_corpus=builtin).validate()
    checkpoint_given = _given(CheckpointConfig, args)
    if builtin:  # the default run keeps its checkpoints and metrics
        checkpoint_given.setdefault("save", "runs/default")
    checkpoint = CheckpointConfig(**checkpoint_given).validate()
    train = _train_config(args, parallel, checkpoint)
    logging = with_wandb_defaults(LoggingConfig(**_given(LoggingConfig, args)).validate(), checkpoint.save)
    return RunConfig(args.model, model, parallel, train, data, checkpoint, logging, args.dry_run).validate()


def _model_config(args, tensor_model_parallel_size: int) -> ModelConfig:
    if args.model not in MODEL_PRESETS:
        model_config_from_preset(args.model)  # raises the unknown-preset message
    overrides = _given(ModelConfig, args)
    if args.num_query_groups is not None and not args.group_query_attention:
        raise UserError("--num-query-groups needs --group-query-attention; add it "
                        "(or drop --num-query-groups for multi-head attention)")
    if args.group_query_attention and args.num_query_groups is None:
        raise UserError("--group-query-attention needs --num-query-groups N (key/value heads)")
    if args.recompute_activations and args.recompute_granularity == "full":
        raise UserError("--recompute-activations means selective recomputation; drop it or "
                        "--recompute-granularity full")
    if args.recompute_activations:
        overrides["recompute_granularity"] = "selective"
    if args.vocab_size is not None and args.tokenizer_type == "NullTokenizer":
        overrides["vocab_size"] = args.vocab_size + 1  # NullTokenizer adds EOD as id V
    preset = MODEL_PRESETS[args.model]
    rope = overrides.get("position_embedding_type", preset.get("position_embedding_type")) == "rope"
    seq_length = args.seq_length or preset.get("seq_length") or 0
    if rope and args.max_position_embeddings is not None:
        check_rope_context(seq_length, args.max_position_embeddings)
    if rope and args.seq_length is not None and args.max_position_embeddings is None \
            and args.seq_length > (preset.get("max_position_embeddings") or 0):
        # Rotary positions have no table: a longer --seq-length moves the preset's stated limit along.
        overrides["max_position_embeddings"] = args.seq_length
    return model_config_from_preset(args.model, tensor_model_parallel_size, **overrides)


def _train_config(args, parallel: ParallelConfig, checkpoint: CheckpointConfig) -> TrainConfig:
    given = _given(TrainConfig, args)
    if args.train_samples is not None:
        if args.train_iters is not None:
            raise UserError("--train-iters and --train-samples both given; pick one")
        batch = given.get("global_batch_size", TrainConfig.global_batch_size)
        rampup = given.get("rampup_batch_size")
        if rampup is not None:  # Megatron's count: the ramp's iterations, then whole global batches
            check_rampup(rampup, batch)
            given["train_iters"] = iterations_for_samples(args.train_samples, batch, rampup)
        elif batch >= 1 and (args.train_samples < 1 or args.train_samples % batch):  # batch < 1: validate says
            raise UserError(f"--train-samples {args.train_samples} is not a positive multiple of --global-batch-size "
                            f"{batch}; use e.g. {max(1, args.train_samples // batch) * batch}")
        else:
            given["train_iters"] = args.train_samples // max(batch, 1)
    precisions = [flag for flag in ("--bf16", "--fp16", "--fp32") if getattr(args, flag[2:])]
    if len(precisions) > 1:
        raise UserError(f"{' and '.join(precisions)} {'both' if len(precisions) == 2 else 'all'} given; pick one")
    bf16_default = not precisions and bf16_is_default(parallel.distributed_backend)
    given["bf16"] = bool(args.bf16) or bf16_default
    if args.lr_warmup_iters is not None and args.lr_warmup_fraction is not None:
        raise UserError("--lr-warmup-iters and --lr-warmup-fraction both given; pick one")
    if args.lr_warmup_fraction is not None and not 0 <= args.lr_warmup_fraction <= 1:
        raise UserError(f"--lr-warmup-fraction must be in [0, 1], got {args.lr_warmup_fraction}")
    if args.exit_signal_handler is None:  # on by default, where there is a --save to save to
        given["exit_signal_handler"] = checkpoint.save is not None
    train = TrainConfig(**given, bf16_default=bf16_default)
    if args.lr_warmup_fraction is not None:  # a fraction of the decay iterations TrainConfig derived
        train = dataclasses.replace(train, lr_warmup_iters=math.floor(args.lr_warmup_fraction * train.lr_decay_iters))
    return train.validate()


def list_models() -> str:
    """A table of the presets: shape, vocabulary, sequence length and parameter count."""
    rows = [f"{'name':<12} {'layers':>6} {'hidden':>6} {'ffn':>6} {'heads':>5} {'kv':>3} {'vocab':>6} "
            f"{'seq':>5}  {'norm':<9} {'pos':<16} {'params':>8}"]
    for name in MODEL_PRESETS:
        config = model_config_from_preset(name)
        params = num_parameters(dataclasses.replace(config, vocab_size=config.real_vocab_size))
        size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
        rows.append(f"{name:<12} {config.num_layers:>6} {config.hidden_size:>6} {config.ffn_hidden_size:>6} "
                    f"{config.num_attention_heads:>5} {config.query_groups:>3} {config.real_vocab_size:>6} "
                    f"{config.seq_length:>5}  {config.normalization:<9} {config.position_embedding_type:<16} "
                    f"{size:>8}")
    return "\n".join(rows)
