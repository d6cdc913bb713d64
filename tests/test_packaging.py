"""The wheel carries every file the package opens at run time: each file in the package folders
that is not Python (kernel sources, the chat page, bench data) is matched by a package-data glob.
CI (`.ci/wheel_smoke`) also builds the wheel and serves from it in a fresh venv."""

from __future__ import annotations

import glob
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_ROOTS = ("compiled_engine", "reference_oracle")


def tracked_data_files() -> set[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout to list the tracked files")
    listed = subprocess.run(
        ["git", "ls-files", "--", *PACKAGE_ROOTS], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout.split()
    return {name for name in listed if not name.endswith(".py") and (ROOT / name).is_file()}


def packaged_data_files(package_data: dict[str, list[str]]) -> set[str]:
    """The files setuptools puts in the wheel for these globs (relative to each package's folder)."""
    packaged = set()
    for package, patterns in package_data.items():
        folder = ROOT.joinpath(*package.split("."))
        for pattern in patterns:
            for match in glob.glob(pattern, root_dir=folder):
                packaged.add((folder / match).relative_to(ROOT).as_posix())
    return packaged


def test_every_tracked_data_file_is_package_data() -> None:
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    missing = sorted(tracked_data_files() - packaged_data_files(package_data))
    assert not missing, f"not in the wheel (add them to [tool.setuptools.package-data]): {missing}"


def test_the_check_sees_a_missing_kernel_folder() -> None:
    """The comparison above would have caught the folder once left out."""
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    without = {package: globs for package, globs in package_data.items() if package != "compiled_engine.linear"}
    missing = tracked_data_files() - packaged_data_files(without)
    assert "compiled_engine/linear/kernels/blocked_gemv.c" in missing
