"""Process groups for data x tensor x expert parallelism, from torchrun's environment or an explicit rank and world.

Layout: rank = replica * (tensor * expert) + expert_rank * tensor + tensor_rank (tensor ranks adjacent, as Megatron
orders them; each engine replica's ranks adjacent). Attention and dense MLPs are split over the `tensor` ranks of
one expert rank (tensor_group); an MoE layer's routed experts over the `expert` ranks and each expert's inner dim
over the tensor ranks, so its partial outputs sum over all tensor x expert ranks of the replica (model_group). The
ranks of one replica run the same requests (the engine is unchanged): the replicated parts (embedding, norms,
router, head) stay bitwise equal across them because an all-reduce gives every rank the same sum. The `data`
replicas are independent engines, each decoding its share of the requests (data.py)."""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from compiledllm.errors import UserError


@dataclass(frozen=True, eq=False)
class Mesh:
    tensor: int
    expert: int
    rank: int  # within this rank's replica (its model-local rank)
    tensor_group: dist.ProcessGroup | None  # None when tensor == 1 (nothing to sum)
    model_group: dist.ProcessGroup | None   # the replica's ranks; None when it is one process
    data: int = 1
    replica: int = 0  # this rank's engine replica

    @property
    def world(self) -> int:
        """Ranks one model is split over (one replica)."""
        return self.tensor * self.expert

    @property
    def tensor_rank(self) -> int:
        return self.rank % self.tensor

    @property
    def expert_rank(self) -> int:
        return self.rank // self.tensor

    @property
    def leader(self) -> bool:
        """Whether this rank reports its replica's results (model-local rank 0: the others decoded the same)."""
        return self.rank == 0


SINGLE = Mesh(1, 1, 0, None, None)


def main_rank() -> bool:
    """Whether this process writes and prints a run's results (rank 0, or the only process)."""
    return not dist.is_initialized() or dist.get_rank() == 0


def check_sizes(tensor, expert, data=1) -> None:
    for key, n in (("tensor", tensor), ("expert", expert), ("data", data)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise UserError(f"parallel.{key}: an integer >= 1, got {n!r}")


def check_one_process(tensor: int, expert: int, data: int, what: str) -> None:
    """`what` runs one whole model in this process: a recipe's parallel sizes above 1 are refused, not ignored."""
    if tensor * expert > 1:
        raise UserError(f"parallel.tensor={tensor} x parallel.expert={expert}: {what} runs the whole model in one "
                        f"process; a split model runs with `compiledllm run` under torchrun (torchrun "
                        f"--nproc-per-node {tensor * expert * data} -m compiledllm run RECIPE)")
    if data > 1:
        raise UserError(f"parallel.data={data}: {what} runs one engine in this process; replicas run with "
                        f"`compiledllm run` under torchrun (torchrun --nproc-per-node {data} -m compiledllm run "
                        "RECIPE)")


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"environment variable {name}={value!r} is not an integer") from None


TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")  # what torchrun sets


def _check_env(sizes: str, need: int, names: tuple[str, ...]) -> None:
    """The torchrun environment that torch.distributed's env:// start reads (`names` of TORCHRUN_ENV), checked
    before it starts: a variable it lacks would be a traceback from torch, not a line saying what to set."""
    missing = [n for n in names if not os.environ.get(n)]
    start = f"start them with torchrun --nproc-per-node {need}"
    if "RANK" in missing and "WORLD_SIZE" in missing:  # not under torchrun at all
        raise UserError(f"parallel: {sizes} needs {need} processes; {start} (RANK / WORLD_SIZE are unset)")
    if missing:
        raise UserError(f"parallel: {sizes}: the environment variable{'s' * (len(missing) > 1)} "
                        f"{', '.join(missing)} {'are' if len(missing) > 1 else 'is'} unset (torch.distributed's "
                        f"env:// start needs {', '.join(names)}; {start}, which sets them)")
    for n in names[:-2]:  # the ranks and the world size
        _env_int(n)
    port = _env_int("MASTER_PORT")
    if not 0 < port < 65536:
        raise UserError(f"environment variable MASTER_PORT={port} is not a TCP port (1-65535)")
    addr = os.environ["MASTER_ADDR"]
    try:  # torch would retry an address that does not resolve until its timeout (30 minutes)
        socket.getaddrinfo(addr, port)
    except (OSError, UnicodeError) as e:
        raise UserError(f"environment variable MASTER_ADDR={addr!r} does not resolve ({e})") from None


