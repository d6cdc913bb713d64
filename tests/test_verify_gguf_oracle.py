"""`verify --model file.gguf`: the oracle reads the file's config, tokenizer and weights through
transformers alone, so a misreading of the file's metadata or tokenizer by our preparation (the
family records' GGUF layouts, weights/gguf_config.py, weights/gguf_tokenizer.py) is reported and
fails, instead of being shared by both sides and ending in MATCH. On a tiny Qwen2 file as
llama.cpp's converter wrote it (tests/fixtures/gguf), alone in its folder, with a chat template added."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from gguf import GGUFValueType as VT

import compiled_engine.weights.gguf_dir as gguf_dir
import compiled_engine.weights.gguf_tokenizer as gguf_tokenizer
from compiled_engine.config import EngineConfig
from compiled_engine.verify import verify
from compiled_engine.weights.gguf_tokenizer import GGUFTokenizer
from compiled_engine.weights.source import resolve_model_dir
from reference_oracle import ReferenceOracle
from tests.test_gguf_families import gguf_path, rewrite

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PROMPTS = ["hello world, the quick brown fox", {"text": "tiny tests of soft caps", "chat": True}]


@pytest.fixture
def model(tmp_path: Path, private_models: Path) -> Path:
    """The Q8_0 Qwen2 fixture with a chat template, alone in a folder (no tokenizer.json beside
    it: ours is built from the metadata), prepared in a models folder of the test's own."""
    alone = tmp_path / "alone"
    alone.mkdir()
    return rewrite(
        gguf_path("qwen2", "q8_0"),
        alone / "tiny-qwen2.gguf",
        metadata={"tokenizer.chat_template": (CHATML, VT.STRING, None)},
    )


def run_verify(model: Path, tmp_path: Path) -> int:
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    config = EngineConfig(model=str(model), page_size=4, num_pages=64, enforce_eager=True)
    return verify(config, prompts, chat=False, max_tokens=8)


def matched(out: str) -> bool:
    return any(line.startswith("MATCH:") for line in out.splitlines())


