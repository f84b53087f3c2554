"""tools/convert_checkpoint.py on MoE models: Mixtral, Qwen2-MoE and Qwen3-MoE, saved by transformers itself
(per-expert tensors on disk), imported, exported back bit for bit, computing HF's logits, and trained on.
MoE models no transformers class computes are refused in one sentence."""

import json
import os

import pytest
import torch
import torch.nn.functional as F

from megalite import checkpoint
from megalite.arguments import parse_args
from megalite.config import ModelConfig
from megalite.convert import hf_state_dict, model_fields_from_hf
from megalite.convert.configs import hf_architecture
from megalite.data.tokenizer import build_tokenizer
from megalite.errors import UserError
from megalite.model.gpt import build_model
from megalite.run.data import build_datasets
from tests.helpers.convert import LLAMA_CONFIG, hf_tensors, load_hf, save_random_hf, train
from tools.convert_checkpoint import main as convert
from tools.generate import load_model

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
COMMON = dict(vocab_size=80, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=32, initializer_range=0.1, tie_word_embeddings=False)
HF_MODELS = {
    "mixtral": lambda: transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                                  **COMMON),
    # the middle layer dense (a --moe-layer-freq list), pre-softmax routing, a gated shared expert, QKV biases
    "qwen2-moe": lambda: transformers.Qwen2MoeConfig(intermediate_size=40, moe_intermediate_size=24, num_experts=4,
                                                     num_experts_per_tok=2, shared_expert_intermediate_size=48,
                                                     mlp_only_layers=[1], norm_topk_prob=False, **COMMON),
    # renormalised top-k (Megatron's default softmax routing), q/k norms, head size 16 != hidden / heads
    "qwen3-moe": lambda: transformers.Qwen3MoeConfig(intermediate_size=40, moe_intermediate_size=16, num_experts=8,
                                                     num_experts_per_tok=3, head_dim=16, norm_topk_prob=True,
                                                     **COMMON),
}


@pytest.fixture(scope="module")
def hf_moe(tmp_path_factory):
    """name -> a folder with a random fp32 HF MoE model saved by `save_pretrained` (norms away from 1, biases
    away from 0, so that their mapping matters)."""
    return {name: save_random_hf(make_config(), seed, tmp_path_factory.mktemp(name))
            for seed, (name, make_config) in enumerate(HF_MODELS.items())}


def logit_difference(run_folder, hf_folder) -> float:
    """Max |logit difference| of a megalite checkpoint and an HF folder on random tokens (fp32, aux loss off)."""
    ours, _ = load_model(str(run_folder), None)
    theirs = load_hf(hf_folder)
    tokens = torch.randint(0, ours.config.real_vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits, hf_logits = ours.logits(ours(tokens)), theirs(tokens).logits
    assert logits.shape == hf_logits.shape and logits.std() > 0.1
    return (logits - hf_logits).abs().max().item()


@pytest.mark.parametrize("name", HF_MODELS)
def test_moe_from_hf_computes_hf_logits_and_goes_back_bit_for_bit(tmp_path, hf_moe, name):
    source = hf_moe[name]
    on_disk = hf_tensors(source)
    assert any(".experts.3." in key for key in on_disk)  # transformers writes one tensor per expert
    convert(["from-hf", "--load", source, "--save", str(tmp_path / "ckpt")])
    difference = logit_difference(tmp_path / "ckpt", source)
    print(f"{name}: max |logit difference| {difference:.2e}")
    assert difference <= ATOL
    convert(["to-hf", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "hf"), "--skip-tokenizer"])
    exported = hf_tensors(tmp_path / "hf")
    assert sorted(exported) == sorted(on_disk)  # every expert, the router, the shared expert and its gate
    for key, tensor in on_disk.items():
        assert exported[key].dtype == tensor.dtype and torch.equal(exported[key], tensor), key
    before = json.loads(open(os.path.join(source, "config.json")).read())
    after = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert after["architectures"] == before["architectures"]
    assert model_fields_from_hf(before).fields == model_fields_from_hf(after).fields
    assert load_hf(tmp_path / "hf").num_parameters() == load_hf(source).num_parameters()


def test_qwen2_moe_fields_map_to_megatron_s_flags(hf_moe):
    fields = model_fields_from_hf(json.loads(open(os.path.join(hf_moe["qwen2-moe"], "config.json")).read())).fields
    assert fields["moe_layer_freq"] == "[1,0,1]" and fields["moe_router_pre_softmax"]
    assert fields["moe_shared_expert_intermediate_size"] == 48 and fields["moe_shared_expert_gate"]
    assert (fields["ffn_hidden_size"], fields["moe_ffn_hidden_size"]) == (40, 24)
    sparse_step = {**LLAMA_CONFIG, "architectures": ["Qwen2MoeForCausalLM"], "num_experts": 4,
                   "num_experts_per_tok": 2, "moe_intermediate_size": 8, "shared_expert_intermediate_size": 8,
                   "decoder_sparse_step": 2, "norm_topk_prob": True}
    fields = model_fields_from_hf(sparse_step).fields
    assert fields["moe_layer_freq"] == "[0,1]" and not fields["moe_router_pre_softmax"]


