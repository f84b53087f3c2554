"""megalite's ModelConfig <-> Hugging Face config, for two families that map one to one: LLaMA-style
(rope, RMSNorm, SwiGLU; GQA, tied or untied, biases on all linear layers or none) <-> `LlamaForCausalLM`
(Mistral without a sliding window imports as it too), and GPT-2-style (learned positions, LayerNorm, GELU,
biases, multi-head) <-> `GPT2LMHeadModel`. Anything else is refused, naming the setting or the field."""

from dataclasses import dataclass

import torch

from megalite.config import ModelConfig
from megalite.errors import UserError

LLAMA, GPT2 = "LlamaForCausalLM", "GPT2LMHeadModel"
_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def hf_architecture(config: ModelConfig) -> str:
    """LLAMA or GPT2, the HF class that computes exactly what `config` computes; UserError otherwise."""
    if config.apply_layernorm_1p:
        raise UserError("this model stores its norm weights as w - 1 (--apply-layernorm-1p), which the converter "
                        "does not translate yet; train without --apply-layernorm-1p to export to Hugging Face")
    llama = dict(position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    gpt2 = dict(position_embedding_type="learned_absolute", normalization="LayerNorm", swiglu=False,
                add_bias_linear=True)
    if all(getattr(config, key) == value for key, value in llama.items()):
        if config.rotary_percent != 1.0:
            raise UserError(f"this model rotates {config.rotary_dim} of each head's {config.head_dim} channels "
                            f"(--rotary-percent {config.rotary_percent:g}), but transformers' LlamaForCausalLM "
                            f"rotates whole heads; train with --rotary-percent 1.0 to export to Hugging Face")
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
    raise UserError(f"no transformers architecture computes this model ({shape}); conversion supports LLaMA-style "
                    "(rope, RMSNorm, SwiGLU) and GPT-2-style (learned positions, LayerNorm, GELU, biases, multi-head "
                    "attention)")


def llama_config_to_hf(config: ModelConfig, attn_implementation: str = "sdpa", **extra):
    """The `transformers.LlamaConfig` (given `extra`) of a LLaMA-shaped megalite config (real vocabulary);
    Llama 3.1 rope scaling is HF's "llama3" rope type with megalite's fixed factors (_LLAMA3_ROPE)."""
    import transformers  # only conversion, tests and benchmarks need it

    rope_scaling = None
    if config.use_rope_scaling:
        rope_scaling = {"rope_type": "llama3", "factor": config.rope_scaling_factor, **_LLAMA3_ROPE}
    extra = {"attention_bias": False, "mlp_bias": False, "attention_dropout": 0.0, **extra}
    return transformers.LlamaConfig(
        vocab_size=config.real_vocab_size, hidden_size=config.hidden_size,
        intermediate_size=config.ffn_hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.query_groups,
        head_dim=config.head_dim, max_position_embeddings=config.max_position_embeddings,
        rms_norm_eps=config.norm_epsilon, rope_theta=config.rotary_base, rope_scaling=rope_scaling,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        attn_implementation=attn_implementation, **extra)


def gpt2_config_to_hf(config: ModelConfig, attn_implementation: str = "sdpa", **extra):
    """The `transformers.GPT2Config` (given `extra`) of a GPT-2-shaped megalite config (real vocabulary)."""
    import transformers

    extra = {"bos_token_id": None, "eos_token_id": None, **extra}
    return transformers.GPT2Config(
        vocab_size=config.real_vocab_size, n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size, n_layer=config.num_layers, n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size, activation_function="gelu_new" if config.openai_gelu else "gelu",
        layer_norm_epsilon=config.norm_epsilon, resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout, attn_pdrop=config.attention_dropout,
        tie_word_embeddings=not config.untie_embeddings_and_output_weights,
        attn_implementation=attn_implementation, **extra)


def hf_config_for(config: ModelConfig, dtype: torch.dtype, bos: int | None, eos: int | None, pad: int | None):
    """The HF config to save with an exported model: architecture, weight dtype, special token ids."""
    architecture = hf_architecture(config)
    extra = dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=pad, initializer_range=config.init_method_std,
                 architectures=[architecture], dtype=str(dtype).split(".")[-1])
    if architecture == GPT2:
        return gpt2_config_to_hf(config, **extra)
    bias = config.add_bias_linear
    try:
        return llama_config_to_hf(config, attention_bias=bias, mlp_bias=bias, **extra)
    except ValueError as error:  # transformers' own checks, e.g. hidden size vs heads
        raise UserError(f"transformers refuses this model's LlamaConfig ({error})") from None


@dataclass
class ImportedConfig:
    """What an HF config.json becomes: the architecture and megalite's ModelConfig fields."""

    architecture: str
    fields: dict  # the ModelConfig fields that define the model (all but the vocabulary and recomputation)
    vocab_size: int  # the HF model's, unpadded


def model_fields_from_hf(hf: dict, seq_length: int | None = None) -> ImportedConfig:
    """Read an HF `config.json` (a dict) of transformers 4.x (rope_theta / rope_scaling) or 5.x
    (rope_parameters); UserError naming the field for anything megalite cannot compute. seq_length: the
    training sequence length to record; default max_position_embeddings, at most 4096."""
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


def _llama_fields(hf: dict) -> dict:
    if hf.get("hidden_act") not in ("silu", None):
        raise UserError(f"config.json field 'hidden_act' is {hf['hidden_act']!r}, but megalite's SwiGLU uses silu")
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
    factor = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if factor != 1.0:
        raise UserError(f"config.json field 'partial_rotary_factor' is {factor}, but LlamaForCausalLM applies rope "
                        f"to whole heads, so the file does not describe a model it computes; only a factor of 1 "
                        f"(or none) imports")
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
