"""A user's own model package, outside transformers: its classes are only patchable once this module's namespace is
registered with ``modelpatch.register_patchable_namespace(__name__)``."""

from __future__ import annotations

from torch import nn


class UserAttention(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.proj = nn.Linear(width, width)

    def forward(self, x):
        return self.proj(x)


class UserBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.attention = UserAttention(width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(x + self.attention(x))


class UserModel(nn.Module):
    def __init__(self, width: int = 8, depth: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(UserBlock(width) for _ in range(depth))

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x


class FastUserAttention(UserAttention):
    """The replacement the tests register for ``UserAttention``."""
