"""EngineSession: requests join and leave a running engine one step at a time (docs/design.md §1).

A session is allocated and captured once for (slots, KV capacity, batch buckets). `add` queues a request with its
own settings (RequestParams), `cancel` ends one (its slot is free for the next step), `step` runs one schedule
round and returns what happened (BlockEvent: a request's newly retired tokens; FinishEvent: its result), and
`has_work` says whether anything is queued or decoding. Engine.generate, LLM, bench, eval and the data-parallel
replicas are loops over it, as a server is (nano-vllm's LLMEngine.generate over add_request / step).

One step: cancellations; admission of queued requests into the lowest free slots; compaction (live rows moved
into the low slots so the batch bucket follows them); prefill (scheduler.py's rules); the policy's block hook for
rows that begin decoding; the policy's schedule, `before_step`, the step's phases, the one host sync, `after_step`;
then collection (events, finished rows freed) and the block hook for rows that begin a block.
"""
from __future__ import annotations

import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from compiledllm.engine.hooks import HostContext, StepReport, StepView
from compiledllm.engine.memory import activation_tier, check_fits
from compiledllm.engine.phase_times import PhaseTimer
from compiledllm.engine.prefill import Prefiller, Progress
from compiledllm.engine.request import (BlockEvent, Event, FinishEvent, FinishReason, GenerationResult, RequestParams,
                                        working_length)
from compiledllm.engine.scheduler import Counters, RunStats, prefill_pieces, prefill_turn
from compiledllm.engine.state import SlotState
from compiledllm.engine.stepper import Stepper, default_buckets
from compiledllm.errors import UserError
from compiledllm.policies.base import Policy
from compiledllm.policies.sampling import request_key
from compiledllm.policies.windows import narrow, report as width_report
from compiledllm.profiling import phase as profile_range
from compiledllm.threads import follow as follow_threads


@dataclass
class _Request:
    id: int
    prompt: list[int]
    max_new: int
    stop: tuple[str, ...]
    key: int
    params: dict[str, float]
    arrival: float
    slot: int | None = None
    admitted: int = -1                # admission order (prefill serves the earliest first)
    prefill: Progress | None = None
    first_block: float | None = None
    sent: int = 0                     # generated tokens already reported in BlockEvents
    work_len: int = 0                 # its working sequence (st.work_len), set when it takes a slot
    out: list[int] = field(default_factory=list)  # its final tokens read so far (BlockEvents; a stop string's block)


