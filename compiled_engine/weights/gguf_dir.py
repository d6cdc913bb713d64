"""A user's `.gguf` file as a model directory the rest of the engine reads: config.json and
generation_config.json from the GGUF's metadata (`gguf_config_dict`), the tokenizer files (a
tokenizer.json beside the file, else one built from the GGUF's own vocabulary by
weights/gguf_tokenizer.py), and `model.gguf` a link to the file (`prepare_gguf_dir`). The weights
are read from that link at load (weights/gguf_loader.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from compiled_engine.cache_paths import models_dir
from compiled_engine.errors import ModelConfigError, ModelSourceError
from compiled_engine.model.registry import config_from_dict
from compiled_engine.weights.default_model import GGUF_NAME
from compiled_engine.weights.gguf import GGUFHeader, read_gguf_header
from compiled_engine.weights.gguf_config import gguf_config_dict, gguf_metadata
from compiled_engine.weights.gguf_tokenizer import build_gguf_tokenizer


def _meta(header: GGUFHeader, key: str, kind: type, default: Any = None, required: bool = True) -> Any:
    return gguf_metadata(header).get(key, kind, default, required)


def _cache_key(resolved: Path) -> str:
    stat = resolved.stat()
    return hashlib.sha256(f"{resolved}\n{stat.st_size}\n{stat.st_mtime_ns}".encode()).hexdigest()[:16]


def _is_prepared(model_dir: Path, resolved: Path) -> bool:
    link = model_dir / GGUF_NAME
    return (
        (model_dir / "config.json").is_file()
        and (model_dir / "tokenizer.json").is_file()
        and link.is_file()
        and link.resolve() == resolved
    )


def prepare_gguf_dir(gguf_path: Path) -> Path:
    """The model directory for a user's `.gguf` file, built once in the engine cache (keyed by the
    file's path, size and modification time) and reused: config.json from the GGUF metadata,
    the tokenizer files (a tokenizer.json beside the file, else one built from the GGUF's own
    vocabulary), generation_config.json, and `model.gguf` a link to the file.
    Built in a temporary directory renamed into place, so a directory that exists is complete."""
    path = Path(gguf_path).expanduser()
    if not path.is_file():
        raise ModelSourceError(f"GGUF file {path} does not exist")
    resolved = path.resolve()
    target = models_dir() / "gguf" / _cache_key(resolved)
    if _is_prepared(target, resolved):
        return target
    header = read_gguf_header(resolved, ModelSourceError)
    config = gguf_config_dict(header)
    try:
        config_from_dict(config, source=f"{resolved} (its metadata)")
    except ModelConfigError as exc:
        raise ModelSourceError(str(exc)) from exc
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as scratch_name:
        build = Path(scratch_name) / "model"
        build.mkdir()
        _write_json(build / "config.json", config)
        generation: dict[str, Any] = {k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config}
        pad = _meta(header, "tokenizer.ggml.padding_token_id", int, required=False)
        if pad is not None:
            generation["pad_token_id"] = pad
        _write_json(build / "generation_config.json", generation)
        _write_tokenizer(header, path.absolute(), build)
        (build / GGUF_NAME).symlink_to(resolved)
        if _is_prepared(target, resolved):  # another process finished first
            return target
        if target.exists():
            os.replace(target, Path(scratch_name) / "stale")  # incomplete or stale: dropped with the scratch
        try:
            os.replace(build, target)
        except OSError:
            if not _is_prepared(target, resolved):
                raise
    return target


def _write_json(path: Path, value: dict[str, Any]) -> None:
    path.write_text(json.dumps(value, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_tokenizer(header: GGUFHeader, source: Path, build: Path) -> None:
    # Beside the path as given, not the resolved one: a Hub snapshot's files are links into a
    # folder of blobs, and its tokenizer.json sits beside the link.
    beside = source.parent
    if (beside / "tokenizer.json").is_file():
        _check_beside_tokenizer(header, beside / "tokenizer.json")
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (beside / name).is_file():
                shutil.copyfile(beside / name, build / name)
    else:
        built = build_gguf_tokenizer(header)
        built.tokenizer.save(str(build / "tokenizer.json"))
        _write_json(build / "tokenizer_config.json", built.config)
    config_path = build / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
    template = header.metadata.get("tokenizer.chat_template")
    if isinstance(template, str) and template and not config.get("chat_template"):
        config["chat_template"] = template
    for key in ("is_local", "local_files_only"):  # facts about the build, not the model
        config.pop(key, None)
    _write_json(config_path, config)


def _check_beside_tokenizer(header: GGUFHeader, tokenizer_path: Path) -> None:
    # A tokenizer.json of another model in the same folder would silently garble every prompt.
    tokens = header.metadata.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list):
        return
    from tokenizers import Tokenizer

    try:
        size = Tokenizer.from_file(str(tokenizer_path)).get_vocab_size(with_added_tokens=True)
    except Exception as exc:  # the Rust library raises plain Exception
        raise ModelSourceError(f"{tokenizer_path} beside {header.path.name} cannot be loaded: {exc}") from exc
    if size != len(tokens):
        raise ModelSourceError(
            f"{tokenizer_path} has {size} tokens but {header.path.name} a vocabulary of {len(tokens)}: "
            f"it belongs to another model; move it away to use the GGUF's own vocabulary"
        )
