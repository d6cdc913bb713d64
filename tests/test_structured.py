"""Structured outputs (structured/): JSON schemas, regexes, choices and grammars constrain the
sampler through llguidance masks. Outputs parse and validate, through `LLM` and through the
server with the official openai client; bad constraints are 400s that name the field; constrained
requests leave no pages behind."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import regex
import torch

from compiled_engine import LLM, SamplingParams
from compiled_engine.engine.sampler import Sampler, SamplingBatch
from compiled_engine.engine.sampling_params import StructuredOutputs
from compiled_engine.errors import RequestError
from tests.server_process import ServerProcess, running_server

MODEL = "SmolLM2-135M-Instruct"
NAME = {"type": "string", "minLength": 1, "maxLength": 16}
SMALL = {"type": "integer", "minimum": 0, "maximum": 999}
# Twenty schemas: nested objects, bounded arrays, enums, anyOf, $ref, numbers, required and
# optional keys. Strings, numbers and arrays are bounded, so that every output can end well
# within max_tokens.
SCHEMAS: list[dict[str, Any]] = [
    {"type": "object", "properties": {"name": NAME}, "required": ["name"]},
    {"type": "object", "properties": {"name": NAME, "age": SMALL}, "required": ["name", "age"]},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": NAME, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {"point": {"type": "object", "properties": {"x": SMALL, "y": SMALL}, "required": ["x", "y"]}},
        "required": ["point"],
    },
    {
        "type": "object",
        "properties": {"price": {"type": "number", "minimum": 0, "maximum": 100, "multipleOf": 0.01}},
        "required": ["price"],
    },
    {"type": "object", "properties": {"id": {"anyOf": [SMALL, NAME]}}, "required": ["id"]},
    {
        "$defs": {"person": {"type": "object", "properties": {"name": NAME}, "required": ["name"]}},
        "type": "object",
        "properties": {"author": {"$ref": "#/$defs/person"}},
        "required": ["author"],
    },
    {"type": "object", "properties": {"name": NAME, "nickname": NAME}, "required": ["name"]},
    {"type": "array", "items": SMALL, "minItems": 2, "maxItems": 4},
    {"type": "object", "properties": {"status": {"const": "done"}}, "required": ["status"]},
    {"type": "object", "properties": {"note": {"type": ["string", "null"], "maxLength": 12}}, "required": ["note"]},
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "object", "properties": {"n": SMALL}, "required": ["n"]},
                "maxItems": 2,
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"}},
        "required": ["code"],
    },
    {"type": "object", "properties": {"level": {"type": "integer", "enum": [1, 2, 3]}}, "required": ["level"]},
    {
        "type": "object",
        "properties": {
            "a": {
                "type": "object",
                "properties": {"b": {"type": "object", "properties": {"c": SMALL}, "required": ["c"]}},
                "required": ["b"],
            }
        },
        "required": ["a"],
    },
    {
        "type": "object",
        "properties": {"flags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}},
        "required": ["flags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {"value": {"oneOf": [{"type": "boolean"}, {"type": "null"}]}},
        "required": ["value"],
    },
    {
        "type": "object",
        "properties": {"score": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.125}, "label": NAME},
        "required": ["score", "label"],
    },
]


def _closed(schema: Any) -> Any:
    """Every object in `schema` with `additionalProperties: false` (as OpenAI's strict mode asks):
    an open object lets the model add keys with unbounded values until max_tokens."""
    if isinstance(schema, dict):
        schema = {key: _closed(value) for key, value in schema.items()}
        if "properties" in schema:
            schema.setdefault("additionalProperties", False)
    elif isinstance(schema, list):
        schema = [_closed(value) for value in schema]
    return schema


SCHEMAS = [_closed(schema) for schema in SCHEMAS]


@pytest.fixture(scope="module")
def llm(default_model_dir: Path) -> LLM:
    return LLM(None, enforce_eager=True, kv_cache_memory_gib=0.1)


def _pool_is_whole(llm: LLM) -> None:
    manager = llm.engine.block_manager
    assert manager.num_free_pages == manager.num_pages and not llm.engine.has_unfinished_requests()


def _chat(llm: LLM, text: str) -> list[int]:
    return list(llm.tokenizer.encode_chat([{"role": "user", "content": text}]))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "exactly one of json, regex, choice, grammar, json_object .got none"),
        ({"regex": "a", "choice": ["b"]}, "exactly one .* .got regex, choice"),
        ({"choice": []}, "choice must be a list of non-empty strings"),
        ({"json": 3}, "must be a JSON schema"),
        ({"regex": "a", "whitespace": "x"}, "unsupported fields: whitespace"),
    ],
)
def test_a_malformed_constraint_is_refused(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(RequestError, match=message):
        StructuredOutputs.of(fields)


def test_every_token_the_mask_allows_keeps_the_output_a_prefix_of_the_regex(llm: LLM) -> None:
    """Along a generated path, each allowed token's text appended to the output so far can still
    complete to a match (the `regex` package's partial matching), and the mask is far from all-open."""
    pattern = r"[0-9]{3}-[a-z]{2,4}(, [0-9]{3}-[a-z]{2,4})*"
    compiler = llm.engine.grammars.compiler()
    spec = StructuredOutputs.of({"regex": pattern})
    matcher = compiler.matcher(spec)
    tokenizer = llm.tokenizer
    eos = min(llm.engine.eos_token_ids)
    text = ""
    for path_token in tokenizer.encode("123-ab, 456-xyz", add_special_tokens=False):
        allowed = matcher.allowed().nonzero().flatten().tolist()
        assert 0 < len(allowed) < matcher.vocab_size // 4
        for token in allowed:
            if token == eos:
                assert regex.fullmatch(pattern, text)  # the end only where the regex is matched
                continue
            candidate = text + tokenizer.decode([token], skip_special_tokens=False)
            assert regex.fullmatch(pattern, candidate, partial=True), repr(candidate)
        assert path_token in allowed
        assert matcher.advance(path_token)
        text += tokenizer.decode([path_token], skip_special_tokens=False)
    assert eos in matcher.allowed().nonzero().flatten().tolist()  # a full match may end here


def test_the_sampler_draws_only_allowed_tokens_greedy_or_sampled() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 3.0], [5.0, 1.0, 0.0, 3.0], [0.0, 0.0, 0.0, 0.0]])
    allowed = torch.tensor([False, False, True, True])
    params = [SamplingParams(temperature=0), SamplingParams(temperature=1.0, seed=1), SamplingParams(temperature=0)]
    batch = SamplingBatch(params, [1, 2, 3], [0, 0, 0], [[]] * 3, [[]] * 3, [[]] * 3, [allowed, allowed, None])
    for _ in range(3):
        out = Sampler()(logits, batch)
        assert out.token_ids[0] == 3 and out.token_ids[1] in (2, 3) and out.token_ids[2] == 0
    draws = {Sampler()(logits, SamplingBatch(**{**batch.__dict__, "seeds": [1, s, 3]})).token_ids[1] for s in range(40)}
    assert draws == {2, 3}


