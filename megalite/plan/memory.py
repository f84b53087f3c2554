"""Bytes per rank in closed form (docs/memory.md derives each): parameters, gradients and optimizer state
exactly under each sharding strategy, and an estimate of the activations autograd keeps on the GPU code path
(flash attention, the fused kernels); tools/bench/memory.py checks them against live tensors."""

import torch

from megalite.config import ModelConfig, Sharding, recompute_segments
from megalite.model.moe import expert_capacity

GRAD_BYTES = 4  # the grad buffer is fp32 whatever the model's dtype
MAIN_PARAM_BYTES = 4  # fp32 main params of a bf16 / fp16 model
ADAM_MOMENT_BYTES = 8  # exp_avg and exp_avg_sq, fp32
STEP_COUNTER_BYTES = 4  # AdamW's per-parameter `step`: an fp32 scalar
MASK_BYTES = 1  # a dropout mask is a bool tensor
STATS_BYTES = 4  # fp32 per-row statistics of a norm (rstd; LayerNorm adds the mean)
LSE_BYTES = 4  # an fp32 log-sum-exp (flash attention: per query head and token; cross-entropy: per token)
ID_BYTES = 8  # int64 token ids and labels
FP32_BYTES = 4  # the router computes in fp32 (logits, scores, probs)
OFFSET_BYTES = 4  # the grouped GEMM's int32 expert offsets


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def state_bytes(buffer, params_dtype: torch.dtype, shard: int, sharding: Sharding = Sharding.NO_SHARD,
                bf16_reduce: str | None = None, recomputed_unit: int = 0) -> dict[str, int]:
    """{"params", "grads", "optimizer", "working"} bytes of the rank that owns shard `shard` of every bucket of
    `buffer`, a GradBuffer (cut into DP shards when the optimizer state is sharded, else 1), under `sharding`.
    `working` (docs/memory.md) exists only during an iteration: ZeRO-3's gathered units (at least the
    `recomputed_unit` largest), ZeRO-2/3's full grads, and with `bf16_reduce` (--grad-reduce-in-bf16 at
    DP > 1) a bf16 copy of "one" bucket in flight or of "all" of them."""
    shards = buffer.shard_count
    bucket_sizes = sorted(-(-sum(param.numel() for param in bucket.params) // shards) * shards
                          for bucket in buffer.buckets)
    owned = [high - low for _, _, (low, high), _ in buffer.owned(shard)]
    grad_elements, elements, pieces = sum(bucket_sizes), sum(owned), len(owned)
    main = 0 if params_dtype == torch.float32 else MAIN_PARAM_BYTES
    working = 0
    tied = any(getattr(param, "shared_embedding", False) for param in buffer.params)
    if sharding.params:
        working += element_bytes(params_dtype) * sum(bucket_sizes[-(max(2, recomputed_unit) + tied):])
    if sharding.grads:
        working += GRAD_BYTES * sum(bucket_sizes[-(2 + tied):])
    if bf16_reduce is not None:
        working += element_bytes(torch.bfloat16) * sum(bucket_sizes if bf16_reduce == "all" else bucket_sizes[-1:])
    return {"params": element_bytes(params_dtype) * (grad_elements // shards if sharding.params else buffer.numel),
            "grads": GRAD_BYTES * (grad_elements // shards if sharding.grads else grad_elements),
            "optimizer": (main + ADAM_MOMENT_BYTES) * elements + STEP_COUNTER_BYTES * pieces, "working": working}


class ActivationModel:
    """Bytes one TP rank keeps per micro-batch in flight, for `config` at `micro_batch_size`;
    element_size: bytes of an activation (the params' dtype). Under context parallelism a rank holds S/CP tokens."""

    def __init__(self, config: ModelConfig, micro_batch_size: int, tp: int = 1, sequence_parallel: bool = False,
                 element_size: int = 2, ep: int = 1, etp: int | None = None, cp: int = 1):
        self.config, self.tp, self.e = config, tp, element_size
        self.ep, self.etp = ep, tp if etp is None else etp  # the routed experts' EP and ETP
        self.tokens = config.seq_length // cp * micro_batch_size  # s*b: what TP-region tensors hold per rank
        self.routing_tokens = self.tokens * cp  # an MoE router routes the whole sequence (its logits gathered over CP)
        # The residual stream (norm inputs, dropout) is split over TP only under SP.
        self.stream_tokens = self.tokens // tp if sequence_parallel else self.tokens
        self.stats = STATS_BYTES * (2 if config.normalization == "LayerNorm" else 1)

    def layer_terms(self, layer_id: int = 0) -> dict[str, int]:
        """Global layer `layer_id` without recomputation, term by term (docs/memory.md)."""
        c, e, t, tokens, stream = self.config, self.e, self.tp, self.tokens, self.stream_tokens
        h, d = c.hidden_size, c.head_dim
        heads, groups, ffn = c.num_attention_heads // t, c.query_groups // t, c.ffn_hidden_size // t
        rope = c.position_embedding_type == "rope"
        qk_copies = rope or c.qk_layernorm
        mlp = self.moe_terms() if c.is_moe_layer(layer_id) else {
            "fc1 input": e * tokens * h,  # all-gathered to the full sequence under SP
            # SwiGLU: fc1's [gate; up] output and the product fed to fc2; GELU: its input and output
            "mlp": e * tokens * ffn * (3 if c.swiglu else 2)}
        return {
            # input_layernorm and pre_mlp_layernorm keep their input and per-row statistics
            "norm inputs": 2 * (e * stream * h + self.stats * stream),
            # linear_qkv keeps its input, all-gathered to the full sequence under SP
            "qkv input": e * tokens * h,
            # attention keeps q, k, v; v is a view of linear_qkv's output, which it keeps whole, and
            # with rope (or q/k norms) q and k are rotated (normalised) copies
            "q, k, v": e * tokens * d * ((heads + 2 * groups) + (heads + groups if qk_copies else 0)),
            # --qk-layernorm: each norm keeps a contiguous copy of its input (a view of linear_qkv's output)
            # and per-row statistics
            "q/k norms": (e * d + self.stats) * tokens * (heads + groups) if c.qk_layernorm else 0,
            # flash attention keeps the log-sum-exp, not the s x s matrix; its output is the next input
            "attention lse": LSE_BYTES * tokens * heads,
            "linear_proj input": e * tokens * heads * d,
            **mlp,
            "dropout masks": 2 * MASK_BYTES * stream * h if c.hidden_dropout > 0 else 0,
        }

    def dispatched_tokens(self) -> int:
        """The tokens this rank's MoE layer dispatches to the experts: all `tokens` (all-gathered over TP under
        SP) when the experts split over TP (ETP = TP), its own sequence chunk's when they are whole (ETP 1)."""
        return self.tokens * self.etp // self.tp

    def routed_rows(self) -> int:
        """The (token, expert) rows this rank's E/EP experts run in an MoE layer (docs/memory.md): at most
        every row its tp_ep group dispatches that can reach them, EP x `dispatched_tokens` tokens x min(topk,
        E/EP) (dropless: the worst case, all routed to this rank's experts); with a capacity at most that many
        per expert from each EP rank (exactly that with --moe-pad-expert-input-to-capacity). At EP 1: every
        token's top-k, or the experts' capacities."""
        c = self.config
        local, dispatched = c.num_experts // self.ep, self.dispatched_tokens()
        rows = self.ep * dispatched * min(c.moe_router_topk, local)
        if c.moe_expert_capacity_factor is None:
            return rows
        capacity = expert_capacity(self.routing_tokens, c.num_experts, c.moe_router_topk,
                                   c.moe_expert_capacity_factor)
        padded = local * self.ep * min(capacity, dispatched)  # an expert takes each token once at most
        return padded if c.moe_pad_expert_input_to_capacity else min(rows, padded)

    def dispatch_bytes(self) -> int:
        """The EP dispatcher's buffers in an MoE layer (0 at EP 1, where no tokens move): allgather keeps the
        tp_ep group's tokens `[EP x dispatched, h]` with their probs and routing map `[EP x dispatched, E]`;
        alltoall this rank's rows in expert order `[dispatched x topk, h]` (the rows it receives are the routed
        rows)."""
        if self.ep == 1:
            return 0
        c, dispatched = self.config, self.dispatched_tokens()
        if c.moe_token_dispatcher_type == "allgather":
            gathered = self.ep * dispatched
            return gathered * (self.e * c.hidden_size + (FP32_BYTES + MASK_BYTES) * c.num_experts)
        return self.e * dispatched * c.moe_router_topk * c.hidden_size

    def moe_terms(self) -> dict[str, int]:
        """An MoE layer's MLP (model/moe.py) on one TP rank, which routes all `tokens` (all-gathered under SP).
        Exact for softmax, pre-softmax or sigmoid routing, with the aux_loss, the z-loss or neither, dropless or
        padded to a capacity (tests/plan); dropping to a capacity, at most. Groups and seq_aux_loss differ by a
        few `[tokens]` or `[tokens, E]` tensors, small beside the routed rows. Under CP the routing terms count the
        whole sequence's tokens, and the gathered logits and this rank's rows of the probs and map are added."""
        c, e, tp, local = self.config, self.e, self.tp, self.stream_tokens
        tokens = self.routing_tokens  # what the router's terms hold; self.tokens: this rank's own
        h, experts, topk, rows = c.hidden_size, c.num_experts, c.moe_router_topk, self.routed_rows()
        ffn, acts = c.expert_ffn_hidden_size // self.etp, 3 if c.swiglu else 2
        fp32_model = e == FP32_BYTES
        training = {  # the balancing losses exist in training forwards only, as every term here
            # z-loss: the logits, their log-sum-exp
            "z-loss": FP32_BYTES * tokens * (experts + 1) if c.moe_z_loss_coeff else 0,
            # aux_loss: its scores (sigmoid: and the per-token sum normalising them), top-k choice and counts
            "aux loss": (FP32_BYTES * tokens * (experts + (c.moe_router_score_function == "sigmoid"))
                         + ID_BYTES * tokens * topk + FP32_BYTES * experts
                         if c.moe_router_load_balancing_type != "none" and c.moe_aux_loss_coeff else 0),
        }
        shared = c.moe_shared_expert_intermediate_size
        gate = c.moe_shared_expert_gate
        return {
            # the router's fp32 input (the layer's input at TP 1 in fp32, else a copy) and, in a 16-bit model,
            # an fp32 copy of its weight each forward
            "router input": FP32_BYTES * self.tokens * h + (0 if fp32_model else FP32_BYTES * experts * h),
            # CP: the logits gathered from every CP rank, then this rank's rows of the probs and routing map
            "context-parallel routing": (FP32_BYTES * tokens * experts + (FP32_BYTES + MASK_BYTES) * self.tokens
                                         * experts if tokens > self.tokens else 0),
            # top-k ids and the scores (below); the probs `[tokens, E]` and the map dispatch selects by
            "routing": ID_BYTES * tokens * topk + self._score_bytes() + (FP32_BYTES + MASK_BYTES) * tokens * experts,
            # a capacity by probs: each expert's top tokens (ids; by position no grad flows through the choice)
            "capacity": (ID_BYTES * experts * min(expert_capacity(tokens, experts, topk, c.moe_expert_capacity_factor),
                                                  tokens)
                         if c.moe_expert_capacity_factor is not None and c.moe_token_drop_policy == "probs" else 0),
            **training,
            # per row: its token id and prob; the gathered rows, fc1's output and the activation (as the dense
            # MLP's), fc2's input (the activation times the prob), and the experts' outputs the combine keeps
            "routed rows": (ID_BYTES + FP32_BYTES) * rows + e * rows * (2 * h + ffn * (acts + 1)),
            "dispatch": self.dispatch_bytes(),
            "grouped GEMM offsets": 2 * OFFSET_BYTES * (experts // self.ep) if c.moe_grouped_gemm else 0,
            # the shared experts: a dense MLP (its input is the router's at TP 1 in fp32); the gate keeps its
            # sigmoid and the shared output it scales, its input being this rank's layer input
            "shared experts": (e * self.tokens * (h * (not (fp32_model and tp == 1)) + shared // tp * acts)
                               + (e * local * (h + 1) + (e * local * h if tp > 1 else 0) if gate else 0)
                               if shared else 0),
        }

    def _score_bytes(self) -> int:
        """The routing scores an MoE layer keeps (fp32): the softmax of the top-k logits (pre-softmax: of all E);
        sigmoid: all E sigmoids, and for k > 1 the k chosen and their sum, which normalises them."""
        c, tokens, experts, topk = self.config, self.routing_tokens, self.config.num_experts, self.config.moe_router_topk
        if c.moe_router_score_function == "sigmoid":
            return FP32_BYTES * tokens * (experts + (topk + 1 if topk > 1 else 0))
        return FP32_BYTES * tokens * (experts if c.moe_router_pre_softmax else topk)

    def layer_bytes(self, recompute: str | None = None, layer_id: int = 0) -> int:
        """Global layer `layer_id`'s kept bytes under `recompute` (None, "selective" or "full")."""
        if recompute == "full":
            return self.e * self.stream_tokens * self.config.hidden_size  # the checkpointed layer's input
        terms = self.layer_terms(layer_id)
        if recompute == "selective":
            terms.pop("attention lse")  # the core attention is recomputed from q, k, v
        return sum(terms.values())

    def layers_bytes(self, layers: list[int]) -> int:
        """A chunk's kept bytes, of the global `layers` in order, under the config's --recompute-*: each
        checkpointed unit keeps its input, every other layer what `layer_bytes` says."""
        c = self.config
        if c.recompute_granularity != "full":
            return sum(self.layer_bytes(c.recompute_granularity, layer) for layer in layers)
        return sum(self.layer_bytes("full") if checkpointed else self._unit_bytes(layers, positions)
                   for positions, checkpointed in self._segments(len(layers)))

    def recomputed_unit_bytes(self, layers: list[int]) -> int:
        """The most bytes a backward of the chunk of global `layers` rebuilds at once: full recomputation's
        largest checkpointed unit, its layers as `layer_bytes()` keeps them (0 without)."""
        if self.config.recompute_granularity != "full":
            return 0
        return max((self._unit_bytes(layers, positions) for positions, checkpointed in self._segments(len(layers))
                    if checkpointed), default=0)

    def _unit_bytes(self, layers: list[int], positions: range) -> int:
        return sum(self.layer_bytes(None, layers[position]) for position in positions)

    def largest_recomputed_unit(self, num_layers: int) -> int:
        """The most layers a backward of a chunk of `num_layers` layers rebuilds at once (full recomputation's
        largest checkpointed unit; 0 without): they hold `layer_bytes()` each meanwhile."""
        if self.config.recompute_granularity != "full":
            return 0
        return max((len(positions) for positions, checkpointed in self._segments(num_layers) if checkpointed),
                   default=0)

    def _segments(self, num_layers: int) -> list[tuple[range, bool]]:
        return recompute_segments(num_layers, self.config.recompute_method, self.config.recompute_num_layers)

    def embedding_bytes(self) -> int:
        """The first stage's embedding: the ids of its lookups (tokens; learned positions), the mask of
        the other ranks' rows under TP, and the dropout mask if any. Under SP the first layer's input is
        this rank's slice of the embedding output, a view that keeps the full `[s, b, h]` alive (unless
        dropout makes a new tensor of it): the part beyond the slice is counted here."""
        c = self.config
        lookups = 2 if c.position_embedding_type == "learned_absolute" else 1
        vocab_mask = MASK_BYTES * self.tokens if self.tp > 1 else 0
        dropout = MASK_BYTES * self.stream_tokens * c.hidden_size if c.hidden_dropout > 0 else 0
        scattered = self.e * (self.tokens - self.stream_tokens) * c.hidden_size if not dropout else 0
        return ID_BYTES * self.tokens * lookups + vocab_mask + dropout + scattered

    def output_bytes(self) -> int:
        """The last stage: final norm input, output layer input (full sequence), and the
        cross-entropy's logits slice `[s, b, V/t]` (the Triton kernel keeps the logits, not a softmax),
        labels and fp32 log-sum-exp. --fused-output-cross-entropy keeps no logits at all."""
        c, e, h, tokens = self.config, self.e, self.config.hidden_size, self.tokens
        logits = 0 if c.fused_output_cross_entropy else e * tokens * c.vocab_size // self.tp
        return (e * self.stream_tokens * h + self.stats * self.stream_tokens + e * tokens * h + logits
                + (ID_BYTES + LSE_BYTES) * tokens)

    def rotary_table_bytes(self) -> int:
        """Rope's cos and sin tables `[s, b, 1, d]` (fp32), built by each chunk's forward from the
        micro-batch's position ids and shared by its layers; full recomputation keeps them too."""
        if self.config.position_embedding_type != "rope":
            return 0
        return 2 * 4 * self.tokens * self.config.rotary_dim


def chunk_activation_bytes(model: ActivationModel, layers: list[int], first: bool, last: bool) -> int:
    """Bytes one model chunk of the global `layers` keeps per micro-batch: its layers (as the config's
    recomputation keeps them) and rope tables, plus the embedding / output it holds."""
    return (model.layers_bytes(layers) + model.rotary_table_bytes()
            + (model.embedding_bytes() if first else 0) + (model.output_bytes() if last else 0))


def peak_activation_bytes(ops, chunk_bytes: list[int], backward_working_bytes: int = 0) -> int:
    """The most activation bytes held at once while a rank runs `ops` (schedules.operation_order): each
    forward holds `chunk_bytes[chunk]` until its backward, which holds `backward_working_bytes` on top
    (with full recomputation, the layers of the largest unit it rebuilds)."""
    live = peak = 0
    for op in ops:
        if op.kind == "F":
            live += chunk_bytes[op.chunk]
            peak = max(peak, live)
        else:
            peak = max(peak, live + backward_working_bytes)
            live -= chunk_bytes[op.chunk]
    return peak
