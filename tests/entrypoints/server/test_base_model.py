"""``guidespec serve`` on a base model (a tiny random one, without a chat template), driven by
the ``openai`` client: completions of text and of token ids (OpenAI's ``prompt`` forms), a chat
request refused with a 400 that names the missing template and says what to do, and ``prompt``
values that are no prompt (bools, floats, nested lists, ids out of the vocabulary, a huge list)
refused with a 400 naming the field while the engine serves on. (The ``LLM`` side:
``tests/test_prompts.py``; hypothesis fuzzing of ``prompt``: ``test_fuzz_server.py``.)"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterator

import httpx
import openai
import pytest

from guidespec.entrypoints.args import engine_from_args
from guidespec.entrypoints.cli import _parser
from tests.entrypoints.server.serving import AUTH, KEY, Server, healthy, start_server, stop_server

VOCAB = 257  # tests/conftest.py make_tiny_base_model's
HELLO = list(b"hello")  # its token ids: one per byte


@pytest.fixture(scope="module")
def server(tiny_base_model: Path) -> Iterator[Server]:
    running = start_server("--model", str(tiny_base_model), "--max-model-len", "64", "--max-batch-size", "4")
    try:
        yield running
    finally:
        stop_server(running)


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)


def _complete(client: openai.OpenAI, prompt: Any) -> list[int] | str:
    out = client.completions.create(model="tiny-base", prompt=prompt, max_tokens=5, temperature=0)
    assert out.usage is not None and out.usage.prompt_tokens == len(HELLO) and out.usage.completion_tokens == 5
    return out.choices[0].text


def test_completions_take_text_and_token_ids(client: openai.OpenAI) -> None:
    text = _complete(client, "hello")
    assert _complete(client, HELLO) == text  # the same prompt as token ids: the same greedy output
    assert _complete(client, [HELLO]) == text and _complete(client, ["hello"]) == text  # batches of one


def test_a_chat_request_to_a_base_model_is_a_400_naming_the_missing_template(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=60)
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(
                model="tiny-base", messages=[{"role": "user", "content": "hi"}], max_tokens=4, stream=stream
            )
        assert e.value.status_code == 400
        error = e.value.body
        assert isinstance(error, dict) and error["param"] == "messages", error
        for advice in ("no chat template", "/v1/completions", "--chat-template"):
            assert advice in error["message"], error
    assert _complete(client, "hello")  # the engine serves on


HOSTILE_PROMPTS: dict[str, Any] = {
    "a bool": True,
    "a number": 5,
    "null": None,
    "an object": {"prompt_token_ids": HELLO},
    "an empty string": "",
    "an empty list": [],
    "an empty batch item": [[]],
    "bools as ids": [True, False],
    "floats as ids": [1.0, 2.0],
    "ids and a string": [1, "2"],
    "a negative id": [1, -1],
    "an id past the vocabulary": [1, VOCAB],
    "an id past int64": [2**70],
    "nested garbage": [[1, [2, [3]]]],
    "a list nested 500 deep": json.loads("[" * 500 + "]" * 500),
    "a batch of two": [HELLO, HELLO],
    "two million ids": [1] * 2_000_000,
}


@pytest.mark.parametrize("name", list(HOSTILE_PROMPTS))
def test_a_prompt_that_is_no_prompt_is_a_400_naming_the_field(server: Server, name: str) -> None:
    body = {"prompt": HOSTILE_PROMPTS[name], "max_tokens": 2}
    response = httpx.post(f"{server.url}/v1/completions", json=body, headers=AUTH, timeout=60)
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert error["param"] == "prompt" and error["type"] == "BadRequestError" and error["message"], error
    assert "Traceback" not in response.text
    assert healthy(server.url)


def test_the_chat_template_flag_reaches_the_llm() -> None:
    args = _parser().parse_args(["serve", "--chat-template", "template.jinja"])
    assert engine_from_args(args)["chat_template"] == "template.jinja"
    assert engine_from_args(_parser().parse_args(["serve"]))["chat_template"] is None
