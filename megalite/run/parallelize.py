"""The one place a built model becomes this rank's parallel model (as torchtitan's `parallelize_llama`).

Tensor and pipeline parallelism, and the `--kernels` path of the fused ops, are chosen when the chunks are
built (`build_model_chunks`: each rank builds only its layers, as column/row-parallel linears). Then, in this
order, from outside the plain model: the context-parallel attention core under CP (else the CPU backend on a
CPU), recomputation, torch.compile, and data parallelism with the sharding strategy (its hooks see the compiled
and recomputed modules) and, in eager layers, the linear layers' weight grads added into its fp32 buffer by their
backward (gradient-accumulation fusion).
"""

from megalite import cpu
from megalite.config import RunConfig
from megalite.data_parallel.ddp import ParallelModel
from megalite.model import context_parallel
from megalite.model.options import apply_options
from megalite.parallel_state import ParallelState
from megalite.pipeline_parallel.stages import ModelChunks


def parallelize(chunks: ModelChunks, run: RunConfig, parallel: ParallelState) -> ParallelModel:
    """`chunks` (this rank's, built for `parallel`) with `run`'s options applied, made data-parallel."""
    model, layout = run.model, run.parallel
    for chunk in chunks:
        if parallel.cp_size > 1:  # its own attention core, on every device
            context_parallel.apply(chunk, parallel.cp_group, *context_parallel.comm_levels(layout, parallel))
        elif parallel.device.type == "cpu":
            cpu.apply(chunk)
        apply_options(chunk, recompute_granularity=model.recompute_granularity,
                      recompute_method=model.recompute_method, recompute_num_layers=model.recompute_num_layers,
                      compile=run.train.compile)
    return ParallelModel(chunks, parallel, bucket_size=layout.ddp_bucket_size, sharding=layout.sharding,
                         overlap_grad_reduce=layout.overlap_grad_reduce,
                         overlap_param_gather=layout.overlap_param_gather,
                         grad_reduce_in_bf16=layout.grad_reduce_in_bf16,
                         # A compiled layer's backward is traced: the fused add's hooks and collectives stay out.
                         gradient_accumulation_fusion=layout.gradient_accumulation_fusion and not run.train.compile)
