"""Model FLOPs per iteration and the peak FLOP/s of one device: the two halves of MFU.

- `flops_per_iteration`: the model FLOPs of one training iteration, from an explicit
  formula (docs/flops.md works it through for llama2-7b).
- `peak_flops`: the dense peak FLOP/s of one device in the run's dtype, from an
  explicit table of GPU datasheet values (`GPU_PEAKS`), or measured by a matmul on a
  CPU. An unknown GPU gets None, and MFU is then printed as "unknown": never guessed.
"""

import re
import time
from dataclasses import dataclass

import torch

from megalite.config import ModelConfig

# ----------------------------------------------------------------------------- FLOPs


def forward_flops_per_token(config: ModelConfig, seq_length: int) -> tuple[float, float, float]:
    """Forward FLOPs per token: (layer matmuls, causal attention, output layer), summed over layers.

    One multiply-add is 2 FLOPs. Per layer, with h = hidden, a = heads, g = query groups,
    d = head dim, f = ffn hidden, s = seq_length:
      QKV projections 2·h·(a + 2g)·d, attention output 2·a·d·h,
      MLP fc1 2·h·f·(2 if SwiGLU else 1), fc2 2·f·h,
      attention scores and values 2·2·s·a·d halved for the causal mask = 2·s·a·d.
    Output layer: 2·h·V with V the padded vocabulary (the model computes those logits).
    Norms, activations, softmax, rotary and the embedding lookup are not matmuls and are
    left out, as in Megatron's and PaLM's counts.
    """
    hidden, heads, groups, head_dim = (config.hidden_size, config.num_attention_heads,
                                       config.query_groups, config.head_dim)
    ffn = config.ffn_hidden_size
    qkv = 2 * hidden * (heads + 2 * groups) * head_dim
    attention_output = 2 * heads * head_dim * hidden
    mlp = 2 * hidden * ffn * (2 if config.swiglu else 1) + 2 * ffn * hidden
    # Each query meets s keys for QK^T and s values for AV; causality halves that on average.
    attention = 2 * 2 * seq_length * heads * head_dim / 2
    logits = 2 * hidden * config.vocab_size
    return (config.num_layers * float(qkv + attention_output + mlp),
            config.num_layers * float(attention), float(logits))


def flops_per_iteration(config: ModelConfig, global_batch_size: int, seq_length: int,
                        include_recompute: bool = False) -> float:
    """Model FLOPs of one training iteration over `global_batch_size` x `seq_length` tokens.

    Training = forward + backward = 3 x forward (the backward computes gradients for
    both the inputs and the weights of every matmul, 2 x forward). This is the count
    MFU uses: recomputation is work the hardware does, not work the model needs, so it
    is left out by default. `include_recompute=True` gives hardware FLOPs instead: full
    recomputation adds one more forward of the transformer layers, selective
    recomputation one more forward of the attention scores and values.
    """
    layer_matmuls, attention, logits = forward_flops_per_token(config, seq_length)
    per_token = 3 * (layer_matmuls + attention + logits)
    if include_recompute and config.recompute_granularity == "full":
        per_token += layer_matmuls + attention
    elif include_recompute and config.recompute_granularity == "selective":
        per_token += attention
    return float(global_batch_size * seq_length) * per_token


# ----------------------------------------------------------------------------- peak FLOP/s


@dataclass(frozen=True)
class GpuPeak:
    """Dense (no sparsity) peak TFLOP/s of one GPU model; None where it has no such unit.

    words: whole words that must all appear in `torch.cuda.get_device_name()`
    (case-insensitive, split on spaces and hyphens); unless: words that must not.
    fp32 is the plain (non-tensor-core) rate; tf32 applies to fp32 matmuls when TF32 is on.
    """

    words: tuple[str, ...]
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float
    source: str
    unless: tuple[str, ...] = ()