def test_offline_outputs_follow_each_kind_of_constraint(llm: LLM) -> None:
    prompt = _chat(llm, "Answer in the requested format.")
    cases: list[tuple[dict[str, Any], Any]] = [
        ({"json": SCHEMAS[1]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[1])),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict) or pytest.fail(t)),
        ({"regex": r"[0-9]{3}-[a-z]{2,5}"}, lambda t: regex.fullmatch(r"[0-9]{3}-[a-z]{2,5}", t) or pytest.fail(t)),
        ({"choice": ["yes", "no", "maybe"]}, lambda t: t in ("yes", "no", "maybe") or pytest.fail(t)),
        (
            {"grammar": 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'},
            lambda t: regex.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", t) or pytest.fail(t),
        ),
        ({"grammar": 'root ::= "ab" [0-9] "!"'}, lambda t: regex.fullmatch(r"ab[0-9]!", t) or pytest.fail(t)),  # GBNF
    ]
    for fields, check in cases:
        for params in (
            SamplingParams(temperature=0, max_tokens=64, structured_outputs=StructuredOutputs.of(fields)),
            SamplingParams(
                temperature=1.0, seed=5, n=2, max_tokens=64, structured_outputs=StructuredOutputs.of(fields)
            ),
        ):
            [out] = llm.generate([prompt], params, use_tqdm=False)
            for completion in out.outputs:
                if "json_object" in fields and completion.finish_reason == "length":
                    # Any object: nothing bounds what a sampled one says, so it may run out of
                    # tokens; then it used them all and is an object begun.
                    assert len(completion.token_ids) == params.max_tokens
                    assert completion.text.lstrip().startswith("{"), completion.text
                    continue
                assert completion.finish_reason == "stop", (fields, completion.text)
                check(completion.text)
    _pool_is_whole(llm)


