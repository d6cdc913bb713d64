"""What a model family is to the engine, in one record (`Family`), which each family's file fills
in for its own: its names, how its config.json reads (`ConfigRules`), the module that builds it,
where its checkpoint's tensors land, how llama.cpp stores it (`GGUFLayout`, read through
`GGUFMetadata`), its tokenizer's quirks there and its tool-call format. model/registry.py lists
the records."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from compiled_engine.errors import ModelSourceError
from compiled_engine.model.checkpoint import Layout
from compiled_engine.model.config import ConfigRules, ModelConfig
from compiled_engine.model.layers import DecoderModel
from compiled_engine.model.shard import TPShard

# The rope's own tensors llama.cpp may store: Phi-3's longrope factors, Llama 3.1's divisors.
LONG_FACTORS = "rope_factors_long.weight"
SHORT_FACTORS = "rope_factors_short.weight"
ROPE_FREQS = "rope_freqs.weight"
# (the file's layer norm, ours), after `blk.N.`.
LLAMA_NORMS = (("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm"))


class GGUFMetadata:
    """A GGUF file's metadata, read with its types checked; `arch` reads the family's own keys
    (`{architecture}.{key}`), `tensors` names the file's tensors and `values(name, count)` reads
    a small one (Phi-3's rope factors). weights/gguf_config.py builds it from a file's header."""

    def __init__(
        self,
        path: Path,
        metadata: Mapping[str, Any],
        architecture: str,
        tensors: Collection[str] = (),
        values: Callable[[str, int], list[float]] | None = None,
    ) -> None:
        self.path, self.metadata, self.architecture, self.tensors = path, metadata, architecture, tensors
        self._values = values

    def get(self, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
        value = self.metadata.get(key)
        if value is None:
            if required:
                raise ModelSourceError(f"{self.path}: GGUF metadata '{key}' is missing")
            return default
        if kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            raise ModelSourceError(f"{self.path}: GGUF metadata '{key}' must be {kind.__name__}, got {value!r}")
        return value

    def arch(self, key: str, kind: type, default: Any = None, required: bool = False) -> Any:
        return self.get(f"{self.architecture}.{key}", kind, default, required)

    def values(self, name: str, count: int) -> list[float]:
        assert self._values is not None, "built without a tensor reader"
        return self._values(name, count)

    def fail(self, what: str) -> ModelSourceError:
        return ModelSourceError(f"{self.path}: {what}")


# A family's own config.json fields from its metadata, given the common ones already read.
ConfigFields = Callable[[GGUFMetadata, dict[str, Any]], dict[str, Any]]


def _no_fields(meta: GGUFMetadata, config: dict[str, Any]) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class GGUFExperts:
    """How llama.cpp stores one family's mixture of experts: what its config.json calls the expert
    count and width, what llama.cpp assumes of the router where the file says nothing, and the
    shared expert. Each sparse layer holds `ffn_gate_inp` (the router), `ffn_{gate,up,down}_exps`
    or a merged `ffn_gate_up_exps` ([experts, rows, in] in torch order), and with `shared` the
    `ffn_{gate,up,down}_shexp` and `ffn_gate_inp_shexp` of Qwen2-MoE's gated shared expert.
    With `biases` (gpt-oss) the router and each expert tensor carry a `.bias` too; with
    `interleaved`, the family's fused gate/up features alternate (gate 0, up 0, gate 1, ...) where
    llama.cpp stores gate and up apart."""

    renormalize: bool  # llama.cpp's fixed choice for this architecture (`expert_weights_norm` may say)
    count_key: str = "num_experts"
    width_key: str = "moe_intermediate_size"
    # The config.json key that says whether to renormalise; None: the family always does as
    # `renormalize` says, and a file that says otherwise is refused.
    renormalize_key: str | None = "norm_topk_prob"
    shared: bool = False
    biases: bool = False
    interleaved: bool = False


@dataclass(frozen=True)
class GGUFLayout:
    """How llama.cpp stores one family: its `general.architecture`, the config fields only it has,
    its tensors' names and transformations, and its tokenizer's quirks."""

    architecture: str
    config_fields: ConfigFields = _no_fields
    permuted_qk: bool = False  # q/k rows interleaved per head for llama.cpp's rope
    fused_qkv: bool = False  # q/k/v rows in one `attn_qkv`
    fused_gate_up: bool = False  # gate rows then up rows in one `ffn_up`
    norm_offset: float = 0.0  # every norm stored as ours + this
    layer_norms: tuple[tuple[str, str], ...] = LLAMA_NORMS
    partial_rotary: bool = False  # `rope.dimension_count` may be below the head size
    extra_scalings: tuple[str, ...] = ()  # rope scaling types its config_fields reads
    rope_freqs: bool = False  # may carry ROPE_FREQS (Llama 3.1's rope scaling)
    # A mixture of experts: files of this architecture with `expert_count` are this family's.
    experts: GGUFExperts | None = None
    # Its merges ranked by the tokens' order in the file, not their scores (Gemma's).
    merges_by_position: bool = False
    # "▁" before every piece of text, even one that starts with a space (Phi-3's).
    always_prefixed: bool = False


@dataclass(frozen=True)
class Family:
    """One model family: everything the engine knows of it outside its model code."""

    name: str
    model_types: tuple[str, ...]  # config.json's model_type; the first is what a GGUF's config gets
    classes: tuple[str, ...]  # config.json's architectures, for configs without a model_type
    model: Callable[[ModelConfig, TPShard], DecoderModel]
    checkpoint_layout: Callable[[ModelConfig, TPShard], Layout]
    config: ConfigRules = field(default_factory=ConfigRules)
    gguf: GGUFLayout | None = None  # None: llama.cpp writes it as another family
    tool_call_parser: str = "hermes"  # its format under tool_choice auto when its template renders tools
    # Why tensor parallelism is refused for this family, or None when it runs where heads divide.
    no_tensor_parallel: str | None = None
    # Other model_type values of its checkpoints, refused with this hint.
    refused: Mapping[str, str] = field(default_factory=dict)
