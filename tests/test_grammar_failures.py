"""A grammar that gives up mid-way is never a finished answer (issue 45).

The engine here runs llguidance with almost no lexer fuel (``GUIDESPEC_LLGUIDANCE_LEXER_FUEL``),
so a string of a pattern makes its matcher fail a few tokens in (past the compile-time walk),
as issue 45's schema did with llguidance's own limits; and "auto" tries llguidance first
(``GUIDESPEC_AUTO_BACKENDS``), so a request whose grammar fails has xgrammar left to start
again on. Both through the Python API and through ``guidespec serve``."""

from __future__ import annotations

import asyncio
import json
import os
import re
from typing import Iterator

import httpx
import jsonschema
import pytest

from guidespec import LLM, RequestError, SamplingParams
from guidespec.protocol import GRAMMAR_FAILED, GuidedDecoding

pytestmark = pytest.mark.slow

ENV = {"GUIDESPEC_LLGUIDANCE_LEXER_FUEL": "500", "GUIDESPEC_AUTO_BACKENDS": "llguidance,xgrammar"}
# llguidance (fuel 500) fails at the code's opening quote, after '{"id":' and a number; xgrammar
# enforces it
SCHEMA = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "code": {"type": "string", "pattern": "^(ab1|b12|bc1|c12|ca1|a12)[a-z]{2,8}z$"},
    },
    "required": ["id", "code"],
}
# issue 45's: xgrammar refuses it; llguidance gives up after the opening quote unless its fuel is raised
ISSUE_SCHEMA = {
    "type": "string",
    "pattern": "[aA][12].*[zZ]",
    "minLength": 10,
    "maxLength": 90,
    "anyOf": [{"pattern": p} for p in ("ab1", "b12", "bc1", "c12", "ca1", "a12")],
}
PROMPT = [{"role": "user", "content": "Make up an id and a code, as JSON."}]


@pytest.fixture(scope="module")
def llm() -> Iterator[LLM]:
    saved = {name: os.environ.get(name) for name in ENV}
    os.environ.update(ENV)  # (an engine takes the client's environment when it starts)
    try:
        with LLM(max_batch_size=8, show_progress=False) as engine:
            yield engine
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _params(backend: str, schema: dict = SCHEMA, max_tokens: int = 48) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, temperature=0.0, guided=GuidedDecoding(json_schema=json.dumps(schema), backend=backend)
    )


def test_a_grammar_that_gives_up_fails_its_request_with_grammar_failed(llm: LLM) -> None:
    with pytest.raises(RequestError) as raised:
        llm.generate([PROMPT], _params("llguidance"))
    assert raised.value.status == 500 and raised.value.code == GRAMMAR_FAILED
    message = str(raised.value)
    assert "llguidance gave up" in message and "too many expressions" in message and "Traceback" not in message


def test_a_stream_whose_grammar_gives_up_never_ends_with_stop(llm: LLM) -> None:
    deltas = []
    with pytest.raises(RequestError) as raised:
        for delta in llm.stream(PROMPT, _params("llguidance")):
            deltas.append(delta)
    assert raised.value.code == GRAMMAR_FAILED
    assert all(d.finish_reason != "stop" and not d.finished for d in deltas)


def test_the_rest_of_the_batch_is_not_touched(llm: LLM) -> None:
    async def run() -> list:
        return await asyncio.gather(
            llm.agenerate(PROMPT, _params("llguidance")),
            llm.agenerate(PROMPT, SamplingParams(max_tokens=24, temperature=0.0)),
            llm.agenerate(PROMPT, _params("xgrammar")),
            return_exceptions=True,
        )

    failed, unguided, guided = asyncio.run(run())
    assert isinstance(failed, RequestError) and failed.code == GRAMMAR_FAILED
    assert unguided.finish_reason == "length" and len(unguided.token_ids) == 24
    assert guided.finish_reason == "stop" and guided.grammar_backend == "xgrammar"
    jsonschema.validate(json.loads(guided.text), SCHEMA)


