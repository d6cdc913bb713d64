"""Every optional feature's registration, one line each (engine/feature_plan.py says how they
are picked). The package imports this module first, so the registry is full before any engine is
built."""

from compiled_engine.engine.feature_plan import REGISTRY
from compiled_engine.lora.manager import LoRAPlan
from compiled_engine.pooling.embedding import EmbeddingPooler
from compiled_engine.speculative.draft_model import DraftModelDrafter
from compiled_engine.speculative.drafts import NgramDrafter
from compiled_engine.structured.grammar_set import LLGuidanceGrammars

REGISTRY.drafters["ngram"] = NgramDrafter.plan
REGISTRY.drafters["draft_model"] = DraftModelDrafter.plan
REGISTRY.adapters["lora"] = LoRAPlan
REGISTRY.grammars["llguidance"] = LLGuidanceGrammars
REGISTRY.poolers["embed"] = EmbeddingPooler
