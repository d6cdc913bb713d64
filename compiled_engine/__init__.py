"""compiled_engine: a small LLM inference engine built on an eager PyTorch model."""

import compiled_engine.registrations  # noqa: F401  (registers the optional features before any engine is built)
from compiled_engine.engine.sampling_params import SamplingParams
from compiled_engine.llm import LLM
from compiled_engine.lora.manager import LoRARequest

__version__ = "0.1.0"
__all__ = ["LLM", "LoRARequest", "SamplingParams"]
