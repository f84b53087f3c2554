"""The model tests' config fixtures, for the CPU backend's model-level tests."""

from tests.model.conftest import llama_config  # noqa: F401 - a fixture