# First match wins, so a variant comes before the family word it contains. Datasheets
# quote tensor-core rates "with sparsity"; the dense rates here are half of those.
GPU_PEAKS: tuple[GpuPeak, ...] = (
    # NVIDIA H100 datasheet: PCIe 1,513 BF16/FP16 and 756 TF32 (sparse), 51 FP32.
    GpuPeak(("H100", "PCIe"), 756.0, 756.0, 378.0, 51.0, "NVIDIA H100 PCIe datasheet"),
    # NVIDIA H100 datasheet: NVL 1,671 BF16/FP16 and 835 TF32 (sparse), 60 FP32.
    GpuPeak(("H100", "NVL"), 835.5, 835.5, 417.5, 60.0, "NVIDIA H100 NVL datasheet"),
    # NVIDIA H100 datasheet: SXM 1,979 BF16/FP16 and 989 TF32 (sparse), 67 FP32.
    # The SXM part reports itself as "NVIDIA H100 80GB HBM3".
    GpuPeak(("H100", "HBM3"), 989.5, 989.5, 494.5, 67.0, "NVIDIA H100 SXM datasheet"),
    GpuPeak(("H100", "SXM"), 989.5, 989.5, 494.5, 67.0, "NVIDIA H100 SXM datasheet"),
    # NVIDIA GH200 datasheet: the same Hopper GPU as H100 SXM.
    GpuPeak(("GH200",), 989.5, 989.5, 494.5, 67.0, "NVIDIA GH200 datasheet"),
    # NVIDIA H200 datasheet: NVL 1,671 BF16/FP16 and 835 TF32 (sparse), 60 FP32.
    GpuPeak(("H200", "NVL"), 835.5, 835.5, 417.5, 60.0, "NVIDIA H200 NVL datasheet"),
    # NVIDIA H200 datasheet: SXM 1,979 BF16/FP16 and 989 TF32 (sparse), 67 FP32.
    GpuPeak(("H200",), 989.5, 989.5, 494.5, 67.0, "NVIDIA H200 SXM datasheet"),
    # NVIDIA A100 datasheet: 312 BF16/FP16, 156 TF32 (dense), 19.5 FP32; SXM and PCIe alike.
    GpuPeak(("A100",), 312.0, 312.0, 156.0, 19.5, "NVIDIA A100 datasheet"),
    # AWS A10G (g5 instances): 70 BF16/FP16 and 35 TF32 tensor, 35 FP32 (80 SMs, half-rate
    # FP32-accumulate tensor cores, unlike the A10).
    GpuPeak(("A10G",), 70.0, 70.0, 35.0, 35.0, "AWS A10G specification"),
    # NVIDIA A10 datasheet: 250 BF16/FP16 and 125 TF32 (sparse), 31.2 FP32.
    GpuPeak(("A10",), 125.0, 125.0, 62.5, 31.2, "NVIDIA A10 datasheet"),
    # NVIDIA L40S datasheet: 733 BF16/FP16 and 366 TF32 (sparse), 91.6 FP32.
    GpuPeak(("L40S",), 362.05, 362.05, 183.0, 91.6, "NVIDIA L40S datasheet"),
    # NVIDIA L40 datasheet: 362.1 BF16/FP16 and 181 TF32 (sparse), 90.5 FP32.
    GpuPeak(("L40",), 181.05, 181.05, 90.5, 90.5, "NVIDIA L40 datasheet"),
    # NVIDIA L4 datasheet: 242 BF16/FP16 and 120 TF32 (sparse), 30.3 FP32.
    GpuPeak(("L4",), 121.0, 121.0, 60.0, 30.3, "NVIDIA L4 datasheet"),
    # NVIDIA Ada Lovelace whitepaper, RTX 4090: 165.2 BF16/FP16 with FP32 accumulate
    # (what PyTorch uses), 82.6 TF32 (dense), 82.6 FP32. The 4090 D is a smaller chip.
    GpuPeak(("RTX", "4090"), 165.2, 165.2, 82.6, 82.6, "NVIDIA Ada Lovelace whitepaper",
            unless=("D",)),
    # NVIDIA V100 datasheet: 125 (SXM2) / 112 (PCIe) / 130 (V100S) FP16 tensor, no BF16 or
    # TF32 units; 15.7 / 14 / 16.4 FP32.
    GpuPeak(("V100", "SXM2"), None, 125.0, None, 15.7, "NVIDIA V100 datasheet"),
    GpuPeak(("V100", "PCIE"), None, 112.0, None, 14.0, "NVIDIA V100 datasheet"),
    GpuPeak(("V100S",), None, 130.0, None, 16.4, "NVIDIA V100S datasheet"),
    # NVIDIA T4 datasheet: 65 FP16 tensor, 8.1 FP32.
    GpuPeak(("T4",), None, 65.0, None, 8.1, "NVIDIA T4 datasheet"),
    # AMD Instinct MI300X datasheet: 1,307.4 BF16/FP16 and 653.7 TF32 (dense), 163.4 FP32 matrix.
    GpuPeak(("MI300X",), 1307.4, 1307.4, 653.7, 163.4, "AMD Instinct MI300X datasheet"),
)

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def find_gpu_peak(device_name: str) -> GpuPeak | None:
    """The first GPU_PEAKS entry whose words all appear in `device_name` (and none of its `unless`)."""
    words = {word.upper() for word in re.split(r"[\s\-_]+", device_name) if word}
    for entry in GPU_PEAKS:
        if ({w.upper() for w in entry.words} <= words
                and not {w.upper() for w in entry.unless} & words):
            return entry
    return None


