"""The mixture-of-experts layer (Megatron-core's MoELayer) on `[s, b, h]`, in four visible steps:
route (the router's top-k over `num_experts`), dispatch (tokens into (expert, token) order), experts (one MLP
each, as a loop or one grouped GEMM), combine (each token's expert outputs summed back in token order), plus
the shared experts every token goes through.

The router's balancing losses never enter the scalar loss: `AuxLossInjector` returns the routing
probabilities unchanged and gives the loss its gradient in backward, scaled as the language-model loss is
(`set_aux_loss_scale`, which the training step calls before its micro-batches). Aux-loss-free balancing
keeps a per-expert bias that `update_expert_bias` moves after each optimizer step.

Parameters, named like Megatron's where it has one layout (`router.weight`, `shared_experts.*`), hold the
routed experts stacked on a leading expert dimension, `experts.linear_fc1.weight` `[E, fc1, h]` and
`experts.linear_fc2.weight` `[E, h, ffn]`: the layout `torch._grouped_mm` and transformers 5 hold in memory,
one tensor per kind whose rows are the experts by global index, so expert parallelism shards dim 0 as TP
shards its own dim, and a checkpoint or a Hugging Face export unbinds it into per-expert tensors.
"""

import collections
import math
import re

import torch
import torch.nn.functional as F
from torch import nn

from megalite.config import ModelConfig
from megalite.data.loader import context_parallel_positions
from megalite.kernels.swiglu import swiglu
from megalite.model.context_parallel import gather_sequence
from megalite.model.token_dispatcher import TokenDispatcher
from megalite.parallel_state import ONE_PROCESS, ParallelState
from megalite.tensor_parallel.comm import (divide, gather_from_sequence_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region)
from megalite.tensor_parallel.layers import init_full_tensor, mark_parameter, shard_full_tensor, tensor_parallel_group


class AuxLossInjector(torch.autograd.Function):
    """Forward: `probs` unchanged. Backward: `probs`' grad, and `scale` as the grad of the 0-dim `loss`, so
    the loss's gradient reaches the router without entering the scalar loss (Megatron's
    MoEAuxLossAutoScaler; it works under any pipeline schedule)."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, loss: torch.Tensor, scale) -> torch.Tensor:
        ctx.loss_shape, ctx.scale = loss.shape, scale
        return probs

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, torch.ones(ctx.loss_shape, dtype=grad.dtype, device=grad.device) * ctx.scale, None


def topk_routing(logits: torch.Tensor, topk: int, score_function: str = "softmax", pre_softmax: bool = False,
                 scaling_factor: float | None = None, num_groups: int | None = None, group_topk: int | None = None,
                 expert_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Megatron's top-k routing of fp32 `logits` `[t, E]` -> (probs `[t, E]`, zero off the map; routing_map
    `[t, E]` bool, `topk` True per row). softmax: top-k of the logits, softmax over those k (pre_softmax: a
    softmax over all E, then top-k, not renormalised); sigmoid: top-k of sigmoid + `expert_bias`, the unbiased
    scores of those k normalised (k > 1). Groups: only the `group_topk` groups with the largest sums of their
    top topk/group_topk scores compete. The probs are then times `scaling_factor`."""
    if score_function == "softmax":
        if pre_softmax:
            probs, indices = _topk(torch.softmax(logits, dim=-1), topk, num_groups, group_topk)
        else:
            top_logits, indices = _topk(logits, topk, num_groups, group_topk)
            probs = torch.softmax(top_logits, dim=-1)
    else:
        scores = torch.sigmoid(logits)
        biased = scores if expert_bias is None else scores + expert_bias
        indices = _topk(biased, topk, num_groups, group_topk)[1]
        probs = scores.gather(1, indices)
        if topk > 1:
            probs = probs / (probs.sum(dim=-1, keepdim=True) + 1e-20)
    if scaling_factor:
        probs = probs * scaling_factor
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, indices, True)
    return torch.zeros_like(logits).scatter(1, indices, probs), routing_map


