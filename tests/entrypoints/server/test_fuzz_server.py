"""schemathesis against the server's own OpenAPI document (``/openapi.json``): every operation
fuzzed with generated bodies, valid and invalid, from a fixed seed, checked for no 5xx
(``not_a_server_error``), responses that match their documented schema, status codes and
content types the document declares.

The server runs with a short model length (64 tokens), so a generated request that is valid
generates few tokens; the run is bounded by ``MAX_EXAMPLES`` per operation (derandomized:
the same cases every run).
"""

from __future__ import annotations

from collections import Counter
from typing import Iterator

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
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
