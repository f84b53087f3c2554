"""The run's final config (the built-in corpus, the tokenizer, a resumed LR schedule), and datasets sized
for the whole run."""

import dataclasses

from megalite.checkpoint.checkpointer import saved_lr_schedule
from megalite.config import RunConfig
from megalite.data import build_gpt_datasets
from megalite.data.tokenizer import build_tokenizer
from megalite.run.lr_schedule import LRSchedule


def final_run_config(run: RunConfig):
    """(config, tokenizer): `run` completed, before anything is built, by what lies outside the flags: the
    built-in corpus for the default run (built here by one rank under the builder's lock, or reused), the
    tokenizer's vocabulary, and under --use-checkpoint-opt_param-scheduler the resumed checkpoint's LR schedule."""
    data = run.data
    if data.builtin_corpus:
        from megalite.data.prep.builtin_corpus import ensure_builtin_corpus

        prefix, tokenizer_model = ensure_builtin_corpus()  # in data/build/ of the repository
        data = dataclasses.replace(data, data_path=[prefix], tokenizer_type="SentencePieceTokenizer",
                                   tokenizer_model=tokenizer_model)
    tokenizer = build_tokenizer(data.tokenizer_type, data.tokenizer_model, data.vocab_size, data.vocab_file,
                                data.merge_file)
    run = dataclasses.replace(run, data=data).with_tokenizer_vocab(tokenizer.vocab_size)
    saved = saved_lr_schedule(run.checkpoint) if run.train.use_checkpoint_opt_param_scheduler else None
    if saved is not None:  # the checkpoint's settings where they differ (as the schedule's load adopts them)
        schedule = LRSchedule(**run.train.lr_schedule_settings())
        schedule.load_state_dict(saved, use_checkpoint=True)
        run = dataclasses.replace(run, train=run.train.with_lr_schedule(schedule.state_dict()))
    return run, tokenizer


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