def _topk(scores: torch.Tensor, topk: int, num_groups: int | None, group_topk: int | None):
    """(values, indices) `[t, topk]` of `scores` `[t, E]`, from the best `group_topk` of `num_groups` groups."""
    if num_groups is None:
        return scores.topk(topk, dim=-1)
    t, experts = scores.shape
    grouped = scores.view(t, num_groups, experts // num_groups)
    group_scores = grouped.topk(topk // group_topk, dim=-1).values.sum(dim=-1)  # [t, groups]
    chosen = torch.zeros_like(group_scores, dtype=torch.bool).scatter(
        1, group_scores.topk(group_topk, dim=-1).indices, True)
    masked = grouped.masked_fill(~chosen.unsqueeze(-1), float("-inf")).view(t, experts)
    return masked.topk(topk, dim=-1)


def expert_capacity(num_tokens: int, num_experts: int, topk: int, capacity_factor: float) -> int:
    """Tokens an expert takes at most: ceil(tokens x topk / experts x factor), as Megatron's get_capacity."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def apply_capacity(probs: torch.Tensor, routing_map: torch.Tensor, capacity: int, drop_policy: str = "probs",
                   pad: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Keep at most `capacity` tokens per expert (column of `[t, E]` probs and map): those with the largest
    probs ("probs") or the first in token order ("position"). `pad`: every expert gets exactly `capacity`
    rows, the extra ones tokens not routed to it, with prob 0 (Megatron's drop-and-pad)."""
    t = routing_map.shape[0]
    if drop_policy == "probs":
        keep_score = probs
    else:  # routed tokens first, each group in token order
        position = torch.arange(t, device=probs.device, dtype=probs.dtype).unsqueeze(1)
        keep_score = routing_map.to(probs.dtype) * t + (t - 1 - position)
    kept = keep_score.topk(min(capacity, t), dim=0).indices  # [capacity, E]
    keep = torch.zeros_like(routing_map).scatter(0, kept, True)
    final_map = keep if pad else routing_map & keep
    return probs * final_map, final_map


def aux_loss_scores(logits: torch.Tensor, score_function: str) -> torch.Tensor:
    """The per-expert scores `[t, E]` the balancing losses use: a softmax, or sigmoids normalised per token."""
    if score_function == "softmax":
        return torch.softmax(logits, dim=-1)
    scores = torch.sigmoid(logits)
    return scores / (scores.sum(dim=-1, keepdim=True) + 1e-20)


def switch_aux_loss(scores: torch.Tensor, tokens_per_expert: torch.Tensor, topk: int,
                    total_tokens: int | None = None) -> torch.Tensor:
    """GShard / Switch balancing loss (Megatron's switch_load_balancing_loss_func): E / (topk x T^2) x sum_e
    (e's summed scores) x (e's assignments), scores `[t, E]`, tokens_per_expert `[E]`, over T = `total_tokens`
    tokens (default t); 1 when balanced. When the counts and T cover more tokens than these t (other ranks'
    too), this is these tokens' share of that larger batch's loss."""
    t, experts = scores.shape
    total = t if total_tokens is None else total_tokens
    return (scores.sum(dim=0) * tokens_per_expert.to(scores.dtype)).sum() * (experts / (topk * total * total))


def sequence_aux_loss(scores: torch.Tensor, routing_map: torch.Tensor, topk: int, seq_length: int) -> torch.Tensor:
    """DeepSeek-V2's balancing loss per sequence, averaged over the sequences: tokens are `[s, b]`-ordered
    rows of scores, routing_map `[s * b, E]`."""
    experts = scores.shape[1]
    scores, routing_map = scores.view(seq_length, -1, experts), routing_map.view(seq_length, -1, experts)
    load = routing_map.sum(dim=0).to(scores.dtype) / (seq_length * topk / experts)  # [b, E]
    return (load * scores.mean(dim=0)).sum(dim=1).mean()


def router_z_loss(logits: torch.Tensor) -> torch.Tensor:
    """ST-MoE's z-loss: the mean over tokens of logsumexp(logits)^2, logits `[t, E]`."""
    return torch.logsumexp(logits, dim=-1).square().mean()


def _in_backward() -> bool:
    """Whether autograd is running a backward now: activation recomputation runs the forward again there,
    and must not count its tokens or losses twice."""
    return torch._C._current_graph_task_id() != -1


class Router(nn.Module):
    """The gate `[E, h]` (its logits in fp32, Megatron's --moe-router-dtype fp32), top-k routing, capacity,
    the balancing losses and the expert bias. Holds `aux_loss_scale`, set by `set_aux_loss_scale`, and the
    statistics `take_moe_statistics` reads. Under TP each of the TP ranks routes the same tokens and injects
    1/TP of the losses' gradient: its weight grads are summed over TP. global_aux_loss sums its counts over
    the data-parallel ranks of `parallel` (`global_counts`)."""

    def __init__(self, config: ModelConfig, parallel: ParallelState = ONE_PROCESS):
        super().__init__()
        self.config, self.dp_size = config, parallel.dp_size
        self.dp_group = parallel.dp_group if parallel.dp_size > 1 else None
        self.cp_size, self.cp_rank, self.cp_group = parallel.cp_size, parallel.cp_rank, parallel.cp_group
        # The TP x CP ranks route the same (the whole micro-batch's) tokens, each injecting its share of the losses.
        self.replicas = parallel.tp_size * parallel.cp_size
        experts = config.num_experts
        # Under TP every rank routes all tokens, and its weight grad is that rank's partial sum (summed over TP).
        self.weight = mark_parameter(nn.Parameter(torch.empty(experts, config.hidden_size)), False,
                                     sequence_parallel=True)
        self.aux_loss_scale = 1.0
        biased = config.moe_router_enable_expert_bias
        # fp32 whatever the model's dtype (see _apply), checkpointed; its counts are the step's only.
        self.register_buffer("expert_bias", torch.zeros(experts, dtype=torch.float32) if biased else None)
        self.register_buffer("tokens_per_expert", torch.zeros(experts, dtype=torch.int64) if biased else None,
                             persistent=False)
        # Since the last take_moe_statistics: tokens per expert, summed losses, training forwards.
        self.register_buffer("routed_tokens", torch.zeros(experts, dtype=torch.int64), persistent=False)
        self.loss_sums = {"load_balancing_loss": 0.0, "z_loss": 0.0}
        self.forwards = 0
        # global_aux_loss: the counts of this step's micro-batches (summed over DP), its training forwards, and
        # the average each used, for their recomputations in backward (reset_global_aux_loss clears them).
        self.register_buffer("global_tokens_per_expert", torch.zeros(experts, dtype=torch.int64), persistent=False)
        self.global_forwards = 0
        self.global_averages = collections.deque()

    def init_weights(self, seed: int, prefix: str) -> None:
        with torch.no_grad():
            self.weight.copy_(init_full_tensor(tuple(self.weight.shape), self.config.init_method_std, seed,
                                               f"{prefix}.weight"))
            if self.expert_bias is not None:
                self.expert_bias.zero_()

    def _apply(self, fn, recurse=True):
        """Module.to(dtype) casts floating buffers; the expert bias stays fp32 (only its device follows)."""
        super()._apply(fn, recurse)
        if self.expert_bias is not None and self.expert_bias.dtype != torch.float32:
            self.expert_bias = self.expert_bias.float()
        return self

    def forward(self, tokens: torch.Tensor, seq_length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens `[t, h]` (`[s, b]`-ordered, s = `seq_length`) -> probs `[t, E]` fp32 (zero off the map)
        and routing_map `[t, E]` bool. Under CP, `tokens` are this rank's part of the sequence, and the routing is
        that of the whole sequence (its logits gathered over CP), of which this rank's rows are returned."""
        config = self.config
        logits = F.linear(tokens.float(), self.weight.float())  # [t, E]
        if self.cp_size > 1:  # capacity and the balancing losses count the whole sequence, as one process's
            logits = gather_sequence(logits.view(seq_length, -1, logits.shape[-1]), self.cp_group).flatten(0, 1)
            seq_length *= self.cp_size
        counting = self.training and torch.is_grad_enabled() and not _in_backward()
        if config.moe_z_loss_coeff and self.training:
            z_loss = router_z_loss(logits) * config.moe_z_loss_coeff
            logits = AuxLossInjector.apply(logits, z_loss, self.aux_loss_scale / self.replicas)
            if counting:
                self.loss_sums["z_loss"] += z_loss.detach()
        probs, routing_map = topk_routing(
            logits, config.moe_router_topk, config.moe_router_score_function, config.moe_router_pre_softmax,
            config.moe_router_topk_scaling_factor, config.moe_router_num_groups, config.moe_router_group_topk,
            self.expert_bias)
        if counting:  # the routing's choices, before capacity drops or pads (as Megatron counts them)
            with torch.no_grad():
                counts = routing_map.sum(dim=0)
                self.routed_tokens += counts
                if self.expert_bias is not None:
                    self.tokens_per_expert += counts
            self.forwards += 1
        if config.moe_expert_capacity_factor is not None:
            capacity = expert_capacity(len(logits), config.num_experts, config.moe_router_topk,
                                       config.moe_expert_capacity_factor)
            probs, routing_map = apply_capacity(probs, routing_map, capacity, config.moe_token_drop_policy,
                                                config.moe_pad_expert_input_to_capacity)
        balancing = config.moe_router_load_balancing_type != "none" and config.moe_aux_loss_coeff > 0
        if balancing and self.training and torch.is_grad_enabled():  # Megatron's condition: none without a graph
            aux_loss = self.balancing_loss(logits, seq_length) * config.moe_aux_loss_coeff
            probs = AuxLossInjector.apply(probs, aux_loss, self.aux_loss_scale / self.replicas)
            if counting:  # global_aux_loss: this rank's share; the DP mean of dp_size x share is their sum
                share = self.dp_size if config.moe_router_load_balancing_type == "global_aux_loss" else 1
                self.loss_sums["load_balancing_loss"] += aux_loss.detach() * share
        if self.cp_size > 1:
            mine = context_parallel_positions(seq_length, self.cp_rank, self.cp_size).to(logits.device)
            probs, routing_map = (x.view(seq_length, -1, x.shape[-1])[mine].flatten(0, 1) for x in (probs, routing_map))
        return probs, routing_map

    def balancing_loss(self, logits: torch.Tensor, seq_length: int) -> torch.Tensor:
        """The --moe-router-load-balancing-type loss of fp32 logits `[t, E]`, without its coefficient. As
        Megatron's, its assignment counts are a plain top-k of the loss's own scores (no bias, groups or
        capacity). aux_loss: over this micro-batch (its TP ranks' tokens are all here); global_aux_loss: these
        tokens' scores against `global_counts`, over the micro-batch's tokens on all DP ranks."""
        config, topk = self.config, self.config.moe_router_topk
        scores = aux_loss_scores(logits, config.moe_router_score_function)
        top = scores.topk(topk, dim=-1).indices
        routing_map = torch.zeros_like(scores, dtype=torch.bool).scatter(1, top, True)
        if config.moe_router_load_balancing_type == "seq_aux_loss":
            return sequence_aux_loss(scores, routing_map, topk, seq_length)
        if config.moe_router_load_balancing_type == "global_aux_loss":
            return switch_aux_loss(scores, self.global_counts(routing_map), topk, len(scores) * self.dp_size)
        return switch_aux_loss(scores, routing_map.sum(dim=0), topk)

    def global_counts(self, routing_map: torch.Tensor) -> torch.Tensor:
        """Megatron's global_aux_loss counts `[E]` fp32 for a training forward's routing map `[t, E]`: the
        micro-batch's tokens per expert summed over the DP ranks (one all-reduce, in the forward, which every
        DP rank of a pipeline stage runs at the same micro-batch), averaged over the step's micro-batches so
        far. A recomputation in backward neither counts nor communicates: it takes the average its forward
        used (backward runs a chunk's micro-batches in forward order)."""
        if _in_backward():
            return self.global_averages.popleft()
        counts = routing_map.sum(dim=0)
        if self.dp_group is not None:
            torch.distributed.all_reduce(counts, group=self.dp_group)
        self.global_tokens_per_expert += counts
        self.global_forwards += 1
        average = self.global_tokens_per_expert.float() / self.global_forwards
        self.global_averages.append(average)
        return average


def local_experts(num_experts: int, parallel: ParallelState) -> range:
    """The global indices of the experts this rank holds: its expert-parallel rank's E/EP consecutive ones."""
    per_rank = num_experts // parallel.ep_size  # RunConfig.validate: EP divides the experts
    return range(parallel.ep_rank * per_rank, (parallel.ep_rank + 1) * per_rank)


class ExpertLinear(nn.Module):
    """This rank's experts (`local_experts`) of `num_experts` linear layers stacked: weight `[E/EP, out, in]`,
    bias `[E/EP, out]`; rows `[n, in]` grouped by local expert (`counts` `[E/EP]` rows each) -> `[n, out]`
    without the bias, by a loop over experts (the reference) or one `torch._grouped_mm` (the same bits in fp32,
    bf16 and fp16). Under expert TP (ETP = TP) each expert splits as the dense MLP's layers do, along
    `partition_dim`: fc1's rows (1, in `output_chunks` blocks) or fc2's columns (2); under ETP = 1 < TP the
    experts are whole, neither TP-split nor TP-replicated (each rank of the TP x EP group holds others)."""

    def __init__(self, num_experts: int, input_size: int, output_size: int, *, bias: bool, init_std: float,
                 partition_dim: int, output_chunks: int = 1, grouped: bool = False,
                 parallel: ParallelState = ONE_PROCESS):
        super().__init__()
        self.init_std, self.grouped, self.output_chunks = init_std, grouped, output_chunks
        self.partition_dim, self.tp_rank, self.tp_size = partition_dim, parallel.expert_tp_rank, parallel.expert_tp_size
        self.expert_ids = local_experts(num_experts, parallel)
        self.full_shape = (num_experts, output_size, input_size)
        local = [len(self.expert_ids), output_size, input_size]
        local[partition_dim] = divide(local[partition_dim], self.tp_size, "expert size")
        with_tp = parallel.expert_tp_size == parallel.tp_size  # split over TP with the dense layers
        self.weight = mark_parameter(nn.Parameter(torch.empty(local)), with_tp, partition_dim,
                                     partition_chunks=output_chunks)
        self.bias = None
        if bias:  # fc1's splits with its rows; fc2's is whole (see Experts for where it is added)
            if partition_dim == 1:
                self.bias = mark_parameter(nn.Parameter(torch.empty(local[:2])), with_tp, 1,
                                           partition_chunks=output_chunks)
            else:
                self.bias = mark_parameter(nn.Parameter(torch.empty(local[0], output_size)), False,
                                           sequence_parallel=with_tp)
        for param in self.parameters():  # their grads are summed over expert-DP, not DP
            param.expert_parallel = True

    def init_weights(self, seed: int, prefix: str) -> None:
        with torch.no_grad():
            full = init_full_tensor(self.full_shape, self.init_std, seed, f"{prefix}.weight")
            mine = full[self.expert_ids.start:self.expert_ids.stop]
            self.weight.copy_(shard_full_tensor(mine, self.partition_dim, self.tp_rank, self.tp_size,
                                                self.output_chunks))
            if self.bias is not None:
                self.bias.zero_()

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        if self.grouped:
            if x.dtype == torch.float64:
                raise ValueError("--moe-grouped-gemm (torch._grouped_mm) does not run in fp64; use the loop path")
            return torch._grouped_mm(x, self.weight.transpose(1, 2), offs=counts.cumsum(0).to(torch.int32))
        chunks = x.split(counts.tolist())
        return torch.cat([F.linear(chunk, self.weight[e]) for e, chunk in enumerate(chunks)])


class Experts(nn.Module):
    """This rank's routed experts, each an MLP like the dense one (fc1 `[gate; up]` with SwiGLU, else GELU), on
    tokens grouped by local expert `[n, h]`; under expert TP each rank's part of every expert, whose outputs
    are partial sums. A token's routing prob multiplies its intermediate activation before fc2 (Megatron), and
    fc2's bias enters as prob x bias, so an expert's output is prob x MLP(x) (Hugging Face's form). Where one
    rank holds every expert (EP 1, ETP = TP) the MoE layer adds fc2's bias after the combine; otherwise
    (`bias_in_experts`) the expert's rank adds it here, 1/ETP of it on each rank of the expert's split.
    `output_std`: fc2's init std (the residual projections')."""

    def __init__(self, config: ModelConfig, output_std: float, kernels: str = "auto",
                 parallel: ParallelState = ONE_PROCESS):
        super().__init__()
        self.swiglu, self.kernels = config.swiglu, kernels
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        self.bias_in_experts = parallel.ep_size > 1 or parallel.expert_tp_size != parallel.tp_size
        self.expert_tp_size = parallel.expert_tp_size
        ffn, experts = config.expert_ffn_hidden_size, config.num_experts
        chunks = 2 if config.swiglu else 1
        self.linear_fc1 = ExpertLinear(experts, config.hidden_size, ffn * chunks, bias=config.add_bias_linear,
                                       init_std=config.init_method_std, partition_dim=1, output_chunks=chunks,
                                       grouped=config.moe_grouped_gemm, parallel=parallel)
        self.linear_fc2 = ExpertLinear(experts, ffn, config.hidden_size, bias=config.add_bias_linear,
                                       init_std=output_std, partition_dim=2, grouped=config.moe_grouped_gemm,
                                       parallel=parallel)

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        """tokens `[n, h]` grouped by local expert, `counts` `[E/EP]`, probs `[n]` fp32 -> `[n, h]` (with fc2's
        bias where `bias_in_experts`)."""
        fc1, fc2 = self.linear_fc1, self.linear_fc2
        x = fc1(tokens, counts)
        if fc1.bias is not None:
            x = x + fc1.bias.repeat_interleave(counts, dim=0, output_size=len(tokens))
        x = swiglu(x, self.kernels) if self.swiglu else F.gelu(x, approximate=self.gelu_approximate)
        output = fc2((x * probs.unsqueeze(-1)).to(tokens.dtype), counts)
        if fc2.bias is not None and self.bias_in_experts:
            bias = fc2.bias.float().repeat_interleave(counts, dim=0, output_size=len(tokens))
            output = output + (probs.unsqueeze(-1) / self.expert_tp_size * bias).to(output.dtype)
        return output


class MoELayer(nn.Module):
    """Route -> dispatch -> experts -> combine, plus `shared_experts` (a dense MLP every token goes through,
    gated by sigmoid(x w) with --moe-shared-expert-gate): `[s, b, h]` -> `[s, b, h]` (`[s/tp, b, h]` under SP).
    `output_std`: the init std of the experts' fc2 (the residual projections').

    Under TP (with SP) the tokens are all-gathered over TP and every rank routes all of them alike (the
    single-process routing, capacity and losses); the router's gradient is then a partial sum per rank, summed
    over TP as the SP-replicated parameters' are. With the experts split over TP (ETP = TP, Megatron's
    allgather dispatcher at EP 1) each rank runs its part of every expert on all tokens, and the partial
    outputs are reduce-scattered back to each rank's tokens. With whole experts (ETP = 1 < TP) each rank
    dispatches only its own sequence chunk's rows, whose outputs come back whole.

    Under expert parallelism (EP > 1) a rank holds E/EP experts (`local_experts`), and the rows it dispatches
    reach the experts' ranks by --moe-token-dispatcher-type (token_dispatcher.py)."""

    def __init__(self, config: ModelConfig, output_std: float, parallel: ParallelState = ONE_PROCESS,
                 kernels: str = "auto", shared_experts: nn.Module | None = None):
        super().__init__()
        assert parallel.tp_size == 1 or parallel.sequence_parallel, "MoE under TP needs SP (RunConfig.validate)"
        self.config, self.parallel, self.tp_group = config, parallel, tensor_parallel_group(parallel)
        self.rows_per_tp_rank = parallel.expert_tp_size < parallel.tp_size
        self.router = Router(config, parallel)
        self.experts = Experts(config, output_std, kernels, parallel)
        self.dispatch = TokenDispatcher(self.experts, local_experts(config.num_experts, parallel),
                                        config.moe_token_dispatcher_type, parallel)
        self.shared_experts = shared_experts
        self.shared_expert_gate = None
        if config.moe_shared_expert_gate:
            self.shared_expert_gate = mark_parameter(nn.Parameter(torch.empty(1, config.hidden_size)), False,
                                                     sequence_parallel=True)

    def init_weights(self, seed: int, prefix: str) -> None:
        if self.shared_expert_gate is not None:
            with torch.no_grad():
                self.shared_expert_gate.copy_(init_full_tensor((1, self.config.hidden_size),
                                                               self.config.init_method_std, seed,
                                                               f"{prefix}.shared_expert_gate"))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local_tokens = hidden.reshape(-1, hidden.shape[-1])  # [t/tp, h] under SP
        everyone = gather_from_sequence_parallel_region(hidden, self.tp_group)  # [s, b, h]
        s, b, h = everyone.shape
        tokens = everyone.reshape(s * b, h)
        probs, routing_map = self.router(tokens, s)  # [t, E], alike on every TP rank
        if self.rows_per_tp_rank:  # this rank's SP chunk, contiguous rows of the [s, b]-ordered tokens
            rows = slice(self.parallel.tp_rank * len(local_tokens), (self.parallel.tp_rank + 1) * len(local_tokens))
            output = self.dispatch(tokens[rows], probs[rows], routing_map[rows])
        else:  # partial sums over TP (or the whole, at TP 1)
            output = self.dispatch(tokens, probs, routing_map).view(s, b, h)
            output = reduce_scatter_to_sequence_parallel_region(output, self.tp_group).view(-1, h)
        fc2_bias = self.experts.linear_fc2.bias
        if fc2_bias is not None and not self.experts.bias_in_experts:  # sum_e prob_e x bias_e of this rank's tokens
            mine = probs.view(s, b, -1).chunk(self.parallel.tp_size)[self.parallel.tp_rank].reshape(len(output), -1)
            output = output + (mine @ fc2_bias.float()).to(output.dtype)
        if self.shared_experts is not None:
            shared = self.shared_experts(hidden).view(-1, h)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(F.linear(local_tokens, self.shared_expert_gate)) * shared
            output = output + shared
        return output.view(hidden.shape)

def moe_routers(model: nn.Module) -> list[Router]:
    """The routers of a model (a GPTModel, a pipeline rank's chunks), in layer order."""
    return [module for module in model.modules() if isinstance(module, Router)]


def set_aux_loss_scale(model: nn.Module, scale) -> None:
    """The factor the balancing losses' gradients get in this step's backwards: 1 / (micro-batches of the
    global batch), times the fp16 loss scale, as the language-model loss's (a float or a 0-dim tensor)."""
    for router in moe_routers(model):
        router.aux_loss_scale = scale


def reset_global_aux_loss(model: nn.Module) -> None:
    """Start a step's global_aux_loss counts afresh (Megatron resets them once per global batch, in
    finalize_model_grads); `forward_backward` calls it before its micro-batches."""
    for router in moe_routers(model):
        router.global_tokens_per_expert.zero_()
        router.global_forwards = 0
        router.global_averages.clear()


@torch.no_grad()
def update_expert_bias(model: nn.Module, dp_group=None) -> None:
    """After an optimizer step: each expert bias moves by --moe-router-bias-update-rate towards balance,
    bias += rate x sign(mean count - count), the counts of the step's tokens (summed over `dp_group`, so every
    data-parallel rank moves alike); the counts restart."""
    for router in moe_routers(model):
        if router.expert_bias is None:
            continue
        counts = router.tokens_per_expert.float()
        if dp_group is not None:
            torch.distributed.all_reduce(counts, group=dp_group)
        router.expert_bias += torch.sign(counts.mean() - counts) * router.config.moe_router_bias_update_rate
        router.tokens_per_expert.zero_()


LAYER_ID = re.compile(r"(?:^|\.)layers\.(\d+)\.")  # a module name's global layer id ("0.layers.3.mlp.router")


@torch.no_grad()
def take_moe_statistics(model: nn.Module, config: ModelConfig, parallel: ParallelState = ONE_PROCESS) -> dict:
    """The MoE log values of the whole job since the last call, then reset; every rank calls it at the same
    iterations (at most two small all-reduces and one host read, so at log lines only). `load_balancing_loss` and
    `z_loss`: per MoE layer and forward, with their coefficients, averaged over all MoE layers (every pipeline
    stage's) and DP ranks, as Megatron's tracker does; `tokens_per_expert_min` / `_max`: the least and most
    loaded expert's tokens over all DP ranks, as a fraction of the mean, over all MoE layers. TP ranks route
    the same (all-gathered) tokens, so their counts are taken once, not summed. {} for a dense model."""
    if config.num_experts is None:
        return {}
    # Per global layer: the two loss sums, the training forwards, the tokens per expert.
    table = torch.zeros(config.num_layers, 3 + config.num_experts, dtype=torch.float64,
                        device=next(model.parameters()).device)
    routers = [(name, module) for name, module in model.named_modules() if isinstance(module, Router)]
    for index, (name, router) in enumerate(routers):
        layer = LAYER_ID.search(name)  # none in a lone MoE layer or router: rows in module order
        row = table[int(layer.group(1)) if layer else index]
        row[0], row[1] = router.loss_sums["load_balancing_loss"], router.loss_sums["z_loss"]
        row[2], row[3:] = router.forwards, router.routed_tokens
        router.routed_tokens.zero_()
        router.loss_sums = dict.fromkeys(router.loss_sums, 0.0)
        router.forwards = 0
    for size, group in ((parallel.pp_size, parallel.pp_group), (parallel.dp_size, parallel.dp_group)):
        if size > 1:  # each stage fills its own layers' rows; DP ranks add their forwards and tokens
            torch.distributed.all_reduce(table, group=group)
    table = table[table[:, 2] > 0]  # the MoE layers that ran training forwards
    if not len(table):
        return {}
    losses = (table[:, :2] / table[:, 2:3]).mean(dim=0)  # per layer and forward, then over layers
    counts = table[:, 3:]
    load = counts / counts.mean(dim=1, keepdim=True).clamp(min=1)
    values = torch.cat([losses, load.min().view(1), load.max().view(1)]).tolist()  # one read
    return dict(zip(("load_balancing_loss", "z_loss", "tokens_per_expert_min", "tokens_per_expert_max"), values))
