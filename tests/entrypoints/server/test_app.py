"""The app (``server/app.py`` and ``routes.py``) in process over a fake engine: the API key, the
body size limit and draining in front of ``/v1``; 422 and 404 in OpenAI's shape; a completion
answered whole and streamed; a stream that fails after its first byte ends with an error event.
The real engine behind a real server is ``test_server.py``'s."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any, AsyncIterator

import pytest
from fastapi.testclient import TestClient

from guidespec.entrypoints.server import MAX_BODY_BYTES, RETRY_AFTER_S, create_app
from guidespec.llm import GenerationOutput, RequestError, RequestHandle, StreamDelta
from guidespec.protocol import SamplingParams, SchedulerStats

AUTH = {"Authorization": "Bearer key"}
FAILED = RequestError("request r: xgrammar gave up: too deep", 500, "grammar_failed")


class FakeLLM:
    """Writes ``pieces`` (an exception among them is raised there), one delta each."""

    config = SimpleNamespace(max_model_len=64, grammar_backend="auto")
    num_restarts = 0
    scheduler_stats = SchedulerStats(running=0, waiting=0, waiting_for_grammar=0, free_slots=2)

    def __init__(self) -> None:
        self.pieces: list[Any] = ["Hel", "lo"]

    def check_alive(self) -> None:
        pass

    def encode_prompt(self, prompt: Any) -> list[int]:
        return [1] * (len(prompt.split()) if isinstance(prompt, str) else 10)

    def open_stream(self, prompt: dict[str, Any], params: SamplingParams, stream: bool = False) -> RequestHandle:
        out = GenerationOutput("r", prompt["prompt_token_ids"], arrival_time=1.0)
        pieces = self.pieces

        async def deltas() -> AsyncIterator[StreamDelta]:
            for i, piece in enumerate(pieces):
                if isinstance(piece, Exception):
                    raise piece
                last = i == len(pieces) - 1
                out.text, out.finished, out.finish_reason = out.text + piece, last, "length" if last else None
                out.token_ids.append(i)
                yield StreamDelta("r", piece, [i], last, out.finish_reason)

        return RequestHandle(out, deltas())


@pytest.fixture
def llm() -> FakeLLM:
    return FakeLLM()


@pytest.fixture
def client(llm: FakeLLM) -> TestClient:
    return TestClient(create_app(llm, "m", api_key="key"), raise_server_exceptions=False)  # type: ignore[arg-type]


def _error(response: Any, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status
    error: dict[str, Any] = response.json()["error"]
    assert error["type"] == kind and error["code"] == status
    return error


def test_the_key_the_size_limit_and_draining_guard_the_v1_routes(client: TestClient) -> None:
    assert client.get("/v1/models", headers=AUTH).json()["data"][0]["id"] == "m"
    _error(client.get("/v1/models"), 401, "AuthenticationError")
    assert client.get("/v1/models", headers={"Authorization": "bearer key"}).status_code == 200
    huge = b"x" * (MAX_BODY_BYTES + 1)
    _error(client.post("/v1/completions", headers=AUTH, content=huge), 413, "RequestTooLargeError")
    client.app.state.draining = True  # type: ignore[attr-defined]
    response = client.get("/v1/models", headers=AUTH)
    _error(response, 503, "ServiceUnavailableError")
    assert response.headers["retry-after"] == str(RETRY_AFTER_S) and client.get("/health").status_code == 503


def test_bodies_of_the_wrong_shape_and_unknown_routes_answer_in_openais_shape(client: TestClient) -> None:
    body = {"prompt": "hi", "max_tokens": "many"}
    error = _error(client.post("/v1/completions", headers=AUTH, json=body), 422, "UnprocessableEntityError")
    assert error["param"] == "max_tokens"
    for prompt in (5, [True], [1.0], [[1, [2]]], None):  # the prompt's own check: a 400 naming it
        error = _error(client.post("/v1/completions", headers=AUTH, json={"prompt": prompt}), 400, "BadRequestError")
        assert error["param"] == "prompt" and "prompt must be a string" in error["message"]
    _error(client.get("/nope", headers=AUTH), 404, "NotFoundError")
    body = {"prompt": "hi", "model": "other"}
    assert _error(client.post("/v1/completions", headers=AUTH, json=body), 404, "NotFoundError")["param"] == "model"


def test_a_completion_whole_and_streamed(client: TestClient) -> None:
    whole = client.post("/v1/completions", headers=AUTH, json={"prompt": "hi"}).json()
    assert whole["choices"][0]["text"] == "Hello" and whole["usage"]["completion_tokens"] == 2
    body = {"messages": [{"role": "user", "content": "hi"}], "stream": True}
    events = client.post("/v1/chat/completions", headers=AUTH, json=body).text.split("\n\n")
    deltas = [json.loads(e.removeprefix("data: "))["choices"][0]["delta"] for e in events[:-2]]
    assert deltas == [{"role": "assistant", "content": ""}, {"content": "Hel"}, {"content": "lo"}]
    assert events[-2:] == ["data: [DONE]", ""]


def test_a_failure_before_the_first_byte_is_a_status_after_it_an_error_event(client: TestClient, llm: FakeLLM) -> None:
    llm.pieces = [FAILED]
    response = client.post("/v1/completions", headers=AUTH, json={"prompt": "hi", "stream": True})
    assert response.status_code == 500 and response.json()["error"]["code"] == "grammar_failed"
    llm.pieces = ["ok", FAILED]
    events = client.post("/v1/completions", headers=AUTH, json={"prompt": "hi", "stream": True}).text.split("\n\n")
    assert json.loads(events[0].removeprefix("data: "))["choices"][0]["text"] == "ok"
    assert json.loads(events[1].removeprefix("data: "))["error"]["code"] == "grammar_failed"
    metrics = client.get("/metrics").text
    assert 'guidespec_grammar_failures_total{backend="xgrammar",outcome="failed"} 2.0' in metrics
