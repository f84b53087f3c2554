"""megalite <-> Hugging Face `transformers`: tensor names and layouts, configurations, tokenizers.

Two families map one to one:

- LLaMA-style (rope, RMSNorm, SwiGLU; GQA, tied or untied, biases on all linear layers
  or none) <-> `LlamaForCausalLM`. Mistral configs without a sliding window import as
  the same architecture.
- GPT-2-style (learned positions, LayerNorm, GELU, biases, multi-head) <-> `GPT2LMHeadModel`.

Layouts that differ (each `TensorMap` below says which applies to a tensor):

- `qkv`: megalite fuses Q, K and V into one projection laid out group by group (for each
  key/value group: its query heads, its key head, its value head; see
  megalite/model/transformer.py). HF keeps q_proj / k_proj / v_proj apart (LLaMA), or
  fuses them as [all Q; all K; all V] (GPT-2's c_attn).
- `gate_up`: megalite's SwiGLU fc1 is [gate; up]; HF has gate_proj and up_proj.
- `vocab`: megalite pads the vocabulary (--make-vocab-size-divisible-by x TP) with zero
  rows; HF holds the tokenizer's rows only. Export drops the padding, import adds it.
- `transposed`: GPT-2's Conv1D stores weights as [in, out], nn.Linear as [out, in].

Rotary embeddings need no permutation: megalite rotates halves of each head (channel i
with i + d/2), as HF's LLaMA does (tests/test_hf_conversion.py compares logits).
"""

import json
import os
import shutil
from dataclasses import dataclass

import torch

from megalite.config import ModelConfig
from megalite.errors import UserError

LLAMA, GPT2 = "LlamaForCausalLM", "GPT2LMHeadModel"
SUPPORTED = ("LLaMA-style (rope, RMSNorm, SwiGLU) and GPT-2-style (learned positions, LayerNorm, GELU, "
             "biases, multi-head attention)")


# -- tensors ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class TensorMap:
    """One megalite tensor and the HF tensor(s) it becomes.

    layout: "same", "vocab" (padding rows), "qkv" (grouped QKV -> q, k, v; one HF name
    means them concatenated, GPT-2's c_attn) or "gate_up" (SwiGLU fc1 -> gate, up).
    transposed: HF stores the weight as [in, out] (Conv1D).
    """

    ours: str
    theirs: tuple[str, ...]
    layout: str = "same"
    transposed: bool = False


def hf_architecture(config: ModelConfig) -> str:
    """LLAMA or GPT2, the HF class that computes exactly what `config` computes; UserError otherwise."""
    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    gpt2 = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                add_bias_linear=True)
    if all(getattr(config, key) == value for key, value in llama.items()):
        return LLAMA
    if all(getattr(config, key) == value for key, value in gpt2.items()):
        if config.query_groups != config.num_attention_heads or config.head_dim * config.num_attention_heads \
                != config.hidden_size:
            raise UserError("GPT-2 in transformers has plain multi-head attention with head size hidden / heads, "
                            f"but this model has {config.query_groups} key/value groups and head size "
                            f"{config.head_dim}; only LLaMA-style models can use GQA or --kv-channels")
        return GPT2
    shape = {key: getattr(config, key) for key in ("position_embedding_type", "normalization", "swiglu",
                                                   "add_bias_linear")}
    raise UserError(f"no transformers architecture computes this model ({shape}); conversion supports {SUPPORTED}")


def tensor_maps(config: ModelConfig) -> list[TensorMap]:
    """Every megalite tensor of `config` with its HF counterpart, in HF's usual order.

    A tied output layer has no tensor of its own on either side (HF re-ties lm_head on load).
    """
    if hf_architecture(config) == GPT2:
        return _gpt2_maps(config)
    return _llama_maps(config)


