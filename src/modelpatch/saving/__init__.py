"""Saving: ``save_pretrained``, as stages whose hooks the modes implement (the load's mirror); offline conversion."""

from .save import save_pretrained

__all__ = ["save_pretrained"]
