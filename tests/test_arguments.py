"""The command line: presets and overrides, derived values, and one test per validation rule."""

import pytest
import torch

from megalite.arguments import GROUPS, list_models, parse_args
from megalite.config import ModelConfig, ParallelConfig, RunConfig, Sharding, TrainConfig
from megalite.config.model import with_tokenizer_vocab
from megalite.config.options import option_fields
from megalite.errors import UserError

MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]


def test_defaults_are_the_default_run():
    run = parse_args([])
    assert run.model_name == "tiny" and run.model.num_layers == 4 and run.model.swiglu
    assert run.data.builtin_corpus and run.checkpoint.save == "runs/default"
    assert run.train.train_iters == 200 and run.train.lr_decay_iters == 200 and run.train.lr_warmup_iters == 20
    assert run.parallel.data_parallel_size == 1


def test_explicit_flags_override_the_preset():
    run = parse_args(["--model", "gpt2-124m", "--num-layers", "2", "--position-embedding-type", "rope",
                      "--disable-bias-linear", "--group-query-attention", "--num-query-groups", "4",
                      "--swiglu", "--seq-length", "128", *MOCK])
    model = run.model
    assert (model.num_layers, model.hidden_size, model.position_embedding_type) == (2, 768, "rope")
    assert not model.add_bias_linear and model.num_query_groups == 4 and model.swiglu
    assert model.seq_length == 128 and model.max_position_embeddings == 1024  # the preset's table stays
    assert run.checkpoint.save is None  # only the default run saves by default


@pytest.mark.parametrize("flags, stage", [
    ([], 0), (["--use-distributed-optimizer"], 1), (["--data-parallel-sharding-strategy", "optim"], 1),
    (["--data-parallel-sharding-strategy", "optim_grads"], 2),
    (["--use-distributed-optimizer", "--data-parallel-sharding-strategy", "optim_grads"], 2),
    (["--data-parallel-sharding-strategy", "optim_grads_params"], 3)])
def test_the_sharding_flags_decide_one_typed_value(flags, stage):
    """Consumers read ParallelConfig.sharding (what is sharded, by ZeRO stage), never the strategy string."""
    sharding = parse_args(flags).parallel.sharding
    assert isinstance(sharding, Sharding) and sharding.stage == stage
    assert (sharding.optimizer_state, sharding.grads, sharding.params) == (stage >= 1, stage >= 2, stage == 3)


@pytest.mark.parametrize("flags", [["--num-layers", "2"], ["--lr", "3e-3"], ["--train-iters", "20"]])
def test_only_the_default_run_saves_and_resumes_without_save(flags):
    """A run on the built-in corpus with any flag is another run: it must not resume (and be refused by)
    the default run's checkpoint in runs/default."""
    run = parse_args(flags)
    assert run.data.builtin_corpus and run.checkpoint.save is None and run.checkpoint.load is None


def test_qkv_bias_and_qk_layernorm_are_megatrons_switches():
    model = parse_args([*MOCK, "--add-qkv-bias", "--qk-layernorm"]).model
    assert model.add_qkv_bias and model.qk_layernorm and not model.add_bias_linear  # tiny has no other biases
    plain = parse_args(MOCK).model
    assert not plain.add_qkv_bias and not plain.qk_layernorm
    qwen3 = parse_args(["--model", "qwen3-0.6b", *MOCK]).model
    assert qwen3.qk_layernorm and qwen3.head_dim == 128 and not qwen3.add_qkv_bias
    assert parse_args(["--model", "qwen2.5-0.5b", *MOCK]).model.add_qkv_bias


def test_tokenizer_vocab_is_padded():
    run = parse_args(MOCK)
    assert run.model.real_vocab_size == 101 and run.model.vocab_size == 128
    model = with_tokenizer_vocab(run.model, 300)
    assert (model.real_vocab_size, model.vocab_size) == (300, 384)