def gpu_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> tuple[float | None, str]:
    """(dense peak FLOP/s or None, where it comes from) for a GPU named `device_name`.

    tf32: whether fp32 matmuls run on TF32 tensor cores; they then use the TF32 peak.
    """
    entry = find_gpu_peak(device_name)
    if entry is None:
        return None, f"{device_name!r} is not in megalite.run.flops.GPU_PEAKS: MFU unknown"
    kind = DTYPE_NAMES.get(dtype, str(dtype))
    if dtype == torch.float32 and tf32 and entry.tf32 is not None:
        tflops, kind = entry.tf32, "tf32"
    else:
        tflops = {"bf16": entry.bf16, "fp16": entry.fp16, "fp32": entry.fp32}.get(kind)
    if tflops is None:
        return None, f"{device_name}: no dense {kind} peak in GPU_PEAKS ({entry.source}): MFU unknown"
    return tflops * 1e12, f"{device_name}: {tflops:g} TFLOP/s dense {kind} ({entry.source})"


def cuda_tf32_enabled() -> bool:
    """Whether fp32 CUDA matmuls may use TF32 (PyTorch's new flag, else the legacy one)."""
    precision = getattr(torch.backends.cuda.matmul, "fp32_precision", "none")
    if precision != "none":
        return precision == "tf32"
    try:
        return bool(torch.backends.cuda.matmul.allow_tf32)
    except RuntimeError:  # torch refuses to answer when the legacy and new flags were mixed
        return False


def measure_cpu_flops(dtype: torch.dtype = torch.float32, size: int = 1024, seconds: float = 0.5) -> float:
    """FLOP/s of `size`^3 matmuls in `dtype` on this process's threads, timed for about `seconds`."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    torch.mm(a, b)  # first call allocates and picks the kernel; keep it out of the timing
    count, start = 0, time.perf_counter()
    while True:
        torch.mm(a, b)
        count += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds and count >= 2:
            return 2.0 * size ** 3 * count / elapsed


def peak_flops(device, dtype: torch.dtype, cpu_matmul_size: int = 1024,
               cpu_seconds: float = 0.5) -> tuple[float | None, str]:
    """(peak FLOP/s of one device in `dtype`, or None, and a sentence saying where it comes from).

    CUDA: the GPU_PEAKS entry of `torch.cuda.get_device_name(device)`; an unlisted GPU
    gives None. CPU: no datasheet applies to "this many cores of this machine", so a
    short matmul benchmark on the current thread count stands in for the peak; it is
    measured here, once per call (about `cpu_seconds`), in `dtype`, and for bf16/fp16 also
    in fp32, keeping the faster; only in fp32 on a CPU without units for `dtype`.
    """
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype, tf32=cuda_tf32_enabled())
    if device.type == "cpu":
        name = DTYPE_NAMES.get(dtype, dtype)
        if not _cpu_has_matrix_units(dtype):
            # Without bf16/fp16 units such matmuls fall back to a slow path (docs/benchmarks.md), so
            # the fp32 rate stands in for this CPU's best.
            value = measure_cpu_flops(torch.float32, cpu_matmul_size, cpu_seconds)
            source = f"a {cpu_matmul_size}^3 fp32 matmul (this CPU has no {name} matrix units)"
        else:
            value = measure_cpu_flops(dtype, cpu_matmul_size, cpu_seconds)
            source = f"a {cpu_matmul_size}^3 {name} matmul"
            if dtype != torch.float32:
                # The faster of the two keeps MFU below 100% where bf16 units are slow ones.
                fp32 = measure_cpu_flops(torch.float32, cpu_matmul_size, cpu_seconds)
                if fp32 > value:
                    value, source = fp32, f"a {cpu_matmul_size}^3 fp32 matmul (faster here than {source})"
        return value, (f"CPU peak measured by {source} at startup on {torch.get_num_threads()} threads: "
                       f"{value / 1e9:.1f} GFLOP/s")
    return None, f"no peak known for device type {device.type!r}: MFU unknown"


def _cpu_has_matrix_units(dtype: torch.dtype) -> bool:
    """Whether oneDNN has fast `dtype` matmul kernels on this CPU (fp32 always; bf16 / fp16 with
    AVX-512-BF16 / AMX / AVX-512-FP16)."""
    try:
        if dtype == torch.bfloat16:
            return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
        if dtype == torch.float16:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
    except (AttributeError, RuntimeError):  # a torch built without oneDNN: its fallback is the slow one
        return False
    return True
