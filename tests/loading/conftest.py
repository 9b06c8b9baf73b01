"""Fixtures of the loader tests: stock-saved tiny checkpoints (built once per session), a clean conversion registry."""

from __future__ import annotations

import pytest
from stock_checkpoints import CheckpointFactory

from modelpatch.conversion import registry as conversion_registry


@pytest.fixture(scope="session")
def stock_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``stock_checkpoint("llama")`` -> a :class:`StockCheckpoint` (built once per session)."""
    return CheckpointFactory(tmp_path_factory.mktemp("stock"))


@pytest.fixture(autouse=True)
def _restore_conversion_registry():
    """Tests may register conversion mappings (the seed example overwrites qwen2_moe's); undo that afterwards."""
    saved = dict(conversion_registry._mappings)
    yield
    conversion_registry._mappings.clear()
    conversion_registry._mappings.update(saved)
