"""A test-only server-shaped loop over EngineSession, the way tests/policies/two_block.py shows a policy: nothing in
the package changes for it. Requests arrive at given steps (as a server's handler threads would queue them), each
with its own length; the loop streams every request's block events into its text-so-far, cancels requests on
cue, and stops when the session has no work and nothing is left to arrive."""
from __future__ import annotations

from dataclasses import dataclass, field

from compiledllm.engine import BlockEvent, EngineSession, FinishEvent, RequestParams


@dataclass
class Served:
    streamed: dict[int, list[int]] = field(default_factory=dict)  # request id -> tokens as BlockEvents sent them
    results: dict = field(default_factory=dict)                   # request id -> GenerationResult
    finished_at: dict[int, int] = field(default_factory=dict)     # request id -> the step whose events ended it
    running: list[int] = field(default_factory=list)              # requests in slots after each step
    steps: int = 0


def serve(session: EngineSession, arrivals: dict[int, list[tuple[int, list[int], RequestParams]]],
          cancels: dict[int, list[int]] | None = None, max_steps: int = 10_000) -> Served:
    """arrivals[k]: (request id, prompt, params) added before step k; cancels[k]: ids cancelled before step k."""
    out, cancels = Served(), cancels or {}
    last = max([*arrivals, *cancels, 0])
    while out.steps <= last or session.has_work():
        if out.steps >= max_steps:
            raise RuntimeError("the session did not drain")
        for rid, prompt, params in arrivals.get(out.steps, ()):
            session.add(rid, prompt, params)
            out.streamed[rid] = []
        for rid in cancels.get(out.steps, ()):
            session.cancel(rid)
        for ev in session.step():
            if isinstance(ev, BlockEvent):
                out.streamed.setdefault(ev.request_id, []).extend(ev.tokens)
            elif isinstance(ev, FinishEvent):
                out.results[ev.request_id] = ev.result
                out.finished_at[ev.request_id] = out.steps
        out.running.append(session.running)
        out.steps += 1
    return out
