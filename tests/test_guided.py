"""Guided decoding through the whole engine: validity, every grammar kind, both backends,
bad grammars failing alone, and compilation that never blocks other requests."""

from __future__ import annotations

import asyncio
import json
import re
import time
from pathlib import Path

import jsonschema
import pytest

from guidespec import LLM, RequestError, SamplingParams
from guidespec.entrypoints.sweep import is_grammar_refusal, validate_output
from guidespec.protocol import GuidedDecoding, RequestOutput

pytestmark = pytest.mark.slow
WORKLOAD = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "jsonschemabench" / "workload.jsonl"
BACKENDS = ["xgrammar", "llguidance"]


@pytest.fixture(scope="module")
def llm(default_llm: LLM) -> LLM:
    return default_llm


def _jme_cases(n: int) -> list[dict]:
    cases = [json.loads(line) for line in WORKLOAD.read_text().splitlines()]
    return [c for c in cases if c["id"].startswith("JME_")][:n]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_outputs_validate(llm: LLM, backend: str, temperature: float) -> None:
    cases = _jme_cases(6)

    async def run() -> list:
        return await asyncio.gather(
            *(
                llm.agenerate(
                    c["messages"],
                    SamplingParams(
                        max_tokens=400,
                        temperature=temperature,
                        seed=i,
                        guided=GuidedDecoding(json_schema=c["schema"], backend=backend),
                    ),
                )
                for i, c in enumerate(cases)
            ),
            return_exceptions=True,
        )

    outputs = asyncio.run(run())
    compiled = [
        (c, o) for c, o in zip(cases, outputs) if not (isinstance(o, RequestError) and is_grammar_refusal(str(o)))
    ]
    assert len(compiled) >= 4
    for case, out in compiled:
        assert not isinstance(out, BaseException), out
        assert out.finish_reason == "stop", (case["id"], out.text)  # loops are closed early, not cut
        assert validate_output(out.text, case["schema"]) is None, (case["id"], out.text)


@pytest.mark.parametrize("backend", BACKENDS)
def test_regex_choice_object_and_grammar(llm: LLM, backend: str) -> None:
    def run(guided: GuidedDecoding, prompt: str = "Answer:") -> str:
        out = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0.0, guided=guided))[0]
        assert out.finish_reason == "stop"
        return out.text

    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", run(GuidedDecoding(regex=r"[0-9]{3}-[0-9]{4}", backend=backend)))
    assert run(GuidedDecoding(choice=("red", "green", "blue"), backend=backend)) in ("red", "green", "blue")
    assert isinstance(json.loads(run(GuidedDecoding(json_object=True, backend=backend), "A JSON object:")), dict)
    grammar = 'root ::= "yes" | "no"' if backend == "xgrammar" else 'start: "yes" | "no"'
    assert run(GuidedDecoding(grammar=grammar, backend=backend), "Is water wet?") in ("yes", "no")


def test_guided_and_unguided_share_a_batch(llm: LLM) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]}
    plain = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = llm.generate("The weather today", plain)[0].token_ids

    async def run() -> list:
        return await asyncio.gather(
            llm.agenerate("The weather today", plain),
            llm.agenerate(
                [{"role": "user", "content": "Name a city as JSON."}],
                SamplingParams(max_tokens=60, temperature=0.0, guided=GuidedDecoding(json_schema=schema)),
            ),
        )

    unguided, guided = asyncio.run(run())
    assert unguided.token_ids == alone
    assert validate_output(guided.text, schema) is None


