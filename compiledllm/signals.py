"""One stop policy for the commands that work through many units (run: prompts, eval: policy runs, bench: points).

Inside `stop_on_signals()` (the CLI's run, eval and bench; also a decorator) the first SIGINT or SIGTERM raises
`Stopped`, a KeyboardInterrupt, so that the code that keeps finished work on Ctrl-C handles both, in the main thread:
at once, unless a `shielded()` section runs (a finished unit being recorded: it then raises at that section's end,
so a record is kept whole or not at all), and not at all after `finishing()` (the work is done; its outputs are
being written: the command ends as a finished one). The command then writes what finished, prints one line and exits
128 + the signal (130 SIGINT, 143 SIGTERM). A second signal exits at once with the same code: it removes the
temporaries registered with `on_exit_now` and leaves every file in place as it was (outputs are renamed into place
whole, and an `atomic()` section, a few renames, finishes first). Outside the context nothing changes (the Python
API keeps Python's KeyboardInterrupt).
"""
from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Stopped(KeyboardInterrupt):
    """A stop signal received during a command's work."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class _State:
    active: bool = False
    signum: int | None = None  # the first stop signal received
    shield: int = 0            # depth of shielded() sections
    pending: bool = False      # a signal came inside one: raise at its end
    finishing: bool = False    # the work is done: a first signal is only noted
    atomic: int = 0            # depth of atomic() sections
    exit_after: int | None = None  # a second signal came inside one: exit at its end


_state = _State()
_on_exit: set[Callable[[], None]] = set()  # cleanups of a second signal's immediate exit


def _handle(signum: int, frame) -> None:
    s = _state
    if s.signum is not None:  # the second signal: exit now (after the renames under way)
        if s.atomic:
            s.exit_after = signum
            return
        _exit_now(signum)
    s.signum = signum
    if s.finishing:
        return
    if s.shield:
        s.pending = True
        return
    raise Stopped(signum)


def _exit_now(signum: int) -> None:
    for cleanup in list(_on_exit):
        with contextlib.suppress(Exception):
            cleanup()
    os.write(2, f"stopped at once by a second signal ({signal.Signals(signum).name}); files already in place are as "
                "they were\n".encode())
    os._exit(128 + signum)


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM handled as the module docstring says, until the block ends (main thread only)."""
    global _state
    if _state.active or threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    _state = _State(active=True)
    try:
        for s in STOP_SIGNALS:
            signal.signal(s, _handle)
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _state = _State()


def received() -> int:
    """The stop signal the command got (SIGINT where none was caught here: a plain KeyboardInterrupt)."""
    return _state.signum or signal.SIGINT


def signal_name() -> str:
    return signal.Signals(received()).name


def exit_code() -> int:
    return 128 + received()


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """A first stop signal that arrives inside waits until the block's end."""
    _state.shield += 1
    try:
        yield
    finally:
        _state.shield -= 1
    if not _state.shield and _state.pending and not _state.finishing:
        _state.pending = False
        raise Stopped(_state.signum)


def finishing() -> None:
    """The work is done: a first stop signal from now on lets the command finish (a second still exits at once)."""
    _state.finishing = _state.active


@contextlib.contextmanager
def atomic() -> Iterator[None]:
    """A few renames that belong together: a shielded() section that even a second signal waits for."""
    _state.atomic += 1
    try:
        with shielded():
            yield
    finally:
        _state.atomic -= 1
        if not _state.atomic and _state.exit_after is not None:
            _exit_now(_state.exit_after)


@contextlib.contextmanager
def on_exit_now(cleanup: Callable[[], None]) -> Iterator[None]:
    """`cleanup` (e.g. removing a temporary) runs if a second signal exits while the block runs."""
    _on_exit.add(cleanup)
    try:
        yield
    finally:
        _on_exit.discard(cleanup)


def register(cleanup: Callable[[], None]) -> None:
    """on_exit_now for an object's lifetime: until forget(cleanup)."""
    _on_exit.add(cleanup)


def forget(cleanup: Callable[[], None]) -> None:
    _on_exit.discard(cleanup)
