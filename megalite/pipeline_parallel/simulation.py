"""A discrete-event run of the real schedule steps with NCCL's rules: idle time, deadlocks, message order. A
step posts its sends and receives together and completes when each has met its counterpart; then its ops run
(`forward_cost` or `backward_cost` per whole stage). Messages between two ranks match in posting order: a
mismatch (tensors swapped on NCCL) or a deadlock raises SimulationError."""

from collections import defaultdict
from dataclasses import dataclass

from megalite.pipeline_parallel.schedules import max_in_flight, schedule_steps


class SimulationError(RuntimeError):
    """The schedule deadlocks or mismatches messages."""


@dataclass
class SimulationResult:
    makespan: float
    busy: list[float]  # per rank: time spent computing
    peak_in_flight: list[int]  # per rank

    @property
    def idle_fraction(self) -> float:
        """Idle time over compute time, averaged over ranks: (makespan - busy) / busy."""
        return sum((self.makespan - busy) / busy for busy in self.busy) / len(self.busy)


def simulate(pp: int, vp: int, num_microbatches: int, forward_cost: float = 1.0,
             backward_cost: float = 2.0) -> SimulationResult:
    """Every rank's `schedule_steps` played against each other: busy times, makespan, peak in flight."""
    steps = [schedule_steps(pp, vp, num_microbatches, rank) for rank in range(pp)]
    cost = {"F": forward_cost / vp, "B": backward_cost / vp}
    position = [0] * pp
    clock = [0.0] * pp  # when each rank reached its current step
    busy = [0.0] * pp
    # Per (src, dst) channel: posted sends and receives in order, as (message, time posted).
    sent, wanted = defaultdict(list), defaultdict(list)

    def post(rank: int) -> None:
        step = steps[rank][position[rank]]
        for message in step.sends:
            sent[(message.src, message.dst)].append((message, clock[rank]))
        for message in step.recvs:
            wanted[(message.src, message.dst)].append((message, clock[rank]))

    def match_time(message, mine: bool) -> float | None:
        """When `message` meets its counterpart; None if the peer has not posted it yet."""
        channel = (message.src, message.dst)
        own, other = (sent, wanted) if mine else (wanted, sent)
        index = next(i for i, (m, _) in enumerate(own[channel]) if m is message)
        if index >= len(other[channel]):
            return None
        counterpart = other[channel][index][0]
        if counterpart != message:
            actual, expected = (message, counterpart) if mine else (counterpart, message)
            raise SimulationError(f"on channel {channel[0]}->{channel[1]} message #{index} is {actual} "
                                  f"but the receiver expects {expected}")
        return max(own[channel][index][1], other[channel][index][1])

    for rank in range(pp):
        post(rank)
    while waiting := [rank for rank in range(pp) if position[rank] < len(steps[rank])]:
        moved = False
        for rank in waiting:
            step = steps[rank][position[rank]]
            times = [match_time(m, True) for m in step.sends] + [match_time(m, False) for m in step.recvs]
            if any(time is None for time in times):
                continue
            start = max([clock[rank], *times])
            duration = sum(cost[op.kind] for op in step.ops)
            busy[rank] += duration
            clock[rank] = start + duration
            position[rank] += 1
            if position[rank] < len(steps[rank]):
                post(rank)
            moved = True
        if not moved:
            stuck = {rank: str(steps[rank][position[rank]]) for rank in waiting}
            raise SimulationError(f"deadlock: P={pp} V={vp} m={num_microbatches}, ranks waiting at {stuck}")
    return SimulationResult(max(clock), busy, [max_in_flight([op for step in rank_steps for op in step.ops])
                                               for rank_steps in steps])


def theoretical_idle_fraction(pp: int, vp: int, num_microbatches: int) -> float:
    """Megatron's bubble fraction for (interleaved) 1F1B: (P - 1) / (V * m)."""
    return (pp - 1) / (vp * num_microbatches)
