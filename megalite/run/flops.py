"""The two halves of MFU (docs/flops.md): the model FLOPs of one iteration, and the dense peak FLOP/s of one
device in the run's dtype, from GPU datasheets or measured on a CPU; an unknown GPU's MFU is "unknown"."""

import re
import time
from dataclasses import dataclass

import torch

from megalite.config import ModelConfig


def forward_flops_per_token(config: ModelConfig, seq_length: int) -> tuple[float, float, float]:
    """Forward FLOPs per token: (layer matmuls, causal attention, output layer), summed over layers.
    A multiply-add is 2 FLOPs; only matmuls count (no norms, activations, softmax, rotary or embedding
    lookup), as in Megatron's and PaLM's counts; the output layer covers the padded vocabulary. An MoE
    layer counts what a token goes through: the router, its top-k experts and the shared experts."""
    hidden, heads, groups, head_dim = (config.hidden_size, config.num_attention_heads,
                                       config.query_groups, config.head_dim)
    qkv = 2 * hidden * (heads + 2 * groups) * head_dim
    attention_output = 2 * heads * head_dim * hidden
    # Each query meets s keys for QK^T and s values for AV; causality halves that on average.
    attention = 2 * 2 * seq_length * heads * head_dim / 2
    logits = 2 * hidden * config.vocab_size
    mlps = sum(_moe_flops_per_token(config) if config.is_moe_layer(layer) else _mlp_flops_per_token(config, None)
               for layer in range(config.num_layers))
    return (config.num_layers * float(qkv + attention_output) + float(mlps),
            config.num_layers * float(attention), float(logits))


def _mlp_flops_per_token(config: ModelConfig, ffn: int | None) -> int:
    """An MLP's forward FLOPs per token: fc1 (gate and up with SwiGLU) and fc2; `ffn` default: the dense one's."""
    ffn = config.ffn_hidden_size if ffn is None else ffn
    return 2 * config.hidden_size * ffn * (2 if config.swiglu else 1) + 2 * ffn * config.hidden_size


def _moe_flops_per_token(config: ModelConfig) -> int:
    """An MoE layer's forward FLOPs per token: the router's logits, top-k routed experts, the shared experts
    and their gate. Capacity drops and padding are not counted (model FLOPs, as Megatron's)."""
    flops = 2 * config.hidden_size * config.num_experts  # the router
    flops += config.moe_router_topk * _mlp_flops_per_token(config, config.expert_ffn_hidden_size)
    if config.moe_shared_expert_intermediate_size:
        flops += _mlp_flops_per_token(config, config.moe_shared_expert_intermediate_size)
    if config.moe_shared_expert_gate:
        flops += 2 * config.hidden_size
    return flops


def flops_per_iteration(config: ModelConfig, global_batch_size: int, seq_length: int,
                        include_recompute: bool = False, recomputed_layers: int | None = None) -> float:
    """Model FLOPs of one training iteration over `global_batch_size` x `seq_length` tokens: 3 x forward (the
    backward takes the gradients of both inputs and weights). Only `include_recompute` (hardware FLOPs) counts
    recomputation, for `recomputed_layers` of the layers under full recomputation (default: all)."""
    layer_matmuls, attention, logits = forward_flops_per_token(config, seq_length)
    per_token = 3 * (layer_matmuls + attention + logits)
    if include_recompute and config.recompute_granularity == "full":
        recomputed = config.num_layers if recomputed_layers is None else recomputed_layers
        per_token += (layer_matmuls + attention) * recomputed / config.num_layers
    elif include_recompute and config.recompute_granularity == "selective":
        per_token += attention
    return float(global_batch_size * seq_length) * per_token


@dataclass(frozen=True)
class GpuPeak:
    """Dense (no sparsity) peak TFLOP/s of one GPU model, None without such a unit; fp32 is the plain
    (non-tensor-core) rate. words: whole words all in `torch.cuda.get_device_name()`; unless: none of these."""

    words: tuple[str, ...]
    bf16: float | None
    fp16: float | None
    tf32: float | None
    fp32: float
    source: str
    unless: tuple[str, ...] = ()


