"""megalite <-> Hugging Face tensors: names and layouts, one `TensorMap` per megalite tensor.

Layouts that differ:
- `qkv`: megalite fuses Q, K, V group by group (per key/value group: its query heads, its
  key head, its value head); HF keeps q/k/v_proj apart (LLaMA) or fuses [all Q; all K; all V]
  (GPT-2's c_attn).
- `gate_up`: megalite's SwiGLU fc1 is [gate; up]; HF has gate_proj and up_proj.
- `vocab`: megalite pads the vocabulary with zero rows; HF holds the tokenizer's rows only.
- `transposed`: GPT-2's Conv1D stores weights as [in, out], nn.Linear as [out, in].
- `experts`, `experts_gate_up`: megalite stacks the routed experts, fc2 `[E, h, ffn]` and fc1 `[E, 2 ffn, h]`
  ([gate; up] per expert); HF files hold one tensor per expert and kind (Mixtral's w1 gate, w3 up, w2 down;
  Qwen's gate_proj, up_proj, down_proj), the names `save_pretrained` writes and `from_pretrained` reads. (In
  memory transformers 5 fuses them into `experts.gate_up_proj` / `down_proj`; the files never hold those.)
Rotary embeddings need no permutation: both rotate halves of each head (channel i with i + d/2).
"""

from dataclasses import dataclass

import torch

from megalite.config import ModelConfig
from megalite.convert.configs import GPT2, MIXTRAL, hf_architecture


@dataclass(frozen=True)
class TensorMap:
    """One megalite tensor and the HF tensor(s) it becomes; layout "same" or one of the module's. A "qkv"
    map with one HF name means q, k, v concatenated (GPT-2's c_attn)."""

    ours: str
    theirs: tuple[str, ...]
    layout: str = "same"
    transposed: bool = False


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    """Every megalite tensor of `config` with its HF counterpart, in HF's usual order. A tied output layer
    has no tensor of its own on either side (HF re-ties lm_head on load)."""
    return _gpt2_maps(config) if hf_architecture(config) == GPT2 else _llama_maps(config)


def _llama_maps(config: ModelConfig) -> list[TensorMap]:
    """LLaMA's names, which Qwen2 (q/k/v biases) and Qwen3 (q_norm, k_norm) share."""
    kinds = ["weight", "bias"] if config.add_bias_linear else ["weight"]
    qkv_kinds = ["weight", "bias"] if config.add_bias_linear or config.add_qkv_bias else ["weight"]
    maps = [TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        maps.append(TensorMap(ours + "input_layernorm.weight", (theirs + "input_layernorm.weight",)))
        for kind in qkv_kinds:
            maps.append(TensorMap(ours + f"self_attention.linear_qkv.{kind}",
                                  tuple(theirs + f"self_attn.{p}_proj.{kind}" for p in "qkv"), "qkv"))
        if config.qk_layernorm:
            maps += [TensorMap(ours + f"self_attention.{p}_layernorm.weight", (theirs + f"self_attn.{p}_norm.weight",))
                     for p in "qk"]
        for kind in kinds:
            maps.append(TensorMap(ours + f"self_attention.linear_proj.{kind}", (theirs + f"self_attn.o_proj.{kind}",)))
        maps.append(TensorMap(ours + "pre_mlp_layernorm.weight", (theirs + "post_attention_layernorm.weight",)))
        if config.is_moe_layer(i):
            maps += _moe_maps(config, ours + "mlp.", theirs)
            continue
        for kind in kinds:
            maps.append(TensorMap(ours + f"mlp.linear_fc1.{kind}",
                                  (theirs + f"mlp.gate_proj.{kind}", theirs + f"mlp.up_proj.{kind}"), "gate_up"))
            maps.append(TensorMap(ours + f"mlp.linear_fc2.{kind}", (theirs + f"mlp.down_proj.{kind}",)))
    maps.append(TensorMap("final_layernorm.weight", ("model.norm.weight",)))
    if config.untie_embeddings_and_output_weights:
        maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), "vocab"))
    return maps


