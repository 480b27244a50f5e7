"""Prefill: the KV of prompts' full blocks, written in chunks batched across rows (docs/design.md §6).

A row's prefill writes positions [0, end) (the prompt's full blocks) chunk by chunk; each chunk is up to `chunk`
positions against the row's cached prefix, block-causal inside. Rows prefilling at the same time share one forward
of [rows, C] tokens when their slots are contiguous (the KV rows of a forward are one view): each row at its own
position, and a row whose prefill ends inside the chunk pads it. Padding starts on a block boundary after the row's
real tokens, so no real query sees it, and it is never written (kv_write -1). Shapes come from small fixed sets
(rows: powers of two or the exported buckets; C: `chunk` divided by powers of two, at least one block). A forward
holds as many rows as fit `max_tokens` at the chunk its rows need, so short prompts share one forward (128 prompts
of 128 tokens: one forward of 16K tokens, where a bound by the longest chunk allowed 4 rows, 32 forwards).

Compiled prefill (`prefill.compile`, issue 31 item 5): the full forward of each chunk size (the most rows of it a
forward holds, `compiled_shapes`), where it has at least COMPILE_MIN_TOKENS tokens, runs the decoder layers as
compiled regions with static shapes, so the float32 elementwise work between the GEMMs (norms, RoPE, residuals,
casts) is fused. The start-up's warm-up compiles exactly those shapes, so no request waits for a compile (one did:
a first use of another shape compiled in the middle of a run for seconds); every other forward (fewer rows, small)
runs eagerly. A shape-generic compile (dynamic shapes) measured slower at 32K prompts (recompiles;
docs/results.md "Prefill"). An eager forward is ~7K ops of host work whatever its rows (36 layers), ~80 ms on an
H100: `prefill.compile_small` compiles the small forwards too (every row count of the smallest chunk, one row of
every chunk), opt-in until its start-up cost and gain are measured.

The first step (`prefill.first_step`, a policy's `prefill_step`): every forward holds one block more per row, C + B
queries. For a row whose prefill ends in the forward, the block after its prefix, [end, end + B), sits right after
its real tokens, where padding would be, and is the request's first decode step: the same queries, attention, KV
writes and update (the policy's, on those rows alone) as that step's own forward, so the tokens are the same and
the request waits one forward less for its first block. For the other rows those B positions are padding.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import torch

from compiledllm.compile_cache import use_cache
from compiledllm.engine.compile import compile_room, compiled_regions
from compiledllm.engine.state import SlotState
from compiledllm.engine.step import finish_phase
from compiledllm.kv.store import KVStore
from compiledllm.policies.plan import window_forward

MIN_CHUNK = 128  # smallest chunk bucket (or one block, if larger): shorter tails pad up to it
COMPILE_MIN_TOKENS = 4096  # the smallest prefill forward (rows x C) that runs compiled (module note)


def warms_prefill(device: torch.device) -> bool:
    """Whether a session builds prefill's kernels at start-up (Prefiller.warm_up): on CUDA, where they are JIT-built
    Triton kernels; on the CPU there is nothing to build."""
    return device.type == "cuda"


@dataclass
class Progress:
    """Host-side prefill progress of one slot: positions [0, done) of [0, end) are in its KV."""

    done: int
    end: int

    @property
    def left(self) -> int:
        return self.end - self.done


def chunk_buckets(chunk: int, block: int) -> list[int]:
    """chunk, chunk / 2, ... down to max(block, MIN_CHUNK), each a whole number of blocks, ascending."""
    top = max(chunk // block, 1) * block
    sizes, c = [], top
    while c >= max(block, MIN_CHUNK) and c % block == 0:
        sizes.append(c)
        c //= 2
    return sorted(set(sizes or [top]))


def split_rows(slots: Sequence[int], sizes: Sequence[int], fits: Callable[[int, int], bool] | None = None
               ) -> list[tuple[int, int]]:
    """(first slot, rows) pieces: contiguous runs of `slots`, each cut greedily into the largest allowed row counts
    for which fits(first slot, rows) holds (a single row always goes)."""
    sizes = sorted(set(sizes), reverse=True)
    pieces, run = [], []
    for s in sorted(slots):
        if run and s != run[-1] + 1:
            pieces += _cut(run, sizes, fits)
            run = []
        run.append(s)
    return pieces + (_cut(run, sizes, fits) if run else [])


def _cut(run: list[int], sizes: list[int], fits: Callable[[int, int], bool] | None) -> list[tuple[int, int]]:
    out, i = [], 0
    while i < len(run):
        n = next((z for z in sizes if z <= len(run) - i and (fits is None or fits(run[i], z))), 1)
        out.append((run[i], n))
        i += n
    return out


class Prefiller:
    """Runs prefill chunk forwards. `max_tokens` bounds one forward's tokens (rows x C): the longest a prefill
    forward can stall rows that are decoding; `slots`: the rows there are (None: no bound). `compiled`: the
    forwards of `compiled_shapes` run the layers as compiled regions (module note)."""

    def __init__(self, model, block: int, chunk: int, max_tokens: int, row_sizes: Sequence[int] | None = None,
                 compiled: bool = False, slots: int | None = None, first_step: tuple | None = None,
                 compile_small: bool = False):
        """first_step: (policy, phase, eos_id): the forwards also make each finishing row's first step (module
        note). compile_small: with `compiled`, the small forwards too (module note)."""
        self.model, self.block, self.max_tokens, self.slots = model, block, max_tokens, slots
        self.first_step = first_step
        self.chunks = chunk_buckets(chunk, block)
        most = max(1, max_tokens // self.chunks[0])  # rows of the smallest chunk in one forward
        # powers of two, and the most that fit (a forward that fills the budget: e.g. just over half a burst, the first
        # piece of prefill.priority first_block)
        rows = sorted(r for r in (row_sizes or {1 << i for i in range(most.bit_length())} | {most}) if r <= most)
        self.row_sizes = rows or [1]
        self.layers = None
        if compiled:
            use_cache()  # Inductor's cache in the user's cache directory, also where the decode step is not compiled
            self.layers = compiled_regions(model).layers
        full = {(r, c) for r, c in {(self.most(c), c) for c in self.chunks} if r * c >= COMPILE_MIN_TOKENS}
        if compile_small:
            small = self.chunks[0]
            full |= {(r, small) for r in self.row_sizes if r <= self.most(small)} | {(1, c) for c in self.chunks}
        self.compiled_shapes = full if compiled else set()

    def most(self, C: int) -> int:
        """The most rows of chunk C one forward holds."""
        rows = max((r for r in self.row_sizes if r * C <= self.max_tokens), default=1)
        return rows if self.slots is None else min(self.slots, rows)

    def chunk_for(self, left: int) -> int:
        """The chunk bucket for a row with `left` positions to prefill: the smallest that holds them, else the
        largest."""
        return next((c for c in self.chunks if c >= left), self.chunks[-1])

    def pieces(self, slots: Sequence[int], progress: Mapping[int, Progress]) -> list[tuple[int, int]]:
        """(first slot, rows) of the forwards that prefill `slots` next: contiguous rows, as many as keep rows x the
        chunk the longest of them needs within max_tokens."""
        def fits(first: int, rows: int) -> bool:
            return rows * self.chunk_for(max(progress[s].left for s in range(first, first + rows))) <= self.max_tokens

        return split_rows(slots, self.row_sizes, fits)

    def run(self, st: SlotState, kv: KVStore, first: int, rows: int, progress: dict[int, Progress],
            step: bool = True) -> int:
        """One chunk forward for slots [first, first + rows) (all prefilling); returns the positions written. With
        `first_step` and `step`, the rows it finishes have made their first step too (active then unless it ended
        them); with `step` False its first-step queries are padding (the forward's shape stays)."""
        slots = range(first, first + rows)
        left = [progress[s].left for s in slots]
        C = self.chunk_for(max(left))
        fwd, logits, finishing = self._forward(st, kv, first, rows, [progress[s].done for s in slots],
                                               [progress[s].end for s in slots], C, step=step)
        if self.first_step is not None and step and any(n <= C for n in left):
            policy, phase, eos = self.first_step
            rows_st = st.view(rows, first)
            step_st = replace(rows_st, active=finishing)  # the rows whose prefill ends here alone take part
            finish_phase(policy, phase, step_st, fwd, logits, eos)
            rows_st.active.copy_(torch.where(finishing, step_st.active, rows_st.active))
        written = 0
        for s, n in zip(slots, left):
            step = min(n, C)
            progress[s].done += step
            written += step
        return written

    def warms(self, device: torch.device) -> bool:
        """Whether warm_up has anything to build: JIT-built kernels (warms_prefill) or compiled shapes."""
        return warms_prefill(device) or bool(self.compiled_shapes)

    def warm_up(self, st: SlotState, kv: KVStore, progress: Callable[[int, int, str], None] | None = None) -> None:
        """One chunk forward of every compiled shape and, where kernels are JIT-built (warms_prefill), of each chunk
        size at one row and of the most rows a forward holds at the smallest and the largest chunk, writing nothing
        (every KV write goes to the spare row; no slot's state changes): the compiled regions' graphs and the kernels
        prefill runs (Triton's JIT on a cold cache, seconds) are built at start-up instead of in the first request's
        prefill. progress(done, total, what): as Stepper's on_startup."""
        shapes = set(self.compiled_shapes)
        if warms_prefill(st.seq.device):
            ends = (self.chunks[0], self.chunks[-1])
            shapes |= {(1, c) for c in self.chunks} | {(self.most(c), c) for c in ends}
        shapes = sorted(shapes)
        what = "compile prefill" if self.layers is not None else "prefill kernels"
        for i, (rows, C) in enumerate(shapes):
            if progress is not None:
                progress(i, len(shapes), f"{what} · {rows} x {C}")
            self._forward(st, kv, 0, rows, [0] * rows, [C] * rows, C, write=False)
        if progress is not None:
            progress(len(shapes), len(shapes), what)

    def _forward(self, st: SlotState, kv: KVStore, first: int, rows: int, done: list[int], ends: list[int],
                 C: int, write: bool = True, step: bool = True):
        """One forward of chunk C (C + B queries with `first_step`; padding where `step` is False); returns its
        Forward, its logits and [rows] bool: the rows whose prefill ends in it."""
        dev, Bk = st.seq.device, self.block
        start = torch.tensor(done, device=dev)
        end = torch.tensor(ends, device=dev)
        Q = C + (Bk if self.first_step is not None else 0)
        pos = start[:, None] + torch.arange(Q, device=dev)
        real = pos < torch.minimum(end, start + C)[:, None]
        finishing = end <= start + C
        cap = st.seq.shape[1]
        seq = st.seq[first : first + rows].gather(1, pos.clamp(max=cap - 1))
        if self.first_step is None:
            live, logits_at, need = real, torch.zeros((rows, 1), dtype=torch.long, device=dev), None  # head: one row
        else:  # the first step's block after the prefix of each row that ends here (module note)
            stepped = (finishing & step)[:, None] & (pos >= end[:, None]) & (pos < end[:, None] + Bk) & (pos < cap)
            live = real | stepped
            logits_at = (end - start).clamp(max=Q - Bk)[:, None] + torch.arange(Bk, device=dev)
            gen = pos.gather(1, logits_at) >= st.prompt_len[first : first + rows, None]
            need = self.first_step[0].needed(seq.gather(1, logits_at), gen, st.view(rows, first).policy)
            need = need & stepped.gather(1, logits_at)
        tokens = torch.where(live, seq, self.model.mask_token_id)
        fwd = window_forward(tokens, pos.clamp(max=cap - 1), start, Bk, live,
                             write=torch.where(live & write, pos, -1), logits_at=logits_at, logits_rows=need)
        if (rows, C) not in self.compiled_shapes:
            return fwd, self.model(fwd, kv.prefill_rows(first, first + rows)), finishing
        with compile_room():
            return fwd, self.model(fwd, kv.prefill_rows(first, first + rows), layers=self.layers), finishing
