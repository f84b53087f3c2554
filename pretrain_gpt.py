"""Pretrain a GPT / LLaMA model with Megatron-LM's flags (`python pretrain_gpt.py --help`; README.md has
examples). The default run (no flags): the tiny model on the built-in corpus, saving checkpoints and
metrics.jsonl under runs/default, resuming from there when run again, and ending with a generated sample;
a run with flags saves only with --save DIR."""

import math
import os
import sys
import time

import torch

from megalite import cpu
from megalite.arguments import parse_args
from megalite.config import DEFAULT_RUN_SAVE
from megalite.errors import run_main
from megalite.parallel_state import choose_backend, world_size_from_env
from megalite.run.generation import SAMPLING, generate
from megalite.run.resilience import hold_signals_until_exit
from megalite.run.training import pretrain

SAMPLE_PROMPT = "def main("  # whole tokens: "def " would end in a lone "▁", which in the corpus precedes digits
NO_SAVE = "this run keeps no checkpoints (no --save DIR)"


def main(argv) -> None:
    start = time.perf_counter()
    run = parse_args(argv, world_size_from_env())
    if run.dry_run:
        from megalite.plan.dry_run import dry_run

        dry_run(run)
        return
    if choose_backend(run.parallel.distributed_backend) == "gloo":  # a CPU run: the CPU backend's process setting
        cpu.set_up_process()
    # Held until the process exits: a SIGTERM in the last moments still saves (or is ignored once all is saved).
    hold_signals_until_exit(run.train.exit_signal_handler)
    last_rank = run.parallel.world_size - 1  # the logging rank
    if int(os.environ.get("RANK", last_rank)) == last_rank:
        if run.checkpoint.save is None:
            print(f"{NO_SAVE}: its end or a Ctrl-C discards the model", flush=True)
        elif not argv:
            print(f"the default run: it saves into {DEFAULT_RUN_SAVE} and resumes from there when run again; "
                  f"a run with any flag saves only with --save DIR", flush=True)
    try:
        trainer, state = pretrain(run)
    except KeyboardInterrupt:
        if run.checkpoint.save is None:
            raise KeyboardInterrupt(f"{NO_SAVE}; with --save DIR a Ctrl-C saves and exits") from None
        raise
    run = trainer.run  # the config the run used: the built-in corpus and the tokenizer's vocabulary filled in
    if not state.losses or not trainer.parallel.is_logging_rank:
        return
    vocab = run.model.real_vocab_size
    print(f"trained iterations {state.iteration - len(state.losses) + 1}-{state.iteration} in "
          f"{time.perf_counter() - start:.0f} s: lm loss {state.losses[0]:.3f} -> {state.losses[-1]:.3f} "
          f"(ln vocab = {math.log(vocab):.3f})")
    if state.exit_reason == "finished" and run.data.tokenizer_type != "NullTokenizer" and run.parallel.world_size == 1:
        print_sample(trainer)


def print_sample(trainer) -> None:
    """A continuation of SAMPLE_PROMPT by the trained model, sampled as tools/generate.py samples by default."""
    tokenizer = trainer.tokenizer
    sample = generate(trainer.model[0], tokenizer.tokenize(SAMPLE_PROMPT), eod=tokenizer.eod,
                      generator=torch.Generator().manual_seed(SAMPLING.seed))
    print(f"sample ({SAMPLING.describe()}: tools/generate.py's defaults):\n" + tokenizer.detokenize(sample))


if __name__ == "__main__":
    sys.exit(run_main(main))