def test_unverified_jump_forward_writes_the_same_document(llm: LLM) -> None:
    """The opt-in ``jump_forward="unverified"`` appends the grammar's forced text as its own
    tokenization; the default (forced tokens verified by the model) equals no jump-forward at all
    token for token (``tests/test_speculative.py``)."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    prompt = [{"role": "user", "content": "Give a person named Ann aged 31 as JSON."}]
    params = SamplingParams(max_tokens=60, temperature=0.0, guided=GuidedDecoding(json_schema=schema))
    verified = llm.generate(prompt, params)[0]
    with LLM(max_batch_size=2, jump_forward="unverified", show_progress=False) as unverified:
        assert unverified.config.jump_forward == "unverified"
        appended = unverified.generate(prompt, params)[0]  # the forced text's own tokenization: same text here
    assert json.loads(appended.text) == json.loads(verified.text)


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(json_schema="{not json"), "not valid JSON"),
        (dict(json_schema="[1, 2]"), "JSON object"),
        (dict(choice=()), "non-empty"),
        (dict(regex="a", choice=("b",)), "exactly one"),
        (dict(regex="a", backend="outlines"), "unknown grammar backend"),
    ],
)
def test_malformed_constraints_raise_in_the_client(llm: LLM, bad: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        llm.generate("x", SamplingParams(guided=GuidedDecoding(**bad)))


@pytest.mark.parametrize(
    "guided, message",
    [
        (GuidedDecoding(regex="(ab", backend="xgrammar"), "xgrammar cannot compile this regex"),
        (GuidedDecoding(regex="(ab", backend="llguidance"), "llguidance cannot compile this regex"),
        (
            GuidedDecoding(json_schema={"type": "string", "not": {"pattern": "^a"}}, backend="llguidance"),
            'Unimplemented keys: ["not"]',
        ),
        (GuidedDecoding(grammar="root ::= ", backend="xgrammar"), "xgrammar cannot compile this grammar"),
    ],
)
def test_grammar_the_backend_rejects_fails_that_request_alone(llm: LLM, guided: GuidedDecoding, message: str) -> None:
    plain = SamplingParams(max_tokens=6, temperature=0.0)

    async def run() -> tuple:
        return await asyncio.gather(
            llm.agenerate("Hello", plain),
            llm.agenerate("Hello", SamplingParams(max_tokens=6, guided=guided)),
            return_exceptions=True,
        )

    ok, failed = asyncio.run(run())
    assert ok.finished and isinstance(failed, RequestError) and message in str(failed)
    with pytest.raises(RequestError, match=re.escape(message)):  # the negative cache answers the same
        llm.generate("Hello", SamplingParams(max_tokens=6, guided=guided))


def test_backend_auto_serves_what_one_backend_refuses(llm: LLM) -> None:
    """xgrammar refuses 'minLength' beside a 'pattern' (it would ignore it); with backend auto (the
    default) llguidance serves the request, and the output says so; a schema both refuse fails
    with both reasons."""
    import jsonschema

    assert llm.config.grammar_backend == "auto"
    schema = {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[a-z]+$", "minLength": 3}},
        "required": ["code"],
        "additionalProperties": False,
    }
    prompt = [{"role": "user", "content": "Give a JSON object whose code is a lowercase word."}]
    out = llm.generate(
        prompt, SamplingParams(max_tokens=40, temperature=0.0, guided=GuidedDecoding(json_schema=schema))
    )[0]
    assert out.grammar_backend == "llguidance" and "xgrammar cannot enforce 'minLength'" in out.grammar_refusal
    assert out.finish_reason == "stop"
    jsonschema.validate(json.loads(out.text), schema)
    plain = llm.generate(prompt, SamplingParams(max_tokens=8, guided=GuidedDecoding(choice=("yes", "no"))))[0]
    assert (plain.grammar_backend, plain.grammar_refusal) == ("xgrammar", "")
    with pytest.raises(RequestError) as failure:
        llm.generate(
            prompt,
            SamplingParams(
                max_tokens=8, guided=GuidedDecoding(json_schema={"type": "string", "not": {"pattern": "^a"}})
            ),
        )
    assert failure.value.status == 400
    assert "xgrammar cannot enforce 'not'" in str(failure.value) and "llguidance cannot" in str(failure.value)


def _slow_schema(tag: str, values: int = 8000) -> dict:
    """An enum this large takes seconds from its request to a ready matcher on our machines (8000
    values: 4.9 s on a 2-core EPYC, 2.6 s on a Xeon; 20000 values took 17 s)."""
    return {"type": "string", "enum": [f"{tag}_value_{i}_{i * 7}" for i in range(values)]}


def test_a_grammar_that_compiles_during_the_prefill_masks_the_first_token_there(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A JME schema compiles while its prompt's prefill runs (past the grace) and is ready before
    the prefill ends: the scheduler writes the held-back mask during the step, and the first
    token is sampled in the prefill step as with a grammar ready at once (cached): the same
    steps, the same output.

    The prompt is padded to 455 tokens, one prefill step of ~0.65 s here: the schema compiles in
    ~30 ms, but at 143 tokens (a 0.26 s prefill) a loaded host once let the compile end after the
    prefill (its mask came late, by design, and the request took a step more)."""
    monkeypatch.setenv("GUIDESPEC_TRACE", str(tmp_path / "trace.json"))
    case = _jme_cases(1)[0]
    messages = [dict(m) for m in case["messages"]]
    messages[0]["content"] += "\n\n" + " ".join(f"Note {i} of the archive is empty." for i in range(32))
    params = SamplingParams(max_tokens=48, temperature=0.0, guided=GuidedDecoding(json_schema=case["schema"]))
    with LLM(max_batch_size=2, show_progress=False, enable_prefix_caching=False) as engine:
        compiled_meanwhile = engine.generate(messages, params)[0]
        cached = engine.generate(messages, params)[0]
        prompt_len = len(engine.encode_prompt(messages))
    assert prompt_len <= 512  # (one prefill step: the engine's max_num_batched_tokens)
    assert compiled_meanwhile.token_ids == cached.token_ids
    forwards = [e["args"] for e in json.loads((tmp_path / "trace.json").read_text())["traceEvents"]]
    forwards = [a for a in forwards if a.get("tokens") and "step" in a]
    steps = {a["step"]: a for a in forwards}
    prefills = [s for s, a in sorted(steps.items()) if a["tokens"] == prompt_len]  # (3: forced tokens verified)
    assert len(prefills) == 2 and all(steps[s]["guided_rows"] for s in prefills)
    assert prefills[1] - prefills[0] == max(steps) + 1 - prefills[1]  # the same number of steps


