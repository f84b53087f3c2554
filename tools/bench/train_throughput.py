"""Training tokens/s of megalite next to Hugging Face's LlamaForCausalLM on the same model.

    python tools/bench/train_throughput.py [--model tiny] [--micro-batch-size 8] [--seq-length 256]
        [--iters 10] [--warmup-iters 2] [--rounds 5] [--dtype fp32|bf16] [--threads 2] [--device cpu|cuda]

Both sides train the same LLaMA-style model: HF's config is built from megalite's, on
the tokenizer's vocabulary (megalite's padding is turned off, so both compute the same
logits), with the same tokens, batch, sequence length, dtype and thread count, and
SDPA attention on both. One iteration is forward + backward + optimizer step with a
plain `torch.optim.AdamW` (same settings on both sides): megalite's own optimizer (fp32
main params, ZeRO) is written elsewhere, and this compares the models, not optimizers.
The two models start from their own initialisations; values do not change the work.

Timing: each model first runs --warmup-iters untimed iterations; then --rounds measured
blocks alternate between them (megalite, HF, HF, megalite, ...), so that whatever else
the machine does falls on both. tokens/s is tokens over the summed block times;
"best/worst" are the fastest and slowest blocks, and the ratio is also given between
the fastest blocks, which other work on a shared machine disturbs least. TFLOP/s and
MFU use megalite.logging's FLOPs formula (the same model FLOPs for both) and peak: a
datasheet value on a known GPU, a short matmul benchmark on a CPU.
"""

import argparse
import os
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if REPO_ROOT not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, REPO_ROOT)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from megalite.config import MODEL_PRESETS, ModelConfig, model_config_from_preset  # noqa: E402
from megalite.errors import UserError, run_main  # noqa: E402
from megalite.hf import llama_config_to_hf  # noqa: E402
from megalite.logging import flops_per_iteration, peak_flops  # noqa: E402
from megalite.model.gpt import build_model  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
OVERRIDE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "seq_length", "vocab_size")


