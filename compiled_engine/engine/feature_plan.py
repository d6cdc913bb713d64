"""Which optional features an engine runs, picked once when it is built.

The engine declares each seam (engine/drafting.py, engine/adapters.py, engine/grammars.py,
engine/pooler.py) and never imports a feature package. Each implementation is registered in
`REGISTRY` by the name of where it lives ("module:attribute"; compiled_engine/registrations.py
holds every line) and imported only when an engine picks it, so a feature that is not asked for
is never loaded.

Building happens in two phases, because a draft model shares the target's page pool and adapters
are put into the model before it is compiled: `plan_features` says what the runner must know
before it loads the model, and the plans' `start` builds each feature around the loaded runner.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from compiled_engine.config import EngineConfig
from compiled_engine.engine.adapters import AdapterSet, NoAdapters
from compiled_engine.engine.drafting import Drafter, NoDrafter
from compiled_engine.engine.grammars import GrammarSet
from compiled_engine.engine.pooler import NoPooler, Pooler
from compiled_engine.errors import ModelConfigError
from compiled_engine.executor.prepare import AdapterSlots, install_no_adapters

if TYPE_CHECKING:
    import torch

    from compiled_engine.executor.runner import Runner, SharedPool
    from compiled_engine.model.config import ModelConfig
    from compiled_engine.model.layers import DecoderModel


class DrafterPlan(Protocol):
    @property
    def shared_pool(self) -> SharedPool | None:
        """What the drafter's own model adds to each page and to the memory budget (None: nothing)."""
        ...

    def start(self, runner: Runner) -> Drafter: ...


class AdapterPlan(Protocol):
    def install(self, model: DecoderModel, config: ModelConfig, max_tokens: int, dtype: torch.dtype) -> AdapterSlots:
        """Put the adapter products into the loaded model, before it is compiled."""
        ...

    def start(self, slots: AdapterSlots, model_config: ModelConfig) -> AdapterSet: ...


GrammarFactory = Callable[[Path | None, int, frozenset[int]], GrammarSet]  # tokenizer.json, vocab, eos ids


@dataclass
class FeatureRegistry:
    """Where each implementation lives, "module:attribute", by the name the engine picks it by."""

    # (SpeculativeConfig, EngineConfig, model dir) -> DrafterPlan, by SpeculativeConfig.method
    drafters: dict[str, str] = field(default_factory=dict)
    adapters: dict[str, str] = field(default_factory=dict)  # "lora": EngineConfig -> AdapterPlan
    grammars: dict[str, str] = field(default_factory=dict)  # "llguidance": a GrammarFactory
    poolers: dict[str, str] = field(default_factory=dict)  # "embed": model dir -> Pooler


REGISTRY = FeatureRegistry()


class _NoDrafterPlan:
    shared_pool = None

    def start(self, runner: Runner) -> Drafter:
        return NoDrafter()


class _NoAdapterPlan:
    def install(self, model: DecoderModel, config: ModelConfig, max_tokens: int, dtype: torch.dtype) -> AdapterSlots:
        return install_no_adapters(model, config, max_tokens, dtype)

    def start(self, slots: AdapterSlots, model_config: ModelConfig) -> AdapterSet:
        return NoAdapters()


@dataclass(frozen=True)
class FeaturePlan:
    drafter: DrafterPlan
    adapters: AdapterPlan
    grammars: GrammarFactory
    pooler: Pooler


def plan_features(config: EngineConfig, model_dir: Path) -> FeaturePlan:
    """The features `config` asks for. A drafter that cannot draft for this model, or a pooling
    the model's files do not describe, fails here, before any weight is read."""
    drafter: DrafterPlan = _NoDrafterPlan()
    if config.speculative is not None:
        drafter = _registered(REGISTRY.drafters, config.speculative.method, "speculative method")(
            config.speculative, config, model_dir
        )
    adapters: AdapterPlan = _NoAdapterPlan()
    if config.enable_lora:
        adapters = _registered(REGISTRY.adapters, "lora", "adapter kind")(config)
    pooler: Pooler = NoPooler()
    if config.runner == "pooling":
        pooler = _registered(REGISTRY.poolers, "embed", "pooler")(model_dir)
    return FeaturePlan(drafter, adapters, _registered(REGISTRY.grammars, "llguidance", "grammar set"), pooler)


def _registered(table: dict[str, str], name: str, what: str) -> Any:
    if name not in table:
        known = ", ".join(sorted(table)) or "none"
        raise ModelConfigError(f"no {what} {name!r} is registered (registered: {known})")
    module, _, attribute = table[name].partition(":")
    found: Any = importlib.import_module(module)
    for part in attribute.split("."):
        found = getattr(found, part)
    return found
