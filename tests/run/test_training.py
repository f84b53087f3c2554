"""The training loop end to end, in process: exact resume, precision modes, stopping rules."""

import json
import os
import sys

import numpy as np
import pytest
import torch

from megalite.arguments import parse_args
from megalite.checkpoint import load_checkpoint
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.errors import UserError
from megalite.model.gpt import build_model
from megalite.run.tracking import scalars_of
from megalite.run.training import Trainer, pretrain
from tests.helpers.model import token_losses
from tests.helpers.runs import MOCK, SMALL


# On a GPU, bitwise resume needs deterministic kernels (attention and embedding grads use atomics).
pytestmark = pytest.mark.usefixtures("one_thread", *(["deterministic"] if torch.cuda.is_available() else []))


@pytest.fixture(scope="module")
def token_file(tmp_path_factory) -> str:
    """A real .bin/.idx file: 300 documents of random NullTokenizer ids below 99."""
    prefix = str(tmp_path_factory.mktemp("tokens") / "random_text_document")
    rng = np.random.default_rng(0)
    with IndexedDatasetBuilder(prefix, dtype=np.uint16) as builder:
        for _ in range(300):
            builder.add_document(rng.integers(0, 99, rng.integers(5, 40)).tolist() + [99])
    return prefix


def train(*flags, quiet=True):
    lines = []
    trainer, state = pretrain(parse_args([*SMALL, *flags]), log=lines.append if quiet else print)
    return trainer, state, lines