class EngineSession:
    def __init__(self, engine, slots: int, capacity: int, block_events: bool = True,
                 on_startup: Callable[[int, int, str], None] | None = None, shortest: int | None = None):
        """engine: the Engine whose model, policy and settings this session runs; `slots` request slots with a KV
        capacity of `capacity` positions each; block_events: report BlockEvents (off: only FinishEvents; stop
        strings then take effect when a request ends); on_startup: the compile / capture's progress (Stepper);
        shortest: the fewest positions any of its requests will need (default one block): the start-up compiles
        and captures only the phases such requests can run (Policy.phases_for)."""
        self.engine, self.model, self.policy = engine, engine.model, engine.policy
        self.slots, self.capacity, self.block_events = slots, capacity, block_events
        self.block = self.policy.block_size
        self.threads = follow_threads(self.model.device)  # CPU: torch's threads follow the machine (threads.py)
        if engine.compile or engine.prefill_compile:  # but not once compiled: Dynamo guards on the thread count,
            self.threads = None  # so a change recompiles every graph (and the compile's own workers, read as other
            # load, would make one at once)
        self.st, self.kv = self._allocate()
        cfg = engine.config
        buckets = engine.buckets or (default_buckets(slots) if engine.cuda_graphs or not engine.compile else [slots])
        buckets = [b for b in buckets if b <= slots]
        if not buckets or max(buckets) < slots:
            buckets = [*buckets, slots]
        self.eos = -1 if cfg.ignore_eos else self.model.eos_token_id
        self.stepper = Stepper(self.model, self.policy, self.st, self.kv, buckets, engine.compile, engine.cuda_graphs,
                               eos_id=self.eos, on_startup=on_startup,
                               phases=self.policy.phases_for(capacity, shortest or self.block))
        static = engine.static
        # a first step inside prefill runs no host hook: only for policies without them
        hooked = any(getattr(type(self.policy), h) is not getattr(Policy, h)
                     for h in ("on_blocks", "before_step", "after_step"))
        phase = self.policy.prefill_step() if cfg.prefill_first_step and static is None and not hooked else None
        self.prefiller = None if self.kv is None else Prefiller(
            self.model, self.block, cfg.prefill_chunk, cfg.prefill_tokens, static.buckets if static else None,
            compiled=engine.compiles_prefill(self.kv), compile_small=cfg.prefill_compile_small, slots=slots,
            first_step=None if phase is None else (self.policy, phase, self.eos))
        self.host = HostContext(self.model, self.st, self.kv, engine.side_stream)
        self.startup_s = self.stepper.startup_s + self._warm_prefill(on_startup)
        self.compile_cache = self.stepper.cache  # None: not compiled
        self._queue: deque[_Request] = deque()
        self._live: dict[int, _Request] = {}          # every request queued or in a slot, by id
        self._owner: list[_Request | None] = [None] * slots
        self._cancel: set[int] = set()
        self._begun: list[int] = []                    # slots that begin a block with the next step
        self._admitted = 0
        self._counts = Counters()
        self.timer = PhaseTimer(self.model.device) if cfg.phase_times else None
        self.t0 = time.perf_counter()

    def _allocate(self) -> tuple[SlotState, object | None]:
        model, device, policy = self.model, self.model.device, self.policy
        layout = policy.kv_layout(model, self.slots, self.capacity)
        tiers = [activation_tier(model, self.slots, self.capacity, self.block, self.engine.config.prefill_tokens,
                                 whole_sequence=policy.bidirectional)]
        tiers += layout.tiers() if layout is not None else []
        check_fits(tiers, self.slots, self.capacity)
        params = {k: torch.full((self.slots,), float(v), device=device) for k, v in policy.row_params().items()}
        try:
            wide = policy.capacity_state(self.slots, self.capacity, device)
            st = SlotState.allocate(self.slots, self.capacity, policy.init_state(self.slots, device) | wide,
                                    model.mask_token_id, device, params, tuple(wide))
            kv = layout.allocate() if layout is not None else None
        except torch.OutOfMemoryError:
            raise UserError(f"batch_size {self.slots} with {self.capacity} positions does not fit in {device} "
                            "memory") from None
        return st, kv

    # --- requests ------------------------------------------------------------------------------------------------
    def now(self) -> float:
        """Seconds since the session started (after compile / capture)."""
        return time.perf_counter() - self.t0

    def add(self, request_id: int, prompt: list[int], params: RequestParams | None = None,
            arrival: float | None = None) -> None:
        """Queue a request (token ids); it joins a free slot at the next step. arrival: its arrival time on the
        session clock (default now), from which its latency is counted."""
        if request_id in self._live:
            raise UserError(f"request {request_id}: already in this session")
        req = self.prepare(request_id, prompt, params, arrival)
        self._queue.append(req)
        self._live[request_id] = req

    def prepare(self, request_id: int, prompt: list[int], params: RequestParams | None = None,
                arrival: float | None = None) -> _Request:
        """The checks of `add` (prompt, length against the KV capacity, per-request settings) without queueing
        anything: a server's handler threads call it to refuse a request before it reaches the engine's thread."""
        eng, params = self.engine, params or RequestParams()
        prompt = list(eng.check_prompt(request_id, prompt))
        max_new = params.max_new_tokens or eng.max_new_tokens
        need = working_length(len(prompt), max_new, self.block, self.policy.first_block(len(prompt)))
        if need > self.capacity:
            raise UserError(f"request {request_id}: a prompt of {len(prompt)} tokens plus max_new_tokens {max_new} "
                            f"needs {need} positions; this session's KV capacity is {self.capacity}")
        row = self.policy.row_params()
        unknown = sorted(set(params.policy) - set(row))
        if unknown:
            raise UserError(f"policy.{unknown[0]}: not a per-request setting of policy {self.policy.name} "
                            f"(those are: {', '.join(row) or 'none'})")
        if params.stop and self.model.tokenizer is None:
            raise UserError(f"request {request_id}: stop strings need a tokenizer; this model has none")
        seed = self.policy.sampling.seed if params.seed is None else params.seed
        index = request_id if params.noise_index is None else params.noise_index
        return _Request(request_id, prompt, max_new, params.stop, request_key(seed, index), row | params.policy,
                        self.now() if arrival is None else float(arrival))

    def cancel(self, request_id: int) -> bool:
        """End a request at the next step (its FinishEvent says "cancelled"); False if it is not in the session."""
        if request_id not in self._live:
            return False
        self._cancel.add(request_id)
        return True

    def has_work(self) -> bool:
        return bool(self._live)

    @property
    def queued(self) -> int:
        return len(self._queue)

    def slot_of(self, request_id: int) -> int | None:
        """The slot a request decodes in (None: queued, or not in the session)."""
        req = self._live.get(request_id)
        return None if req is None else req.slot

    @property
    def running(self) -> int:
        return sum(o is not None for o in self._owner)

    # --- one step ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> list[Event]:
        begin = time.perf_counter()
        if self.threads is not None:  # between steps: at most every threads.CHECK_S, one /proc/stat read
            self.threads.check()
        events: list[Event] = []
        self._cancellations(events)
        ready = self._admit()
        self._compact()
        admit_s = time.perf_counter() - begin
        ready = [s for s, o in enumerate(self._owner) if o is not None and o.id in ready]
        owner, st, policy = self._owner, self.st, self.policy
        prefilling = [s for s, o in enumerate(owner) if o is not None and o.prefill.left > 0]
        decoding = [s for s, o in enumerate(owner) if o is not None and o.prefill.left == 0 and s not in ready]
        turn = prefilling and prefill_turn(self.engine.config.prefill_priority, len(decoding),
                                           sum(owner[s].first_block is None for s in decoding))
        stepped: list[int] = []  # rows whose prefill made their first step too (Prefiller's first_step)
        t = time.perf_counter()
        if turn:  # (the rows in their first block are counted only while prompts wait)
            # a first_block turn comes as the decoding rows begin a block, so its rows start in step with them; a
            # first step made in its forward would put them a step ahead, which a lockstep policy pays for on most
            # steps after (SDAR-4B, batch 128, H100: 19.0 against 13.9 ms a step, docs/results.md)
            step_too = not (decoding and policy.lockstep and self.engine.config.prefill_priority == "first_block")
            done = self._prefill(prefilling, everyone=turn == "all", events=events, step=step_too)
            ready += done
            stepped = done if self.prefiller.first_step is not None and step_too else []
            if decoding:  # those rows waited for this forward before their next step
                self._counts.stalled(time.perf_counter() - t)
        prefill_s = time.perf_counter() - t
        t = time.perf_counter()  # decode time: the step and the policy's host hooks around it
        ready.sort()
        admitted = [s for s in ready if s not in stepped]  # beginning a block with this step
        if ready:
            st.active[admitted] = True  # (a first step in prefill left its rows' own)
            policy.on_blocks(self.host, ready)
        decoding = sorted(decoding + ready)
        if not decoding:
            self._counts.hooks(t)
            self._counts.note(at=begin - self.t0, admit_s=admit_s, prefill_s=prefill_s, rows=0)
            return events
        view = StepView(tuple(decoding), tuple(sorted(set(self._begun) | set(admitted))), self.host.state,
                        self.capacity, tuple(admitted))
        policy.before_step(self.host, view)
        self._counts.hooks(t)
        before = time.perf_counter() - t
        t = launched = time.perf_counter()
        schedule = narrow(policy.schedule(view), policy.narrow_phases, self.capacity, self.block, view.rows,
                          {s: owner[s].work_len for s in decoding}, self.host.state)
        self.stepper.run(1 + max(decoding), schedule, st.selected, self.timer)
        sync = time.perf_counter()
        report = StepReport(*st.host_view(self.host.wait_for()))  # the one host sync of a step
        wait = time.perf_counter() - sync
        self._counts.sync_s += wait
        if self.timer is not None:
            self.timer.collect()
        st.retired.zero_()
        self._counts.decode_s += time.perf_counter() - t
        self._counts.decode_steps += 1
        t = time.perf_counter()
        policy.after_step(self.host, report)
        self._begun = self._collect(decoding, report, events)
        self._counts.hooks(t)
        self._counts.note(at=begin - self.t0, admit_s=admit_s, prefill_s=prefill_s, before_s=before,
                          launch_s=sync - launched, sync_s=wait, after_s=time.perf_counter() - t, rows=len(decoding),
                          phases=[getattr(r, "phase", r) for r in schedule])
        return events

    def _cancellations(self, events: list[Event]) -> None:
        for rid in sorted(self._cancel):
            req = self._live.get(rid)
            if req is None:
                continue
            if req.slot is None:
                self._queue.remove(req)
            else:
                self.st.active[req.slot] = False
                self._begun = [b for b in self._begun if b != req.slot]
            events.append(FinishEvent(rid, self._finish(req, "cancelled")))
        self._cancel.clear()

    @torch.no_grad()  # as step() runs prefill: grad mode is part of the compiled regions' guards
    def _warm_prefill(self, on_startup: Callable[[int, int, str], None] | None) -> float:
        """Prefill's kernels (on CUDA) and compiled regions built before the first request (Prefiller.warm_up: on a
        cold Triton cache the first prefill otherwise paid seconds, measured 3.7 s of a 4K-token prefill on an
        H100); its seconds."""
        if self.prefiller is None or not self.policy.prefills or not self.prefiller.warms(self.model.device):
            return 0.0
        t = time.perf_counter()
        self.prefiller.warm_up(self.st, self.kv, on_startup)
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)
        return time.perf_counter() - t

    def _admit(self) -> set[int]:
        """Queued requests into free slots, lowest first; returns the ids of those that need no prefill."""
        admit = getattr(self.kv, "admit", None)  # a store that lends rows device memory for prefill (kv/offload.py)
        placed: list[tuple[int, _Request]] = []
        for s in range(self.slots):
            if self._owner[s] is None and self._queue:
                if admit is not None and not admit(s):
                    break
                req = self._queue.popleft()
                req.slot, req.admitted = s, self._admitted
                self._admitted += 1
                self._owner[s] = req
                placed.append((s, req))
        if placed:
            self._place(placed)
        return {req.id for _, req in placed if req.prefill.left == 0}

    def _place(self, placed: list[tuple[int, _Request]]) -> None:
        """Write requests into their slots (SlotState.place: one write a buffer for all of them); each decodes once
        [0, policy.prefill_end) is in its KV (its Progress)."""
        reqs = [req for _, req in placed]
        P = [len(r.prompt) for r in reqs]
        start = [self.policy.first_block(p) for p in P]
        cached = [self.policy.prefill_end(p) if self.kv is not None else 0 for p in P]
        for r, p, b, c in zip(reqs, P, start, cached):
            r.work_len = working_length(p, r.max_new, self.block, b)
            r.prefill = Progress(0, c)
        n = len(reqs)
        rows = {"prompt_len": P, "work_len": [r.work_len for r in reqs], "block_start": start, "steps": [0] * n,
                "active": [c == 0 for c in cached], "retired": [0] * n,
                "key": [r.key for r in reqs]}  # each request's own noise: batch invariant
        rows |= {f"params.{k}": [r.params[k] for r in reqs] for k in self.st.params}
        self.st.place([s for s, _ in placed], [r.prompt for r in reqs], self.model.mask_token_id, rows)

    def _compact(self) -> None:
        """Move the highest live rows into free low slots while that lets a smaller batch bucket hold them all."""
        owner = self._owner
        live = [s for s, o in enumerate(owner) if o is not None]
        if not live:
            return
        target = self.stepper.bucket_for(len(live))
        free = [s for s in range(target) if owner[s] is None]
        for src in sorted((s for s in live if s >= target), reverse=True):
            dst = free.pop(0)
            req = owner[src]
            self.st.move(src, dst)
            if self.kv is not None:
                self.kv.move(src, dst, int(self.st.work_len[dst]))
            owner[dst], owner[src], req.slot = req, None, dst
            self._begun = [dst if b == src else b for b in self._begun]
            self.policy.on_move(self.host, src, dst)

    def _prefill(self, prefilling: list[int], everyone: bool, events: list[Event], step: bool) -> list[int]:
        """Prefill chunk forwards (scheduler.prefill_pieces); returns the slots whose prefill is complete and that
        still decode. Where the forwards made those rows' first step (Prefiller's first_step, unless `step` is
        False), its events are collected here, as a decode step's are."""
        owner = self._owner
        progress = {s: owner[s].prefill for s in prefilling}
        pieces = prefill_pieces(self.prefiller, prefilling, {s: owner[s].admitted for s in prefilling}, progress,
                                everyone)
        t, first_turn = time.perf_counter(), self._counts.prefill_forwards == 0
        with profile_range("prefill"):
            for first, rows in pieces:
                self._counts.prefill_tokens += self.prefiller.run(self.st, self.kv, first, rows, progress, step)
                self._counts.prefill_forwards += 1
            if self.st.seq.device.type == "cuda":
                torch.cuda.synchronize(self.st.seq.device)  # prefill time as spent, not as queued
        dt = time.perf_counter() - t
        self._counts.prefill_s += dt
        if first_turn:
            self._counts.prefill_first_s = dt
        done = [s for s in prefilling if progress[s].left == 0]
        if self.prefiller.first_step is not None and step and done:
            report = StepReport(*self.st.host_view())
            self.st.retired.zero_()
            begun = self._collect(done, report, events)  # a block retired, or the request ended, in its first step
            self._begun = sorted(set(self._begun) | set(begun))
            done = [s for s in done if self._owner[s] is not None]
        return done

    def _collect(self, decoding: list[int], report: StepReport, events: list[Event]) -> list[int]:
        """The step's events for `decoding` (block events, finished requests, their slots freed); returns the rows
        that begin a block with the next step."""
        begun, now = [], self.now()
        new = self._new_tokens(decoding, report) if self.block_events else {}
        final = self._final([s for s in decoding if not report.active[s]], report)
        for s in decoding:
            req = self._owner[s]
            reason = None
            if report.retired[s]:
                if req.first_block is None:
                    req.first_block = now
                if self.block_events:
                    reason = self._block_event(req, new.get(s, []), events)
            if report.active[s] and reason is None:
                if report.retired[s]:
                    begun.append(s)
                continue
            if reason is not None:
                self.st.active[s] = False
            events.append(FinishEvent(req.id, self._finish(req, reason, final.get(s))))
        if begun:
            self.policy.on_blocks(self.host, begun)
        return begun

    def _new_tokens(self, rows: list[int], report: StepReport) -> dict[int, list[int]]:
        """Per row that retired blocks: its tokens made final since its last BlockEvent."""
        spans = {}
        for s in (s for s in rows if report.retired[s]):
            req = self._owner[s]
            spans[s] = (len(req.prompt) + req.sent, min(report.block_start[s], len(req.prompt) + req.max_new))
        return self._read_spans(spans)

    def _final(self, rows: list[int], report: StepReport) -> dict[int, tuple[list[int], int, int]]:
        """Per row that ended with the step: (its output up to max_new, its steps, its block start), every row in
        two copies (not three syncs a row: a burst's rows end in the same step)."""
        if not rows:
            return {}
        reqs = {s: self._owner[s] for s in rows}
        out = self._read_spans({s: (len(r.prompt), len(r.prompt) + r.max_new) for s, r in reqs.items()})
        steps = self.st.steps.tolist()
        return {s: (out.get(s, []), steps[s], report.block_start[s]) for s in rows}

    def _read_spans(self, spans: dict[int, tuple[int, int]]) -> dict[int, list[int]]:
        """seq[s, lo:hi] per slot s of `spans`, every row in one copy (one sync, not one a row)."""
        seq = self.st.seq
        spans = {s: (lo, min(hi, seq.shape[1])) for s, (lo, hi) in spans.items() if min(hi, seq.shape[1]) > lo}
        if not spans:
            return {}
        width = max(hi - lo for lo, hi in spans.values())
        idx = torch.tensor([lo for lo, _ in spans.values()])[:, None] + torch.arange(width)
        at = torch.tensor(list(spans)).to(seq.device)
        got = seq.index_select(0, at).gather(1, idx.clamp(max=seq.shape[1] - 1).to(seq.device)).tolist()
        return {s: row[: hi - lo] for (s, (lo, hi)), row in zip(spans.items(), got)}

    def _block_event(self, req: _Request, new: list[int], events: list[Event]) -> FinishReason | None:
        """Report the request's newly final tokens; returns "stop" when they complete a stop string (then they are
        not reported: the FinishEvent's result carries them, cut where the stop string begins)."""
        if self.eos in new:
            new = new[: new.index(self.eos) + 1]
        if not new:
            return None
        if req.stop and self._stop_at(req, req.out + new):
            req.out += new  # (the result is cut at the stop string)
            return "stop"
        req.sent += len(new)
        req.out += new
        events.append(BlockEvent(req.id, new))
        return None

    def _stop_at(self, req: _Request, out: list[int]) -> tuple[int, int, str] | None:
        """(tokens, characters, the stop string) of the output up to its first stop string, or None: tokens, the
        shortest prefix whose text holds a stop string; characters, where the earliest one in that text begins."""
        decode = self.model.tokenizer.decode
        if not any(x in decode(out) for x in req.stop):
            return None
        holds = lambda n: any(x in decode(out[:n]) for x in req.stop)  # noqa: E731
        n = bisect.bisect_left(range(len(out) + 1), True, key=holds)
        text = decode(out[:n])
        at, stop = min((text.find(x), x) for x in req.stop if x in text)
        return n, at, stop

    def _finish(self, req: _Request, reason: FinishReason | None,
                final: tuple[list[int], int, int] | None = None) -> GenerationResult:
        """The request's result; its slot (if any) is free from now on. final: its output, steps and block start as
        _final read them (else read here)."""
        st, P, s = self.st, len(req.prompt), req.slot
        tok, now = self.model.tokenizer, self.now()
        if s is None:  # cancelled while queued
            out, steps, blocks, extra = [], 0, 0, {}
        else:
            if final is None:
                end = P + req.max_new if reason != "cancelled" else min(int(st.block_start[s]), P + req.max_new)
                out = [] if reason == "stop" else st.seq[s, P:end].tolist()
                final = (out, int(st.steps[s]), int(st.block_start[s]))
            out, steps, block_start = final
            if reason == "stop":  # what the block events read, up to the block that holds the stop string
                out = list(req.out)
            extra = self.policy.report(st, s)
            blocks = (block_start - self.policy.first_block(P)) // self.block
            self._owner[s] = None
            if hasattr(self.kv, "free"):
                self.kv.free(s)
        text = stop = None
        if reason is None or reason == "stop":
            if self.eos in out:
                out, reason = out[: out.index(self.eos) + 1], "eos"
            cut = self._stop_at(req, out) if req.stop else None
            if cut is not None:
                out, reason, stop = out[: cut[0]], "stop", cut[2]
                text = tok.decode(out)[: cut[1]]
            reason = reason or "length"
        if text is None and tok is not None:
            text = tok.decode(out)
        self._counts.generated_tokens += len(out)
        del self._live[req.id]
        first = req.first_block if req.first_block is not None else now
        return GenerationResult(index=req.id, prompt_ids=list(req.prompt), output_ids=out, steps=steps, blocks=blocks,
                                latency_s=now - req.arrival, text=text, extra=extra, arrival_s=req.arrival,
                                first_block_s=first - req.arrival, finish_reason=reason, stop_reason=stop)

    def stats(self) -> RunStats:
        policy = width_report(self.host.state) | self.policy.host_stats(self.host)  # narrowed phases per width
        return self._counts.stats(self.now(), self.startup_s, policy, self.timer.report() if self.timer else {})

    def close(self) -> None:
        """Stop the host worker (a session's buffers go with the object)."""
        self.host.close()
