"""The token dispatcher of the MoE layer (Megatron's MoE token dispatchers): routed rows to the experts that hold
them, wherever those are, and the experts' outputs back, combined per row. The only part of the layer that
expert parallelism (EP) changes.

At EP 1 the rows go into (expert, token) order, run through the local experts, and are summed back in token
order. Under EP a rank holds E/EP experts (`moe.local_experts`), and --moe-token-dispatcher-type says how the
rows reach them:
- allgather: every EP rank's rows, probs and routing map are all-gathered over EP (equal sizes), each rank runs
  its experts' columns on all of them, and the outputs are reduce-scattered back to their rows' ranks;
- alltoall: the rows go in (expert, token) order straight to their experts' ranks and back, by one uneven
  all-to-all each way, whose sizes come from the per-expert counts all-gathered over EP (the one host read).
"""

import torch
from torch import nn

from megalite.parallel_state import ParallelState
from megalite.tensor_parallel.comm import (all_to_all, gather_from_sequence_parallel_region,
                                           reduce_scatter_to_sequence_parallel_region)


def expert_order(probs: torch.Tensor, routing_map: torch.Tensor):
    """The dispatch order of rows routed by probs and routing map `[n, E]`: (the row ids `[m]` in (expert,
    token) order, each expert's rows contiguous; their probs `[m]`; the rows per expert `[E]`)."""
    by_expert = routing_map.t()  # [E, n]
    token_ids = torch.arange(len(routing_map), device=routing_map.device).expand_as(by_expert).masked_select(by_expert)
    return token_ids, probs.t().masked_select(by_expert), by_expert.sum(dim=1)


class TokenDispatcher:
    """Rows `[n, h]` with their probs `[n, E]` and routing map `[n, E]` over all E experts -> `[n, h]`, each row
    the sum of its experts' outputs (partial sums where the experts split over TP). `experts` (moe.Experts) holds
    this rank's `local` experts (a range of expert ids); `kind` is --moe-token-dispatcher-type."""

    def __init__(self, experts: nn.Module, local: range, kind: str, parallel: ParallelState):
        self.experts, self.local, self.kind = experts, local, kind
        self.ep_size, self.ep_rank = parallel.ep_size, parallel.ep_rank
        self.group = parallel.ep_group if parallel.ep_size > 1 else None

    def __call__(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        if self.group is None:
            return self.run_local_experts(tokens, probs, routing_map)
        if self.kind == "alltoall":
            return self.alltoall(tokens, probs, routing_map)
        mine = slice(self.local.start, self.local.stop)
        tokens = gather_from_sequence_parallel_region(tokens, self.group)  # [EP n, h]
        probs = gather_from_sequence_parallel_region(probs, self.group)
        routing_map = gather_from_sequence_parallel_region(routing_map, self.group)
        output = self.run_local_experts(tokens, probs[:, mine], routing_map[:, mine])
        return reduce_scatter_to_sequence_parallel_region(output, self.group)

    def run_local_experts(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """Rows `[n, h]` with probs and routing map `[n, E/EP]` over this rank's experts -> `[n, h]`: dispatch
        into (expert, token) order, the experts, and the combine (each row's outputs summed in token order)."""
        token_ids, row_probs, counts = expert_order(probs, routing_map)
        expert_out = self.experts(tokens[token_ids], counts, row_probs)
        return torch.zeros_like(tokens).index_add(0, token_ids, expert_out)

    def alltoall(self, tokens: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor) -> torch.Tensor:
        """The call by the uneven all-to-all: rows `[n, h]`, probs and routing map `[n, E]` -> `[n, h]`."""
        group, ep, me, local = self.group, self.ep_size, self.ep_rank, len(self.local)
        # The (expert, token) order puts the rows for each EP rank's experts together.
        token_ids, row_probs, counts = expert_order(probs, routing_map)
        # table[source][destination][local expert]: rows each rank sends each expert (the one host sync)
        table = gather_from_sequence_parallel_region(counts.view(1, -1), group).view(ep, ep, local).tolist()
        send = [sum(table[me][destination]) for destination in range(ep)]
        receive = [sum(table[source][me]) for source in range(ep)]
        rows = all_to_all(tokens[token_ids], group, receive, send)
        row_probs = all_to_all(row_probs, group, receive, send)
        # Received in (source, local expert) order; the experts take (local expert, source) order.
        blocks = torch.arange(sum(receive), device=tokens.device).split(
            [table[source][me][expert] for source in range(ep) for expert in range(local)])
        order = torch.cat([blocks[source * local + expert] for expert in range(local) for source in range(ep)])
        expert_counts = torch.tensor([sum(table[source][me][expert] for source in range(ep))
                                      for expert in range(local)], device=tokens.device)
        expert_out = self.experts(rows[order], expert_counts, row_probs[order])
        back = all_to_all(expert_out[order.argsort()], group, send, receive)
        return torch.zeros_like(tokens).index_add(0, token_ids, back)
