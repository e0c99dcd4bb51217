"""Taking turns: one reconcile per fleet at a time, with requests arriving meanwhile folded into one."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")
STOP_POLL_SECONDS = 0.1  # how often a caller waiting for its turn looks whether it should give up


@dataclass
class _Turn:
    lock: threading.Lock = field(default_factory=threading.Lock)
    pending: bool = False


class Turns:
    """Serialises passes per key; a burst of child events costs one or two passes, not one each."""

    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._turns: dict[Hashable, _Turn] = {}

    def run(self, key: Hashable, fn: Callable[[], T], *, wait: bool,
            stop: Callable[[], bool] = lambda: False) -> T | None:
        """Run fn for key. wait=False hands the work to a pass already running (returns None).

        Once stop() is true nothing new starts: a waiting caller gives up its turn (None) and the
        running pass does not go once more for the requests that arrived meanwhile."""
        with self._guard:
            turn = self._turns.setdefault(key, _Turn())
            if not wait and not turn.lock.acquire(blocking=False):
                turn.pending = True  # the running pass will go once more
                return None
        if wait:
            while not turn.lock.acquire(timeout=STOP_POLL_SECONDS):
                if stop():
                    return None
        try:
            while True:
                with self._guard:
                    turn.pending = False
                result = fn()
                with self._guard:
                    # Released under the guard, so a request cannot slip in between the last
                    # look at `pending` and the release and then be lost.
                    if not turn.pending or stop():
                        turn.lock.release()
                        return result
        except BaseException:
            with self._guard:
                turn.lock.release()
            raise

    def forget(self, key: Hashable) -> None:
        """Drop the bookkeeping of a fleet that is gone."""
        with self._guard:
            turn = self._turns.get(key)
            if turn is not None and not turn.lock.locked():
                del self._turns[key]
