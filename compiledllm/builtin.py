"""Built-in models: usable by name without a checkpoint directory (the quickstart's default). What each name is;
loader.load_builtin builds it (this module imports nothing of the loader's)."""
from __future__ import annotations

from pathlib import Path

import torch

ASSETS = Path(__file__).resolve().parent / "assets"

# Name -> how to build it. A random built-in is deterministic everywhere (fixed seed); prompts are token ids.
# A shipped built-in is a checkpoint directory inside the package (see its README.md model card).
BUILTINS = {
    "tiny-llada2": {"path": ASSETS / "tiny-llada2"},  # trained on the Python stdlib by tools/train/train_tiny.py
    # issue 15's yardsticks, trained on the stdlib mixed with generated exact-answer tasks (tools/train/synth_tasks.py):
    "tiny-llada2.1": {"path": ASSETS / "tiny-llada2.1"},  # LLaDA2 MoE, block diffusion + T2T editing, 8K context
    # issue 29's: tiny-llada2.1 fine-tuned with LLaDA2.2's block routing (8 of its 16 experts per 32-token block)
    "tiny-llada2.1-block8": {"path": ASSETS / "tiny-llada2.1-block8"},
    "tiny-llada": {"path": ASSETS / "tiny-llada"},  # LLaDA (bidirectional MHA), masked diffusion, 2K context
    "tiny-llada2-random": {"preset": "tiny-random-llada2", "seed": 0, "routing": "random"},  # its weights as ever
}


def is_builtin(name) -> bool:
    return isinstance(name, str) and name in BUILTINS


@torch.no_grad()
def init_random(model, seed: int, std: float = 0.02, embed_std: float = 1.0, routing: str = "random") -> None:
    """Deterministic normal init on the model's device (norm weights 1, router bias 0). routing "balanced": then
    set attention and router so that MoE routing spreads like a trained load-balanced router's (models/routing.py);
    "random": the plain init (a random router touches few experts per block of MASK tokens)."""
    from compiledllm.models import routing as routing_init

    routing_init.check_routing(routing)
    gen = torch.Generator(device=model.device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        else:
            scale = embed_std if name.startswith(("embed", "lm_head")) else std
            p.copy_(torch.randn(p.shape, generator=gen, device=p.device, dtype=torch.float32) * scale)
    if routing == "balanced":
        routing_init.balance(model)
