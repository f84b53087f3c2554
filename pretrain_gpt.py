"""Pretrain a GPT / LLaMA model. With no arguments: the tiny model on the built-in corpus.

    python pretrain_gpt.py                                   # a few minutes on a CPU
    python pretrain_gpt.py --data-path data/my_text_document \
        --tokenizer-type SentencePieceTokenizer --tokenizer-model tokenizers/my.model
    python pretrain_gpt.py --mock-data --tokenizer-type NullTokenizer --vocab-size 1000

Single process for now; the flags follow Megatron-LM's names. The full argument set,
checkpoints and the parallel layouts arrive with their issues.
"""

import argparse
import os
import sys
import time

import torch

from megalite.config import MODEL_PRESETS, model_config_from_preset
from megalite.data import build_data_loader, build_gpt_datasets, check_batch_sizes
from megalite.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from megalite.errors import UserError, run_main
from megalite.model.gpt import build_model
from megalite.training import build_optimizer, generate, train

REPO_ROOT = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS))
    parser.add_argument("--seq-length", type=int, default=None, help="default: the preset's")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=16)
    parser.add_argument("--train-iters", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--min-lr", type=float, default=1e-4)
    parser.add_argument("--lr-warmup-iters", type=int, default=20)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--clip-grad", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--log-interval", type=int, default=10)
    parser.add_argument("--eval-interval", type=int, default=100)
    parser.add_argument("--eval-iters", type=int, default=5)
    parser.add_argument("--data-path", nargs="+", default=None, help="default: the built-in corpus")
    parser.add_argument("--split", default="969,30,1")
    parser.add_argument("--data-cache-path", default=None)
    parser.add_argument("--mock-data", action="store_true")
    parser.add_argument("--tokenizer-type", default=None, choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model", default=None)
    parser.add_argument("--vocab-size", type=int, default=None)
    parser.add_argument("--debug", action="store_true", help="show tracebacks of user errors")
    return parser.parse_args(argv)


def resolve_data(args) -> None:
    """With no --data-path and no --mock-data, build or reuse the built-in corpus."""
    if args.mock_data or args.data_path:
        if args.tokenizer_type is None:
            raise UserError("--tokenizer-type is required with --data-path or --mock-data")
        return
    from megalite.data.builtin_corpus import ensure_builtin_corpus

    prefix, tokenizer_model = ensure_builtin_corpus(os.path.join(REPO_ROOT, "data", "build"))
    args.data_path, args.tokenizer_type, args.tokenizer_model = [prefix], "SentencePieceTokenizer", tokenizer_model


def main(argv) -> None:
    args = parse_args(argv)
    torch.manual_seed(args.seed)
    resolve_data(args)
    tokenizer = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size)
    overrides = {"vocab_size": tokenizer.vocab_size}
    if args.seq_length is not None:
        overrides["seq_length"] = args.seq_length
    config = model_config_from_preset(args.model, **overrides)
    args.seq_length = config.seq_length
    num_microbatches = check_batch_sizes(args.global_batch_size, args.micro_batch_size, 1)

    eval_batches = (args.train_iters // args.eval_interval + 1) * args.eval_iters if args.eval_interval else 0
    train_ds, valid_ds, _ = build_gpt_datasets(
        None if args.mock_data else args.data_path, args.split, config.seq_length, args.seed,
        (args.train_iters * args.global_batch_size, eval_batches * args.global_batch_size, 0),
        args.data_cache_path, eod=tokenizer.eod, pad=tokenizer.pad,
        mock_vocab_size=tokenizer.vocab_size - 1 if args.mock_data else None)
    train_iterator = iter(build_data_loader(train_ds, 0, args.global_batch_size, args.micro_batch_size))
    valid_iterator = None
    if valid_ds is not None:
        valid_iterator = iter(build_data_loader(valid_ds, 0, args.global_batch_size, args.micro_batch_size))

    model = build_model(config, args.seed)
    optimizer = build_optimizer(model, args.lr, args.weight_decay)
    num_params = sum(p.numel() for p in model.parameters())
    print(f"model {args.model}: {num_params / 1e6:.2f}M parameters, vocab {tokenizer.vocab_size} "
          f"(padded {config.vocab_size}), seq {config.seq_length}; {torch.get_num_threads()} threads")
    start = time.perf_counter()
    losses = train(model, optimizer, args, train_iterator, valid_iterator, num_microbatches)
    print(f"trained {args.train_iters} iterations in {time.perf_counter() - start:.0f} s: "
          f"lm loss {losses[0]:.3f} -> {losses[-1]:.3f} (ln vocab = {torch.log(torch.tensor(float(tokenizer.vocab_size))):.3f})")
    if args.tokenizer_type != "NullTokenizer":
        prompt = tokenizer.tokenize("def ")
        sample = generate(model, prompt, 60, generator=torch.Generator().manual_seed(args.seed))
        print("sample:\n" + tokenizer.detokenize(sample))


if __name__ == "__main__":
    sys.exit(run_main(main))
