"""`pretrain_gpt.py --dry-run`: its figures against a live run, closed forms and saved tensors."""

import time

import pytest
import torch

from megalite.arguments import parse_args
from megalite.config import model_config_from_preset
from megalite.plan.dry_run import dry_run, format_ranks, plan
from megalite.errors import UserError
from megalite.kernels import triton_available
from megalite.plan.memory import ActivationModel, chunk_activation_bytes
from megalite.model.gpt import build_model
from megalite.model.options import apply_options
from megalite.pipeline_parallel.stages import build_model_chunks
from tests.helpers.distributed import run_world
from tests.helpers.model import token_losses

# A GPT-2-shaped model small enough for 4 CPU ranks, TP 2 (SP) x DP 2: odd head size (11) and FFN
# share (125) give odd bias lengths, so the small buckets need padding under the distributed
# optimizer; biases and norms are replicated on TP ranks. Pipeline stages are checked by closed
# forms in the llama2-7b test below (a third dimension would double this test's processes).
LIVE_FLAGS = ["--model", "gpt2-124m", "--num-layers", "2", "--hidden-size", "66", "--num-attention-heads", "6",
              "--ffn-hidden-size", "250", "--seq-length", "16", "--max-position-embeddings", "16",
              "--hidden-dropout", "0", "--attention-dropout", "0",
              "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
              "--micro-batch-size", "2", "--global-batch-size", "8", "--train-iters", "1", "--eval-interval", "0",
              "--eval-iters", "0", "--bf16", "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--use-distributed-optimizer", "--ddp-bucket-size", "3000",
              "--distributed-backend", "gloo"]

LLAMA2_7B_64_RANKS = ["--model", "llama2-7b", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size",
                      "2", "--sequence-parallel", "--use-distributed-optimizer", "--bf16", "--micro-batch-size", "1",
                      "--global-batch-size", "1024", "--data-path", "data/llama2_text_document", "--tokenizer-type",
                      "Llama2Tokenizer", "--tokenizer-model", "not/here/tokenizer.model", "--dry-run",
                      "--world-size", "64"]


def _saved_bytes(function) -> dict[int, int]:
    """{storage pointer: bytes} of the distinct storages autograd saves while `function()` runs."""
    saved, kept = {}, []

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        # Held to the end: a storage saved by a part of the graph that is freed at once (its output unused) would
        # free its address for a later one, which then counted as the same storage.
        kept.append(storage)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        function()
    return saved


def _live_rank(rank, world_size, flags):
    """One real training step on this rank; its live bytes, and its saved activations per micro-batch."""
    import megalite.run.logger
    from megalite.run.training import Trainer
    from tools.bench.memory import optimizer_state_bytes, tensor_bytes

    # The logging rank's CPU peak benchmark (a 1024^3 bf16 matmul, slow on CPUs) is not under test.
    megalite.run.logger.peak_flops = lambda device, dtype: (None, "not measured in this test")
    run = parse_args(flags, world_size)
    with Trainer(run, log=lambda line: None) as trainer:
        trainer.train_step()
        model, optimizer = trainer.model, trainer.optimizer
        live = {"params": sum(tensor_bytes(param) for param in model.parameters()),
                "grads": tensor_bytes(optimizer.grad_buffer.data), "optimizer": optimizer_state_bytes(optimizer)}
        # What autograd keeps of one micro-batch, on the GPU code path: this rank's chunk built again with
        # --kernels triton (here in the interpreter; the step above took the quicker PyTorch path).
        config, micro_batch_size = trainer.run.model, run.train.micro_batch_size
        chunk = build_model_chunks(config, run.train.seed, trainer.device, run.train.params_dtype, trainer.parallel,
                                   kernels="triton")[0]
        tokens = torch.randint(0, config.real_vocab_size, (micro_batch_size, config.seq_length))
        positions = torch.arange(config.seq_length).repeat(micro_batch_size, 1)  # a real [b, s] tensor, as in batches
        saved = _saved_bytes(lambda: token_losses(chunk, tokens, tokens, position_ids=positions) if chunk.post_process
                             else chunk(tokens, positions))
        params = {param.untyped_storage().data_ptr() for param in chunk.parameters()}
        live["activations"] = sum(nbytes for pointer, nbytes in saved.items() if pointer not in params)
        return live


