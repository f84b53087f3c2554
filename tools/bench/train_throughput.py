"""Training tokens/s of megalite next to Hugging Face's LlamaForCausalLM on the same model.

    python tools/bench/train_throughput.py [--config A|B|1B|preset] [--dtype fp32|bf16]
        [--modes best|eager|compile] [--iters 10] [--warmup-iters 2] [--rounds 5] [--threads 2]
        [--peers hf,minimal] [--hf-iters N] [--hf-warmup-iters N] [--device cpu|cuda]
        [--model tiny] [--profile ROWS] [--json PATH] ...

Configs (issue 10): A = hidden 256, 4 layers, 4 heads, FFN 688, vocab 8192, seq 256,
micro-batch 8; B = hidden 512, 8 layers, 8 heads, FFN 1376, vocab 32000, seq 512,
micro-batch 4 (both LLaMA-shaped, one key/value head per query head); 1B = the llama-1b
preset (1.1B parameters) at seq 2048, micro-batch 4, for a GPU (`--device cuda --dtype
bf16`, MFU against the GPU's datasheet bf16 peak); `--config preset` takes --model and the
override flags instead.

Peers (`--peers`, default both): HF's LlamaForCausalLM, and a minimal PyTorch LLaMA of
about 100 lines (tools/bench/minimal_llama.py: nn.Linear projections, F.rms_norm, rotary,
SDPA with enable_gqa, SwiGLU, F.cross_entropy on fp32 logits; what a user writes instead
of using a framework), whose variants are `minimal eager` / `minimal compile` (the whole
model and its loss under torch.compile). It has the same shapes, real vocabulary, dtype,
batch and iteration; its parameter count and its loss at init (about ln(vocab)) are
printed beside megalite's.

Every side trains the same LLaMA-style model: HF's config is built from megalite's, on
the tokenizer's vocabulary (megalite's padding is turned off, so both compute the same
logits), with the same tokens, batch, sequence length, dtype and thread count, and
SDPA attention on all. One iteration is forward + backward + optimizer step with the
same `torch.optim.AdamW(fused=True)` on every side (megalite's own optimizer, with fp32
main params and ZeRO, is measured by its training runs): this compares the models. The
models start from their own initialisations; values do not change the work. All
run in this one process.

Modes: with `--modes best` (the default) each side runs eager and under torch.compile
(megalite: its transformer layers compiled one by one, as `--compile` does in training;
HF and the minimal model: the whole model and its loss in one graph), all timed side by
side, and each side is judged by its faster mode: megalite's best against each peer's
best. Compile time (the warm-up iterations' extra time over eager) is reported apart and
never counted in tokens/s.

Timing: each variant first runs --warmup-iters untimed iterations; then --rounds measured
blocks alternate between them (forward order, then reversed, ...), so that whatever else
the machine does falls on all. tokens/s is given per block: median, min and max; the
ratio megalite / HF (and megalite / minimal) is given between the medians, between the fastest blocks, and as
the median of same-round pairs (blocks seconds apart, so slow drifts of a shared machine
cancel), with a 90% bootstrap interval for that median from 4 pairs on. Where HF is
very slow (bf16 on a CPU without bf16 units: ~1 GFLOP/s GEMMs), --hf-iters /
--hf-warmup-iters give it fewer iterations; its blocks then fill the first rounds. The
--hf-* flags (iterations, warm-up, modes) hold for the minimal model too: it runs the
same PyTorch GEMMs as HF.
TFLOP/s and MFU use megalite.run.flops's FLOPs formula (the same model FLOPs for all) and
peak: a datasheet value on a known GPU; on a CPU the fastest 1024^3 matmul measured in
this run (at startup and after every round) by megalite.run.flops.peak_flops: for bf16 the
faster of bf16 and fp32 (fp32 alone on a CPU without bf16 units).
"""

import argparse
import copy
import functools
import json
import math
import os
import random
import statistics
import time

import torch
import torch.nn.functional as F

