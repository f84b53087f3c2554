"""The command line: Megatron-LM's flag names -> a validated, frozen RunConfig (`parse_args`). The parser is
generated from the config dataclasses, plus `NON_FIELD_FLAGS` and Megatron's flags that megalite accepts
without effect or refuses (config/megatron.py)."""

import argparse
import dataclasses
import difflib
import os

from megalite.config import (DEFAULT_RUN_SAVE, MODEL_PRESETS, CheckpointConfig, DataConfig, LoggingConfig, ModelConfig,
                             ParallelConfig, RunConfig, TrainConfig, model_config_from_preset, num_parameters)
from megalite.config.megatron import COMPAT_FLAGS, accepted_flags, refusal_of_unknown
from megalite.config.options import HELP_GROUPS, Option, flags_of, option_fields, value_type
from megalite.config.rules import check_rope_context
from megalite.errors import UserError
from megalite.parallel_state import bf16_is_default

# Each config class's --help group (config/options.py's HELP_GROUPS); an option may name another.
GROUPS = [(ModelConfig, "network size"), (TrainConfig, "training"), (DataConfig, "data and dataloader"),
          (CheckpointConfig, "checkpointing"), (LoggingConfig, "logging"), (ParallelConfig, "distributed")]
GROUP_NOTES = {"network size": "defaults: the --model preset's (each flag says tiny's); see --list-models",
               "logging": "the console, the metrics file and experiment tracking (wandb, TensorBoard)"}
DRY_RUN_GROUP = "dry run (planning a layout)"

# Flags that are not config fields: (group title, flags, argparse keywords).
NON_FIELD_FLAGS = [
    ("network size", ("--model",),
     dict(default="tiny", metavar="NAME", help="named architecture (see --list-models) (default: tiny)")),
    ("network size", ("--list-models",), dict(action="store_true", help="print the presets and exit")),
    ("network size", ("--group-query-attention",),
     dict(action="store_true", help="use --num-query-groups key/value heads")),
    ("training", ("--recompute-activations",),
     dict(action="store_true", help="same as --recompute-granularity selective (the attention core)")),
    ("mixed precision", ("--fp32",), dict(action="store_true", help="fp32 params and compute (the default on CPUs "
                                          "and on GPUs without bf16 units; a dry run plans bf16)")),
    (DRY_RUN_GROUP, ("--dry-run",), dict(action="store_true", help="print each rank's parameters, memory and "
                                         "FLOPs for the layout, then exit: no processes, GPUs or data "
                                         "(megalite/plan/dry_run.py)")),
    (DRY_RUN_GROUP, ("--world-size",),
     dict(type=int, help="with --dry-run: the number of ranks to plan for (default: TP x PP, DP 1)")),
    (DRY_RUN_GROUP, ("--dry-run-gpu-memory",), dict(type=float, metavar="GIB", help="with --dry-run: warn when a "
                                                    "rank needs more than this many GiB (default: 80)")),
    ("logging", ("--debug",), dict(action="store_true", help="show tracebacks of user errors")),
]


COMPAT_GROUP = "Megatron-LM flags accepted without effect (megalite's fixed behaviour is said) or refused"


class Parser(argparse.ArgumentParser):
    """argparse with Megatron's strictness (no abbreviated flags) and megalite's errors: one sentence."""

    def error(self, message: str):
        raise UserError(f"{message}; see python pretrain_gpt.py --help")


def build_parser() -> argparse.ArgumentParser:
    """The pretrain_gpt.py parser, in Megatron-LM's groups: one flag per option field (default None: not
    given; --help shows the field's default), the non-field flags and Megatron's compatibility flags."""
    parser = Parser(prog="pretrain_gpt.py", allow_abbrev=False, usage="%(prog)s [options]",
                    description="Pretrain a GPT / LLaMA model with Megatron-LM's flags, in its groups; with none, "
                                "the tiny model on the built-in corpus (README.md).")
    titles = [*HELP_GROUPS, DRY_RUN_GROUP]
    groups = {title: parser.add_argument_group(title, GROUP_NOTES.get(title)) for title in titles}
    for title, flags, kwargs in NON_FIELD_FLAGS:
        groups[title].add_argument(*flags, **kwargs)
    for cls, title in GROUPS:
        preset = MODEL_PRESETS["tiny"] if cls is ModelConfig else None
        for field, spec in option_fields(cls):
            _add_option(groups[spec.group or title], cls, field, spec, preset)
    compat = parser.add_argument_group(COMPAT_GROUP)
    for flag in COMPAT_FLAGS:
        if flag.takes_value:
            compat.add_argument(flag.flag, dest=flag.dest, metavar="VALUE", help=f"{flag.why} (default: none)")
        else:
            compat.add_argument(flag.flag, dest=flag.dest, action="store_true", help=flag.why)
    return parser


