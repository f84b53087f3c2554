"""What the conversion tests share: training a run in-process or as processes, reading HF folders, and an
HF LLaMA config.json to vary."""

import glob
import os

import torch

from megalite.arguments import parse_args
from megalite.run.training import pretrain
from tools.check_layouts import run as run_processes

LLAMA_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 100, "hidden_size": 64,
                "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "max_position_embeddings": 64, "rms_norm_eps": 1e-6, "hidden_act": "silu",
                "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}


def train(folder, flags: list[str], processes: int = 1) -> None:
    """Train run `flags` into `folder` (checkpoints, metrics.jsonl), in process or as `processes` ranks."""
    flags = [*flags, "--save", str(folder), "--data-cache-path", str(folder / "cache")]
    if processes == 1:
        pretrain(parse_args(flags), log=lambda line: None)
    else:
        run_processes(processes, flags, str(folder / "metrics.jsonl"))


def save_random_hf(config, seed: int, folder, dtype: torch.dtype | None = None, **save_kwargs) -> str:
    """A random HF causal LM of `config` (seeded; in `dtype`; its 1-D parameters, norms and biases, moved off their
    initial values so that their mapping matters), saved by `save_pretrained` into `folder`; the folder."""
    import transformers  # only conversion tests need it

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model = model if dtype is None else model.to(dtype)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn_like(param))
    model.save_pretrained(folder, **save_kwargs)
    return str(folder)


def load_hf(folder):
    """An HF model from a local folder, in fp32 and eval mode."""
    import transformers  # only conversion tests need it

    return transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, local_files_only=True).eval()


def hf_tensors(folder) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors = {}
    for path in sorted(glob.glob(os.path.join(folder, "*.safetensors"))):
        tensors.update(load_file(path))
    return tensors
