"""megalite's logits equal Hugging Face's for the same weights (fp32, atol 1e-5).

The HF models are built locally from a config (nothing is downloaded) and receive
megalite's weights through the mapping below (issue 8 moves it to megalite/hf.py).
Norm weights and biases are randomised first so that their mapping is tested too, and
weights are drawn with std 0.1 (not 0.02) so that activations are large enough for
the comparison to tell apart, e.g., exact and tanh GELU (they differ by ~6e-4 here).
"""

import pytest
import torch
import torch.nn.functional as F

from megalite.config import ModelConfig
from megalite.hf import llama_config_to_hf
from megalite.model.gpt import GPTModel

transformers = pytest.importorskip("transformers")

ATOL = 1e-5
INIT_STD = 0.1


def split_qkv(weight: torch.Tensor, config: ModelConfig):
    """Megatron's grouped QKV rows (or bias) -> (q, k, v) with heads in order."""
    groups, head_dim = config.query_groups, config.head_dim
    per_group = config.num_attention_heads // groups
    grouped = weight.reshape(groups, per_group + 2, head_dim, *weight.shape[1:])
    q = grouped[:, :per_group].reshape(-1, *weight.shape[1:])
    k = grouped[:, per_group].reshape(-1, *weight.shape[1:])
    v = grouped[:, per_group + 1].reshape(-1, *weight.shape[1:])
    return q, k, v


def to_hf_llama(model: GPTModel) -> dict[str, torch.Tensor]:
    """megalite state dict -> LlamaForCausalLM's, padding rows dropped."""
    config, state = model.config, model.state_dict()
    vocab, ffn = config.real_vocab_size, config.ffn_hidden_size
    hf = {"model.embed_tokens.weight": state["embedding.word_embeddings.weight"][:vocab],
          "model.norm.weight": state["final_layernorm.weight"]}
    hf["lm_head.weight"] = (state["output_layer.weight"][:vocab] if config.untie_embeddings_and_output_weights
                            else hf["model.embed_tokens.weight"])
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"model.layers.{i}."
        q, k, v = split_qkv(state[ours + "self_attention.linear_qkv.weight"], config)
        gate, up = state[ours + "mlp.linear_fc1.weight"].split([ffn, ffn])
        hf.update({
            theirs + "input_layernorm.weight": state[ours + "input_layernorm.weight"],
            theirs + "self_attn.q_proj.weight": q,
            theirs + "self_attn.k_proj.weight": k,
            theirs + "self_attn.v_proj.weight": v,
            theirs + "self_attn.o_proj.weight": state[ours + "self_attention.linear_proj.weight"],
            theirs + "post_attention_layernorm.weight": state[ours + "pre_mlp_layernorm.weight"],
            theirs + "mlp.gate_proj.weight": gate,
            theirs + "mlp.up_proj.weight": up,
            theirs + "mlp.down_proj.weight": state[ours + "mlp.linear_fc2.weight"],
        })
    return hf


def to_hf_gpt2(model: GPTModel) -> dict[str, torch.Tensor]:
    """megalite state dict -> GPT2LMHeadModel's (Conv1D weights are [in, out])."""
    config, state = model.config, model.state_dict()
    vocab = config.real_vocab_size
    hf = {"transformer.wte.weight": state["embedding.word_embeddings.weight"][:vocab],
          "transformer.wpe.weight": state["embedding.position_embeddings"],
          "transformer.ln_f.weight": state["final_layernorm.weight"],
          "transformer.ln_f.bias": state["final_layernorm.bias"]}
    hf["lm_head.weight"] = hf["transformer.wte.weight"]
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        qkv_weight = torch.cat(split_qkv(state[ours + "self_attention.linear_qkv.weight"], config))
        qkv_bias = torch.cat(split_qkv(state[ours + "self_attention.linear_qkv.bias"], config))
        hf.update({
            theirs + "ln_1.weight": state[ours + "input_layernorm.weight"],
            theirs + "ln_1.bias": state[ours + "input_layernorm.bias"],
            theirs + "attn.c_attn.weight": qkv_weight.t(),
            theirs + "attn.c_attn.bias": qkv_bias,
            theirs + "attn.c_proj.weight": state[ours + "self_attention.linear_proj.weight"].t(),
            theirs + "attn.c_proj.bias": state[ours + "self_attention.linear_proj.bias"],
            theirs + "ln_2.weight": state[ours + "pre_mlp_layernorm.weight"],
            theirs + "ln_2.bias": state[ours + "pre_mlp_layernorm.bias"],
            theirs + "mlp.c_fc.weight": state[ours + "mlp.linear_fc1.weight"].t(),
            theirs + "mlp.c_fc.bias": state[ours + "mlp.linear_fc1.bias"],
            theirs + "mlp.c_proj.weight": state[ours + "mlp.linear_fc2.weight"].t(),
            theirs + "mlp.c_proj.bias": state[ours + "mlp.linear_fc2.bias"],
        })
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
        logits = ours(tokens, positions)
        hf_logits = hf_model(input_ids=tokens, position_ids=positions).logits
        labels = tokens.roll(-1, dims=1)
        losses = ours(tokens, positions, labels=labels)
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
    load_into(hf_model, to_hf_llama(ours))
    compare(ours, hf_model, config)
    compare(ours, hf_model, config, reset_at=5)  # position ids restarting inside a sample


@pytest.mark.parametrize("openai_gelu", [True, False], ids=["gelu_new", "gelu-exact"])
def test_gpt2_logits_match_hugging_face(gpt2_config, openai_gelu):
    config = gpt2_config(openai_gelu=openai_gelu, tokenizer_vocab_size=250, init_method_std=INIT_STD)
    ours = GPTModel(config, seed=12)
    randomise_norms_and_biases(ours)
    hf_config = transformers.GPT2Config(
        vocab_size=config.real_vocab_size, n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size, n_layer=config.num_layers, n_head=config.num_attention_heads,
        n_inner=config.ffn_hidden_size, activation_function="gelu_new" if openai_gelu else "gelu",
        layer_norm_epsilon=config.norm_epsilon, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=None, eos_token_id=None)
    hf_config._attn_implementation = "eager"
    hf_model = transformers.GPT2LMHeadModel(hf_config).float()
    load_into(hf_model, to_hf_gpt2(ours))
    compare(ours, hf_model, config)
    compare(ours, hf_model, config, reset_at=7)
