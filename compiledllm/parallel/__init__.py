"""Tensor and expert parallelism of the model forward over torch.distributed (gloo on the CPU, NCCL on GPUs):
`mesh = init_mesh(tensor, expert)` on every rank, then `shard_model(model, mesh)` on the loaded model, then the
engine as in one process (every rank runs the same requests and gets the same tokens)."""
from compiledllm.parallel.group import SINGLE, Mesh, init_mesh, main_rank
from compiledllm.parallel.shard import check_divisible, local_config, shard_model

__all__ = ["SINGLE", "Mesh", "check_divisible", "init_mesh", "local_config", "main_rank", "shard_model"]
