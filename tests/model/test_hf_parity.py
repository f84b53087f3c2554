"""megalite's logits equal Hugging Face's for the same weights (fp32, atol 1e-5).

The HF models are built locally from a config (nothing is downloaded) and receive
megalite's weights through the conversion mapping of megalite/convert/maps.py.
Norm weights and biases are randomised first so that their mapping is tested too, and
weights are drawn with std 0.1 (not 0.02) so that activations are large enough for
the comparison to tell apart, e.g., exact and tanh GELU (they differ by ~6e-4 here).
"""

import pytest
import torch
import torch.nn.functional as F

from megalite.config import ModelConfig
from megalite.convert import gpt2_config_to_hf, hf_state_dict, llama_config_to_hf
from megalite.model.gpt import GPTModel
from tests.helpers.model import logits as logits_of, token_losses

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
INIT_STD = 0.1


def hf_state(model: GPTModel) -> dict[str, torch.Tensor]:
    """megalite's weights under HF's names (megalite/convert/maps.py), lm_head included when tied."""
    hf = hf_state_dict(model.state_dict(), model.config)
    head = "model.embed_tokens.weight" if "model.embed_tokens.weight" in hf else "transformer.wte.weight"
    hf.setdefault("lm_head.weight", hf[head])
    return hf


def randomise_norms_and_biases(model: GPTModel) -> None:
    """Init leaves norms at 1 and biases at 0; give them values so their mapping matters."""
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:
                param.add_(0.1 * torch.randn(param.shape, generator=generator))


def load_into(hf_model, hf_state: dict[str, torch.Tensor]) -> None:
    missing, unexpected = hf_model.load_state_dict({k: v.clone() for k, v in hf_state.items()}, strict=False)
    assert not unexpected, unexpected
    assert not missing, missing


def inputs(config: ModelConfig, reset_at: int | None = None, batch: int = 2):
    """Tokens [b, s] (below the real vocabulary) and position ids, optionally restarting at `reset_at`."""
    generator = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, config.real_vocab_size, (batch, config.seq_length), generator=generator)
    positions = torch.arange(config.seq_length).repeat(batch, 1)
    if reset_at is not None:
        positions[0, reset_at:] -= reset_at  # a second document starts in sample 0
    return tokens, positions


def compare(ours: GPTModel, hf_model, config: ModelConfig, reset_at: int | None = None) -> float:
    """Max |logit difference|; also checks per-token losses against HF's logits."""
    ours.eval()
    hf_model.eval()
    tokens, positions = inputs(config, reset_at)
    with torch.no_grad():
        logits = logits_of(ours, tokens, positions)
        hf_logits = hf_model(input_ids=tokens, position_ids=positions).logits
        labels = tokens.roll(-1, dims=1)
        losses = token_losses(ours, tokens, labels, position_ids=positions)
    assert logits.shape == hf_logits.shape == (*tokens.shape, config.real_vocab_size)
    torch.testing.assert_close(logits, hf_logits, atol=ATOL, rtol=0)
    hf_losses = F.cross_entropy(hf_logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    torch.testing.assert_close(losses, hf_losses, atol=ATOL, rtol=0)
    return (logits - hf_logits).abs().max().item()


def hf_llama(config: ModelConfig):
    return transformers.LlamaForCausalLM(llama_config_to_hf(config, attn_implementation="eager")).float()


@pytest.mark.parametrize("overrides", [
    dict(),                                                      # GQA, untied
    dict(untie_embeddings_and_output_weights=False),             # tied
    dict(num_query_groups=None, kv_channels=24),                 # MHA, head size != hidden/heads
    dict(num_query_groups=1, rotary_base=500000.0, use_rope_scaling=True, rope_scaling_factor=32.0,
         max_position_embeddings=131072),                        # Llama 3.2 style
    dict(vocab_size=256, tokenizer_vocab_size=250),              # padded vocabulary
], ids=["gqa-untied", "tied", "mha-kv-channels", "llama3-rope-scaling", "padded-vocab"])
def test_llama_logits_match_hugging_face(llama_config, overrides):
    config = llama_config(init_method_std=INIT_STD, **overrides)
    ours = GPTModel(config, seed=11)
    randomise_norms_and_biases(ours)
    hf_model = hf_llama(config)
    load_into(hf_model, hf_state(ours))
    compare(ours, hf_model, config)
    compare(ours, hf_model, config, reset_at=5)  # position ids restarting inside a sample


@pytest.mark.parametrize("overrides, architecture", [
    (dict(add_qkv_bias=True), "Qwen2ForCausalLM"),                                               # GQA, untied
    (dict(add_qkv_bias=True, untie_embeddings_and_output_weights=False), "Qwen2ForCausalLM"),   # tied
    (dict(qk_layernorm=True, kv_channels=24), "Qwen3ForCausalLM"),            # head size != hidden/heads
    (dict(qk_layernorm=True, num_query_groups=None, untie_embeddings_and_output_weights=False), "Qwen3ForCausalLM"),
], ids=["qwen2-untied", "qwen2-tied", "qwen3-gqa-kv-channels", "qwen3-mha-tied"])
def test_qwen_logits_match_hugging_face(llama_config, overrides, architecture):
    config = llama_config(init_method_std=INIT_STD, **overrides)
    ours = GPTModel(config, seed=13)
    randomise_norms_and_biases(ours)  # the QKV bias and the q/k norm weights too
    hf_model = transformers.AutoModelForCausalLM.from_config(
        llama_config_to_hf(config, attn_implementation="eager")).float()
    assert type(hf_model).__name__ == architecture
    load_into(hf_model, hf_state(ours))
    compare(ours, hf_model, config)
    compare(ours, hf_model, config, reset_at=5)


MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)


@pytest.mark.parametrize("overrides, architecture", [
    (dict(), "MixtralForCausalLM"),
    (dict(add_qkv_bias=True, moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
          moe_router_pre_softmax=True, moe_layer_freq="[1,0,1,1]"), "Qwen2MoeForCausalLM"),
    (dict(qk_layernorm=True, kv_channels=24, moe_router_topk=3, moe_layer_freq=2), "Qwen3MoeForCausalLM"),
], ids=["mixtral", "qwen2-moe-shared-gated-dense-layer", "qwen3-moe"])
def test_moe_logits_match_hugging_face(llama_config, overrides, architecture):
    """megalite's own random MoE models (aux loss off) in transformers 5's in-memory layout: fused experts."""
    config = llama_config(init_method_std=INIT_STD, **{**MOE, **overrides})
    ours = GPTModel(config, seed=14)
    randomise_norms_and_biases(ours)
    hf_model = transformers.AutoModelForCausalLM.from_config(
        llama_config_to_hf(config, attn_implementation="eager")).float()
    assert type(hf_model).__name__ == architecture
    load_into(hf_model, hf_state_dict(ours.state_dict(), config, fused_experts=True))
    compare(ours, hf_model, config)


@pytest.mark.parametrize("openai_gelu", [True, False], ids=["gelu_new", "gelu-exact"])
def test_gpt2_logits_match_hugging_face(gpt2_config, openai_gelu):
    config = gpt2_config(openai_gelu=openai_gelu, tokenizer_vocab_size=250, init_method_std=INIT_STD)
    ours = GPTModel(config, seed=12)
    randomise_norms_and_biases(ours)
    hf_model = transformers.GPT2LMHeadModel(gpt2_config_to_hf(config, attn_implementation="eager")).float()
    load_into(hf_model, hf_state(ours))
    compare(ours, hf_model, config)
    compare(ours, hf_model, config, reset_at=7)
