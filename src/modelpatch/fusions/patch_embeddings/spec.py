"""``patch_embeddings``: vision patch embeddings (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V, ...) whose Conv3d has
kernel == stride run as one Linear; checkpoint kernels are flattened on load and restored on save."""

from __future__ import annotations

import re
from collections.abc import Mapping
from contextvars import ContextVar

from torch import nn
from transformers import PretrainedConfig

from ...conversion.operations import Conv3dToLinear
from ...conversion.transforms import WeightConverter, WeightTransform
from ..generated import make_class
from ..spec import ModuleFusionSpec
from .modules import Conv3dAsLinear, FlattenedPatches, is_patch_conv, patch_conv_mismatch

# The fused patch embedding whose forward runs in this context (modules are reentrant across threads, so no flag on
# the instance).
_in_forward: ContextVar[nn.Module | None] = ContextVar("modelpatch_patch_embedding_forward", default=None)


def _patch_convs(module: nn.Module) -> list[str]:
    return [name for name, child in module.named_children() if is_patch_conv(child)]


class PatchEmbeddingsFusionSpec(ModuleFusionSpec):
    def is_fusable(self, module: nn.Module) -> bool:
        return bool(_patch_convs(module))

    def unfusable_reason(self, module: nn.Module) -> str | None:
        if _patch_convs(module):
            return None
        convs = {name: child for name, child in module.named_children() if isinstance(child, nn.Conv3d)}
        if not convs:
            return "it holds no Conv3d"
        return "; ".join(f"its Conv3d {name!r}: {patch_conv_mismatch(conv)}" for name, conv in convs.items())

    def make_fused_class(self, original_cls: type[nn.Module]) -> type[nn.Module]:
        def __init__(self, *args, **kwargs):
            original_cls.__init__(self, *args, **kwargs)
            linears = {}
            for name in _patch_convs(self):
                linear = Conv3dAsLinear(getattr(self, name))
                setattr(self, name, linear)
                linears[name] = (linear.in_channels, linear.kernel_size)
            object.__setattr__(self, "_modelpatch_patch_linears", linears)

        def forward(self, *args, **kwargs):
            token = _in_forward.set(self)
            try:
                return original_cls.forward(self, *args, **kwargs)
            finally:
                _in_forward.reset(token)

        def __getattr__(self, name):
            # Children are read by attribute at call time: a module that replaced the Linear since (a quantized
            # Linear, a PEFT wrapper) is what runs, fed the flattened patches it expects. Outside forward (named
            # lookups such as get_submodule) the module itself is returned.
            module = nn.Module.__getattr__(self, name)
            shape = self.__dict__.get("_modelpatch_patch_linears", {}).get(name)
            if (
                shape is None
                or not isinstance(module, nn.Module)
                or isinstance(module, Conv3dAsLinear)
                or _in_forward.get() is not self
            ):
                return module
            return FlattenedPatches(module, *shape)

        namespace = {"__init__": __init__, "forward": forward, "__getattr__": __getattr__}
        return make_class("PatchLinear", original_cls, namespace, spec=self)

    def make_transforms(self, config: PretrainedConfig, modules: Mapping[str, nn.Module]) -> list[WeightTransform]:
        """``<patch embed>.<conv>.weight``: Conv3d kernel -> Linear weight (the bias keeps its layout).

        The kernel shape is declared from the modules, so a model that was never loaded (``from_config``) can be
        saved back in the checkpoint's Conv3d layout too.
        """
        paths = sorted(
            {
                (name.rpartition(".")[2], conv, (child.in_channels, *child.kernel_size))
                for name, module in modules.items()
                for conv in _patch_convs(module)
                for child in [getattr(module, conv)]
            }
        )
        transforms: list[WeightTransform] = []
        for anchor, conv, kernel_shape in paths:
            local = f"{anchor}.{conv}.weight" if anchor else f"{conv}.weight"
            transforms.append(
                WeightConverter(rf"(?<![^.]){re.escape(local)}$", local, [Conv3dToLinear(kernel_shape=kernel_shape)])
            )
        return transforms
