"""A local Hugging Face model folder -> a megalite checkpoint (iteration 0) to continue pretraining;
anything megalite would compute differently is refused, naming the config field. Checkpoints are
layout-free, so the layout sizes only check that the model can be split that way (and pad the vocabulary
for that TP size); any other layout loads the checkpoint just as well."""

import dataclasses
import json
import os
import shlex
import time
from collections.abc import Callable

import torch

from megalite import checkpoint
from megalite.checkpoint import Piece
from megalite.config import ModelConfig
from megalite.convert.configs import GPT2, model_fields_from_hf
from megalite.convert.hf_files import HFWeights
from megalite.convert.maps import from_hf, hf_shapes, tensor_maps
from megalite.convert.preset_model import preset_model
from megalite.errors import UserError
from megalite.model.gpt import build_model


def import_checkpoint(load: str, save: str, tensor_model_parallel_size: int = 1, pipeline_model_parallel_size: int = 1,
                      seq_length: int | None = None, make_vocab_size_divisible_by: int = 128,
                      dtype: torch.dtype | None = None, log: Callable[[str], None] = print) -> None:
    """Write HF folder `load` as megalite checkpoint `save` (model only, iteration 0), then log the
    pretrain_gpt.py command that continues from it with `--load save --finetune`. seq_length: the training
    sequence length to record (default max_position_embeddings, at most 4096). dtype: default as stored."""
    tp, pp = tensor_model_parallel_size, pipeline_model_parallel_size
    start = time.perf_counter()
    config_path = os.path.join(load, "config.json")
    if not os.path.isfile(config_path):
        megalite = os.path.isfile(os.path.join(load, checkpoint.LATEST_FILE))
        raise UserError(f"{config_path} does not exist; --load takes a local Hugging Face model folder"
                        + (" (this is a megalite checkpoint: convert it with to-hf)" if megalite else ""))
    if os.path.isdir(save) and checkpoint.read_latest_iteration(save) is not None:
        raise UserError(f"--save {save} already holds a megalite checkpoint; choose a new folder")
    with open(config_path) as file:
        hf = json.load(file)
    imported = model_fields_from_hf(hf, seq_length)
    imported.fields["make_vocab_size_divisible_by"] = make_vocab_size_divisible_by
    model = preset_model(imported.fields, imported.vocab_size, tp, pp)
    config, flags = model.config, model.flags()
    weights = HFWeights(load, "transformer." if imported.architecture == GPT2 else "model.")
    shapes = {name: tuple(tensor.shape) for name, tensor in build_model(config, 0, device="meta").state_dict().items()}
    tensors = {}
    for tensor_map in tensor_maps(config):
        hf_tensors = [weights.get(name) for name in tensor_map.theirs]
        expected = hf_shapes(tensor_map, shapes[tensor_map.ours], config)
        for name, tensor, shape in zip(tensor_map.theirs, hf_tensors, expected):
            if tuple(tensor.shape) != shape:
                raise UserError(f"{load}: {name} has shape {list(tensor.shape)} but config.json implies "
                                f"{list(shape)}; the weights do not match the config")
        tensor = from_hf(tensor_map, hf_tensors, config)
        tensors[tensor_map.ours] = tensor.to(dtype) if dtype else tensor
    tied_head = [] if config.untie_embeddings_and_output_weights else ["lm_head.weight"]
    unused = [name for name in weights.unused() if name not in tied_head]
    if unused:
        raise UserError(f"{load} holds tensors megalite's {imported.architecture} mapping does not use "
                        f"({', '.join(unused[:3])}{', ...' if len(unused) > 3 else ''}); the model has parts "
                        f"megalite cannot represent")
    tokenizer = any(os.path.isfile(os.path.join(load, name))
                    for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json"))
    extra = {"model_name": f"from-hf:{os.path.basename(os.path.normpath(load))}", "model_flags": flags,
             "converted_from": {"path": os.path.abspath(load), "architecture": hf.get("architectures"),
                                "vocab_size": imported.vocab_size}}
    if tokenizer:
        # Where tools/generate.py and a later to-hf look for the run's tokenizer.
        extra["run"] = {"data": {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": os.path.abspath(load)}}
    saved = _save_megalite(save, tensors, config, extra)
    log(f"wrote {saved}: {imported.architecture} with {sum(t.numel() for t in tensors.values()) / 1e6:.2f}M "
        f"parameters (vocabulary {imported.vocab_size}, padded to {config.vocab_size}) in "
        f"{time.perf_counter() - start:.1f} s")
    note = _tokenizer_size_note(load, imported.vocab_size) if tokenizer else None
    if note:
        log(note)
    log("continue pretraining with these model flags (the tokenizer must have "
        f"{imported.vocab_size} tokens):")
    log("  " + shlex.join(continue_command(load, save, flags, tokenizer, tp, pp)))  # "[1,0,1]" quoted


def continue_command(load: str, save: str, model_flags: list[str], tokenizer: bool, tensor_model_parallel_size: int,
                     pipeline_model_parallel_size: int) -> list[str]:
    """The pretrain_gpt.py command that continues from checkpoint `save` (`...` for the user to fill in)."""
    layout = []
    if tensor_model_parallel_size > 1:
        layout += ["--tensor-model-parallel-size", str(tensor_model_parallel_size)]
    if pipeline_model_parallel_size > 1:
        layout += ["--pipeline-model-parallel-size", str(pipeline_model_parallel_size)]
    tokenizer_flags = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", load] if tokenizer \
        else ["--tokenizer-type", "...", "--tokenizer-model", "..."]
    return ["pretrain_gpt.py", "--load", save, "--finetune", *model_flags, *layout, *tokenizer_flags,
            "--data-path", "...", "--save", "..."]


def _tokenizer_size_note(folder: str, vocab_size: int) -> str | None:
    """A warning when the folder's tokenizer has another vocabulary than the model (megalite needs them equal)."""
    try:
        from transformers import AutoTokenizer

        size = len(AutoTokenizer.from_pretrained(folder, local_files_only=True))
    except Exception:  # noqa: BLE001 - an unreadable tokenizer only costs the check
        return f"note: could not load the tokenizer of {folder}; training needs one with {vocab_size} tokens"
    if size == vocab_size:
        return None
    return (f"note: the tokenizer of {folder} has {size} tokens but the model's vocabulary is {vocab_size}; "
            f"megalite takes the vocabulary from the tokenizer, so --finetune needs one with {vocab_size} tokens")


def _save_megalite(save: str, tensors: dict, config: ModelConfig, extra: dict) -> str:
    """`<save>/iter_0000000/`: the model only (no optimizer), written as one piece per tensor."""
    staging = checkpoint.begin_save(save, 0)
    report = checkpoint.write_rank_files(staging, 0, {name: [Piece.full(tensor)] for name, tensor in tensors.items()})
    header = {"iteration": 0, "consumed_samples": 0, "consumed_valid_samples": 0,
              "model_config": dataclasses.asdict(config), "optimizer": None, "extra": extra}
    return checkpoint.finalize_save(save, 0, header, [report])
