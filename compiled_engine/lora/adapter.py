"""PEFT LoRA adapters read from a directory and laid out for the model's fused products.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors`, as PEFT's
`save_pretrained` writes them. Each adapted product `y = W x` gains `scale * B (A x)`, with A
[r, in] and B [out, r] and `scale = lora_alpha / r` (`lora_alpha / sqrt(r)` with `use_rslora`).
Our model fuses q/k/v into `qkv_proj` and gate/up into `gate_up_proj`, so an adapter's q, k and v
(or gate and up) modules become pieces of the fused product: each piece keeps its own A and B
(the scale folded into B) and names which slice of the product's output rows its B writes.

Everything is checked before anything is used: names, shapes against the base model, each
module's rank against `max_rank`, dtype. What the engine cannot apply exactly is refused, one
error naming the key: DoRA, `modules_to_save`, LoRA on the embedding or head, bias training, pickle weight files,
unknown target modules.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from compiled_engine.errors import ModelSourceError, RequestError
from compiled_engine.model.config import ModelConfig
from compiled_engine.weights.source import HUB_ID, download_from_hub

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"

WHOLE = -1  # a target that is the whole fused product, as Phi-3 stores qkv_proj and gate_up_proj
# Each PEFT target module: our fused product, and which slice of its output rows it is
# (0: q / gate, 1: k / up, 2: v; WHOLE: all of them, its lora_B split by rows into the slices).
TARGETS: dict[str, tuple[str, str, int]] = {
    "qkv_proj": ("self_attn", "qkv_proj", WHOLE),
    "gate_up_proj": ("mlp", "gate_up_proj", WHOLE),
    "q_proj": ("self_attn", "qkv_proj", 0),
    "k_proj": ("self_attn", "qkv_proj", 1),
    "v_proj": ("self_attn", "qkv_proj", 2),
    "o_proj": ("self_attn", "o_proj", 0),
    "gate_proj": ("mlp", "gate_up_proj", 0),
    "up_proj": ("mlp", "gate_up_proj", 1),
    "down_proj": ("mlp", "down_proj", 0),
}
PRODUCTS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)(?:\.[\w-]+)?\.weight$")


class LoRAError(RequestError):
    """An adapter that cannot be loaded or applied; the message names the file and key."""

    def __init__(self, message: str, param: str | None = "lora_request") -> None:
        super().__init__(message, param)


@dataclass(frozen=True)
class LoRAPiece:
    """One adapted module: the slice `piece` of its fused product's output rows gains
    b @ (a @ x), the scale already in b."""

    piece: int  # 0: q / gate / a whole unfused product, 1: k / up, 2: v
    a: torch.Tensor  # fp32 [rank, in]
    b: torch.Tensor  # fp32 [width of the slice, rank]


@dataclass(frozen=True)
class LoRAAdapter:
    """A loaded adapter: its products by (layer, product name such as "self_attn.qkv_proj"),
    and a digest of its files that changes whenever they do (the prefix cache keys on it)."""

    path: Path  # as the request named it: a directory or a Hub id
    rank: int  # the largest rank of any target module
    weights: dict[tuple[int, str], tuple[LoRAPiece, ...]]  # each product's adapted pieces
    digest: str


def product_shapes(config: ModelConfig) -> dict[str, tuple[int, list[int]]]:
    """Each fused product's input width and the output widths of its slices."""
    q, kv, h, inter = config.q_size, config.kv_size, config.hidden_size, config.intermediate_size
    return {
        "self_attn.qkv_proj": (h, [q, kv, kv]),
        "self_attn.o_proj": (q, [h]),
        "mlp.gate_up_proj": (h, [inter, inter]),
        "mlp.down_proj": (inter, [h]),
    }


def _pattern_value(patterns: dict[str, Any], module: str, default: Any) -> Any:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the
    module's name."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _read_config(path: Path) -> dict[str, Any]:
    file = path / CONFIG_NAME
    if not file.is_file():
        raise LoRAError(f"{path}: no {CONFIG_NAME} (a PEFT adapter directory has it)")
    try:
        config = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise LoRAError(f"{file}: not readable JSON ({error})") from error
    if not isinstance(config, dict):
        raise LoRAError(f"{file}: not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise LoRAError(f"{file}: peft_type {peft_type!r} is not supported, only LORA")
    refusals = {
        "use_dora": "DoRA adapters are not supported",
        "modules_to_save": "modules_to_save (fully trained modules) is not supported",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D layers) is not supported",
    }
    for key, problem in refusals.items():
        if config.get(key):
            raise LoRAError(f"{file}: {key}: {problem}")
    if config.get("bias", "none") != "none":
        raise LoRAError(f"{file}: bias: trained biases ({config['bias']!r}) are not supported")
    for key in ("r", "lora_alpha"):
        if not isinstance(config.get(key), int | float) or config[key] <= 0:
            raise LoRAError(f"{file}: {key} must be a positive number, got {config.get(key)!r}")
    targets = config.get("target_modules")
    names = [targets] if isinstance(targets, str) else targets
    if isinstance(names, list):
        for name in names:
            if name in ("embed_tokens", "lm_head"):
                raise LoRAError(f"{file}: target_modules: LoRA on {name} is not supported")
            if isinstance(targets, list) and name not in TARGETS:
                raise LoRAError(f"{file}: target_modules: unknown module {name!r} (supported: {', '.join(TARGETS)})")
    return config


