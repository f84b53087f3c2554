"""Continue a prompt from a megalite checkpoint.

    python tools/generate.py --load runs/default --prompt "def main(" --max-new-tokens 80
    python tools/generate.py --load runs/default --iteration 100 --temperature 0 --prompt "import "

The model shape comes from the checkpoint; the tokenizer from the flags the run was
trained with (override with --tokenizer-type/--tokenizer-model when the files moved).
"""

import argparse
import dataclasses
import sys

import torch

from megalite.checkpoint import load_checkpoint, read_metadata, resolve_checkpoint
from megalite.config import ModelConfig
from megalite.data.tokenizer import TOKENIZER_TYPES, build_tokenizer
from megalite.errors import UserError, run_main
from megalite.run.generation import SAMPLING, generate
from megalite.model.gpt import build_model


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--load", required=True, help="checkpoint folder (the run's --save)")
    parser.add_argument("--iteration", type=int, help="default: the latest checkpoint")
    parser.add_argument("--prompt", default="", help="text to continue")
    parser.add_argument("--max-new-tokens", type=int, default=SAMPLING.max_new_tokens)
    parser.add_argument("--temperature", type=float, default=SAMPLING.temperature, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=SAMPLING.top_k, help="0: no top-k filter")
    parser.add_argument("--top-p", type=float, default=SAMPLING.top_p, help="1.0: no nucleus filter")
    parser.add_argument("--seed", type=int, default=SAMPLING.seed)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--tokenizer-type", choices=TOKENIZER_TYPES)
    parser.add_argument("--tokenizer-model")
    parser.add_argument("--debug", action="store_true")
    args = parser.parse_args(argv)
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise UserError("--max-new-tokens and --num-samples must be at least 1")
    if args.top_k < 0 or not 0 < args.top_p <= 1 or args.temperature < 0:
        raise UserError("--top-k must be >= 0, --top-p in (0, 1] and --temperature >= 0")
    return args


def load_model(load: str, iteration: int | None):
    """(model in eval mode, the run's saved settings) from checkpoint folder `load`."""
    metadata = read_metadata(resolve_checkpoint(load, iteration))
    fields = {field.name for field in dataclasses.fields(ModelConfig)}
    config = ModelConfig(**{k: v for k, v in metadata["model_config"].items() if k in fields})
    model = build_model(config, seed=0)
    load_checkpoint(load, model, model_config=config, iteration=metadata["iteration"], load_rng=False)
    return model.eval(), metadata


def tokenizer_for(args, metadata: dict):
    data = metadata.get("extra", {}).get("run", {}).get("data", {})
    tokenizer_type = args.tokenizer_type or data.get("tokenizer_type")
    tokenizer_model = args.tokenizer_model or data.get("tokenizer_model")
    if tokenizer_type is None:
        raise UserError(f"{args.load} does not record its tokenizer; pass --tokenizer-type and --tokenizer-model")
    return build_tokenizer(tokenizer_type, tokenizer_model, data.get("vocab_size"))


def main(argv) -> None:
    args = parse_args(argv)
    model, metadata = load_model(args.load, args.iteration)
    tokenizer = tokenizer_for(args, metadata)
    prompt = tokenizer.tokenize(args.prompt) if args.prompt else [tokenizer.eod]
    generator = torch.Generator().manual_seed(args.seed)
    for index in range(args.num_samples):
        out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                       eod=tokenizer.eod, generator=generator)
        text = tokenizer.detokenize(out if args.prompt else out[1:])
        print(text if args.num_samples == 1 else f"--- sample {index + 1}\n{text}")


if __name__ == "__main__":
    sys.exit(run_main(main))
