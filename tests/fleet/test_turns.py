"""One pass per fleet at a time; a burst of requests costs one more pass, never a lost one."""

from __future__ import annotations

import threading

import pytest

from fleet.turns import Turns


def test_requests_during_a_pass_fold_into_one_more_pass() -> None:
    turns = Turns()
    started, release = threading.Event(), threading.Event()
    runs: list[int] = []

    def work() -> int:
        runs.append(1)
        if len(runs) == 1:
            started.set()
            release.wait(5)
        return len(runs)

    first = threading.Thread(target=lambda: turns.run("k", work, wait=True))
    first.start()
    started.wait(5)
    assert [turns.run("k", work, wait=False) for _ in range(5)] == [None] * 5
    release.set()
    first.join(5)
    assert len(runs) == 2


def test_waiting_callers_run_themselves_and_see_errors() -> None:
    turns = Turns()
    assert turns.run("k", lambda: 42, wait=True) == 42

    def boom() -> None:
        raise RuntimeError("api down")

    with pytest.raises(RuntimeError):
        turns.run("k", boom, wait=True)
    assert turns.run("k", lambda: "free again", wait=False) == "free again"


def test_other_keys_do_not_wait() -> None:
    turns = Turns()
    inside = threading.Event()
    release = threading.Event()
    thread = threading.Thread(target=lambda: turns.run("a", lambda: (inside.set(), release.wait(5)), wait=True))
    thread.start()
    inside.wait(5)
    assert turns.run("b", lambda: "b ran", wait=False) == "b ran"
    release.set()
    thread.join(5)
    turns.forget("a")


def test_once_stopping_nothing_new_starts() -> None:
    """A waiting caller gives up its turn, and the running pass does not go once more for the
    requests that arrived meanwhile."""
    turns = Turns()
    stopping, started, release = threading.Event(), threading.Event(), threading.Event()
    runs: list[int] = []

    def work() -> int:
        runs.append(1)
        started.set()
        release.wait(5)
        return len(runs)

    first = threading.Thread(target=lambda: turns.run("k", work, wait=True, stop=stopping.is_set))
    first.start()
    started.wait(5)
    assert turns.run("k", work, wait=False, stop=stopping.is_set) is None  # folded: one more pass pending
    waiter: list[object] = []
    second = threading.Thread(target=lambda: waiter.append(turns.run("k", work, wait=True, stop=stopping.is_set)))
    second.start()
    stopping.set()
    second.join(5)
    assert not second.is_alive() and waiter == [None]
    release.set()
    first.join(5)
    assert runs == [1]