def test_auto_starts_a_request_again_on_the_next_backend(llm: LLM) -> None:
    out = llm.generate([PROMPT], _params("auto"))[0]
    assert out.finish_reason == "stop" and out.grammar_backend == "xgrammar"
    assert out.stats.grammar_restarts == 1 and "llguidance gave up" in out.grammar_refusal
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_a_request_with_stop_strings_starts_again_with_nothing_of_its_first_try(llm: LLM) -> None:
    """A request with stop strings sends the client each step's tokens (the client finds stop
    strings: ``output_text``), also where it does not stream: its first try's tokens reach the
    client, and the restart's first delta says they are void. The output is the second try's
    alone, as without stop strings."""
    plain = llm.generate([PROMPT], _params("auto"))[0]
    params = _params("auto")
    stopped = SamplingParams(
        max_tokens=params.max_tokens, temperature=0.0, guided=params.guided, stop=("never in a JSON answer\n",)
    )
    out = llm.generate([PROMPT], stopped)[0]
    assert out.stats.grammar_restarts == 1 and out.grammar_backend == "xgrammar"
    assert out.token_ids == plain.token_ids and out.text == plain.text
    jsonschema.validate(json.loads(out.text), SCHEMA)


def test_issue_45s_schema_is_refused_where_every_backend_would_give_up(llm: LLM) -> None:
    """With llguidance's fuel this low its compile-time walk finds the failure after the quote:
    a 400 that names both backends' reasons, before any token."""
    with pytest.raises(RequestError) as raised:
        llm.generate([PROMPT], _params("auto", ISSUE_SCHEMA))
    message = str(raised.value)
    assert raised.value.status == 400 and "no grammar backend can enforce this exactly" in message
    assert "xgrammar cannot enforce 'minLength' beside a 'pattern'" in message
    assert 'llguidance cannot enforce this json_schema: it gives up after "\\""' in message


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    from tests.entrypoints.server.serving import start_server, stop_server

    saved = {name: os.environ.get(name) for name in ENV}
    os.environ.update(ENV)
    try:
        running = start_server("--max-batch-size", "4")
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    try:
        yield running.url
    finally:
        stop_server(running)


def _body(backend: str, stream: bool = False) -> dict:
    return {
        "model": "SmolLM2-135M-Instruct",
        "messages": PROMPT,
        "max_tokens": 48,
        "temperature": 0,
        "stream": stream,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
        "guided_decoding_backend": backend,
    }


def test_the_server_answers_a_grammar_that_gives_up_with_grammar_failed(server: str) -> None:
    from tests.entrypoints.server.serving import AUTH

    answer = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, json=_body("llguidance"), timeout=120)
    assert answer.status_code == 500
    error = answer.json()["error"]
    assert error["code"] == GRAMMAR_FAILED and "llguidance gave up" in error["message"]

    events = []
    with httpx.stream(
        "POST", f"{server}/v1/chat/completions", headers=AUTH, json=_body("llguidance", stream=True), timeout=120
    ) as streamed:
        if streamed.status_code == 200:  # (the failure may come before the first byte: then a 500 as above)
            events = [json.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
            assert events[-1]["error"]["code"] == GRAMMAR_FAILED
        else:
            streamed.read()
            assert streamed.status_code == 500 and streamed.json()["error"]["code"] == GRAMMAR_FAILED
    assert not any(c.get("finish_reason") for e in events for c in e.get("choices", []))


def test_the_server_says_a_request_started_again_on_another_backend(server: str) -> None:
    from tests.entrypoints.server.serving import AUTH

    answer = httpx.post(f"{server}/v1/chat/completions", headers=AUTH, json=_body("auto"), timeout=120)
    assert answer.status_code == 200, answer.text
    assert answer.headers["X-Guidespec-Grammar-Backend"] == "xgrammar"
    assert answer.headers["X-Guidespec-Grammar-Restarts"] == "1"
    body = answer.json()
    assert body["usage"]["grammar_backend"] == "xgrammar" and body["usage"]["grammar_restarts"] == 1
    assert body["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(body["choices"][0]["message"]["content"]), SCHEMA)
    metrics = httpx.get(f"{server}/metrics", timeout=10).text
    assert 'guidespec_grammar_failures_total{backend="llguidance",outcome="restarted"} 1.0' in metrics
    failed = re.search(
        r'^guidespec_grammar_failures_total\{backend="llguidance",outcome="failed"\} (\S+)', metrics, re.M
    )
    assert failed is not None and float(failed.group(1)) >= 2  # (the test above: its answer and its stream)