def _llama_maps(config: ModelConfig) -> list[TensorMap]:
    kinds = ["weight", "bias"] if config.add_bias_linear else ["weight"]
    maps = [TensorMap("embedding.word_embeddings.weight", ("model.embed_tokens.weight",), "vocab")]
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        maps.append(TensorMap(ours + "input_layernorm.weight", (theirs + "input_layernorm.weight",)))
        for kind in kinds:
            maps.append(TensorMap(ours + f"self_attention.linear_qkv.{kind}",
                                  tuple(theirs + f"self_attn.{p}_proj.{kind}" for p in "qkv"), "qkv"))
            maps.append(TensorMap(ours + f"self_attention.linear_proj.{kind}", (theirs + f"self_attn.o_proj.{kind}",)))
        maps.append(TensorMap(ours + "pre_mlp_layernorm.weight", (theirs + "post_attention_layernorm.weight",)))
        for kind in kinds:
            maps.append(TensorMap(ours + f"mlp.linear_fc1.{kind}",
                                  (theirs + f"mlp.gate_proj.{kind}", theirs + f"mlp.up_proj.{kind}"), "gate_up"))
            maps.append(TensorMap(ours + f"mlp.linear_fc2.{kind}", (theirs + f"mlp.down_proj.{kind}",)))
    maps.append(TensorMap("final_layernorm.weight", ("model.norm.weight",)))
    if config.untie_embeddings_and_output_weights:
        maps.append(TensorMap("output_layer.weight", ("lm_head.weight",), "vocab"))
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
    """megalite's grouped QKV rows `[(heads + 2 groups) * d, ...]` -> q `[heads * d, ...]`, k, v `[groups * d, ...]`.

    Works on weights `[rows, hidden]` and biases `[rows]`; heads come out in order.
    """
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
    """The HF tensors (one per `tensor_map.theirs`) of megalite tensor `tensor`; contiguous, same dtype."""
    layout = tensor_map.layout
    if layout == "vocab":
        parts = [tensor[:config.real_vocab_size]]
    elif layout == "qkv":
        parts = list(split_qkv(tensor, config))
        if len(tensor_map.theirs) == 1:
            parts = [torch.cat(parts)]
    elif layout == "gate_up":
        parts = list(tensor.chunk(2))
    else:
        parts = [tensor]
    if tensor_map.transposed:
        parts = [part.t() for part in parts]
    return [part.contiguous() for part in parts]


def from_hf(tensor_map: TensorMap, tensors: list[torch.Tensor], config: ModelConfig) -> torch.Tensor:
    """The megalite tensor of `tensor_map` from its HF tensors (the inverse of to_hf; exact)."""
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
    return parts[0].contiguous()


def hf_shapes(tensor_map: TensorMap, shape: tuple[int, ...], config: ModelConfig) -> list[tuple[int, ...]]:
    """The shapes to_hf gives for a megalite tensor of `shape`, without touching any data."""
    return [tuple(part.shape) for part in to_hf(tensor_map, torch.empty(shape, device="meta"), config)]


def hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """A whole megalite state dict -> the HF state dict (tied lm_head left out, as HF saves it)."""
    return {name: tensor for tensor_map in tensor_maps(config)
            for name, tensor in zip(tensor_map.theirs, to_hf(tensor_map, state[tensor_map.ours], config))}


# -- configurations: megalite -> HF -----------------------------------------------------------------