def test_train_samples_warmup_fraction_and_recompute():
    run = parse_args([*MOCK, "--train-samples", "64", "--global-batch-size", "16", "--lr-warmup-fraction", "0.25",
                      "--recompute-activations"])
    assert run.train.train_iters == 4 and run.train.lr_warmup_iters == 1
    assert run.model.recompute_granularity == "selective"
    assert parse_args([*MOCK, "--recompute-granularity", "full"]).model.recompute_granularity == "full"
    # Megatron's example recipe
    model = parse_args([*MOCK, "--recompute-granularity", "full", "--recompute-method", "uniform",
                        "--recompute-num-layers", "1"]).model
    assert (model.recompute_granularity, model.recompute_method, model.recompute_num_layers) == ("full", "uniform", 1)


def test_list_models_prints_every_preset_with_its_size(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--list-models"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out == list_models() + "\n"
    for name, size in [("tiny", "7.1M"), ("gpt2-124m", "124.4M"), ("llama2-7b", "6.74B"), ("llama3-8b", "8.03B"),
                       ("llama3.2-1b", "1.24B"), ("llama-1b", "1.10B"), ("gpt2-350m", "354.8M"),
                       ("qwen2.5-0.5b", "494.0M"), ("qwen3-0.6b", "596.0M"), ("tiny-moe", "8 top-2    11.2M"),
                       ("mixtral-8x7b", "8 top-2   46.70B"), ("qwen3-30b-a3b", "128 top-8   30.53B"),
                       ("deepseek-v2-lite", "64 top-6   15.79B")]:
        line = next(line for line in out.splitlines() if line.startswith(name + " "))
        assert line.endswith(size)


REJECTED = [
    # (flags, world size, words the message must contain)
    (["--model", "gpt5"], 1, ["--model 'gpt5'", "--list-models"]),
    (["--num-layers", "0"], 1, ["--num-layers", "positive"]),
    (["--hidden-size", "100", "--num-attention-heads", "3"], 1, ["--hidden-size 100", "--num-attention-heads 3"]),
    (["--model", "llama2-7b", "--group-query-attention"], 1, ["--group-query-attention", "--num-query-groups"]),
    (["--group-query-attention", "--num-query-groups", "3"], 1, ["--num-query-groups 3", "divide"]),
    (["--model", "gpt2-124m", "--seq-length", "2048"], 1, ["--seq-length 2048", "--max-position-embeddings"]),
    (["--hidden-dropout", "1.5"], 1, ["--hidden-dropout", "[0, 1)"]),
    (["--recompute-activations", "--recompute-granularity", "full"], 1, ["--recompute-activations"]),
    (["--micro-batch-size", "3", "--global-batch-size", "8"], 1, ["--global-batch-size 8", "--micro-batch-size 3"]),
    (["--micro-batch-size", "0"], 1, ["--micro-batch-size must be at least 1"]),
    (["--train-iters", "10", "--train-samples", "160"], 1, ["--train-iters", "--train-samples", "pick one"]),
    (["--train-samples", "8", "--global-batch-size", "16"], 1, ["--train-samples 8", "less than one"]),
    (["--train-samples", "64", "--lr-decay-iters", "2", *MOCK], 1, ["--lr-decay-iters", "--lr-decay-samples"]),
    (["--lr-warmup-samples", "64", *MOCK], 1, ["--lr-warmup-samples", "--lr-warmup-iters"]),
    (["--train-samples", "64", "--lr-warmup-samples", "65", *MOCK], 1, ["--lr-warmup-samples 65",
                                                                       "--lr-decay-samples 64"]),
    (["--rotary-percent", "1.5"], 1, ["--rotary-percent must be in (0, 1]", "1.5"]),
    (["--rotary-percent", "0.3"], 1, ["--rotary-percent 0.3 rotates 19 of a head's 64 channels", "even"]),
    (["--vocab-file", "v.json", *MOCK], 1, ["--vocab-file", "GPT2BPETokenizer"]),
    (["--context-parallel-size", "2"], 1, ["--context-parallel-size 2", "does not divide the world size 1"]),
    (["--context-parallel-size", "4", "--attention-dropout", "0", "--cp-comm-type", "a2a",
      "--num-attention-heads", "6", "--hidden-size", "384", "--num-query-groups", "6"], 4,
     ["--cp-comm-type a2a needs the attention heads per tensor-parallel rank (6)"]),
    (["--context-parallel-size", "0"], 1, ["--context-parallel-size must be at least 1, got 0"]),
    (["--context-parallel-size", "2", "--seq-length", "254"], 2, ["--seq-length 254", "2 x --context-parallel-size "
                                                                  "2 = 4", "multiple of 4"]),
    (["--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups", "4",
      "--context-parallel-size", "2", "--sequence-parallel", "--seq-length", "36"], 8,
     ["--seq-length 36", "--tensor-model-parallel-size 4 x --context-parallel-size 2", "multiple of 8"]),
    (["--context-parallel-size", "2", "--num-experts", "8", "--expert-model-parallel-size", "8"], 4,
     ["--expert-model-parallel-size 8 x --expert-tensor-parallel-size 1 = 8 does not divide the 4 data-parallel x "
      "context-parallel x tensor-parallel ranks per pipeline stage"]),
    (["--dry-run", "--context-parallel-size", "2", "--world-size", "3"], 1,
     ["--world-size 3", "--tensor-model-parallel-size 1 x --context-parallel-size 2 x", "= 2"]),
    (["--ckpt-format", "torch"], 1, ["--ckpt-format torch", "layout-free"]),
    (["--train-iter", "5"], 1, ["unknown flag --train-iter", "did you mean --train-iters?"]),
    (["--seq-len", "5"], 1, ["unknown flag --seq-len", "--seq-length"]),
    (["--fp8-format", "hybrid"], 1, ["--fp8-format", "FP8"]),
    (["--moe-router-topk", "4"], 1, ["--moe-router-topk", "need --num-experts"]),
    (["--lr", "fast"], 1, ["--lr", "invalid float value"]),
    (["--train-iters", "0"], 1, ["--train-iters must be at least 1"]),
    (["--bf16", "--fp16"], 1, ["--bf16 and --fp16 both given; pick one"]),
    (["--bf16", "--fp16", "--fp32"], 1, ["--bf16 and --fp16 and --fp32 all given; pick one"]),
    (["--initial-loss-scale", "1024"], 1, ["--initial-loss-scale", "--fp16"]),
    (["--lr", "-1"], 1, ["--lr is -1.0 but must not be negative; pass a value >= 0"]),
    (["--lr", "0"], 1, ["--min-lr 0.0001 is larger than --lr 0.0"]),
    (["--adam-eps", "0"], 1, ["--adam-eps must be positive, got 0.0"]),
    (["--fp16", "--min-loss-scale", "8", "--initial-loss-scale", "4"], 1, ["--min-loss-scale", "0 < min <= initial"]),
    (["--fp16", "--loss-scale-window", "0"], 1, ["--loss-scale-window is 0 but must be at least 1"]),
    (["--fp16", "--hysteresis", "0"], 1, ["--hysteresis is 0 but must be at least 1"]),
    (["--lr-warmup-iters", "5", "--lr-warmup-fraction", "0.1"], 1, ["--lr-warmup-iters", "--lr-warmup-fraction"]),
    (["--lr-warmup-fraction", "2"], 1, ["--lr-warmup-fraction"]),
    (["--train-samples", "64", "--lr-warmup-iters", "3"], 1, ["--lr-warmup-iters given with --train-samples; the "
                                                              "schedule counts samples, so pass --lr-warmup-samples"]),
    (["--lr-decay-samples", "5"], 1, ["--lr-decay-samples given with --train-iters; the schedule counts iterations, "
                                      "so pass --lr-decay-iters instead"]),
    (["--override-opt_param-scheduler", "--use-checkpoint-opt_param-scheduler"], 1,
     ["--override-opt_param-scheduler and --use-checkpoint-opt_param-scheduler both given; pick one"]),
    (["--adam-beta2", "1.0"], 1, ["--adam-beta2"]),
    (["--adam-beta1", "-0.1"], 1, ["--adam-beta1 -0.1", "must be in [0, 1)"]),
    (["--weight-decay", "-1"], 1, ["--weight-decay"]),
    (["--clip-grad", "-1"], 1, ["--clip-grad must be 0 or more, got -1.0"]),
    (["--eval-iters", "-1"], 1, ["--eval-iters"]),
    (["--log-interval", "0"], 1, ["--log-interval"]),
    (["--exit-interval", "0"], 1, ["--exit-interval"]),
    (["--exit-duration-in-mins", "0"], 1, ["--exit-duration-in-mins"]),
    (["--compile", "--recompute-activations"], 1, ["--compile", "--recompute"]),
    (["--mock-data", "--data-path", "x"], 1, ["--mock-data", "--data-path"]),
    (["--data-path", "x", "--train-data-path", "y", "--tokenizer-type", "NullTokenizer"], 1,
     ["--data-path", "--train/valid/test-data-path"]),
    (["--data-path", "x"], 1, ["--tokenizer-type is required"]),
    (["--tokenizer-type", "NullTokenizer"], 1, ["--tokenizer-type", "built-in corpus"]),
    (["--num-workers", "-1"], 1, ["--num-workers"]),
    (["--save-interval", "10", *MOCK], 1, ["--save-interval", "--save"]),
    (["--save", "out", "--save-interval", "0", *MOCK], 1, ["--save-interval must be at least 1"]),
    (["--exit-signal-handler", *MOCK], 1, ["--exit-signal-handler", "--save"]),
    (["--finetune"], 1, ["--finetune needs --load"]),
    (["--no-load-optim"], 1, ["--no-load-optim needs --load"]),
    (["--no-load-rng"], 1, ["--no-load-rng needs --load"]),
    (["--tensor-model-parallel-size", "0"], 1, ["--tensor-model-parallel-size must be at least 1"]),
    (["--tensor-model-parallel-size", "2"], 3, ["--tensor-model-parallel-size 2", "world size 3"]),
    (["--tensor-model-parallel-size", "8"], 8, ["--num-attention-heads 4", "--tensor-model-parallel-size 8"]),
    (["--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups", "2"], 4,
     ["--num-query-groups 2", "--tensor-model-parallel-size 4"]),
    (["--tensor-model-parallel-size", "4", "--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", "90"], 4,
     ["--ffn-hidden-size 90", "--tensor-model-parallel-size 4"]),
    (["--tensor-model-parallel-size", "2", "--sequence-parallel", "--seq-length", "255"], 2,
     ["--seq-length 255", "--sequence-parallel"]),
    (["--pipeline-model-parallel-size", "3"], 3, ["--num-layers 4", "3 stage(s)", "multiple of 3"]),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "4"], 2,
     ["--num-layers 4", "8 stage(s)"]),
    (["--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "3"], 2,
     ["--num-layers 4", "--num-layers-per-virtual-pipeline-stage 3"]),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--num-layers-per-virtual-pipeline-stage", "1"], 2, ["pick one"]),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--global-batch-size", "24"], 2, ["micro-batch count", "multiple of --pipeline-model-parallel-size 2",
                                        "but it is 3"]),
    (["--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1"], 3,
     ["--num-layers 4", "leaves 3", "other 2"]),
    (["--pipeline-model-parallel-size", "2", "--decoder-last-pipeline-num-layers", "0"], 2,
     ["--decoder-last-pipeline-num-layers must be at least 1"]),
    (["--decoder-first-pipeline-num-layers", "1"], 1, ["--pipeline-model-parallel-size 2 or more"]),
    (["--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank", "2",
      "--decoder-first-pipeline-num-layers", "1"], 2, ["without virtual stages"]),
    (["--num-layers-per-virtual-pipeline-stage", "1"], 1, ["virtual pipeline stages",
                                                           "--pipeline-model-parallel-size 2 or more"]),
    (["--num-virtual-stages-per-pipeline-rank", "2"], 1, ["--pipeline-model-parallel-size 2 or more"]),
    (["--ddp-bucket-size", "0"], 1, ["--ddp-bucket-size must be at least 1"]),
    (["--global-batch-size", "16", "--micro-batch-size", "3"], 2, ["--global-batch-size 16"]),
    (["--distributed-timeout-minutes", "0"], 1, ["--distributed-timeout-minutes"]),
]


