"""Fixtures of the integration tests: the fusion tests' tiny stock-saved checkpoints (built once per session)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# The fusion tests' checkpoints and comparisons are what these tests need too: reuse them rather than copy them.
sys.path.insert(0, str(Path(__file__).parents[1] / "fusions"))

from fusion_models import CheckpointFactory  # noqa: E402


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``tiny("llama")`` -> a :class:`TinyCheckpoint` (built once per session)."""
    return CheckpointFactory(tmp_path_factory.mktemp("integration_checkpoints"))
