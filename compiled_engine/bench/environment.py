"""What a benchmark figure was measured on: recorded with every JSON result."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path
from typing import Any

import torch


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=Path(__file__).parent
        )
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def config_hash(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "config.json").read_bytes()).hexdigest()[:16]


def environment(device: torch.device | None, dtype: torch.dtype | None, model_dir: Path) -> dict[str, Any]:
    """`device` and `dtype` are None when the figures come from a server elsewhere."""
    env: dict[str, Any] = {
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": _version("triton"),
        "flashinfer": _version("flashinfer-python"),
        "transformers": _version("transformers"),
        "device": str(device) if device is not None else "remote server",
        "dtype": str(dtype).removeprefix("torch.") if dtype is not None else None,
        "cpu_model": _cpu_model(),
        "cpu_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count(),
        "model_dir": model_dir.name,
        "model_config_hash": config_hash(model_dir),
        "model_config": json.loads((model_dir / "config.json").read_text()).get("architectures"),
    }
    if device is not None and device.type == "cuda":
        env["device_name"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                check=True,
            )
            env["driver"] = out.stdout.strip().splitlines()[0]
        except (OSError, subprocess.CalledProcessError, IndexError):
            env["driver"] = None
    return env