@pytest.mark.parametrize("flags, world_size, words", REJECTED, ids=[" ".join(r[0]) or "world" for r in REJECTED])
def test_each_rule_names_the_flags(flags, world_size, words):
    with pytest.raises(UserError) as err:
        parse_args(flags, world_size)
    message = str(err.value)
    for word in words:
        assert word in message, message
    assert "\n" not in message


@pytest.mark.parametrize("cuda, bf16_units, flags, expected", [
    (True, True, [], torch.bfloat16),  # the default on a bf16 GPU
    (True, True, ["--fp32"], torch.float32),
    (True, True, ["--fp16"], torch.float16),
    (True, True, ["--distributed-backend", "gloo"], torch.float32),  # gloo trains on the CPU
    (True, False, [], torch.float32),  # a GPU without bf16 units (V100)
    (False, False, [], torch.float32),  # CPUs
    (False, False, ["--bf16"], torch.bfloat16),
])
def test_precision_defaults_to_bf16_only_on_a_gpu_with_bf16_units(monkeypatch, cuda, bf16_units, flags, expected):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16_units)
    train = parse_args([*MOCK, *flags]).train
    assert train.params_dtype == expected
    assert train.bf16_default == (expected == torch.bfloat16 and not flags)


def test_two_precision_flags_are_refused(monkeypatch):
    with pytest.raises(UserError, match="--bf16 and --fp32 both given; pick one"):
        parse_args([*MOCK, "--bf16", "--fp32"])
    # --bf16 with --fp16 is TrainConfig's rule alone: without its check nothing else refuses them.
    monkeypatch.setattr(TrainConfig, "validate", lambda self: self)
    assert parse_args([*MOCK, "--bf16", "--fp16"]).train.fp16


