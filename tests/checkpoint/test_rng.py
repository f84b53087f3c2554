"""RNG states: the draws after a load are the draws after the save."""

import random

import numpy as np
import torch

from megalite.checkpoint import load_checkpoint
from megalite.model.gpt import build_model
from tests.helpers.checkpoint import save, small_config


def test_rng_draws_after_load_equal_draws_after_save(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    np.random.randn()  # leaves a cached gaussian in numpy's state
    save(tmp_path, 1, build_model(small_config(), seed=1))
    expected = (random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), torch.rand(3))
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    load_checkpoint(str(tmp_path), build_model(small_config(), seed=1), model_config=small_config())
    drawn = (random.random(), random.gauss(0, 1), np.random.randn(3).tolist(), torch.rand(3))
    assert drawn[:3] == expected[:3] and torch.equal(drawn[3], expected[3])
