"""Engine: slots, batching, the step's phases and results."""
from compiledllm.engine.config import EngineConfig
from compiledllm.engine.engine import Engine, generate
from compiledllm.engine.request import BlockEvent, FinishEvent, GenerationResult, RequestParams
from compiledllm.engine.session import EngineSession

__all__ = ["BlockEvent", "Engine", "EngineConfig", "EngineSession", "FinishEvent", "GenerationResult", "RequestParams",
           "generate"]
