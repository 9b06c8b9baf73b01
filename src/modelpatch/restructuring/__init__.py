"""Restructuring a model in memory: ``fuse``, ``unfuse`` and ``patch_model``, planned first, then executed through the
load's fill stage."""

from .restructure import fuse, patch_model, unfuse

__all__ = ["fuse", "patch_model", "unfuse"]