from megalite import cpu
from megalite.config import MODEL_PRESETS, ModelConfig, model_config_from_preset
from megalite.errors import UserError, run_main
from megalite.convert import llama_config_to_hf
from megalite.run.flops import flops_per_iteration, peak_flops
from megalite.model.gpt import build_model
from megalite.model.loss import LanguageModelLoss
from megalite.model.options import apply_options
from megalite.model.rotary import RotaryEmbedding
from tools.bench.minimal_llama import MinimalLlama

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# The two configs; `preset` keeps --model and the override flags.
CONFIGS = {
    "A": dict(model="tiny", hidden_size=256, num_layers=4, num_attention_heads=4, num_query_groups=4,
              ffn_hidden_size=688, vocab_size=8192, seq_length=256, micro_batch_size=8),
    "B": dict(model="tiny", hidden_size=512, num_layers=8, num_attention_heads=8, num_query_groups=8,
              ffn_hidden_size=1376, vocab_size=32000, seq_length=512, micro_batch_size=4),
    # For a GPU (--device cuda --dtype bf16): the llama-1b preset (TinyLlama's shape, 1.1B
    # parameters, GQA 32/4), seq 2048.
    "1B": dict(model="llama-1b", seq_length=2048, micro_batch_size=4),
}
MODES = {"best": ("eager", "compile"), "eager": ("eager",), "compile": ("compile",)}
PEERS = {"hf": "HF", "minimal": "minimal"}  # --peers name -> the prefix of its variants
OVERRIDE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                  "num_query_groups", "seq_length", "vocab_size")


def get_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="A", choices=sorted(CONFIGS) + ["preset"],
                        help="the issue's config A or B, or `preset`: --model with the override flags")
    parser.add_argument("--modes", default="best", choices=sorted(MODES),
                        help="best: each side eager and torch.compile, judged by the faster")
    parser.add_argument("--model", default="tiny", choices=sorted(MODEL_PRESETS))
    for name in OVERRIDE_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=None,
                            help="override the preset's value")
    parser.add_argument("--micro-batch-size", type=int, default=8)
    parser.add_argument("--iters", type=int, default=10, help="measured iterations per model")
    parser.add_argument("--warmup-iters", type=int, default=2, help="untimed iterations per model")
    parser.add_argument("--rounds", type=int, default=5, help="alternating measured blocks per model")
    parser.add_argument("--peers", default="hf,minimal",
                        help="comma-separated peers to time beside megalite: hf (HF's LlamaForCausalLM), minimal "
                             "(a ~100-line PyTorch LLaMA, tools/bench/minimal_llama.py); default both")
    parser.add_argument("--hf-iters", type=int, default=None,
                        help="measured iterations of each HF (and minimal) variant (default: --iters); fewer where "
                             "HF is very slow, e.g. bf16 on a CPU without bf16 units")
    parser.add_argument("--hf-warmup-iters", type=int, default=None,
                        help="untimed iterations of each HF (and minimal) variant (default: --warmup-iters); 0 where "
                             "one iteration takes minutes and its one-off costs are noise")
    parser.add_argument("--hf-modes", default=None, choices=sorted(MODES),
                        help="HF's (and minimal's) modes (default: --modes); eager alone where its compile cannot "
                             "help, e.g. bf16 GEMMs at ~1 GFLOP/s on a CPU without bf16 units")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads (CPU)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--debug", action="store_true")
    parser.add_argument("--profile", type=int, default=0, metavar="ROWS",
                        help="after the timing, print the top ROWS ops of one iteration of each side's best mode "
                             "(by GPU time on CUDA, CPU time on a CPU)")
    parser.add_argument("--json", default=None, metavar="PATH",
                        help="also write the summary (tokens/s, ratios, MFU; --profile's rows) to PATH as JSON")
    args = parser.parse_args(argv)
    args.peers = parse_peers(args.peers)
    args.hf_modes = args.modes if args.hf_modes is None else args.hf_modes
    args.hf_iters = args.iters if args.hf_iters is None else args.hf_iters
    args.hf_warmup_iters = args.warmup_iters if args.hf_warmup_iters is None else args.hf_warmup_iters
    if args.config != "preset":
        for name, value in CONFIGS[args.config].items():
            setattr(args, name, value)
    return args


