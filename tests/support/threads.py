"""Running a test's function on several threads at once (the races a registry or a scope must survive)."""

from __future__ import annotations

import threading
from collections.abc import Callable


def run_on_threads(target: Callable[[int], object], count: int) -> None:
    """``target(i)`` on ``count`` threads (``i`` from 0), all started before the first is joined; returns once every
    thread has ended. ``target`` records its own outcome: an exception only ends its thread."""
    threads = [threading.Thread(target=target, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
