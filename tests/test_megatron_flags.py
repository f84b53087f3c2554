"""Megatron-LM's own launch scripts run unchanged apart from paths: the flag sets of
examples/gpt3/train_gpt3_175b_distributed.sh (TP8 PP16, with --rampup-batch-size), examples/llama/
train_llama3_8b_h100_fp8.sh and train_llama32_1b_h100_fp8.sh (minus their FP8 group) pass the parser
and the dry run; with the FP8 group, context parallelism or experts they stop with one sentence. So do the MoE
flag sets of examples/mixtral/train_mixtral_8x7b_distributed.sh and the Qwen3-30B-A3B model flags of
examples/post_training/modelopt/conf/qwen/ (minus expert parallelism and --moe-layer-recompute)."""

import importlib.util
import json
import shlex

import numpy as np
import pytest

import pretrain_gpt
from megalite.arguments import parse_args
from megalite.config import MODEL_PRESETS, ModelConfig
from megalite.data.indexed_dataset import IndexedDatasetBuilder
from megalite.errors import UserError
from megalite.plan.dry_run import dry_run, plan

GPT3_175B = """
--num-layers 96 --hidden-size 12288 --num-attention-heads 96 --seq-length 2048 --max-position-embeddings 2048
--attention-backend auto
--micro-batch-size 1 --global-batch-size 1536 --rampup-batch-size 16 16 5859375 --train-iters 500000
--weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.006 --clip-grad 1.0 --fp16
--lr 6.0e-5 --lr-decay-style cosine --min-lr 6.0e-6 --lr-warmup-fraction .001 --lr-decay-iters 430000
--tensor-model-parallel-size 8 --pipeline-model-parallel-size 16
--data-path {data} --vocab-file {vocab} --merge-file {merges} --split 949,50,1
--log-interval 100 --save-interval 10000 --eval-interval 1000 --save {ckpt} --load {ckpt} --eval-iters 10
--tensorboard-dir {tb}
"""

LLAMA3_MODEL = """
--use-mcore-models --num-layers {layers} --hidden-size {hidden} --ffn-hidden-size {ffn} --num-attention-heads 32
--group-query-attention --num-query-groups 8 --kv-channels 128 --seq-length 8192 --max-position-embeddings 8192
--position-embedding-type rope --rotary-base {base} --rotary-percent 1.0 --attention-dropout 0.0 --hidden-dropout 0.0
--swiglu {norm} --init-method-std 0.0134 --attention-backend fused --apply-layernorm-1p
--untie-embeddings-and-output-weights --disable-bias-linear
"""

LLAMA3_TRAIN_TAIL = """
--lr 0.00015 --min-lr 0.00001 --decoupled-lr 5.0e-4 --decoupled-min-lr 4.5e-5 --lr-decay-style cosine
--clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --bf16 --grad-reduce-in-bf16
--cross-entropy-loss-fusion --calculate-per-token-loss --manual-gc --empty-unused-memory-level 1
--exit-duration-in-mins 235
--tensor-model-parallel-size {tp} --context-parallel-size 1 --sequence-parallel
--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
--data-path {data} --tokenizer-type HuggingFaceTokenizer --tokenizer-model {hf}
--data-cache-path {cache} --split 99,1,0 --no-create-attention-mask-in-dataloader --no-mmap-bin-files
--num-workers 1 --vocab-size 128256
--log-interval 1 --eval-iters 32 --eval-interval 100 --save-interval 1000 --log-throughput
--ckpt-format torch_dist --distributed-timeout-minutes 60 --save {ckpt} --tensorboard-dir {tb}
"""

LLAMA3_8B = (LLAMA3_MODEL.format(layers=32, hidden=4096, ffn=14336, base=1000000, norm="--normalization RMSNorm")
             + "--micro-batch-size 1 --global-batch-size 128 --train-samples 1953125000 "
               "--lr-decay-samples 1949218748 --lr-warmup-samples 3906252"
             + LLAMA3_TRAIN_TAIL.replace("{tp}", "1")
             + "--profile --profile-step-start 4 --profile-step-end 6 --load {ckpt}")

LLAMA32_1B = (LLAMA3_MODEL.format(layers=16, hidden=2048, ffn=8192, base=500000, norm="")
              + "--transformer-impl local --micro-batch-size 1 --global-batch-size 128 --train-iters 369844 "
                "--lr-decay-iters 369103 --lr-warmup-iters 740 --use-checkpoint-opt_param-scheduler"
              + LLAMA3_TRAIN_TAIL.replace("{tp}", "4") + "--pipeline-model-parallel-size 1")

