"""megalite <-> Hugging Face `transformers`: checkpoints, tensors, configurations, tokenizers.

    maps.py          tensor names and layouts (TensorMap; fused QKV, SwiGLU fc1, padded vocabulary)
    configs.py       ModelConfig -> LlamaConfig / GPT2Config, and config.json -> ModelConfig fields
    preset_model.py  the ModelConfig (and the pretrain_gpt.py flags) of an imported model
    tokenizer.py     a run's tokenizer as an HF tokenizer folder
    hf_files.py      safetensors written tensor by tensor, HF weights read lazily
    export.py        megalite checkpoint -> HF folder (tools/convert_checkpoint.py to-hf)
    importer.py      HF folder -> megalite checkpoint (tools/convert_checkpoint.py from-hf)
"""

from megalite.convert.configs import (
    GPT2, LLAMA, SUPPORTED, ImportedConfig, gpt2_config_to_hf, hf_architecture, hf_config_for, llama_config_to_hf,
    model_fields_from_hf,
)
from megalite.convert.export import export_checkpoint
from megalite.convert.hf_files import DTYPES
from megalite.convert.importer import import_checkpoint
from megalite.convert.maps import TensorMap, from_hf, hf_shapes, hf_state_dict, merge_qkv, split_qkv, tensor_maps, to_hf
from megalite.convert.preset_model import PresetModel, preset_model
from megalite.convert.tokenizer import export_tokenizer, null_tokenizer_to_tokenizers, sentencepiece_to_tokenizers

__all__ = ["DTYPES", "GPT2", "ImportedConfig", "LLAMA", "PresetModel", "SUPPORTED", "TensorMap", "export_checkpoint",
           "export_tokenizer", "from_hf", "gpt2_config_to_hf", "hf_architecture", "hf_config_for", "hf_shapes",
           "hf_state_dict", "import_checkpoint", "llama_config_to_hf", "merge_qkv", "model_fields_from_hf",
           "null_tokenizer_to_tokenizers", "preset_model", "sentencepiece_to_tokenizers", "split_qkv", "tensor_maps",
           "to_hf"]
