"""Shared fixtures: tiny random models saved as HF directories (session-scoped)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny_models.py

from tiny_models import make_tiny_model  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {arch: make_tiny_model(root / arch, arch) for arch in ("llama", "mistral", "qwen2", "qwen3")}


@pytest.fixture(scope="session")
def tiny_llama(tiny_model_dirs) -> Path:
    return tiny_model_dirs["llama"]


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory) -> Path:
    """A different (weaker) llama with the same vocabulary: a realistic draft."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny-draft") / "draft", "llama", seed=7, num_hidden_layers=1)
