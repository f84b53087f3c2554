"""A contiguous fp32 gradient buffer: every trainable parameter's `main_grad` is a view of it.

Why one buffer: gradients accumulate over micro-batches in fp32 whatever the model's
dtype, no per-parameter `.grad` outlives its micro-batch, and gradient reduction and
the optimizer's elementwise work (unscale, clip) run on one flat tensor. A later issue
cuts the buffer into buckets (reduced while backward still runs) and, for ZeRO, into
equal data-parallel shards; `pad_to` makes the total size divisible for that.

Layout: parameters in reverse registration order (the order backward produces their
gradients, so the first bucket fills first), each one contiguous, then zero padding.
"""

import torch
from torch import nn


class GradBuffer:
    """One contiguous buffer holding every trainable parameter's gradient (`param.main_grad`).

    params: the parameters, in registration order; duplicates (tied weights) count once.
    dtype: of the buffer (fp32: gradients accumulate in fp32 for bf16/fp16 models too).
    pad_to: the buffer's length is rounded up to a multiple of this (zeros at the end).

    Attributes: `data` (the flat buffer, 1-D, `[padded numel]`), `params` (buffer order),
    `offsets` (param -> (start, numel) in `data`), `numel` (unpadded length).
    After each backward, `param.main_grad` (shaped like the param) holds the sum of its
    gradients since the last `zero()`, and `param.grad` is None.
    """

    def __init__(self, params: list[nn.Parameter], dtype: torch.dtype = torch.float32, pad_to: int = 1):
        self.params = _unique_in_backward_order(params)
        if pad_to < 1:
            raise ValueError(f"pad_to must be >= 1, got {pad_to}")
        devices = {param.device for param in self.params}
        if len(devices) > 1:
            raise ValueError(f"the parameters of one grad buffer must share a device, got {devices}")
        device = devices.pop() if devices else torch.device("cpu")

        self.offsets: dict[nn.Parameter, tuple[int, int]] = {}
        start = 0
        for param in self.params:
            self.offsets[param] = (start, param.numel())
            start += param.numel()
        self.numel = start
        padded = -(-start // pad_to) * pad_to
        self.data = torch.zeros(padded, dtype=dtype, device=device)

        self._hooks = []
        for param in self.params:
            param.main_grad = self.view(param)
            self._hooks.append(param.register_post_accumulate_grad_hook(_accumulate_into_main_grad))

    def view(self, param: nn.Parameter) -> torch.Tensor:
        """The slice of `data` that holds `param`'s gradient, shaped like `param`."""
        start, numel = self.offsets[param]
        return self.data[start:start + numel].view(param.shape)

    def zero(self) -> None:
        """Zero every main_grad (and the padding) before the first micro-batch of an iteration."""
        self.data.zero_()

    def remove_hooks(self) -> None:
        """Stop accumulating into this buffer: later backwards leave grads in `param.grad`."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def _unique_in_backward_order(params: list[nn.Parameter]) -> list[nn.Parameter]:
    """Reverse of `params`, keeping each parameter once (at its first registration)."""
    unique, seen = [], set()
    for param in params:
        if id(param) in seen:
            continue
        if not param.requires_grad:
            raise ValueError("a grad buffer holds trainable parameters only; got one with requires_grad=False")
        seen.add(id(param))
        unique.append(param)
    return unique[::-1]


def _accumulate_into_main_grad(param: nn.Parameter) -> None:
    """Add this backward's `param.grad` (any dtype) into the fp32 `main_grad`; free `.grad`.

    Runs once per backward per parameter, after autograd has summed every use of it
    (a tied weight's two uses arrive as one gradient).
    """
    param.main_grad.add_(param.grad)
    param.grad = None