def test_a_constraint_that_cannot_finish_in_max_tokens_ends_with_length(llm: LLM) -> None:
    spec = StructuredOutputs.of(
        {"json": {"type": "object", "properties": {"text": {"type": "string", "minLength": 50}}, "required": ["text"]}}
    )
    [out] = llm.generate(
        [_chat(llm, "Write JSON.")],
        SamplingParams(temperature=0, max_tokens=6, structured_outputs=spec),
        use_tqdm=False,
    )
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(out.outputs[0].text)


def test_constrained_and_free_requests_batch_together_and_aborts_leave_no_pages(llm: LLM) -> None:
    spec = StructuredOutputs.of({"json": SCHEMAS[4]})
    prompt = _chat(llm, "List some tags as JSON.")
    free = SamplingParams(temperature=0, max_tokens=20)
    alone = llm.generate([prompt], free, use_tqdm=False)[0].outputs[0].token_ids
    outs = llm.generate(
        [prompt, prompt], [SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec), free], use_tqdm=False
    )
    jsonschema.validate(json.loads(outs[0].outputs[0].text), SCHEMAS[4])
    assert outs[1].outputs[0].token_ids == alone  # the mask is that row's alone
    engine = llm.engine
    request_id = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=80, structured_outputs=spec))
    for _ in range(3):
        engine.step()
    engine.abort_request(request_id)
    while engine.has_unfinished_requests():
        engine.step()
    _pool_is_whole(llm)
    with pytest.raises(RequestError, match="invalid regex"):
        engine.add_request(prompt, SamplingParams(structured_outputs=StructuredOutputs.of({"regex": "(a"})))
    assert not engine.has_unfinished_requests()


PEOPLE = _closed(
    {
        "type": "object",
        "properties": {
            "people": {
                "type": "array",
                "items": {"type": "object", "properties": {"name": NAME, "age": SMALL}, "required": ["name", "age"]},
                "minItems": 3,
                "maxItems": 4,
            }
        },
        "required": ["people"],
    }
)


@pytest.mark.parametrize("method", ["ngram", pytest.param("draft_model", marks=pytest.mark.full)])
def test_constrained_requests_speculate_with_masked_drafts_and_keep_their_output(
    llm: LLM, default_model_dir: Path, method: str
) -> None:
    """Each verified draft position is masked by the grammar as the draft tokens before it left
    it, and the matcher rolls back after verification: the output is the one without
    speculation, token for token (greedy, and seeded sampling with prompt lookup), and drafts
    were accepted. The draft model here is the default model itself."""
    spec = StructuredOutputs.of({"json": PEOPLE})
    prompt = _chat(llm, "List three people with their ages as JSON.")
    params = [
        SamplingParams(temperature=0, max_tokens=120, structured_outputs=spec),
        SamplingParams(temperature=0.8, seed=3, max_tokens=120, structured_outputs=spec),
    ]
    if method == "draft_model":
        params = params[:1]  # sampled rows of a draft model keep the distribution, not the seeded tokens
    expected = [out.outputs[0].token_ids for out in llm.generate([prompt] * len(params), params, use_tqdm=False)]
    config: dict[str, Any] = {"method": "ngram", "num_speculative_tokens": 3}
    if method == "draft_model":
        config = {"method": "draft_model", "model": str(default_model_dir), "num_speculative_tokens": 3}
    spec_llm = LLM(None, enforce_eager=True, kv_cache_memory_gib=0.05, speculative_config=config)
    outs = spec_llm.generate([prompt] * len(params), params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outs] == expected
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), PEOPLE)
    stats = spec_llm.engine.speculative_stats
    assert stats.accepted_tokens > 0 and stats.draft_tokens > 0
    _pool_is_whole(spec_llm)


