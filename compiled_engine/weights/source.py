"""Model source resolution: a local directory, a Hugging Face Hub id, or the embedded default."""

from __future__ import annotations

import re
from pathlib import Path

from compiled_engine.errors import ModelSourceError
from compiled_engine.weights.default_model import load_default_model_dir

HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
HUB_FILE_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "tokenizer*"]


def resolve_model_dir(model: str | None) -> Path:
    """Turn `--model` into a local directory holding config.json and the weights (for a `.gguf`
    file, the directory prepared for it in the engine cache)."""
    if model is None:
        return load_default_model_dir()
    if not model:
        # Path("") is ".", the working directory: an empty --model (an unset shell variable)
        # must not silently load whatever the current directory holds.
        raise ModelSourceError("--model is empty; pass a local directory or a Hub id (owner/name)")
    path = Path(model).expanduser()
    if path.is_dir():
        return path
    if path.is_file() and path.suffix.lower() == ".gguf":
        from compiled_engine.weights.gguf_dir import prepare_gguf_dir

        return prepare_gguf_dir(path)
    if path.exists():
        raise ModelSourceError(f"--model {model!r} is a file; pass the model directory or a .gguf file")
    if not HUB_ID.match(model) or model.startswith((".", "~")):
        raise ModelSourceError(f"--model {model!r} is neither a local directory nor a Hub id (owner/name)")
    return download_from_hub(model)


def download_from_hub(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HFValidationError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
    )

    try:
        return Path(snapshot_download(repo_id, allow_patterns=HUB_FILE_PATTERNS))
    except LocalEntryNotFoundError as exc:
        raise ModelSourceError(
            f"model {repo_id!r} is not in the local Hugging Face cache and the Hub cannot be "
            f"reached (no network, or HF_HUB_OFFLINE=1); download it on a connected machine "
            f"or pass a local directory"
        ) from exc
    except HFValidationError as exc:  # e.g. 'a/b--c', 'a/b.': our pattern is looser than the Hub's
        raise ModelSourceError(f"--model {repo_id!r} is neither a local directory nor a valid Hub id: {exc}") from exc
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise ModelSourceError(f"the Hub has no accessible model {repo_id!r}: {exc}") from exc
    except OSError as exc:  # connection failures surface as OSError subclasses
        raise ModelSourceError(
            f"could not download {repo_id!r} from the Hugging Face Hub (network error: {exc})"
        ) from exc
