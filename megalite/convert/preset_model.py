"""The megalite model an imported HF model becomes: a `--model` preset and the fields that override it.
One dict of overrides builds the ModelConfig the checkpoint records (`model_config_from_preset`) and is
spelled as the pretrain_gpt.py flags to continue with (`PresetModel.flags`). As `arguments.py` makes the
same call, a run given those flags holds a ModelConfig equal to the checkpoint's, which `--load
--finetune` requires field by field."""

import dataclasses
from dataclasses import dataclass

from megalite.config import MODEL_PRESETS, ModelConfig, ParallelConfig, model_config_from_preset
from megalite.config.options import flags_of
from megalite.config.rules import check_rope_context, check_tensor_parallel_split, virtual_stage_layers
from megalite.errors import UserError

# Presets tried as the base: flags switch some booleans on only (--swiglu, --untie-...,
# --openai-gelu, --add-qkv-bias, --qk-layernorm) or off only (--disable-bias-linear), so the base decides the rest.
_BASE_PRESETS = ("tiny", "llama3.2-1b", "gpt2-124m")
# Fields whose raw value may differ while the model computes the same thing.
_DERIVED = {"num_query_groups": "query_groups", "kv_channels": "head_dim"}
_FLAGS = {field.name: flags_of(field)[0] for field in dataclasses.fields(ModelConfig) if "option" in field.metadata}
_DEFAULTS = {field.name: field.default for field in dataclasses.fields(ModelConfig)}
# The MoE fields an import sets, in flag order: all on-only booleans or values.
_MOE_FIELDS = ("num_experts", "moe_ffn_hidden_size", "moe_router_topk", "moe_router_pre_softmax", "moe_layer_freq",
               "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")


@dataclass(frozen=True)
class PresetModel:
    """`config` is `model_config_from_preset(preset, TP, vocab_size=..., **overrides)`."""

    preset: str
    overrides: dict
    config: ModelConfig

    def flags(self) -> list[str]:
        """The pretrain_gpt.py model flags that select `preset` and set `overrides`, for the user to read."""
        flags = ["--model", self.preset]
        for key, value in self.overrides.items():
            if key == "num_query_groups":
                flags += ["--group-query-attention", _FLAGS[key], str(value)]
            elif isinstance(value, bool):
                flags.append(_FLAGS[key])  # an on flag, or --disable-bias-linear for add_bias_linear False
            else:
                flags += [_FLAGS[key], str(value)]
        return flags


def preset_model(fields: dict, vocab_size: int, tensor_model_parallel_size: int = 1,
                 pipeline_model_parallel_size: int = 1) -> PresetModel:
    """The preset, overrides and ModelConfig (vocabulary `vocab_size`, padded for TP) of the model `fields`
    describe (model_fields_from_hf's, plus make_vocab_size_divisible_by when not 128). The layout is checked
    as a run would check it. UserError when no preset and overrides express the model, or the layout does
    not fit it."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    ParallelConfig(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                   world_size=max(tp, 1) * max(pp, 1)).validate()  # sizes below 1, with the flag named
    errors = []
    for preset in _BASE_PRESETS:
        overrides = _overrides_on_preset(fields, preset)
        try:
            if overrides["position_embedding_type"] == "rope":
                check_rope_context(overrides["seq_length"], overrides["max_position_embeddings"])
            config = model_config_from_preset(preset, tp, vocab_size=vocab_size, **overrides)
            check_tensor_parallel_split(config.num_attention_heads, config.query_groups, config.ffn_hidden_size, tp)
            virtual_stage_layers(config.num_layers, pp)
        except UserError as error:  # the layout does not fit, or this preset cannot take the overrides
            errors.append(error)
            continue
        if _same_model(config, fields):
            return PresetModel(preset, overrides, config)
    if errors:
        raise errors[0]
    raise UserError("no combination of pretrain_gpt.py's model flags builds this model, so megalite cannot "
                    "train it")


def _overrides_on_preset(fields: dict, preset: str) -> dict:
    """The fields that flags set on top of `preset` for the model `fields` describe, in flag order.
    Booleans appear only where a flag exists for that value (True, or add_bias_linear False)."""
    overrides = {key: fields[key] for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads")}
    if fields["num_query_groups"] != fields["num_attention_heads"] or MODEL_PRESETS[preset].get("num_query_groups"):
        overrides["num_query_groups"] = fields["num_query_groups"]
    if fields["kv_channels"] * fields["num_attention_heads"] != fields["hidden_size"]:
        overrides["kv_channels"] = fields["kv_channels"]
    for key in ("seq_length", "max_position_embeddings", "position_embedding_type"):
        overrides[key] = fields[key]
    if fields["position_embedding_type"] == "rope":
        overrides["rotary_base"] = fields["rotary_base"]
    if fields["use_rope_scaling"]:
        overrides.update(use_rope_scaling=True, rope_scaling_factor=fields["rope_scaling_factor"])
    overrides.update(normalization=fields["normalization"], norm_epsilon=fields["norm_epsilon"])
    for key, on in [("swiglu", fields["swiglu"]), ("openai_gelu", fields["openai_gelu"] and not fields["swiglu"]),
                    ("untie_embeddings_and_output_weights", fields["untie_embeddings_and_output_weights"]),
                    ("add_qkv_bias", fields["add_qkv_bias"]), ("qk_layernorm", fields["qk_layernorm"])]:
        if on:
            overrides[key] = True
    if not fields["add_bias_linear"]:
        overrides["add_bias_linear"] = False
    for key in _MOE_FIELDS:  # an imported MoE model's (model_fields_from_hf gives them only for MoE classes)
        if key in fields and fields[key] != _DEFAULTS[key]:
            overrides[key] = fields[key]
    for key in ("hidden_dropout", "attention_dropout", "init_method_std"):
        overrides[key] = fields[key]
    if fields.get("make_vocab_size_divisible_by", 128) != 128:
        overrides["make_vocab_size_divisible_by"] = fields["make_vocab_size_divisible_by"]
    return overrides


def _same_model(config: ModelConfig, fields: dict) -> bool:
    """Whether `config` computes the model `fields` describe (raw fields may differ where derived)."""
    unused = {"openai_gelu": fields["swiglu"], "rope_scaling_factor": not fields["use_rope_scaling"],
              "rotary_base": fields["position_embedding_type"] != "rope"}
    return all(getattr(config, _DERIVED.get(key, key)) == value
               for key, value in fields.items() if not unused.get(key, False))