def parse_peers(text: str) -> tuple[str, ...]:
    """`--peers hf,minimal` -> ("hf", "minimal"); UserError on an unknown or empty list."""
    peers = tuple(dict.fromkeys(name.strip().lower() for name in text.split(",") if name.strip()))
    unknown = [name for name in peers if name not in PEERS]
    if unknown or not peers:
        raise UserError(f"--peers {text!r}: give one or more of {', '.join(PEERS)}, comma-separated "
                        f"(e.g. --peers hf,minimal)")
    return peers


def build_config(args) -> ModelConfig:
    """The preset with the overrides, vocabulary unpadded; refuses shapes HF's Llama cannot hold."""
    overrides = {name: getattr(args, name) for name in OVERRIDE_FLAGS if getattr(args, name) is not None}
    if "seq_length" in overrides:  # the context length follows the sequence (RoPE has no table to outgrow)
        overrides["max_position_embeddings"] = overrides["seq_length"]
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


def minimal_llama(config: ModelConfig, device, dtype) -> MinimalLlama:
    """The minimal PyTorch LLaMA with megalite's dimensions (real vocabulary), built in `dtype` on `device`."""
    inv_freq = None
    if config.use_rope_scaling:  # Llama 3.1's scaled frequencies, as megalite's model draws them
        inv_freq = RotaryEmbedding(config.head_dim, config.rotary_base, config.rope_scaling_factor).inv_freq
    return MinimalLlama(config.real_vocab_size, config.hidden_size, config.num_layers, config.num_attention_heads,
                        config.query_groups, config.ffn_hidden_size, rope_theta=config.rotary_base,
                        eps=config.norm_epsilon, tied=not config.untie_embeddings_and_output_weights,
                        inv_freq=inv_freq, device=device, dtype=dtype)


def make_optimizer(model):
    """The same plain AdamW for both sides (not megalite's mixed-precision / ZeRO optimizer)."""
    return torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95), eps=1e-8,
                             weight_decay=0.1, fused=True)  # the fastest AdamW on CPU and GPU


def megalite_step(model, optimizer, batch) -> float:
    """One iteration; megalite's loss returns per-token losses [b, s]."""
    tokens, labels, positions = batch
    losses = LanguageModelLoss.of(model)(model, model(tokens, positions), labels)
    loss = losses.sum() / losses.numel()
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def hf_loss(model, tokens, labels, positions) -> torch.Tensor:
    """HF's mean loss over the batch, from the logits as megalite takes it (fp32 cross-entropy)."""
    logits = model(input_ids=tokens, position_ids=positions).logits  # [b, s, vocab]
    return F.cross_entropy(logits.float().flatten(0, 1), labels.flatten())


def peer_step(loss_fn, optimizer, batch) -> float:
    """One iteration of a peer; loss_fn is hf_loss on HF's model, or the minimal model (its loss inside),
    compiled whole (loss included) in compile mode."""
    tokens, labels, positions = batch
    loss = loss_fn(tokens, labels, positions)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_block(step, iters: int, device: torch.device) -> tuple[float, float, float]:
    """(seconds for `iters` calls of step(), the last loss, the first loss), with the GPU drained at both
    ends; the losses are read after the clock stops (no host sync inside the block)."""
    synchronize(device)
    start, first, loss = time.perf_counter(), None, float("nan")
    for _ in range(iters):
        loss = step()
        first = loss if first is None else first
    synchronize(device)
    seconds = time.perf_counter() - start
    return seconds, float(loss), float("nan") if first is None else float(first)


