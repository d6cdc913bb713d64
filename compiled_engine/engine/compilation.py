"""torch.compile for the model: regional (one decoder layer compiled, reused by every layer),
the token count as the one dynamic dimension, Inductor's on-disk caches under the engine cache.

Every layer has the same code and the same shapes, so Dynamo compiles `TransformerBlock.forward`
once and the other layers hit the same compiled code (their weights are graph inputs, not
constants). A whole-model compile traces all layers into one graph instead: several times the
compile time for the same decode speed on this model.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch
import torch._inductor.config
from torch.distributed.tensor import DTensor

from compiled_engine.model.llama import Linear, Transformer
from compiled_engine.model.packed_linear import can_pack, pack

logger = logging.getLogger(__name__)

INDUCTOR_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def use_compile_cache(cache_dir: Path) -> Path:
    """Keep Inductor's FX-graph and AOTAutograd caches in `cache_dir` (unless the user already
    chose a directory with TORCHINDUCTOR_CACHE_DIR), so a second start of the same model reuses
    the first one's compiled kernels."""
    chosen = os.environ.get(INDUCTOR_CACHE_ENV)
    if chosen:
        return Path(chosen)
    cache_dir.mkdir(parents=True, exist_ok=True)
    os.environ[INDUCTOR_CACHE_ENV] = str(cache_dir)
    return cache_dir


def compile_layers(model: Transformer) -> None:
    """Compile each decoder layer's forward (one Dynamo graph, no breaks). Compilation itself
    happens on the first calls; `ModelRunner.warm_up` makes those calls at start."""
    torch._inductor.config.fx_graph_cache = True
    # Each layer is one code object called 30-odd times per step; two graphs (one token, many
    # tokens) per code object is the expected state, so the default limit of 8 is ample.
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module, Linear):
                _pack_if_possible(module)
        layer.compile(fullgraph=True)  # the token dimension is marked dynamic by the model
    if model.lm_head.weight.device.type == "cpu":
        # On CPU the head's one-row product is the largest GEMV of a decode step, and compiled it
        # streams at close to bandwidth (see Linear). Many rows are one GEMM compiled or not (on
        # GPU one cuBLAS call either way), so they stay eager, one graph less to build at start;
        # on CPU they go through the packed head, 2-4x faster than F.linear for 2-32 rows here.
        model.one_row_head = torch.compile(model.lm_head.forward, fullgraph=True, dynamic=False)
        _pack_if_possible(model.lm_head)


def _pack_if_possible(linear: Linear) -> None:
    """Give `linear` a oneDNN-packed weight where one can run (fp32 on CPU, not tensor-parallel)."""
    if not isinstance(linear.weight, DTensor) and can_pack(linear.weight):
        pack(linear.weight)
        linear.packed = True
