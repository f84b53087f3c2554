"""megalite <-> Hugging Face `transformers`: checkpoints (export.py, importer.py), tensors, configs, tokenizers."""

from megalite.convert.configs import gpt2_config_to_hf, llama_config_to_hf, model_fields_from_hf
from megalite.convert.export import export_checkpoint
from megalite.convert.hf_files import DTYPES
from megalite.convert.importer import import_checkpoint
from megalite.convert.maps import hf_state_dict
from megalite.convert.preset_model import preset_model
from megalite.convert.tokenizer import sentencepiece_to_tokenizers

__all__ = ["DTYPES", "export_checkpoint", "gpt2_config_to_hf", "hf_state_dict", "import_checkpoint",
           "llama_config_to_hf", "model_fields_from_hf", "preset_model", "sentencepiece_to_tokenizers"]