def block_sizes(iters: int, rounds: int) -> list[int]:
    """`iters` split into `rounds` blocks as even as can be."""
    base, extra = divmod(iters, rounds)
    return [base + (1 if i < extra else 0) for i in range(rounds) if base or i < extra]


def measure(steps: dict, args, device: torch.device, dtype: torch.dtype) -> tuple[dict, dict, list]:
    """(name -> {"seconds", "iters", "rounds": [per block], "loss": last}, name -> warm-up seconds,
    CPU matmul FLOP/s measured after each round).

    Blocks alternate between the variants, forward order then reversed, round after round.
    On a CPU the matmul peak is re-measured after every round, so that a peak taken while
    other work held the cores does not stand for the machine's.
    """
    peaks = []
    warmup, first_loss = {}, {}
    for name, step in steps.items():
        warmup[name], _, first_loss[name] = time_block(step, warmup_iters(args, name), device)
        print(f"warm-up {name}: {warmup[name]:.1f} s", flush=True)  # progress on slow machines
    results = {name: {"seconds": [], "iters": [], "rounds": [], "loss": float("nan"), "first_loss": first_loss[name]}
               for name in steps}
    blocks = {name: block_sizes(measured_iters(args, name), args.rounds) for name in steps}
    for round_index in range(args.rounds):
        order = list(steps) if round_index % 2 == 0 else list(reversed(steps))
        for name in order:
            if round_index >= len(blocks[name]):  # fewer iterations than rounds: no block this round
                continue
            seconds, loss, first = time_block(steps[name], blocks[name][round_index], device)
            if math.isnan(results[name]["first_loss"]):  # no warm-up: the first measured iteration's
                results[name]["first_loss"] = first
            results[name]["seconds"].append(seconds)
            results[name]["iters"].append(blocks[name][round_index])
            results[name]["rounds"].append(round_index)
            results[name]["loss"] = loss
        if device.type == "cpu":
            peaks.append(peak_flops(device, dtype, cpu_seconds=0.3)[0])  # bf16: or fp32, if faster
    return results, warmup, peaks


def is_peer(name: str) -> bool:
    """Whether the variant `name` is a peer's (HF or minimal), not megalite's."""
    return name.split()[0] in PEERS.values()


def warmup_iters(args, name: str) -> int:
    """Untimed iterations of the variant `name` (the peers' own count with --hf-warmup-iters)."""
    return args.hf_warmup_iters if is_peer(name) else args.warmup_iters


def measured_iters(args, name: str) -> int:
    """Timed iterations of the variant `name` (the peers' own count with --hf-iters)."""
    return args.hf_iters if is_peer(name) else args.iters


def block_rates(result: dict, tokens_per_iter: int) -> list[float]:
    """tokens/s of each measured block."""
    return [tokens_per_iter * i / s for s, i in zip(result["seconds"], result["iters"])]


def compile_seconds(warmup: dict, name: str, median_seconds_per_iter: dict, iters: int) -> float | None:
    """The compiled variant's warm-up time beyond what as many eager iterations take.

    About 0 when Inductor's on-disk cache already held the code (noise can make the
    difference negative, hence the floor at 0).
    """
    eager = name.replace("compile", "eager")
    if "compile" not in name or eager not in median_seconds_per_iter:
        return None
    return max(0.0, warmup[name] - iters * median_seconds_per_iter[eager])


