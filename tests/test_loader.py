"""load_model against checkpoints written by transformers, and against every way of breaking one."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import msgspec
import pytest
import torch
from safetensors.torch import load_file, save_file

from compiled_engine.errors import ModelLoadError
from compiled_engine.model.config import ModelConfig
from compiled_engine.model.llama import Transformer, checkpoint_layout
from compiled_engine.model.registry import config_from_model_dir
from compiled_engine.weights.safetensors_loader import INDEX_FILE, SINGLE_FILE, load_model

CPU = torch.device("cpu")
Factory = Callable[..., Path]


def load(model_dir: Path, config: ModelConfig | None = None, dtype: torch.dtype = torch.float32) -> Transformer:
    config = config or config_from_model_dir(model_dir)
    return load_model(model_dir, config, dtype, CPU)


def load_error(model_dir: Path, message: str, config: ModelConfig | None = None) -> str:
    with pytest.raises(ModelLoadError, match=message) as info:
        load(model_dir, config)
    return str(info.value)


def copy_model(factory: Factory, tmp_path: Path, model_type: str = "llama", **overrides: object) -> Path:
    target = tmp_path / "model"
    shutil.copytree(factory(model_type, **overrides), target)
    return target


def rewrite(model_dir: Path, edit: Callable[[dict[str, torch.Tensor]], None]) -> None:
    """Load model.safetensors, let `edit` change the dict in place, write it back."""
    path = model_dir / SINGLE_FILE
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path, metadata={"format": "pt"})


def shard(model_dir: Path, first: Callable[[str], bool]) -> tuple[str, str]:
    """Split model.safetensors into two shards plus an index, as transformers lays them out."""
    tensors = load_file(model_dir / SINGLE_FILE)
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    parts: tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] = ({}, {})
    weight_map: dict[str, str] = {}
    for key, tensor in tensors.items():
        which = 0 if first(key) else 1
        parts[which][key] = tensor
        weight_map[key] = names[which]
    assert parts[0] and parts[1]
    for name, part in zip(names, parts, strict=True):
        save_file(part, model_dir / name, metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    write_index(model_dir, weight_map, total_size=total)
    (model_dir / SINGLE_FILE).unlink()
    return names


def write_index(model_dir: Path, weight_map: Mapping[str, object], total_size: int = 0) -> None:
    index = {"metadata": {"total_size": total_size}, "weight_map": weight_map}
    (model_dir / INDEX_FILE).write_text(json.dumps(index, indent=2))


def read_index(model_dir: Path) -> dict[str, str]:
    weight_map: dict[str, str] = json.loads((model_dir / INDEX_FILE).read_text())["weight_map"]
    return weight_map


def in_layer_zero(key: str) -> bool:
    return ".layers.0." in key


# --- successful loads ------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_loaded_parameters_equal_checkpoint(tiny_model_factory: Factory, model_type: str) -> None:
    model_dir = tiny_model_factory(model_type)
    tensors = load_file(model_dir / SINGLE_FILE)
    model = load(model_dir)
    params = dict(model.named_parameters())
    layout = checkpoint_layout(model.config)
    assert set(layout) == set(tensors)
    assert {part.param for part in layout.values()} == set(params)  # every parameter is filled
    for name, part in layout.items():
        param = params[part.param]
        assert param.device == CPU
        assert param.dtype == torch.float32
        assert torch.equal(part.view(param.detach()), tensors[name]), name
    # the fused weights stack q, k, v (and gate, up) row after row
    q = tensors["model.layers.1.self_attn.q_proj.weight"]
    v = tensors["model.layers.1.self_attn.v_proj.weight"]
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight[: q.shape[0]], q)
    assert torch.equal(model.layers[1].self_attn.qkv_proj.weight[-v.shape[0] :], v)
    assert not model.training
    assert model.rotary.inv_freq.device == CPU
    assert model.rotary.inv_freq.dtype == torch.float32
    assert model.lm_head.weight is not model.embed_tokens.weight
    if model_type == "qwen3":
        assert "layers.0.self_attn.q_norm.weight" in params
        assert "layers.1.self_attn.k_norm.weight" in params


def test_load_accepts_str_path(tiny_model_factory: Factory) -> None:
    model_dir = tiny_model_factory("llama")
    config = config_from_model_dir(model_dir)
    model = load_model(str(model_dir), config, torch.float32, CPU)
    assert torch.equal(model.norm.weight, load_file(model_dir / SINGLE_FILE)["model.norm.weight"])


def test_weights_cast_to_bfloat16(tiny_model_factory: Factory) -> None:
    model_dir = tiny_model_factory("qwen3")
    tensors = load_file(model_dir / SINGLE_FILE)
    model = load(model_dir, dtype=torch.bfloat16)
    params = dict(model.named_parameters())
    for name, part in checkpoint_layout(model.config).items():
        assert params[part.param].dtype == torch.bfloat16, name
        assert torch.equal(part.view(params[part.param]), tensors[name].to(torch.bfloat16)), name
    # rotary frequencies stay float32 whatever the weights' dtype
    assert model.rotary.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("stored", [torch.float16, torch.bfloat16])
def test_half_precision_checkpoint_loads_as_float32(
    tiny_model_factory: Factory, tmp_path: Path, stored: torch.dtype
) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path)

    def to_half(tensors: dict[str, torch.Tensor]) -> None:
        for key in tensors:
            tensors[key] = tensors[key].to(stored)

    rewrite(model_dir, to_half)
    tensors = load_file(model_dir / SINGLE_FILE)
    model = load(model_dir)
    assert model.norm.weight.dtype == torch.float32
    assert torch.equal(model.embed_tokens.weight, tensors["model.embed_tokens.weight"].float())


def test_sharded_checkpoint_loads_like_single_file(tiny_model_factory: Factory, tmp_path: Path) -> None:
    single = tiny_model_factory("llama")
    sharded = copy_model(tiny_model_factory, tmp_path)
    names = shard(sharded, in_layer_zero)
    assert not (sharded / SINGLE_FILE).exists()
    assert all((sharded / n).is_file() for n in names)
    a = load(single).state_dict()
    b = load(sharded).state_dict()
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_checkpoint_sharded_by_transformers_loads(tiny_model_factory: Factory, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    single = tiny_model_factory("qwen3")
    hf_model = AutoModelForCausalLM.from_pretrained(single, dtype=torch.float32)
    sharded = tmp_path / "sharded"
    hf_model.save_pretrained(sharded, max_shard_size="40KB")
    assert (sharded / INDEX_FILE).is_file()
    assert not (sharded / SINGLE_FILE).exists()
    assert len(set(read_index(sharded).values())) > 1
    a = load(single).state_dict()
    b = load(sharded).state_dict()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def test_index_wins_over_single_file(tiny_model_factory: Factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path)
    original = load_file(model_dir / SINGLE_FILE)
    shard(model_dir, in_layer_zero)
    # a stale single file with different values next to the index must not be read
    save_file({k: torch.zeros_like(v) for k, v in original.items()}, model_dir / SINGLE_FILE)
    model = load(model_dir)
    assert torch.equal(model.norm.weight, original["model.norm.weight"])


def test_old_rotary_buffers_are_skipped(tiny_model_factory: Factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path)

    def add_inv_freq(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    rewrite(model_dir, add_inv_freq)
    model = load(model_dir)
    assert not torch.equal(model.rotary.inv_freq, torch.ones(8))


# --- tied embeddings -------------------------------------------------------------------------


def test_tied_embeddings_give_the_head_the_embedding(tiny_model_factory: Factory) -> None:
    model_dir = tiny_model_factory("llama", tie_word_embeddings=True)
    tensors = load_file(model_dir / SINGLE_FILE)
    assert "lm_head.weight" not in tensors  # transformers drops the tied copy
    model = load(model_dir)
    assert model.lm_head.weight is model.embed_tokens.weight  # shared, not a copy
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])
    hidden = torch.randn(3, 64)
    torch.testing.assert_close(model.compute_logits(hidden), hidden @ tensors["model.embed_tokens.weight"].T)


def test_tied_embeddings_ignore_a_stored_lm_head(tiny_model_factory: Factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path, tie_word_embeddings=True)

    def add_head(tensors: dict[str, torch.Tensor]) -> None:
        tensors["lm_head.weight"] = torch.zeros(320, 64)

    rewrite(model_dir, add_head)
    model = load(model_dir)
    assert model.lm_head.weight is model.embed_tokens.weight
    assert model.lm_head.weight.abs().sum() > 0


def test_untied_config_needs_lm_head(tiny_model_factory: Factory) -> None:
    model_dir = tiny_model_factory("llama", tie_word_embeddings=True)
    config = msgspec.structs.replace(config_from_model_dir(model_dir), tie_word_embeddings=False)
    message = load_error(model_dir, re.escape("missing tensors 'lm_head.weight'"), config)
    assert message.startswith(f"{model_dir}: ")


# --- missing, unexpected, mis-shaped and mistyped tensors ------------------------------------


def test_missing_tensor_is_named(tiny_model_factory: Factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path)

    def drop(tensors: dict[str, torch.Tensor]) -> None:
        del tensors["model.layers.1.mlp.up_proj.weight"]

    rewrite(model_dir, drop)
    message = load_error(model_dir, re.escape("missing tensors 'model.layers.1.mlp.up_proj.weight'"))
    assert message == f"{model_dir}: missing tensors 'model.layers.1.mlp.up_proj.weight'"


def test_many_missing_tensors_are_summarised(tiny_model_factory: Factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path)

    def drop_layer_one(tensors: dict[str, torch.Tensor]) -> None:
        for key in [k for k in tensors if ".layers.1." in k]:
            del tensors[key]

    rewrite(model_dir, drop_layer_one)
    message = load_error(model_dir, r"missing tensors 'model\.layers\.1\.")
    assert message.endswith("and 4 more")  # 9 tensors per llama layer, 5 shown
    assert message.count("'model.layers.1.") == 5


def test_unexpected_tensor_is_named_with_its_file(tiny_model_factory: Factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path)

    def add_layer_two(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.2.mlp.up_proj.weight"] = torch.zeros(128, 64)

    rewrite(model_dir, add_layer_two)
    load_error(
        model_dir,
        re.escape(
            "unexpected tensor 'model.layers.2.mlp.up_proj.weight' in model.safetensors: the "
            "llama config has no such parameter"
        ),
    )


def test_qwen3_checkpoint_with_llama_config_has_unexpected_norms(
    tiny_model_factory: Factory,
) -> None:
    model_dir = tiny_model_factory("qwen3")
    config = msgspec.structs.replace(config_from_model_dir(model_dir), architecture="llama", qk_norm=False)
    load_error(model_dir, r"unexpected tensor 'model\.layers\.\d\.self_attn\.[qk]_norm\.weight'", config)


def test_wrong_shape_reports_both(tiny_model_factory: Factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path)

    def reshape(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(64, 64)

    rewrite(model_dir, reshape)
    load_error(
        model_dir,
        re.escape(
            "tensor 'model.layers.0.self_attn.k_proj.weight' in model.safetensors has shape "
            "[64, 64], the config implies [32, 64]"
        ),
    )


def test_config_that_disagrees_with_checkpoint(tiny_model_factory: Factory) -> None:
    model_dir = tiny_model_factory("llama")
    config = msgspec.structs.replace(config_from_model_dir(model_dir), vocab_size=321)
    load_error(
        model_dir,
        re.escape("tensor 'lm_head.weight' in model.safetensors has shape [320, 64], the config implies [321, 64]"),
        config,
    )


@pytest.mark.parametrize(("dtype", "name"), [(torch.int32, "I32"), (torch.int64, "I64"), (torch.bool, "BOOL")])
def test_integer_dtype_is_rejected(tiny_model_factory: Factory, tmp_path: Path, dtype: torch.dtype, name: str) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path)

    def to_int(tensors: dict[str, torch.Tensor]) -> None:
        tensors["model.norm.weight"] = tensors["model.norm.weight"].to(dtype)

    rewrite(model_dir, to_int)
    load_error(
        model_dir,
        re.escape(f"tensor 'model.norm.weight' in model.safetensors has dtype {name}; supported: BF16, F16, F32"),
    )


# --- which files exist -----------------------------------------------------------------------


@pytest.mark.parametrize("pickle_name", ["pytorch_model.bin", "model.pt"])
def test_pickle_only_checkpoint_is_refused(tiny_model_factory: Factory, tmp_path: Path, pickle_name: str) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path)
    torch.save(load_file(model_dir / SINGLE_FILE), model_dir / pickle_name)
    (model_dir / SINGLE_FILE).unlink()
    message = load_error(model_dir, re.escape(f"holds only pickle weights ({pickle_name})"))
    assert "safetensors only, never pickle" in message
    assert f"convert them to {SINGLE_FILE}" in message


def test_no_weights_at_all(tiny_model_factory: Factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path)
    (model_dir / SINGLE_FILE).unlink()
    load_error(model_dir, re.escape(f"{model_dir} has neither {SINGLE_FILE} nor {INDEX_FILE}"))


@pytest.mark.parametrize(
    "content",
    [b"garbage" * 10, b"", b'\x08\x00\x00\x00\x00\x00\x00\x00{"a": 1}'],
    ids=["garbage", "empty", "bad-header"],
)
def test_corrupt_safetensors_file(tiny_model_factory: Factory, tmp_path: Path, content: bytes) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path)
    (model_dir / SINGLE_FILE).write_bytes(content)
    load_error(model_dir, re.escape(f"{model_dir / SINGLE_FILE} is not a valid safetensors file: "))


def test_truncated_safetensors_file(tiny_model_factory: Factory, tmp_path: Path) -> None:
    model_dir = copy_model(tiny_model_factory, tmp_path)
    path = model_dir / SINGLE_FILE
    path.write_bytes(path.read_bytes()[:-1000])
    load_error(model_dir, "is not a valid safetensors file")


# --- sharded index failures ------------------------------------------------------------------


@pytest.fixture
def sharded_dir(tiny_model_factory: Factory, tmp_path: Path) -> Path:
    model_dir = copy_model(tiny_model_factory, tmp_path)
    shard(model_dir, in_layer_zero)
    return model_dir


def test_absolute_shard_path_is_refused(sharded_dir: Path) -> None:
    weight_map = read_index(sharded_dir)
    absolute = str(sharded_dir / weight_map["model.norm.weight"])  # exists, but absolute
    weight_map["model.norm.weight"] = absolute
    write_index(sharded_dir, dict(weight_map))
    load_error(
        sharded_dir,
        re.escape(
            f"shard '{absolute}' listed in {INDEX_FILE} for tensor 'model.norm.weight' lies outside the model directory"
        ),
    )


def test_shard_path_escaping_with_dotdot_is_refused(sharded_dir: Path) -> None:
    weight_map = read_index(sharded_dir)
    shard_name = weight_map["model.norm.weight"]
    shutil.copy(sharded_dir / shard_name, sharded_dir.parent / "outside.safetensors")
    write_index(sharded_dir, {**weight_map, "model.norm.weight": "../outside.safetensors"})
    load_error(
        sharded_dir,
        re.escape(
            "shard '../outside.safetensors' listed in model.safetensors.index.json for tensor 'model.norm.weight' lies outside the model directory"
        ),
    )


def test_dotdot_that_stays_inside_is_allowed(sharded_dir: Path) -> None:
    weight_map = read_index(sharded_dir)
    (sharded_dir / "sub").mkdir()
    write_index(sharded_dir, {k: f"sub/../{v}" if in_layer_zero(k) else v for k, v in weight_map.items()})
    assert load(sharded_dir).layers[0].mlp is not None


def test_symlinked_shard_pointing_outside_is_refused(sharded_dir: Path) -> None:
    weight_map = read_index(sharded_dir)
    shard_name = weight_map["model.norm.weight"]
    outside = sharded_dir.parent / "outside.safetensors"
    shutil.move(sharded_dir / shard_name, outside)
    (sharded_dir / shard_name).symlink_to(outside)
    load_error(sharded_dir, re.escape(f"shard '{shard_name}' listed in {INDEX_FILE}"))
    load_error(sharded_dir, "lies outside the model directory")


def test_missing_shard_file(sharded_dir: Path) -> None:
    (sharded_dir / "model-00002-of-00002.safetensors").unlink()
    load_error(
        sharded_dir,
        re.escape(f"shard 'model-00002-of-00002.safetensors' listed in {INDEX_FILE} is missing"),
    )


def test_tensor_listed_in_index_but_absent_from_shard(sharded_dir: Path) -> None:
    weight_map = read_index(sharded_dir)
    assert weight_map["model.norm.weight"] == "model-00002-of-00002.safetensors"
    weight_map["model.norm.weight"] = "model-00001-of-00002.safetensors"  # wrong shard
    write_index(sharded_dir, dict(weight_map))
    load_error(
        sharded_dir,
        re.escape(
            f"tensor 'model.norm.weight' listed in {INDEX_FILE} is missing from model-00001-of-00002.safetensors"
        ),
    )


def test_tensor_left_out_of_the_index_is_missing(sharded_dir: Path) -> None:
    weight_map = read_index(sharded_dir)
    del weight_map["model.layers.1.self_attn.o_proj.weight"]
    write_index(sharded_dir, dict(weight_map))
    load_error(sharded_dir, re.escape("missing tensors 'model.layers.1.self_attn.o_proj.weight'"))


def test_unexpected_tensor_in_index_names_its_shard(sharded_dir: Path) -> None:
    shard_path = sharded_dir / "model-00002-of-00002.safetensors"
    tensors = load_file(shard_path)
    tensors["model.extra.weight"] = torch.zeros(2)
    save_file(tensors, shard_path)
    weight_map = read_index(sharded_dir)
    write_index(sharded_dir, {**weight_map, "model.extra.weight": shard_path.name})
    load_error(
        sharded_dir,
        re.escape(f"unexpected tensor 'model.extra.weight' in {shard_path.name}: the llama config"),
    )


@pytest.mark.parametrize("target", [3, "", None, ["a.safetensors"]])
def test_index_entry_that_is_not_a_file_name(sharded_dir: Path, target: object) -> None:
    weight_map: dict[str, object] = dict(read_index(sharded_dir))
    weight_map["model.norm.weight"] = target
    write_index(sharded_dir, weight_map)
    load_error(
        sharded_dir,
        re.escape(f"tensor 'model.norm.weight' maps to {target!r}, not a file name"),
    )


@pytest.mark.parametrize("content", ["{not json", "", '{"weight_map": {"a": "b"},}'])
def test_bad_index_json(sharded_dir: Path, content: str) -> None:
    (sharded_dir / INDEX_FILE).write_text(content)
    load_error(sharded_dir, re.escape(f"{sharded_dir / INDEX_FILE} is not valid JSON: "))


def test_index_that_is_not_utf8(sharded_dir: Path) -> None:
    (sharded_dir / INDEX_FILE).write_bytes(b"\xff\xfe{\x00}\x00")
    load_error(sharded_dir, re.escape(f"{sharded_dir / INDEX_FILE} is not valid JSON: "))


@pytest.mark.parametrize("index", [{}, {"weight_map": {}}, {"weight_map": ["a"]}, [1, 2], {"metadata": {}}])
def test_index_without_weight_map(sharded_dir: Path, index: object) -> None:
    (sharded_dir / INDEX_FILE).write_text(json.dumps(index))
    load_error(sharded_dir, re.escape(f"{sharded_dir / INDEX_FILE} has no 'weight_map' object"))
