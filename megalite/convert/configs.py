"""megalite's ModelConfig <-> Hugging Face config, for the families that map one to one: LLaMA-style
(rope, RMSNorm, SwiGLU; GQA, tied or untied) with biases on all linear layers or none <-> `LlamaForCausalLM`
(Mistral without a sliding window imports as it too), with biases on QKV only (--add-qkv-bias) <->
`Qwen2ForCausalLM`, with per-head q/k norms (--qk-layernorm) and no biases <-> `Qwen3ForCausalLM`; and
GPT-2-style (learned positions, LayerNorm, GELU, biases, multi-head) <-> `GPT2LMHeadModel`. LLaMA-style MoE
models with softmax top-k routing: plain <-> `MixtralForCausalLM`, with a sigmoid-gated shared expert <->
`Qwen2MoeForCausalLM`, with q/k norms <-> `Qwen3MoeForCausalLM` (HF's norm_topk_prob False is Megatron's
--moe-router-pre-softmax). Anything else is refused, naming the setting or the field."""

from dataclasses import dataclass

import torch

from megalite.config import ModelConfig
from megalite.config.model import moe_layer_pattern
from megalite.errors import UserError

LLAMA, GPT2 = "LlamaForCausalLM", "GPT2LMHeadModel"
QWEN2, QWEN3 = "Qwen2ForCausalLM", "Qwen3ForCausalLM"
MIXTRAL, QWEN2_MOE, QWEN3_MOE = "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"
MOE_FAMILIES = (MIXTRAL, QWEN2_MOE, QWEN3_MOE)
# config.json's architectures or model_type -> the family it imports as.
_FAMILIES = {"LlamaForCausalLM": LLAMA, "llama": LLAMA, "MistralForCausalLM": LLAMA, "mistral": LLAMA,
             "Qwen2ForCausalLM": QWEN2, "qwen2": QWEN2, "Qwen3ForCausalLM": QWEN3, "qwen3": QWEN3,
             "MixtralForCausalLM": MIXTRAL, "mixtral": MIXTRAL, "Qwen2MoeForCausalLM": QWEN2_MOE,
             "qwen2_moe": QWEN2_MOE, "Qwen3MoeForCausalLM": QWEN3_MOE, "qwen3_moe": QWEN3_MOE,
             "GPT2LMHeadModel": GPT2, "gpt2": GPT2}
# Routing options no MoE class of transformers has: (field, flag).
_HF_LESS_ROUTING = [("moe_router_enable_expert_bias", "--moe-router-enable-expert-bias"),
                    ("moe_router_num_groups", "--moe-router-num-groups"),
                    ("moe_router_topk_scaling_factor", "--moe-router-topk-scaling-factor"),
                    ("moe_expert_capacity_factor", "--moe-expert-capacity-factor")]
_ROPE_TYPES = ("default", "llama3")
_LLAMA3_ROPE = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def hf_architecture(config: ModelConfig) -> str:
    """LLAMA, QWEN2, QWEN3 or GPT2: the HF class that computes exactly what `config` computes; UserError
    otherwise."""
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
        return _llama_family(config) if config.num_experts is None else _moe_family(config)
    if config.num_experts is not None:
        raise UserError("transformers' MoE classes (Mixtral, Qwen2-MoE, Qwen3-MoE) are LLaMA-style; train the MoE "
                        "model with rope, RMSNorm and --swiglu to export it to Hugging Face")
    if config.add_qkv_bias or config.qk_layernorm:
        raise UserError("only LLaMA-style models (rope, RMSNorm, SwiGLU) with --add-qkv-bias (Qwen2) or "
                        "--qk-layernorm (Qwen3) have a transformers class; GPT-2 has neither")
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


def _llama_family(config: ModelConfig) -> str:
    """Which LLaMA-shaped HF class: by the biases and the q/k norms."""
    if config.qk_layernorm:
        if config.add_bias_linear or config.add_qkv_bias:
            raise UserError("Qwen3ForCausalLM, the transformers class with q/k norms (--qk-layernorm), has no "
                            "biases, but this model has some; train with --disable-bias-linear and without "
                            "--add-qkv-bias to export to Hugging Face")
        return QWEN3
    return QWEN2 if config.add_qkv_bias and not config.add_bias_linear else LLAMA