def data_flags(kind: str, token_file: str) -> list[str]:
    if kind == "mock":
        return MOCK
    return ["--data-path", token_file, "--split", "90,5,5", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99"]


@pytest.mark.parametrize("kind", ["mock", "real"])
def test_resume_is_bitwise_exact(tmp_path, token_file, kind):
    """8 iterations straight == 4 iterations, exit, --load, 4 more (dropout on, to test the RNG)."""
    common = [*data_flags(kind, token_file), "--train-iters", "8", "--hidden-dropout", "0.1"]
    _, straight, _ = train(*common, "--save", str(tmp_path / "a"))
    _, first, _ = train(*common, "--save", str(tmp_path / "b"), "--exit-interval", "4")
    assert first.exit_reason == "--exit-interval 4" and first.iteration == 4
    _, second, lines = train(*common, "--save", str(tmp_path / "b"), "--load", str(tmp_path / "b"))
    assert any("loaded" in line and "iteration 4" in line for line in lines)
    assert first.losses + second.losses == straight.losses  # bitwise: == on Python floats
    assert len(set(straight.losses)) == 8
    # The metrics of the resumed run continue the first run's file without duplicates.
    records = [json.loads(line) for line in open(tmp_path / "b" / "metrics.jsonl")]
    iterations = [r["iteration"] for r in records if "split" not in r]
    assert iterations == [2, 4, 6, 8]
    straight_records = [json.loads(line) for line in open(tmp_path / "a" / "metrics.jsonl")]
    assert [r["lm_loss"] for r in records] == [r["lm_loss"] for r in straight_records]


@pytest.mark.parametrize("iters, save_interval", [(6, 3), (4, 4), (4, 3)],
                         ids=["saved-with-the-validation", "saved-before-the-end-evaluations", "saved-after-them"])
def test_running_a_finished_run_again_leaves_its_metrics_as_they_were(tmp_path, iters, save_interval):
    """The README's "the same command every time" on a finished run: whichever evaluations of the last iteration
    came after its checkpoint are done again on the same batches, and none is logged twice."""
    flags = [*MOCK, "--train-iters", str(iters), "--save-interval", str(save_interval), "--save", str(tmp_path)]
    train(*flags)
    finished = (tmp_path / "metrics.jsonl").read_text()
    assert [json.loads(line).get("split") for line in finished.splitlines()][-2:] == ["valid", "test"]
    _, state, lines = train(*flags)
    assert state.iteration == iters and any("nothing to train" in line for line in lines)
    assert (tmp_path / "metrics.jsonl").read_text() == finished


def test_without_the_rng_state_dropout_differs(tmp_path):
    common = [*MOCK, "--train-iters", "4", "--hidden-dropout", "0.1", "--save", str(tmp_path)]
    _, straight, _ = train(*common[:-2])
    train(*common, "--exit-interval", "2")
    _, second, _ = train(*common, "--load", str(tmp_path), "--no-load-rng")
    assert second.losses[0] != straight.losses[2]


def test_finetune_loads_weights_and_restarts_counting(tmp_path):
    train(*MOCK, "--train-iters", "4", "--save", str(tmp_path / "base"))
    trainer, state, lines = train(*MOCK, "--train-iters", "2", "--load", str(tmp_path / "base"), "--finetune",
                                  "--save", str(tmp_path / "ft"))
    assert state.iteration == 2 and any("--finetune" in line for line in lines)
    fresh_trainer, fresh, _ = train(*MOCK, "--train-iters", "2")
    assert state.losses[0] < fresh.losses[0] - 0.05  # it starts from the trained weights


def test_load_refuses_a_different_model(tmp_path):
    train(*MOCK, "--train-iters", "2", "--save", str(tmp_path))
    with pytest.raises(UserError, match="num_layers .checkpoint 2, now 3."):
        train(*MOCK, "--train-iters", "4", "--load", str(tmp_path), "--num-layers", "3")


def test_load_of_an_empty_folder(tmp_path):
    with pytest.raises(UserError, match="holds no checkpoint"):
        train(*MOCK, "--train-iters", "2", "--load", str(tmp_path / "nothing"))
    # --load equal to --save and still empty: a fresh start (the requeue pattern).
    _, state, lines = train(*MOCK, "--train-iters", "2", "--load", str(tmp_path), "--save", str(tmp_path))
    assert state.iteration == 2 and any("starting from scratch" in line for line in lines)


def test_lr_schedule_change_on_resume_needs_a_flag(tmp_path):
    train(*MOCK, "--train-iters", "4", "--save", str(tmp_path), "--exit-interval", "2")
    with pytest.raises(UserError, match="--override-opt_param-scheduler"):
        train(*MOCK, "--train-iters", "4", "--load", str(tmp_path), "--lr-decay-style", "linear")
    _, state, _ = train(*MOCK, "--train-iters", "4", "--load", str(tmp_path), "--lr-decay-style", "linear",
                        "--override-opt_param-scheduler")
    assert state.iteration == 4


def test_checkpoints_save_the_config_the_run_used(tmp_path, monkeypatch):
    """The parsed config stays as parsed; the run's config (and what its checkpoints save) holds what lies
    outside the flags, the tokenizer's vocabulary and the LR schedule a resume adopts, from before anything is
    built: the Trainer builds everything from it and never replaces it."""
    from megalite import checkpoint
    from megalite.checkpoint.checkpointer import Checkpointer

    train(*MOCK, "--train-iters", "4", "--save", str(tmp_path), "--exit-interval", "2")
    parsed = parse_args([*SMALL, *MOCK, "--train-iters", "4", "--save", str(tmp_path), "--lr-decay-style", "linear",
                         "--use-checkpoint-opt_param-scheduler"])
    given, build = [], Checkpointer.__init__

    def recorded(self, run, *args, **kwargs):  # the config the Trainer builds its checkpointer from
        given.append(run)
        build(self, run, *args, **kwargs)

    monkeypatch.setattr(Checkpointer, "__init__", recorded)
    trainer, state = pretrain(parsed, log=lambda line: None)
    saved = checkpoint.read_metadata(checkpoint.resolve_checkpoint(str(tmp_path)))["extra"]["run"]
    assert state.iteration == 4 and parsed.train.lr_decay_style == "linear"
    assert given == [trainer.run] and given[0] is trainer.run is trainer.checkpointer.run
    assert trainer.run.train.lr_decay_style == saved["train"]["lr_decay_style"] == "cosine"
    assert (saved["model"]["tokenizer_vocab_size"], saved["model"]["vocab_size"]) == (100, 128)


@pytest.mark.parametrize("precision", [["--bf16"], ["--fp16", "--initial-loss-scale", "4096"]])
def test_half_precision_tracks_fp32_with_fp32_main_params(precision):
    _, reference, _ = train(*MOCK, "--train-iters", "10", "--fp32")  # bf16 is the default on a GPU
    trainer, state, _ = train(*MOCK, "--train-iters", "10", *precision)
    dtype = torch.bfloat16 if precision[0] == "--bf16" else torch.float16
    assert all(p.dtype == dtype for p in trainer.model.parameters())
    assert all(p.dtype == torch.float32 for p in trainer.optimizer.main_params)
    assert np.allclose(state.losses, reference.losses, atol=0.02), (state.losses, reference.losses)
    assert state.losses != reference.losses  # it really ran in half precision


def test_fp16_overflow_skips_steps_and_lowers_the_scale():
    trainer, state, lines = train(*MOCK, "--train-iters", "4", "--fp16", "--log-interval", "4")
    # 2^32 overflows fp16 grads: every step so far is skipped and the scale backs off.
    assert float(trainer.optimizer.loss_scaler.scale) < 2.0 ** 32
    assert any("number of skipped iterations:   4" in line for line in lines), lines
    assert trainer.optimizer.adam.state == {} or all(
        float(s["step"]) == 0 for s in trainer.optimizer.adam.state.values())


def test_recompute_changes_nothing(tmp_path):
    _, plain, _ = train(*MOCK, "--train-iters", "3")
    _, full, _ = train(*MOCK, "--train-iters", "3", "--recompute-granularity", "full")
    _, selective, _ = train(*MOCK, "--train-iters", "3", "--recompute-activations")
    _, recipe, _ = train(*MOCK, "--train-iters", "3", "--recompute-granularity", "full", "--recompute-method",
                         "uniform", "--recompute-num-layers", "1")  # Megatron's examples' recipe
    assert plain.losses == full.losses == selective.losses == recipe.losses


def test_exit_duration_stops_and_saves(tmp_path):
    _, state, lines = train(*MOCK, "--train-iters", "50", "--exit-duration-in-mins", "1e-9", "--save", str(tmp_path))
    assert state.iteration == 1 and state.exit_reason.startswith("--exit-duration-in-mins")
    assert open(tmp_path / "latest_checkpointed_iteration.txt").read().strip() == "1"


def test_divergence_stops_with_one_sentence():
    with pytest.raises(UserError, match="diverged"):
        train(*MOCK, "--train-iters", "5", "--lr", "1e30", "--lr-warmup-iters", "0", "--clip-grad", "0")


def test_save_interval_and_final_checkpoint(tmp_path):
    train(*MOCK, "--train-iters", "5", "--save", str(tmp_path), "--save-interval", "2")
    assert sorted(os.listdir(tmp_path)) == ["iter_0000002", "iter_0000004", "iter_0000005",
                                            "latest_checkpointed_iteration.txt", "metrics.jsonl"]


def test_finetune_continues_a_rope_model_at_a_longer_context(tmp_path):
    """Continued pretraining: a RoPE model saved at seq 128 goes on at seq 256 with a new --rotary-base, and its
    first loss is the loss the saved weights give at 256 on that run's first batch; a plain resume is refused."""
    rope = [*MOCK, "--hidden-dropout", "0", "--attention-dropout", "0"]  # SMALL is rope (the tiny preset's)
    train(*rope, "--seq-length", "128", "--train-iters", "2", "--save", str(tmp_path / "base"))
    longer = [*rope, "--seq-length", "256", "--rotary-base", "500000", "--train-iters", "1", "--lr-warmup-iters", "0",
              "--load", str(tmp_path / "base")]
    with pytest.raises(UserError, match=r"saved with other settings of --rotary-base --seq-length: .* or add "
                                        r"--finetune to start a new run from its weights"):
        train(*longer)
    trainer, state, lines = train(*longer, "--finetune")
    assert any("(--finetune): starting at iteration 0, with seq_length 128 -> 256, rotary_base 10000.0 -> 500000.0"
               in line for line in lines)

    def first_batch_loss(model_config) -> float:
        model = build_model(model_config, seed=0)
        load_checkpoint(str(tmp_path / "base"), model, model_config=model_config, load_rng=False, finetune=True)
        samples = [trainer.train_ds[i] for i in range(trainer.run.train.global_batch_size)]
        batch = {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}
        with torch.no_grad():
            losses = token_losses(model, batch["tokens"], batch["labels"], batch["loss_mask"], batch["position_ids"])
        return float(losses.sum() / batch["loss_mask"].sum())

    assert state.losses[0] == pytest.approx(first_batch_loss(trainer.run.model), rel=1e-6)
    head_dim = trainer.run.model.head_dim
    assert torch.equal(trainer.model[0].rotary.inv_freq, 1.0 / 500000.0 ** (torch.arange(0, head_dim, 2) / head_dim))


# Every way a tensor's value reaches Python: on a GPU each one waits for the device's queued work.
HOST_READS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__")


def is_host_data_read(frame) -> bool:
    """Whether `frame` reads the loader's micro-batches, which are in host memory on every device (the token-id
    check, and the local sum of loss_mask in the token count): on a CPU those reads look like any other."""
    name = frame.f_code.co_name
    return name == "checked_token_ids" or (name == "<genexpr>" and frame.f_back.f_code.co_name == "global_token_count")


MOE_GROUPED = ["--num-experts", "4", "--moe-grouped-gemm", "--moe-aux-loss-coeff", "1e-2", "--moe-z-loss-coeff", "1e-3"]


@pytest.mark.parametrize("precision", [[], ["--fp16", "--initial-loss-scale", "4096"], MOE_GROUPED],
                         ids=["default", "fp16", "moe"])
def test_a_step_reads_nothing_from_the_device_outside_log_steps(monkeypatch, precision):
    """The default run (fp32, no loss scaler, the NaN check on, clipping at 1) on one process, fp16 with its
    loss scaler, and an MoE model (grouped GEMM; the loop reads each forward's token counts): with
    --log-interval 4, iterations 1-3 and 5-7 read no tensor value back; iteration 4 reads the four iterations'
    results at once (and the MoE routing statistics, once)."""
    monkeypatch.setattr("megalite.run.logger.peak_flops", lambda device, dtype: (None, "not what is tested"))
    reads, running = {}, [0]  # iteration -> ["how in file:line function"]; the iteration running
    real_step = Trainer.train_step

    def train_step(self):
        running[0] = self.state.iteration + 1
        return real_step(self)

    def counted(how):
        real = getattr(torch.Tensor, how)

        def read(self, *args, **kwargs):
            frame = sys._getframe(1)
            if running[0] and not is_host_data_read(frame):
                where = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"
                reads.setdefault(running[0], []).append(f"{how} in {where}")
            return real(self, *args, **kwargs)
        return read

    monkeypatch.setattr(Trainer, "train_step", train_step)
    for how in HOST_READS:
        monkeypatch.setattr(torch.Tensor, how, counted(how))
    train(*MOCK, "--train-iters", "8", "--log-interval", "4", "--eval-interval", "0", *precision)
    between_log_lines = (1, 2, 3, 5, 6, 7)
    assert {i: reads.get(i, []) for i in between_log_lines} == dict.fromkeys(between_log_lines, [])
    assert len(reads[4]) == (2 if precision is MOE_GROUPED else 1), reads[4]


def test_a_tiny_moe_model_trains_and_logs_its_routing(tmp_path):
    trainer, state, lines = train(*MOCK, "--num-experts", "4", "--moe-router-score-function", "sigmoid",
                                  "--moe-router-enable-expert-bias", "--moe-aux-loss-coeff", "1e-2",
                                  "--moe-grouped-gemm", "--train-iters", "6", "--save", str(tmp_path),
                                  "--data-parallel-sharding-strategy", "optim_grads_params")  # 3-D flat ranges
    assert np.mean(state.losses[-2:]) < np.mean(state.losses[:2])
    line = next(line for line in lines if line.startswith(" iteration        6/"))
    assert "load_balancing_loss: 1.0" in line and "tokens per expert (of the mean): min" in line
    record = [record for record in map(json.loads, open(tmp_path / "metrics.jsonl")) if "split" not in record][-1]
    assert record["tokens_per_expert_min"] <= 1 <= record["tokens_per_expert_max"]
    # The tracking sink (wandb, TensorBoard) gets them as train/ scalars with every training record.
    assert {f"train/{name}" for name in ("load_balancing_loss", "z_loss", "tokens_per_expert_min",
                                         "tokens_per_expert_max")} <= set(scalars_of(record))
    # The Trainer moved the expert bias after each step, and the checkpoint holds it.
    bias = trainer.model[0].layers["0"].mlp.router.expert_bias
    assert bias.abs().min() > 0
    restored = build_model(trainer.run.model, seed=1)
    load_checkpoint(str(tmp_path), restored, model_config=trainer.run.model, load_rng=False)
    assert torch.equal(restored.layers["0"].mlp.router.expert_bias, bias)


def test_moe_grouped_gemm_and_the_expert_loop_train_to_bitwise_equal_losses():
    """10 iterations of the Trainer (Adam, shared expert, aux and z losses, a dense layer) with each path
    (tests/model/test_moe.py compares them in bf16 too)."""
    flags = [*MOCK, "--num-experts", "4", "--moe-ffn-hidden-size", "32", "--moe-aux-loss-coeff", "1e-2",
             "--moe-z-loss-coeff", "1e-3", "--moe-shared-expert-intermediate-size", "16", "--moe-layer-freq", "[1,0]",
             "--train-iters", "10", "--eval-interval", "0", "--eval-iters", "0"]
    loop = train(*flags)[1].losses
    grouped = train(*flags, "--moe-grouped-gemm")[1].losses
    assert loop == grouped and len(set(loop)) == 10