def report(results: dict, warmup: dict, params: dict, config: ModelConfig, args, peak) -> dict:
    """The table, and the ratio megalite / peer (HF, minimal) between each side's best mode; returns the
    summary: the HF comparison at the top level (None without HF) and every peer's under "peers"."""
    tokens_per_iter = args.micro_batch_size * config.seq_length
    flops = flops_per_iteration(config, args.micro_batch_size, config.seq_length)
    rates = {name: block_rates(result, tokens_per_iter) for name, result in results.items()}
    medians = {name: statistics.median(r) for name, r in rates.items()}
    seconds_per_iter = {name: tokens_per_iter / m for name, m in medians.items()}
    print(f"{'variant':21s} {'params':>11s} {'median tok/s':>12s} {'min':>8s} {'max':>8s} {'ms/iter':>8s} "
          f"{'TFLOP/s':>8s} {'MFU':>6s} {'compile s':>9s} {'last loss':>9s}")
    for name, result in results.items():
        achieved = flops * medians[name] / tokens_per_iter
        mfu = "?" if peak[0] is None else f"{100 * achieved / peak[0]:.1f}%"
        extra = compile_seconds(warmup, name, seconds_per_iter, warmup_iters(args, name))
        print(f"{name:21s} {params[name.split()[0]]:11,d} {medians[name]:12.0f} {min(rates[name]):8.0f} "
              f"{max(rates[name]):8.0f} {1000 * seconds_per_iter[name]:8.1f} {achieved / 1e12:8.4f} {mfu:>6s} "
              f"{'-' if extra is None else f'{extra:.1f}':>9s} {result['loss']:9.4f}")
    sides = [side for side in ("megalite", *PEERS.values()) if any(n.startswith(side + " ") for n in results)]
    best = {side: max((n for n in results if n.startswith(side + " ")), key=lambda n: medians[n]) for side in sides}
    print_checks(results, params, config, best)
    mfu = None if peak[0] is None else flops * medians[best["megalite"]] / tokens_per_iter / peak[0]
    peers = {}
    for side in sides[1:]:
        ratio = medians[best["megalite"]] / medians[best[side]]
        # The fastest block is the least disturbed by other work on a shared machine.
        fastest_ratio = max(rates[best["megalite"]]) / max(rates[best[side]])
        paired, paired_ratio, interval, pairs_text = compare_pairs(results, rates, best["megalite"], best[side])
        if paired:  # HF's line keeps its original wording
            print(f"same-round ratios{'' if side == 'HF' else f' megalite / {side}'}: "
                  + " ".join(f"{r:.3f}" for r in paired))
        print(f"best modes: {best['megalite']} vs {best[side]}; ratio megalite / {side} tokens/s: {ratio:.3f} "
              f"between the medians, {fastest_ratio:.3f} between the fastest blocks, {pairs_text}; megalite MFU "
              f"{'unknown' if mfu is None else f'{100 * mfu:.1f}%'}")
        peers[side] = {"ratio": ratio, "fastest_ratio": fastest_ratio, "paired_ratio": paired_ratio,
                       "paired_interval": interval}
    hf = peers.get("HF", dict.fromkeys(("ratio", "fastest_ratio", "paired_ratio", "paired_interval")))
    return {"best": best, **hf, "peers": peers, "mfu": mfu, "medians": medians,
            "init_loss": {name: result["first_loss"] for name, result in results.items()}}


def print_checks(results: dict, params: dict, config: ModelConfig, best: dict) -> None:
    """Same model on every side: each side's parameter count beside megalite's, and the loss of each best
    variant's first iteration (at init: about ln(vocab), a bit above it as the logits' spread grows)."""
    mine = params["megalite"]
    counts = ", ".join(f"{side} {params[side]:,d}" for side in best)
    same = all(params[side] == mine for side in best)
    print(f"parameters: {counts} ({'equal' if same else 'DIFFERENT: not the same model'})")
    expected = math.log(config.real_vocab_size)
    losses = ", ".join(f"{name} {results[name]['first_loss']:.4f}" for name in best.values())
    far = [name for name in best.values() if not abs(results[name]["first_loss"] - expected) <= 0.1 * expected]
    print(f"loss at init (first iteration): {losses}; ln(vocab {config.real_vocab_size}) = {expected:.4f}"
          + (f"; more than 10% away: {', '.join(far)} (check its init)" if far else ""))


