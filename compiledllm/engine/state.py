"""Static per-slot buffers the decode step reads and updates in place (preallocated once per engine)."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from compiledllm.policies.plan import State


@dataclass
class SlotState:
    seq: torch.Tensor          # [B, T] long: prompt, then generated / MASK tokens up to the working length
    prompt_len: torch.Tensor   # [B] long
    work_len: torch.Tensor     # [B] long: end of the block holding position prompt_len + max_new_tokens - 1
    block_start: torch.Tensor  # [B] long: first position not yet retired (= the cached prefix length)
    active: torch.Tensor       # [B] bool: slot holds a request that is still decoding
    steps: torch.Tensor        # [B] long: forwards made for the slot's request
    retired: torch.Tensor      # [B] long: blocks the last step retired (read by the host sync with `active`)
    key: torch.Tensor          # [B] long: the request's sampling key (policies/sampling.py request_key)
    policy: State              # the policy's per-row state
    params: State = field(default_factory=dict)  # per-request settings the policy reads (Policy.row_params), [B]
    selected: torch.Tensor | None = None  # [B] bool: the rows a row-subset phase runs on (hooks.PhaseRun)
    capacity: int = 0          # KV positions per slot (the pools' stride); seq may be a narrower view (narrow)
    wide: tuple[str, ...] = ()  # the policy buffers whose last axis is the capacity plus a fixed count

    @classmethod
    def allocate(cls, batch: int, capacity: int, policy_state: State, fill: int, device,
                 params: State | None = None, wide: tuple[str, ...] = ()) -> "SlotState":
        zeros = lambda: torch.zeros(batch, dtype=torch.long, device=device)  # noqa: E731
        return cls(seq=torch.full((batch, capacity), fill, dtype=torch.long, device=device), prompt_len=zeros(),
                   work_len=zeros(), block_start=zeros(), active=torch.zeros(batch, dtype=torch.bool, device=device),
                   steps=zeros(), retired=zeros(), key=zeros(), policy=policy_state, params=params or {},
                   selected=torch.zeros(batch, dtype=torch.bool, device=device), capacity=capacity, wide=wide)

    def tensors(self) -> dict[str, torch.Tensor]:
        """Every per-slot buffer by name (policy state and params prefixed), for moving a row."""
        fixed = {f: getattr(self, f) for f in ("seq", "prompt_len", "work_len", "block_start", "active", "steps",
                                              "retired", "key")}
        return fixed | {f"policy.{k}": v for k, v in self.policy.items()} | {f"params.{k}": v
                                                                            for k, v in self.params.items()}

    def view(self, rows: int, first: int = 0) -> "SlotState":
        """Slots [first, first + rows), as views: a step on the view updates these buffers in place."""
        r = slice(first, first + rows)
        return SlotState(self.seq[r], self.prompt_len[r], self.work_len[r], self.block_start[r], self.active[r],
                         self.steps[r], self.retired[r], self.key[r], {k: v[r] for k, v in self.policy.items()},
                         {k: v[r] for k, v in self.params.items()}, None if self.selected is None else self.selected[r],
                         self.capacity, self.wide)

    def narrow(self, width: int) -> "SlotState":
        """Positions [0, width) of every slot, as views (policies/windows.py): the sequence and the `wide` policy
        buffers cut by capacity - width on their last axis; a phase on it updates these buffers in place."""
        cut = self.capacity - width
        policy = {k: v[..., : v.shape[-1] - cut] if k in self.wide else v for k, v in self.policy.items()}
        return replace(self, seq=self.seq[:, :width], policy=policy)

    def move(self, src: int, dst: int) -> None:
        """Slot src's request into slot dst (every buffer's row)."""
        for t in self.tensors().values():
            t[dst] = t[src]

    def place(self, slots: list[int], prompts: list[list[int]], fill: int, rows: dict[str, list]) -> None:
        """Requests into `slots`: each one's sequence its prompt, then `fill`; its policy state zeroed; the buffers
        `rows` names (as `tensors()` does) set to its values. One indexed write a buffer for all the slots: written
        slot by slot, a request cost ~15 small device writes (128 requests: ~12 ms of admission on the CPU)."""
        dev = self.seq.device
        idx = torch.tensor(slots, device=dev)
        width = max(len(p) for p in prompts)
        host = torch.tensor([p + [fill] * (width - len(p)) for p in prompts], dtype=self.seq.dtype)
        self.seq[idx] = fill
        self.seq[idx, :width] = host.to(dev)
        buffers = self.tensors()
        for name, values in rows.items():
            buffers[name][idx] = torch.tensor(values, dtype=buffers[name].dtype).to(dev)
        for v in self.policy.values():
            v[idx] = 0

    def host_view(self, done: torch.cuda.Event | None = None) -> tuple[list[bool], list[int], list[int]]:
        """(active, retired, block_start) per slot: the one host sync of a step (first a sleeping wait on `done`,
        where given)."""
        if done is not None:
            done.record()
            done.synchronize()
        rows = torch.stack([self.active.long(), self.retired, self.block_start]).tolist()
        return [bool(a) for a in rows[0]], rows[1], rows[2]
