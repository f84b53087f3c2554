"""A run's tokenizer as a Hugging Face tokenizer folder that `AutoTokenizer` loads."""

import json
import os
import shutil

from megalite.config import ModelConfig
from megalite.config.data import SENTENCEPIECE_TYPES
from megalite.data.tokenizer import build_tokenizer
from megalite.errors import UserError


def export_tokenizer(tokenizer_type: str, tokenizer_model: str | None, vocab_size: int | None, out_dir: str,
                     config: ModelConfig) -> tuple[str, dict]:
    """Write a run's tokenizer (its --tokenizer-* flags) into HF folder `out_dir`; return (a one-line
    description, the special token ids {"bos", "eos", "pad"}). SentencePiece models become an exactly
    equivalent `tokenizer.json` (with the `.model` copied beside it), a Hugging Face tokenizer is re-saved,
    NullTokenizer becomes a word-level tokenizer of its integer ids."""
    ours = build_tokenizer(tokenizer_type, tokenizer_model, vocab_size)
    if ours.vocab_size != config.real_vocab_size:
        raise UserError(f"the tokenizer ({tokenizer_type} {tokenizer_model or ''}) has {ours.vocab_size} tokens but "
                        f"the model {config.real_vocab_size}; pass the run's --tokenizer-type/--tokenizer-model")
    ids = {"bos": ours.bos, "eos": ours.eos if ours.eos is not None else ours.eod, "pad": ours.pad}
    if tokenizer_type == "HuggingFaceTokenizer":
        from transformers import AutoTokenizer

        local = os.path.isdir(tokenizer_model)
        AutoTokenizer.from_pretrained(tokenizer_model, local_files_only=local).save_pretrained(out_dir)
        return f"the Hugging Face tokenizer of {tokenizer_model}", ids
    if tokenizer_type in SENTENCEPIECE_TYPES:
        backend, special = sentencepiece_to_tokenizers(tokenizer_model, add_bos=tokenizer_type == "Llama2Tokenizer")
        shutil.copyfile(tokenizer_model, os.path.join(out_dir, "tokenizer.model"))
        described = f"SentencePiece model {tokenizer_model} as tokenizer.json (+ tokenizer.model)"
    else:  # NullTokenizer: whitespace-separated ids 0..eod, each its own word
        from tokenizers import Tokenizer, pre_tokenizers
        from tokenizers.models import WordLevel

        backend = Tokenizer(WordLevel({str(i): i for i in range(ours.eod + 1)}, unk_token=str(ours.eod)))
        backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
        special = {"eos_token": str(ours.eod)}
        described = f"NullTokenizer (ids 0..{ours.eod} as words) as tokenizer.json"
    backend.save(os.path.join(out_dir, "tokenizer.json"))
    # PreTrainedTokenizerFast loads tokenizer.json as it is; LlamaTokenizer would replace its
    # pre-tokenizer with one that adds a leading space, which megalite's SentencePiece models do not.
    settings = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": config.max_position_embeddings,
                "clean_up_tokenization_spaces": False, **special}
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as file:
        json.dump(settings, file, indent=2)
        file.write("\n")
    return described, ids


# SentencePiece piece types (sentencepiece_model.proto).
_NORMAL, _UNKNOWN, _CONTROL, _USER_DEFINED = 1, 2, 3, 4


def sentencepiece_to_tokenizers(model_path: str, add_bos: bool = False):
    """(a `tokenizers.Tokenizer` that encodes and decodes exactly as SentencePiece model `model_path`, the
    special tokens for tokenizer_config.json). BPE: SentencePiece merges the adjacent pair whose merged
    piece scores highest, so the merges are every split of every piece into two pieces, ranked by the
    merged piece's score. Unigram models keep their scores. Normalisation follows the model's spec.
    add_bos: prepend bos (Llama2Tokenizer)."""
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, processors
    from tokenizers.models import BPE, Unigram

    proto = sentencepiece_model_pb2.ModelProto()
    with open(model_path, "rb") as file:
        proto.ParseFromString(file.read())
    trainer, spec, pieces = proto.trainer_spec, proto.normalizer_spec, proto.pieces
    if trainer.model_type == 2:  # BPE
        if any(piece.type == _USER_DEFINED for piece in pieces):
            # SentencePiece cuts them out before merging; tokenizers' BPE has no equivalent step.
            raise UserError(f"{model_path} is a BPE SentencePiece model with user-defined symbols, which has no "
                            f"exact Hugging Face equivalent; export with --skip-tokenizer")
        vocab = {piece.piece: i for i, piece in enumerate(pieces)}
        mergeable = {piece.piece for piece in pieces if piece.type == _NORMAL}
        merges = []
        normal = [piece for piece in pieces if piece.type == _NORMAL]
        for piece in sorted(normal, key=lambda piece: -piece.score):  # stable: ties keep id order
            text = piece.piece
            merges += [(text[:cut], text[cut:]) for cut in range(1, len(text))
                       if text[:cut] in mergeable and text[cut:] in mergeable]
        model = BPE(vocab, merges, unk_token=trainer.unk_piece, fuse_unk=True, byte_fallback=trainer.byte_fallback)
    elif trainer.model_type == 1:  # unigram
        model = Unigram([(piece.piece, piece.score) for piece in pieces], trainer.unk_id, trainer.byte_fallback)
    else:
        raise UserError(f"{model_path} is a SentencePiece model of type {trainer.model_type}; only BPE and "
                        f"unigram models convert to a Hugging Face tokenizer")
    tokenizer = Tokenizer(model)
    rules = []
    if spec.precompiled_charsmap:
        rules.append(normalizers.Precompiled(spec.precompiled_charsmap))
    if spec.remove_extra_whitespaces:
        rules += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.escape_whitespaces:
        rules.append(normalizers.Replace(" ", "\u2581"))
    if spec.add_dummy_prefix:
        rules.append(normalizers.Prepend("\u2581"))
    tokenizer.normalizer = normalizers.Sequence(rules)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if spec.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1))
    tokenizer.decoder = decoders.Sequence(steps)
    tokenizer.add_special_tokens([AddedToken(piece.piece, special=True, normalized=False)
                                  for piece in pieces if piece.type in (_UNKNOWN, _CONTROL)])
    named_ids = {"unk_token": trainer.unk_id, "bos_token": trainer.bos_id, "eos_token": trainer.eos_id,
                 "pad_token": trainer.pad_id}
    special = {key: pieces[index].piece for key, index in named_ids.items() if 0 <= index < len(pieces)}
    if add_bos and "bos_token" in special:
        bos = special["bos_token"]
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, trainer.bos_id)])
    return tokenizer, special