def digest_of(path: Path) -> str:
    """A digest of the adapter's two files: a changed adapter under the same name is another."""
    digest = hashlib.sha256()
    for name in (CONFIG_NAME, WEIGHTS_NAME):
        digest.update((path / name).read_bytes())
    return digest.hexdigest()


def adapter_dir(source: str | Path) -> Path:
    """A local adapter directory, or a Hub id (owner/name) resolved through huggingface_hub as
    models are (weights/source.py), from the local cache when offline."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path
    if path.exists() or not HUB_ID.match(str(source)) or str(source).startswith((".", "~", "/")):
        raise LoRAError(f"{source}: no such adapter directory (nor a Hub id owner/name)")
    try:
        return download_from_hub(str(source))
    except ModelSourceError as error:
        raise LoRAError(f"adapter {str(source)!r}: {error}") from error


def load_adapter(source: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check the PEFT adapter in directory (or Hub id) `source` for a model of `config`."""
    path = adapter_dir(source)
    adapter_config = _read_config(path)
    weights_file = path / WEIGHTS_NAME
    if not weights_file.is_file():
        pickles = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        found = f" ({', '.join(pickles)} are pickle files, which are never loaded)" if pickles else ""
        raise LoRAError(f"{path}: no {WEIGHTS_NAME}{found}")
    pieces: dict[tuple[int, str, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_file), framework="pt") as tensors:
        for key in tensors.keys():  # noqa: SIM118 - safe_open is not a mapping
            match = _KEY.match(key)
            moe_layer = config.moe is not None and match is not None and config.moe.sparse(int(match[1]))
            in_mixture = any(part in key for part in (".experts.", ".block_sparse_moe.", ".shared_mlp."))
            if (config.moe is not None and in_mixture) or (moe_layer and match is not None and match[2] == "mlp"):
                raise LoRAError(
                    f"{weights_file}: {key}: LoRA on a mixture of experts is not supported; "
                    "adapters of the attention products (q/k/v/o_proj) work"
                )
            if match is None:
                raise LoRAError(f"{weights_file}: {key}: not a LoRA weight of a decoder layer's product")
            layer, block, module, which = int(match[1]), match[2], match[3], match[4]
            if module not in TARGETS or TARGETS[module][0] != block:
                raise LoRAError(f"{weights_file}: {key}: unknown target module {block}.{module}")
            if layer >= config.num_layers:
                raise LoRAError(f"{weights_file}: {key}: layer {layer}, but the model has {config.num_layers}")
            tensor = tensors.get_tensor(key)
            if not tensor.is_floating_point() or tensor.dim() != 2:
                raise LoRAError(
                    f"{weights_file}: {key}: expected a 2-D float tensor, got {tensor.dtype} {list(tensor.shape)}"
                )
            pieces.setdefault((layer, block, module), {})[which] = tensor.float()
    if not pieces:
        raise LoRAError(f"{weights_file}: holds no LoRA weights")
    shapes = product_shapes(config)
    fused: dict[tuple[int, str], list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
    for (layer, block, module), pair in sorted(pieces.items()):
        name = f"base_model.model.model.layers.{layer}.{block}.{module}"
        if set(pair) != {"A", "B"}:
            raise LoRAError(f"{weights_file}: {name}: lora_A and lora_B must both be present")
        a, b = pair["A"], pair["B"]
        _, product, piece = TARGETS[module]
        in_features, widths = shapes[f"{block}.{product}"]
        width = sum(widths) if piece == WHOLE else widths[piece]
        rank = a.shape[0]
        if a.shape != (rank, in_features) or b.shape != (width, rank):
            raise LoRAError(
                f"{weights_file}: {name}: lora_A {list(a.shape)} and lora_B {list(b.shape)} do not fit "
                f"[r, {in_features}] and [{width}, r] of the base model"
            )
        if rank > max_rank:
            raise LoRAError(f"{weights_file}: {name}: rank {rank} is above --max-lora-rank {max_rank}")
        module_name = f"model.layers.{layer}.{block}.{module}"
        expected = _pattern_value(adapter_config.get("rank_pattern") or {}, module_name, adapter_config["r"])
        if rank != expected:
            raise LoRAError(f"{weights_file}: {name}: rank {rank}, but the config gives {expected}")
        alpha = _pattern_value(adapter_config.get("alpha_pattern") or {}, module_name, adapter_config["lora_alpha"])
        scale = alpha / math.sqrt(rank) if adapter_config.get("use_rslora") else alpha / rank
        parts = fused.setdefault((layer, f"{block}.{product}"), [])
        if piece == WHOLE:  # one A for every slice, and each slice its rows of B
            parts.extend((i, a, rows * scale) for i, rows in enumerate(b.split(widths)))
        else:
            parts.append((piece, a, b * scale))
    weights = {key: tuple(LoRAPiece(*part) for part in parts) for key, parts in fused.items()}
    rank = max(pair["A"].shape[0] for pair in pieces.values())
    return LoRAAdapter(Path(source), rank, weights, digest_of(path))