def test_a_zero_learning_rate_is_a_run_as_in_megatron():
    """Megatron's schedule takes max_lr >= min_lr >= 0: --lr 0 --min-lr 0 trains nothing (a debug run)."""
    train = parse_args([*MOCK, "--lr", "0", "--min-lr", "0"]).train
    assert (train.lr, train.min_lr) == (0.0, 0.0)


# -- the parser is generated from the config dataclasses ------------------------------------------

FIELD_NAMES = {field.name for cls, _ in GROUPS for field, _ in option_fields(cls)}


def test_every_option_field_has_exactly_one_flag_and_every_flag_a_field_or_a_listed_place():
    """Drift guard: each config field is an option or declared derived; each option field owns its
    flag(s) and nothing else does; every other flag is one of arguments.NON_FIELD_FLAGS or of
    config/megatron.py's COMPAT_FLAGS."""
    import argparse
    import dataclasses

    from megalite.arguments import NON_FIELD_FLAGS, build_parser
    from megalite.config.options import flags_of

    parser = build_parser()
    actions = [action for action in parser._actions if not isinstance(action, argparse._HelpAction)]
    flags_by_dest = {}
    for action in actions:
        flags_by_dest.setdefault(action.dest, []).extend(action.option_strings)
    from megalite.config.megatron import COMPAT_FLAGS

    expected, non_field = {}, {flag for _, flags, _ in NON_FIELD_FLAGS for flag in flags}
    non_field |= {compat.flag for compat in COMPAT_FLAGS}
    for cls, _ in GROUPS:
        for field in dataclasses.fields(cls):
            kinds = {"option", "derived"} & set(field.metadata)
            assert len(kinds) == 1, f"{cls.__name__}.{field.name} must be an option() or derived()"
        for field, _ in option_fields(cls):
            assert field.name not in expected, f"{field.name} is an option of two config classes"
            expected[field.name] = sorted(flags_of(field))
    for dest, flags in flags_by_dest.items():
        if dest in expected:
            assert sorted(flags) == expected.pop(dest), f"{dest}: the parser's flags {flags} drifted"
        else:
            assert set(flags) <= non_field, f"{flags} set neither a config field nor a listed non-field flag"
            non_field -= set(flags)
    assert not expected, f"option fields without a flag: {sorted(expected)}"
    assert not non_field, f"listed non-field flags missing from the parser: {sorted(non_field)}"
    every_flag = [flag for action in actions for flag in action.option_strings]
    assert len(every_flag) == len(set(every_flag))


