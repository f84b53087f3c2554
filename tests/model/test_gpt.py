"""GPTModel: layout-independent init, pipeline stages, vocabulary padding, losses."""

import pytest
import torch
import torch.nn.functional as F

from megalite.model.gpt import GPTModel, build_model
from megalite.model.options import apply_options
from tests.helpers.model import logits as logits_of, token_losses


def batch(config, b=2, seed=0):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.real_vocab_size, (b, config.seq_length), generator=generator)
    return tokens, torch.arange(config.seq_length).repeat(b, 1), tokens.roll(-1, dims=1)


def test_init_is_deterministic_and_depends_on_seed_and_name(llama_config):
    config = llama_config()
    first, again, other = (GPTModel(config, seed=s).state_dict() for s in (1, 1, 2))
    assert all(torch.equal(first[name], again[name]) for name in first)
    weight = "layers.0.self_attention.linear_qkv.weight"
    assert not torch.equal(first[weight], other[weight])
    assert not torch.equal(first[weight], first["layers.1.self_attention.linear_qkv.weight"])


@pytest.mark.parametrize("tied", [False, True])
def test_a_stage_holds_bitwise_the_same_tensors_as_the_whole_model(llama_config, tied):
    config = llama_config(untie_embeddings_and_output_weights=not tied)
    whole = GPTModel(config, seed=3).state_dict()
    last = GPTModel(config, seed=3, layer_ids=[3, 2], pre_process=False).state_dict()
    first = GPTModel(config, seed=3, layer_ids=[0], post_process=False).state_dict()
    middle = GPTModel(config, seed=3, layer_ids=[1], pre_process=False, post_process=False).state_dict()
    assert {name.split(".")[1] for name in last if name.startswith("layers.")} == {"2", "3"}
    assert set(middle) == {name for name in whole if name.startswith("layers.1.")}
    for stage in (first, middle, last):
        for name, value in stage.items():
            assert torch.equal(value, whole[name]), name
    # Tied: the last stage's copy of the word embeddings is the first stage's.
    assert ("embedding.word_embeddings.weight" in last) == tied
    assert set(first) | set(middle) | set(last) == set(whole)


def test_pipeline_stages_chained_equal_the_whole_model(gpt2_config):
    config = gpt2_config(num_layers=3)
    tokens, positions, labels = batch(config)
    whole = GPTModel(config, seed=4)
    stage0 = GPTModel(config, seed=4, layer_ids=[0], post_process=False)
    stage1 = GPTModel(config, seed=4, layer_ids=[1], pre_process=False, post_process=False)
    stage2 = GPTModel(config, seed=4, layer_ids=[2], pre_process=False)
    hidden = stage0(tokens, positions)
    assert hidden.shape == (config.seq_length, 2, config.hidden_size)  # [s, b, h] between stages
    hidden = stage1(None, positions, hidden_states=hidden)
    losses = token_losses(stage2, None, labels, position_ids=positions, hidden_states=hidden)
    torch.testing.assert_close(losses, token_losses(whole, tokens, labels, position_ids=positions), atol=0, rtol=0)


def test_losses_are_fp32_cross_entropy_times_loss_mask(llama_config):
    config = llama_config()
    model = GPTModel(config, seed=5)
    tokens, positions, labels = batch(config)
    logits = logits_of(model, tokens, positions)
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(labels.shape)
    torch.testing.assert_close(token_losses(model, tokens, labels, position_ids=positions), expected)
    loss_mask = torch.ones_like(tokens, dtype=torch.float32)
    loss_mask[0, 4:] = 0
    masked = token_losses(model, tokens, labels, loss_mask, positions)
    torch.testing.assert_close(masked, expected * loss_mask)
    assert masked.is_contiguous()