def test_unguided_request_completes_while_a_grammar_compiles(llm: LLM) -> None:
    """The guided request's prompt is computed while its grammar compiles for seconds: the token
    the workers sample for its last prompt token without the mask (it came too late) is dropped,
    and that token runs again once the grammar is ready. (The compile is background work, but the
    scheduler's load of it shares the cores with the steps: 12,000 values, so that it is still
    compiling when the 8 tokens are done on a 2-core host.)"""
    schema = _slow_schema("waiting", 12000)
    plain = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def run() -> tuple:
        guided = asyncio.ensure_future(
            llm.agenerate(
                "Pick one:", SamplingParams(max_tokens=30, temperature=0.0, guided=GuidedDecoding(json_schema=schema))
            )
        )
        await asyncio.sleep(0.2)
        unguided = await llm.agenerate("Count: 1, 2, 3,", plain)
        return unguided, time.time(), await guided

    unguided, unguided_done, guided = asyncio.run(run())
    assert len(unguided.token_ids) == 8
    assert guided.first_token_time > unguided_done  # the guided request was still compiling
    assert json.loads(guided.text) in schema["enum"]


def test_compile_timeout_fails_the_request_with_a_clear_message() -> None:
    """The deadline passes while another request's steps run (the scheduler watches compiles while
    it waits for a step): the guided request fails, the other one runs to its end."""
    slow = SamplingParams(max_tokens=4, guided=GuidedDecoding(json_schema=_slow_schema("timeout")))

    long_enough = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)  # (~3 s of steps: 6x the deadline)

    async def run(engine: LLM) -> RequestOutput:
        plain = asyncio.ensure_future(engine.agenerate("Count: 1, 2, 3,", long_enough))
        await asyncio.sleep(0.1)
        with pytest.raises(RequestError, match="grammar compilation took longer than 0.5 s"):
            await engine.agenerate("x", slow)
        assert not plain.done()  # the guided request failed while the other one's steps ran
        return await plain

    with LLM(max_batch_size=2, grammar_compile_timeout_s=0.5, show_progress=False) as engine:
        assert len(asyncio.run(run(engine)).token_ids) == 120
        assert engine.generate("Hi", SamplingParams(max_tokens=3))[0].finished
        # the compile process was killed and restarted: guided requests work again
        out = engine.generate("Pick:", SamplingParams(max_tokens=5, guided=GuidedDecoding(choice=("a", "b"))))[0]
        assert out.text in ("a", "b")


