"""megalite/convert/preset_model.py: the ModelConfig built from an imported model's fields is the one
its printed pretrain_gpt.py flags parse to, so `--load --finetune` with those flags accepts the checkpoint."""

import pytest

from megalite.arguments import parse_args
from megalite.convert import model_fields_from_hf, preset_model
from megalite.errors import UserError

LLAMA = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
         "rms_norm_eps": 1e-6, "hidden_act": "silu", "rope_theta": 50000.0, "initializer_range": 0.1}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 90, "n_positions": 48, "n_embd": 32, "n_layer": 2,
        "n_head": 4, "initializer_range": 0.1}
MODELS = {
    "llama-gqa-untied": LLAMA,
    "llama-mha-tied-biases": {**LLAMA, "num_key_value_heads": 4, "attention_bias": True, "mlp_bias": True,
                              "tie_word_embeddings": True},
    "mistral-head-dim": {**LLAMA, "architectures": ["MistralForCausalLM"], "sliding_window": None, "head_dim": 32},
    "llama3.1-rope-scaling": {**LLAMA, "rope_scaling": {"rope_type": "llama3", "factor": 32.0}},
    "gpt2-tied": GPT2,
    "gpt2-untied-wide-mlp": {**GPT2, "tie_word_embeddings": False, "n_inner": 96},
}
# Only the model and layout matter; these flags just complete a run's command line.
PLACEHOLDERS = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1", "--micro-batch-size", "1"]


@pytest.mark.parametrize("tp, pp, divisible_by", [(1, 1, 128), (2, 1, 128), (1, 2, 64)])
@pytest.mark.parametrize("name", MODELS)
def test_config_from_fields_equals_the_config_its_flags_parse_to(name, tp, pp, divisible_by):
    imported = model_fields_from_hf(MODELS[name])
    imported.fields["make_vocab_size_divisible_by"] = divisible_by
    model = preset_model(imported.fields, imported.vocab_size, tp, pp)
    assert model.flags()[:2] == ["--model", model.preset]
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
              "--global-batch-size", str(pp)]
    parsed = parse_args(model.flags() + layout + PLACEHOLDERS, world_size=tp * pp)
    assert parsed.with_tokenizer_vocab(imported.vocab_size).model == model.config
    assert model.config.real_vocab_size == imported.vocab_size
    assert model.config.vocab_size % (divisible_by * tp) == 0


def test_layouts_that_do_not_fit_are_refused_naming_the_flags():
    imported = model_fields_from_hf(LLAMA)
    with pytest.raises(UserError, match="--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"):
        preset_model(imported.fields, imported.vocab_size, tensor_model_parallel_size=4)
    with pytest.raises(UserError, match="--num-layers 2 is not divisible by --pipeline-model-parallel-size"):
        preset_model(imported.fields, imported.vocab_size, pipeline_model_parallel_size=4)
    with pytest.raises(UserError, match="--seq-length 128 exceeds --max-position-embeddings 64"):
        preset_model(model_fields_from_hf(LLAMA, seq_length=128).fields, imported.vocab_size)
