"""Weight loading: safetensors only (single file or sharded index), every name, shape and dtype
checked against the model the config describes before a byte is copied. Packed expert tensors
(gpt-oss's MXFP4) are kept apart and installed as quantized experts (weights/mxfp4.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from compiled_engine.errors import ModelLoadError
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.layers import DecoderModel, RotaryEmbedding, in_layers
from compiled_engine.model.registry import build_model, check_shard, family_of
from compiled_engine.model.shard import NO_SHARD, TPShard
from compiled_engine.weights.mxfp4 import install_mxfp4_experts

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = {"F32", "F16", "BF16"}
PACKED_DTYPES = {"U8"}  # MXFP4 blocks and scales
# Buffers some older checkpoints saved; we recompute them, so they are skipped, not loaded.
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)


def weight_files(model_dir: Path) -> dict[Path, list[str] | None]:
    """The safetensors files to read, each with the tensor names the index assigns it (None for
    a single-file checkpoint: all of its tensors)."""
    index_path = model_dir / INDEX_FILE
    if index_path.is_file():
        return _indexed_files(model_dir, index_path)
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return {single: None}
    pickles = sorted(p.name for p in model_dir.glob("*.bin")) + sorted(p.name for p in model_dir.glob("*.pt"))
    if pickles:
        raise ModelLoadError(
            f"{model_dir} holds only pickle weights ({', '.join(pickles)}); this engine loads "
            f"safetensors only, never pickle: convert them to {SINGLE_FILE}"
        )
    raise ModelLoadError(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}")


def _indexed_files(model_dir: Path, index_path: Path) -> dict[Path, list[str] | None]:
    try:
        index = json.loads(index_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelLoadError(f"{index_path} is not valid JSON: {exc}") from exc
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError(f"{index_path} has no 'weight_map' object")
    root = model_dir.resolve()
    files: dict[Path, list[str] | None] = {}
    for tensor_name, shard in weight_map.items():
        if not isinstance(shard, str) or not shard:
            raise ModelLoadError(f"{index_path}: tensor '{tensor_name}' maps to {shard!r}, not a file name")
        shard_path = Path(shard)
        if shard_path.is_absolute() or not (root / shard_path).resolve().is_relative_to(root):
            raise ModelLoadError(
                f"shard '{shard}' listed in {INDEX_FILE} for tensor '{tensor_name}' lies outside the model directory"
            )
        path = model_dir / shard_path
        if not path.is_file():
            raise ModelLoadError(f"shard '{shard}' listed in {INDEX_FILE} is missing")
        names = files.setdefault(path, [])
        assert names is not None
        names.append(tensor_name)
    return files


def load_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    shard: TPShard = NO_SHARD,
    layers: range | None = None,
) -> DecoderModel:
    """Build the model on the meta device and fill it from the checkpoint, cast to `dtype`.
    With tensor parallelism, only `shard`'s parts of the sharded tensors are read; with `layers`
    (a pipeline stage's), only those decoder layers are read and held. The whole checkpoint's
    names, shapes and types are checked either way."""
    model_dir = Path(model_dir)
    check_shard(config, shard)
    with torch.device("meta"):
        model = build_model(config, shard)
    layout = family_of(config).checkpoint_layout(config, shard)
    packed_params = {part.param for part in layout.values() if part.packed is not None}
    params = {
        name: torch.empty(param.shape, dtype=dtype, device=device)
        for name, param in model.named_parameters()
        if not (config.tie_word_embeddings and name == "lm_head.weight")
        and in_layers(name, layers)
        and name not in packed_params
    }
    packed: dict[str, dict[str, torch.Tensor]] = {}  # parameter -> its packed tensors by kind
    seen: set[str] = set()
    for path, names in weight_files(model_dir).items():
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
        except SafetensorError as exc:
            raise ModelLoadError(f"{path} is not a valid safetensors file: {exc}") from exc
        with handle as f:
            available = set(f.keys())
            for tensor_name in names if names is not None else sorted(available):
                if tensor_name not in available:
                    raise ModelLoadError(f"tensor '{tensor_name}' listed in {INDEX_FILE} is missing from {path.name}")
                if tensor_name.endswith(IGNORED_SUFFIXES) or (
                    config.tie_word_embeddings and tensor_name == "lm_head.weight"
                ):
                    continue
                if tensor_name not in layout:
                    raise ModelLoadError(
                        f"unexpected tensor '{tensor_name}' in {path.name}: the "
                        f"{config.architecture} config has no such parameter"
                    )
                part = layout[tensor_name]
                tensor_slice = f.get_slice(tensor_name)
                found_shape = tuple(tensor_slice.get_shape())
                if found_shape != part.shape:
                    raise ModelLoadError(
                        f"tensor '{tensor_name}' in {path.name} has shape {list(found_shape)}, "
                        f"the config implies {list(part.shape)}"
                    )
                found_dtype = tensor_slice.get_dtype()
                dtypes = FLOAT_DTYPES if part.packed is None else PACKED_DTYPES
                if found_dtype not in dtypes:
                    raise ModelLoadError(
                        f"tensor '{tensor_name}' in {path.name} has dtype {found_dtype}; "
                        f"supported: {', '.join(sorted(dtypes))}"
                    )
                if in_layers(part.param, layers) and part.packed is not None:
                    packed.setdefault(part.param, {})[part.packed] = tensor_slice[:]
                elif in_layers(part.param, layers):
                    part.view(params[part.param]).copy_(part.read(tensor_slice))
                seen.add(tensor_name)
    missing = [name for name in layout if name not in seen]
    if missing:
        shown = ", ".join(f"'{n}'" for n in missing[:5])
        more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        raise ModelLoadError(f"{model_dir}: missing tensors {shown}{more}")
    model.load_state_dict(params, strict=False, assign=True)
    if packed:
        install_mxfp4_experts(model, packed, device)
    if config.tie_word_embeddings:
        model.lm_head.weight = cast(nn.Parameter, model.embed_tokens.weight)  # one tensor, as in the checkpoint
    if layers is not None:
        model.keep_layers(layers)
    rebuild_rotaries(model, device)
    return model.eval()


def rebuild_rotaries(model: DecoderModel, device: torch.device) -> None:
    """The rotary tables computed again on `device` (built on the meta device, they hold no
    value, and no checkpoint holds them)."""
    for name, rotary in model.rotaries().items():
        setattr(model, name, RotaryEmbedding(rotary.rope, rotary.rotary_dim).to(device))
