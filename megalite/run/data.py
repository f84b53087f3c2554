"""The run's data: the built-in corpus for the default run, and datasets sized for the whole run."""

import dataclasses

from megalite.config import RunConfig
from megalite.data import build_gpt_datasets


def resolve_data(run: RunConfig) -> RunConfig:
    """`run`, or for the default run a copy whose data flags point at the built-in corpus (built
    here, or reused)."""
    if not run.data.builtin_corpus:
        return run
    from megalite.data.prep.builtin_corpus import ensure_builtin_corpus

    prefix, tokenizer_model = ensure_builtin_corpus()  # in data/build/ of the repository
    return dataclasses.replace(run, data=dataclasses.replace(
        run.data, data_path=[prefix], tokenizer_type="SentencePieceTokenizer", tokenizer_model=tokenizer_model))


def build_datasets(run: RunConfig, tokenizer):
    """Train/valid/test datasets sized like Megatron's: every sample the run will draw."""
    train = run.train
    evaluations = train.train_iters // train.eval_interval + 1 if train.eval_interval else 1
    num_samples = (train.train_iters * train.global_batch_size,
                   evaluations * train.eval_iters * train.global_batch_size,
                   train.eval_iters * train.global_batch_size)
    data = run.data
    return build_gpt_datasets(
        data.data_path, data.split, run.model.seq_length, train.seed, num_samples, data.data_cache_path,
        eod=tokenizer.eod, pad=tokenizer.pad, eod_mask_loss=data.eod_mask_loss,
        reset_position_ids=data.reset_position_ids, train_data_path=data.train_data_path,
        valid_data_path=data.valid_data_path, test_data_path=data.test_data_path,
        mock_vocab_size=tokenizer.vocab_size - 1 if data.mock_data else None, mmap_bin_files=data.mmap_bin_files)
