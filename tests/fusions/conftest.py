"""Fixtures of the fusion tests: tiny stock-saved checkpoints (built once per session)."""

from __future__ import annotations

import pytest
from fusion_models import CheckpointFactory


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``tiny("llama")`` -> a :class:`TinyCheckpoint` (built once per session)."""
    return CheckpointFactory(tmp_path_factory.mktemp("fusion_checkpoints"))
