"""Megatron-LM flags that set no config field: the ones megalite accepts without effect (it has one fixed
behaviour that meets their intent, or they only tune speed) and the ones it refuses (the feature is missing).
Each is defined once here; megalite/arguments.py adds them to the parser, refuses the refused ones with one
sentence and prints the accepted ones given on one start-up line, so a Megatron launch script runs unchanged."""

from dataclasses import dataclass

from megalite.errors import UserError


@dataclass(frozen=True)
class CompatFlag:
    """One Megatron-LM flag: `takes_value` (else a switch); `why` says what megalite does instead (help text).
    `refused` is a one-sentence refusal for every value but `allowed` (a switch: whenever given)."""

    flag: str
    why: str
    takes_value: bool = False
    allowed: tuple[str, ...] = ()
    refused: str | None = None

    @property
    def dest(self) -> str:
        return "megatron_" + self.flag[2:].replace("-", "_")


_FUSION = "megalite has one implementation of each fused op; --kernels picks Triton or PyTorch"

COMPAT_FLAGS = [
    CompatFlag("--use-mcore-models", "megalite has one model implementation"),
    CompatFlag("--transformer-impl", "megalite has one PyTorch implementation (Triton kernels per --kernels)",
               takes_value=True, allowed=("local", "transformer_engine")),
    CompatFlag("--attention-backend", "megalite picks its attention kernel itself (SDPA; blocked on CPUs)",
               takes_value=True, allowed=("auto", "flash", "fused", "unfused", "local")),
    CompatFlag("--cross-entropy-loss-fusion", "megalite's vocab-parallel cross-entropy is one fused function"),
    CompatFlag("--no-masked-softmax-fusion", _FUSION),
    CompatFlag("--no-bias-gelu-fusion", _FUSION),
    CompatFlag("--no-bias-swiglu-fusion", _FUSION),
    CompatFlag("--no-bias-dropout-fusion", _FUSION),
    CompatFlag("--no-rope-fusion", _FUSION),
    CompatFlag("--no-persist-layer-norm", _FUSION),
    CompatFlag("--no-create-attention-mask-in-dataloader", "megalite's loader never builds an attention mask "
                                                           "(causal attention needs none)"),
    CompatFlag("--no-position-embedding", "Megatron's switch off of the learned position table, which rope models "
                                          "(--position-embedding-type rope) have none of anyway"),
    CompatFlag("--tiktoken-pattern", "only TikTokenizer reads it, which megalite does not have", takes_value=True,
               allowed=("v1", "v2")),
    CompatFlag("--ckpt-format", "megalite writes one layout-free format (safetensors + metadata), which any "
                                "layout loads", takes_value=True, allowed=("torch_dist", "fsdp_dtensor", "zarr"),
               refused="--ckpt-format {value} (per-rank files) is not a megalite format: megalite writes one "
                       "layout-free format that any layout loads, so drop the flag (or pass torch_dist)"),
    CompatFlag("--log-throughput", "every log line already shows Megatron's throughput per GPU as 'TFLOP/s per "
                                   "device' (model FLOPs per second per device, docs/flops.md), beside tokens/s "
                                   "and MFU"),
    CompatFlag("--use-megatron-fsdp", "megalite's sharded data parallelism is its FSDP; "
                                      "--data-parallel-sharding-strategy picks what is sharded"),
    CompatFlag("--calculate-per-token-loss", "megalite's loss always is Megatron's per-token loss: summed over the "
                                             "global batch's tokens, divided once by their count (docs/training.md)"),
    CompatFlag("--use-pytorch-profiler", "--profile always writes a PyTorch profiler trace (megalite has no "
                                         "nsys capture range)"),
    CompatFlag("--moe-router-dtype", "megalite's router computes its logits and probabilities in fp32",
               takes_value=True, allowed=("fp32",),
               refused="--moe-router-dtype {value} is not built: megalite's router computes in fp32; drop the "
                       "flag (or pass fp32)"),
]

# Flag families megalite refuses whatever their spelling: prefix -> the one sentence.
REFUSED_PREFIXES = {
    "--fp8": "{flag} asks for FP8 training, which megalite does not have; drop the --fp8-* flags "
             "(--bf16 is the lowest precision megalite trains in)",
    "--moe-": "{flag} is a Megatron MoE option megalite does not build; drop it (docs/training.md lists the "
              "--moe-* flags megalite has)",
}


def refusal_of_unknown(flag: str) -> str | None:
    """The one-sentence refusal of an unknown `flag` of a family megalite refuses, else None."""
    name = flag.split("=", 1)[0]
    for prefix, sentence in REFUSED_PREFIXES.items():
        if name.startswith(prefix):
            return sentence.format(flag=name)
    return None


def accepted_flags(args) -> list[str]:
    """The compat flags the parsed `args` set, each as given; UserError for a refused one or value."""
    given = []
    for compat in COMPAT_FLAGS:
        value = getattr(args, compat.dest)
        if value is None or value is False:
            continue
        if compat.takes_value and compat.refused and value not in compat.allowed:
            raise UserError(compat.refused.format(value=value))
        if compat.takes_value and compat.allowed and value not in compat.allowed:
            raise UserError(f"{compat.flag} {value} is not one of {', '.join(compat.allowed)}; pass one of them "
                            f"(or drop the flag: {compat.why})")
        given.append(f"{compat.flag} {value}" if compat.takes_value else compat.flag)
    return given