def test_help_shows_every_flags_default():
    """Every flag that takes a value, and every switch of a config field, says its default in --help."""
    from megalite.arguments import build_parser

    for action in build_parser()._actions:
        if action.option_strings[0] in ("-h",) or action.option_strings[0].startswith("--no-"):
            continue
        if action.nargs != 0 or action.dest in FIELD_NAMES:
            assert "(default: " in action.help, action.option_strings


def test_help_starts_with_a_short_usage_and_groups_the_flags_as_megatron():
    import argparse

    from megalite.arguments import build_parser
    from megalite.config.options import HELP_GROUPS

    parser = build_parser()
    lines = parser.format_help().splitlines()
    assert lines[0] == "usage: pretrain_gpt.py [options]"
    assert max(map(len, lines[:4])) <= 80
    first_flag = next(i for i, line in enumerate(lines) if line.startswith("  --"))
    assert first_flag < 15 and lines[first_flag].startswith("  --model NAME")
    groups = [group for group in parser._action_groups if group._group_actions]
    titles = [group.title for group in groups]
    assert all(titles) and len(set(titles)) == len(titles)
    assert [title for title in titles if title in HELP_GROUPS] == list(HELP_GROUPS)  # every one, Megatron's order
    options = next(group for group in groups if group.title == "options")
    assert [type(action) for action in options._group_actions] == [argparse._HelpAction]  # only -h is ungrouped


