"""Literal float64 loops of `mage` and `herald`, written from their descriptions with no engine: a logits_fn for
oracle.literal_decode (threshold decoding) that recomputes the whole working sequence every forward with
tests/oracle.py's forward, where in every selecting layer and KV head each block's rows see, of the prefix before
their block, only the positions their block reads (the first forward of a block that selects: all of it).
Recomputing every row with its own block's visibility gives exactly the K/V a cache holds, since each retired block's
K/V came from a forward where it saw that set.

* A selection: the `keep` positions of [0, prefix) with the largest attention mass (softmax probabilities summed over
  a KV head's query heads and the selecting queries), ties to the lower position.
* mage: each block selects at its first forward with its [MASK] queries, keep = ceil(budget x block start).
* herald: blocks select as mage's when nothing was prepared (the request's first block; a block whose predecessor
  was final before its second forward); otherwise the block reads what the retrieval selected before the previous
  block plus the whole previous block. The retrieval for block m+1 (`draft`: at block m's second forward, from block
  m's draft = the argmax at every masked position of its first forward; `none`: once block m is final, from block
  m) forwards the representative query (the centre [MASK] of block m+1, which sees the prefix and itself; `block`:
  all of block m+1's [MASK]s) over the prefix with block m (or its draft) in place, and keeps
  min(ceil(budget x start(m+1)), start(m)) positions before block m. `retrieval: scan`: the centre [MASK] rides in
  block m's second forward instead (it sees what block m's rows see of the prefix, the draft and itself), and its q
  in each selecting layer scores every key of [0, start(m+1)) (the draft's there): the same count kept by that mass.
"""
from __future__ import annotations

import math

import torch
from checkpoints import MASK_ID
from oracle import _FORWARDS, _arch, literal_decode, load_checkpoint, visibility


class Record(list):
    """Each layer's attention probabilities, and in `qk` its (q, per-query-head k) (oracle.attention fills both)."""

    def __init__(self):
        super().__init__()
        self.qk: list = []


def top_positions(probs: list[torch.Tensor], rows: list[int], prefix: int, keep: int, kvh: int, dense: int
                  ) -> dict[int, list[set[int]]]:
    """Per selecting layer, per KV head: the `keep` positions < prefix with the most mass from query rows `rows`."""
    out = {}
    G = probs[0].shape[1] // kvh
    for layer in range(dense, len(probs)):
        mass = probs[layer][0][:, rows, :prefix].sum(1).view(kvh, G, prefix).sum(1)  # [KVH, prefix]
        out[layer] = [set(sorted(range(prefix), key=lambda t: (-float(mass[h, t]), t))[:keep]) for h in range(kvh)]
    return out


