"""Process groups for tensor x expert parallelism, from torchrun's environment or an explicit rank and world.

Layout: rank = expert_rank * tensor + tensor_rank (tensor ranks adjacent, as Megatron orders them). Attention
and dense MLPs are split over the `tensor` ranks of one expert rank (tensor_group); an MoE layer's routed experts
over the `expert` ranks and each expert's inner dim over the tensor ranks, so its partial outputs sum over all
tensor x expert ranks (model_group). Every rank runs the same requests (the engine is unchanged): the replicated
parts (embedding, norms, router, head) stay bitwise equal across ranks because an all-reduce gives every rank the
same sum."""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from compiledllm.errors import UserError


@dataclass(frozen=True, eq=False)
class Mesh:
    tensor: int
    expert: int
    rank: int
    tensor_group: dist.ProcessGroup | None  # None when tensor == 1 (nothing to sum)
    model_group: dist.ProcessGroup | None   # None in one process

    @property
    def world(self) -> int:
        return self.tensor * self.expert

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor

    @property
    def expert_rank(self) -> int:
        return self.rank // self.tensor


SINGLE = Mesh(1, 1, 0, None, None)


def main_rank() -> bool:
    """Whether this process writes and prints a run's results (rank 0, or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def check_sizes(tensor, expert) -> None:
    for key, n in (("tensor", tensor), ("expert", expert)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UserError(f"parallel.{key}: an integer >= 1, got {n!r}")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


def init_mesh(tensor: int = 1, expert: int = 1, *, rank: int | None = None, world_size: int | None = None,
              init_method: str | None = None, backend: str | None = None) -> Mesh:
    """The Mesh of this process. Starts torch.distributed if it is not running: from torchrun's RANK /
    WORLD_SIZE / MASTER_ADDR / MASTER_PORT, or the given rank, world_size and init_method (e.g.
    tcp://127.0.0.1:PORT); backend default: nccl where CUDA is, else gloo. The world must be tensor x expert ranks.
    Every rank must call this with the same sizes (it creates the tensor groups collectively)."""
    check_sizes(tensor, expert)
    if tensor * expert == 1 and not dist.is_initialized():
        return SINGLE
    if not dist.is_initialized():
        rank = _env_int("RANK") if rank is None else rank
        world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
        if rank is None or world_size is None:
            raise UserError(f"parallel: tensor {tensor} x expert {expert} needs {tensor * expert} processes; start "
                            f"them with torchrun --nproc-per-node {tensor * expert} (RANK / WORLD_SIZE are unset)")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(_env_int("LOCAL_RANK") or 0)  # "cuda" then means this rank's GPU
        dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size)
    world = dist.get_world_size()
    if world != tensor * expert:
        raise UserError(f"parallel: tensor {tensor} x expert {expert} = {tensor * expert} ranks, but {world} "
                        "processes run")
    me = dist.get_rank()
    tensor_group = None
    if tensor > 1 and expert == 1:
        tensor_group = dist.group.WORLD
    elif tensor > 1:
        for e in range(expert):  # new_group is collective: every rank creates every group, keeps its own
            group = dist.new_group([e * tensor + t for t in range(tensor)])
            if me // tensor == e:
                tensor_group = group
    return Mesh(tensor, expert, me, tensor_group, dist.group.WORLD if world > 1 else None)