# -- through the server, with the openai client ------------------------------------------------


@pytest.fixture(scope="module")
def server(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    with running_server(
        tmp_path_factory.mktemp("structured"), "--kv-cache-memory-gib", "0.25", "--enforce-eager"
    ) as process:
        yield process


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "sampled"])
def test_twenty_json_schemas_through_the_openai_client_validate(server: ServerProcess, sampled: bool) -> None:
    """All twenty at once (one batch), each output parsed and validated by `jsonschema`."""
    import openai

    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none")

    async def one(i: int, schema: dict[str, Any]) -> tuple[str, str | None]:
        reply = await client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Reply with JSON."}],
            max_tokens=200,
            temperature=1.0 if sampled else 0.0,
            seed=i if sampled else None,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema, "strict": True}},
        )
        return reply.choices[0].message.content or "", reply.choices[0].finish_reason

    async def everything() -> list[tuple[str, str | None]]:
        return await asyncio.gather(*(one(i, schema) for i, schema in enumerate(SCHEMAS)))

    for (text, reason), schema in zip(asyncio.run(everything()), SCHEMAS, strict=True):
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), schema)


def test_regex_choice_and_streamed_json_through_the_server(server: ServerProcess) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    reply = client.completions.create(
        model=MODEL,
        prompt="Phone:",
        max_tokens=20,
        temperature=0,
        extra_body={"structured_outputs": {"regex": r"\d{3}-\d{4}"}},
    )
    assert regex.fullmatch(r"\d{3}-\d{4}", reply.choices[0].text)
    reply = client.completions.create(
        model=MODEL, prompt="Is the sky blue?", max_tokens=5, temperature=0, extra_body={"guided_choice": ["yes", "no"]}
    )
    assert reply.choices[0].text in ("yes", "no")
    chunks = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        max_tokens=100,
        temperature=0,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMAS[5]}},
    )
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[5])


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs", "invalid regex"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}}},
            "response_format",
            "invalid JSON schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format", 'needs "json_schema"'),
        ({"response_format": {"type": "yaml"}}, "response_format", 'must be "text"'),
        ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs", "invalid grammar"),
        ({"guided_json": {"type": "object"}, "guided_regex": "a"}, "guided_regex", "one way to constrain"),
        ({"guided_choice": []}, "guided_choice", "non-empty strings"),
    ],
)
def test_bad_constraints_are_400s_naming_the_field_and_the_server_keeps_serving(
    server: ServerProcess, body: dict[str, Any], param: str, message: str
) -> None:
    import httpx

    reply = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 3, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and message in error["message"]
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def _count_grammar_builds(monkeypatch: pytest.MonkeyPatch) -> list[StructuredOutputs]:
    """Every constraint the grammar compiler builds (a cache miss), in order."""
    from compiled_engine.structured import grammar

    built: list[StructuredOutputs] = []
    build = grammar.grammar_text

    def counted(spec: StructuredOutputs) -> str:
        built.append(spec)
        return build(spec)

    monkeypatch.setattr(grammar, "grammar_text", counted)
    return built


