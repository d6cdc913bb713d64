"""compiled_engine: a small LLM inference engine built on an eager PyTorch model."""

__version__ = "0.1.0"