def get_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS))
    for name in OVERRIDE_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help="override the preset's value")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10, help="measured iterations per model")
    parser.add_argument("--warmup-iters", type=int, default=2, help="untimed iterations per model")
    parser.add_argument("--rounds", type=int, default=5, help="alternating measured blocks per model")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (CPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--debug", action="store_true")
    return parser.parse_args(argv)


def build_config(args) -> ModelConfig:
    """The preset with the overrides, vocabulary unpadded; refuses shapes HF's Llama cannot hold."""
    overrides = {name: getattr(args, name) for name in OVERRIDE_FLAGS if getattr(args, name) is not None}
    config = model_config_from_preset(args.model, make_vocab_size_divisible_by=1, **overrides)
    if not (config.position_embedding_type == "rope" and config.swiglu and config.normalization == "RMSNorm"
            and not config.add_bias_linear):
        raise UserError(f"--model {args.model} is not LLaMA-shaped (rope, SwiGLU, RMSNorm, no biases); "
                        f"pick a llama preset or tiny")
    return config


def hf_llama(config: ModelConfig):
    """LlamaForCausalLM with megalite's dimensions, SDPA attention, no KV cache (fp32, CPU)."""
    import transformers

    return transformers.LlamaForCausalLM(llama_config_to_hf(config, attn_implementation="sdpa", use_cache=False))


def make_optimizer(model):
    """The same plain AdamW for both sides (not megalite's mixed-precision / ZeRO optimizer)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=0.1, foreach=True)


def megalite_step(model, optimizer, batch) -> float:
    """One iteration; megalite returns per-token losses [b, s]."""
    tokens, labels, positions = batch
    losses = model(tokens, positions, labels)
    loss = losses.sum() / losses.numel()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def hf_step(model, optimizer, batch) -> float:
    """One iteration; the loss is taken from the logits as megalite takes it (fp32 cross-entropy)."""
    tokens, labels, positions = batch
    logits = model(input_ids=tokens, position_ids=positions).logits  # [b, s, vocab]
    loss = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_block(step, iters: int, device: torch.device) -> tuple[float, float]:
    """(seconds for `iters` calls of step(), the last loss), with the GPU drained at both ends."""
    synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        loss = step()
    synchronize(device)
    return time.perf_counter() - start, float(loss)


def block_sizes(iters: int, rounds: int) -> list[int]:
    """`iters` split into `rounds` blocks as even as can be."""
    base, extra = divmod(iters, rounds)
    return [base + (1 if i < extra else 0) for i in range(rounds) if base or i < extra]


def measure(steps: dict, args, device: torch.device) -> dict:
    """name -> {"seconds": [per block], "iters": [per block], "loss": last}, blocks alternating."""
    for step in steps.values():
        time_block(step, args.warmup_iters, device)
    results = {name: {"seconds": [], "iters": [], "loss": float("nan")} for name in steps}
    for round_index, iters in enumerate(block_sizes(args.iters, args.rounds)):
        order = list(steps) if round_index % 2 == 0 else list(reversed(steps))
        for name in order:
            seconds, loss = time_block(steps[name], iters, device)
            results[name]["seconds"].append(seconds)
            results[name]["iters"].append(iters)
            results[name]["loss"] = loss
    return results


def report(results: dict, params: dict, config: ModelConfig, args, peak) -> None:
    """The table, and the megalite / HF ratio over all blocks and over each side's fastest block."""
    tokens_per_iter = args.micro_batch_size * config.seq_length
    flops = flops_per_iteration(config, args.micro_batch_size, config.seq_length)
    print(f"{'model':10s} {'params':>11s} {'tokens/s':>10s} {'ms/iter':>9s} {'best/worst ms/iter':>19s} "
          f"{'TFLOP/s':>8s} {'MFU':>7s} {'last loss':>10s}")
    rates, best_rates = {}, {}
    for name, result in results.items():
        seconds, iters = sum(result["seconds"]), sum(result["iters"])
        per_block = [1000 * s / i for s, i in zip(result["seconds"], result["iters"])]
        rates[name] = tokens_per_iter * iters / seconds
        best_rates[name] = tokens_per_iter * 1000 / min(per_block)
        achieved = flops * iters / seconds
        mfu = "unknown" if peak[0] is None else f"{100 * achieved / peak[0]:.1f}%"
        print(f"{name:10s} {params[name]:11,d} {rates[name]:10.0f} {1000 * seconds / iters:9.1f} "
              f"{min(per_block):9.1f}/{max(per_block):<9.1f} {achieved / 1e12:8.4f} {mfu:>7s} "
              f"{result['loss']:10.4f}")
    # The fastest block is the least disturbed by other work on a shared machine.
    print(f"ratio megalite / HF tokens/s: {rates['megalite'] / rates['HF']:.3f} over all blocks, "
          f"{best_rates['megalite'] / best_rates['HF']:.3f} between the fastest blocks")


def main(argv=None):
    args = get_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no GPU; use --device cpu")
    if args.iters < 1 or args.rounds < 1 or args.warmup_iters < 0:
        raise UserError("--iters and --rounds must be at least 1 and --warmup-iters at least 0")
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    config = build_config(args)

    import transformers

    model = build_model(config, args.seed, device=device, dtype=dtype).train()
    torch.manual_seed(args.seed)
    hf_model = hf_llama(config).to(device=device, dtype=dtype).train()
    generator = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, config.real_vocab_size, (args.micro_batch_size, config.seq_length + 1),
                         generator=generator).to(device)
    positions = torch.arange(config.seq_length, device=device).expand(args.micro_batch_size, -1)
    batch = (data[:, :-1].contiguous(), data[:, 1:].contiguous(), positions)

    optimizer, hf_optimizer = make_optimizer(model), make_optimizer(hf_model)
    steps = {"megalite": lambda: megalite_step(model, optimizer, batch),
             "HF": lambda: hf_step(hf_model, hf_optimizer, batch)}
    params = {"megalite": sum(p.numel() for p in model.parameters()),
              "HF": sum(p.numel() for p in hf_model.parameters())}
    peak = peak_flops(device, dtype)

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    print(f"model {args.model}: {config.num_layers} layers, hidden {config.hidden_size}, ffn "
          f"{config.ffn_hidden_size}, {config.num_attention_heads} heads / {config.query_groups} groups, "
          f"vocab {config.real_vocab_size}; batch {args.micro_batch_size} x seq {config.seq_length}, "
          f"{args.dtype}; {args.warmup_iters} warm-up + {args.iters} measured iterations each "
          f"in {args.rounds} alternating blocks")
    print(f"model FLOPs per iteration: {flops_per_iteration(config, args.micro_batch_size, config.seq_length):.4E}"
          f" | peak: {peak[1]}")
    report(measure(steps, args, device), params, config, args, peak)


if __name__ == "__main__":
    run_main(main)
