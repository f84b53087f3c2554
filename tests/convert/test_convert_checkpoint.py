"""tools/convert_checkpoint.py: megalite checkpoints <-> Hugging Face folders that `transformers` loads.

Every HF model here is loaded from a local folder (local_files_only): folders written by
to-hf, and small random models `transformers` builds and saves itself for from-hf.
"""

import glob
import json
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from megalite import checkpoint
from megalite.arguments import parse_args
from megalite.config import ModelConfig
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.data.tokenizer import build_tokenizer, train_sentencepiece
from megalite.errors import UserError
from megalite.run.generation import generate
from megalite.convert import model_fields_from_hf, sentencepiece_to_tokenizers
from megalite.model.gpt import build_model
from megalite.run.data import build_datasets
from tests.helpers.convert import LLAMA_CONFIG, hf_tensors, load_hf, save_random_hf, train
from tools.convert_checkpoint import main as convert
from tools.generate import load_model

transformers = pytest.importorskip("transformers")  # megalite imports it only where it converts

ATOL = 1e-4
STDLIB = os.path.dirname(os.__file__)
TINY = ["--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--lr", "1e-2",
        "--init-method-std", "0.1", "--eval-interval", "0", "--eval-iters", "0", "--log-interval", "1",
        "--hidden-dropout", "0", "--attention-dropout", "0", "--fp32"]  # fp32 also where bf16 is the default
MOCK = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99"]
LLAMA_GQA = ["--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "96"]  # tiny: untied
# tied output, biases, LayerNorm, GELU, learned positions
GPT2 = ["--model", "gpt2-124m", "--max-position-embeddings", "64", "--ffn-hidden-size", "256"]


def compare_with_hf(run_folder, hf_folder) -> float:
    """Max |logit difference| of the checkpoint and the HF folder on random tokens (fp32);
    asserts it is within ATOL and that greedy generation of 20 tokens is identical."""
    ours, _ = load_model(str(run_folder), None)
    theirs = load_hf(hf_folder)
    config = ours.config
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, config.real_vocab_size, (2, config.seq_length), generator=generator)
    with torch.no_grad():
        logits, hf_logits = ours.logits(ours(tokens)), theirs(tokens).logits
    assert logits.shape == hf_logits.shape == (2, config.seq_length, config.real_vocab_size)
    difference = (logits - hf_logits).abs().max().item()
    print(f"{type(theirs).__name__}: max |logit difference| {difference:.2e}")
    assert difference <= ATOL
    assert logits.std() > 0.1  # weights large enough for a real comparison
    prompt = tokens[0, :8].tolist()
    expected = generate(ours, prompt, 20, temperature=0)  # all 20: no stop at the end-of-document id
    theirs.generation_config.eos_token_id = None
    hf_ids = theirs.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False)[0].tolist()
    assert hf_ids == expected and len(expected) == 28
    return difference


# -- to-hf from trained runs ----------------------------------------------------------------------


@pytest.mark.slow
def test_llama_trained_at_tp2_pp2_exports_logits_and_greedy_tokens_of_megalite(tmp_path, capsys):
    """GQA, untied output, rope, SwiGLU: trained by 4 processes, exported from their pieces."""
    train(tmp_path / "run", [*MOCK, *TINY, *LLAMA_GQA, "--tensor-model-parallel-size", "2",
                             "--pipeline-model-parallel-size", "2"], processes=4)
    convert(["to-hf", "--load", str(tmp_path / "run"), "--save", str(tmp_path / "hf")])
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["num_key_value_heads"] == 2
    assert config["vocab_size"] == 100 and not config["tie_word_embeddings"]  # padding (256 at TP=2) dropped
    difference = compare_with_hf(tmp_path / "run", tmp_path / "hf")
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert tokenizer("5 17 99")["input_ids"] == [5, 17, 99] and tokenizer.eos_token_id == 99
    # Back again: the import records the folder's tokenizer, which the next export re-saves.
    convert(["from-hf", "--load", str(tmp_path / "hf"), "--save", str(tmp_path / "back")])
    assert "--tokenizer-type HuggingFaceTokenizer --tokenizer-model" in capsys.readouterr().out
    convert(["to-hf", "--load", str(tmp_path / "back"), "--save", str(tmp_path / "hf2")])
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf2", local_files_only=True)
    assert tokenizer("5 17 99")["input_ids"] == [5, 17, 99]
    again = hf_tensors(tmp_path / "hf2")
    assert all(torch.equal(tensor, again[name]) for name, tensor in hf_tensors(tmp_path / "hf").items())
    print(f"TP=2 x PP=2 LLaMA: max |logit difference| {difference:.2e}")


