"""The ``linear_experts`` fusion: fused 3-D MoE experts become a ModuleList of per-expert ``nn.Linear`` MLPs."""

from .spec import LinearExpertsFusionSpec, LinearExpertsOptions

__all__ = ["LinearExpertsFusionSpec", "LinearExpertsOptions"]
