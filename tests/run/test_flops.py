"""megalite/run/flops.py: the FLOPs formula against hand counts, and the peak table."""

import pytest
import torch

from megalite.config import ModelConfig, model_config_from_preset, num_parameters
from megalite.run.flops import find_gpu_peak, flops_per_iteration, gpu_peak_flops, peak_flops



def gpt_config(**overrides) -> ModelConfig:
    """2 layers, h 64, 4 heads of 16, MHA, GELU MLP of 256, vocab 256."""
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                  seq_length=16, vocab_size=256)
    values.update(overrides)
    return ModelConfig.of(**values).validate()


def llama_config(**overrides) -> ModelConfig:
    """2 layers, h 64, 4 heads of 16 in 2 groups (GQA), SwiGLU MLP of 96, vocab 256."""
    values = dict(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                  ffn_hidden_size=96, seq_length=16, vocab_size=256, position_embedding_type="rope",
                  normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                  untie_embeddings_and_output_weights=True)
    values.update(overrides)
    return ModelConfig.of(**values).validate()

# ----------------------------------------------------------------------------- FLOPs


def test_flops_by_hand_mha_gelu():
    # Per layer and token, 2 FLOPs per multiply-add, s = 16, d = 16:
    qkv = 2 * 64 * (4 + 2 * 4) * 16       # 24576: q, k, v for 4 heads
    proj = 2 * 64 * 64                    # 8192
    mlp = 2 * 64 * 256 + 2 * 256 * 64     # 65536: fc1 and fc2, no gate
    attention = 2 * 16 * 4 * 16           # 2048: (QK^T + AV) = 4·s·a·d, halved by the causal mask
    logits = 2 * 64 * 256                 # 32768
    forward_per_token = 2 * (qkv + proj + mlp + attention) + logits
    assert forward_per_token == 233472
    assert flops_per_iteration(gpt_config(), global_batch_size=3, seq_length=16) == 3 * 3 * 16 * 233472


def test_flops_by_hand_gqa_swiglu():
    qkv = 2 * 64 * (4 + 2 * 2) * 16       # 16384: 2 key/value groups instead of 4
    proj = 2 * 64 * 64                    # 8192
    mlp = 2 * 64 * 96 * 2 + 2 * 96 * 64   # 36864: gate and up, then down
    attention = 2 * 16 * 4 * 16           # 2048
    logits = 2 * 64 * 256                 # 32768
    forward_per_token = 2 * (qkv + proj + mlp + attention) + logits
    assert forward_per_token == 159744
    assert flops_per_iteration(llama_config(), global_batch_size=2, seq_length=16) == 3 * 2 * 16 * 159744


def test_flops_use_the_given_seq_length_and_padded_vocab():
    config = llama_config(vocab_size=384, tokenizer_vocab_size=300)
    per_token_32 = flops_per_iteration(config, 1, 32) / 32
    per_token_16 = flops_per_iteration(config, 1, 16) / 16
    assert per_token_32 - per_token_16 == 3 * 2 * (2 * 16 * 4 * 16)  # attention grows with s
    assert per_token_16 - flops_per_iteration(llama_config(), 1, 16) / 16 == 3 * 2 * 64 * (384 - 256)


def test_recompute_counts_only_as_hardware_flops():
    full, selective, none = (llama_config(recompute_granularity=g) for g in ("full", "selective", None))
    model = flops_per_iteration(none, 1, 16)
    assert flops_per_iteration(full, 1, 16) == flops_per_iteration(selective, 1, 16) == model
    layers_forward = 16 * 2 * (16384 + 8192 + 36864 + 2048)
    assert flops_per_iteration(full, 1, 16, include_recompute=True) == model + layers_forward
    # --recompute-method block 1 at PP 1: one of the two layers is rebuilt
    assert flops_per_iteration(full, 1, 16, include_recompute=True, recomputed_layers=1) == model + layers_forward / 2
    assert flops_per_iteration(selective, 1, 16, include_recompute=True) == model + 16 * 2 * 2048


