"""What the doors to other libraries' private APIs share (:mod:`modelpatch._transformers`, :mod:`modelpatch._peft`,
:mod:`modelpatch._torch`): the table of the private names a door relies on, written feature by feature, and the
lookup of one of them when a feature needs it.

The lookup imports the name's module then, so that ``import modelpatch`` never depends on a private name, and
reports a module or attribute the installed release lacks by name, in the door's own error: the installed release,
the name, the feature that needs it, and the releases modelpatch was checked against or what to install. Only that
last part differs from door to door; the door's functions call its ``require`` and ``available``, so that what each
of them needs stays written in the door (the door tests read it there).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Mapping
from typing import Any


def private_api(
    floor: str, features: Mapping[str, Iterable[str]], since: Mapping[str, str] | None = None
) -> dict[str, tuple[str, str]]:
    """A door's table of private names: ``"module:attribute path"`` (no attribute: the module itself) -> (the first
    release that has it, the feature that needs it), from the names each feature needs (``features``). Every name is
    in the door's lowest release ``floor`` but those ``since`` gives a later first release; a name several features
    need is listed for each (its feature reads "one; the other").

    Raises:
        ValueError: ``since`` names a path no feature needs (a release kept for a name the door no longer lists).
    """
    needs: dict[str, list[str]] = {}
    for feature, paths in features.items():
        for path in paths:
            needs.setdefault(path, []).append(feature)
    later = dict(since or {})
    stale = later.keys() - needs.keys()
    if stale:
        raise ValueError(f"first releases given for names no feature needs: {sorted(stale)}")
    return {path: (later.get(path, floor), "; ".join(needed)) for path, needed in needs.items()}


class Door:
    """One library's private names (a :func:`private_api` table, read at each lookup, so a test may add to it) and
    how the door refuses a feature whose name the installed release lacks.

    Args:
        names: the table.
        error: the door's error type (a :class:`~modelpatch.errors.ModelPatchError`).
        installed: the installed library and its release as messages name them (``"torch 2.6.0"``), asked only when
            a name is missing.
        advice: what the message ends with: the releases modelpatch was checked against, what to install.
    """

    def __init__(
        self, names: Mapping[str, tuple[str, str]], error: type[Exception], installed: Callable[[], str], advice: str
    ) -> None:
        self.names = names
        self.error = error
        self.installed = installed
        self.advice = advice

    def require(self, path: str) -> Any:
        """The private name ``path`` of the table, imported and read now (not cached: a module global such as
        transformers' conversion registry's cache is rebound by its library).

        Raises:
            Exception: the door's error, naming the module or attribute the installed release lacks and the feature
                that needs it.
        """
        feature = self.names[path][1]
        module, _, attribute = path.partition(":")
        try:
            value: Any = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            # Only the module asked for (or a package above it) being absent is a missing name; anything else is a
            # broken install, reported as it is.
            if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
                raise
            raise self._missing(module, feature) from None
        for part in attribute.split(".") if attribute else ():
            try:
                value = getattr(value, part)
            except AttributeError:
                raise self._missing(f"{module}.{attribute}", feature) from None
        return value

    def available(self, path: str) -> bool:
        """Whether the installed release has the private name ``path`` of the table."""
        try:
            self.require(path)
        except self.error:
            return False
        return True

    def _missing(self, name: str, feature: str) -> Exception:
        return self.error(f"{self.installed()} lacks {name}, which {feature} needs{self.advice}")
