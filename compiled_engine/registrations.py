"""Every optional feature's registration, one line each: where its implementation lives,
imported only when an engine picks it (engine/feature_plan.py says how)."""

from compiled_engine.engine.feature_plan import REGISTRY

REGISTRY.drafters["ngram"] = "compiled_engine.speculative.drafts:NgramDrafter.plan"
REGISTRY.drafters["draft_model"] = "compiled_engine.speculative.draft_model:DraftModelDrafter.plan"
REGISTRY.adapters["lora"] = "compiled_engine.lora.manager:LoRAPlan"
REGISTRY.grammars["llguidance"] = "compiled_engine.structured.grammar_set:LLGuidanceGrammars"
REGISTRY.poolers["embed"] = "compiled_engine.pooling.embedding:EmbeddingPooler"
