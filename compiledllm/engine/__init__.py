"""Engine: slots, batching, the decode step and results."""
from compiledllm.engine.engine import Engine, GenerationResult, generate

__all__ = ["Engine", "GenerationResult", "generate"]