def unknown_flag_error(extras: list[str], parser: argparse.ArgumentParser) -> UserError:
    """One sentence for the first argument the parser did not take: a refused Megatron family, or the
    closest known flag."""
    flags = [arg for arg in extras if arg.startswith("-")]
    if not flags:
        return UserError(f"unexpected argument {extras[0]!r}; every value follows its flag (--flag VALUE), "
                         f"see python pretrain_gpt.py --help")
    flag = flags[0].split("=", 1)[0]
    refusal = refusal_of_unknown(flag)
    if refusal is not None:
        return UserError(refusal)
    near = difflib.get_close_matches(flag, list(parser._option_string_actions), n=1, cutoff=0.6)
    hint = f"did you mean {near[0]}?" if near else "python pretrain_gpt.py --help lists the flags"
    return UserError(f"unknown flag {flag}; {hint}")


def _add_option(group, cls, field: dataclasses.Field, spec: Option, preset: dict | None) -> None:
    flags = flags_of(field)
    own = flags[:-1] if spec.off_flag else flags
    kind, is_list = value_type(cls, field)
    # A switch's default says whether what it does is in force: an inverted one's is the field's negation.
    shown = (lambda value: _shown(not value)) if spec.inverted else _shown
    if preset is not None:  # a model flag: the preset decides what is not given
        tiny = preset.get(field.name, field.default)
        default = f"the --model preset's; tiny: {spec.default_text if tiny is None else shown(tiny)}"
    else:
        default = shown(field.default) if spec.default_text is None else spec.default_text
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
    """Parse and validate; `--list-models` prints the presets and exits. The Megatron-LM flags accepted
    without effect, and what megalite changed to honour a Megatron script, are printed once (rank 0)."""
    parser = build_parser()
    args, extras = parser.parse_known_args(argv)
    if extras:
        raise unknown_flag_error(extras, parser)
    if args.list_models:
        print(list_models())
        raise SystemExit(0)
    if args.dry_run:  # --world-size, or TP x CP x PP (sizes below 1 are ParallelConfig.validate's to report)
        tp, cp, pp = (max(size or 1, 1) for size in (args.tensor_model_parallel_size, args.context_parallel_size,
                                                     args.pipeline_model_parallel_size))
        world_size = tp * cp * pp if args.world_size is None else args.world_size
        if world_size < 1 or world_size % (tp * cp * pp):
            raise UserError(f"--world-size {world_size} is not a positive multiple of --tensor-model-parallel-size "
                            f"{tp} x {f'--context-parallel-size {cp} x ' if cp > 1 else ''}--pipeline-model-"
                            f"parallel-size {pp} = {tp * cp * pp}; use e.g. {tp * cp * pp * 2}")
    elif args.world_size is not None:
        raise UserError("--world-size only applies to --dry-run; a real run's world size is what torchrun "
                        "launches, so drop it (or add --dry-run)")
    if args.dry_run_gpu_memory is not None and not (args.dry_run and args.dry_run_gpu_memory > 0):
        raise UserError(f"--dry-run-gpu-memory {args.dry_run_gpu_memory:g} needs --dry-run and a positive size in "
                        f"GiB (e.g. 80); fix it or drop the flag")
    notes = accepted_flags(args)
    run = run_config_from_args(args, world_size, default_run=not argv)
    if args.megatron_no_position_embedding and run.model.position_embedding_type != "rope":
        raise UserError("--no-position-embedding drops Megatron's learned position table, which megalite keeps with "
                        f"--position-embedding-type {run.model.position_embedding_type}; pass "
                        "--position-embedding-type rope (or drop --no-position-embedding)")
    if args.sequence_parallel and not run.parallel.sequence_parallel:  # ParallelConfig turned it off
        notes.append("--sequence-parallel (off at --tensor-model-parallel-size 1)")
    if notes and os.environ.get("RANK", "0") == "0":
        print(f"accepted without effect (see --help): {', '.join(notes)}", flush=True)
    return run