FP8 = "--fp8-format hybrid --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --fp8-param-gather"

# (name, flag set, world size): the scripts' layouts
SCRIPTS = [("gpt3-175b", GPT3_175B, 128), ("llama3-8b", LLAMA3_8B, 8), ("llama3.2-1b", LLAMA32_1B, 8)]

# examples/mixtral/train_mixtral_8x7b_distributed.sh, whose PP 4 runs on 4 nodes of 8 GPUs at EP 8.
MIXTRAL_8X7B = """
--use-mcore-models --disable-bias-linear --seq-length 4096 --max-position-embeddings 32768 --num-layers 32
--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --init-method-std 0.01 --attention-dropout 0.0
--hidden-dropout 0.0 --normalization RMSNorm --position-embedding-type rope --swiglu
--untie-embeddings-and-output-weights --group-query-attention --num-query-groups 8 --no-masked-softmax-fusion
--no-position-embedding --rotary-base 1000000
--num-experts 8 --moe-router-topk 2 --moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2
--moe-grouped-gemm --moe-token-dispatcher-type alltoall --overlap-param-gather --overlap-grad-reduce
--tokenizer-type Llama2Tokenizer --tokenizer-model {ckpt}/tokenizer.model --data-path {data} --split 99990,8,2
--micro-batch-size 1 --global-batch-size 256 --lr 1e-4 --train-iters 500000 --lr-decay-iters 320000
--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 0.1 --lr-warmup-iters 500 --clip-grad 1.0 --bf16
--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --use-distributed-optimizer --sequence-parallel
--log-interval 1 --save-interval 10000 --eval-interval 1000 --eval-iters 10 --save {ckpt} --load {ckpt}
--tensorboard-dir {tb} --no-load-optim --no-load-rng --expert-model-parallel-size 8
"""

# examples/post_training/modelopt/conf/qwen/Qwen3-30B-A3B.sh (model flags only; data and batch added here),
# without its --moe-layer-recompute (QWEN3_RECOMPUTE), which megalite refuses: it recomputes whole layers.
QWEN3_30B_A3B = """
--save-interval 100000 --micro-batch-size 1 --bf16 --no-masked-softmax-fusion --disable-bias-linear
--untie-embeddings-and-output-weights --position-embedding-type rope --no-rope-fusion --normalization RMSNorm
--swiglu --num-layers 48 --hidden-size 2048 --ffn-hidden-size 6144 --num-attention-heads 32 --group-query-attention
--num-query-groups 4 --kv-channels 128 --qk-layernorm --num-experts 128 --moe-ffn-hidden-size 768
--moe-router-topk 8 --moe-router-dtype fp32 --moe-aux-loss-coeff 1e-3 --moe-token-dispatcher-type alltoall
--moe-router-load-balancing-type aux_loss --seq-length 4096 --max-position-embeddings 40960
--tokenizer-type HuggingFaceTokenizer --make-vocab-size-divisible-by 1187 --use-mcore-models --rotary-percent 1.0
--rotary-base 1000000 --no-bias-swiglu-fusion --sequence-parallel
--tokenizer-model {hf} --data-path {data} --global-batch-size 64 --train-iters 100 --save {ckpt}
"""
QWEN3_RECOMPUTE = "--moe-layer-recompute"
MOE_SCRIPTS = [("mixtral-8x7b", MIXTRAL_8X7B, 32), ("qwen3-30b-a3b", QWEN3_30B_A3B, 8)]

def _gpt2_bpe_files(folder) -> tuple[str, str]:
    """A byte-level GPT-2 vocabulary (the 256 byte symbols, two merges, <|endoftext|>) and its merges."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    symbols, extra = [], 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + extra))
            extra += 1
    vocab = {symbol: i for i, symbol in enumerate(symbols)}
    vocab.update({"Ġt": 256, "Ġth": 257, "<|endoftext|>": 258})
    vocab_file, merge_file = folder / "gpt2-vocab.json", folder / "gpt2-merges.txt"
    vocab_file.write_text(json.dumps(vocab))
    merge_file.write_text("#version: 0.2\nĠ t\nĠt h\n")
    return str(vocab_file), str(merge_file)


def _hf_tokenizer(folder) -> str:
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    model = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>"))
    model.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    model.train_from_iterator(["the quick brown fox jumps over the lazy dog"] * 20, trainer)
    transformers.PreTrainedTokenizerFast(tokenizer_object=model, unk_token="<unk>", bos_token="<s>",
                                         eos_token="</s>").save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    """The scripts' paths, replaced by local files."""
    root = tmp_path_factory.mktemp("megatron_scripts")
    with IndexedDatasetBuilder(str(root / "corpus_text_document"), np.uint16) as builder:
        for _ in range(8):
            builder.add_document(np.arange(1, 200) % 250)
    vocab, merges = _gpt2_bpe_files(root)
    return dict(data=str(root / "corpus_text_document"), vocab=vocab, merges=merges, ckpt=str(root / "ckpt"),
                tb=str(root / "tb"), cache=str(root / "cache"), hf=_hf_tokenizer(root / "hf"))