def llama_config_to_hf(config: ModelConfig, attn_implementation: str = "sdpa", **extra):
    """The `transformers.LlamaConfig` of a LLaMA-shaped megalite config (real vocabulary, no padding).

    Llama 3.1 rope scaling maps to HF's "llama3" rope type with megalite's fixed low/high
    frequency factors (1, 4) and original context (8192). `extra` goes to LlamaConfig.
    """
    import transformers  # only conversion, tests and benchmarks need it

    rope_scaling = None
    if config.use_rope_scaling:
        rope_scaling = {"rope_type": "llama3", "factor": config.rope_scaling_factor, "low_freq_factor": 1.0,
                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    extra = {"attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, **extra}
    hf_config = transformers.LlamaConfig(
        vocab_size=config.real_vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.query_groups,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_epsilon, rope_theta=config.rotary_base, rope_scaling=rope_scaling,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights, **extra)
    hf_config._attn_implementation = attn_implementation
    return hf_config


def gpt2_config_to_hf(config: ModelConfig, attn_implementation: str = "sdpa", **extra):
    """The `transformers.GPT2Config` of a GPT-2-shaped megalite config (real vocabulary, no padding)."""
    import transformers

    extra = {"bos_token_id": None, "eos_token_id": None, **extra}
    hf_config = transformers.GPT2Config(
        vocab_size=config.real_vocab_size, n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size, n_layer=config.num_layers, n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size, activation_function="gelu_new" if config.openai_gelu else "gelu",
        layer_norm_epsilon=config.norm_epsilon, resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout, attn_pdrop=config.attention_dropout,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights, **extra)
    hf_config._attn_implementation = attn_implementation
    return hf_config


def hf_config_for(config: ModelConfig, dtype: torch.dtype, bos: int | None, eos: int | None, pad: int | None):
    """The HF config to save with an exported model: architecture, weight dtype, special token ids."""
    extra = dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, initializer_range=config.init_method_std,
                 architectures=[hf_architecture(config)], dtype=str(dtype).split(".")[-1])
    if hf_architecture(config) == GPT2:
        return gpt2_config_to_hf(config, **extra)
    bias = config.add_bias_linear
    try:
        return llama_config_to_hf(config, attention_bias=bias, mlp_bias=bias, **extra)
    except ValueError as error:  # transformers' own checks, e.g. hidden size vs heads
        raise UserError(f"transformers refuses this model's LlamaConfig ({error})") from None


# -- configurations: HF -> megalite -----------------------------------------------------------------

_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@dataclass
class ImportedConfig:
    """What an HF config.json becomes: the architecture and megalite's ModelConfig fields.

    `fields` holds the ModelConfig fields that define the model (all but the vocabulary,
    its padding and recomputation); `vocab_size` is the HF model's unpadded vocabulary.
    """

    architecture: str
    fields: dict
    vocab_size: int


def model_fields_from_hf(hf: dict, seq_length: int | None = None) -> ImportedConfig:
    """Read an HF `config.json` (a dict); UserError naming the field for anything megalite cannot compute.

    Accepts LlamaForCausalLM, MistralForCausalLM (no sliding window) and GPT2LMHeadModel
    configs of transformers 4.x (rope_theta / rope_scaling) and 5.x (rope_parameters).
    seq_length: the training sequence length to record; default max_position_embeddings,
    capped at 4096.
    """
    architecture = (hf.get("architectures") or [None])[0] or hf.get("model_type")
    kind = {"LlamaForCausalLM": LLAMA, "llama": LLAMA, "MistralForCausalLM": LLAMA, "mistral": LLAMA,
            "GPT2LMHeadModel": GPT2, "gpt2": GPT2}.get(architecture)
    if kind is None:
        hint = (" (Qwen2 has biases on q/k/v only, which megalite's all-or-none --disable-bias-linear cannot "
                "express)" if str(architecture).lower().startswith("qwen2") else "")
        raise UserError(f"config.json's architectures/model_type is {architecture!r}, which megalite cannot "
                        f"import{hint}; supported: LlamaForCausalLM, MistralForCausalLM, GPT2LMHeadModel")
    for field in ("quantization_config", "num_local_experts", "num_experts"):
        if hf.get(field):
            raise UserError(f"config.json field {field!r} is set; megalite imports dense, unquantized models only")
    fields = _gpt2_fields(hf) if kind == GPT2 else _llama_fields(hf)
    max_positions = fields["max_position_embeddings"]
    fields["seq_length"] = seq_length or min(max_positions, 4096)
    if fields["position_embedding_type"] == "learned_absolute" and fields["seq_length"] > max_positions:
        raise UserError(f"--seq-length {fields['seq_length']} exceeds the model's learned positions "
                        f"(n_positions {max_positions}); use at most {max_positions}")
    return ImportedConfig(kind, fields, int(hf["vocab_size"]))


def _require(hf: dict, field: str, allowed, why: str) -> None:
    value = hf.get(field)
    if value not in allowed:
        raise UserError(f"config.json field {field!r} is {value!r}, {why}")


def _llama_fields(hf: dict) -> dict:
    _require(hf, "hidden_act", ("silu", None), "but megalite's SwiGLU uses silu")
    window = hf.get("sliding_window")
    if hf.get("use_sliding_window") or (window is not None and window < hf.get("max_position_embeddings", 0)):
        raise UserError(f"config.json field 'sliding_window' is {window!r}, but megalite attends over the whole "
                        f"sequence; only models without a sliding window (null) convert")
    if any(kind != "full_attention" for kind in hf.get("layer_types") or []):
        raise UserError("config.json field 'layer_types' has layers other than full_attention; megalite has "
                        "only full causal attention")
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if attention_bias != mlp_bias:
        raise UserError(f"config.json fields 'attention_bias' ({attention_bias}) and 'mlp_bias' ({mlp_bias}) "
                        f"differ, but megalite's linear layers have biases all or none (--disable-bias-linear)")
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or hidden // heads)
    groups = int(hf.get("num_key_value_heads") or heads)
    rope_theta, rope = _rope(hf)
    return dict(
        num_layers=int(hf["num_hidden_layers"]), hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=int(hf["intermediate_size"]), num_query_groups=groups,
        kv_channels=head_dim, max_position_embeddings=int(hf["max_position_embeddings"]),
        position_embedding_type="rope", rotary_base=float(rope_theta),
        use_rope_scaling=rope is not None, rope_scaling_factor=float(rope["factor"]) if rope else 8.0,
        normalization="RMSNorm", norm_epsilon=float(hf.get("rms_norm_eps", 1e-6)), swiglu=True,
        openai_gelu=False, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        add_bias_linear=attention_bias, hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout") or 0.0),
        init_method_std=float(hf.get("initializer_range", 0.02)))


def _rope(hf: dict) -> tuple[float, dict | None]:
    """(rope theta, llama3 scaling parameters or None) from either transformers generation's fields."""
    parameters = hf.get("rope_parameters")
    if parameters and "full_attention" in parameters and isinstance(parameters["full_attention"], dict):
        parameters = parameters["full_attention"]  # per-layer-type form
    scaling = parameters or hf.get("rope_scaling") or {}
    theta = scaling.get("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    field = "rope_parameters" if parameters else "rope_scaling"
    if rope_type not in _ROPE_TYPES:
        raise UserError(f"config.json field {field!r} has rope type {rope_type!r}, which megalite does not "
                        f"implement; supported: {', '.join(_ROPE_TYPES)} (Llama 3.1)")
    if scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise UserError("config.json field 'partial_rotary_factor' is not 1; megalite rotates whole heads")
    if rope_type == "default":
        return theta, None
    for key, value in _LLAMA3_ROPE.items():
        if float(scaling.get(key, value)) != value:
            raise UserError(f"config.json field {field!r} has {key} {scaling.get(key)!r}, but megalite's llama3 "
                            f"rope scaling fixes it at {value:g}")
    return theta, scaling


def _gpt2_fields(hf: dict) -> dict:
    activation = hf.get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):
        why = ("but pretrain_gpt.py can select exact GELU only with --swiglu off and no --openai-gelu, which "
               "no preset allows" if activation == "gelu" else "but megalite's GPT-2 uses the tanh GELU")
        raise UserError(f"config.json field 'activation_function' is {activation!r}, {why}")
    for field, ok in [("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                      ("add_cross_attention", False)]:
        if bool(hf.get(field, ok)) != ok:
            raise UserError(f"config.json field {field!r} is {hf[field]!r}; megalite's attention needs {ok}")
    hidden, heads = int(hf.get("n_embd", hf.get("hidden_size", 768))), int(hf.get("n_head", 12))
    return dict(
        num_layers=int(hf.get("n_layer", 12)), hidden_size=hidden, num_attention_heads=heads,
        ffn_hidden_size=int(hf.get("n_inner") or 4 * hidden), num_query_groups=heads, kv_channels=hidden // heads,
        max_position_embeddings=int(hf.get("n_positions", hf.get("max_position_embeddings", 1024))),
        position_embedding_type="learned_absolute", rotary_base=10000.0, use_rope_scaling=False,
        rope_scaling_factor=8.0, normalization="LayerNorm", norm_epsilon=float(hf.get("layer_norm_epsilon", 1e-5)),
        swiglu=False, openai_gelu=True, untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", True),
        add_bias_linear=True, hidden_dropout=float(hf.get("resid_pdrop", 0.1)),
        attention_dropout=float(hf.get("attn_pdrop", 0.1)), init_method_std=float(hf.get("initializer_range", 0.02)))


# -- the pretrain_gpt.py command line for a model ----------------------------------------------------

# Presets tried as the base of the flags: flags can switch some booleans on only
# (--swiglu, --untie-..., --openai-gelu) or off only (--disable-bias-linear), so the base decides the rest.
_BASE_PRESETS = ("tiny", "llama3.2-1b", "gpt2-124m")
# Fields whose raw value may differ while the model computes the same thing.
_DERIVED = {"num_query_groups": "query_groups", "kv_channels": "head_dim"}


def _flags_on_preset(fields: dict, preset: str) -> list[str]:
    """pretrain_gpt.py flags for the model `fields` describe, on top of `--model preset`."""
    from megalite.config import MODEL_PRESETS

    flags = ["--model", preset, "--num-layers", fields["num_layers"], "--hidden-size", fields["hidden_size"],
             "--ffn-hidden-size", fields["ffn_hidden_size"], "--num-attention-heads", fields["num_attention_heads"]]
    if fields["num_query_groups"] != fields["num_attention_heads"] or MODEL_PRESETS[preset].get("num_query_groups"):
        flags += ["--group-query-attention", "--num-query-groups", fields["num_query_groups"]]
    if fields["kv_channels"] * fields["num_attention_heads"] != fields["hidden_size"]:
        flags += ["--kv-channels", fields["kv_channels"]]
    flags += ["--seq-length", fields["seq_length"], "--max-position-embeddings", fields["max_position_embeddings"],
              "--position-embedding-type", fields["position_embedding_type"]]
    if fields["position_embedding_type"] == "rope":
        flags += ["--rotary-base", fields["rotary_base"]]
    if fields["use_rope_scaling"]:
        flags += ["--use-rope-scaling", "--rope-scaling-factor", fields["rope_scaling_factor"]]
    flags += ["--normalization", fields["normalization"], "--norm-epsilon", fields["norm_epsilon"]]
    for flag, on in [("--swiglu", fields["swiglu"]), ("--openai-gelu", fields["openai_gelu"] and not fields["swiglu"]),
                     ("--untie-embeddings-and-output-weights", fields["untie_embeddings_and_output_weights"]),
                     ("--disable-bias-linear", not fields["add_bias_linear"])]:
        if on:
            flags.append(flag)
    flags += ["--hidden-dropout", fields["hidden_dropout"], "--attention-dropout", fields["attention_dropout"],
              "--init-method-std", fields["init_method_std"]]
    if fields.get("make_vocab_size_divisible_by", 128) != 128:
        flags += ["--make-vocab-size-divisible-by", fields["make_vocab_size_divisible_by"]]
    return [str(flag) for flag in flags]


def _same_model(config: ModelConfig, fields: dict) -> bool:
    """Whether `config` computes the model `fields` describe (raw fields may differ where derived)."""
    unused = {"openai_gelu": fields["swiglu"], "rope_scaling_factor": not fields["use_rope_scaling"],
              "rotary_base": fields["position_embedding_type"] != "rope"}
    return all(getattr(config, _DERIVED.get(key, key)) == value
               for key, value in fields.items() if not unused.get(key, False))


def pretrain_model_flags(fields: dict, vocab_size: int, tensor_model_parallel_size: int = 1,
                         pipeline_model_parallel_size: int = 1) -> tuple[list[str], ModelConfig]:
    """The pretrain_gpt.py model flags for `fields`, and the ModelConfig those flags build for `vocab_size`.

    The config comes from megalite's own argument parser (with TP x PP checked as a run
    would check it), so a checkpoint saved with it passes `--load --finetune` with these
    flags. UserError when no flags express the model, or the layout does not fit it.
    """
    from megalite.arguments import parse_args

    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    # Only the model and layout matter here; data and batch flags just satisfy the parser.
    placeholders = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1",
                    "--micro-batch-size", "1", "--global-batch-size", str(pp)]
    errors = []
    for preset in _BASE_PRESETS:
        flags = _flags_on_preset(fields, preset)
        try:
            config = parse_args(flags + layout + placeholders, world_size=tp * pp).with_tokenizer_vocab(
                vocab_size).model
        except UserError as error:  # the layout does not fit, or this preset cannot take the flags
            errors.append(error)
            continue
        if _same_model(config, fields):
            return flags, config
    if errors:
        raise errors[0]
    raise UserError("no combination of pretrain_gpt.py's model flags builds this model, so megalite cannot "
                    "train it")


# -- tokenizers -------------------------------------------------------------------------------------


def export_tokenizer(tokenizer_type: str, tokenizer_model: str | None, vocab_size: int | None, out_dir: str,
                     config: ModelConfig) -> tuple[str, dict]:
    """Write a run's tokenizer (its --tokenizer-* flags) into HF folder `out_dir` for `AutoTokenizer`.

    SentencePiece models become an exactly equivalent `tokenizer.json` (a fast tokenizer;
    the `.model` file is copied beside it as `tokenizer.model`); a Hugging Face tokenizer
    folder is re-saved; NullTokenizer becomes a word-level tokenizer of its integer ids.
    Returns (a one-line description, the special token ids {"bos", "eos", "pad"}).
    UserError when the tokenizer's vocabulary is not the model's.
    """
    from megalite.data.tokenizer import SENTENCEPIECE_TYPES, build_tokenizer

    ours = build_tokenizer(tokenizer_type, tokenizer_model, vocab_size)
    if ours.vocab_size != config.real_vocab_size:
        raise UserError(f"the tokenizer ({tokenizer_type} {tokenizer_model or ''}) has {ours.vocab_size} tokens but "
                        f"the model {config.real_vocab_size}; pass the run's --tokenizer-type/--tokenizer-model")
    model_max_length = config.max_position_embeddings
    ids = {"bos": ours.bos, "eos": ours.eos if ours.eos is not None else ours.eod, "pad": ours.pad}
    if tokenizer_type == "HuggingFaceTokenizer":
        from transformers import AutoTokenizer

        local = os.path.isdir(tokenizer_model)
        AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=local).save_pretrained(out_dir)
        return f"the Hugging Face tokenizer of {tokenizer_model}", ids
    if tokenizer_type in SENTENCEPIECE_TYPES:
        backend, special = sentencepiece_to_tokenizers(tokenizer_model, add_bos=tokenizer_type == "Llama2Tokenizer")
        shutil.copyfile(tokenizer_model, os.path.join(out_dir, "tokenizer.model"))
        described = f"SentencePiece model {tokenizer_model} as tokenizer.json (+ tokenizer.model)"
    else:
        backend, special = null_tokenizer_to_tokenizers(ours.eod), {"eos_token": str(ours.eod)}
        described = f"NullTokenizer (ids 0..{ours.eod} as words) as tokenizer.json"
    _save_fast_tokenizer(backend, special, out_dir, model_max_length)
    return described, ids


def _save_fast_tokenizer(backend, special: dict, out_dir: str, model_max_length: int) -> None:
    backend.save(os.path.join(out_dir, "tokenizer.json"))
    # PreTrainedTokenizerFast loads tokenizer.json as it is; LlamaTokenizer would replace its
    # pre-tokenizer with one that adds a leading space, which megalite's SentencePiece models do not.
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
                "clean_up_tokenization_spaces": False, **special}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as file:
        json.dump(settings, file, indent=2)
        file.write("\n")


