"""Named RNG states for dropout inside tensor-parallel regions (Megatron's RNG tracker). Dropout on replicated
activations draws from the default RNG, alike on every TP rank; on split ones (attention heads, hidden states
under SP) from the per-rank "tensor-parallel" state, inside `with model_parallel_rng_tracker.fork():`.
Recomputation must use this module's `checkpoint`."""

import contextlib

import torch
import torch.utils.checkpoint

TENSOR_PARALLEL_RNG = "tensor-parallel"


def get_rng_state(device: torch.device) -> torch.Tensor:
    """The default generator's state on `device` (the CPU's, or that CUDA device's)."""
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGStatesTracker:
    """Named generator states of one device (CPU or a CUDA device), swapped in by `fork`."""

    def __init__(self):
        self.reset("cpu", {})

    def reset(self, device, seeds: dict[str, int]) -> None:
        """Track exactly the states `seeds` names: each that of a generator on `device` seeded with its seed."""
        self.device = torch.device(device)
        self.states = {name: torch.Generator(device=self.device).manual_seed(seed).get_state()
                       for name, seed in seeds.items()}

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
        default_state = get_rng_state(self.device)
        set_rng_state(self.states[name], self.device)
        try:
            yield
        finally:
            self.states[name] = get_rng_state(self.device)
            set_rng_state(default_state, self.device)


model_parallel_rng_tracker = RNGStatesTracker()


CP_SEED_STRIDE = 7919  # a prime past any TP rank: CP and TP ranks' tracker seeds never meet


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int = 0, device="cpu", cp_rank: int = 0) -> None:
    """Seed torch's default RNG (CPU and CUDA) with `seed + 100 * pp_rank`, alike on a stage's ranks as in
    Megatron, and reset the tracker to `device` with its state seeded `seed + 100 * pp_rank + 2718 + tp_rank`
    (Megatron's offsets: the TP stream differs from the default one and between TP ranks), plus
    `CP_SEED_STRIDE * cp_rank`: context-parallel ranks hold other tokens, so their masks differ too."""
    stage_seed = seed + 100 * pp_rank
    torch.manual_seed(stage_seed)
    model_parallel_rng_tracker.reset(device, {TENSOR_PARALLEL_RNG: stage_seed + 2718 + tp_rank
                                              + CP_SEED_STRIDE * cp_rank})


_recomputations = 0  # recomputations under way (nested checkpoints count each)


def recomputing() -> bool:
    """Whether a `checkpoint`ed function is being run again for its backward: module hooks inside it then
    see a second forward, which belongs to the backward (ZeRO-3 keeps the parameters gathered for it)."""
    return _recomputations > 0


def checkpoint(function, *args, **kwargs):
    """torch.utils.checkpoint (non-reentrant) that also replays the tracker's streams. torch restores the
    default RNG for the recomputation, but a `fork` inside `function` would draw from the tracker's
    backward-time state (other dropout masks). Here the recomputation starts from the forward's tracker
    states, and the tracker is left as it was."""
    states_at_forward = model_parallel_rng_tracker.get_states()
    calls = 0

    def replay(*inner_args, **inner_kwargs):
        global _recomputations
        nonlocal calls
        calls += 1
        if calls == 1:
            return function(*inner_args, **inner_kwargs)
        states_now = model_parallel_rng_tracker.get_states()
        model_parallel_rng_tracker.set_states(states_at_forward)
        _recomputations += 1
        try:
            return function(*inner_args, **inner_kwargs)
        finally:  # also when torch stops the recomputation early, once it has every tensor the backward needs
            _recomputations -= 1
            model_parallel_rng_tracker.set_states(states_now)

    return torch.utils.checkpoint.checkpoint(replay, *args, use_reentrant=False, **kwargs)
