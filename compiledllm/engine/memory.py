"""Up-front memory check so an oversized batch is a clear error, not an allocator crash mid-run."""
from __future__ import annotations

import torch

from compiledllm.errors import UserError
from compiledllm.models.base import BlockDiffusionLM


def available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def estimate_bytes(model: BlockDiffusionLM, slots: int, capacity: int, block: int) -> int:
    c = model.config
    item = torch.finfo(model.dtype).bits // 8
    kv = 0 if model.bidirectional else 2 * c.num_layers * slots * capacity * c.num_kv_heads * c.head_dim * item
    tokens = slots * (capacity if model.bidirectional else block)
    activations = tokens * (4 * c.hidden_size + 3 * c.intermediate_size) * 4 + slots * block * c.vocab_size * 4 * 3
    if model.bidirectional:  # dense attention scores of the whole sequence
        activations += slots * c.num_heads * capacity * capacity * 4
    return kv + activations


def check_fits(model: BlockDiffusionLM, slots: int, capacity: int, block: int) -> None:
    need = estimate_bytes(model, slots, capacity, block)
    free = available_bytes(model.device)
    if free is not None and need > 0.9 * free:
        raise UserError(f"batch_size {slots} at {capacity} positions needs about {need / 2**30:.1f} GiB; "
                        f"{model.device} has {free / 2**30:.1f} GiB free (lower batch_size or max_new_tokens)")
