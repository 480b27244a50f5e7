"""Up-front memory check, per device and tier, so an oversized batch is a clear error, not an allocator crash."""
from __future__ import annotations

from collections import defaultdict

import torch

from compiledllm.errors import UserError
from compiledllm.kv.cache import Tier


def available_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        if device.index is None:  # "cuda": the current device (the fraction's getter takes no index-less device)
            device = torch.device("cuda", torch.cuda.current_device())
        free, total = torch.cuda.mem_get_info(device)
        # blocks this process's allocator holds but no tensor uses are free to it, though not to the driver (a
        # second engine in one process: compiledllm profile's warm-up, eval's policies one after the other)
        allocated = torch.cuda.memory_allocated(device)
        free += max(0, torch.cuda.memory_reserved(device) - allocated)
        # a process limited by torch.cuda.set_per_process_memory_fraction (a shared card) may use only its share
        fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _: 1.0)(device)
        if fraction < 1.0:
            free = min(free, max(0, int(fraction * total) - allocated))
        return free
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def activation_tier(model, slots: int, capacity: int, block: int, prefill_tokens: int = 0,
                    whole_sequence: bool | None = None) -> Tier:
    """A step's (or a prefill forward's) activations, logits and softmax on the model's device (a generous
    estimate); whole_sequence: some forward covers every position of every slot (default: the model is
    bidirectional)."""
    c = model.config
    whole = model.bidirectional if whole_sequence is None else whole_sequence
    tokens = slots * capacity if whole else max(slots * block, min(prefill_tokens, slots * capacity))
    nbytes = tokens * (4 * c.hidden_size + 3 * c.intermediate_size) * 4 + slots * block * c.vocab_size * 4 * 3
    if whole:  # dense attention scores of the whole sequence
        nbytes += slots * c.num_heads * capacity * capacity * 4
    return Tier("activations", model.device, nbytes)


def check_fits(tiers: list[Tier], slots: int, capacity: int) -> None:
    """Every device must hold what its tiers need (with 10 % to spare)."""
    need: dict[torch.device, list[Tier]] = defaultdict(list)
    for t in tiers:
        need[t.device].append(t)
    for device, ts in need.items():
        total = sum(t.nbytes for t in ts)
        free = available_bytes(device)
        if free is not None and total > 0.9 * free:
            parts = ", ".join(f"{t.name} {t.nbytes / 2**30:.1f}" for t in ts)
            raise UserError(f"batch_size {slots} at {capacity} positions needs about {total / 2**30:.1f} GiB on "
                            f"{device} ({parts}) and 10 % to spare; it has {free / 2**30:.1f} GiB free (lower "
                            "batch_size or max_new_tokens)")


def check_weights_fit(nbytes: int, device: torch.device, what: str) -> None:
    """A model's weights (`nbytes`, counted on the meta device; `what` names them, a plural) must fit in `device`'s
    free memory (with 10 % to spare) before any of them is allocated: on the CPU an oversized model would otherwise
    be allocated lazily and the process killed while its weights are written, with no message."""
    free = available_bytes(device)
    if free is not None and nbytes > 0.9 * free:
        raise UserError(f"{what} need about {nbytes / 2**30:.3g} GiB on {device}, which has {free / 2**30:.1f} GiB "
                        "free")
