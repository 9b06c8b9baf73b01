"""Replacement classes importable by ``modelpatch --patch`` in the CLI tests (this folder is put on PYTHONPATH)."""

from transformers.models.llama.modeling_llama import LlamaMLP


class SameMLP(LlamaMLP):
    """Identical math: verification passes."""


class DoubledMLP(LlamaMLP):
    """Doubles the MLP output: verification must fail."""

    def forward(self, x):
        return 2 * super().forward(x)


class CrashingMLP(LlamaMLP):
    """Raises in forward: verification must fail (exit 1), not crash the command."""

    def forward(self, x):
        raise RuntimeError("this MLP is broken")


NOT_A_MODULE = 42