class LiteralSelection:
    def __init__(self, ckpt, block: int, budget: float, dense_layers: int, first_block: int, policy: str = "mage",
                 lookahead: str = "draft", query: str = "center", retrieval: str = "forward"):
        self.cfg, self.w = load_checkpoint(ckpt)
        self.forward = _FORWARDS[_arch(self.cfg)]
        self.B, self.budget, self.dense, self.first = block, budget, dense_layers, first_block
        self.policy, self.lookahead, self.query, self.retrieval = policy, lookahead, query, retrieval
        self.kvh = self.cfg["num_key_value_heads"]
        self.seen: dict[int, dict[int, list[set[int]]]] = {}  # block start -> layer -> KV head -> prefix positions
        self.prepared: dict[int, dict[int, list[set[int]]]] = {}  # block start -> the retrieval's selection
        self.current, self.t, self.draft = None, 0, None

    # --- visibility ----------------------------------------------------------------------------------------------
    def vis(self, layer: int, L: int, full_block: int | None, rows_only: dict[int, set[int]] | None = None):
        """[KVH, L, L]: block-causal; in a selecting layer each block b's rows see self.seen[b] of their prefix
        (full_block: that block sees all of it); rows_only: row -> the only keys that row sees."""
        base = visibility(L, self.B)
        out = base[None].repeat(self.kvh, 1, 1)
        if layer >= self.dense:
            for b in range(self.first, L, self.B):
                if b == full_block or b not in self.seen:
                    continue
                for h in range(self.kvh):
                    hidden = [s for s in range(b) if s not in self.seen[b][layer][h]]
                    out[h, b : b + self.B, hidden] = False
        for r, keys in (rows_only(layer) if callable(rows_only) else rows_only or {}).items():
            out[:, r] = False
            out[:, r, sorted(keys)] = True
        return out

    def run(self, ids: torch.Tensor, full_block=None, rows_only=None):
        probs = Record()
        L = ids.shape[1]
        with torch.no_grad():
            logits = self.forward(self.cfg, self.w, ids, self.B, lambda i: self.vis(i, L, full_block, rows_only), probs)
        return logits, probs

    # --- the selections ------------------------------------------------------------------------------------------
    def keep(self, prefix: int) -> int:
        return math.ceil(self.budget * prefix)

    def prepared_plus_block(self, s: int) -> dict[int, list[set[int]]]:
        prev = set(range(s - self.B, s))
        return {layer: [sel | prev for sel in heads] for layer, heads in self.prepared[s].items()}

    def retrieve(self, prefix_ids: list[int], m: int) -> None:
        """The selection for block m + B from the prefix [0, m) and `prefix_ids` [m, m + B) (final or a draft)."""
        nxt = m + self.B
        ids = torch.tensor([prefix_ids[:nxt] + [MASK_ID] * self.B])
        if self.query == "center":
            c = nxt + self.B // 2
            rows, rows_only = [c], {c: set(range(nxt)) | {c}}
        else:
            rows, rows_only = list(range(nxt, nxt + self.B)), None
        _, probs = self.run(ids, rows_only=rows_only)
        self.prepared[nxt] = top_positions(probs, rows, m, min(self.keep(nxt), m), self.kvh, self.dense)

    def scan(self, prefix_ids: list[int], m: int) -> None:
        """The K-only scan for block m + B during block m's second forward (`prefix_ids` [m, m + B): the draft)."""
        nxt, B = m + self.B, self.B
        c = nxt + B // 2
        ids = torch.tensor([prefix_ids[:nxt] + [MASK_ID] * B])
        probs = Record()
        with torch.no_grad():
            self.forward(self.cfg, self.w, ids, self.B, lambda i: self.centre_vis(i, ids.shape[1], c, m), probs)
        keep, G = min(self.keep(nxt), m), probs[0].shape[1] // self.kvh
        self.prepared[nxt] = {}
        for layer in range(self.dense, len(probs)):
            q, k = probs.qk[layer]  # [1, H, L, hd]
            s = (q[0, :, c, None, :] * k[0, :, :nxt]).sum(-1) * q.shape[-1] ** -0.5  # [H, nxt]
            mass = torch.softmax(s, -1).view(self.kvh, G, nxt).sum(1)[:, :m]
            self.prepared[nxt][layer] = [set(sorted(range(m), key=lambda t: (-float(mass[h, t]), t))[:keep])
                                         for h in range(self.kvh)]

    def centre_vis(self, layer: int, L: int, c: int, m: int) -> torch.Tensor:
        """The centre query of block m + B sees what block m's rows see of the prefix, block m (the draft), itself."""
        out = self.vis(layer, L, None)
        for h in range(self.kvh):
            seen = set(range(m)) if layer < self.dense else self.seen[m][layer][h]
            out[h, c] = False
            out[h, c, sorted(seen | set(range(m, m + self.B)) | {c})] = True
        return out

    def __call__(self, ids: torch.Tensor, block_size) -> torch.Tensor:
        L = ids.shape[1]
        s = L - self.B
        if s != self.current:  # a block's first forward
            if self.policy == "herald" and self.lookahead == "none" and s - self.B >= self.first:
                self.retrieve(ids[0].tolist(), s - self.B)  # block s - B is final now
            self.current, self.t = s, 0
        t, self.t = self.t, self.t + 1
        warm = self.policy == "herald" and s in self.prepared
        if t == 0 and warm:
            self.seen[s] = self.prepared_plus_block(s)
        logits, probs = self.run(ids, full_block=s if t == 0 and not warm else None)
        if t == 0 and not warm:  # MAGE's selection with the block's [MASK] queries
            rows = [r for r in range(s, L) if int(ids[0, r]) == MASK_ID]
            self.seen[s] = top_positions(probs, rows, s, self.keep(s), self.kvh, self.dense)
        if self.policy == "herald" and self.lookahead == "draft":
            block = ids[0, s:].tolist()
            if t == 0:  # the draft: the argmax (MASK excluded, ties to the lower id) at every masked position
                lg = logits[0, s:].clone()
                lg[:, MASK_ID] = float("-inf")
                self.draft = [int(a) if tok == MASK_ID else tok for a, tok in zip(lg.argmax(-1).tolist(), block)]
            elif t == 1 and MASK_ID in block:  # the draft step (not the block's commit): retrieve with the draft
                if self.retrieval == "scan":
                    self.scan(ids[0, :s].tolist() + self.draft, s)
                else:
                    self.retrieve(ids[0, :s].tolist() + self.draft, s)
        return logits


def literal(ckpt, prompt: list[int], *, block: int, threshold: float, new: int, budget: float, dense_layers: int = 2,
            **kw) -> list[int]:
    fn = LiteralSelection(ckpt, block, budget, dense_layers, len(prompt) // block * block, **kw)
    return literal_decode(fn, prompt, policy="threshold", block_size=block, max_new_tokens=new, mask_id=MASK_ID,
                          eos_id=-1, threshold=threshold)
