"""Narrowed phases: a bidirectional model's step spans its rows' working sequences, not the session's whole KV
capacity (a server's session is sized for its longest request, and every short one would be computed that long).

A phase a policy lists in `Policy.narrow_phases` reads and writes only positions [0, W) of every per-slot buffer
whenever W holds the working sequence of each row it acts on. The engine runs such a phase on the slot state
narrowed to W (SlotState.narrow: the sequence and the policy's capacity-sized buffers cut to W, the KV pool's
stride unchanged). Its name says the width: "<phase>@<W>"; the plain name runs at the whole capacity. W is one of a
few widths, the capacity T and T / 2, T / 4, T / 8 in whole blocks, each compiled and captured as a phase of its
own, and the session runs each phase at the narrowest width that holds the longest working sequence among the rows
it runs on (`narrow`): never narrower than a row needs (that row would see a cut sequence).
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

HALVINGS = 4  # widths T, T/2, T/4, T/8: a few graphs per phase, and a request an eighth of the capacity runs 8x less


def widths(T: int, block: int, halvings: int = HALVINGS) -> tuple[int, ...]:
    """The distinct widths at capacity T, widest first: T / 2^k (k < halvings) rounded up to whole blocks, at most
    T."""
    out: list[int] = []
    for k in range(halvings):
        w = min(T, -(-T // (block << k)) * block)
        if w not in out:
            out.append(w)
    return tuple(out)


def fit(T: int, block: int, need: int, halvings: int = HALVINGS) -> int:
    """The narrowest width that holds `need` positions (T always holds a row)."""
    return [w for w in widths(T, block, halvings) if w >= need or w == T][-1]


def named(phase: str, width: int, T: int) -> str:
    """The name of `phase` narrowed to `width` (the plain name at the whole capacity)."""
    return phase if width >= T else f"{phase}@{width}"


def split(name: str) -> tuple[str, int | None]:
    """(phase, width) of a phase name; width None: the whole capacity."""
    phase, _, width = name.partition("@")
    return phase, int(width) if width else None


def expand(phases: Iterable[str], narrow: Iterable[str], T: int, block: int, shortest: int) -> tuple[str, ...]:
    """Every phase name a session of capacity T can run whose requests each need at least `shortest` positions: a
    phase in `narrow` at each width no narrower than the one `shortest` gets (the session compiles and captures
    these), the others at the whole capacity."""
    narrow = set(narrow)
    reach = [w for w in widths(T, block) if w >= fit(T, block, shortest)]
    return tuple(named(ph, w, T) for ph in phases for w in (reach if ph in narrow else (T,)))


def narrow(schedule: Sequence, narrow_phases: Iterable[str], T: int, block: int, rows: Sequence[int],
           lengths: Mapping[int, int], state: dict) -> list:
    """The step's schedule with each phase of `narrow_phases` at the narrowest width that holds the working
    sequences (`lengths`, per slot) of the rows it runs on (a PhaseRun's own rows, else the step's `rows`); each
    choice counted in `state` (the policy's host state, `report`)."""
    from compiledllm.engine.hooks import PhaseRun  # the engine imports the policies: not at module level

    narrow_phases, out = set(narrow_phases), []
    for entry in schedule:
        run = isinstance(entry, PhaseRun)
        phase, on = (entry.phase, entry.rows) if run else (entry, rows)
        if phase not in narrow_phases or not on:
            out.append(entry)
            continue
        width = fit(T, block, max(lengths[s] for s in on))
        tally(state, "widths", width)
        name = named(phase, width, T)
        out.append(PhaseRun(name, entry.rows) if run else name)
    return out


def tally(state: dict, key: str, width: int) -> None:
    """One more run at `width`, counted in the host state under `key` (`report`)."""
    count = state.setdefault(key, {})
    count[width] = count.get(width, 0) + 1


def report(state: dict, key: str = "widths") -> dict:
    """{key: {width: runs}} of the widths tallied under `key` so far, widest first (nothing if none): by default
    the narrowed phases' (bench's policy_stats)."""
    count = state.get(key)
    return {key: dict(sorted(count.items(), reverse=True))} if count else {}
