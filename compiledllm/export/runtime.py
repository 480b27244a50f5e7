"""Running an exported engine: its metadata, the load probe, and ExportedModel - a model kind of its own with
fixed shapes (`static_shapes`) that runs the packaged forwards in place of a live BlockDiffusionLM."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from compiledllm.attention.spec import BlockCausal, Bidirectional
from compiledllm.errors import UserError
from compiledllm.kv.cache import KVCache
from compiledllm.models.config import ConfigFacts, ModelConfig, MoEConfig
from compiledllm.policies.plan import Forward
from compiledllm.tokenizer import TextTokenizer

EXPORT_FILE = "compiledllm_export.json"
FORMAT = 2  # 2: KV caches with the spare position (kv/cache.py), bidirectional forwards take lengths


@dataclass(frozen=True)
class StaticShapes:
    """What an exported engine was traced for: the engine runs these and nothing else."""

    block: int
    capacity: int
    buckets: tuple[int, ...]


def is_exported(path) -> bool:
    return isinstance(path, (str, Path)) and (Path(path) / EXPORT_FILE).exists()


# run in a child process before a CUDA package is loaded here (see probe_load)
PROBE = "import sys, torch; torch._inductor.aoti_load_package(sys.argv[1])"


def probe_load(package: Path, code: str = PROBE) -> None:
    """Load `package` in a child process first: torch 2.11 + CUDA 13 on the H200 dies with a segmentation fault
    loading any CUDA AOTInductor package (a single nn.Linear too), which would end this process with no message."""
    try:
        res = subprocess.run([sys.executable, "-c", code, str(package)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        raise UserError(f"{package}: loading the exported package took over 10 minutes in a test process") from None
    if res.returncode < 0:
        name = signal.Signals(-res.returncode).name
        raise UserError(f"{package}: torch {torch.__version__} crashes ({name}) loading CUDA AOTInductor packages on "
                        "this machine; run the recipe's model directly (compile: true, cuda_graphs: true) instead "
                        "of the exported engine")
    if res.returncode:
        last = (res.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"{package}: the exported package does not load: {last}")


class ExportedModel(ConfigFacts):
    """Stands in for a BlockDiffusionLM in the engine, running the exported packages. It runs the plans of
    single-window policies: a block-causal forward of one block against the cache (prefill chunks one block at a
    time), or a bidirectional model's whole sequence."""

    def __init__(self, path: Path, meta: dict, device: str):
        cfg = dict(meta["config"])
        moe = cfg.pop("moe")
        self.config = ModelConfig(**cfg, moe=MoEConfig(**moe) if moe else None)
        self.static_shapes = StaticShapes(meta["block_size"], meta["capacity"], tuple(meta["buckets"]))
        self.dtype = getattr(torch, meta["dtype"])
        self.device = torch.device(device)
        self.tokenizer = TextTokenizer.from_dir(path)
        if self.device.type == "cuda":
            probe_load(path / meta["files"][str(meta["buckets"][0])])
        self.runners = {int(b): torch._inductor.aoti_load_package(str(path / f)) for b, f in meta["files"].items()}

    def _runner(self, batch: int):
        if batch not in self.runners:
            raise UserError(f"the exported engine has buckets {list(self.static_shapes.buckets)}; batch {batch} "
                            "was not exported")
        return self.runners[batch]

    def __call__(self, fwd: Forward, kv: KVCache | None = None, layers=None) -> torch.Tensor:
        """float32 logits of fwd.logits_at (every row computed: the package has no row-selective head)."""
        rule, B = fwd.attention.rule, fwd.tokens.shape[0]
        if isinstance(rule, Bidirectional) and fwd.attention.prefix_len is None:
            return self._runner(B)(fwd.tokens, fwd.positions, rule.length, fwd.logits_at)
        bk = self.static_shapes.block
        if not (isinstance(rule, BlockCausal) and rule.block == bk and fwd.attention.prefix_len is not None
                and fwd.attention.kv_index is None and fwd.attention.stats is None):
            raise UserError("an exported engine runs block-causal single-window plans only (threshold, t2t); run "
                            "the recipe's model directly for this policy")
        prefix, logits = fwd.attention.prefix_len, None
        for i in range(0, fwd.tokens.shape[1], bk):  # a prefill chunk: one block at a time through the same package
            cols = slice(i, i + bk)
            logits, k_new, v_new = self._runner(B)(fwd.tokens[:, cols], fwd.positions[:, cols], prefix + i,
                                                   kv.k_full, kv.v_full)
            if fwd.kv_write is not None:
                for n, layer in enumerate(kv.layers):
                    layer.write(fwd.kv_write[:, cols], k_new[:, n], v_new[:, n])
        if fwd.logits_at is not None and fwd.tokens.shape[1] == bk:
            logits = logits.gather(1, fwd.logits_at[..., None].expand(-1, -1, logits.shape[-1]))
        return logits


def same_device(asked: torch.device, exported: torch.device) -> bool:
    """`cuda` asks for the current CUDA device, which an export records with its index (`cuda:0`)."""
    return asked.type == exported.type and (asked.index is None or asked.index == exported.index)


def load_exported(path, device: str | None = None) -> ExportedModel:
    path = Path(path)
    try:
        meta = json.loads((path / EXPORT_FILE).read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path / EXPORT_FILE}: malformed JSON ({e})") from None
    if meta.get("format") != FORMAT:
        raise UserError(f"{path / EXPORT_FILE}: export format {meta.get('format')!r}, this compiledllm reads {FORMAT} "
                        "(export the recipe again)")
    if device is not None and not same_device(torch.device(device), torch.device(meta["device"])):
        raise UserError(f"{path}: exported for {meta['device']}, the recipe asks for {device}")
    return ExportedModel(path, meta, meta["device"])
