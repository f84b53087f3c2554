"""The language-model loss: the function the schedule applies to the last stage's output (as torchtitan's
loss_fn; Megatron's forward step returns one). The model returns hidden states; the loss runs the output
layer and the cross-entropy, or, with --fused-output-cross-entropy, both in one kernel on the output
layer's weight, never holding the logits.
"""

import torch

from megalite.config import ModelConfig
from megalite.kernels.linear_cross_entropy import linear_cross_entropy
from megalite.parallel_state import ONE_PROCESS, ParallelState
from megalite.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from megalite.tensor_parallel.layers import tensor_parallel_group


class LanguageModelLoss:
    """Per-token cross-entropy (+ PaLM's z-loss) of a model config's output, on the path `kernels`
    (`--kernels`) picks; built once per run."""

    def __init__(self, config: ModelConfig, parallel: ParallelState = ONE_PROCESS, kernels: str = "auto"):
        # RunConfig.validate refuses it; a loss built in code would cover its vocabulary shard only.
        assert not (config.fused_output_cross_entropy and parallel.tp_size > 1), "fused cross-entropy needs TP 1"
        self.config, self.parallel, self.kernels = config, parallel, kernels

    @classmethod
    def of(cls, model) -> "LanguageModelLoss":
        """The loss of a built GPTModel's config, parallel state and kernels."""
        return cls(model.config, model.parallel, model.kernels)

    def __call__(self, model, hidden: torch.Tensor, labels: torch.Tensor,
                 loss_mask: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 losses `[b, s]` (times loss_mask `[b, s]`) of `labels` `[b, s]`, given the last stage's hidden
        states `[s, b, h]` and `model`, the GPTModel chunk whose output layer (and weight) they go through."""
        config = self.config
        if config.fused_output_cross_entropy:  # TP = 1: no logits at all
            losses = linear_cross_entropy(hidden, model.output_weight(), labels.t(), config.real_vocab_size,
                                          config.z_loss_weight, kernels=self.kernels,
                                          weight_used_once=not model.tied).t()
        else:
            output_layer = model.output_layer
            logits = output_layer(hidden, model.output_weight())  # [s, b, vocab/tp]: never gathered
            vocab_start = output_layer.tp_rank * output_layer.output_size_per_partition
            # The logits are this call's own: the loss may overwrite them with their grad.
            losses = vocab_parallel_cross_entropy(logits, labels.t(), tensor_parallel_group(self.parallel),
                                                  vocab_start, config.real_vocab_size, config.z_loss_weight,
                                                  inplace=True, kernels=self.kernels).t()
        return (losses if loss_mask is None else losses * loss_mask).contiguous()
