"""The engine options are declared once: every EngineConfig field has exactly one flag, with
EngineConfig's own default, and every command that builds an engine offers all of them."""

from __future__ import annotations

import argparse
from collections.abc import Callable, Collection

import pytest

from compiled_engine.attention.selector import BACKENDS
from compiled_engine.bench import __main__ as bench
from compiled_engine.cli import build_parser
from compiled_engine.config import DEVICES, DTYPES, SAMPLERS, EngineConfig
from compiled_engine.engine_options import (
    ENGINE_OPTIONS,
    add_engine_options,
    engine_config_fields,
    engine_config_from_args,
    value_type,
)


def _parser(exclude: Collection[str] = ()) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_engine_options(parser, exclude=exclude)
    return parser


def _actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {action.dest: action for action in parser._actions}


def test_every_field_has_exactly_one_option() -> None:
    """A field added to EngineConfig without an entry in ENGINE_OPTIONS fails here."""
    declared = [option.field for option in ENGINE_OPTIONS]
    missing = set(engine_config_fields()) - set(declared)
    assert not missing, f"EngineConfig fields without a command-line option: {sorted(missing)}"
    assert set(declared) <= set(engine_config_fields())
    assert len(set(declared)) == len(declared)
    flags = [option.flag for option in ENGINE_OPTIONS]
    assert len(set(flags)) == len(flags)


def test_every_default_is_engine_configs_own() -> None:
    defaults = EngineConfig()
    args = _parser().parse_args([])
    for name in engine_config_fields():
        assert getattr(args, name) == getattr(defaults, name), name
    assert engine_config_from_args(args) == defaults
    actions = _actions(_parser())
    for name, field in engine_config_fields().items():
        assert actions[name].default == field.default, name


def test_choices_come_from_the_registries() -> None:
    actions = _actions(_parser())
    assert actions["attention_backend"].choices == BACKENDS
    assert actions["sampler"].choices == SAMPLERS
    assert actions["device"].choices == DEVICES
    assert sorted(actions["dtype"].choices or ()) == sorted(DTYPES)


def test_boolean_flags_keep_their_spellings_and_meanings() -> None:
    """`--no-...` turns a field that defaults to True off; --enforce-eager absent is None, so
    $COMPILED_ENGINE_ENFORCE_EAGER still decides."""
    parser = _parser()
    assert engine_config_from_args(parser.parse_args([])).enforce_eager is None
    config = engine_config_from_args(parser.parse_args(["--enforce-eager", "--no-cuda-graphs", "--no-prefix-caching"]))
    assert config.enforce_eager is True
    assert config.cuda_graphs is False
    assert config.enable_prefix_caching is False
    for option in ENGINE_OPTIONS:
        field = engine_config_fields()[option.field]
        if value_type(field.type) is bool:
            assert option.flag.startswith("--no-") == (field.default is True), option.flag


def test_every_valued_flag_reaches_the_config() -> None:
    argv = [
        "--model", "some/model", "--device", "cpu", "--dtype", "bfloat16", "--page-size", "8",
        "--num-pages", "40", "--kv-cache-memory-gib", "0.5", "--gpu-memory-utilization", "0.5",
        "--max-model-len", "64", "--attention-backend", "torch", "--sampler", "torch",
        "--max-num-seqs", "3", "--max-num-batched-tokens", "32", "--seed", "7",
        "--tensor-parallel-size", "2", "--distributed-timeout-s", "5",
    ]  # fmt: skip
    config = engine_config_from_args(_parser().parse_args(argv))
    assert config == EngineConfig(
        model="some/model", device="cpu", dtype="bfloat16", page_size=8, num_pages=40,
        kv_cache_memory_gib=0.5, gpu_memory_utilization=0.5, max_model_len=64,
        attention_backend="torch", sampler="torch", max_num_seqs=3, max_num_batched_tokens=32,
        seed=7, tensor_parallel_size=2, distributed_timeout_s=5.0,
    )  # fmt: skip


def test_excluded_fields_and_overrides() -> None:
    """A command's own option of an excluded field's name never leaks into the config;
    overrides win over the flags."""
    parser = _parser(exclude={"seed"})
    parser.add_argument("--seed", type=int, default=123)  # the command's own, not the engine's
    args = parser.parse_args(["--seed", "5", "--max-num-seqs", "4"])
    assert engine_config_from_args(args).seed is None
    assert engine_config_from_args(args, max_num_seqs=9, seed=1) == EngineConfig(max_num_seqs=9, seed=1)
    with pytest.raises(ValueError, match="no EngineConfig field named nope"):
        _parser(exclude={"nope"})
    with pytest.raises(ValueError, match="without add_engine_options"):
        engine_config_from_args(argparse.Namespace(model=None))


def test_a_bad_value_is_engine_configs_error() -> None:
    with pytest.raises(ValueError, match="max_num_seqs must be at least 1"):
        engine_config_from_args(_parser().parse_args(["--max-num-seqs", "0"]))
    with pytest.raises(SystemExit):
        _parser().parse_args(["--sampler", "nope"])


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    raise AssertionError("no subcommands")


@pytest.mark.parametrize(
    ("parser", "command", "excluded"),
    [
        (build_parser, "generate", {"seed", "data_parallel_size"}),
        (build_parser, "verify", {"data_parallel_size"}),
        (build_parser, "serve", set()),
        (bench._parser, "latency", {"seed", "enable_prefix_caching", "data_parallel_size"}),
        (bench._parser, "offline", {"seed", "data_parallel_size"}),
        (bench._parser, "serve", {"seed"}),
    ],
)
def test_every_engine_command_offers_every_option(
    parser: Callable[[], argparse.ArgumentParser], command: str, excluded: set[str]
) -> None:
    """Only a field the command fixes itself, or whose flag it spends on its own option (the
    request's or the workload's --seed), is missing; and data parallelism, which only a server
    runs."""
    sub = _subcommands(parser())[command]
    declared = set(sub.get_default("_engine_option_fields"))
    assert declared == set(engine_config_fields()) - excluded
    flags = {flag for action in sub._actions for flag in action.option_strings}
    assert {option.flag for option in ENGINE_OPTIONS if option.field in declared} <= flags


def test_the_bench_gains_the_options_it_lacked() -> None:
    argv = [
        "offline", "--page-size", "8", "--num-pages", "40", "--max-model-len", "64",
        "--max-num-batched-tokens", "32", "--no-prefix-caching", "--sampler", "torch",
        "--tensor-parallel-size", "2", "--seed", "3",
    ]  # fmt: skip
    args = bench._parser().parse_args(argv)
    config = engine_config_from_args(args)
    assert (config.page_size, config.num_pages, config.max_model_len) == (8, 40, 64)
    assert (config.max_num_batched_tokens, config.enable_prefix_caching) == (32, False)
    assert (config.sampler, config.tensor_parallel_size) == ("torch", 2)
    assert config.max_num_seqs == EngineConfig().max_num_seqs == 256
    assert args.seed == 3 and config.seed is None  # the workload's seed, not the engine's
