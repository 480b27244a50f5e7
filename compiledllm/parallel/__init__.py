"""Tensor and expert parallelism of the model forward, and data-parallel engine replicas, over torch.distributed
(gloo on the CPU, NCCL on GPUs): `mesh = init_mesh(tensor, expert, data)` on every rank, then this rank's share of
the model (`load_model(path, mesh=mesh)` reads only its slices of a checkpoint; `shard_model(model, mesh)` cuts a
model in memory), then the engine as in one process (every rank of a replica runs the same requests and gets the
same tokens); with data > 1 each replica runs its share (data.py)."""
from compiledllm.parallel.data import assign_replicas, gather_results, generate_share, replica_share
from compiledllm.parallel.group import SINGLE, Mesh, init_mesh, main_rank
from compiledllm.parallel.shard import check_divisible, local_config, shard_model

__all__ = ["SINGLE", "Mesh", "assign_replicas", "check_divisible", "gather_results", "generate_share", "init_mesh",
           "local_config", "main_rank", "replica_share", "shard_model"]
