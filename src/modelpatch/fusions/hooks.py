"""Whether calling a module does more than running its ``forward``.

Fused modules take shortcuts past the modules that stand in their parts' place (packed experts computed at once,
a projection's rows computed from the fused weight) only while calling those modules would compute nothing else:
no hook on them or on every module, no ``forward`` wrapped on the instance (accelerate's offloading hooks).
"""

from __future__ import annotations

from torch import nn
from torch.nn.modules import module as torch_module


def hooked(module: nn.Module) -> bool:
    """Whether calling ``module`` does more than its ``forward``: hooks, or a forward wrapped on the instance."""
    return bool(
        module._forward_hooks
        or module._forward_pre_hooks
        or module._backward_hooks
        or module._backward_pre_hooks
        or "forward" in module.__dict__
    )


def global_hooks() -> bool:
    """Whether hooks registered for every module are in place."""
    return bool(
        torch_module._global_forward_hooks
        or torch_module._global_forward_pre_hooks
        or torch_module._global_backward_hooks
        or torch_module._global_backward_pre_hooks
    )
