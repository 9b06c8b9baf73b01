"""Fixtures of the fusion tests: tiny stock-saved checkpoints (built once per session), a clean fusion registry."""

from __future__ import annotations

import pytest
from fusion_models import CheckpointFactory

from modelpatch.fusions import registry as fusion_registry


@pytest.fixture(scope="session")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``tiny("llama")`` -> a :class:`TinyCheckpoint` (built once per session)."""
    return CheckpointFactory(tmp_path_factory.mktemp("fusion_checkpoints"))


@pytest.fixture(autouse=True)
def _restore_fusion_registry():
    """Tests register their own fusions (and may overwrite built-in ones); undo that afterwards."""
    saved = dict(fusion_registry._fusions)
    yield
    with fusion_registry._lock:
        fusion_registry._fusions.clear()
        fusion_registry._fusions.update(saved)
