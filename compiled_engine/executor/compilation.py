"""How the model runs: eager (the plain reference), or compiled.

Compiled, every decoder layer runs one compiled code object (its weights are graph inputs, not
constants), so compile time is that of one layer, and the token count is the one dynamic
dimension. Attention is an opaque operator (attention/op.py) inside it. Two ways in:
- a step of one token (batch-1 decode, where host work is a large share of the step) runs the
  whole forward (embedding, every layer, the final norm) as one compiled entry, so it pays
  Dynamo's guards and wrappers once instead of once per layer. The layer is a
  `nested_compile_region` in it: Dynamo traces each layer call, but Inductor compiles the
  layer's code once and every layer calls it;
- a step of several tokens (prompts, batched decode) runs the forward eagerly around the layers,
  each compiled on its own with the token count marked dynamic: per-layer guards cost little
  beside such a step, and this graph compiles in a fraction of the time of a whole-forward one
  with a symbolic token count.
The page count of the pool is dynamic too (the warm-up's scratch cache and the real pool share
the graphs).

Both ways go through `CompiledBlock`, a module put in each decoder layer's place (`setattr` on
the layer list) that holds the layer. How each product runs (the packed CPU kernel, the
quantized kernels, LoRA) is decided before, by the product walk (linear/install.py): this module
only compiles. Where a CPU head keeps its dense weight (its packed copy cannot be read in its
blocked layout, or the head is quantized), its one-row product is compiled on its own.
Tensor-parallel (DTensor) weights keep the plain Linear, and every step runs the layers compiled
one by one (nested compile regions do not take DTensor yet).
"""

from __future__ import annotations

import logging
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch._inductor.config
from torch import nn
from torch._inductor.runtime.cache_dir_utils import default_cache_dir
from torch.distributed.tensor import DTensor

from compiled_engine.cache_paths import INDUCTOR_CACHE_ENV
from compiled_engine.executor.precompiled import PrecompiledFunction, model_signature
from compiled_engine.linear.packed_cpu import CpuLinear
from compiled_engine.model.layers import DecoderLayer, DecoderModel

logger = logging.getLogger(__name__)


def use_compile_cache(cache_dir: Path) -> Path:
    """Keep Inductor's FX-graph and AOTAutograd caches in `cache_dir` (unless the user already
    chose a directory with TORCHINDUCTOR_CACHE_DIR), so a second start of the same model reuses
    the first one's compiled kernels. Importing torch._dynamo writes Inductor's default (a
    directory under /tmp) into that variable, so the default does not count as a choice."""
    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if chosen and os.path.abspath(chosen) != os.path.abspath(default_cache_dir()):
        return Path(chosen)
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_CACHE_ENV] = str(cache_dir)
    return cache_dir


@torch.compiler.nested_compile_region
def _decoder_layer(
    layer: DecoderLayer, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor
) -> torch.Tensor:
    out: torch.Tensor = type(layer).forward(layer, x, cos, sin, kv_cache)
    return out


# Inductor checks every input's size, stride and alignment inside the generated wrapper, here at
# each call of the shared layer code: Python work that Dynamo's guards at the entry already cover
# (docs/benchmarks.md has its cost).
COMPILE_OPTIONS: dict[str, str | int | bool | Callable[..., Any]] = {"size_asserts": False, "alignment_asserts": False}

# Each compiled layer's entry (`CompiledForward.compiled_layers`, one per kind of layer). It
# is kept here, not as a module attribute, because a saved trace pickles the modules' attributes.
_LAYER_ENTRIES: weakref.WeakKeyDictionary[CompiledBlock, PrecompiledFunction] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class LayerKind:
    """What a compiled layer's trace depends on beyond its inputs: the attention window and
    soft-cap (Python constants of the layer) and its tensors' names, dtypes and shapes (its
    products' weight formats)."""

    window: int
    soft_cap: float
    tensors: tuple[str, ...]

    def file_name(self, variant: int) -> str:
        """The saved trace's file: `variant` counts the kinds before it of the same attention."""
        base = (
            "layer" if (self.window, self.soft_cap) == (0, 0.0) else f"layer-window{self.window}-cap{self.soft_cap:g}"
        )
        return f"{base}.bin" if variant == 0 else f"{base}-weights{variant}.bin"

    def entry_name(self, variant: int) -> str:
        base = (
            "layer"
            if (self.window, self.soft_cap) == (0, 0.0)
            else f"layer (window {self.window}, soft-cap {self.soft_cap:g})"
        )
        return base if variant == 0 else f"{base}, weights #{variant + 1}"


class CompiledBlock(nn.Module):
    """A decoder layer of the compiled model, in the layer's place. Traced inside the whole
    forward (one-token steps): the nested region every layer shares. Called eagerly (steps of
    several tokens, tensor parallelism): the layer compiled on its own, one code object for every
    layer (their weights are graph inputs, not constants)."""

    def __init__(self, layer: DecoderLayer) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return _decoder_layer(self.layer, x, cos, sin, kv_cache)
        out: torch.Tensor = _LAYER_ENTRIES[self](self.layer, x, cos, sin, kv_cache)
        return out