def _own_group(blocks: list[list[int]], me: int) -> dist.ProcessGroup:
    """The group of the block (blocks partition the world) holding rank `me`; one block is the world itself.
    new_group is collective: every rank creates every group, in the same order, and keeps its own."""
    if len(blocks) == 1:
        return dist.group.WORLD
    own = None
    for block in blocks:
        group = dist.new_group(block)
        if me in block:
            own = group
    return own


def init_mesh(tensor: int = 1, expert: int = 1, data: int = 1, *, rank: int | None = None,
              world_size: int | None = None, init_method: str | None = None, backend: str | None = None) -> Mesh:
    """The Mesh of this process. Starts torch.distributed if it is not running: from torchrun's RANK /
    WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (checked first: one missing is a UserError naming it), or
    the given rank, world_size and init_method (e.g.
    tcp://127.0.0.1:PORT); backend default: nccl where CUDA is, else gloo (one GPU per rank: LOCAL_RANK's). The
    world must be data x tensor x expert ranks. Every rank must call this with the same sizes (it creates the
    groups collectively)."""
    check_sizes(tensor, expert, data)
    split, need = tensor * expert, data * tensor * expert
    sizes = f"data {data} x tensor {tensor} x expert {expert}"
    if need == 1 and not dist.is_initialized():
        return SINGLE
    if not dist.is_initialized():
        if init_method in (None, "env://"):  # torchrun's variables; a given rank / world_size stands in for its own
            given = {"RANK": rank, "LOCAL_RANK": rank, "WORLD_SIZE": world_size}
            _check_env(sizes, need, tuple(n for n in TORCHRUN_ENV if given.get(n) is None))
        rank = _env_int("RANK") if rank is None else rank
        world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
        if rank is None or world_size is None:
            raise UserError(f"parallel: {sizes} needs {need} processes; start them with torchrun "
                            f"--nproc-per-node {need} (RANK / WORLD_SIZE are unset)")
        if not 0 <= rank < world_size:
            raise UserError(f"parallel: rank {rank} of {world_size} processes: RANK must lie in [0, WORLD_SIZE)")
        if world_size != need:  # before the start, which would wait for ranks that do not exist
            raise UserError(f"parallel: {sizes} = {need} ranks, but {world_size} processes run")
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        if backend == "nccl":
            torch.cuda.set_device(_env_int("LOCAL_RANK") or 0)  # "cuda" then means this rank's GPU
        try:
            dist.init_process_group(backend, init_method=init_method or "env://", rank=rank, world_size=world_size)
        except (RuntimeError, ValueError) as e:  # an address that does not resolve, a port taken (DistNetworkError)
            where = init_method or f"env:// (MASTER_ADDR={os.environ['MASTER_ADDR']}, MASTER_PORT=" \
                                   f"{os.environ['MASTER_PORT']})"
            raise UserError(f"parallel: torch.distributed did not start at {where}, rank {rank} of {world_size}: "
                            f"{' '.join(str(e).split())[:200]}") from None
    world = dist.get_world_size()
    if world != need:
        raise UserError(f"parallel: {sizes} = {need} ranks, but {world} processes run")
    me = dist.get_rank()
    replica = me // split
    model_group = _own_group([list(range(d * split, (d + 1) * split)) for d in range(data)], me) if split > 1 else None
    tensor_group = None
    if tensor > 1 and expert == 1:
        tensor_group = model_group  # the replica's ranks are its tensor ranks
    elif tensor > 1:
        tensor_group = _own_group([list(range(b, b + tensor)) for b in range(0, world, tensor)], me)
    return Mesh(tensor, expert, me % split, tensor_group, model_group, data, replica)