def _moe_maps(config: ModelConfig, ours: str, theirs: str) -> list[TensorMap]:
    """One MoE layer's router, routed experts (one HF tensor per expert and kind, in expert order) and
    Qwen2-MoE's shared expert and its gate. `ours`: "layers.{i}.mlp.", `theirs`: "model.layers.{i}."."""
    experts = range(config.num_experts)
    if hf_architecture(config) == MIXTRAL:
        moe, gate, up, down = theirs + "block_sparse_moe.", "w1", "w3", "w2"
    else:
        moe, gate, up, down = theirs + "mlp.", "gate_proj", "up_proj", "down_proj"
    maps = [TensorMap(ours + "router.weight", (moe + "gate.weight",)),
            TensorMap(ours + "experts.linear_fc1.weight",
                      tuple(moe + f"experts.{e}.{kind}.weight" for e in experts for kind in (gate, up)),
                      "experts_gate_up"),
            TensorMap(ours + "experts.linear_fc2.weight", tuple(moe + f"experts.{e}.{down}.weight" for e in experts),
                      "experts")]
    if config.moe_shared_expert_intermediate_size is not None:  # Qwen2-MoE's, gated
        shared = moe + "shared_expert."
        maps += [TensorMap(ours + "shared_experts.linear_fc1.weight",
                           (shared + "gate_proj.weight", shared + "up_proj.weight"), "gate_up"),
                 TensorMap(ours + "shared_experts.linear_fc2.weight", (shared + "down_proj.weight",)),
                 TensorMap(ours + "shared_expert_gate", (moe + "shared_expert_gate.weight",))]
    return maps


def _gpt2_maps(config: ModelConfig) -> list[TensorMap]:
    maps = [TensorMap("embedding.word_embeddings.weight", ("transformer.wte.weight",), "vocab"),
            TensorMap("embedding.position_embeddings", ("transformer.wpe.weight",))]
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            conv = kind == "weight"  # Conv1D weights are [in, out]; biases are the same
            maps += [
                TensorMap(ours + f"input_layernorm.{kind}", (theirs + f"ln_1.{kind}",)),
                TensorMap(ours + f"self_attention.linear_qkv.{kind}", (theirs + f"attn.c_attn.{kind}",), "qkv", conv),
                TensorMap(ours + f"self_attention.linear_proj.{kind}", (theirs + f"attn.c_proj.{kind}",),
                          transposed=conv),
                TensorMap(ours + f"pre_mlp_layernorm.{kind}", (theirs + f"ln_2.{kind}",)),
                TensorMap(ours + f"mlp.linear_fc1.{kind}", (theirs + f"mlp.c_fc.{kind}",), transposed=conv),
                TensorMap(ours + f"mlp.linear_fc2.{kind}", (theirs + f"mlp.c_proj.{kind}",), transposed=conv),
            ]
    maps += [TensorMap("final_layernorm.weight", ("transformer.ln_f.weight",)),
             TensorMap("final_layernorm.bias", ("transformer.ln_f.bias",))]
    if config.untie_embeddings_and_output_weights:
        maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), "vocab"))
    return maps


def split_qkv(qkv: torch.Tensor, config: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """megalite's grouped QKV rows `[(heads + 2 groups) * d, ...]` -> q `[heads * d, ...]`, k, v
    `[groups * d, ...]`, for weights `[rows, hidden]` and biases `[rows]` alike."""
    groups, head_dim, rest = config.query_groups, config.head_dim, qkv.shape[1:]
    per_group = config.num_attention_heads // groups
    grouped = qkv.reshape(groups, per_group + 2, head_dim, *rest)
    q = grouped[:, :per_group].reshape(-1, *rest)
    k = grouped[:, per_group].reshape(-1, *rest)
    v = grouped[:, per_group + 1].reshape(-1, *rest)
    return q, k, v


def merge_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: ModelConfig) -> torch.Tensor:
    """The inverse of split_qkv: q, k, v rows -> megalite's grouped QKV rows."""
    groups, head_dim, rest = config.query_groups, config.head_dim, q.shape[1:]
    per_group = config.num_attention_heads // groups
    grouped = torch.cat([q.reshape(groups, per_group, head_dim, *rest), k.reshape(groups, 1, head_dim, *rest),
                         v.reshape(groups, 1, head_dim, *rest)], dim=1)
    return grouped.reshape(-1, *rest)


