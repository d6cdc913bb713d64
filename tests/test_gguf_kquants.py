"""GGUF's block types beyond Q8_0/Q4_0/Q4_1 (Q5_0, Q5_1, IQ4_NL, Q2_K..Q6_K, IQ4_XS), kept
quantized: on tensors and whole files that llama.cpp's own quantizer wrote
(tests/fixtures/gguf_kquants, made by tests/fixtures/make_kquant_ggufs.py), and on random blocks.

- Each type reads as gguf-py's `dequantize`, bit for bit.
- Each type's native products (direct, dequantize-then-GEMM, and with LoRA adapters) match
  F.linear over that dequantization.
- Whole Q4_K_M, Q5_K_M, Q6_K, Q3_K_M and Q2_K files, each a mix of types, give transformers'
  greedy ids on the same file.
- Bad files are refused with one clear error before any data is read.
"""

from __future__ import annotations

import shutil
import struct
from functools import cache
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as QT

from compiled_engine.config import EngineConfig
from compiled_engine.engine.reference_loop import Generator
from compiled_engine.errors import ModelLoadError
from compiled_engine.executor.runner import Runner
from compiled_engine.linear.quantized import QuantizedLinear
from compiled_engine.linear.quantized_op import cpu_kernels, native_operator
from compiled_engine.linear.quantized_weight import QuantizedWeight, concat_rows
from compiled_engine.model.registry import config_from_model_dir
from compiled_engine.weights.gguf import BLOCK_TYPES, check_tensor, read_gguf_header, read_tensor
from compiled_engine.weights.gguf_blocks import decode_blocks
from compiled_engine.weights.gguf_dir import prepare_gguf_dir
from compiled_engine.weights.gguf_loader import load_gguf_model

FIXTURES = Path(__file__).parent / "fixtures" / "gguf_kquants"
BLOCKS = FIXTURES / "blocks.gguf"
MODEL = FIXTURES / "model"
# MXFP4 aside: llama.cpp's quantizer writes it for expert tensors only (gpt-oss's), and it is read
# as int8 groups of 32, whose products these tests already cover; its blocks are tested, every
# code and exponent, in tests/test_gguf_granite_gpt_oss.py.
TYPES = [QT(t) for t in BLOCK_TYPES if t != QT.MXFP4]
# Each whole file, and the block types llama.cpp chose for it on this small model (hidden 64:
# its 64-wide matrices fall back to the 32-wide types; ffn_down, 256 wide, gets real k-quants).
WHOLE = {
    "Q4_K_M": {QT.Q5_0, QT.Q4_K, QT.Q6_K, QT.Q8_0},
    "Q5_K_M": {QT.Q5_1, QT.Q5_K, QT.Q6_K, QT.Q8_0},
    "Q6_K": {QT.Q6_K, QT.Q8_0},
    "Q3_K_M": {QT.Q4_0, QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q8_0},
    "Q2_K": {QT.Q4_0, QT.Q3_K, QT.Q8_0},
}
CPU = torch.device("cpu")


pytestmark = pytest.mark.usefixtures("one_thread")


@cache
def fixture_weight(qtype: QT) -> QuantizedWeight:
    """That type's tensor of blocks.gguf, read and decoded by the engine."""
    header = read_gguf_header(BLOCKS)
    with BLOCKS.open("rb") as f:
        return decode_blocks(read_tensor(f, header, qtype.name.lower()), qtype.value)


def gguf_py_dequantized(qtype: QT) -> np.ndarray:
    [tensor] = [t for t in gguf.GGUFReader(BLOCKS).tensors if t.name == qtype.name.lower()]
    assert tensor.tensor_type == qtype  # the fixture holds what its name says
    return np.asarray(gguf.dequantize(tensor.data, qtype), dtype=np.float32)