# SentencePiece piece types (sentencepiece_model.proto).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4


def sentencepiece_to_tokenizers(model_path: str, add_bos: bool = False):
    """A `tokenizers.Tokenizer` that encodes and decodes exactly as SentencePiece model `model_path`.

    BPE: SentencePiece merges the adjacent pair whose merged piece scores highest, so the
    merges are every split of every piece into two pieces, ranked by the merged piece's
    score. Unigram models keep their scores. Normalisation follows the model's spec
    (precompiled rules, extra-whitespace removal, dummy prefix, whitespace as U+2581);
    unknown characters fall back to byte pieces when the model does. add_bos: prepend bos
    (Llama2Tokenizer). Returns (tokenizer, the special tokens for tokenizer_config.json).
    """
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE, Unigram

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_path, "rb") as file:
        proto.ParseFromString(file.read())
    trainer, spec, pieces = proto.trainer_spec, proto.normalizer_spec, proto.pieces
    if trainer.model_type == 2:  # BPE
        if any(piece.type == _USER_DEFINED for piece in pieces):
            # SentencePiece cuts them out before merging; tokenizers' BPE has no equivalent step.
            raise UserError(f"{model_path} is a BPE SentencePiece model with user-defined symbols, which has no "
                            f"exact Hugging Face equivalent; export with --skip-tokenizer")
        vocab = {piece.piece: i for i, piece in enumerate(pieces)}
        mergeable = {piece.piece for piece in pieces if piece.type == _NORMAL}
        merges = []
        for piece in sorted(pieces, key=lambda piece: -piece.score):  # stable: ties keep id order
            if piece.type != _NORMAL:
                continue
            text = piece.piece
            merges += [(text[:cut], text[cut:]) for cut in range(1, len(text))
                       if text[:cut] in mergeable and text[cut:] in mergeable]
        model = BPE(vocab, merges, unk_token=trainer.unk_piece, fuse_unk=True, byte_fallback=trainer.byte_fallback)
    elif trainer.model_type == 1:  # unigram
        model = Unigram([(piece.piece, piece.score) for piece in pieces], trainer.unk_id, trainer.byte_fallback)
    else:
        raise UserError(f"{model_path} is a SentencePiece model of type {trainer.model_type}; only BPE and "
                        f"unigram models convert to a Hugging Face tokenizer")
    tokenizer = Tokenizer(model)
    rules = []
    if spec.precompiled_charsmap:
        rules.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        rules += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.escape_whitespaces:
        rules.append(normalizers.Replace(" ", "\u2581"))
    if spec.add_dummy_prefix:
        rules.append(normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(rules)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if spec.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    tokenizer.add_special_tokens([AddedToken(piece.piece, special=True, normalized=False)
                                  for piece in pieces if piece.type in (_UNKNOWN, _CONTROL)])
    special = {}
    for key, index in [("unk_token", trainer.unk_id), ("bos_token", trainer.bos_id),
                       ("eos_token", trainer.eos_id), ("pad_token", trainer.pad_id)]:
        if 0 <= index < len(pieces):
            special[key] = pieces[index].piece
    if add_bos and "bos_token" in special:
        bos = special["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, trainer.bos_id)])
    return tokenizer, special


def null_tokenizer_to_tokenizers(eod: int):
    """NullTokenizer as a `tokenizers.Tokenizer`: whitespace-separated ids 0..eod, each its own word."""
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    tokenizer = Tokenizer(WordLevel({str(i): i for i in range(eod + 1)}, unk_token=str(eod)))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return tokenizer
