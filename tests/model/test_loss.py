"""The loss outside the model (model/loss.py): the model returns hidden states, and the fused output loss
(--fused-output-cross-entropy) equals the output layer then the vocab-parallel cross-entropy."""

import inspect
from dataclasses import replace

import pytest
import torch

from megalite.model.gpt import GPTModel
from megalite.model.loss import LanguageModelLoss


def test_the_model_returns_hidden_states_and_takes_no_loss_arguments(llama_config):
    config = llama_config()
    model = GPTModel(config, seed=1)
    assert not {"labels", "loss_mask"} & set(inspect.signature(model.forward).parameters)
    tokens = torch.randint(0, config.real_vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(0))
    hidden = model(tokens)
    assert hidden.shape == (config.seq_length, 2, config.hidden_size)  # [s, b, h], after the final norm
    expected = (hidden @ model.output_layer.weight.t()).transpose(0, 1)
    torch.testing.assert_close(model.logits(hidden), expected[..., :config.real_vocab_size], atol=0, rtol=0)


@pytest.mark.parametrize("tied", [False, True])
def test_fused_and_unfused_losses_agree_on_the_same_hidden_states(llama_config, tied):
    """Losses, the hidden states' grad and the output weight's grad (the embedding's when tied), with z-loss,
    vocabulary padding and a loss mask."""
    config = llama_config(num_layers=1, untie_embeddings_and_output_weights=not tied, vocab_size=256,
                          tokenizer_vocab_size=250, z_loss_weight=1e-3)
    model = GPTModel(config, seed=2)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 250, (2, config.seq_length), generator=generator)
    loss_mask = (torch.rand(2, config.seq_length, generator=generator) > 0.3).float()
    hidden = model(tokens).detach()
    results = []
    for fused in (False, True):
        loss_fn = LanguageModelLoss(replace(config, fused_output_cross_entropy=fused))
        model.zero_grad()
        leaf = hidden.clone().requires_grad_()
        losses = loss_fn(model, leaf, tokens.roll(-1, dims=1), loss_mask)
        losses.sum().backward()
        assert losses.shape == tokens.shape and losses.dtype == torch.float32
        results.append((losses.detach(), leaf.grad, model.output_weight().grad.clone()))
    for unfused, fused in zip(*results):
        torch.testing.assert_close(fused, unfused, rtol=1e-5, atol=1e-6)
    assert results[0][0][loss_mask == 0].abs().max() == 0