def to_hf(tensor_map: TensorMap, tensor: torch.Tensor, config: ModelConfig) -> list[torch.Tensor]:
    """The HF tensors (one per `tensor_map.theirs`) of the full megalite tensor `tensor`; contiguous, same
    dtype. vocab `[padded vocab, h]` -> `[real vocab, h]`; qkv as split_qkv; SwiGLU fc1 `[2 ffn, h]` ->
    gate, up `[ffn, h]`; stacked experts `[E, ...]` -> one tensor per expert (fc1: its gate, then its up);
    transposed maps swap the two dimensions."""
    layout = tensor_map.layout
    if layout == "vocab":
        parts = [tensor[:config.real_vocab_size]]
    elif layout == "qkv":
        parts = list(split_qkv(tensor, config))
        if len(tensor_map.theirs) == 1:
            parts = [torch.cat(parts)]
    elif layout == "gate_up":
        parts = list(tensor.chunk(2))
    elif layout == "experts_gate_up":
        parts = [part for expert in tensor.unbind() for part in expert.chunk(2)]
    elif layout == "experts":
        parts = list(tensor.unbind())
    else:
        parts = [tensor]
    if tensor_map.transposed:
        parts = [part.t() for part in parts]
    return [part.contiguous() for part in parts]


def from_hf(tensor_map: TensorMap, tensors: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The megalite tensor of `tensor_map` from its HF tensors (the exact inverse of to_hf; the HF dtype);
    vocabulary rows are padded with zero rows to `config.vocab_size`."""
    parts = [part.t() for part in tensors] if tensor_map.transposed else list(tensors)
    layout = tensor_map.layout
    if layout == "vocab":
        rows = parts[0]
        padding = rows.new_zeros(config.vocab_size - rows.shape[0], *rows.shape[1:])
        return torch.cat([rows, padding]).contiguous()
    if layout == "qkv":
        if len(parts) == 1:
            q_rows = config.num_attention_heads * config.head_dim
            kv_rows = config.query_groups * config.head_dim
            parts = list(parts[0].split([q_rows, kv_rows, kv_rows]))
        return merge_qkv(*parts, config).contiguous()
    if layout == "gate_up":
        return torch.cat(parts).contiguous()
    if layout == "experts_gate_up":
        return torch.stack([torch.cat(parts[i:i + 2]) for i in range(0, len(parts), 2)])
    if layout == "experts":
        return torch.stack(parts)
    return parts[0].contiguous()


def hf_shapes(tensor_map: TensorMap, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
    """The shapes to_hf gives for a megalite tensor of `shape`, without touching any data."""
    return [tuple(part.shape) for part in to_hf(tensor_map, torch.empty(shape, device="meta"), config)]


def hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig,
                  fused_experts: bool = False) -> dict[str, torch.Tensor]:
    """A whole megalite state dict -> the HF state dict as HF saves it (tied lm_head left out). fused_experts:
    transformers 5's in-memory names instead, for `load_state_dict` on a model built in memory: each MoE
    layer's `mlp.experts.gate_up_proj` `[E, 2 ffn, h]` and `down_proj` `[E, h, ffn]` (megalite's stacked
    tensors as they are), and Mixtral's `block_sparse_moe.` named `mlp.`."""
    hf = {}
    for tensor_map in tensor_maps(config):
        if fused_experts and tensor_map.layout in ("experts", "experts_gate_up"):
            layer = tensor_map.theirs[0].split(".experts.")[0]
            kind = "gate_up_proj" if tensor_map.layout == "experts_gate_up" else "down_proj"
            hf[f"{layer}.experts.{kind}"] = state[tensor_map.ours]
        else:
            hf.update(zip(tensor_map.theirs, to_hf(tensor_map, state[tensor_map.ours], config)))
    if fused_experts:
        hf = {name.replace(".block_sparse_moe.", ".mlp."): tensor for name, tensor in hf.items()}
    return hf