def assert_same_bits(ours: torch.Tensor, theirs: np.ndarray, qtype: QT) -> None:
    """Bit for bit; Q4_0 is int4 with the offset -8 d, whose zeros come out +0 where gguf-py's
    d * (q - 8) gives -0 for a negative d: equal values, the same products."""
    mine = ours.numpy()
    assert mine.shape == theirs.shape
    if qtype == QT.Q4_0:
        assert np.array_equal(mine, theirs)
        nonzero = theirs != 0
        assert np.array_equal(mine[nonzero].view(np.uint32), theirs[nonzero].view(np.uint32))
    else:
        assert np.array_equal(mine.view(np.uint32), theirs.view(np.uint32))


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_llama_cpps_blocks_read_as_gguf_py_dequantizes_them(qtype: QT) -> None:
    assert_same_bits(fixture_weight(qtype).dequantize(), gguf_py_dequantized(qtype), qtype)


# Byte offsets of each type's fp16 fields: random bytes there are set to moderate fp16 numbers
# (random ones would be NaN and infinities now and then); every other byte is random.
HALVES = {
    QT.Q4_0: (0,), QT.Q4_1: (0, 2), QT.Q5_0: (0,), QT.Q5_1: (0, 2), QT.Q8_0: (0,), QT.IQ4_NL: (0,),
    QT.Q2_K: (80, 82), QT.Q3_K: (108,), QT.Q4_K: (0, 2), QT.Q5_K: (0, 2), QT.Q6_K: (208,), QT.IQ4_XS: (0,),
}  # fmt: skip


def random_blocks(qtype: QT, rows: int, width: int, seed: int) -> np.ndarray:
    weights, nbytes = BLOCK_TYPES[qtype.value]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, width // weights, nbytes), dtype=np.uint8)
    for start in HALVES[qtype]:
        halves = (rng.normal(size=raw.shape[:2]) * 0.05).astype(np.float16)
        raw[..., start : start + 2] = halves.view(np.uint8).reshape(*raw.shape[:2], 2)
    return raw


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_every_bit_pattern_reads_as_gguf_py_dequantizes_it(qtype: QT) -> None:
    """Random bytes: every scale, min, sign and high bit a block can hold, not only those a
    quantizer writes."""
    raw = random_blocks(qtype, 24, 512, seed=qtype.value)
    ours = decode_blocks(torch.from_numpy(raw), qtype.value)
    assert ours.shape == (24, 512)
    assert_same_bits(ours.dequantize(), gguf.dequantize(raw.reshape(24, -1), qtype), qtype)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
@pytest.mark.parametrize("rows", [1, 3, 4, 7, 40])
def test_native_products_match_f_linear_over_the_dequantization(qtype: QT, rows: int) -> None:
    """The C kernels from the ctypes path and the C++ operator: up to 32 rows straight from the
    quantized weight, 40 rows by dequantize-then-GEMM (which dequantizes exactly)."""
    weight = fixture_weight(qtype)
    kernels = cpu_kernels()
    assert kernels is not None and native_operator() is not None
    dense = weight.dequantize()
    x = torch.randn(rows, weight.in_features, generator=torch.Generator().manual_seed(rows))
    bias = torch.randn(weight.out_features)
    want = F.linear(x, dense, bias)
    scale = want.abs().max()
    for got in (kernels.matmul(x, weight, bias), QuantizedLinear(weight, bias)(x)):
        assert (got - want).abs().max() <= 1e-5 * scale
    assert torch.equal(kernels.dequantize(weight), dense)