def switch_defaults() -> list[tuple[str, str, bool]]:
    """(flag, the default --help shows, whether the flag's effect is in force in the default run) for each
    switch of a config field whose help says "on" or "off"."""
    import dataclasses
    import re

    from megalite.arguments import build_parser

    run = parse_args([])
    config_of = {type(getattr(run, field.name)): getattr(run, field.name) for field in dataclasses.fields(run)}
    fields = {field.name: cls for cls, _ in GROUPS for field, _ in option_fields(cls)}
    switches = []
    for action in build_parser()._actions:
        shown = re.search(r"\(default: (?:the --model preset's; tiny: )?(on|off)\)$", action.help or "")
        if action.nargs == 0 and action.dest in fields and shown:
            in_force = getattr(config_of[fields[action.dest]], action.dest) == action.const
            switches.append((action.option_strings[0], shown.group(1), in_force))
    return switches


def test_help_shows_whether_each_switch_is_in_force_by_default_inverted_ones_too():
    """--disable-bias-linear sets add_bias_linear False: tiny has no biases, so its default is on."""
    switches = switch_defaults()
    assert ("--disable-bias-linear", "on", True) in switches
    assert ("--no-manual-gc-eval", "off", False) in switches
    assert ("--swiglu", "on", True) in switches and ("--openai-gelu", "off", False) in switches
    for flag, shown, in_force in switches:
        assert shown == ("on" if in_force else "off"), flag


