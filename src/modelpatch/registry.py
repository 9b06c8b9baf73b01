"""The one registry type of modelpatch: a process-wide, copy-on-write ``key -> value`` table.

Patches (``patching/registry.py``), patchable namespaces (``patching/candidates.py``), conversions
(``conversion/registry.py``) and fusions (``fusions/registry.py``) are each one :class:`Registry`, so they share their
verbs, their guarantees and their error type:

* ``register`` / ``unregister`` are all or nothing: every key is checked first, and a refused call
  (:class:`~modelpatch.errors.RegistryError`, naming every key at fault) leaves the registry exactly as it was;
* every change publishes a new immutable table (copy on write), so ``snapshot()`` is a constant-time read, and a
  snapshot taken earlier (a scope that is open, a load under way) never sees a later change, whole or half-made;
* ``restore(snapshot)`` and ``scoped()`` put a registry back as it was, which is how tests isolate what they register.

Validation of keys and values (a regular expression, a fusion spec) belongs to each registry's own functions, which
check before they call ``register``.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from types import MappingProxyType
from typing import Generic, TypeVar

from .errors import RegistryError

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

_MISSING = object()


class Registry(Generic[K, V]):
    """A thread-safe registry of ``key -> value`` that publishes immutable snapshots.

    Args:
        item: What one entry is, for messages: ``"fusion"`` gives "No fusion named 'x'; available: ..." and "'x' is
            already registered in the fusion registry; ...".
        error: The :class:`RegistryError` subclass raised for refused keys (the registry's domain error).
    """

    def __init__(self, item: str, error: type[RegistryError] = RegistryError):
        if not issubclass(error, RegistryError):
            raise TypeError(f"error must be a subclass of RegistryError, got {error!r}.")
        self.item = item
        self.error = error
        self._lock = threading.Lock()
        # Replaced, never mutated: whoever holds a snapshot holds a table that no later change touches.
        self._entries: Mapping[K, V] = MappingProxyType({})

    def __repr__(self) -> str:
        return f"Registry({self.item!r}, {len(self._entries)} entries)"

    def snapshot(self) -> Mapping[K, V]:
        """The registry's contents now, in registration order: a read-only mapping that later changes leave alone.

        The same object is returned until the registry changes, so callers may cache what they derive from it.
        """
        return self._entries

    def get(self, key: K, default: object = _MISSING) -> V:
        """The value registered under ``key``; ``default`` when it is not registered and one is given.

        Raises:
            RegistryError: ``key`` is not registered and no default is given (the message lists what is).
        """
        entries = self._entries
        if key in entries:
            return entries[key]
        if default is not _MISSING:
            return default  # type: ignore[return-value]
        raise self.error(self._unknown_message([key], entries))

    def register(self, entries: Mapping[K, V], *, overwrite: bool = False) -> None:
        """Add every item of ``entries``; a key already registered keeps its place in the order when replaced.

        Raises:
            RegistryError: A key is already registered and ``overwrite`` is False (every such key is named; nothing
                is registered).
        """
        additions = dict(entries)
        with self._lock:
            clashes = [key for key in additions if key in self._entries]
            if clashes and not overwrite:
                one = len(clashes) == 1
                raise self.error(
                    f"{self._names(clashes)} {'is' if one else 'are'} already registered in the {self.item} registry; "
                    f"pass overwrite=True to replace {'it' if one else 'them'}."
                )
            self._entries = MappingProxyType({**self._entries, **additions})

    def unregister(self, keys: Iterable[K]) -> None:
        """Remove ``keys``, given exactly as they were registered.

        Raises:
            RegistryError: A key is not registered (every such key is named; nothing is removed).
            TypeError: ``keys`` is a string (it would be taken letter by letter): pass ``[key]``.
        """
        if isinstance(keys, str):
            raise TypeError(f"keys must be an iterable of keys, got the string {keys!r}; pass [{keys!r}] for one key.")
        keys = list(keys)
        with self._lock:
            unknown = [key for key in keys if key not in self._entries]
            if unknown:
                raise self.error(self._unknown_message(unknown, self._entries))
            removed = set(keys)
            self._entries = MappingProxyType({k: v for k, v in self._entries.items() if k not in removed})

    def clear(self) -> None:
        """Remove every entry."""
        with self._lock:
            self._entries = MappingProxyType({})

    def restore(self, snapshot: Mapping[K, V]) -> None:
        """Make the registry hold exactly ``snapshot`` (taken earlier with :meth:`snapshot`) again."""
        if not isinstance(snapshot, Mapping):
            raise TypeError(f"snapshot must be a mapping taken with {self!r}.snapshot(), got {snapshot!r}.")
        restored = MappingProxyType(dict(snapshot))  # a copy: a proxy of someone's dict could change under us
        with self._lock:
            self._entries = restored

    @contextmanager
    def scoped(self) -> Iterator[Mapping[K, V]]:
        """Restore the registry, on exit (an exception included), to what it holds on entry; yields that snapshot.

        For tests and examples that register something for a while: ``with fusion_registry.scoped(): ...``. It
        restores the whole table, so it is meant for code that owns the process's registrations while it runs, not
        for library code beside other threads registering concurrently.
        """
        before = self.snapshot()
        try:
            yield before
        finally:
            self.restore(before)

    def _unknown_message(self, unknown: Iterable[K], entries: Mapping[K, V]) -> str:
        available = ", ".join(sorted(map(str, entries))) or "none"
        return f"No {self.item} named {self._names(unknown)}; available: {available}."

    @staticmethod
    def _names(keys: Iterable[K]) -> str:
        return ", ".join(map(repr, keys))
