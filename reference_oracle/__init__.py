"""An independent reference: Hugging Face transformers, fp32, eager attention. It knows nothing
about the engine; it produces golden token ids and logits for a model directory and prompts, and
finds the first place where another run's tokens part from them."""

from reference_oracle.compare import Divergence, first_divergence
from reference_oracle.oracle import GoldenResult, ReferenceOracle

__all__ = ["Divergence", "GoldenResult", "ReferenceOracle", "first_divergence"]