def compare_pairs(results: dict, rates: dict, mine: str, theirs: str) -> tuple:
    """(same-round ratios mine / theirs, their median or None, its bootstrap interval or None, a phrase)."""
    paired = paired_ratios(results[mine], rates[mine], results[theirs], rates[theirs])
    if not paired:
        return paired, None, None, "no round ran both"
    median, interval = statistics.median(paired), median_interval(paired)
    text = f"{median:.3f} as the median of {len(paired)} same-round pairs"
    if interval:
        text += f" (90% bootstrap interval {interval[0]:.3f}-{interval[1]:.3f})"
    return paired, median, interval, text


def median_interval(values: list[float], confidence: float = 0.9, resamples: int = 2000) -> tuple | None:
    """(low, high): a percentile-bootstrap interval for the median of `values`; None for fewer than 4.

    On a machine whose speed drifts by ±20%, this says how far the measured ratio could
    move in another run of the same length (seeded, so a run reprints the same interval).
    """
    if len(values) < 4:
        return None
    generator = random.Random(0)
    medians = sorted(statistics.median(generator.choices(values, k=len(values))) for _ in range(resamples))
    tail = (1 - confidence) / 2
    return medians[int(tail * resamples)], medians[int((1 - tail) * resamples) - 1]


def paired_ratios(mine: dict, my_rates: list, theirs: dict, their_rates: list) -> list[float]:
    """mine / theirs tokens/s of the blocks that ran in the same round (seconds apart).

    Slow drifts of a shared machine (another job starting, the clock changing) fall
    on both blocks of a pair, so their ratio is steadier than one of medians.
    """
    their_rate_in = dict(zip(theirs["rounds"], their_rates))
    return [rate / their_rate_in[r] for r, rate in zip(mine["rounds"], my_rates) if r in their_rate_in]


def megalite_variant(model, mode: str, batch):
    """The step closure of `model` (its own optimizer) in `mode`, set up as training sets it up: the CPU
    backend on a CPU, then (compile) each layer compiled on its own, as --compile does."""
    if next(model.parameters()).device.type == "cpu":
        cpu.apply(model)
    if mode == "compile":
        apply_options(model, compile=True)
    return functools.partial(megalite_step, model, make_optimizer(model), batch)


def build_variants(config: ModelConfig, args, device, dtype, batch) -> tuple[dict, dict]:
    """(variant name -> step closure, side -> parameter count) for --modes, and --hf-modes of each of
    --peers."""
    model = build_model(config, args.seed, device=device, dtype=dtype).train()
    mine = sum(p.numel() for p in model.parameters())
    params = {"megalite": mine}
    peer_models = {}
    if "hf" in args.peers:
        torch.manual_seed(args.seed)
        peer_models["HF"] = hf_llama(config).to(device=device, dtype=dtype).train()
    if "minimal" in args.peers:
        torch.manual_seed(args.seed)
        peer_models["minimal"] = minimal_llama(config, device, dtype).train()
    params.update({side: sum(p.numel() for p in peer.parameters()) for side, peer in peer_models.items()})
    steps = {}
    for mode in MODES[args.modes]:
        # Each variant owns a model copy and an optimizer, so they never share state.
        steps[f"megalite {mode}"] = megalite_variant(model if mode == "eager" else copy.deepcopy(model), mode, batch)
    for side, peer in peer_models.items():
        for mode in MODES[args.hf_modes]:
            theirs = peer if mode == "eager" else copy.deepcopy(peer)
            loss_theirs = functools.partial(hf_loss, theirs) if side == "HF" else theirs  # minimal: loss inside
            if mode == "compile":
                # Each peer's best case: the model and its loss in one graph, so the cross-entropy is fused too.
                loss_theirs = torch.compile(loss_theirs)
            steps[f"{side} {mode}"] = functools.partial(peer_step, loss_theirs, make_optimizer(theirs), batch)
    return steps, params