def test_a_repeated_constraint_is_built_once_errors_too(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """The compiler's cache: the same constraint again (an equal one, not the same object) and a
    matcher made from it take the grammar built the first time; an invalid one is refused each
    time from one build."""
    built = _count_grammar_builds(monkeypatch)
    compiler = llm.engine.grammars.compiler()
    schema = {"type": "object", "properties": {"cache_test": {"type": "integer"}}, "required": ["cache_test"]}
    first = compiler.compile(StructuredOutputs.of({"json": schema}))
    assert compiler.compile(StructuredOutputs.of({"json": schema})) == first
    assert compiler.matcher(StructuredOutputs.of({"json": schema})).allowed().any()
    assert built == [StructuredOutputs.of({"json": schema})]
    bad = StructuredOutputs.of({"regex": "(unclosed"})
    for _ in range(2):
        with pytest.raises(RequestError, match="invalid regex"):
            compiler.compile(bad)
    assert built[1:] == [bad]


def test_bench_structured_reports_constrained_against_free(
    default_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from compiled_engine.bench.__main__ import main

    built = _count_grammar_builds(monkeypatch)
    out = tmp_path / "structured.json"
    args = ["structured", "--enforce-eager", "--kv-cache-memory-gib", "0.05", "--batch", "2", "--output-len", "10"]
    assert main([*args, "--rounds", "1", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    results = report["results"]
    assert report["peak_rss_bytes"] > 100e6  # the bench's JSON records the process's peak memory
    assert results["free_tokens_per_s"] > 0 and results["constrained_tokens_per_s"] > 0
    assert results["ratio"] == pytest.approx(results["constrained_tokens_per_s"] / results["free_tokens_per_s"])
    for figure in ("compile_cold_ms", "compile_warm_ms", "matcher_ms", "mask_us"):
        assert results[figure] > 0, figure
    assert results["free_steps"] > 0 and results["constrained_steps"] > 0
    # What "warm" measures is the cache: the 20-field schema is built once, for the cold compile,
    # and the warm compile and the matcher take it from the cache; so is the decode rounds'
    # schema, built once for all of its requests.
    schemas = [json.loads(spec.json) for spec in built if spec.json is not None]
    assert sum("r0_0" in schema["properties"] for schema in schemas) == 1, [spec.kind for spec in built]
    assert sum("facts" in schema["properties"] for schema in schemas) == 1, [spec.kind for spec in built]


# -- the rest of what clients send: logit_bias, /tokenize, /detokenize -------------------------


def test_logit_bias_forces_or_bans_tokens(llm: LLM) -> None:
    prompt = _chat(llm, "Say something.")
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)[0].outputs[0].token_ids
    forced = SamplingParams(temperature=0.8, seed=1, max_tokens=4, ignore_eos=True, logit_bias=((42, 100.0),))
    assert llm.generate([prompt], forced, use_tqdm=False)[0].outputs[0].token_ids == [42] * 4
    banned = SamplingParams(temperature=0, max_tokens=1, logit_bias=((free[0], -100.0),))
    assert llm.generate([prompt], banned, use_tqdm=False)[0].outputs[0].token_ids[0] != free[0]
    with pytest.raises(RequestError, match="outside the vocabulary"):
        llm.engine.add_request(prompt, SamplingParams(logit_bias=((10**7, 1.0),)))
    with pytest.raises(RequestError, match=r"biases in \[-100, 100\]"):
        SamplingParams(logit_bias=((5, 101.0),))


def test_logit_bias_tokenize_and_detokenize_through_the_server(server: ServerProcess, llm: LLM) -> None:
    import httpx

    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "ignore_eos": True, "logit_bias": {"42": 100}}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == llm.tokenizer.decode([42] * 3)
    for bias, message in (
        ({"x": 1}, "keys must be token ids"),
        ({"5": 500}, "[-100, 100]"),
        ({"99999999": 1}, "outside"),
    ):
        bad = httpx.post(f"{server.url}/v1/completions", json={**body, "logit_bias": bias}, timeout=60)
        assert bad.status_code == 400 and message in bad.json()["error"]["message"]
        assert bad.json()["error"]["param"] == "logit_bias"
    text = "The capital of France"
    tokens = httpx.post(f"{server.url}/tokenize", json={"prompt": text}, timeout=60).json()
    assert tokens["tokens"] == llm.tokenizer.encode(text) and tokens["count"] == len(tokens["tokens"])
    assert tokens["max_model_len"] == httpx.get(f"{server.url}/v1/models").json()["data"][0]["max_model_len"]
    messages = [{"role": "user", "content": text}]
    chat = httpx.post(f"{server.url}/tokenize", json={"messages": messages}, timeout=60).json()
    assert chat["tokens"] == llm.tokenizer.encode_chat(messages)
    back = httpx.post(f"{server.url}/detokenize", json={"tokens": tokens["tokens"]}, timeout=60).json()
    assert back["prompt"] == llm.tokenizer.decode(tokens["tokens"], skip_special_tokens=False)
    assert httpx.post(f"{server.url}/detokenize", json={"tokens": [-1]}, timeout=60).status_code == 400
    assert httpx.post(f"{server.url}/tokenize", json={}, timeout=60).status_code == 400


# -- tools ---------------------------------------------------------------------------------------

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {"type": "object", "properties": {"a": SMALL, "b": SMALL}, "required": ["a", "b"], "additionalProperties": False}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "The weather in a city", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD}},
]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def test_tool_call_blocks_parse_and_stream_only_what_cannot_be_a_call() -> None:
    from compiled_engine.server.common.tool_parsers import HermesParser

    parse_tool_calls, held_back = HermesParser().parse, HermesParser().shown

    text = 'Let me check.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    content, calls = parse_tool_calls(text, ["add", "get_weather"])
    assert content == "Let me check." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("add", {"a": 1, "b": 2})
    ]
    assert (
        parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}', ["add"])[1][0].name == "add"
    )  # unclosed at the end
    assert parse_tool_calls("no calls <tool_call>not json</tool_call>", ["add"]) == (
        "no calls <tool_call>not json</tool_call>",
        [],
    )
    assert held_back("Hello <tool") == len("Hello ") and held_back("Hello <tool_call>{") == len("Hello ")
    assert held_back("a < b") == len("a < b") and held_back("x<") == 1


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
@pytest.mark.parametrize("choice", ["required", "add"])
def test_required_and_named_tool_calls_parse_and_follow_the_parameters(
    server: ServerProcess, choice: str, stream: bool
) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    tool_choice: Any = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    request = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "tool_choice": tool_choice,
        "temperature": 0,
        "max_tokens": 80,
    }
    if stream:
        calls: dict[int, dict[str, str]] = {}
        reasons = []
        for chunk in client.chat.completions.create(**request, stream=True):
            for part in chunk.choices[0].delta.tool_calls or [] if chunk.choices else []:
                entry = calls.setdefault(part.index, {"name": "", "arguments": ""})
                entry["name"] += part.function.name or ""
                entry["arguments"] += part.function.arguments or ""
            if chunk.choices and chunk.choices[0].finish_reason:
                reasons.append(chunk.choices[0].finish_reason)
        found = [(c["name"], c["arguments"]) for c in calls.values()]
        assert reasons == ["tool_calls"]
    else:
        reply = client.chat.completions.create(**request)
        assert reply.choices[0].finish_reason == "tool_calls" and reply.choices[0].message.content is None
        tool_calls = reply.choices[0].message.tool_calls or []
        assert all(call.id.startswith("call_") for call in tool_calls)
        found = [(call.function.name, call.function.arguments) for call in tool_calls]  # type: ignore[union-attr]
    assert len(found) == 1
    name, arguments = found[0]
    assert name == choice if choice != "required" else name in ("get_weather", "add")
    jsonschema.validate(json.loads(arguments), WEATHER if name == "get_weather" else ADD)