def run_config_from_args(args: argparse.Namespace, world_size: int = 1, default_run: bool = False) -> RunConfig:
    """The frozen RunConfig of parsed `args`: each group validated, defaults that depend on other
    groups filled in before the group is built, then the cross-group checks. `default_run`: no flags were
    given (`python pretrain_gpt.py`), the one run that saves without --save, into DEFAULT_RUN_SAVE."""
    parallel = ParallelConfig.from_flags(**_given(ParallelConfig, args), world_size=world_size)
    model = _model_config(args, parallel.tensor_model_parallel_size)
    parallel = dataclasses.replace(parallel, virtual_pipeline_model_parallel_size=parallel.virtual_stages(
        model.num_layers))
    data_given = _given(DataConfig, args)
    if "merge_file" in data_given and "tokenizer_type" not in data_given:  # only GPT-2's BPE has merges
        data_given["tokenizer_type"] = "GPT2BPETokenizer"
    builtin = not (data_given.get("mock_data") or any(
        key in data_given for key in ("data_path", "train_data_path", "valid_data_path", "test_data_path")))
    # A dry run reads no data: a tokenizer alone says what vocabulary to plan for.
    builtin = builtin and not (args.dry_run and (args.tokenizer_type or args.tokenizer_model))
    data = DataConfig(**data_given, builtin_corpus=builtin).validate()
    checkpoint_given = _given(CheckpointConfig, args)
    if default_run:  # it keeps its checkpoints and metrics; any other run saves only where told
        checkpoint_given["save"] = DEFAULT_RUN_SAVE
    checkpoint = CheckpointConfig(**checkpoint_given).validate()
    train = _train_config(args, parallel, checkpoint)
    logging = LoggingConfig.from_flags(checkpoint.save, **_given(LoggingConfig, args))
    gpu_memory = {} if args.dry_run_gpu_memory is None else {"dry_run_gpu_memory": args.dry_run_gpu_memory}
    return RunConfig(args.model, model, parallel, train, data, checkpoint, logging, args.dry_run,
                     **gpu_memory).validate()


def _model_config(args, tensor_model_parallel_size: int) -> ModelConfig:
    if args.model not in MODEL_PRESETS:
        model_config_from_preset(args.model)  # raises the unknown-preset message
    overrides = _given(ModelConfig, args)
    preset = MODEL_PRESETS[args.model]
    # --num-query-groups alone says what it means (Megatron also wants --group-query-attention); the
    # preset's groups stand for --group-query-attention alone, and a new head count without groups is
    # multi-head attention, as in Megatron.
    if args.group_query_attention and args.num_query_groups is None and preset.get("num_query_groups") is None:
        raise UserError("--group-query-attention needs --num-query-groups N (key/value heads)")
    if args.num_attention_heads is not None and args.num_query_groups is None and not args.group_query_attention:
        overrides["num_query_groups"] = None
    if args.recompute_activations and args.recompute_granularity == "full":
        raise UserError("--recompute-activations means selective recomputation; drop it or "
                        "--recompute-granularity full")
    if args.recompute_activations:
        overrides["recompute_granularity"] = "selective"
    if args.vocab_size is not None:  # NullTokenizer adds EOD as id V; another tokenizer must fit in it
        overrides["vocab_size"] = args.vocab_size + (args.tokenizer_type == "NullTokenizer")
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
    """TrainConfig's flags and the defaults other groups decide: the precision, the exit signal handler."""
    given = _given(TrainConfig, args)
    precisions = [flag for flag in ("--bf16", "--fp16", "--fp32") if getattr(args, flag[2:])]
    if args.fp32 and len(precisions) > 1:  # --fp32 is no field (--bf16 with --fp16 is TrainConfig's to refuse)
        raise UserError(f"{' and '.join(precisions)} {'both' if len(precisions) == 2 else 'all'} given; pick one")
    # A dry run plans a GPU job (wherever it runs): its default is a bf16 GPU's, unless it plans for gloo.
    plans_gpu = args.dry_run and parallel.distributed_backend != "gloo"
    bf16_default = not precisions and (plans_gpu or bf16_is_default(parallel.distributed_backend))
    given["bf16"] = bool(args.bf16) or bf16_default
    if args.exit_signal_handler is None:  # on by default, where there is a --save to save to
        given["exit_signal_handler"] = checkpoint.save is not None
    return TrainConfig.from_flags(**given, bf16_default=bf16_default)


def list_models() -> str:
    """A table of the presets: shape, vocabulary, sequence length, experts (routed, top-k) and parameter count."""
    width = max(map(len, MODEL_PRESETS))
    rows = [f"{'name':<{width}} {'layers':>6} {'hidden':>6} {'ffn':>6} {'heads':>5} {'kv':>3} {'vocab':>6} "
            f"{'seq':>5}  {'norm':<9} {'pos':<16} {'experts':>9} {'params':>8}"]
    for name in MODEL_PRESETS:
        config = model_config_from_preset(name)
        params = num_parameters(dataclasses.replace(config, vocab_size=config.real_vocab_size))
        size = f"{params / 1e9:.2f}B" if params >= 1e9 else f"{params / 1e6:.1f}M"
        experts = f"{config.num_experts} top-{config.moe_router_topk}" if config.num_experts else "-"
        rows.append(f"{name:<{width}} {config.num_layers:>6} {config.hidden_size:>6} {config.ffn_hidden_size:>6} "
                    f"{config.num_attention_heads:>5} {config.query_groups:>3} {config.real_vocab_size:>6} "
                    f"{config.seq_length:>5}  {config.normalization:<9} {config.position_embedding_type:<16} "
                    f"{experts:>9} {size:>8}")
    return "\n".join(rows)