def test_a_converted_moe_model_continues_training_from_its_hf_loss(tmp_path, hf_moe, capsys):
    convert(["from-hf", "--load", hf_moe["qwen2-moe"], "--save", str(tmp_path / "ckpt")])
    assert "--moe-layer-freq '[1,0,1]'" in capsys.readouterr().out  # quoted for the shell
    metadata = checkpoint.read_metadata(checkpoint.resolve_checkpoint(str(tmp_path / "ckpt")))
    flags = [*metadata["extra"]["model_flags"], "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size",
             "79", "--micro-batch-size", "2", "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-3",
             "--eval-interval", "0", "--eval-iters", "0", "--log-interval", "1", "--fp32"]
    train(tmp_path / "run", [*flags, "--load", str(tmp_path / "ckpt"), "--finetune"])
    losses = [json.loads(line)["lm_loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"split"' not in line]
    # The first batch megalite saw, rebuilt from the same flags, through the HF model.
    run = parse_args([*flags, "--data-cache-path", str(tmp_path / "run" / "cache")])
    tokenizer = build_tokenizer(run.data.tokenizer_type, run.data.tokenizer_model, run.data.vocab_size)
    train_set = build_datasets(run.with_tokenizer_vocab(tokenizer.vocab_size), tokenizer)[0]
    batch = {key: torch.stack([torch.as_tensor(train_set[i][key]) for i in range(2)])
             for key in ("tokens", "labels", "loss_mask")}
    with torch.no_grad():
        logits = load_hf(hf_moe["qwen2-moe"])(batch["tokens"]).logits
    per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten().float()
    hf_loss = float((per_token * mask).sum() / mask.sum())
    print(f"first loss {losses[0]:.7f}, the HF model's on that batch {hf_loss:.7f}")
    assert len(losses) == 2 and abs(losses[0] - hf_loss) <= 1e-5


# -- refusals --------------------------------------------------------------------------------------

MOE = dict(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
           position_embedding_type="rope", normalization="RMSNorm", swiglu=True, add_bias_linear=False,
           num_experts=4, moe_router_topk=2)


@pytest.mark.parametrize("extra, architecture", [
    (dict(), "MixtralForCausalLM"),
    (dict(add_qkv_bias=True, moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True,
          moe_router_pre_softmax=True, moe_layer_freq="[0,1]"), "Qwen2MoeForCausalLM"),
    (dict(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True), "Qwen2MoeForCausalLM"),
    (dict(qk_layernorm=True, moe_layer_freq=2), "Qwen3MoeForCausalLM"),
])
def test_moe_models_export_as_the_hf_class_that_computes_them(extra, architecture):
    config = ModelConfig.of(**MOE, **extra)
    assert hf_architecture(config) == architecture
    state = build_model(config, seed=0, device="meta").state_dict()
    hf = hf_state_dict(state, config)  # a KeyError on MoE models before
    assert sum(t.numel() for t in hf.values()) == sum(t.numel() for t in state.values())


@pytest.mark.parametrize("extra, words", [
    (dict(moe_router_score_function="sigmoid"), "routes by sigmoid scores"),
    (dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True), "routes by sigmoid scores"),
    (dict(moe_expert_capacity_factor=1.0), "routes with --moe-expert-capacity-factor, which no transformers"),
    (dict(moe_router_num_groups=2, moe_router_group_topk=1), "routes with --moe-router-num-groups"),
    (dict(moe_router_topk_scaling_factor=2.0), "routes with --moe-router-topk-scaling-factor"),
    (dict(add_bias_linear=True), "MoE classes have no biases"),
    (dict(swiglu=False), "MoE classes .* are LLaMA-style"),
    (dict(moe_shared_expert_intermediate_size=16), "only Qwen2MoeForCausalLM .* has a shared expert"),
    (dict(moe_shared_expert_intermediate_size=16, moe_shared_expert_gate=True, qk_layernorm=True),
     "only Qwen2MoeForCausalLM .* without q/k norms"),
    (dict(add_qkv_bias=True), "exports as Qwen2MoeForCausalLM, which has a gated shared expert"),
    (dict(qk_layernorm=True, add_qkv_bias=True), "Qwen3MoeForCausalLM, the MoE class with q/k norms, has no QKV"),
    (dict(moe_layer_freq=2), "MixtralForCausalLM, .* has an MoE layer in every layer"),
    (dict(moe_router_pre_softmax=True), "renormalises the top-k probabilities"),
])
def test_moe_models_no_hf_class_computes_are_refused_in_one_sentence(extra, words):
    with pytest.raises(UserError, match=words) as error:
        hf_architecture(ModelConfig.of(**{**MOE, **extra}))
    assert str(error.value).count(". ") == 0


MIXTRAL_CONFIG = {**LLAMA_CONFIG, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                  "num_local_experts": 4, "num_experts_per_tok": 2}


@pytest.mark.parametrize("change, words", [
    ({"router_jitter_noise": 0.01}, "field 'router_jitter_noise' is 0.01"),
    ({"num_local_experts": 0}, "sets no experts"),
    ({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}, "sets experts for 'LlamaForCausalLM'"),
    ({"architectures": ["Qwen3MoeForCausalLM"], "moe_intermediate_size": 8, "mlp_only_layers": [0, 1]},
     "leave no MoE layer"),
])
def test_moe_hf_configs_megalite_cannot_compute_are_refused_naming_the_field(change, words):
    with pytest.raises(UserError, match=words):
        model_fields_from_hf({**MIXTRAL_CONFIG, **change})


def test_moe_presets_export_as_their_hf_classes():
    from megalite.config import model_config_from_preset

    classes = {"tiny-moe": "Qwen2MoeForCausalLM", "mixtral-8x7b": "MixtralForCausalLM",
               "qwen3-30b-a3b": "Qwen3MoeForCausalLM"}
    for name, architecture in classes.items():
        assert hf_architecture(model_config_from_preset(name)) == architecture
    with pytest.raises(UserError, match="only Qwen2MoeForCausalLM .* has a shared expert, gated"):
        hf_architecture(model_config_from_preset("deepseek-v2-lite"))  # ungated shared experts: no HF class