# First match wins, so a variant comes before the family word it contains. Datasheets quote
# tensor-core rates "with sparsity" (H100 SXM: 1,979 BF16); the dense rates here are half of those.
GPU_PEAKS: tuple[GpuPeak, ...] = (
    GpuPeak(("H100", "PCIe"), 756.0, 756.0, 378.0, 51.0, "NVIDIA H100 PCIe datasheet"),
    GpuPeak(("H100", "NVL"), 835.5, 835.5, 417.5, 60.0, "NVIDIA H100 NVL datasheet"),
    # The SXM part reports itself as "NVIDIA H100 80GB HBM3".
    GpuPeak(("H100", "HBM3"), 989.5, 989.5, 494.5, 67.0, "NVIDIA H100 SXM datasheet"),
    GpuPeak(("H100", "SXM"), 989.5, 989.5, 494.5, 67.0, "NVIDIA H100 SXM datasheet"),
    GpuPeak(("GH200",), 989.5, 989.5, 494.5, 67.0, "NVIDIA GH200 datasheet"),  # the H100 SXM's GPU
    GpuPeak(("H200", "NVL"), 835.5, 835.5, 417.5, 60.0, "NVIDIA H200 NVL datasheet"),
    GpuPeak(("H200",), 989.5, 989.5, 494.5, 67.0, "NVIDIA H200 SXM datasheet"),
    GpuPeak(("A100",), 312.0, 312.0, 156.0, 19.5, "NVIDIA A100 datasheet"),  # SXM and PCIe alike
    GpuPeak(("A10G",), 70.0, 70.0, 35.0, 35.0, "AWS A10G specification"),  # half-rate FP32-accumulate tensor cores
    GpuPeak(("A10",), 125.0, 125.0, 62.5, 31.2, "NVIDIA A10 datasheet"),
    GpuPeak(("L40S",), 362.05, 362.05, 183.0, 91.6, "NVIDIA L40S datasheet"),
    GpuPeak(("L40",), 181.05, 181.05, 90.5, 90.5, "NVIDIA L40 datasheet"),
    GpuPeak(("L4",), 121.0, 121.0, 60.0, 30.3, "NVIDIA L4 datasheet"),
    # BF16/FP16 with FP32 accumulate (what PyTorch uses); the 4090 D is a smaller chip.
    GpuPeak(("RTX", "4090"), 165.2, 165.2, 82.6, 82.6, "NVIDIA Ada Lovelace whitepaper", unless=("D",)),
    # Volta has FP16 tensor cores only: no BF16 or TF32 units.
    GpuPeak(("V100", "SXM2"), None, 125.0, None, 15.7, "NVIDIA V100 datasheet"),
    GpuPeak(("V100", "PCIE"), None, 112.0, None, 14.0, "NVIDIA V100 datasheet"),
    GpuPeak(("V100S",), None, 130.0, None, 16.4, "NVIDIA V100S datasheet"),
    GpuPeak(("T4",), None, 65.0, None, 8.1, "NVIDIA T4 datasheet"),
    GpuPeak(("MI300X",), 1307.4, 1307.4, 653.7, 163.4, "AMD Instinct MI300X datasheet"),
)

DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


def find_gpu_peak(device_name: str) -> GpuPeak | None:
    """The first GPU_PEAKS entry whose words all appear in `device_name` (and none of its `unless`)."""
    words = set(re.split(r"[\s\-_]+", device_name.upper()))
    for entry in GPU_PEAKS:
        if {w.upper() for w in entry.words} <= words and not {w.upper() for w in entry.unless} & words:
            return entry
    return None


def gpu_peak_flops(device_name: str, dtype: torch.dtype, tf32: bool = False) -> tuple[float | None, str]:
    """(dense peak FLOP/s or None, where it comes from) for a GPU named `device_name`; with `tf32`
    (fp32 matmuls run on TF32 tensor cores) fp32 uses the TF32 peak."""
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
               cpu_seconds: float = 0.05) -> tuple[float | None, str]:
    """(peak FLOP/s of one device in `dtype`, or None, and a sentence saying where it comes from). No
    datasheet describes "this many cores of this machine", so on a CPU a matmul on the current thread
    count is measured instead, in `dtype` and for bf16/fp16 in fp32 too, keeping the faster."""
    device = torch.device(device)
    if device.type == "cuda":
        return gpu_peak_flops(torch.cuda.get_device_name(device), dtype, tf32=cuda_tf32_enabled())
    if device.type != "cpu":
        return None, f"no peak known for device type {device.type!r}: MFU unknown"
    size, name = cpu_matmul_size, DTYPE_NAMES.get(dtype, dtype)
    if not _cpu_has_matrix_units(dtype):
        # Without bf16/fp16 units such matmuls take a slow path (docs/benchmarks.md): fp32 is this CPU's best.
        value = measure_cpu_flops(torch.float32, size, cpu_seconds)
        source = f"a {size}^3 fp32 matmul (this CPU has no {name} matrix units)"
    else:
        value = measure_cpu_flops(dtype, size, cpu_seconds)
        source = f"a {size}^3 {name} matmul"
        if dtype != torch.float32:
            # The faster of the two keeps MFU below 100% where bf16 units are slow ones.
            fp32 = measure_cpu_flops(torch.float32, size, cpu_seconds)
            if fp32 > value:
                value, source = fp32, f"a {size}^3 fp32 matmul (faster here than {source})"
    return value, (f"CPU peak measured by {source} at startup on {torch.get_num_threads()} threads: "
                   f"{value / 1e9:.1f} GFLOP/s")


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
