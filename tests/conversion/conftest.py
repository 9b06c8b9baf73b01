"""Fixtures of the conversion tests: the per-model-type registry is restored after every test."""

from __future__ import annotations

import pytest

from modelpatch.conversion import registry as conversion_registry


@pytest.fixture(autouse=True)
def _restore_conversion_registry():
    saved = dict(conversion_registry._mappings)
    yield
    conversion_registry._mappings.clear()
    conversion_registry._mappings.update(saved)