def test_bf16_model_returns_fp32_losses(llama_config):
    config = llama_config()
    model = build_model(config, seed=5, dtype=torch.bfloat16)
    tokens, positions, labels = batch(config)
    losses = token_losses(model, tokens, labels, position_ids=positions)
    assert losses.dtype == torch.float32
    reference = token_losses(build_model(config, seed=5), tokens, labels, position_ids=positions)
    torch.testing.assert_close(losses, reference, atol=0.1, rtol=0.02)


def test_vocabulary_padding_changes_nothing(llama_config):
    """The padded model equals the unpadded one, and padding rows get no gradient."""
    plain = GPTModel(llama_config(vocab_size=250), seed=6)
    padded = GPTModel(llama_config(vocab_size=384, tokenizer_vocab_size=250), seed=6)
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(padded.state_dict()[name][: value.shape[0]], value, atol=0, rtol=0)
    assert padded.output_layer.weight[250:].abs().max() == 0
    assert padded.embedding.word_embeddings.weight[250:].abs().max() == 0
    tokens, positions, labels = batch(plain.config)
    torch.testing.assert_close(logits_of(padded, tokens, positions), logits_of(plain, tokens, positions))
    losses = token_losses(padded, tokens, labels, position_ids=positions)
    torch.testing.assert_close(losses, token_losses(plain, tokens, labels, position_ids=positions))
    losses.sum().backward()
    assert padded.output_layer.weight.grad[250:].abs().max() == 0
    assert padded.embedding.word_embeddings.weight.grad[250:].abs().max() == 0


def test_tied_output_uses_the_embedding_weight(gpt2_config):
    model = GPTModel(gpt2_config(), seed=7)
    assert model.output_layer.weight is None
    names = [name for name, _ in model.named_parameters()]
    assert "output_layer.weight" not in names and "embedding.word_embeddings.weight" in names
    tokens, positions, labels = batch(model.config)
    token_losses(model, tokens, labels, position_ids=positions).sum().backward()
    assert model.embedding.word_embeddings.weight.grad.abs().max() > 0
    assert model.embedding.word_embeddings.weight.shared_embedding


def test_output_projections_are_scaled_by_depth(llama_config):
    config = llama_config(num_layers=8, init_method_std=0.05, ffn_hidden_size=512)
    state = GPTModel(config, seed=8).state_dict()
    scaled = 0.05 / (2 * 8) ** 0.5
    for name, std in [("layers.5.self_attention.linear_qkv.weight", 0.05),
                      ("layers.5.mlp.linear_fc1.weight", 0.05),
                      ("layers.5.self_attention.linear_proj.weight", scaled),
                      ("layers.5.mlp.linear_fc2.weight", scaled),
                      ("embedding.word_embeddings.weight", 0.05), ("output_layer.weight", 0.05)]:
        assert state[name].std().item() == pytest.approx(std, rel=0.05), name
    assert torch.equal(state["layers.5.input_layernorm.weight"], torch.ones(64))


def test_parameters_carry_tensor_parallel_marks(gpt2_config):
    model = GPTModel(gpt2_config(), seed=0)
    marks = {name: (p.tensor_model_parallel, p.sequence_parallel) for name, p in model.named_parameters()}
    assert marks["layers.0.self_attention.linear_qkv.weight"] == (True, False)
    assert marks["layers.0.self_attention.linear_qkv.bias"] == (True, False)
    assert marks["layers.0.mlp.linear_fc2.weight"] == (True, False)
    assert marks["layers.0.mlp.linear_fc2.bias"] == (False, True)  # replicated row-parallel bias
    assert marks["layers.0.input_layernorm.weight"] == (False, True)
    assert marks["final_layernorm.bias"] == (False, True)
    assert marks["embedding.word_embeddings.weight"] == (True, False)
    assert marks["embedding.position_embeddings"] == (False, False)
    fc1 = GPTModel(gpt2_config(swiglu=True), seed=0).layers["0"].mlp.linear_fc1
    assert (fc1.weight.partition_dim, fc1.weight.partition_chunks, fc1.bias.partition_chunks) == (0, 2, 2)
    assert build_model(model.config, seed=0, dtype=torch.bfloat16).final_layernorm.weight.sequence_parallel


