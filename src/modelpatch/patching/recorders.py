"""Keep transformers' output recorders working when a recorded class is replaced.

transformers collects ``output_attentions`` / ``output_hidden_states`` with forward hooks attached to modules that are
instances of the classes named in a model's ``_can_record_outputs``. A replacement that does not subclass the
original would be skipped. We extend those specs *additively*: the original class stays and the replacement is added
beside it, so a patched model records from its replacement modules and an unpatched model (which has no replacement
instances) records exactly as before. The dicts are updated in place, never resized, so a forward pass installing its
hooks concurrently iterates a consistent dict.

The extension is permanent: transformers installs the hooks lazily, at the first forward that asks for outputs, from
specs keyed by model *class*, so a scoped extension would be gone by the time a patched model needs it (and per-model
hooks installed at build time would make every patched model unpicklable). docs/class_patching.md says so.
"""

from __future__ import annotations

import dataclasses
import sys
import threading

from torch import nn

from .. import _installs

_lock = threading.Lock()
_done: set[tuple[type, type]] = set()


def _covers(existing: object, candidate: object) -> bool:
    """Whether spec item ``existing`` already records every module ``candidate`` would: adding ``candidate`` would
    record each of them twice (``candidate`` targets a subclass of an earlier replacement, say)."""
    from .._transformers import output_recorder_class  # here: importing modelpatch.patching imports no transformers

    OutputRecorder = output_recorder_class()

    if isinstance(candidate, type):
        return isinstance(existing, type) and issubclass(candidate, existing)
    return (
        isinstance(existing, OutputRecorder)
        and isinstance(candidate, OutputRecorder)
        and isinstance(existing.target_class, type)
        and issubclass(candidate.target_class, existing.target_class)
        and dataclasses.replace(existing, target_class=candidate.target_class) == candidate
    )


def _with_replacement(spec: object, original: type, replacement: type) -> object:
    """``spec`` extended so that it also targets ``replacement`` wherever it targets ``original``."""
    from .._transformers import output_recorder_class  # here: importing modelpatch.patching imports no transformers

    OutputRecorder = output_recorder_class()

    specs = spec if isinstance(spec, list) else [spec]
    added: list[object] = []
    for item in specs:
        if item is original:
            candidate: object = replacement
        elif isinstance(item, OutputRecorder) and item.target_class is original:
            candidate = dataclasses.replace(item, target_class=replacement)
        else:
            continue
        if not any(_covers(existing, candidate) for existing in (*specs, *added)):
            added.append(candidate)
    return [*specs, *added] if added else spec


def register_replacement_for_recorders(
    original: type[nn.Module], replacement: type[nn.Module], wraps_original: bool = False
) -> None:
    """Make every ``_can_record_outputs`` of ``original``'s modeling module also target ``replacement``.

    Nothing to do when ``replacement`` subclasses ``original`` (the original's recorders already match it) or when it
    wraps an instance of ``original`` (``wraps_original``): that inner module is recorded, and recording the wrapper
    too would report every output twice.
    """
    if wraps_original or issubclass(replacement, original) or (original, replacement) in _done:
        return
    from transformers import PreTrainedModel

    from .._transformers import recorded_outputs

    with _lock:
        if (original, replacement) in _done:
            return
        module = sys.modules.get(original.__module__)
        seen: set[int] = set()
        for value in list(vars(module).values()) if module is not None else ():
            if not (isinstance(value, type) and issubclass(value, PreTrainedModel)):
                continue
            specs = recorded_outputs(value)
            if not isinstance(specs, dict) or id(specs) in seen:
                continue
            seen.add(id(specs))
            for key, spec in list(specs.items()):
                specs[key] = _with_replacement(spec, original, replacement)
        _done.add((original, replacement))
        _installs.made("output_recorders")