@pytest.mark.parametrize("qtype", TYPES, ids=lambda t: t.name)
def test_quantized_lora_products_over_every_type_equal_their_reference(qtype: QT) -> None:
    """The quantized product and its adapters' delta in one native call, on each type's weight,
    against dequantize-then-matmul plus the Python delta."""
    from compiled_engine.linear import lora_op

    assert lora_op.native_lora_kernel()
    weight = fixture_weight(qtype)
    generator = torch.Generator().manual_seed(3)
    widths, rank, num_slots = [40, 24], 4, 2
    assert sum(widths) == weight.out_features
    a = torch.randn(num_slots * len(widths) * rank * weight.in_features, generator=generator)
    b = torch.randn(num_slots * rank * weight.out_features, generator=generator)
    base = QuantizedLinear(weight)
    for tokens in (1, 6, 40):
        x = torch.randn(tokens, weight.in_features, generator=generator)
        slots = torch.tensor([t % 3 - 1 for t in range(tokens)])  # no adapter, slot 0, slot 1
        args = (x, base.data, base.scales, base.offsets, None, weight.group_size, 32, 64, a, b, slots, 0, 0)
        args += (num_slots, rank, widths)
        native = torch.ops.compiled_engine.quantized_lora_linear_f32(*args)
        reference = lora_op.reference_quantized_lora_linear(*args)
        torch.testing.assert_close(native, reference, rtol=1e-4, atol=1e-4)
        if tokens > 1:
            assert (native - base(x))[1].abs().max() > 0  # token 1 is on slot 0: its delta is there


def test_parts_of_different_types_stack_into_one_weight_exactly() -> None:
    """q, k and v of a Q4_K_M file are often three types (Q4_K, Q4_K, Q6_K): stacked into the
    model's qkv weight in a common format (int8, groups of 16, offsets), every value unchanged,
    and the stack still runs natively."""
    parts = [fixture_weight(QT.Q4_K), fixture_weight(QT.Q6_K), fixture_weight(QT.Q5_0), fixture_weight(QT.Q2_K)]
    stacked = concat_rows(parts)
    assert (stacked.format, stacked.group_size, stacked.offsets is not None) == ("int8", 16, True)
    assert torch.equal(stacked.dequantize(), torch.cat([p.dequantize() for p in parts]))
    x = torch.randn(2, stacked.in_features)
    torch.testing.assert_close(QuantizedLinear(stacked)(x), F.linear(x, stacked.dequantize()), rtol=1e-5, atol=1e-4)
    int4_only = concat_rows([fixture_weight(QT.Q4_K), fixture_weight(QT.Q4_1)])
    assert (int4_only.format, int4_only.group_size) == ("int4", 32)


# --- whole files ---------------------------------------------------------------------------------


def whole_file(file_type: str) -> Path:
    return MODEL / f"model-{file_type}.gguf"


@cache
def transformers_model(file_type: str) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(MODEL)
    return AutoModelForCausalLM.from_pretrained(
        MODEL, gguf_file=whole_file(file_type).name, config=config, dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("file_type", sorted(WHOLE))
def test_each_file_holds_the_mix_of_types_llama_cpp_gives_a_small_model(file_type: str) -> None:
    types = {t.tensor_type for t in gguf.GGUFReader(whole_file(file_type)).tensors if len(t.shape) == 2}
    assert types == WHOLE[file_type]


@pytest.mark.parametrize("file_type", sorted(WHOLE))
def test_whole_files_keep_every_matrix_quantized_and_give_transformers_greedy_ids(
    file_type: str, private_cache: Path
) -> None:
    path = whole_file(file_type)
    prepared = prepare_gguf_dir(path)
    config = config_from_model_dir(prepared)
    model = load_gguf_model(path, config, torch.float32, CPU)
    for name in ("qkv_proj", "o_proj"):
        assert isinstance(model.get_submodule(f"layers.0.self_attn.{name}"), QuantizedLinear), name
    for name in ("gate_up_proj", "down_proj"):
        assert isinstance(model.get_submodule(f"layers.1.mlp.{name}"), QuantizedLinear), name
    assert isinstance(model.lm_head, QuantizedLinear)
    runner = Runner(prepared, EngineConfig(model=str(prepared), page_size=4, num_pages=64, enforce_eager=True))
    ids = torch.randint(3, config.vocab_size, (24,), generator=torch.Generator().manual_seed(1)).tolist()
    [ours] = Generator(runner).generate([ids], 8, record_logits=True)
    reference = transformers_model(file_type)
    want: list[int] = []
    with torch.inference_mode():  # greedy, through end-of-text tokens as the engine's Generator
        logits = reference(torch.tensor([ids])).logits[0, -1]
        for _ in range(8):
            want.append(int(reference(torch.tensor([ids + want])).logits[0, -1].argmax()))
    assert ours.token_ids == want
    assert ours.prefill_logits is not None
    torch.testing.assert_close(ours.prefill_logits, logits, atol=1e-4, rtol=1e-4)


# --- bad files ---------------------------------------------------------------------------------


def tensor_entry(path: Path, name: str) -> int:
    """The byte offset of tensor `name`'s directory entry (just after its name) in the header."""
    data = path.read_bytes()
    encoded = name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded)
    return at + 8 + len(encoded)


