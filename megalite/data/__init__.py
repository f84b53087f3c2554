"""Token data: indexed .bin/.idx files, tokenizers, GPT sample indices, blends, loader. The public entry is
`build_gpt_datasets`; docs/data.md has the formats and the sample-index algorithm."""

from megalite.data.builder import build_gpt_datasets, parse_data_path
from megalite.data.loader import build_data_loader
