"""Loading and saving: ``from_pretrained``, ``from_config``, ``save_pretrained``."""

from .load import from_config, from_pretrained
from .report import LoadReport, get_load_report
from .save import save_pretrained

__all__ = ["LoadReport", "from_config", "from_pretrained", "get_load_report", "save_pretrained"]
