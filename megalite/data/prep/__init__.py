"""Data preparation: text inputs (`text_sources`) tokenized into .bin/.idx files (`preprocess`),
and the built-in corpus (`builtin_corpus`); tools/preprocess_data.py and tools/train_tokenizer.py call these."""
