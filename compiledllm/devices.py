"""Device and dtype names: the parsers that the loader, the export runtime, recipes and `save` share (a leaf module:
it imports nothing of compiledllm's but errors)."""
from __future__ import annotations

import torch

from compiledllm.errors import UserError

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16, "half": torch.float16}
DEVICE_TYPES = ("cpu", "cuda")


def parse_dtype(dtype, what: str = "model.dtype") -> torch.dtype:
    """A floating torch dtype from a torch.dtype or one of DTYPES' names."""
    if isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        return dtype
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    raise UserError(f"{what}: {dtype!r} is not one of float32, bfloat16, float16")


def available_devices() -> list[str]:
    return ["cpu", *(f"cuda:{i}" for i in range(torch.cuda.device_count()))]


def parse_device(value, what: str = "model.device") -> torch.device:
    """A device this process can place a model on (cpu, cuda, cuda:N of an existing GPU), from a string or a
    torch.device; anything else is a UserError naming `what` and the devices there are."""
    here = f"available here: {', '.join(available_devices())}"
    if not isinstance(value, (str, torch.device)):
        raise UserError(f"{what}: expected a device name such as cpu or cuda:0, got {value!r} ({here})")
    try:
        device = torch.device(value)
    except RuntimeError:  # torch's message lists every device type it knows, most of which compiledllm never runs
        raise UserError(f"{what}: {str(value)!r} is not a device name ({here})") from None
    if device.type not in DEVICE_TYPES:
        raise UserError(f"{what}: compiledllm runs models on cpu or cuda, not {device.type!r} ({here})")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"{what}: {value}: CUDA is not available in this process ({here})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise UserError(f"{what}: {value} does not exist ({here})")
    return device
