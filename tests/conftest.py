"""Shared fixtures: the prepared default model, and tiny random-weight models written by
transformers itself, so our loader and model are checked against the library that defines them."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from compiled_engine.cache_paths import CACHE_ENV, MODELS_ENV
from compiled_engine.config import ENFORCE_EAGER_ENV
from compiled_engine.weights.default_model import load_default_model_dir
from reference_oracle import ReferenceOracle
from tests.cache_isolation import Snapshot, isolate
from tests.server_process import ServerProcess, running_server

# Compile artefacts (saved traces, Inductor's caches, native kernels not yet built) go to a
# temporary cache of this session's own, set here, before any test module is imported, and inherited by the servers
# and command-line processes the tests start; the prepared models are read from the user's.
USER_CACHE, TEST_CACHE = isolate()
USER_CACHE_AT_START = Snapshot.take(USER_CACHE)

# Engines in tests run eager unless a test asks for the compiled path (tests/test_compile.py and
# the compiled end-to-end runs): one process compiling many different models would spend the
# suite's time in Inductor. Server subprocesses inherit this.
os.environ.setdefault(ENFORCE_EAGER_ENV, "1")


@pytest.fixture(scope="session", autouse=True)
def user_cache_untouched() -> Iterator[None]:
    """After the last test (as an error in its teardown): nothing under the user's engine cache,
    models included, was created, modified or deleted during the session."""
    yield
    changes = USER_CACHE_AT_START.changes(Snapshot.take(USER_CACHE))
    if changes:
        shown = "\n".join(changes[:30]) + (f"\n... and {len(changes) - 30} more" if len(changes) > 30 else "")
        pytest.fail(
            f"the tests changed the user's engine cache ({', '.join(map(str, USER_CACHE_AT_START.roots))}); "
            f"tests must build in the session's cache ({TEST_CACHE.root}), or in their own (`private_cache`), "
            f"unless another process used the user's cache meanwhile:\n{shown}",
            pytrace=False,
        )


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(TEST_CACHE.root, ignore_errors=True)


@pytest.fixture
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An engine cache of the test's own, its models directory inside it (not the user's), for
    tests that prepare or look for models."""
    root = tmp_path / "engine-cache"
    root.mkdir()
    monkeypatch.setenv(CACHE_ENV, str(root))
    monkeypatch.delenv(MODELS_ENV)
    return root


@pytest.fixture
def private_models(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A models directory of the test's own (not the user's), for tests that prepare a model in
    processes they start: the session's cache stays theirs, so its built kernels serve them."""
    models = tmp_path / "models"
    models.mkdir()
    monkeypatch.setenv(MODELS_ENV, str(models))
    return models


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    # `make test` prepares the model first; a missing one is a setup error, not a skip.
    return load_default_model_dir()


@pytest.fixture(scope="session")
def default_oracle(default_model_dir: Path) -> ReferenceOracle:
    """transformers on the default model's GGUF (dequantized through gguf-py), loaded once a
    session for every module that checks the engine against it."""
    return ReferenceOracle(default_model_dir)


TINY_LLAMA: dict[str, Any] = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
)
TINY_QWEN3: dict[str, Any] = dict(TINY_LLAMA, head_dim=32, num_key_value_heads=2)


# The server the API-shape tests share (tests/test_messages_api.py, tests/test_responses_api.py):
# the default model, two API keys, eager.
API_KEY, OTHER_API_KEY = "api-key", "other-api-key"
API_MODEL = "smol"


@pytest.fixture(scope="session")
def api_server(tmp_path_factory: pytest.TempPathFactory, default_model_dir: Path) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("api-server"),
        "--api-key",
        API_KEY,
        "--api-key",
        OTHER_API_KEY,
        "--served-model-name",
        API_MODEL,
        "--kv-cache-memory-gib",
        "0.05",
    ) as process:
        yield process


def write_tiny_model(path: Path, model_type: str, seed: int = 0, **overrides: Any) -> Path:
    """Save a random-weight transformers model of `model_type` ("llama" or "qwen3") to `path`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    base = TINY_QWEN3 if model_type == "qwen3" else TINY_LLAMA
    config = AutoConfig.for_model(model_type, **{**base, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # default init is too small to give varied greedy tokens
        for param in model.parameters():
            if param.dim() > 1:
                param.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    return path


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    made: dict[tuple[Any, ...], Path] = {}

    def make(model_type: str = "llama", seed: int = 0, **overrides: Any) -> Path:
        key = (model_type, seed, json.dumps(overrides, sort_keys=True))
        if key not in made:
            made[key] = write_tiny_model(tmp_path_factory.mktemp(model_type), model_type, seed, **overrides)
        return made[key]

    return make


# Which tests run: "quick" (`make test`, the default) leaves out those marked `full`, the wider
# matrices of paths the quick tier already covers and the slowest checks of rare failures (they
# wait out a timeout); "full" (`make test-full`) runs only those;
# "all" runs everything. CI runs both tiers.
TEST_TIER_ENV = "COMPILED_ENGINE_TEST_TIER"
TEST_TIERS = ("quick", "full", "all")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tier = os.environ.get(TEST_TIER_ENV, "quick")
    if tier not in TEST_TIERS:
        raise pytest.UsageError(f"{TEST_TIER_ENV}={tier!r}: choose one of {', '.join(TEST_TIERS)}")
    if tier != "all":
        # By marker, not keyword: a parameter id or a folder named "full" must not move a test.
        wanted = {id(item) for item in items if (item.get_closest_marker("full") is not None) == (tier == "full")}
        config.hook.pytest_deselected(items=[item for item in items if id(item) not in wanted])
        items[:] = [item for item in items if id(item) in wanted]
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """One intra-op thread for a module of tiny models: they run fastest so beside other
    processes on the cores. A module takes it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