def patch_type(path: Path, name: str, ggml_type: int) -> None:
    entry = tensor_entry(path, name)
    with path.open("r+b") as f:
        f.seek(entry)
        (n_dims,) = struct.unpack("<I", f.read(4))
        f.seek(entry + 4 + 8 * n_dims)
        f.write(struct.pack("<I", ggml_type))


def patch_width(path: Path, name: str, width: int) -> None:
    entry = tensor_entry(path, name)
    with path.open("r+b") as f:
        f.seek(entry + 4)
        f.write(struct.pack("<Q", width))


@pytest.fixture
def q4_k_m(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    shutil.copyfile(whole_file("Q4_K_M"), path)
    return path


def load(path: Path) -> None:
    config = config_from_model_dir(prepare_gguf_dir(whole_file("Q4_K_M")))
    load_gguf_model(path, config, torch.float32, CPU)


def test_a_codebook_type_is_refused_naming_the_tensor_and_its_type(q4_k_m: Path, private_cache: Path) -> None:
    patch_type(q4_k_m, "blk.1.ffn_down.weight", QT.IQ2_XXS.value)
    with pytest.raises(
        ModelLoadError, match=r"'blk\.1\.ffn_down\.weight' .* type IQ2_XXS, which this engine does not load"
    ):
        load(q4_k_m)


def test_an_unknown_type_id_is_refused(q4_k_m: Path, private_cache: Path) -> None:
    patch_type(q4_k_m, "blk.0.attn_q.weight", 77)
    with pytest.raises(ModelLoadError, match=r"'blk\.0\.attn_q\.weight' .* type 77, which this engine does not load"):
        load(q4_k_m)


def test_rows_that_are_not_whole_blocks_are_refused(q4_k_m: Path, private_cache: Path) -> None:
    patch_width(q4_k_m, "blk.0.ffn_down.weight", 250)  # Q4_K: super-blocks of 256
    header = read_gguf_header(q4_k_m)  # the check every load makes of every tensor, alone
    with pytest.raises(ModelLoadError, match=r"is Q4_K with shape \[64, 250\]: .* whole blocks of 256"):
        check_tensor(header, "blk.0.ffn_down.weight")
    with pytest.raises(ModelLoadError, match=r"has shape \[64, 250\], the config implies \[64, 256\]"):
        load(q4_k_m)


def test_a_truncated_tensor_is_refused_before_any_is_read(q4_k_m: Path, private_cache: Path) -> None:
    header = read_gguf_header(q4_k_m)
    last = max(header.tensors.values(), key=lambda t: t.offset)
    with q4_k_m.open("r+b") as f:
        f.truncate(last.offset + 10)
    with pytest.raises(ModelLoadError, match=rf"tensor '{last.name}' .* past the end of the file"):
        load(q4_k_m)


def test_verify_matches_the_oracle_on_a_q4_k_m_file_alone(tmp_path: Path, private_cache: Path, capsys: Any) -> None:
    """`verify --model file.gguf` on a k-quant file with nothing beside it: the oracle loads the
    prepared directory's GGUF through transformers (gguf-py's dequantization) and the engine,
    which keeps the file quantized, gives its greedy ids."""
    from compiled_engine.verify import verify

    alone = tmp_path / "alone" / "tiny-Q4_K_M.gguf"
    alone.parent.mkdir()
    shutil.copyfile(whole_file("Q4_K_M"), alone)
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("the quick brown fox\nhello world, hello tests\n")
    config = EngineConfig(model=str(alone), page_size=4, num_pages=64, enforce_eager=True)
    assert verify(config, prompts, chat=False, max_tokens=8) == 0
    assert "MATCH: 2 prompts" in capsys.readouterr().out


def test_bench_perplexity_takes_gguf_files_side_by_side_with_transformers_on_each(
    tmp_path: Path, private_cache: Path
) -> None:
    """`bench perplexity --formats a.gguf,b.gguf --baseline hf`: each file run kept quantized,
    scored on the same windows as transformers on that file's dequantization."""
    import json

    from compiled_engine.bench import __main__ as bench

    out = tmp_path / "perplexity.json"
    files = [str(whole_file(t)) for t in ("Q4_K_M", "Q2_K")]
    argv = [
        "perplexity", "--model", files[0], "--formats", ",".join(files), "--baseline", "hf", "--enforce-eager",
        "--kv-cache-memory-gib", "0.05", "--max-tokens", "80", "--window", "32", "--stride", "16", "--json", str(out),
    ]  # fmt: skip
    assert bench.main(argv) == 0
    rows = json.loads(out.read_text())["results"]
    assert [row["format"] for row in rows] == files
    for row in rows:
        assert row["weights"].startswith("GGUF")
        assert row["baseline_perplexity"] == pytest.approx(row["perplexity"], rel=1e-5), row["format"]
    assert rows[0]["perplexity"] != pytest.approx(rows[1]["perplexity"], rel=1e-3)  # two files, two models' worth


def test_bench_perplexity_refuses_a_missing_file_and_another_models_file(
    capsys: pytest.CaptureFixture[str], private_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from compiled_engine.bench import __main__ as bench
    from compiled_engine.bench import perplexity as bench_perplexity

    with pytest.raises(SystemExit):
        bench._parser().parse_args(["perplexity", "--formats", "none,missing.gguf"])
    assert "no such GGUF file: missing.gguf" in capsys.readouterr().err
    other = Path(__file__).parent / "fixtures" / "gguf" / "qwen2" / "model-q8_0.gguf"
    argv = ["perplexity", "--model", str(whole_file("Q6_K")), "--formats", f"gguf,{other}", "--enforce-eager"]
    argv += ["--kv-cache-memory-gib", "0.05", "--max-tokens", "60", "--window", "32", "--stride", "32"]
    built = []
    monkeypatch.setattr(bench_perplexity, "LLMEngine", lambda *args: built.append(args))
    assert bench.main(argv) == 2
    assert "tokenizes the text differently" in capsys.readouterr().err
    assert not built  # refused before any format ran


def test_a_rank_keeps_whole_groups_of_columns_or_is_refused(private_cache: Path) -> None:
    """Row-parallel slices are whole groups: four ranks would split o_proj's 64 input columns into
    16, half a Q5_0 group, which is refused naming the tensor; two ranks' slices dequantize to
    the columns of the whole weight."""
    from compiled_engine.linear.quantized_weight import QuantizationError
    from compiled_engine.model.shard import TPShard

    weight = fixture_weight(QT.Q4_K)
    assert torch.equal(weight.narrow_cols(128, 128).dequantize(), weight.dequantize()[:, 128:])
    with pytest.raises(QuantizationError, match="not whole groups of 32"):
        weight.narrow_cols(16, 32)
    path = whole_file("Q4_K_M")
    config = config_from_model_dir(prepare_gguf_dir(path))
    whole = load_gguf_model(path, config, torch.float32, CPU)
    half = load_gguf_model(path, config, torch.float32, CPU, shard=TPShard(1, 2))
    down = whole.get_submodule("layers.0.mlp.down_proj").weight.dequantize()
    assert torch.equal(half.get_submodule("layers.0.mlp.down_proj").weight.dequantize(), down[:, 128:])
    with pytest.raises(
        ModelLoadError, match=r"'blk\.0\.attn_output\.weight' .* columns 16\.\.32 split its groups of 32"
    ):
        load_gguf_model(path, config, torch.float32, CPU, shard=TPShard(1, 4))
