"""Exception types raised by modelpatch.

Every error names what is at fault (a key, class, pattern or file) so that a user can act on it without a debugger.
Each subclasses the built-in exception a caller would naturally catch (``ValueError``, ``TypeError``).

What comes from outside the program (checkpoint files, configs, patch mappings, conversions, fusion specs, the
file system a save writes to) is always reported as a :class:`ModelPatchError`. Only an invalid argument of the
call itself raises a plain ``TypeError`` (wrong type: ``model_class=3``, ``new_parameters="lm_head"``) or
``ValueError`` (a value the parameter does not accept: an unknown dtype name or device, ``unexpected_keys``
other than "warn" / "error" / "ignore", a ``device_map`` naming modules the model does not have).
"""

from __future__ import annotations


class ModelPatchError(Exception):
    """Base class of every error raised by modelpatch."""


class RegistryError(ModelPatchError, ValueError):
    """A registry refused a change or a lookup: a key already registered (without ``overwrite``), an unknown key.

    Every registry of modelpatch (patches, patchable namespaces, conversions, fusions) raises it, or the subclass of
    its domain below, which is one too: ``except RegistryError`` catches the refusals of all of them.
    """


class PatchRegistryError(RegistryError):
    """A patch mapping was rejected: bad pattern, duplicate key, unknown key."""


class PatchError(ModelPatchError, TypeError):
    """A class patch cannot be applied: its replacement fails to build with the arguments of the class it replaces
    (the message names both classes and the patch key; the replacement's own error is the cause)."""


class CheckpointError(ModelPatchError, ValueError):
    """A checkpoint on disk is missing, malformed, truncated, or tries to reach outside its directory."""


class CheckpointPermissionError(CheckpointError, PermissionError):
    """A save would change a directory whose permissions forbid it (a read-only target, or a read-only parent).

    Also a ``PermissionError``, so code that handles file-system permission failures catches it too.
    """


class TransformersVersionError(ModelPatchError, RuntimeError):
    """The installed transformers lacks a private name a modelpatch feature relies on (a release newer or older than
    the supported range). The message names the release, the missing name, the feature and the supported range."""


class TorchVersionError(ModelPatchError, RuntimeError):
    """The installed torch lacks what a modelpatch feature needs (an older release than the one that added it). The
    message names the installed torch, what it lacks, the feature and the torch release it needs."""


class ConversionError(ModelPatchError, ValueError):
    """A weight conversion cannot be planned or applied (incompatible shapes, incomplete groups, ...)."""


class LoadPlanError(ModelPatchError, ValueError):
    """The checkpoint does not cover the model: missing parameters, shape or dtype mismatches.

    Raised before any tensor data is read. ``problems`` groups the offending keys by kind.
    """

    def __init__(self, message: str, problems: dict[str, list[str]]):
        super().__init__(message)
        self.problems = problems


class FusionError(ModelPatchError, ValueError):
    """An unknown fusion name, invalid fusion options, or a fusion spec that cannot be registered."""


class FusionRegistryError(RegistryError, FusionError):
    """The fusion registry refused a name: already registered, or not registered."""


class ConversionRegistryError(RegistryError, ConversionError):
    """The conversion registry refused a key: already registered (built-in ones included), or not registered."""


class SaveError(ModelPatchError, ValueError):
    """A model cannot be saved so that it loads back the same (a substituted module, a quantized tensor subclass,
    PEFT layers). Raised before anything is written; the message names every module at fault."""


class PeftIntegrationError(ModelPatchError, TypeError):
    """PEFT cannot be used this way on a modelpatch model: a non-LoRA adapter on fused projection parts, or a merge into
    a fused layer that is not a plain float Linear."""


class ShardingError(ModelPatchError, ValueError):
    """An operation that a model spread over processes (FSDP2, tensor parallelism) cannot take part in as it is
    sharded; the message names the sharding and what to do instead."""


class TensorParallelError(ModelPatchError, ValueError):
    """A tensor-parallel load that cannot be done as asked: a keyword, or a TP plan rule a fused module cannot
    follow (the message names the module or keyword)."""


class PeftVersionError(PeftIntegrationError):
    """The installed PEFT lacks a private name the PEFT integration relies on (``modelpatch/_peft.py``). The message
    names the release, the missing name, the feature and the releases checked."""