def test_moe_flops_count_the_active_experts_by_hand():
    # 3 layers, layer 1 dense (--moe-layer-freq); 8 experts of 32, top-2, a shared expert of 48 with its gate.
    config = llama_config(num_layers=3, num_experts=8, moe_ffn_hidden_size=32, moe_router_topk=2,
                          moe_layer_freq="[1,0,1]", moe_shared_expert_intermediate_size=48,
                          moe_shared_expert_gate=True)
    attention_part = 16384 + 8192 + 2048  # qkv, proj, causal attention as in the GQA hand count
    dense_mlp = 36864
    router = 2 * 64 * 8                   # 1024: the gate's logits for all 8 experts
    routed = 2 * (2 * 64 * 32 * 2 + 2 * 32 * 64)  # 24576: two experts of 32, SwiGLU
    shared = 2 * 64 * 48 * 2 + 2 * 48 * 64        # 18432
    gate = 2 * 64                         # 128: sigmoid(x w)
    logits = 2 * 64 * 256
    forward_per_token = 3 * attention_part + dense_mlp + 2 * (router + routed + shared + gate) + logits
    assert forward_per_token == 237824
    assert flops_per_iteration(config, global_batch_size=2, seq_length=16) == 3 * 2 * 16 * 237824
    # As with dense models, 6 x the active matmul parameters + attention (norm weights aside).
    active = num_parameters(config, active=True) - 256 * 64
    assert active == (3 * (16384 + 8192) + dense_mlp + 2 * (router + routed + shared + gate) + logits) // 2 + 7 * 64
    assert num_parameters(config) - num_parameters(config, active=True) == 2 * 6 * 3 * 64 * 32  # 6 idle experts


def test_big_model_is_six_n_plus_attention():
    config = model_config_from_preset("llama2-7b")
    seq, tokens = 4096, 4096 * 8
    attention = 6 * config.num_layers * seq * config.hidden_size  # 3 x causal 2·s·a·d, a·d = h
    flops = flops_per_iteration(config, 8, seq)
    # The embedding lookup does no matmul: without it, 6N is exact up to the norm weights.
    matmul_params = num_parameters(config) - config.vocab_size * config.hidden_size
    assert flops == pytest.approx(6 * matmul_params * tokens + attention * tokens, rel=1e-4)
    # The rule of thumb with every parameter is within a few percent for a 7B model.
    assert flops == pytest.approx(6 * num_parameters(config) * tokens + attention * tokens, rel=0.03)


# ----------------------------------------------------------------------------- peaks


@pytest.mark.parametrize("name, dtype, tflops", [
    ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.5),
    ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
    ("NVIDIA H100 NVL", torch.float16, 835.5),
    ("NVIDIA H200", torch.bfloat16, 989.5),
    ("NVIDIA H200 NVL", torch.bfloat16, 835.5),
    ("NVIDIA A100-SXM4-80GB", torch.bfloat16, 312.0),
    ("NVIDIA A100 80GB PCIe", torch.float32, 19.5),
    ("NVIDIA A10G", torch.bfloat16, 70.0),
    ("NVIDIA A10", torch.bfloat16, 125.0),
    ("NVIDIA L4", torch.bfloat16, 121.0),
    ("NVIDIA L40S", torch.bfloat16, 362.05),
    ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2),
    ("Tesla V100-SXM2-16GB", torch.float16, 125.0),
    ("Tesla V100-PCIE-32GB", torch.float16, 112.0),
])
def test_peak_table_lookup_by_device_name(name, dtype, tflops):
    value, source = gpu_peak_flops(name, dtype)
    assert value == pytest.approx(tflops * 1e12)
    assert source.startswith(f"{name}: {tflops:g} TFLOP/s dense ")


def test_fp32_uses_the_tf32_peak_only_when_tf32_is_on():
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=True)[0] == pytest.approx(156e12)
    assert gpu_peak_flops("NVIDIA A100-SXM4-40GB", torch.float32, tf32=False)[0] == pytest.approx(19.5e12)
    assert gpu_peak_flops("Tesla V100-SXM2-16GB", torch.float32, tf32=True)[0] == pytest.approx(15.7e12)


@pytest.mark.parametrize("name, dtype", [
    ("NVIDIA B300 Mystery", torch.bfloat16),       # not in the table
    ("NVIDIA GeForce RTX 4090 D", torch.bfloat16),  # a smaller chip under a listed name
    ("NVIDIA H100", torch.bfloat16),                # which H100 is not said
    ("Tesla V100-SXM2-16GB", torch.bfloat16),       # no bf16 units
])
def test_unknown_peaks_are_none_never_guessed(name, dtype):
    value, source = gpu_peak_flops(name, dtype)
    assert value is None and "MFU unknown" in source


def test_family_words_do_not_match_inside_other_names():
    assert find_gpu_peak("NVIDIA A100-SXM4-80GB").words == ("A100",)
    assert find_gpu_peak("NVIDIA L40").words == ("L40",)
    assert find_gpu_peak("NVIDIA L4").words == ("L4",)


def test_cpu_peak_is_measured_and_says_so():
    value, source = peak_flops("cpu", torch.float32, cpu_matmul_size=64, cpu_seconds=0.01)
    assert value > 0
    assert source.startswith("CPU peak measured by a 64^3 fp32 matmul at startup on ")
    assert "GFLOP/s" in source
