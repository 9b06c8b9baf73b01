"""Loading: ``from_pretrained``, ``from_config``, and a load in two steps (``plan_pretrained`` → ``load_planned``)."""

from .load import PlannedLoad, from_config, from_pretrained, load_planned, plan_pretrained
from .record import get_load_report
from .report import LoadReport

__all__ = [
    "LoadReport",
    "PlannedLoad",
    "plan_pretrained",
    "load_planned",
    "from_config",
    "from_pretrained",
    "get_load_report",
]