def main(argv=None):
    args = get_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda asked for, but torch sees no GPU; use --device cpu")
    if args.device != "cuda":
        cpu.set_up_process()  # as pretrain_gpt.py does on a CPU; every side runs in this process
    if min(args.iters, args.rounds, args.warmup_iters, args.hf_iters) < 1 or args.hf_warmup_iters < 0:
        raise UserError("--iters, --rounds, --warmup-iters and --hf-iters must be at least 1, "
                        "--hf-warmup-iters at least 0")
    if args.hf_warmup_iters == 0 and "compile" in MODES[args.hf_modes]:
        raise UserError("--hf-warmup-iters 0 would time HF's compilation; give it 1 or use --hf-modes eager")
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    config = build_config(args)

    import transformers

    generator = torch.Generator().manual_seed(args.seed)
    data = torch.randint(0, config.real_vocab_size, (args.micro_batch_size, config.seq_length + 1),
                         generator=generator).to(device)
    positions = torch.arange(config.seq_length, device=device).expand(args.micro_batch_size, -1)
    batch = (data[:, :-1].contiguous(), data[:, 1:].contiguous(), positions)
    steps, params = build_variants(config, args, device, dtype, batch)
    peak = peak_flops(device, dtype)

    print(f"torch {torch.__version__}, transformers {transformers.__version__}, device "
          f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    print(f"config {args.config}: {config.num_layers} layers, hidden {config.hidden_size}, ffn "
          f"{config.ffn_hidden_size}, {config.num_attention_heads} heads / {config.query_groups} groups, "
          f"vocab {config.real_vocab_size}; batch {args.micro_batch_size} x seq {config.seq_length}, "
          f"{args.dtype}; {args.warmup_iters} warm-up + {args.iters} measured iterations per megalite variant"
          f" ({args.hf_warmup_iters} + {args.hf_iters} per {' and '.join(PEERS[p] for p in args.peers)} variant) in up "
          f"to {args.rounds} alternating blocks")
    print(f"model FLOPs per iteration: {flops_per_iteration(config, args.micro_batch_size, config.seq_length):.4E}"
          f" | peak: {peak[1]}")
    results, warmup, peaks = measure(steps, args, device, dtype)
    if peak[0] is not None and peaks:
        best_peak = max([peak[0]] + peaks)
        kind = args.dtype if dtype == torch.float32 else f"{args.dtype} or fp32"
        peak = (best_peak, f"the fastest of the {kind} 1024^3 matmuls measured in this run "
                           f"(at startup and after each round): {best_peak / 1e9:.1f} GFLOP/s")
        print(f"peak: {peak[1]}")
    summary = report(results, warmup, params, config, args, peak)
    if args.profile:
        summary["profiles"] = {name: print_profile(name, steps[name], args.profile, device)
                               for name in summary["best"].values()}
    if args.json:
        write_json(args.json, summary)
    return summary


def print_profile(name: str, step, rows: int, device: torch.device) -> dict:
    """torch.profiler's table of one more iteration of `name`, by self GPU time on CUDA (self CPU time on a CPU):
    where it goes. Returns {"sort_by", "table": the printed text, "top": [{"name", "calls", "self_ms"}] * rows}."""
    with torch.profiler.profile() as prof:  # CPU, and CUDA where present
        step()
        synchronize(device)
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    table = averages.table(sort_by=sort_by, row_limit=rows)
    print(f"profile of one iteration of {name}, by {sort_by}:")
    print(table)
    top = sorted(averages, key=lambda event: getattr(event, sort_by), reverse=True)[:rows]
    return {"sort_by": sort_by, "table": table,
            "top": [{"name": e.key, "calls": e.count, "self_ms": getattr(e, sort_by) / 1e3} for e in top]}


def write_json(path: str, summary: dict) -> None:
    """--json: the summary with NaN (not measured) as null, as JSON has no NaN."""
    def clean(value):
        if isinstance(value, dict):
            return {key: clean(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [clean(item) for item in value]
        return None if isinstance(value, float) and math.isnan(value) else value

    with open(path, "w") as file:
        json.dump(clean(summary), file, indent=1)


if __name__ == "__main__":
    run_main(main)
