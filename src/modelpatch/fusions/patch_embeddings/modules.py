"""``Conv3dAsLinear``: a Conv3d whose kernel equals its stride, run as a Linear over flattened patches."""

from __future__ import annotations

import math
from typing import ClassVar

import torch
from torch import nn
from torch.nn import functional as F


def patch_conv_mismatch(conv: nn.Module) -> str | None:
    """Why ``conv`` is not a Conv3d that tiles its input into non-overlapping patches (kernel == stride, no padding,
    dilation or groups), or None when it is."""
    if type(conv) is not nn.Conv3d:
        return f"{type(conv).__name__} is not a plain Conv3d"
    for name, value, expected in (
        ("stride", tuple(conv.stride), tuple(conv.kernel_size)),
        ("padding", conv.padding if isinstance(conv.padding, str) else tuple(conv.padding), (0, 0, 0)),
        ("dilation", tuple(conv.dilation), (1, 1, 1)),
        ("groups", conv.groups, 1),
        ("padding_mode", conv.padding_mode, "zeros"),
    ):
        if value != expected:
            return f"its {name} is {value}, not {expected} (kernel {tuple(conv.kernel_size)})"
    return None


def is_patch_conv(conv: nn.Module) -> bool:
    """A Conv3d that tiles its input into non-overlapping patches: kernel == stride, no padding, dilation or groups."""
    return patch_conv_mismatch(conv) is None


class Conv3dAsLinear(nn.Linear):
    """``nn.Linear(C*T*H*W -> out)`` standing in for a patch Conv3d; weight is the kernel flattened in (C, T, H, W).

    Called with one patch per row (``[N, C, T, H, W]``, as patch embeddings do) it is a single matmul and returns
    ``[N, out, 1, 1, 1]`` like the convolution; called with flattened patches (``[N, C*T*H*W]``) it is the plain
    Linear. Any other input falls back to the convolution with the same weights.
    """

    # Called where the Conv3d was, with the same input, returning its output: a hook registered on the Conv3d keeps
    # its meaning here (modelpatch.fuse / unfuse carry hooks over between the two).
    stands_in_for: ClassVar[tuple[type[nn.Module], ...]] = (nn.Conv3d,)

    def __init__(self, conv: nn.Conv3d):
        super().__init__(
            conv.in_channels * math.prod(conv.kernel_size),
            conv.out_channels,
            bias=conv.bias is not None,
            device=conv.weight.device,
            dtype=conv.weight.dtype,
        )
        self.in_channels = conv.in_channels
        self.kernel_size = tuple(conv.kernel_size)
        if conv.weight.device.type != "meta":
            with torch.no_grad():
                self.weight.copy_(conv.weight.reshape(conv.out_channels, -1))
                if self.bias is not None and conv.bias is not None:
                    self.bias.copy_(conv.bias)

    def is_patch_input(self, x: torch.Tensor) -> bool:
        return x.dim() == 5 and tuple(x.shape[1:]) == (self.in_channels, *self.kernel_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_patch_input(x):
            return self._rows(x.reshape(x.shape[0], -1)).view(x.shape[0], -1, 1, 1, 1)
        if x.dim() == 2 and x.shape[1] == self.in_features:
            return self._rows(x)
        kernel = self.weight.view(self.out_features, self.in_channels, *self.kernel_size)
        return F.conv3d(x, kernel, self.bias, stride=self.kernel_size)

    def _rows(self, patches: torch.Tensor) -> torch.Tensor:
        # A plain matmul against the transposed weight: on CPU, faster than F.linear for these shapes.
        return patches @ self.weight.t() if self.bias is None else torch.addmm(self.bias, patches, self.weight.t())

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, conv3d_kernel={self.kernel_size}"


class FlattenedPatches:
    """What the patch embedding's ``forward`` sees in place of a module that replaced its :class:`Conv3dAsLinear`.

    A quantizer or PEFT swaps the Linear for a module that expects ``[N, C*T*H*W]`` rows, while the patch embedding's
    own ``forward`` passes ``[N, C, T, H, W]`` patches (it was written for the Conv3d). This adapter flattens the
    patches, calls the module that stands there now, and gives the result the convolution's shape. Attribute reads
    (``proj.weight.dtype``) go to that module.
    """

    def __init__(self, module: nn.Module, in_channels: int, kernel_size: tuple[int, ...]):
        self.module = module
        self.shape = (in_channels, *kernel_size)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() == 5 and tuple(x.shape[1:]) == self.shape:
            return self.module(x.reshape(x.shape[0], -1)).view(x.shape[0], -1, 1, 1, 1)
        return self.module(x)

    def __getattr__(self, name: str):
        return getattr(self.module, name)
