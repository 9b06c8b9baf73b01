"""Fixtures of the loader tests: stock-saved tiny checkpoints (built once per session)."""

from __future__ import annotations

import pytest
from stock_checkpoints import CheckpointFactory


@pytest.fixture(scope="session")
def stock_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    """``stock_checkpoint("llama")`` -> a :class:`StockCheckpoint` (built once per session)."""
    return CheckpointFactory(tmp_path_factory.mktemp("stock"))
