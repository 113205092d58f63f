"""schemathesis against the server's own OpenAPI document (``/openapi.json``): every operation
fuzzed with generated bodies, valid and invalid, from a fixed seed, checked for no 5xx
(``not_a_server_error``), responses that match their documented schema, status codes and
content types the document declares.

The server runs with a short model length (64 tokens), so a generated request that is valid
generates few tokens; the run is bounded by ``MAX_EXAMPLES`` per operation (derandomized:
the same cases every run). ``/v1/completions``' ``prompt`` is fuzzed on its own as well (any
JSON value, and near misses of OpenAI's four forms): a 200 exactly where it is a prompt.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.entrypoints.server.serving import AUTH, Server, start_server, stop_server

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 40
VOCAB, MAX_MODEL_LEN = 49152, 64  # SmolLM2's vocabulary; the fuzzed server's model length
# printable ASCII: a token at most a character, so a text prompt leaves room for the answer
_TEXT = st.text(st.characters(min_codepoint=32, max_codepoint=126), max_size=30)
_IDS = st.lists(st.integers(-3, VOCAB + 3) | st.integers(-(2**70), 2**70), min_size=0, max_size=70)
_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) | _TEXT,
    lambda children: st.lists(children, max_size=6) | st.dictionaries(_TEXT, children, max_size=3),
    max_leaves=20,
)
PROMPTS = (
    _JSON
    | _TEXT
    | _IDS
    | st.lists(_IDS | _TEXT, min_size=1, max_size=2)  # batches (of one: a prompt)
    | st.lists(st.integers(0, 200) | st.booleans())  # ids with a bool among them
)
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance]


@pytest.fixture(scope="module")
def fuzzed_server() -> Iterator[Server]:
    server = start_server("--max-batch-size", "4", "--max-model-len", "64", "--speculative", "ngram")
    try:
        yield server
    finally:
        stop_server(server)


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_server_error(fuzzed_server: Server, mode: GenerationMode) -> None:
    """Each operation's cases (schemathesis' strategies, run by hypothesis here: its pytest plugin
    does not run under pytest 9), valid bodies then invalid ones."""
    api = schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json")
    operations = [result.ok() for result in api.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions", "GET /health"}
    statuses: Counter[int] = Counter()
    for operation in operations:
        if mode is GenerationMode.NEGATIVE and operation.method.upper() == "GET":
            continue  # nothing in a GET of ours to make invalid

        @given(case=operation.as_strategy(mode))
        @settings(
            max_examples=MAX_EXAMPLES,
            derandomize=True,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        def call(case: schemathesis.Case) -> None:
            response = case.call_and_validate(headers=AUTH, timeout=60, checks=CHECKS)
            statuses[response.status_code] += 1

        call()
    if mode is GenerationMode.POSITIVE:  # streams, whatever the generator drew: the events are checked too
        for path, body in (
            ("/v1/completions", {"prompt": "Hi"}),
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
        ):
            case = api[path]["POST"].Case(body={**body, "max_tokens": 5, "stream": True})
            statuses[case.call_and_validate(headers=AUTH, timeout=60, checks=CHECKS).status_code] += 1
    print(f"{mode.value}: {sum(statuses.values())} requests, by status {dict(sorted(statuses.items()))}")
    assert statuses[200] > 0 if mode is GenerationMode.POSITIVE else sum(statuses.values()) > 0
    assert httpx.get(f"{fuzzed_server.url}/health", timeout=5).status_code == 200


def _is_prompt(value: Any) -> bool:
    """A ``prompt`` the fuzzed server serves: text, token ids in its vocabulary that leave room
    for one token, or a batch of one of these."""
    if isinstance(value, list) and len(value) == 1 and isinstance(value[0], (str, list)):
        value = value[0]
    if isinstance(value, str):
        return bool(value)
    is_id = lambda t: type(t) is int and 0 <= t < VOCAB  # noqa: E731 (bools are no ids)
    return isinstance(value, list) and 0 < len(value) < MAX_MODEL_LEN and all(is_id(t) for t in value)


def test_a_prompt_is_served_exactly_where_it_is_one(fuzzed_server: Server) -> None:
    """Any JSON as ``prompt`` (bools, floats, nesting, ids out of the vocabulary): a 400 naming
    the field unless it is a prompt, never a 5xx or a 422; the engine serves on."""
    statuses: Counter[int] = Counter()

    @given(prompt=PROMPTS)
    @settings(max_examples=80, derandomize=True, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def call(prompt: Any) -> None:
        body = {"prompt": prompt, "max_tokens": 1}
        response = httpx.post(f"{fuzzed_server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
        statuses[response.status_code] += 1
        assert response.status_code == (200 if _is_prompt(prompt) else 400), (prompt, response.text[:300])
        if response.status_code == 400:
            assert response.json()["error"]["param"] == "prompt", response.text[:300]

    call()
    print(f"prompt: by status {dict(sorted(statuses.items()))}")
    assert statuses[200] > 0 and statuses[400] > 0
    assert httpx.get(f"{fuzzed_server.url}/health", timeout=5).status_code == 200