def test_json_output_closes_before_the_model_length_ends(llm: LLM) -> None:
    """max_tokens far beyond the context left: the output still closes in time instead of being cut
    (JME_30 loops in its "ingredients" array until something stops it)."""
    case = next(c for c in _jme_cases(50) if c["id"] == "JME_30")
    prompt_len = len(llm.encode_prompt(case["messages"]))
    with LLM(max_batch_size=1, max_model_len=prompt_len + 40, show_progress=False) as engine:
        out = engine.generate(
            case["messages"],
            SamplingParams(max_tokens=1024, temperature=0.0, guided=GuidedDecoding(json_schema=case["schema"])),
        )[0]
    assert out.finish_reason == "stop", out.text
    assert validate_output(out.text, case["schema"]) is None, out.text


def test_an_enum_beside_a_type_it_contradicts_is_exact(llm: LLM) -> None:
    """No string is an object: a valid answer leaves the property out; required, it is a 400."""
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "builtin": {"enum": ["MODIFIABLE", "DELETABLE", "IMMUTABLE"], "type": "object"},
        },
        "required": ["name"],
    }
    prompt = [{"role": "user", "content": 'As JSON: name "disk", builtin "MODIFIABLE".'}]
    for backend in BACKENDS:
        out = llm.generate([prompt], _params(backend, schema, max_tokens=40))[0]
        assert out.finish_reason == "stop" and "builtin" not in json.loads(out.text)
        jsonschema.validate(json.loads(out.text), schema)
    with pytest.raises(RequestError) as raised:
        llm.generate([prompt], _params("auto", {**schema, "required": ["name", "builtin"]}))
    assert raised.value.status == 400
    assert "no JSON value can match this json_schema" in str(raised.value)
    assert "required property 'builtin' can have no value" in str(raised.value)


# issue 45's: xgrammar refuses it (a pattern beside minLength); llguidance gave up after the
# opening quote with its own lexer fuel, and the error read as a finished answer ("", "stop")
ISSUE_45_SCHEMA = {
    "type": "string",
    "pattern": "[aA][12].*[zZ]",
    "minLength": 10,
    "maxLength": 90,
    "anyOf": [{"pattern": p} for p in ("ab1", "b12", "bc1", "c12", "ca1", "a12")],
}


def test_issue_45s_string_schema_gives_a_valid_answer(llm: LLM) -> None:
    prompt = [{"role": "user", "content": "Give a code that starts with a12 and ends with z, as a JSON string."}]
    out = llm.generate([prompt], _params("auto", ISSUE_45_SCHEMA, max_tokens=60))[0]
    assert out.finish_reason == "stop" and out.grammar_backend == "llguidance"
    jsonschema.validate(json.loads(out.text), ISSUE_45_SCHEMA)


def _params(backend: str, schema: dict, max_tokens: int = 40) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, guided=GuidedDecoding(json_schema=json.dumps(schema), backend=backend)
    )