# The ranks are a CPU world with Triton in its interpreter on any machine (tests/helpers/distributed.py).
@pytest.mark.skipif(not triton_available(), reason="needs Triton's CPU interpreter: triton is not installed")
@pytest.mark.interpreter
def test_dry_run_figures_equal_a_live_tp2_dp2_run():
    """Params, grads and optimizer bytes, and the activation estimate of one micro-batch, to the byte,
    on each of 4 ranks: TP 2 (SP) x DP 2, distributed optimizer, padded buckets, bf16."""
    report = plan(parse_args(LIVE_FLAGS + ["--dry-run", "--world-size", "4"]))
    live = run_world(4, _live_rank, LIVE_FLAGS)
    for rank, figures in enumerate(live):
        cls = report.rank_class(rank)
        assert cls.in_flight == 1  # no pipeline: the activation figure is one micro-batch's
        assert (figures["params"], figures["grads"], figures["optimizer"], figures["activations"]) == \
               (cls.param_bytes, cls.grad_bytes, cls.optimizer_bytes, cls.activation_bytes), f"rank {rank}"
    padded = [cls for cls in report.classes if cls.grad_bytes > 4 * cls.params]
    assert padded, "no bucket needed padding: the test does not cover it"


def test_llama2_7b_on_64_ranks_plans_in_seconds(capsys):
    start = time.perf_counter()
    report = dry_run(parse_args(LLAMA2_7B_64_RANKS))
    seconds = time.perf_counter() - start
    out = capsys.readouterr().out
    assert seconds < 30, f"the 64-rank dry run took {seconds:.1f} s"
    assert "64 ranks = TP 8 x PP 2 x DP 4" in out and "256 micro-batches" in out
    h, f, layers, vocab = 4096, 11008, 32, 32000
    layer = 4 * h * h + 3 * h * f + 2 * h  # q, k, v, o; gate, up, down; two RMSNorm weights
    assert f"model: {2 * vocab * h + layers * layer + h:,} parameters" in out  # 6,738,415,616
    assert "vocabulary 32000 from the llama2-7b preset" in out  # the tokenizer file is not here
    padded_vocab = 32768  # 32000 rounded up to 128 x TP 8
    tp_layer = (4 * h * h + 3 * h * f) // 8 + 2 * h  # norm weights are replicated on every TP rank
    first = padded_vocab // 8 * h + 16 * tp_layer
    assert [(cls.pp_rank, cls.params) for cls in report.classes if cls.ranks[0] in (0, 32)] == \
           [(0, first), (1, first + h)]  # the last stage adds the final norm
    for cls in report.classes:
        assert cls.param_bytes == 2 * cls.params  # bf16
        assert 4 * cls.params <= cls.grad_bytes <= 4 * cls.params + 4 * 4 * 20  # + padding of <= 20 buckets
        sharded = 12 * cls.params / 4  # fp32 main param + two moments, over DP 4
        assert sharded <= cls.optimizer_bytes <= sharded + 4 * 400  # + a step counter per parameter piece
    # 1F1B: stage 0 holds P - 0 = 2 micro-batches of its 16 layers; the estimate per layer, by hand
    # (s 4096, b 1, t 8, SP, bf16; docs/memory.md):
    s, t = 4096, 8
    per_layer = (2 * (2 * s // t * h + 4 * s // t) + 2 * 2 * s * h + 2 * s * 128 * (12 + 8) + 4 * s * 4
                 + 2 * s * 4 * 128 + 2 * s * (f // t) * 3)
    stage0 = report.rank_class(0)
    assert stage0.in_flight == 2 and report.rank_class(63).in_flight == 1
    # int64 token ids, the mask of the ids other TP ranks own, and the rest of the embedding output
    # that the first layer's SP slice (a view) keeps alive
    embedding = 8 * s + s + 2 * (s - s // t) * h
    rope_tables = 2 * 4 * s * 128  # cos and sin, fp32, per micro-batch
    assert stage0.activation_bytes == 2 * (16 * per_layer + embedding + rope_tables)
    assert 1.0 < report.model_flops / (6 * 6.738e9 * 1024 * s) < 1.1  # 6 N per token, plus attention


# 4 experts of 24, top-2, a gated shared expert, both balancing losses, the grouped GEMM; layer 0 dense.
MOE = {"num_experts": 4, "moe_ffn_hidden_size": 24, "moe_layer_freq": "[0,1]", "moe_aux_loss_coeff": 1e-2,
       "moe_z_loss_coeff": 1e-3, "moe_shared_expert_intermediate_size": 16, "moe_shared_expert_gate": True,
       "moe_grouped_gemm": True}


@pytest.mark.parametrize("preset, recompute, extra", [
    ("tiny", None, {}), ("tiny", "selective", {}), ("gpt2-124m", None, {}),
    ("tiny", None, {"fused_output_cross_entropy": True}),
    ("tiny", None, {"qk_layernorm": True, "add_qkv_bias": True}),
    ("tiny", None, MOE),  # layer 1 an MoE layer
    ("tiny", "selective", {**MOE, "moe_grouped_gemm": False, "moe_shared_expert_gate": False,  # the loop
                           "moe_router_score_function": "sigmoid", "moe_expert_capacity_factor": 1.5,
                           "moe_pad_expert_input_to_capacity": True}),
    ("tiny", "full", {"recompute_method": "uniform", "recompute_num_layers": 2}),  # both layers one unit
    ("tiny", "full", {"recompute_method": "block", "recompute_num_layers": 1})])  # layer 0 recomputed, 1 not
@pytest.mark.skipif(not triton_available() or torch.cuda.is_available(), reason="needs Triton's CPU interpreter")
@pytest.mark.interpreter
def test_activation_estimate_equals_the_tensors_autograd_saves(preset, recompute, extra):
    """One process, the GPU code path (Triton kernels in the interpreter): per-micro-batch bytes to the byte."""
    # Shapes this small keep Triton's interpreter quick; tiny's GQA keeps 2 heads per key/value group.
    groups = {"num_query_groups": 1} if preset == "tiny" else {}
    config = model_config_from_preset(preset, num_layers=2, hidden_size=32, num_attention_heads=2, **groups, **extra,
                                      ffn_hidden_size=48, seq_length=8, max_position_embeddings=8,
                                      hidden_dropout=0.0, attention_dropout=0.0, vocab_size=100,
                                      recompute_granularity=recompute)
    model = apply_options(build_model(config, seed=1, dtype=torch.bfloat16, kernels="triton"),
                          recompute_granularity=config.recompute_granularity, recompute_method=config.recompute_method,
                          recompute_num_layers=config.recompute_num_layers)
    # Seeded: the tokens must not depend on what ran before in this process (see the stop note of issue 41).
    tokens = torch.randint(0, 100, (3, 8), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(8).repeat(3, 1)  # a real [b, s] tensor, as batches hold
    saved = _saved_bytes(lambda: token_losses(model, tokens, tokens, position_ids=positions).sum())
    params = {param.untyped_storage().data_ptr() for param in model.parameters()}
    measured = sum(nbytes for pointer, nbytes in saved.items() if pointer not in params)
    estimate = ActivationModel(config, micro_batch_size=3, element_size=2)
    if recompute == "full" and extra["recompute_method"] == "uniform":
        # checkpointed layers keep the rope tables alive by reference, not as saved tensors (a plain layer saves them)
        measured += estimate.rotary_table_bytes()
    assert measured == chunk_activation_bytes(estimate, [0, 1], True, True)


def test_world_size_flag_needs_dry_run_and_a_multiple_of_tp_x_pp():
    with pytest.raises(UserError, match="--world-size only applies to --dry-run"):
        parse_args(["--world-size", "8"])
    with pytest.raises(UserError, match="--world-size 6 is not a positive multiple of .* = 4; use e.g. 8"):
        parse_args(["--tensor-model-parallel-size", "4", "--dry-run", "--world-size", "6"])
    run = parse_args(["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--dry-run"])
    assert run.dry_run and run.parallel.world_size == 4 and run.parallel.data_parallel_size == 1
    assert not parse_args([]).dry_run


def test_dry_run_validates_like_a_real_run():
    # 4 layers over 3 pipeline stages: the real run's one-sentence error, before any planning.
    with pytest.raises(UserError, match="--num-layers 4 is not divisible"):
        parse_args(["--pipeline-model-parallel-size", "3", "--dry-run"])


def test_format_ranks():
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"
    assert format_ranks([3]) == "3"


def test_a_preset_without_data_plans_with_its_own_vocabulary_and_warns_past_the_gpu_memory(capsys):
    h, f, layers, vocab = 4096, 14336, 32, 128256
    layer = (2 * h * h + 2 * h * h // 4) + 3 * h * f + 2 * h  # q, o; k, v of 8 groups of 32 heads; MLP; norms
    params = 2 * vocab * h + layers * layer + h  # untied embedding and output, final norm
    report = dry_run(parse_args(["--model", "llama3-8b", "--dry-run"]))
    out = capsys.readouterr().out
    assert params == 8_030_261_248 and f"model: {params:,} parameters" in out
    assert "vocabulary 128256 from the llama3-8b preset (no --tokenizer-model)" in out
    assert report.classes[0].total_bytes > 80 * 2 ** 30
    assert out.strip().splitlines()[-1].startswith("warning: rank 0 needs more than the 80 GiB of "
                                                   "--dry-run-gpu-memory; add tensor or pipeline parallelism")
    report = dry_run(parse_args(["--model", "llama3-8b", "--dry-run", "--dry-run-gpu-memory", "800"]))
    assert report.classes[0].total_bytes < 800 * 2 ** 30 and "warning" not in capsys.readouterr().out


def test_a_dry_run_takes_a_tokenizer_without_data(capsys):
    dry_run(parse_args(["--dry-run", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]))
    assert "vocabulary 1001 from NullTokenizer --vocab-size 1000" in capsys.readouterr().out
    dry_run(parse_args(["--dry-run", "--model", "llama2-7b", "--tokenizer-type", "Llama2Tokenizer",
                        "--tokenizer-model", "not/here/tokenizer.model"]))
    assert "vocabulary 32000 from the llama2-7b preset (--tokenizer-model not/here" in capsys.readouterr().out
    with pytest.raises(UserError, match="--tokenizer-type/--tokenizer-model given without --data-path"):
        parse_args(["--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"])  # a real run still needs data
    with pytest.raises(UserError, match="--dry-run-gpu-memory 80 needs --dry-run"):
        parse_args(["--dry-run-gpu-memory", "80"])


def test_a_dry_run_plans_a_gpu_job_in_bf16_unless_told_and_says_so(monkeypatch, capsys):
    """On a CPU (made one here on any machine) a real run defaults to fp32; a dry run plans for GPUs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    flags = ["--model", "llama3-8b", "--dry-run", "--world-size", "64", "--global-batch-size", "512"]
    report = dry_run(parse_args(flags))
    lines = capsys.readouterr().out.splitlines()
    assert report.run.train.params_dtype == torch.bfloat16 and lines[0].endswith(", bf16")
    assert lines[1] == ("precision: bf16, a GPU run's default (no --bf16, --fp16 or --fp32 given); --fp32 or --fp16 "
                        "plans those instead")
    for flag, dtype in [("--fp32", torch.float32), ("--fp16", torch.float16), ("--bf16", torch.bfloat16)]:
        report = dry_run(parse_args([*flags, flag]))
        assert report.run.train.params_dtype == dtype and "precision:" not in capsys.readouterr().out
    cpu_plan = dry_run(parse_args([*flags, "--distributed-backend", "gloo"]))  # a plan of a CPU job
    assert cpu_plan.run.train.params_dtype == torch.float32 and "precision:" not in capsys.readouterr().out


def test_the_plan_follows_the_recompute_method_per_chunk(capsys):
    """12 layers over PP 2 x VP 2 (chunks of three layers), ZeRO-3 at DP 2: block 1 rebuilds one layer per chunk
    (a third of the layers' recomputed FLOPs); uniform 3 a chunk's three layers at once: it keeps one input per
    chunk, and ZeRO-3 gathers the three layers' units together (more than the running and the prefetched one)."""
    flags = ["--num-layers", "12", "--pipeline-model-parallel-size", "2", "--num-virtual-stages-per-pipeline-rank",
             "2", "--data-parallel-sharding-strategy", "optim_grads_params", "--dry-run", "--world-size", "4",
             "--global-batch-size", "16", "--micro-batch-size", "4", "--recompute-granularity", "full"]
    uniform_flags = flags + ["--recompute-method", "uniform", "--recompute-num-layers", "3"]
    every, block, uniform = (plan(parse_args(flags + method)) for method in (
        [], ["--recompute-method", "block", "--recompute-num-layers", "1"], uniform_flags[len(flags):]))
    none = plan(parse_args(flags[:-2]))
    assert block.hardware_flops - none.hardware_flops == pytest.approx((every.hardware_flops - none.hardware_flops) / 3)
    assert uniform.hardware_flops == every.hardware_flops
    activations = ActivationModel(parse_args(uniform_flags).model, 4, element_size=4)
    assert chunk_activation_bytes(activations, [0, 1, 2], False, False) == (activations.layer_bytes("full")
                                                                     + activations.rotary_table_bytes())
    assert uniform.classes[0].working_bytes > every.classes[0].working_bytes == block.classes[0].working_bytes
    dry_run(parse_args(uniform_flags))
    assert "recompute: full, uniform 3" in capsys.readouterr().out
