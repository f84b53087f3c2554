"""Weighted blends: Megatron's greedy rule, sizes, and --data-path parsing."""

import numpy as np
import pytest

from megalite.data import build_gpt_datasets, parse_data_path
from megalite.data.blended_dataset import BlendedDataset, build_blending_indices
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.errors import UserError


@pytest.mark.parametrize("weights, size", [([0.5, 0.3, 0.2], 2000), ([1 / 3] * 3, 999), ([0.9, 0.1], 500),
                                           ([0.25, 0.25, 0.25, 0.25], 401)])
def test_greedy_rule_and_proportions(weights, size):
    indices = build_blending_indices(weights, size)
    dataset_index, sample_index = indices["dataset_index"], indices["dataset_sample_index"]
    counts = np.zeros(len(weights), dtype=np.int64)
    for i in range(size):
        errors = [w * max(i, 1) - c for w, c in zip(weights, counts)]
        assert dataset_index[i] == int(np.argmax(errors))  # argmax: lowest index on ties
        assert sample_index[i] == counts[dataset_index[i]]  # each dataset's samples in order
        counts[dataset_index[i]] += 1
        # every prefix of the blend is within one sample of the weighted share
        assert np.all(np.abs(counts - np.array(weights) * (i + 1)) <= 1.0 + 1e-9)


def test_parse_data_path():
    assert parse_data_path(["a"]) == (["a"], None)
    assert parse_data_path("0.3 a 0.7 b") == (["a", "b"], [0.3, 0.7])
    assert parse_data_path(["a", "b"]) == (["a", "b"], None)
    for bad in (["0.3", "a", "b"], ["0.3", "a", "0.7"], ["a", "0.5"]):
        with pytest.raises(UserError, match="mixes weights and prefixes"):
            parse_data_path(bad)
    with pytest.raises(UserError, match="not all zero"):
        parse_data_path(["0", "a", "0", "b"])


def _file(path, num_docs, first_token, seed):
    rng = np.random.RandomState(seed)
    with IndexedDatasetBuilder(str(path), np.uint16) as builder:
        for _ in range(num_docs):
            # each file's tokens live in their own range, so a sample tells its source
            builder.add_document(rng.randint(first_token, first_token + 100, rng.randint(5, 40)))
    return str(path)


def test_weighted_blend_draws_in_proportion(tmp_path):
    a, b = _file(tmp_path / "a", 100, 0, 0), _file(tmp_path / "b", 100, 1000, 1)
    train, valid, _ = build_gpt_datasets(["0.25", a, "0.75", b], "90,10,0", 16, 1, (400, 40, 0),
                                         str(tmp_path / "c"))
    assert isinstance(train, BlendedDataset) and len(train) == 400
    from_b = sum(int(train[i]["tokens"][0] >= 1000) for i in range(400))
    assert from_b == 300
    assert len(valid) == 40


def test_unweighted_prefixes_weigh_by_size(tmp_path):
    a, b = _file(tmp_path / "a", 50, 0, 0), _file(tmp_path / "b", 150, 1000, 1)
    train, _, _ = build_gpt_datasets([a, b], "1,0,0", 16, 1, (200, 0, 0), str(tmp_path / "c"))
    share_a = train.weights[0]
    tokens_a = sum(len(x) for x in [train.datasets[0].indexed[i] for i in range(50)])
    tokens_b = sum(len(x) for x in [train.datasets[1].indexed[i] for i in range(150)])
    assert share_a == pytest.approx(((tokens_a - 1) // 16) / ((tokens_a - 1) // 16 + (tokens_b - 1) // 16))


def test_too_small_part_is_a_clear_error(tmp_path):
    a = _file(tmp_path / "a", 20, 0, 0)
    part = build_gpt_datasets(a, "1,0,0", 16, 1, (None, 0, 0), str(tmp_path / "c"))[0]
    with pytest.raises(UserError, match=r"needs \d+ samples from a but it provides only"):
        BlendedDataset([part, part], ["a", "a"], [0.5, 0.5], 4 * len(part), None, "train")


def test_per_split_paths_and_exclusivity(tmp_path):
    a, b = _file(tmp_path / "a", 40, 0, 0), _file(tmp_path / "b", 40, 1000, 1)
    train, valid, test = build_gpt_datasets(None, "1,0,0", 16, 1, (30, 10, 0), str(tmp_path / "c"),
                                            train_data_path=[a], valid_data_path=[b])
    assert int(train[0]["tokens"][0]) < 1000 and int(valid[0]["tokens"][0]) >= 1000 and test is None
    with pytest.raises(UserError, match="use one or the other"):
        build_gpt_datasets([a], "1,0,0", 16, 1, (30, 10, 0), train_data_path=[a])


def test_missing_prefix_suggests_near_matches(tmp_path):
    _file(tmp_path / "corpus_text_document", 5, 0, 0)
    with pytest.raises(UserError, match="did you mean .*corpus_text_document"):
        build_gpt_datasets([str(tmp_path / "corpus_txt_document")], "1", 16, 1, (1, 0, 0))
    with pytest.raises(UserError, match="without '.bin'"):
        build_gpt_datasets([str(tmp_path / "corpus_text_document.bin")], "1", 16, 1, (1, 0, 0))
    with pytest.raises(UserError, match="no token files are in"):
        build_gpt_datasets([str(tmp_path / "empty" / "x")], "1", 16, 1, (1, 0, 0))