def _moe_family(config: ModelConfig) -> str:
    """Which MoE class: by the shared expert and the q/k norms, after the routing (softmax top-k only)."""
    if config.moe_router_score_function != "softmax":
        raise UserError("this MoE model routes by sigmoid scores (--moe-router-score-function sigmoid), but "
                        "transformers' Mixtral, Qwen2-MoE and Qwen3-MoE route by a softmax; train with softmax "
                        "routing to export to Hugging Face")
    for field, flag in _HF_LESS_ROUTING:
        if getattr(config, field):
            raise UserError(f"this MoE model routes with {flag}, which no transformers MoE class (Mixtral, "
                            f"Qwen2-MoE, Qwen3-MoE) computes; train without it to export to Hugging Face")
    if config.add_bias_linear:
        raise UserError("transformers' MoE classes have no biases on their projections and experts; train the MoE "
                        "model with --disable-bias-linear to export it to Hugging Face")
    if config.moe_shared_expert_intermediate_size is not None:
        if not config.moe_shared_expert_gate or config.qk_layernorm:
            raise UserError("only Qwen2MoeForCausalLM among transformers' MoE classes has a shared expert, gated by "
                            "sigmoid(x w) and without q/k norms; train with --moe-shared-expert-gate and without "
                            "--qk-layernorm (or without shared experts) to export to Hugging Face")
        return QWEN2_MOE
    if config.qk_layernorm:
        if config.add_qkv_bias:
            raise UserError("Qwen3MoeForCausalLM, the MoE class with q/k norms, has no QKV bias; train without "
                            "--add-qkv-bias to export to Hugging Face")
        return QWEN3_MOE
    if config.add_qkv_bias:
        raise UserError("an MoE model with --add-qkv-bias exports as Qwen2MoeForCausalLM, which has a gated shared "
                        "expert; add --moe-shared-expert-intermediate-size and --moe-shared-expert-gate, or train "
                        "without --add-qkv-bias")
    if config.moe_router_pre_softmax or not all(moe_layer_pattern(config.moe_layer_freq, config.num_layers)):
        raise UserError("MixtralForCausalLM, the MoE class without shared experts or q/k norms, has an MoE layer in "
                        "every layer and renormalises the top-k probabilities; train with --moe-layer-freq 1 and "
                        "without --moe-router-pre-softmax (or add --qk-layernorm, as Qwen3-MoE) to export it")
    return MIXTRAL


def _moe_fields_to_hf(config: ModelConfig, architecture: str) -> dict:
    """The HF config fields of the experts and the router (intermediate_size: the dense layers', Qwen's)."""
    experts = dict(num_experts_per_tok=config.moe_router_topk, output_router_logits=False)
    if architecture == MIXTRAL:
        return dict(experts, num_local_experts=config.num_experts, intermediate_size=config.expert_ffn_hidden_size,
                    router_jitter_noise=0.0)
    pattern = moe_layer_pattern(config.moe_layer_freq, config.num_layers)
    qwen = dict(experts, num_experts=config.num_experts, moe_intermediate_size=config.expert_ffn_hidden_size,
                norm_topk_prob=not config.moe_router_pre_softmax, decoder_sparse_step=1,
                mlp_only_layers=[i for i, moe in enumerate(pattern) if not moe], use_sliding_window=False)
    if architecture == QWEN2_MOE:
        qwen.update(shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size,
                    qkv_bias=config.add_qkv_bias)
    return qwen


