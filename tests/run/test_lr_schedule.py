"""LRSchedule: every decay style at its key points, the settings' rule (checked once, by TrainConfig), and
checkpoint reconciliation."""

import json
import math

import pytest

from megalite.config.rules import check_schedule_settings
from megalite.errors import UserError
from megalite.run.lr_schedule import LRSchedule

# lr 1.0 -> min 0.1; warmup iterations 0..9; decay from iteration 10 to 110 (span 100).
BASE = dict(lr=1.0, min_lr=0.1, warmup_iters=10, decay_iters=110)


def schedule(**overrides) -> LRSchedule:
    return LRSchedule(**{**BASE, **overrides})


def approx(value):
    return pytest.approx(value, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root", "WSD"])
def test_warmup_is_linear_and_starts_above_zero(style):
    lrs = schedule(decay_style=style, wsd_decay_iters=20)
    assert lrs.lr_at(0) == approx(0.1)  # the first step moves (Megatron's would be 0)
    assert lrs.lr_at(4) == approx(0.5)
    assert lrs.lr_at(9) == approx(1.0)  # the last warmup step reaches lr


@pytest.mark.parametrize("style, expected", [
    # iteration:  10 (decay start), 35 (ratio 1/4), 60 (middle), 110 (end), 111, 10**6 (beyond)
    ("constant", [1.0, 1.0, 1.0, 1.0, 1.0, 1.0]),
    ("linear", [1.0, 0.1 + 0.75 * 0.9, 0.55, 0.1, 0.1, 0.1]),
    ("cosine", [1.0, 0.1 + 0.5 * (1 + math.cos(math.pi / 4)) * 0.9, 0.55, 0.1, 0.1, 0.1]),
])
def test_decay_styles_at_key_points(style, expected):
    lrs = schedule(decay_style=style)
    assert [lrs.lr_at(i) for i in (10, 35, 60, 110, 111, 10 ** 6)] == [approx(v) for v in expected]


def test_cosine_decreases_monotonically_from_lr_to_min_lr():
    lrs = schedule(decay_style="cosine")
    values = [lrs.lr_at(i) for i in range(9, 112)]
    assert all(a >= b for a, b in zip(values, values[1:]))
    assert values[0] == approx(1.0) and values[-1] == approx(0.1)


def test_inverse_square_root_continues_the_warmup_and_floors_at_min_lr():
    lrs = schedule(decay_style="inverse-square-root", decay_iters=5000)
    # In steps taken t = i + 1: warmup lr * t / 10 and decay lr * sqrt(10 / t) meet at t = 10.
    assert lrs.lr_at(9) == approx(1.0)
    assert lrs.lr_at(10) == approx(math.sqrt(10 / 11))
    assert lrs.lr_at(39) == approx(0.5)
    assert lrs.lr_at(999) == approx(0.1)
    assert lrs.lr_at(1999) == approx(0.1)  # sqrt(10/2000) < min_lr
    assert lrs.lr_at(5001) == approx(0.1)  # beyond decay_iters
    no_warmup = schedule(decay_style="inverse-square-root", warmup_iters=0, decay_iters=5000)
    assert [no_warmup.lr_at(i) for i in (0, 1, 3)] == [approx(1.0), approx(math.sqrt(0.5)), approx(0.5)]


@pytest.mark.parametrize("wsd_style, half_way", [
    ("exponential", 2 * 0.5 ** 0.5 - 1),
    ("linear", 0.5),
    ("cosine", 0.5),
    ("minus_sqrt", 1 - math.sqrt(0.5)),
])
def test_wsd_is_stable_then_anneals_to_min_lr(wsd_style, half_way):
    # Anneal over the last 20 of 110 iterations: from iteration 90 to 110.
    lrs = schedule(decay_style="WSD", wsd_decay_style=wsd_style, wsd_decay_iters=20)
    assert lrs.lr_at(10) == approx(1.0)
    assert lrs.lr_at(50) == approx(1.0)
    assert lrs.lr_at(90) == approx(1.0)  # the last stable iteration
    assert lrs.lr_at(91) < 1.0  # the anneal has begun
    assert lrs.lr_at(100) == approx(0.1 + half_way * 0.9)
    assert lrs.lr_at(110) == approx(0.1)
    assert lrs.lr_at(500) == approx(0.1)
    values = [lrs.lr_at(i) for i in range(90, 111)]
    assert all(a > b for a, b in zip(values, values[1:]))


def test_zero_length_decay_goes_straight_to_min_lr():
    lrs = schedule(decay_style="linear", warmup_iters=10, decay_iters=10)
    assert lrs.lr_at(9) == approx(1.0)
    assert lrs.lr_at(10) == approx(0.1)


@pytest.mark.parametrize("overrides, flags", [
    (dict(decay_style="step"), ["--lr-decay-style"]),
    (dict(decay_style="WSD", wsd_decay_iters=20, wsd_decay_style="square"), ["--lr-wsd-decay-style"]),
    (dict(decay_style="WSD"), ["--lr-wsd-decay-iters"]),
    (dict(decay_style="WSD", wsd_decay_iters=111), ["--lr-wsd-decay-iters", "--lr-decay-iters"]),
    (dict(min_lr=2.0), ["--min-lr", "--lr"]),
    (dict(warmup_iters=200), ["--lr-warmup-iters", "--lr-decay-iters"]),
    (dict(lr=-1.0, min_lr=-2.0), ["--lr"]),
    (dict(min_lr=-0.1), ["--min-lr"]),
    (dict(warmup_iters=-1), ["--lr-warmup-iters"]),
    (dict(lr=math.nan), ["--lr"]),
])
def test_invalid_settings_name_the_flag(overrides, flags):
    settings = {**BASE, "decay_style": "cosine", "wsd_decay_style": "exponential", "wsd_decay_iters": None}
    with pytest.raises(UserError) as error:
        check_schedule_settings(**{**settings, **overrides})
    for flag in flags:
        assert flag in str(error.value)


def test_state_dict_is_json_able_and_equal_settings_load_quietly():
    lrs = schedule(decay_style="WSD", wsd_decay_iters=20)
    state = json.loads(json.dumps(lrs.state_dict()))
    other = schedule(decay_style="WSD", wsd_decay_iters=20)
    other.load_state_dict(state)
    assert [other.lr_at(i) for i in range(120)] == [lrs.lr_at(i) for i in range(120)]


def test_differing_settings_name_each_one_with_both_values_and_both_flags():
    checkpoint = schedule(decay_iters=200, min_lr=0.01).state_dict()
    with pytest.raises(UserError) as error:
        schedule().load_state_dict(checkpoint)
    message = str(error.value)
    assert "--lr-decay-iters is 200 in the checkpoint but 110 in this run" in message
    assert "--min-lr is 0.01 in the checkpoint but 0.1 in this run" in message
    assert "--lr-warmup-iters" not in message  # equal settings are not listed
    assert "--override-opt_param-scheduler" in message
    assert "--use-checkpoint-opt_param-scheduler" in message


def test_override_keeps_this_run_and_use_checkpoint_adopts_the_checkpoint():
    checkpoint = schedule(decay_iters=200, decay_style="linear").state_dict()
    kept = schedule()
    kept.load_state_dict(checkpoint, override=True)
    assert kept.state_dict() == schedule().state_dict()
    adopted = schedule()
    adopted.load_state_dict(checkpoint, use_checkpoint=True)
    assert adopted.state_dict() == checkpoint
    assert adopted.lr_at(105) == approx(0.1 + 0.5 * 0.9)  # linear, half way to 200
    both = schedule()  # TrainConfig refuses both flags; here the first wins
    both.load_state_dict(checkpoint, override=True, use_checkpoint=True)
    assert both.state_dict() == schedule().state_dict()


def test_wsd_settings_count_only_when_a_side_uses_wsd():
    cosine = schedule(wsd_decay_style="linear", wsd_decay_iters=5).state_dict()
    schedule().load_state_dict(cosine)  # unused WSD settings differ: no error
    wsd = schedule(decay_style="WSD", wsd_decay_iters=20).state_dict()
    with pytest.raises(UserError) as error:
        schedule(decay_style="WSD", wsd_decay_iters=30).load_state_dict(wsd)
    assert "--lr-wsd-decay-iters is 20 in the checkpoint but 30 in this run" in str(error.value)
    with pytest.raises(UserError, match="--lr-decay-style is 'WSD'"):
        schedule().load_state_dict(wsd)


def test_adopted_checkpoint_settings_are_validated_and_absent_ones_reported():
    corrupt = {**schedule().state_dict(), "min_lr": 5.0}
    with pytest.raises(UserError, match="--min-lr"):
        schedule().load_state_dict(corrupt, use_checkpoint=True)
    partial = schedule().state_dict()
    del partial["lr"]
    with pytest.raises(UserError, match="--lr is absent in the checkpoint"):
        schedule().load_state_dict(partial)