def test_bad_layer_ids_are_refused(llama_config):
    with pytest.raises(ValueError, match="outside 0..3"):
        GPTModel(llama_config(), seed=0, layer_ids=[4])


def test_compile_option_compiles_each_layer_in_place_and_keeps_the_names(llama_config):
    model = GPTModel(llama_config(), seed=1)
    names = list(model.state_dict())
    apply_options(model, compile=True)  # lazy: nothing is traced until the first call, so this test stays fast
    assert list(model.state_dict()) == names
    assert all(layer._compiled_call_impl is not None for layer in model.layers.values())
    assert model.final_layernorm._compiled_call_impl is not None
    assert model.embedding._compiled_call_impl is None  # only the layers and the final norm


@pytest.mark.parametrize("granularity", ["selective", "full"])
def test_recomputation_option_keeps_the_names_and_the_results(llama_config, granularity):
    """apply_options(recompute_granularity=...) recomputes in the backward: same loss and grads, and
    the forward under no_grad (evaluation) runs the layers plainly."""
    config = llama_config()
    assert_trains_like_eager(config, 5,
                             lambda model: _losses_of(apply_options(model, recompute_granularity=granularity)))
    model = apply_options(GPTModel(config, seed=5), recompute_granularity=granularity)
    tokens, positions, labels = batch(config)
    with torch.no_grad():
        torch.testing.assert_close(token_losses(model, tokens, labels, position_ids=positions),
                                   token_losses(GPTModel(config, seed=5), tokens, labels, position_ids=positions))


def test_logits_returned_to_the_caller_are_not_overwritten_by_the_next_forward(llama_config):
    config = llama_config()
    model = GPTModel(config, seed=7)
    tokens, positions, _ = batch(config, b=1)
    with torch.no_grad():
        logits = logits_of(model, tokens, positions)
        kept = logits.clone()
        other = logits_of(model, tokens.flip(1), positions)
    assert torch.equal(logits, kept) and not torch.equal(other, kept)


def assert_trains_like_eager(config, seed, prepare):
    """prepare(model) -> a callable (tokens, positions, labels) -> per-token losses (the model compiled some
    way): one step of it gives the loss and parameter grads of the same model in eager."""
    model, reference = GPTModel(config, seed=seed), GPTModel(config, seed=seed)
    run = prepare(model)
    tokens, positions, labels = batch(config)
    loss = run(tokens, positions, labels).mean()
    loss.backward()
    expected = token_losses(reference, tokens, labels, position_ids=positions).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected)
    for (name, param), other in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, other.grad, msg=name)


def test_a_whole_model_under_torch_compile_trains_like_eager(llama_config):
    """Traced whole (the model's forward and its loss, not only its layers), with the in-place loss over
    the loss's own logits. aot_eager: dynamo and AOTAutograd, no C++ build."""
    def compiled(model):
        return torch.compile(_losses_of(model), backend="aot_eager")
    assert_trains_like_eager(llama_config(num_layers=1, vocab_size=1024), 3, compiled)


def _losses_of(model):
    """The per-token losses of `model` as assert_trains_like_eager runs them."""
    return lambda tokens, positions, labels: token_losses(model, tokens, labels, position_ids=positions)


def _layers_compiled(model):
    return _losses_of(apply_options(model, compile=True))


def test_compiled_layers_train_like_eager(llama_config, one_thread):
    """--compile: the layers and the final norm under Inductor give the eager model's loss and grads,
    vocabulary padding included (1,000 real ids of 1,024)."""
    assert_trains_like_eager(llama_config(num_layers=1, vocab_size=1024, tokenizer_vocab_size=1000), 4,
                             _layers_compiled)