def llama_config_to_hf(config: ModelConfig, attn_implementation: str = "sdpa", **extra):
    """The `transformers` config (given `extra`) of a LLaMA-shaped megalite config (real vocabulary):
    LlamaConfig, Qwen2Config, Qwen3Config or their MoE kin as hf_architecture decides. Llama 3.1 rope
    scaling is HF's "llama3" rope type with megalite's fixed factors (_LLAMA3_ROPE)."""
    import transformers  # only conversion, tests and benchmarks need it

    rope_scaling = None
    if config.use_rope_scaling:
        rope_scaling = {"rope_type": "llama3", "factor": config.rope_scaling_factor, **_LLAMA3_ROPE}
    architecture = hf_architecture(config)
    biases = {LLAMA: {"attention_bias": False, "mlp_bias": False}, QWEN3: {"attention_bias": False},
              QWEN3_MOE: {"attention_bias": False}}
    moe = _moe_fields_to_hf(config, architecture) if architecture in MOE_FAMILIES else {}
    extra = {"intermediate_size": config.ffn_hidden_size, **biases.get(architecture, {}), **moe,
             "attention_dropout": 0.0, **extra}
    config_class = {LLAMA: transformers.LlamaConfig, QWEN2: transformers.Qwen2Config,
                    QWEN3: transformers.Qwen3Config, MIXTRAL: transformers.MixtralConfig,
                    QWEN2_MOE: transformers.Qwen2MoeConfig, QWEN3_MOE: transformers.Qwen3MoeConfig}[architecture]
    return config_class(
        vocab_size=config.real_vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
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
    if architecture == LLAMA:
        extra.update(attention_bias=config.add_bias_linear, mlp_bias=config.add_bias_linear)
    try:
        return llama_config_to_hf(config, **extra)
    except ValueError as error:  # transformers' own checks, e.g. hidden size vs heads
        raise UserError(f"transformers refuses this model's {architecture} config ({error})") from None


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
    kind = _FAMILIES.get(architecture)
    if kind is None:
        hint = (" (OLMo models normalise q and k across all heads, megalite's --qk-layernorm per head)"
                if str(architecture).lower().startswith("olmo") else "")
        raise UserError(f"config.json's architectures/model_type is {architecture!r}, which megalite cannot "
                        f"import{hint}; supported: {', '.join(name for name in _FAMILIES if name[0].isupper())}")
    if hf.get("quantization_config"):
        raise UserError("config.json field 'quantization_config' is set; megalite imports unquantized models only")
    if kind not in MOE_FAMILIES and (hf.get("num_local_experts") or hf.get("num_experts")):
        raise UserError(f"config.json sets experts for {architecture!r}, a dense class; megalite imports MoE models "
                        f"as {', '.join(MOE_FAMILIES)}")
    fields = _gpt2_fields(hf) if kind == GPT2 else _llama_fields(hf, kind)
    if kind in MOE_FAMILIES:
        fields.update(_moe_fields(hf, kind))
    max_positions = fields["max_position_embeddings"]
    fields["seq_length"] = seq_length or min(max_positions, 4096)
    if fields["position_embedding_type"] == "learned_absolute" and fields["seq_length"] > max_positions:
        raise UserError(f"--seq-length {fields['seq_length']} exceeds the model's learned positions "
                        f"(n_positions {max_positions}); use at most {max_positions}")
    return ImportedConfig(kind, fields, int(hf["vocab_size"]))


def _llama_fields(hf: dict, kind: str) -> dict:
    if hf.get("hidden_act") not in ("silu", None):
        raise UserError(f"config.json field 'hidden_act' is {hf['hidden_act']!r}, but megalite's SwiGLU uses silu")
    window = hf.get("sliding_window")
    # Qwen's window applies only with use_sliding_window; Mistral has no such switch.
    if hf.get("use_sliding_window", True) and window is not None and window < hf.get("max_position_embeddings", 0):
        raise UserError(f"config.json field 'sliding_window' is {window!r}, but megalite attends over the whole "
                        f"sequence; only models without a sliding window (null) convert")
    if any(layer != "full_attention" for layer in hf.get("layer_types") or []):
        raise UserError("config.json field 'layer_types' has layers other than full_attention; megalite has "
                        "only full causal attention")
    attention_bias, mlp_bias = bool(hf.get("attention_bias", False)), bool(hf.get("mlp_bias", False))
    if kind == LLAMA and attention_bias != mlp_bias:
        raise UserError(f"config.json fields 'attention_bias' ({attention_bias}) and 'mlp_bias' ({mlp_bias}) "
                        f"differ, but megalite's linear layers have biases all or none (--disable-bias-linear)")
    if kind in (QWEN3, QWEN3_MOE) and attention_bias:
        raise UserError("config.json field 'attention_bias' is true, but Qwen3 then has biases on q/k/v/o and "
                        "none in the MLP, which megalite's --disable-bias-linear / --add-qkv-bias cannot express")
    heads, hidden = int(hf["num_attention_heads"]), int(hf["hidden_size"])
    head_dim = int(hf.get("head_dim") or (128 if kind == QWEN3 else hidden // heads))  # Qwen3Config's default
    qkv_bias = kind == QWEN2 or kind == QWEN2_MOE and bool(hf.get("qkv_bias", True))
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
        add_bias_linear=attention_bias and kind == LLAMA, add_qkv_bias=qkv_bias,
        qk_layernorm=kind in (QWEN3, QWEN3_MOE),
        hidden_dropout=0.0,
        attention_dropout=float(hf.get("attention_dropout") or 0.0),
        init_method_std=float(hf.get("initializer_range", 0.02)))


def _moe_fields(hf: dict, kind: str) -> dict:
    """The MoE fields of a Mixtral / Qwen2-MoE / Qwen3-MoE config.json: experts, router and which layers."""
    experts = hf.get("num_local_experts") or hf.get("num_experts")  # Qwen3-MoE writes either name
    if not experts:
        raise UserError(f"config.json of {kind} sets no experts (num_experts / num_local_experts); a model "
                        f"without MoE layers imports as its dense class")
    layers = int(hf["num_hidden_layers"])
    fields = dict(num_experts=int(experts), moe_router_topk=int(hf["num_experts_per_tok"]))
    if kind == MIXTRAL:
        if hf.get("router_jitter_noise"):
            raise UserError(f"config.json field 'router_jitter_noise' is {hf['router_jitter_noise']}, but megalite's "
                            f"router has no input jitter; set it to 0.0 to import")
        return fields  # every layer MoE, the experts of size intermediate_size (megalite's ffn_hidden_size)
    step, dense = int(hf.get("decoder_sparse_step") or 1), set(hf.get("mlp_only_layers") or [])
    pattern = [int(i not in dense and (i + 1) % step == 0) for i in range(layers)]
    if not any(pattern):
        raise UserError("config.json fields 'decoder_sparse_step' and 'mlp_only_layers' leave no MoE layer; import "
                        "the model as its dense class")
    fields.update(moe_ffn_hidden_size=int(hf["moe_intermediate_size"]),
                  moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
                  moe_layer_freq=1 if all(pattern) else "[" + ",".join(map(str, pattern)) + "]")
    if kind == QWEN2_MOE:
        fields.update(moe_shared_expert_intermediate_size=int(hf["shared_expert_intermediate_size"]),
                      moe_shared_expert_gate=True)
    return fields


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
        add_bias_linear=True, add_qkv_bias=False, qk_layernorm=False, hidden_dropout=float(hf.get("resid_pdrop", 0.1)),
        attention_dropout=float(hf.get("attn_pdrop", 0.1)), init_method_std=float(hf.get("initializer_range", 0.02)))