def test_auto_parses_a_call_from_the_reply_and_tool_turns_come_back(server: ServerProcess) -> None:
    import httpx
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none")
    crafted = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}</tool_call>'
    for stream in (False, True):
        request = {"model": MODEL, "messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 60}
        extra = {"structured_outputs": {"choice": [crafted]}}  # the reply is this call, whatever the model says
        if stream:
            chunks = list(client.chat.completions.create(**request, stream=True, extra_body=extra))
            parts = [p for c in chunks if c.choices for p in c.choices[0].delta.tool_calls or []]
            assert not any(c.choices[0].delta.content for c in chunks if c.choices)  # the call's text is not streamed
            assert [(p.function.name, json.loads(p.function.arguments or "")) for p in parts] == [
                ("get_weather", {"city": "Paris", "unit": "c"})
            ]  # type: ignore[union-attr]
            reasons = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
            assert reasons == ["tool_calls"]  # one end, saying the reply is a call
        else:
            reply = client.chat.completions.create(**request, extra_body=extra)
            call = (reply.choices[0].message.tool_calls or [])[0]
            assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"  # type: ignore[union-attr]
    plain = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        temperature=0,
        max_tokens=12,
        extra_body={"structured_outputs": {"choice": ["Sunny."]}},
    )
    assert plain.choices[0].message.content == "Sunny." and not plain.choices[0].message.tool_calls
    turns = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    reply = client.chat.completions.create(
        model=MODEL,
        messages=turns,  # type: ignore[arg-type]
        tools=TOOLS,  # type: ignore[arg-type]
        temperature=0,
        max_tokens=12,
        extra_body={"structured_outputs": {"choice": ["It is 18 degrees."]}},
    )
    assert reply.choices[0].finish_reason == "stop" and reply.choices[0].message.content == "It is 18 degrees."
    rendered = httpx.post(f"{server.url}/tokenize", json={"messages": turns}, timeout=60).json()["tokens"]
    text = httpx.post(f"{server.url}/detokenize", json={"tokens": rendered}, timeout=60).json()["prompt"]
    assert '"city": "Paris"' in text and "18 degrees and sunny" in text and "<tool_response>" in text


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice",
            "not among the tools",
        ),
        ({"tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice", "tool_choice must be"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools", "letters, digits"),
        ({"tools": TOOLS + TOOLS[:1]}, "tools", "distinct function names"),
        (
            {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
            "constrains the output itself",
        ),
        ({"functions": [{"name": "f"}]}, "functions", "use tools"),
        (
            {
                "messages": [
                    *ASK,
                    {"role": "assistant", "tool_calls": [{"function": {"name": "add", "arguments": "{"}}]},
                ]
            },
            "messages",
            "needs function.name",
        ),
    ],
)
def test_bad_tool_requests_are_400s(server: ServerProcess, body: dict[str, Any], param: str, message: str) -> None:
    import httpx

    reply = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": ASK, "max_tokens": 3, **body}, timeout=60)
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == param and message in reply.json()["error"]["message"]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(server: ServerProcess) -> None:
    import httpx

    body = {
        "messages": ASK,
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=60) as reply:
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    chunks = [json.loads(line) for line in lines]
    content = [c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]
    assert content and all(c.get("usage") for c in content)
    counts = [c["usage"]["completion_tokens"] for c in content]
    assert counts == sorted(counts) and counts[-1] <= 8
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 8
    plain = {**body, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=plain, timeout=60) as reply:
        lines = [line[6:] for line in reply.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    assert not any(json.loads(line).get("usage") for line in lines[:-1])


QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n"
    "</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}<tool_call>{{ call.function | tojson }}"
    "</tool_call>{% endfor %}{% else %}{{ message.content }}{% endif %}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_takes_tools_renders_them_and_the_fallback_stays_out(
    default_model_dir: Path, tmp_path: Path
) -> None:
    from compiled_engine.server.common.tools import render_turns, tool_plan
    from compiled_engine.tokenizer import Tokenizer

    (tmp_path / "tokenizer.json").write_bytes((default_model_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": QWEN_STYLE_TEMPLATE}))
    tokenizer = Tokenizer(tmp_path)
    assert tokenizer.template_takes_tools and not Tokenizer(default_model_dir).template_takes_tools
    plan = tool_plan(TOOLS, "auto")
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}
    turns = [*ASK, {"role": "assistant", "content": "", "tool_calls": [call]}, {"role": "tool", "content": "3"}]
    rendered = tokenizer.apply_chat_template(
        render_turns(turns, plan, True),
        tools=[{"type": "function", "function": t} for t in plan.tools],  # type: ignore[union-attr]
    )
    assert rendered.count('"name": "get_weather"') == 1 and "You can call functions" not in rendered
    assert (
        "<|im_start|>tool\n3<|im_end|>" in rendered
        and '"arguments": "{\\"a\\": 1, \\"b\\": 2}"}</tool_call>' in rendered
    )
    fallback = Tokenizer(default_model_dir).apply_chat_template(render_turns(turns, plan, False))
    assert "You can call functions" in fallback and "<tool_response>\n3\n</tool_response>" in fallback


def test_prompt_logprobs_equal_transformers_in_chunks_and_skip_the_prefix_cache(
    tiny_model_factory: Any,
) -> None:
    """Each prompt token's logprob given the tokens before it, its rank and the top-N, against
    transformers on the same tiny model, with the prompt computed in chunks of 8; a second
    identical request computes its prompt again rather than taking cached pages."""
    from transformers import AutoModelForCausalLM

    model_dir = tiny_model_factory("llama")
    prompt = [5, 17, 99, 3, 42, 8, 11, 12, 13, 200, 7, 7, 31, 64, 150, 9, 21, 60, 2, 77]
    with torch.no_grad():
        hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        expected = torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), dim=-1)
    llm = LLM(str(model_dir), enforce_eager=True, page_size=4, num_pages=64, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0, max_tokens=2, n=2, prompt_logprobs=3)
    for _ in range(2):
        [out] = llm.generate([prompt], params, use_tqdm=False)
        assert out.prompt_logprobs is not None and len(out.prompt_logprobs) == len(prompt)
        assert out.prompt_logprobs[0] is None and out.num_cached_tokens == 0
        for position, entry in enumerate(out.prompt_logprobs[1:], 1):
            assert entry is not None and entry.token_id == prompt[position]
            row = expected[position - 1]
            assert entry.logprob == pytest.approx(float(row[prompt[position]]), abs=1e-4)
            assert entry.rank == int((row > row[prompt[position]]).sum()) + 1
            assert entry.top_token_ids == row.topk(3).indices.tolist()
    plain = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0]
    assert plain.prompt_logprobs is None and plain.outputs[0].token_ids == out.outputs[0].token_ids
    with pytest.raises(RequestError, match="prompt_logprobs must be in"):
        SamplingParams(prompt_logprobs=21)


def test_prompt_logprobs_through_the_server(server: ServerProcess, llm: LLM) -> None:
    import httpx

    body = {"prompt": "The capital of France is", "max_tokens": 2, "temperature": 0, "prompt_logprobs": 1}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    entries = reply.json()["choices"][0]["prompt_logprobs"]
    ids = llm.tokenizer.encode("The capital of France is")
    assert len(entries) == len(ids) and entries[0] is None
    for token, entry in zip(ids[1:], entries[1:], strict=True):
        assert str(token) in entry and entry[str(token)]["logprob"] <= 0 and entry[str(token)]["rank"] >= 1
    chat = httpx.post(
        f"{server.url}/v1/chat/completions",
        json={"messages": ASK, "max_tokens": 1, "prompt_logprobs": 0},
        timeout=60,
    ).json()
    assert chat["prompt_logprobs"][0] is None and all(len(e) == 1 for e in chat["prompt_logprobs"][1:])
    assert (
        "prompt_logprobs"
        not in httpx.post(f"{server.url}/v1/completions", json={**body, "prompt_logprobs": None}, timeout=60).json()[
            "choices"
        ][0]
    )
    streamed = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=60)
    assert streamed.status_code == 400 and streamed.json()["error"]["param"] == "prompt_logprobs"
