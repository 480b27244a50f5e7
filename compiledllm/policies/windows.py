"""Window phases: a forward that spans a row's working sequence, captured at a few fixed widths, so that it computes
about that sequence and not the session's whole KV capacity (a server's session is sized for its longest request).

Phase "decode" spans the capacity T; "decode1" .. "decode3" T / 2, T / 4, T / 8, rounded up to whole blocks (sizes
that coincide keep the first name only). The host runs the narrowest window that holds the step's longest need
(Policy.schedule): a window never runs where a row needs more (that row would see a cut sequence), so a step with no
host schedule (run_step) runs "decode" alone.
"""
from __future__ import annotations

PHASES = ("decode", "decode1", "decode2", "decode3")


def width(phase: str, T: int, block: int) -> int:
    """Query positions of window phase `phase` at capacity T: T / 2^k in whole blocks (k = its number), at most T."""
    k = int(phase.removeprefix("decode") or 0)
    return min(T, -(-T // (block << k)) * block)


def windows(T: int, block: int) -> dict[str, int]:
    """phase -> width at capacity T, distinct widths only, widest first."""
    out: dict[str, int] = {}
    for ph in PHASES:
        w = width(ph, T, block)
        if w not in out.values():
            out[ph] = w
    return out


def smallest(T: int, block: int, need: int) -> str:
    """The phase of the narrowest window that holds `need` positions (the widest, T, always holds a row)."""
    return [ph for ph, w in windows(T, block).items() if w >= need or w == T][-1]


def reachable(T: int, block: int, shortest: int) -> tuple[str, ...]:
    """The window phases a session can run whose requests each need at least `shortest` positions: those no
    narrower than the one `shortest` gets (the session compiles and captures only these)."""
    names = list(windows(T, block))
    return tuple(names[: names.index(smallest(T, block, shortest)) + 1])


def pick(state: dict, T: int, block: int, need: int) -> str:
    """`smallest`, counted in the policy's host state by width (`report`: bench's policy_stats)."""
    phase = smallest(T, block, need)
    count, w = state.setdefault("windows", {}), width(phase, T, block)
    count[w] = count.get(w, 0) + 1
    return phase


def report(state: dict) -> dict:
    """{"decode_windows": {width: steps}} of the windows `pick` chose so far, widest first (nothing if none)."""
    count = state.get("windows")
    return {"decode_windows": dict(sorted(count.items(), reverse=True))} if count else {}