def test_the_config_is_frozen():
    import dataclasses

    run = parse_args(MOCK)
    for group in (run, run.model, run.parallel, run.train, run.data, run.checkpoint, run.logging):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(group, dataclasses.fields(group)[0].name, None)
    assert run.num_microbatches == 2 and run.parallel.virtual_pipeline_model_parallel_size == 1


def test_arguments_does_not_import_training():
    import subprocess
    import sys

    code = "import sys, megalite.arguments; sys.exit('megalite.run.training' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


# -- leniency where the intent is clear ------------------------------------------------------------

def test_num_query_groups_alone_means_grouped_query_attention():
    assert parse_args(["--num-query-groups", "2"]).model.query_groups == 2  # tiny already is GQA
    assert parse_args(["--num-query-groups", "1"]).model.query_groups == 1
    assert parse_args(["--group-query-attention"]).model.query_groups == 2  # the preset's groups
    run = parse_args(["--model", "llama2-7b", "--num-query-groups", "8", *MOCK])
    assert (run.model.num_attention_heads, run.model.query_groups) == (32, 8)
    # A head count without groups is multi-head attention, as in Megatron (no --group-query-attention).
    assert parse_args(["--num-attention-heads", "8"]).model.query_groups == 8


def test_each_config_is_built_once_and_frozen():
    """Derived defaults are computed before a config is built (`from_flags`, `ModelConfig.of`), never written
    into a frozen one afterwards by a __post_init__."""
    for cls in (*(cls for cls, _ in GROUPS), RunConfig):
        assert cls.__dataclass_params__.frozen and "__post_init__" not in vars(cls), cls.__name__
    train = TrainConfig.from_flags(train_iters=50, lr_warmup_fraction=0.2)
    assert (train.lr_decay_iters, train.lr_warmup_iters) == (50, 10)
    model = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=8, vocab_size=64)
    assert model.ffn_hidden_size is None and ModelConfig.of(**vars(model)) == ModelConfig.of(
        num_layers=1, hidden_size=64, num_attention_heads=4, seq_length=8, vocab_size=64, ffn_hidden_size=256,
        max_position_embeddings=8)


def test_sequence_parallel_at_tp1_is_off_and_said(capsys):
    run = parse_args(["--sequence-parallel", "--use-mcore-models", *MOCK])
    assert not run.parallel.sequence_parallel
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "--use-mcore-models" in out and "--sequence-parallel" in out
    # The rule is ParallelConfig's: a config built in code gets the same, and keeps SP where TP splits.
    assert not ParallelConfig.from_flags(sequence_parallel=True).sequence_parallel
    assert ParallelConfig(tensor_model_parallel_size=2, sequence_parallel=True, world_size=2).sequence_parallel


def test_megatron_flags_megalite_always_meets_are_accepted_without_effect(capsys):
    """--use-megatron-fsdp (megalite's sharding is its FSDP) and --calculate-per-token-loss (its loss always
    is the per-token mean) set no field: the config is the one without them, and the start-up line says so."""
    run = parse_args(["--use-megatron-fsdp", "--calculate-per-token-loss", *MOCK])
    assert capsys.readouterr().out == ("accepted without effect (see --help): --use-megatron-fsdp, "
                                       "--calculate-per-token-loss\n")
    assert run == parse_args(MOCK)


def test_no_abbreviations_and_parser_errors_are_one_sentence():
    from megalite.arguments import build_parser

    assert not build_parser().allow_abbrev
    for argv in (["--train-iter", "5"], ["--tokenizer-type", "TikTokenizer"], ["--lr"], ["stray"]):
        with pytest.raises(UserError) as err:
            parse_args(argv)
        assert "\n" not in str(err.value) and "unrecognized arguments" not in str(err.value)
