"""Data preparation: text inputs to Megatron's .bin/.idx token files, and the built-in corpus.

- `text_sources`: the inputs (JSONL, .txt, Hugging Face datasets), cut into chunks and parsed;
- `preprocess`: `preprocess(...)`, the tokenizing core behind tools/preprocess_data.py;
- `builtin_corpus`: `ensure_builtin_corpus()`, the default run's corpus (the standard library).

The command-line tools (tools/preprocess_data.py, tools/train_tokenizer.py) call these;
nothing here imports tools/.
"""