def test_a_correct_file_matches_and_says_what_was_checked(
    model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_verify(model, tmp_path) == 0
    out = capsys.readouterr().out
    assert matched(out) and "MATCH: 2 prompts" in out
    assert "our config and tokenizer agree with transformers' reading of tiny-qwen2.gguf" in out
    for name in ("rms_norm_eps", "rope_theta", "eos_token_id", "num_key_value_heads", "head_dim"):
        assert name in out
    assert "and a conversation through the chat template" in out and "not compared" not in out


def test_the_oracle_reads_nothing_our_preparation_wrote(model: Path) -> None:
    """The prepared directory's config.json and tokenizer files, garbled after preparation, change
    nothing in the oracle's model or tokenizer: only the check against them sees it."""
    prepared = resolve_model_dir(str(model))
    intact = ReferenceOracle(prepared)
    config = json.loads((prepared / "config.json").read_text())
    config |= {"hidden_size": 64, "num_hidden_layers": 5, "rms_norm_eps": 0.5}
    (prepared / "config.json").write_text(json.dumps(config))
    (prepared / "tokenizer.json").write_text("{}")
    (prepared / "tokenizer_config.json").write_text(json.dumps({"chat_template": "garbled"}))
    garbled = ReferenceOracle(prepared)
    assert garbled.gguf is not None and garbled.gguf.check is not None
    assert garbled.gguf.path == prepared / "model.gguf"
    assert [d.split(":")[0] for d in garbled.gguf.check.disagreements] == [
        "num_hidden_layers",
        "hidden_size",
        "rms_norm_eps",
    ]
    ids = [5, 17, 42, 99, 7]
    assert garbled.logits(ids).equal(intact.logits(ids))
    assert garbled.encode("tiny tests of soft caps", chat=True) == intact.encode("tiny tests of soft caps", chat=True)


# A misreading of each kind our metadata reader could make, and how the file really reads
# (the fixture's rms eps is 1e-6 as float32, its rope base 1e6, its eos id 0).
MISREADINGS: dict[str, tuple[dict[str, Any], list[str]]] = {
    "rms-eps": ({"rms_norm_eps": 1e-5}, ["config rms_norm_eps: ours 1e-05, transformers 9.99999997"]),
    "rope-theta": ({"rope_theta": 10000.0}, ["config rope_theta: ours 10000.0, transformers 1000000.0"]),
    "eos-id": (
        {"eos_token_id": 5},
        ["config eos_token_id: ours [5], transformers [0]", "stop token ids: ours [5], transformers [0]"],
    ),
    "kv-heads": ({"num_key_value_heads": 2}, ["config num_key_value_heads: ours 2, transformers 1"]),
}


@pytest.mark.parametrize("case", sorted(MISREADINGS))
def test_a_misread_config_field_is_reported_and_fails(
    case: str, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    wrong, reported = MISREADINGS[case]
    read = gguf_dir.gguf_config_dict

    def misread(header: Any) -> dict[str, Any]:
        return read(header) | wrong

    monkeypatch.setattr(gguf_dir, "gguf_config_dict", misread)
    assert run_verify(model, tmp_path) == 1
    captured = capsys.readouterr()
    assert "GGUF CHECK FAILED" in captured.out and not matched(captured.out)
    for line in reported:
        assert f"\n  {line}" in captured.out, captured.out
    assert "disagreements with transformers' reading of the GGUF" in captured.err


def _misread_chat_template(monkeypatch: pytest.MonkeyPatch) -> None:
    # The template's generation prompt lost.
    build = gguf_dir.build_gguf_tokenizer

    def misbuild(header: Any) -> GGUFTokenizer:
        built = build(header)
        return GGUFTokenizer(built.tokenizer, built.config | {"chat_template": CHATML.split("{% if")[0]})

    monkeypatch.setattr(gguf_dir, "build_gguf_tokenizer", misbuild)


def _misread_add_bos(monkeypatch: pytest.MonkeyPatch) -> None:
    build = gguf_dir.build_gguf_tokenizer

    def misbuild(header: Any) -> GGUFTokenizer:
        built = build(header)
        return GGUFTokenizer(built.tokenizer, built.config | {"add_bos_token": True})

    monkeypatch.setattr(gguf_dir, "build_gguf_tokenizer", misbuild)


TOKENIZER_MISREADINGS = {
    "chat-template": (_misread_chat_template, "chat template renders a conversation as: ours ["),
    "add-bos": (_misread_add_bos, "(with special tokens): ours [0, "),
}


@pytest.mark.parametrize("case", sorted(TOKENIZER_MISREADINGS))
def test_a_misbuilt_tokenizer_is_reported_and_fails(
    case: str, model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    misread, reported = TOKENIZER_MISREADINGS[case]
    misread(monkeypatch)
    assert run_verify(model, tmp_path) == 1
    out = capsys.readouterr().out
    assert "GGUF CHECK FAILED" in out and not matched(out)
    assert reported in out, out
    assert "config " not in out  # the config itself was read right


TOKENIZER_FIXTURES = Path(__file__).parent / "fixtures" / "gguf_tokenizer"


def tokenizer_check(path: Path) -> Any:
    """The check verify makes of our tokenizer (built from the file's metadata) against
    transformers' reading of a file, on tests/fixtures/gguf_tokenizer's vocabularies (which have
    no weights to run)."""
    from transformers import AutoTokenizer

    from compiled_engine.tokenizer import Tokenizer
    from compiled_engine.weights.gguf_dir import prepare_gguf_dir
    from reference_oracle.gguf_source import compare_tokenizers, gguf_alone

    ours = Tokenizer(prepare_gguf_dir(path))
    with gguf_alone(path) as (folder, file_name):
        theirs = AutoTokenizer.from_pretrained(folder, gguf_file=file_name)
    encode_chat = ours.encode_chat if ours.chat_template_source is not None else None
    return compare_tokenizers(theirs, ours.encode, encode_chat)


@pytest.mark.parametrize("name", ["bpe-llama3", "bpe-qwen2", "spm-gemma", "spm-llama"])
def test_each_kind_of_vocabulary_agrees_on_the_probes(name: str, private_models: Path) -> None:
    check = tokenizer_check(TOKENIZER_FIXTURES / f"{name}.gguf")
    assert check.disagreements == [] and len(check.compared) >= 6
    assert check.chat_template == name.startswith("spm")


def test_a_misread_pre_tokenizer_is_reported(private_models: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Llama 3's word splitting (up to three digits together) read as Qwen2's (each digit alone):
    the vocabulary's digit merges go unused."""
    monkeypatch.setitem(gguf_tokenizer.PRE_TOKENIZERS, "llama-bpe", gguf_tokenizer.PRE_TOKENIZERS["qwen2"])
    problems = tokenizer_check(TOKENIZER_FIXTURES / "bpe-llama3.gguf").disagreements
    assert problems and all(p.startswith("tokenizer encodes 'numbers 3.14159") for p in problems), problems


def test_texts_a_vocabulary_cannot_spell_are_not_compared(tmp_path: Path, private_models: Path) -> None:
    """Mistral's 96 tokens have no bytes: a capital letter or an accent has no spelling. Ours
    encodes it as <unk> and transformers drops it, which is no reading of the file: those probes
    are counted, not compared."""
    alone = tmp_path / "mistral.gguf"  # without the checkpoint's tokenizer.json beside it
    shutil.copyfile(gguf_path("mistral", "f16"), alone)
    check = tokenizer_check(alone)
    assert check.disagreements == []
    assert check.compared and any(text.startswith("Hello") for text in check.unspellable)