def _argv(flag_set: str, paths: dict) -> list[str]:
    """The flag set as a command line, without --tensorboard-dir where tensorboard is not installed (refused
    with its own sentence)."""
    drop = ["--tensorboard-dir"] if importlib.util.find_spec("tensorboard") is None else []
    argv, skipping = [], False
    for word in shlex.split(flag_set.format(**paths)):
        if word.startswith("--"):
            skipping = word in drop
        if not skipping:
            argv.append(word)
    return argv


@pytest.mark.parametrize("name, flag_set, world_size", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_megatron_example_scripts_pass_the_parser_and_the_dry_run(name, flag_set, world_size, paths, capsys):
    argv = _argv(flag_set, paths) + ["--dry-run", "--world-size", str(world_size)]
    pretrain_gpt.main(argv)
    out = capsys.readouterr().out
    assert out.count("accepted without effect") == 1  # the one start-up line naming the accepted flags
    assert "--attention-backend" in out
    if name == "gpt3-175b":  # planned with the GPT-2 BPE files' vocabulary, not a preset's
        assert f"from --vocab-file {paths['vocab']}" in out


def test_the_scripts_mean_what_megatron_means(paths):
    gpt3 = parse_args(_argv(GPT3_175B, paths), 128)
    assert gpt3.model.query_groups == 96  # a head count without groups: multi-head attention
    assert (gpt3.parallel.tensor_model_parallel_size, gpt3.parallel.pipeline_model_parallel_size) == (8, 16)
    assert gpt3.data.split == "949,50,1" and gpt3.train.lr_warmup_iters == 430  # .001 x 430000
    llama = parse_args(_argv(LLAMA3_8B, paths), 8)
    train = llama.train
    assert train.train_iters == 1953125000 // 128 and train.lr_schedule_unit == "samples"
    assert (train.lr_warmup_samples, train.lr_decay_samples) == (3906252, 1949218748)
    assert llama.model.apply_layernorm_1p and llama.model.query_groups == 8
    assert not llama.parallel.sequence_parallel  # Megatron turns it off at TP 1
    assert not llama.data.mmap_bin_files and llama.data.num_workers == 1 and llama.data.data_cache_path
    assert llama.with_tokenizer_vocab(300).model.vocab_size == 128256  # --vocab-size bounds the tokenizer's 300
    small = parse_args(_argv(LLAMA32_1B, paths), 8)
    assert small.parallel.sequence_parallel and small.train.lr_schedule_unit == "iterations"


@pytest.mark.parametrize("extra, words", [
    (FP8, ["--fp8-format", "FP8"]),
    ("--context-parallel-size 3", ["--context-parallel-size 3"]),  # a layout that does not divide the world
    ("--expert-model-parallel-size 2 --expert-tensor-parallel-size 1", ["--expert-model-parallel-size 2",
                                                                         "--num-experts"]),
], ids=["fp8", "context-parallel", "expert-parallel-without-experts"])
@pytest.mark.parametrize("name, flag_set, world_size", SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_missing_features_stop_with_one_sentence(name, flag_set, world_size, extra, words, paths):
    argv = _argv(flag_set, paths) + shlex.split(extra) + ["--dry-run", "--world-size", str(world_size)]
    with pytest.raises(UserError) as err:
        pretrain_gpt.main(argv)
    message = str(err.value)
    assert "\n" not in message and "unrecognized arguments" not in message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("name, flag_set, world_size", MOE_SCRIPTS, ids=[s[0] for s in MOE_SCRIPTS])
def test_megatron_moe_scripts_pass_the_parser_and_the_dry_run(name, flag_set, world_size, paths, capsys):
    pretrain_gpt.main(_argv(flag_set, paths) + ["--dry-run", "--world-size", str(world_size)])
    out = capsys.readouterr().out
    assert out.count("accepted without effect") == 1
    run = parse_args(_argv(flag_set, paths), world_size)
    assert run.model.moe_token_dispatcher_type == "alltoall"
    model, preset = run.model, MODEL_PRESETS[name]  # the script's MoE model is the preset's
    for field in ("num_experts", "moe_router_topk", "expert_ffn_hidden_size", "num_layers", "hidden_size",
                  "query_groups", "head_dim", "qk_layernorm", "moe_aux_loss_coeff"):
        assert getattr(model, field) == getattr(ModelConfig.of(**preset), field), field
    assert model.moe_router_load_balancing_type == "aux_loss" and not model.moe_router_pre_softmax


def test_mixtral_8x7b_dry_run_holds_an_eighth_of_the_experts_per_rank_at_ep_8(paths, capsys):
    """The script's layout (world 32 = PP 4 x DP 8, TP 1, EP 8 folded over DP, expert-DP 1): each rank holds
    1 of the 8 experts of its stage's MoE layers, with their whole grads and optimizer state (nothing to share
    them with at expert-DP 1); the dense rest as at EP 1, its optimizer state sharded over DP 8."""
    argv = _argv(MIXTRAL_8X7B, paths) + ["--dry-run", "--world-size", "32"]
    ep8 = dry_run(parse_args(argv, 32))
    print(capsys.readouterr().out)  # the per-rank table (pytest -s shows it)
    all_experts = plan(parse_args(argv + ["--expert-model-parallel-size", "1"], 32))
    for rank in range(32):
        mine, whole = ep8.rank_class(rank), all_experts.rank_class(rank)
        assert mine.expert_params > 0 and mine.expert_params * 8 == whole.expert_params, rank
        assert mine.params - mine.expert_params == whole.params - whole.expert_params, rank
        assert mine.grad_bytes >= 4 * mine.params  # fp32 grads of every parameter, experts included
        # fp32 main params and Adam's moments of its own experts, whole, plus 1/8 of the dense ones'
        dense = mine.params - mine.expert_params
        assert 12 * (mine.expert_params + dense // 8) <= mine.optimizer_bytes < 12 * (mine.expert_params + dense // 7)


def test_llama3_8b_dry_run_at_cp_2_holds_half_the_activations_per_rank(paths, capsys):
    """The script's flags at seq 8192 with --context-parallel-size 2 (world 8 = TP 1 x CP 2 x DP 4): each rank's
    activations are half of CP 1's (world 4 = DP 4: the same DP, the same micro-batches), its model state alike,
    the optimizer state sharded over DP x CP 8 instead of DP 4."""
    argv = _argv(LLAMA3_8B, paths) + ["--dry-run"]
    cp2 = dry_run(parse_args(argv + ["--world-size", "8", "--context-parallel-size", "2"], 8))
    out = capsys.readouterr().out
    print(out)  # the per-rank table (pytest -s shows it)
    # The ring's traffic: K/V (8 key/value heads of 128, 4096 tokens a rank, bf16) forward and backward, one hop
    # each at CP 2, and the fp32 dK/dV accumulator two hops: 96 MiB a layer, x 32 layers x 32 micro-batches.
    per_layer = 2 * 8 * 128 * 4096 * (2 * 2 + 2 * 4)
    assert per_layer == 96 * 2 ** 20
    assert ("context parallel: CP 2, 4096 tokens of each sequence per rank; --cp-comm-type p2p sends 96.0 MiB per rank "
            "per layer and micro-batch (forward + backward), 96.00 GiB per iteration (32 layers x 32 micro-batches") in out
    cp1 = plan(parse_args(argv + ["--world-size", "4"], 4))
    mine, whole = cp2.rank_class(0), cp1.rank_class(0)
    assert mine.params == whole.params and mine.grad_bytes == whole.grad_bytes
    assert mine.activation_bytes * 2 == pytest.approx(whole.activation_bytes, rel=0.01)
    assert mine.optimizer_bytes * 2 == pytest.approx(whole.optimizer_bytes, rel=0.01)


@pytest.mark.parametrize("flag_set, extra, world_size, words", [
    (QWEN3_30B_A3B, QWEN3_RECOMPUTE, 8, ["--moe-layer-recompute", "does not build"]),
], ids=["qwen3-moe-layer-recompute"])
def test_megatron_moe_scripts_stop_with_one_sentence_on_what_is_missing(flag_set, extra, world_size, words, paths):
    with pytest.raises(UserError) as err:
        pretrain_gpt.main(_argv(flag_set, paths) + shlex.split(extra) + ["--dry-run", "--world-size", str(world_size)])
    assert "\n" not in str(err.value) and all(word in str(err.value) for word in words), str(err.value)


def test_no_position_embedding_is_refused_where_the_model_keeps_a_learned_table():
    base = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "99", "--no-position-embedding"]
    assert parse_args([*base, "--position-embedding-type", "rope"]).model.position_embedding_type == "rope"
    with pytest.raises(UserError, match="--no-position-embedding drops Megatron's learned position table"):
        parse_args([*base, "--position-embedding-type", "learned_absolute"])


def test_too_small_vocab_size_for_the_tokenizer_is_refused(paths):
    run = parse_args(["--data-path", paths["data"], "--tokenizer-type", "HuggingFaceTokenizer",
                      "--tokenizer-model", paths["hf"], "--vocab-size", "100"])
    with pytest.raises(UserError, match="the tokenizer has 300 tokens, more than --vocab-size 100"):
        run.with_tokenizer_vocab(300)


def test_gpt2_bpe_tokenizer_from_local_files(paths):
    from megalite.data.tokenizer import build_tokenizer

    tokenizer = build_tokenizer("GPT2BPETokenizer", vocab_file=paths["vocab"], merge_file=paths["merges"])
    assert tokenizer.vocab_size == 259 and tokenizer.eod == 258
    ids = tokenizer.tokenize(" the cat")
    assert ids[0] == 257 and tokenizer.detokenize(ids) == " the cat"  # "t" "h" merged, no special tokens added
    with pytest.raises(UserError, match="--merge-file"):
        build_tokenizer("GPT2BPETokenizer", vocab_file=paths["vocab"])


# -- what the implemented flags do ------------------------------------------------------------------

def test_sample_counted_schedule_matches_megatrons_and_the_iteration_count():
    from megalite.run.lr_schedule import LRSchedule

    by_iterations = LRSchedule(1.0, 0.1, warmup_iters=4, decay_iters=20)
    by_samples = LRSchedule(1.0, 0.1, warmup_iters=4 * 16, decay_iters=20 * 16, unit="samples")
    for iteration in range(25):  # lengths that are whole batches: the two counts agree
        assert by_samples.lr_at(iteration, iteration * 16, 16) == pytest.approx(by_iterations.lr_at(iteration))
    odd = LRSchedule(1.0, 0.0, warmup_iters=40, decay_iters=100, decay_style="linear", unit="samples")
    assert odd.lr_at(0, 0, 16) == pytest.approx(16 / 40) and odd.lr_at(2, 32, 16) == 1.0  # capped at lr
    assert odd.lr_at(4, 64, 16) == pytest.approx(1 - (64 - 40) / 60)  # decays by samples, not iterations


def test_resume_after_raising_train_iters_names_the_flags_that_keep_the_schedule():
    from megalite.run.lr_schedule import LRSchedule

    old = LRSchedule(1e-3, 1e-4, warmup_iters=20, decay_iters=200).state_dict()
    with pytest.raises(UserError) as err:
        LRSchedule(1e-3, 1e-4, warmup_iters=30, decay_iters=300).load_state_dict(old)
    assert "--lr-warmup-iters 20 --lr-decay-iters 200" in str(err.value)
    assert "--use-checkpoint-opt_param-scheduler" in str(err.value)
    LRSchedule(1e-3, 1e-4, warmup_iters=20, decay_iters=200).load_state_dict(old)  # those flags resume cleanly
    assert old["unit"] == "iterations"  # the checkpoint says what its lengths count
    with pytest.raises(UserError, match="counts iterations but this run's counts samples"):
        LRSchedule(1e-3, 1e-4, warmup_iters=20, decay_iters=200, unit="samples").load_state_dict(old)


def test_apply_layernorm_1p_stores_w_minus_one_and_computes_the_same():
    import torch

    from megalite.config import model_config_from_preset
    from megalite.model.transformer import Norm

    for normalization in ("LayerNorm", "RMSNorm"):
        plain, one_p = (Norm(model_config_from_preset("tiny", normalization=normalization, apply_layernorm_1p=flag))
                        for flag in (False, True))
        plain.init_weights(0, ""), one_p.init_weights(0, "")
        assert torch.all(one_p.weight == 0) and torch.all(plain.weight == 1)
        x = torch.randn(3, 2, 256)
        torch.testing.assert_close(one_p(x), plain(x))
        with torch.no_grad():
            one_p.weight.fill_(0.5), plain.weight.fill_(1.5)
        torch.testing.assert_close(one_p(x), plain(x))


def test_no_mmap_reads_the_same_tokens(paths):
    from megalite.data.indexed_dataset import IndexedDataset

    mapped, read = IndexedDataset(paths["data"]), IndexedDataset(paths["data"], mmap=False)
    for i in range(len(mapped)):
        np.testing.assert_array_equal(read.get(i, 3, 50), mapped.get(i, 3, 50))
        np.testing.assert_array_equal(read[i], mapped[i])
