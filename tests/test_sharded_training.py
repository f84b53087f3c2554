"""ZeRO-2 and ZeRO-3 end to end (pretrain_gpt.py on CPU ranks): losses match one process over 6
iterations, a ZeRO-3 checkpoint resumes bitwise and loads into other layouts and strategies.
The grads of one step, per parameter and per layout, are checked in tests/data_parallel/test_sharding.py."""

import os
import shutil

import pytest

from megalite.run.metrics import read_metrics_records
from tests.helpers.runs import assert_matches, train
from tools.check_layouts import COMMON, LAYOUTS, MODELS, ZERO2, ZERO3

SIX = [*COMMON, *MODELS["llama"], "--train-iters", "6", "--eval-interval", "3"]
TEN = [*COMMON, *MODELS["llama"], "--train-iters", "10", "--eval-interval", "5"]  # fp16 needs its first steps to settle


@pytest.fixture(scope="module")
def single6(tmp_path_factory):
    return train(tmp_path_factory.mktemp("single6"), 1, base=SIX)


def test_zero3_at_dp4_resumes_bitwise_and_loads_at_tp2_dp2_optim_and_at_one_process(single6, tmp_path):
    whole = train(tmp_path / "whole", 4, *ZERO3, base=SIX)
    assert_matches(single6, whole, 9)
    stopped = train(tmp_path / "stopped", 4, *ZERO3, "--exit-interval", "3", base=SIX)
    assert sorted(stopped)[-1] == ("valid", 3)
    for layout in ("tp2-optim", "one"):
        shutil.copytree(tmp_path / "stopped", tmp_path / layout)
    assert train(tmp_path / "stopped", 4, *ZERO3, load=True, base=SIX) == whole  # bitwise
    elsewhere = train(tmp_path / "tp2-optim", 4, "--tensor-model-parallel-size", "2",
                      "--data-parallel-sharding-strategy", "optim", load=True, base=SIX)
    assert_matches(single6, elsewhere, 9)
    assert_matches(single6, train(tmp_path / "one", 1, load=True, base=SIX), 9)


def test_zero2_resumes_at_zero3_and_no_shard(single6, tmp_path):
    train(tmp_path / "zero2", 2, *ZERO2, "--exit-interval", "3", base=SIX)
    shutil.copytree(tmp_path / "zero2", tmp_path / "no-shard")
    assert_matches(single6, train(tmp_path / "zero2", 4, *ZERO3, load=True, base=SIX), 9)
    assert_matches(single6, train(tmp_path / "no-shard", 2, load=True, base=SIX), 9)


@pytest.mark.parametrize("layout", ["tp2-pp2-vp2-dp2-sp-zero3", "pp2-dp2-zero3", "dp2-tp2-sp-zero2", "dp2-zero2"])
def test_sharded_layouts_match_one_process_over_six_iterations(layout, single6, tmp_path):
    processes, flags, tolerance = LAYOUTS[layout]
    assert_matches(single6, train(tmp_path / layout, processes, *flags, base=SIX), 9, tolerance)


# Every token's logit grad is the scale / 256 tokens, so 2^25 overflows fp16 grads on any CPU: iteration 1
# is always skipped. Backing off at each overflow (--hysteresis 1), the scale soon reaches one the model
# trains at (2^21 on an AVX2 and on an AVX512-FP16 host alike). The default 2^32 with hysteresis 2 is still
# at 2^24 after 10 iterations, so every step would be skipped and the test would compare nothing.
FP16 = ["--fp16", "--initial-loss-scale", str(2 ** 25), "--hysteresis", "1"]


def skipped_iterations(losses: dict) -> list[int]:
    return sorted(iteration for (split, iteration), loss in losses.items() if split == "train" and loss is None)


def test_zero3_with_fp16_loss_scaling_and_recomputation_tracks_one_process(tmp_path):
    flags = [*FP16, "--recompute-granularity", "full"]
    reference = train(tmp_path / "one", 1, *flags, base=TEN)
    sharded = train(tmp_path / "zero3", 2, *flags, *ZERO3, base=TEN)
    assert sharded.keys() == reference.keys()
    skipped = skipped_iterations(reference)
    scales = [record["loss_scale"] for record in read_metrics_records(str(tmp_path / "one" / "metrics.jsonl"))
              if "loss_scale" in record]
    assert len(skipped) < 10, f"every fp16 iteration of the one-process run was skipped (the loss scale fell " \
                              f"to {scales[-1]:g} and fp16 grads still overflowed): no step was compared"
    assert skipped[:1] == [1], f"iteration 1 at loss scale 2^25 should overflow, but skipped were {skipped}"
    assert skipped_iterations(sharded) == skipped, \
        f"ZeRO-3 skipped iterations {skipped_iterations(sharded)}, one process {skipped}"
    for key, loss in reference.items():
        if loss is not None:  # skipped iterations log no loss, in both runs alike
            assert sharded[key] == pytest.approx(loss, rel=2e-3), key


def test_zero3_run_saves_every_rank_s_model_pieces(tmp_path):
    train(tmp_path / "run", 2, *ZERO3, "--train-iters", "2", base=SIX)
    folder = os.path.join(tmp_path / "run", "iter_0000002")
    assert sorted(name for name in os.listdir(folder) if name.startswith("model_")) == \
        ["model_00000.safetensors", "model_00001.safetensors"]
