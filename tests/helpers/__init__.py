"""What several test files share: model configs, CPU worlds, corpora, training runs.

A test file imports its shared helpers from here, never from another test file or conftest;
a helper that only one file uses stays in that file.
"""