@pytest.fixture(scope="module")
def sentencepiece_data(tmp_path_factory):
    """A SentencePiece model (vocab 400) and token files made from some stdlib sources."""
    folder = tmp_path_factory.mktemp("sp")
    texts = [open(path).read() for path in sorted(glob.glob(os.path.join(STDLIB, "json", "*.py")))]
    model = train_sentencepiece(texts, str(folder / "sp"), vocab_size=400)["model"]
    tokenizer = build_tokenizer("SentencePieceTokenizer", model)
    with IndexedDatasetBuilder(str(folder / "data_text_document"), np.uint16) as builder:
        for text in texts:
            builder.add_document(tokenizer.tokenize(text) + [tokenizer.eod])
    return model, str(folder / "data_text_document"), texts


@pytest.mark.slow
def test_gpt2_exports_its_sentencepiece_tokenizer_for_auto_tokenizer(tmp_path, sentencepiece_data):
    model, prefix, texts = sentencepiece_data
    train(tmp_path / "run", [*GPT2, *TINY, "--num-layers", "2", "--data-path", prefix, "--split", "1,0,0",
                             "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model])
    convert(["to-hf", "--load", str(tmp_path / "run"), "--save", str(tmp_path / "hf")])
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["architectures"] == ["GPT2LMHeadModel"]
    compare_with_hf(tmp_path / "run", tmp_path / "hf")
    ours = build_tokenizer("SentencePieceTokenizer", model)
    theirs = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf", local_files_only=True)
    assert len(theirs) == 400 and theirs.eos_token_id == ours.eod
    for text in [texts[0][:3000], "  two  spaces\tand a tab\n\nü ✓ 中 12345", ""]:
        ids = ours.tokenize(text)
        assert theirs(text)["input_ids"] == ids
        assert theirs.decode(ids) == text


@pytest.mark.slow
@pytest.mark.parametrize("flags", [
    [*GPT2, "--untie-embeddings-and-output-weights"],
    ["--model", "gpt2-124m", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
     "--ffn-hidden-size", "96"],  # LLaMA-style with tied output and biases on every linear layer
    [*LLAMA_GQA, "--add-qkv-bias"],  # Qwen2: the trained QKV bias
    [*LLAMA_GQA, "--qk-layernorm", "--kv-channels", "32"],  # Qwen3: the trained q/k norms
], ids=["gpt2-untied", "llama-tied-with-biases", "qwen2", "qwen3"])
def test_other_model_kinds_export_exactly(tmp_path, flags):
    train(tmp_path / "run", [*MOCK, *TINY, "--num-layers", "2", *flags])
    convert(["to-hf", "--load", str(tmp_path / "run"), "--save", str(tmp_path / "hf"), "--max-shard-size", "40KB"])
    files = {}
    for name, file in json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())["weight_map"].items():
        files.setdefault(file, []).append(name)
    assert len(files) > 2  # sharded: each file within the limit, or one tensor larger than it
    assert all(os.path.getsize(tmp_path / "hf" / file) < 42_000 or len(names) == 1 for file, names in files.items())
    compare_with_hf(tmp_path / "run", tmp_path / "hf")


# -- from-hf --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_llama(tmp_path_factory):
    """A random LLaMA (GQA, untied, bf16) saved by transformers in several shards."""
    config = transformers.LlamaConfig(vocab_size=100, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      rope_theta=50000.0, rms_norm_eps=1e-6, initializer_range=0.1,
                                      tie_word_embeddings=False)
    return save_random_hf(config, 0, tmp_path_factory.mktemp("llama"), torch.bfloat16, max_shard_size="60KB")


@pytest.fixture(scope="module")
def hf_llama_tied_with_biases(tmp_path_factory):
    """A random LLaMA with multi-head attention, tied embeddings and biases on every projection (fp32)."""
    config = transformers.LlamaConfig(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=32, attention_bias=True,
                                      mlp_bias=True, tie_word_embeddings=True, initializer_range=0.1)
    return save_random_hf(config, 2, tmp_path_factory.mktemp("llama-tied"))


@pytest.fixture(scope="module")
def hf_gpt2(tmp_path_factory):
    """A random tied GPT-2 (fp32) in one file."""
    config = transformers.GPT2Config(vocab_size=90, n_positions=48, n_embd=32, n_layer=2, n_head=4,
                                     initializer_range=0.1, bos_token_id=None, eos_token_id=None)
    return save_random_hf(config, 1, tmp_path_factory.mktemp("gpt2"))


@pytest.fixture(scope="module")
def hf_qwen2(tmp_path_factory):
    """A random tied Qwen2 (biases on q/k/v only, GQA, fp32)."""
    config = transformers.Qwen2Config(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      tie_word_embeddings=True, initializer_range=0.1)
    return save_random_hf(config, 3, tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="module")
def hf_qwen3(tmp_path_factory):
    """A random untied Qwen3 (per-head q/k norms, head size 16 != hidden / heads, GQA, bf16)."""
    config = transformers.Qwen3Config(vocab_size=80, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=32, tie_word_embeddings=False, initializer_range=0.1)
    return save_random_hf(config, 4, tmp_path_factory.mktemp("qwen3"), torch.bfloat16)


@pytest.mark.parametrize("which", ["hf_llama", "hf_llama_tied_with_biases", "hf_gpt2", "hf_qwen2", "hf_qwen3"])
def test_from_hf_then_to_hf_reproduces_every_tensor_bit_for_bit(tmp_path, request, which, capsys):
    source = request.getfixturevalue(which)
    sharded = os.path.exists(os.path.join(source, "model.safetensors.index.json"))
    assert sharded == (which == "hf_llama")  # both ways of storing weights are read
    convert(["from-hf", "--load", source, "--save", str(tmp_path / "ckpt"), "--tensor-model-parallel-size", "2"])
    printed = capsys.readouterr().out
    metadata = checkpoint.read_metadata(checkpoint.resolve_checkpoint(str(tmp_path / "ckpt")))
    assert metadata["iteration"] == 0 and " ".join(metadata["extra"]["model_flags"]) in printed
    convert(["to-hf", "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "hf"), "--skip-tokenizer"])
    original, exported = hf_tensors(source), hf_tensors(tmp_path / "hf")
    assert sorted(original) == sorted(exported)
    for name, tensor in original.items():
        assert exported[name].dtype == tensor.dtype and torch.equal(exported[name], tensor), name
    before = json.loads(open(os.path.join(source, "config.json")).read())
    after = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert model_fields_from_hf(before).fields == model_fields_from_hf(after).fields
    # The imported model computes what the HF model computes.
    compare_with_hf(tmp_path / "ckpt", source)


@pytest.mark.slow
def test_from_hf_continues_at_tp2_starting_from_the_hf_models_loss(tmp_path, hf_llama):
    convert(["from-hf", "--load", hf_llama, "--save", str(tmp_path / "ckpt"), "--tensor-model-parallel-size", "2",
             "--seq-length", "32"])
    metadata = checkpoint.read_metadata(checkpoint.resolve_checkpoint(str(tmp_path / "ckpt")))
    flags = [*metadata["extra"]["model_flags"], *MOCK, "--tensor-model-parallel-size", "2",
             "--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "3", "--eval-interval", "0",
             "--eval-iters", "0", "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0"]
    train(tmp_path / "run", [*flags, "--load", str(tmp_path / "ckpt"), "--finetune"], processes=2)
    losses = [json.loads(line)["lm_loss"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
              if '"split"' not in line]
    assert len(losses) == 3 and losses[2] < losses[0]

    # The first global batch megalite saw, rebuilt from the same flags, through the HF model.
    run = parse_args([*flags, "--data-cache-path", str(tmp_path / "run" / "cache")], world_size=2)
    tokenizer = build_tokenizer(run.data.tokenizer_type, run.data.tokenizer_model, run.data.vocab_size)
    run = run.with_tokenizer_vocab(tokenizer.vocab_size)  # TP 2, from the flags
    train_set = build_datasets(run, tokenizer)[0]
    batch = {key: torch.stack([torch.as_tensor(train_set[i][key]) for i in range(4)]) for key in ("tokens", "labels",
                                                                                                  "loss_mask")}
    model = load_hf(hf_llama)
    with torch.no_grad():
        logits = model(batch["tokens"]).logits
    per_token = F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), reduction="none")
    mask = batch["loss_mask"].flatten().float()
    hf_loss = float((per_token * mask).sum() / mask.sum())
    print(f"first loss at TP=2 {losses[0]:.7f}, the HF model's on that batch {hf_loss:.7f}")
    assert abs(losses[0] - hf_loss) <= 1e-4
    assert abs(hf_loss - np.log(100)) > 0.1  # a real model, not a uniform guess


# -- errors ---------------------------------------------------------------------------------------




@pytest.mark.parametrize("change, message", [
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}},
     "field 'rope_parameters' has rope type 'yarn'"),
    ({"rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}},
     "field 'rope_scaling' has rope type 'linear'"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 2.0}},
     "has low_freq_factor 2.0"),
    ({"architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 16},
     "field 'sliding_window' is 16"),
    ({"attention_bias": True}, "fields 'attention_bias' (True) and 'mlp_bias' (False) differ"),
    ({"hidden_act": "gelu"}, "field 'hidden_act' is 'gelu'"),
    ({"architectures": ["OlmoeForCausalLM"], "model_type": "olmoe"}, "OLMo models normalise q and k across all heads"),
    ({"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": True},
     "Qwen3 then has biases on q/k/v/o"),
    ({"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}, "'DeepseekV3ForCausalLM', which"),
    ({"quantization_config": {"bits": 4}}, "field 'quantization_config' is set"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "field 'partial_rotary_factor' is 0.5"),
    ({"partial_rotary_factor": 0.25}, "field 'partial_rotary_factor' is 0.25"),
])
def test_unsupported_hf_configs_are_refused_naming_the_field(change, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        model_fields_from_hf({**LLAMA_CONFIG, **change})


def test_supported_variants_of_hf_configs_import():
    llama3 = model_fields_from_hf({**LLAMA_CONFIG, "rope_parameters": None, "rope_theta": 5e5, "rope_scaling": {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}}).fields  # transformers 4.x fields
    assert llama3["use_rope_scaling"] and llama3["rope_scaling_factor"] == 32.0 and llama3["rotary_base"] == 5e5
    mistral = model_fields_from_hf({**LLAMA_CONFIG, "architectures": ["MistralForCausalLM"], "sliding_window": None,
                                    "head_dim": 32})
    assert mistral.architecture == "LlamaForCausalLM" and mistral.fields["kv_channels"] == 32
    # Qwen's window is off unless use_sliding_window; Qwen3Config's head size defaults to 128.
    qwen2 = model_fields_from_hf({**LLAMA_CONFIG, "architectures": ["Qwen2ForCausalLM"], "sliding_window": 16,
                                  "use_sliding_window": False})
    assert qwen2.architecture == "Qwen2ForCausalLM" and qwen2.fields["add_qkv_bias"]
    assert not qwen2.fields["add_bias_linear"] and not qwen2.fields["qk_layernorm"]
    qwen3 = model_fields_from_hf({**LLAMA_CONFIG, "model_type": "qwen3", "architectures": None})
    assert qwen3.architecture == "Qwen3ForCausalLM" and qwen3.fields["qk_layernorm"]
    assert qwen3.fields["kv_channels"] == 128 and not qwen3.fields["add_qkv_bias"]


def test_cli_errors_are_one_sentence(tmp_path, hf_llama, capsys):
    with pytest.raises(UserError, match="--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"):
        convert(["from-hf", "--load", hf_llama, "--save", str(tmp_path / "a"), "--tensor-model-parallel-size", "4"])
    with pytest.raises(UserError, match="--num-layers 2 .*--pipeline-model-parallel-size"):
        convert(["from-hf", "--load", hf_llama, "--save", str(tmp_path / "b"), "--pipeline-model-parallel-size", "4"])
    (tmp_path / "pickled").mkdir()
    (tmp_path / "pickled" / "config.json").write_text(json.dumps(LLAMA_CONFIG))
    (tmp_path / "pickled" / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(UserError, match="it has pytorch_model.bin, a pickle"):
        convert(["from-hf", "--load", str(tmp_path / "pickled"), "--save", str(tmp_path / "c")])
    # A model no transformers class computes: LayerNorm with rope.
    config = ModelConfig.of(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
                            position_embedding_type="rope", hidden_dropout=0.0, attention_dropout=0.0)
    checkpoint.save_checkpoint(str(tmp_path / "odd"), 1, build_model(config, seed=0), consumed_samples=0,
                                  model_config=config)
    with pytest.raises(UserError, match="no transformers architecture computes this model"):
        convert(["to-hf", "--load", str(tmp_path / "odd"), "--save", str(tmp_path / "d")])


def test_unused_hf_tensors_are_refused(tmp_path, hf_gpt2):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "extra"
    folder.mkdir()
    (folder / "config.json").write_text(open(os.path.join(hf_gpt2, "config.json")).read())
    tensors = load_file(os.path.join(hf_gpt2, "model.safetensors"))
    save_file({**tensors, "transformer.h.0.attn.q_norm.weight": torch.ones(8)}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(UserError, match="does not use \\(transformer.h.0.attn.q_norm.weight\\)"):
        convert(["from-hf", "--load", str(folder), "--save", str(tmp_path / "ckpt")])


# -- tokenizers -----------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type, symbols", [("bpe", []), ("unigram", ["<tool>", "json"])])
def test_sentencepiece_models_with_default_normalisation_convert_exactly(tmp_path, model_type, symbols):
    """Besides megalite's own models (identity, no dummy prefix): NFKC, dummy prefix, extra
    whitespace removal, unigram models and user-defined symbols, as in many published tokenizers."""
    import sentencepiece

    texts = [open(path).read() for path in sorted(glob.glob(os.path.join(STDLIB, "json", "*.py")))]
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(line for text in texts for line in text.splitlines() if line.strip()),
        model_prefix=str(tmp_path / "sp"), vocab_size=400, model_type=model_type, byte_fallback=True,
        user_defined_symbols=symbols, minloglevel=2, num_threads=1)
    path = str(tmp_path / "sp.model")
    processor = sentencepiece.SentencePieceProcessor(model_file=path)
    converted, special = sentencepiece_to_tokenizers(path)
    assert special == {"unk_token": "<unk>", "bos_token": "<s>", "eos_token": "</s>"}
    for text in [texts[1][:4000], "  leading,  double  and trailing spaces  ", "ｆｕｌｌ ｗｉｄｔｈ ①",
                 "ü ✓ 中", "<tool> import json"]:
        assert converted.encode(text).ids == processor.encode(text), text
        assert converted.decode(processor.encode(text)) == processor.decode(processor.encode(text))


def test_a_partial_rotary_model_is_refused_by_the_export():
    """HF's LlamaForCausalLM rotates whole heads: a --rotary-percent 0.5 model has no HF counterpart."""
    from megalite.convert.configs import hf_architecture

    llama = dict(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
                 position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    assert hf_architecture(ModelConfig.of(**llama)) == "LlamaForCausalLM"
    with pytest.raises(UserError, match=r"rotates 4 of each head's 8 channels \(--rotary-percent 0.5\).*"
                                        r"--rotary-percent 1.0 to export"):
        hf_architecture(ModelConfig.of(**llama, rotary_percent=0.5))


def test_qkv_bias_and_qk_norms_export_only_as_a_qwen_computes_them():
    from megalite.convert.configs import hf_architecture

    llama = dict(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64,
                 position_embedding_type="rope", normalization="RMSNorm", swiglu=True)
    assert hf_architecture(ModelConfig.of(**llama, add_bias_linear=False, add_qkv_bias=True)) == "Qwen2ForCausalLM"
    assert hf_architecture(ModelConfig.of(**llama, add_qkv_bias=True)) == "LlamaForCausalLM"  # biases everywhere
    assert hf_architecture(ModelConfig.of(**llama, add_bias_linear=False, qk_layernorm=True)) == "Qwen3ForCausalLM"
    for extra in [dict(add_bias_linear=False, add_qkv_bias=True), dict()]:
        with pytest.raises(UserError, match="Qwen3ForCausalLM, the transformers class with q/k norms .* has no biases"):
            hf_architecture(ModelConfig.of(**llama, qk_layernorm=True, **extra))
    gpt2 = dict(num_layers=1, hidden_size=32, num_attention_heads=4, seq_length=8, vocab_size=64)
    with pytest.raises(UserError, match="GPT-2 has neither"):
        hf_architecture(ModelConfig.of(**gpt2, qk_layernorm=True))
