"""Engine: slots, batching, the step's phases and results."""
from compiledllm.engine.config import EngineConfig
from compiledllm.engine.engine import Engine, GenerationResult, generate

__all__ = ["Engine", "EngineConfig", "GenerationResult", "generate"]
