"""Selection recall of MAGE and HERALD against the per-step oracle (HERALD's Fig. 7 and 9, for this engine's models).

Decodes the prompts densely (`threshold`, exact) and, at every step of every block after a request's first, compares
what each selection would let the block read with the oracle of that step: per selecting layer and KV head, the
ceil(budget x prefix) prefix positions with the largest attention mass from the step's [MASK] queries. Recall = the
share of the oracle's positions the selection holds, averaged over (step, layer, KV head). Selections:

* mage: the block's own first step (its B [MASK] queries over the full prefix), ceil(budget x prefix) positions;
* herald-draft / herald-draft-block: HERALD's retrieval during the previous block (the centre [MASK], or all B) over
  the prefix with the previous block's draft in place, min(ceil(budget x prefix), prefix - B) positions before the
  previous block, plus that whole block;
* herald-omitted: the same centre query with the previous block hidden (no draft);
* herald-completed: the same centre query after the previous block is final (HERALD without lookahead);
* herald-scan: the centre [MASK] as a third group of the previous block's draft step, its q per layer scoring every
  key with the draft in place (the K-only scan variant); herald-scan-int8: the same against an int8 copy of the keys;
* infinigen: the block's [MASK] queries at its first step ranked by InfiniGen's partial scores (`--partial` of the
  head dim after the model's skew, compiledllm/policies/infinigen.py), ceil(budget x prefix) positions.

One dense run serves every budget (selections of different budgets are prefixes of one ranking).

    python tools/bench/selection_recall.py [--model tiny-llada2.1] [--task compiledllm/assets/tasks/retrieval_2k.jsonl]
        [--limit 8] [--new 96] [--budgets 0.01,0.025,0.05,0.1,0.2] [--device cpu] [--out FILE.json]
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import platform
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import compiledllm  # noqa: E402
from compiledllm.engine import Engine, EngineConfig  # noqa: E402
from compiledllm.evaluate import load_tasks  # noqa: E402
from compiledllm.policies import register_policy  # noqa: E402
from compiledllm.attention.spec import AttentionSpec, BlockCausal  # noqa: E402
from compiledllm.policies.herald import HeraldConfig, HeraldPolicy  # noqa: E402
from compiledllm.policies.herald_pool import row_mask  # noqa: E402
from compiledllm.policies.infinigen import skew  # noqa: E402
from compiledllm.policies.plan import Forward, route_groups  # noqa: E402

METHODS = ("mage", "infinigen", "herald-draft", "herald-draft-block", "herald-omitted", "herald-completed",
           "herald-scan", "herald-scan-int8")


@dataclass(frozen=True)
class ProbeConfig(HeraldConfig):
    budget: float = 1.0  # decode exactly: every selection holds the whole prefix
    retrieval: str = "scan"  # the draft step carries the centre query (its scan ranks); the forwards run on top


class ProbePolicy(HeraldPolicy):
    """`herald` at budget 1.0 (dense tokens) that counts, at every step, the [MASK] queries' mass per selecting layer
    and KV head (the oracle), and ranks the prefix by each selection method on the way."""

    name = "selection_probe"
    budgets: tuple[float, ...] = ()
    partial: float = 0.3
    totals: dict = {}

    def kv_layout(self, model, slots, capacity):
        layout = super().kv_layout(model, slots, capacity)
        r = math.ceil(self.partial * model.config.head_dim)
        self.skew = skew(model, self.layers, 512)[..., :r].contiguous().to(model.device)
        return replace(layout, draft=self.block_size)  # the forward retrievals read the draft region too

    def capacity_state(self, batch, capacity, device):
        # wide enough for the draft step's queries too (2B and the centre one)
        mass = torch.zeros(batch, len(self.layers), self.kv_heads, capacity + 2 * self.block_size + 1, device=device)
        scan = torch.zeros(batch, len(self.layers), self.kv_heads, capacity, device=device)
        return {"mass": mass, "probe": torch.zeros_like(mass), "scan": scan, "scan_int8": torch.zeros_like(scan)}

    def plan(self, phase, st):
        fwd = super().plan(phase, st)
        idx, tokens, _ = self.block_window(st)
        queries = (tokens == self.mask_id) & st.active[:, None]
        Q = fwd.tokens.shape[1]
        queries = torch.cat([queries, queries.new_zeros(queries.shape[0], Q - queries.shape[1])], 1)
        width = st.policy["mass"].shape[-1] - 2 * self.block_size - 1 + Q
        stats = replace(fwd.attention, stats=st.policy["mass"][..., :width].transpose(0, 1), stats_queries=queries,
                        stats_layers=self.layers)
        return replace(fwd, attention=stats)

    def after_forward(self, phase, st, fwd, upd, kv):
        st.policy["probe"].add_(st.policy["mass"])
        super().after_forward(phase, st, fwd, upd, kv)
        st.policy["mass"].zero_()
        if phase == "draft":  # the scan's mass, for the host (rows outside this phase keep theirs)
            rows = st.active[None, :, None, None]
            for key, form in (("scan", "exact"), ("scan_int8", "int8")):
                scan = self.scan_mass(st.policy["rep_q"], st.block_start + self.block_size, kv, form)
                st.policy[key].copy_(torch.where(rows, scan, st.policy[key].transpose(0, 1)).transpose(0, 1))

    # --- the rankings --------------------------------------------------------------------------------------------
    def variants(self, host, rows) -> None:
        """After a draft step (the scan prepared the next pool already): the forward retrievals' rankings."""
        st, Bk = host.st, self.block_size
        n = max(rows) + 1
        on = row_mask(st.active[:n], rows)
        target = st.block_start[:n] + Bk
        host.kv.rows(0, n).stage_draft(on, target - Bk)
        ranks = {"herald-draft": self.representative_mass(host, on, target, target, True, "center"),
                 "herald-draft-block": self.representative_mass(host, on, target, target, True, "block"),
                 "herald-omitted": self.representative_mass(host, on, target, target - Bk, False, "center"),
                 "herald-scan": st.policy["scan"][:n].transpose(0, 1),
                 "herald-scan-int8": st.policy["scan_int8"][:n].transpose(0, 1)}
        self._keep(host, rows, target, ranks)

    def on_blocks(self, host, rows):
        st, Bk = host.st, self.block_size
        boundary = [s for s, n in zip(rows, st.steps[rows].tolist()) if n > 0]
        herald = host.state.setdefault("herald_rank", {})
        for key in [key for key in herald if key[0] in rows and key[0] not in boundary]:  # a new request's slot
            del herald[key]
        self._infinigen(host, rows)
        if boundary:
            n = max(boundary) + 1
            target = st.block_start[:n]
            mass = self.representative_mass(host, row_mask(st.active[:n], boundary), target, target, False, "center")
            self._keep(host, boundary, target, {"herald-completed": mass})
        super().on_blocks(host, rows)

    def on_move(self, host, src, dst):
        super().on_move(host, src, dst)
        herald = host.state.get("herald_rank", {})
        for key in [key for key in herald if key[0] in (src, dst)]:
            ranks = herald.pop(key)
            if key[0] == src:
                herald[dst, key[1]] = ranks
        for key in ("mage_rank", "infinigen_rank"):
            if src in host.state.get(key, {}):
                host.state[key][dst] = host.state[key].pop(src)

    def _infinigen(self, host, rows) -> None:
        """The blocks beginning now, ranked as InfiniGen's speculation ranks them at their first step."""
        st, Bk = host.st, self.block_size
        n = max(rows) + 1
        on = row_mask(st.active[:n], rows)
        idx = st.block_start[:n, None] + torch.arange(Bk, device=on.device)
        tokens = st.seq[:n].gather(1, idx.clamp(max=st.seq.shape[1] - 1))
        queries = (tokens == self.mask_id) & on[:, None]
        stats = torch.zeros(len(self.layers), n, self.kv_heads, host.kv.capacity + Bk, device=on.device)
        spec = AttentionSpec(BlockCausal(Bk), prefix_len=st.block_start[:n], stats=stats, stats_queries=queries,
                             stats_layers=self.layers, stats_skew=self.skew)
        fwd = Forward(tokens, idx.clamp(max=host.kv.capacity - 1), spec, kv_write=None,
                      logits_at=torch.zeros(n, 1, dtype=torch.long, device=on.device),
                      logits_rows=torch.zeros(n, 1, dtype=torch.bool, device=on.device),
                      route_groups=route_groups(idx, Bk, on[:, None].expand(n, Bk)))
        host.model(fwd, host.kv.retrieval_rows(0, n, None))
        starts = st.block_start[:n].tolist()
        for s in rows:
            host.state.setdefault("infinigen_rank", {})[s] = (starts[s], _order(stats[:, s, :, : starts[s]]))

    def _keep(self, host, rows, target, ranks) -> None:
        """Per row: the ranking of [0, target - B) by each method's mass, for the block at target."""
        for s in rows:
            t = int(target[s])
            keep = host.state.setdefault("herald_rank", {}).setdefault((s, t), {})
            for name, mass in ranks.items():
                keep[name] = _order(mass[:, s, :, : t - self.block_size])

    def after_step(self, host, report):
        st, h = host.st, self._rows(host)
        probe = st.policy["probe"]
        starts = st.block_start.tolist()
        for s in h["rows"]:
            start = starts[s] - self.block_size * report.retired[s]  # the block this step decoded
            mass = probe[s, :, :, :start]
            if float(probe[s].sum()) == 0.0 or start == 0:  # no [MASK] query (a commit step) or no prefix
                continue
            oracle = _order(mass)
            if h["bstep"][s] == 0:  # MAGE selects with this step's mass
                host.state.setdefault("mage_rank", {})[s] = (start, oracle)
                continue
            mage = host.state.get("mage_rank", {}).get(s)
            herald = host.state.setdefault("herald_rank", {})
            for old in [key for key in herald if key[0] == s and key[1] < start]:  # earlier blocks' (or requests')
                del herald[old]
            ranks = dict(herald.get((s, start), {}))
            if mage is not None and mage[0] == start:
                ranks["mage"] = mage[1]
            infinigen = host.state.get("infinigen_rank", {}).get(s)
            if infinigen is not None and infinigen[0] == start:
                ranks["infinigen"] = infinigen[1]
            self._score(start, oracle, ranks)
        probe.zero_()
        drafted = [s for s in h["rows"] if h["bstep"][s] == 1 and report.active[s] and not report.retired[s]]
        super().after_step(host, report)
        if drafted:
            self.variants(host, drafted)

    def _score(self, start: int, oracle: torch.Tensor, ranks: dict) -> None:
        B = self.block_size
        for budget in self.budgets:
            k = math.ceil(budget * start)
            truth = _top_mask(oracle, k, start)
            for name in METHODS:
                if name not in ranks or (name.startswith("herald") and start < 2 * B):
                    continue
                if not name.startswith("herald"):
                    chosen = _top_mask(ranks[name], k, start)
                else:
                    chosen = _top_mask(ranks[name], min(k, start - B), start)
                    chosen[..., start - B : start] = True  # the previous block, appended whole
                hit = (chosen & truth).sum(-1).double() / k
                total = self.totals.setdefault((name, budget), [0.0, 0])
                total[0] += float(hit.sum())
                total[1] += hit.numel()


