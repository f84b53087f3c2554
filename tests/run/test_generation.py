"""Sampling filters, and tools/generate.py continuing a prompt from a saved checkpoint."""

import os
import subprocess
import sys

import torch

from megalite.arguments import parse_args
from megalite.run.generation import filter_logits
from megalite.run.training import pretrain

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_top_k_keeps_the_k_largest():
    logits = torch.tensor([1.0, 5.0, 3.0, 4.0, 2.0])
    kept = torch.isfinite(filter_logits(logits, top_k=2))
    assert kept.tolist() == [False, True, False, True, False]


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log()
    assert torch.isfinite(filter_logits(logits, top_p=0.8)).tolist() == [True, True, False, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.81)).tolist() == [True, True, True, False]
    assert torch.isfinite(filter_logits(logits, top_p=0.1)).tolist() == [True, False, False, False]
    assert torch.isfinite(filter_logits(logits)).all()


def run_generate(*flags):
    return subprocess.run([sys.executable, os.path.join(REPO_ROOT, "tools", "generate.py"), *flags],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})


def test_generate_continues_a_prompt_from_a_checkpoint(tmp_path):
    flags = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "50", "--num-layers", "2",
             "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
             "--global-batch-size", "2", "--train-iters", "3", "--eval-interval", "0", "--save", str(tmp_path)]
    pretrain(parse_args(flags), log=lambda line: None)
    greedy = run_generate("--load", str(tmp_path), "--prompt", "1 2 3", "--max-new-tokens", "5",
                          "--temperature", "0")
    assert greedy.returncode == 0, greedy.stderr
    ids = greedy.stdout.split()
    assert ids[:3] == ["1", "2", "3"] and 3 < len(ids) <= 8 and all(0 <= int(i) <= 50 for i in ids)
    again = run_generate("--load", str(tmp_path), "--prompt", "1 2 3", "--max-new-tokens", "5", "--temperature", "0")
    assert again.stdout == greedy.stdout
    sampled = run_generate("--load", str(tmp_path), "--prompt", "1 2 3", "--num-samples", "2", "--top-p", "0.9")
    assert sampled.returncode == 0 and sampled.stdout.count("--- sample") == 2


def test_generate_reports_a_missing_checkpoint(tmp_path):
    result = run_generate("--load", str(tmp_path / "none"))
    assert result.returncode == 1
    assert result.stderr.startswith("error: --load directory") and len(result.stderr.strip().splitlines()) == 1
