"""Named RNG states for dropout inside tensor-parallel regions (Megatron's RNG tracker idea).

Two random streams per process:
- the default torch RNG, seeded alike on every TP rank, for work on replicated
  activations (dropout on full `[s, b, h]` hidden states without SP), so every TP rank
  draws the same mask and the replicas stay identical;
- the "tensor-parallel" state of `model_parallel_rng_tracker`, seeded differently on
  every TP rank, for work on sharded or split activations: attention-probability
  dropout on this rank's heads, and hidden dropout on `[s/tp, b, h]` under SP. Run it
  inside `with model_parallel_rng_tracker.fork():`.

`fork` swaps the tracked state into the default generator of the tracker's device
(`torch.get_rng_state` on CPU, `torch.cuda.get_rng_state` on CUDA), runs the block,
keeps the advanced state and puts the default one back, so the default stream is
untouched by forked draws. `get_states` / `set_states` save and restore the tracker
exactly (checkpoints). Activation recomputation must replay the forked stream too:
use this module's `checkpoint` for a function that forks inside.
"""

import contextlib

import torch
import torch.utils.checkpoint

TENSOR_PARALLEL_RNG = "tensor-parallel"
# Megatron's offsets: the TP stream differs from the default one and between TP ranks.
TENSOR_PARALLEL_SEED_OFFSET = 2718
PIPELINE_SEED_STRIDE = 100


def _get_rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states of one device (CPU or a CUDA device), swapped in by `fork`."""

    def __init__(self, device="cpu"):
        self.device = torch.device(device)
        self.states: dict[str, torch.Tensor] = {}

    def reset(self, device="cpu") -> None:
        """Forget every state; later states belong to `device`'s default generator."""
        self.device = torch.device(device)
        self.states = {}

    def add(self, name: str, seed: int) -> None:
        """Track a new state `name`, that of a generator seeded with `seed`."""
        if name in self.states:
            raise ValueError(f"RNG state {name!r} is already tracked")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(seed)
        self.states[name] = generator.get_state()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of every tracked state (uint8 CPU tensors), e.g. for a checkpoint."""
        return {name: state.clone() for name, state in self.states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the tracked states by `states` (from `get_states` on the same kind of device)."""
        self.states = {name: state.clone() for name, state in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = TENSOR_PARALLEL_RNG):
        """Draw from state `name` inside the block; the default RNG is restored after it."""
        if name not in self.states:
            raise KeyError(f"RNG state {name!r} is not tracked; call model_parallel_seed(...) first")
        default_state = _get_rng_state(self.device)
        _set_rng_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = _get_rng_state(self.device)
            _set_rng_state(default_state, self.device)


model_parallel_rng_tracker = RNGStatesTracker()


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int = 0, device="cpu") -> None:
    """Seed torch's default RNG and the tracker for this rank.

    The default RNG (CPU and every CUDA device, through torch.manual_seed) gets
    `seed + 100 * pp_rank`: the same on all TP (and DP) ranks of a pipeline stage,
    different between stages, as Megatron does. The tracker is reset to `device` with
    one state, "tensor-parallel", seeded `seed + 100 * pp_rank + 2718 + tp_rank`.
    Python's `random` and numpy are the caller's to seed.
    """
    stage_seed = seed + PIPELINE_SEED_STRIDE * pp_rank
    torch.manual_seed(stage_seed)
    model_parallel_rng_tracker.reset(device)
    model_parallel_rng_tracker.add(TENSOR_PARALLEL_RNG, stage_seed + TENSOR_PARALLEL_SEED_OFFSET + tp_rank)


def checkpoint(function, *args, tracker: RNGStatesTracker | None = None, **kwargs):
    """torch.utils.checkpoint (non-reentrant) that also replays the tracker's streams.

    torch's checkpoint restores the default RNG for the recomputation, but a `fork`
    inside `function` would then draw from the tracker's state as it is at backward
    time, giving other dropout masks than the forward. Here the recomputation starts
    from the tracker states of the forward, and the tracker is left as it was.
    """
    tracker = model_parallel_rng_tracker if tracker is None else tracker
    states_at_forward = tracker.get_states()
    calls = 0

    def replay(*inner_args, **inner_kwargs):
        nonlocal calls
        calls += 1
        if calls == 1:
            return function(*inner_args, **inner_kwargs)
        states_now = tracker.get_states()
        tracker.set_states(states_at_forward)
        try:
            return function(*inner_args, **inner_kwargs)
        finally:
            tracker.set_states(states_now)

    return torch.utils.checkpoint.checkpoint(replay, *args, use_reentrant=False, **kwargs)