# The dimensions that vary between calls of each compiled entry: the token count of a layer's
# input, cos and sin, and the page count of the pool (the warm-up's scratch cache and the real
# pool share the graphs). maybe_mark_dynamic, not mark_dynamic: the latter validates and costs
# ~100 us a call (docs/benchmarks.md).
_LAYER_DYNAMIC_DIMS = ((1, 0), (2, 0), (3, 0), (4, 0))  # (self, x, cos, sin, kv_cache)
_FORWARD_DYNAMIC_DIMS = ((3, 1),)  # (self, input_ids, positions, kv_cache [layers, pages, ...])


class ModelForward:
    """The model as the runner calls it: `hidden(input_ids, positions, kv_cache)` (inside the
    runner's attention_forward) and `logits(hidden)`. This one is plain eager PyTorch."""

    compiled = False

    def __init__(self, model: DecoderModel) -> None:
        self.model = model

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, positions, kv_cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(hidden)


class CompiledForward(ModelForward):
    """One-token steps (batch-1 decode) as one compiled entry for the whole forward; steps of
    more tokens through the layers compiled one by one; on CPU also the head's one-row product,
    unless the head's packed copy runs it natively. The model's products are already the
    kernels the product walk installed (linear/install.py)."""

    compiled = True

    def __init__(self, model: DecoderModel, saved_dir: Path | None = None, whole_forward: bool = True) -> None:
        """`saved_dir`: where the entries' traces are saved and loaded (precompiled.py); None:
        traced at every start. `whole_forward`: False runs one-token steps through the layers
        one by one too (a pipeline stage, whose boundary layers send and receive)."""
        super().__init__(model)
        torch._inductor.config.fx_graph_cache = True
        # Python floats of the model (the softmax scale, norm epsilons) stay constants: a second
        # model in the process with another head_dim must recompile, not trace the scale as a
        # symbolic float, which the attention operator's schema cannot take.
        torch._dynamo.config.specialize_float = True
        on_cpu = model.norm.weight.device.type == "cpu"
        # Tensor parallelism: torch's nested compile regions have no rule for DTensor's
        # functional tensors yet, so there every step runs the layers compiled one by one; and
        # DTensor traces are not saved.
        tensor_parallel = any(isinstance(p, DTensor) for p in model.parameters())
        if tensor_parallel:
            saved_dir = None

        def saved(name: str) -> Path | None:
            return saved_dir / name if saved_dir is not None else None

        # One entry for every layer of a kind: a family's layers share one class, but a window
        # or a soft-cap is a Python constant of the layer, and its products' weight formats are
        # the dtypes and shapes of its tensors, all of which a trace guards on. So each kind
        # (Gemma's sliding and full layers; a Q4_K_M file's layers whose down_proj is Q4_K or
        # Q6_K) has its own entry and its own saved trace.
        self.compiled_layers: dict[LayerKind, PrecompiledFunction] = {}
        self._layer_names: dict[LayerKind, str] = {}
        for index, layer in enumerate(model.layers):
            assert isinstance(layer, DecoderLayer)
            attention = (layer.self_attn.window, layer.self_attn.soft_cap)
            kind = LayerKind(*attention, tuple(model_signature(layer)))
            if kind not in self.compiled_layers:
                variant = sum(1 for known in self.compiled_layers if (known.window, known.soft_cap) == attention)
                self.compiled_layers[kind] = PrecompiledFunction(
                    type(layer).forward, saved(kind.file_name(variant)), _LAYER_DYNAMIC_DIMS, options=COMPILE_OPTIONS
                )
                self._layer_names[kind] = kind.entry_name(variant)
            block = CompiledBlock(layer)
            model.layers[index] = block
            _LAYER_ENTRIES[block] = self.compiled_layers[kind]
        self.one_token_forward = (
            None
            if tensor_parallel or not whole_forward
            else PrecompiledFunction(
                type(model).forward, saved("one_token_forward.bin"), _FORWARD_DYNAMIC_DIMS, options=COMPILE_OPTIONS
            )
        )
        # The head's one-row product, compiled on its own on CPU, unless its packed copy runs it
        # through the native kernel.
        head_blocked = isinstance(model.lm_head, CpuLinear) and model.lm_head.blocked is not None
        self.one_row_head = (
            PrecompiledFunction(type(model.lm_head).forward, saved("one_row_head.bin"), dynamic=False)
            if on_cpu and not head_blocked
            else None
        )

    def entries(self) -> dict[str, PrecompiledFunction]:
        """The compiled entries by name, with where each came from (`.source`)."""
        layers = {self._layer_names[kind]: entry for kind, entry in self.compiled_layers.items()}
        named = {**layers, "one-token forward": self.one_token_forward, "head": self.one_row_head}
        return {name: entry for name, entry in named.items() if entry is not None}

    def hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[0] == 1 and self.one_token_forward is not None:
            hidden: torch.Tensor = self.one_token_forward(self.model, input_ids, positions, kv_cache)
            return hidden
        return self.model(input_ids, positions, kv_cache)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] == 1 and self.one_row_head is not None:
            out: torch.Tensor = self.one_row_head(self.model.lm_head, hidden)
            return self.model.finish_logits(out)
        return self.model.compute_logits(hidden)


def model_forward(
    model: DecoderModel, compiled: bool, saved_dir: Path | None = None, whole_forward: bool = True
) -> ModelForward:
    return CompiledForward(model, saved_dir, whole_forward) if compiled else ModelForward(model)