def _order(mass: torch.Tensor) -> torch.Tensor:
    """[L, KVH, S] mass -> positions by decreasing mass (ties: the lower position)."""
    return torch.sort(mass.float(), dim=-1, descending=True, stable=True).indices


def _top_mask(order: torch.Tensor, k: int, size: int) -> torch.Tensor:
    out = torch.zeros(*order.shape[:-1], size, dtype=torch.bool)
    out.scatter_(-1, order[..., :k].cpu(), True)
    return out


register_policy("selection_probe", ProbeConfig, ProbePolicy)


def plot(report: dict, path: Path) -> None:
    """Recall against the budget, one line per method (skipped without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for method, recall in report["recall"].items():
        budgets = [float(b) for b in recall]
        ax.plot([b * 100 for b in budgets], list(recall.values()), marker="o", label=method,
                linestyle="--" if method.startswith("herald") else "-")
    ax.set_xscale("log")
    ax.set_xlabel("budget (% of the prefix per layer and KV head)")
    ax.set_ylabel("recall vs the per-step oracle")
    ax.set_ylim(0, 1)
    task = Path(report["task"]).name
    ax.set_title(f"{report['model']} · {task} x {report['prompts']} · {report['new_tokens']} new tokens · "
                 f"{report['device']}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llada2.1")
    ap.add_argument("--task", default="compiledllm/assets/tasks/retrieval_2k.jsonl")
    ap.add_argument("--limit", type=int, default=8)
    ap.add_argument("--new", type=int, default=96, help="new tokens per prompt (EOS ignored: every block decodes)")
    ap.add_argument("--budgets", default="0.01,0.025,0.05,0.1,0.2")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--partial", type=float, default=0.3, help="infinigen's share of the head dim")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=None, help="CPU threads, pinned (default: torch's)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads or torch.get_num_threads())  # pinned: the engine then keeps it for the run
    ProbePolicy.budgets = tuple(float(b) for b in a.budgets.split(","))
    ProbePolicy.totals, ProbePolicy.partial = {}, a.partial
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    model = compiledllm.load_model(a.model, device=a.device, dtype=dtype)
    tasks = load_tasks(Path(a.task), model.tokenizer, limit=a.limit)
    prompts = [t.prompt_ids for t in tasks]
    policy = {"name": "selection_probe", "block_size": 32, "threshold": 0.95}
    cfg = EngineConfig(policy, max_new_tokens=a.new, batch_size=a.batch, ignore_eos=True)
    t0 = time.perf_counter()
    Engine(model, cfg).generate(prompts)
    seconds = time.perf_counter() - t0
    recall = {m: {str(b): (ProbePolicy.totals[(m, b)][0] / ProbePolicy.totals[(m, b)][1])
                  for b in ProbePolicy.budgets if (m, b) in ProbePolicy.totals} for m in METHODS}
    samples = {m: next((ProbePolicy.totals[(m, b)][1] for b in ProbePolicy.budgets if (m, b) in ProbePolicy.totals), 0)
               for m in METHODS}
    report = {"tool": "tools/bench/selection_recall.py", "command": " ".join(sys.argv), "model": a.model,
              "task": a.task, "prompts": len(prompts), "prompt_tokens": [len(p) for p in prompts],
              "new_tokens": a.new, "block": 32, "infinigen_partial": a.partial, "threshold": 0.95,
              "budgets": list(ProbePolicy.budgets),
              "recall": recall, "samples": samples, "seconds": round(seconds, 1),
              "device": a.device if a.device != "cpu" else f"cpu ({platform.processor() or platform.machine()}, "
              f"{torch.get_num_threads()} threads)",
              "date": datetime.date.today().isoformat(), "torch": torch.__version__}
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1) + "\n")
        plot(report, Path(a.out).with_suffix(".png"))
    width = max(len(m) for m in METHODS)
    print(f"recall vs the per-step oracle · {a.model} · {Path(a.task).name} x {len(prompts)} · {a.new} new tokens")
    print(f"{'method':<{width}}  " + "  ".join(f"{b * 100:>6.1f}%" for b in ProbePolicy.budgets) + "  samples")
    for m in METHODS:
        cells = "  ".join(f"{recall[m][str(b)]:7.3f}" if str(b) in recall[m] else "      -"
                          for b in ProbePolicy.budgets)
        print(f"{m:<{width}}  {cells}  {samples[m]}")


if __name__ == "__main__":
    main()
