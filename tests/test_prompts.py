"""A prompt's forms (``guidespec/prompts.py``): text, chat messages, token ids, the dict forms, one
prompt told from a batch; the chat template given by the user (a file or its text); a model
without a chat template (a base model), which serves completions and refuses chats with a clear
``InvalidRequest``; hostile token ids refused before anything reaches the engine. Then the same
through ``LLM`` on a tiny random base model (the server's side: ``tests/entrypoints/server/
test_base_model.py``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pytest

from guidespec import LLM, SamplingParams
from guidespec.prompts import NO_CHAT_TEMPLATE, PromptEncoder, as_prompt_list, load_chat_template
from guidespec.protocol import InvalidRequest
from tests.grammar_backends.dataset import byte_level_tokenizer

VOCAB = 257  # the byte-level tokenizer's: 256 bytes and <|end|>
MAX_LEN = 64
# a template as simple as a base model's users write: one line per message, then the answer's cue
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CHAT = [{"role": "user", "content": "hi"}]
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return byte_level_tokenizer()


@pytest.fixture(scope="module")
def encoder(tokenizer: Any) -> PromptEncoder:
    return PromptEncoder(tokenizer, VOCAB, MAX_LEN)


def test_one_prompt_is_told_from_a_batch() -> None:
    chat: list[Any] = [{"role": "user", "content": "a"}]
    assert as_prompt_list("a") == ["a"]
    assert as_prompt_list({"prompt_token_ids": [1]}) == [{"prompt_token_ids": [1]}]
    assert as_prompt_list([5, 6, 7]) == [[5, 6, 7]]  # token ids: one prompt
    assert as_prompt_list([[5, 6], [7]]) == [[5, 6], [7]]  # a batch of two
    assert as_prompt_list(chat) == [chat] and as_prompt_list([chat, chat]) == [chat, chat]
    assert as_prompt_list(["a", [1, 2]]) == ["a", [1, 2]]
    assert len(as_prompt_list(np.array([1, 2, 3]))) == 1 and len(as_prompt_list(np.ones((2, 3), int))) == 2
    assert as_prompt_list(p for p in ("a", "b")) == ["a", "b"]
    assert as_prompt_list([]) == [] and as_prompt_list(5) == [5]  # type: ignore[arg-type]


def test_each_form_gives_its_token_ids(encoder: PromptEncoder) -> None:
    hello = [104, 101, 108, 108, 111]  # one token per byte
    assert encoder.encode("hello") == hello
    assert encoder.encode(hello) == hello and encoder.encode(tuple(hello)) == hello  # type: ignore[arg-type]
    assert encoder.encode(np.array(hello, dtype=np.int64)) == hello  # type: ignore[arg-type]
    assert encoder.encode({"prompt_token_ids": hello}) == hello
    assert encoder.encode({"prompt": "hello"}) == hello
    assert all(type(t) is int for t in encoder.encode(np.array(hello)))  # type: ignore[arg-type]


def test_a_chat_without_a_chat_template_is_refused_naming_it(encoder: PromptEncoder) -> None:
    assert not encoder.has_chat_template
    with pytest.raises(InvalidRequest) as e:
        encoder.encode(CHAT)  # type: ignore[arg-type]
    assert str(e.value) == NO_CHAT_TEMPLATE and e.value.param == "messages"
    for advice in ("no chat template", "completion", "--chat-template", "chat_template="):
        assert advice in NO_CHAT_TEMPLATE


def test_the_users_chat_template_renders_chats(tokenizer: Any) -> None:
    encoder = PromptEncoder(tokenizer, VOCAB, MAX_LEN, load_chat_template(TEMPLATE))
    assert encoder.has_chat_template
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    assert encoder.encode(chat) == list(b"system: Be brief.\nuser: hi\nassistant:")  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="cannot render") as e:
        PromptEncoder(tokenizer, VOCAB, MAX_LEN, "{{ raise_exception('no system here') }}").encode(chat)  # type: ignore[arg-type]
    assert e.value.param == "messages"


def test_a_chat_template_is_a_file_or_its_text(tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    assert load_chat_template(str(path)) == TEMPLATE and load_chat_template(path) == TEMPLATE
    assert load_chat_template(TEMPLATE) == TEMPLATE and load_chat_template(None) is None
    with pytest.raises(ValueError, match="neither a readable file nor a Jinja template"):
        load_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(ValueError, match="does not parse"):
        load_chat_template("{% for m in messages %}{{ m }}")  # no endfor
    with pytest.raises(ValueError, match="empty"):
        load_chat_template("\n\n")


@pytest.mark.parametrize(
    "prompt, message",
    [
        ([1, -1], "vocabulary"),
        ([VOCAB], "vocabulary"),
        ([2**70], "vocabulary"),
        ([True, False], "integers"),
        ([1, 2.0], "integers"),
        ([1, [2]], "integers"),
        ([1, "2"], "integers"),
        ([1.0, 2.0], "list of float"),
        (["a", "b"], "list of str"),
        ([[1], [2]], "list of list"),
        ([None], "list of NoneType"),
        ([], "empty"),
        ("", "empty"),
        ({"prompt_token_ids": "12"}, "list of token ids"),
        ({"prompt_token_ids": [1], "prompt": "a"}, "prompt_token_ids"),
        ({"role": "user", "content": "hi"}, "unknown key"),
        ({"prompt": 5}, "must be a string"),
        (5, "got int"),
        (None, "got NoneType"),
        (np.array(5), "got ndarray"),
        (np.ones((2, 2), int), "list of ndarray"),
    ],
)
def test_what_is_not_a_prompt_is_refused_naming_the_field(encoder: PromptEncoder, prompt: Any, message: str) -> None:
    with pytest.raises(InvalidRequest, match=message) as e:
        encoder.encode(prompt)
    assert e.value.param == "prompt"


def test_a_huge_list_of_token_ids_is_refused_at_once(encoder: PromptEncoder) -> None:
    huge = [1] * 5_000_000
    start = time.perf_counter()
    with pytest.raises(InvalidRequest, match="model length"):
        encoder.encode(huge)
    assert time.perf_counter() - start < 0.5  # (the length is checked before the ids)


# ------------------------------------------------------------------ through LLM, on a tiny base model


@pytest.fixture(scope="module")
def base_llm(tiny_base_model: Path) -> Iterator[LLM]:
    with LLM(str(tiny_base_model), max_batch_size=4, max_model_len=MAX_LEN, show_progress=False) as llm:
        yield llm


def test_a_base_model_serves_text_and_token_ids_alike(base_llm: LLM) -> None:
    text, ids, as_dict = base_llm.generate(["hello", [104, 101, 108, 108, 111], {"prompt": "hello"}], GREEDY)
    assert text.prompt_token_ids == ids.prompt_token_ids == as_dict.prompt_token_ids == list(b"hello")
    assert len(text.token_ids) == 6 and text.token_ids == ids.token_ids == as_dict.token_ids
    one = base_llm.generate([104, 101, 108, 108, 111], GREEDY)  # a bare list of ints: ONE prompt
    assert len(one) == 1 and one[0].token_ids == text.token_ids
    two = base_llm.generate([[104, 105], [104, 101, 108, 108, 111]], GREEDY)
    assert [o.prompt_token_ids for o in two] == [[104, 105], list(b"hello")] and two[1].token_ids == text.token_ids


def test_a_base_model_refuses_a_chat_and_bad_ids_and_goes_on(base_llm: LLM) -> None:
    with pytest.raises(InvalidRequest, match="no chat template") as e:
        base_llm.generate(CHAT, GREEDY)
    assert e.value.param == "messages"
    with pytest.raises(InvalidRequest, match="no chat template"):
        list(base_llm.stream(CHAT, GREEDY))  # type: ignore[arg-type]
    for bad in ([1, VOCAB], [True, 1], [1, -5], [[1, [2]]]):
        with pytest.raises(InvalidRequest):
            base_llm.generate(bad, GREEDY)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest, match="vocabulary"):  # the second of a batch: the first is aborted
        base_llm.generate([[104, 105], [104, VOCAB]], GREEDY)
    assert base_llm.is_healthy and base_llm.generate("hi", GREEDY)[0].finished


def test_a_chat_template_given_to_a_base_model_serves_chats(tiny_base_model: Path, tmp_path: Path) -> None:
    path = tmp_path / "template.jinja"
    path.write_text(TEMPLATE)
    with LLM(
        str(tiny_base_model), max_batch_size=2, max_model_len=MAX_LEN, chat_template=str(path), show_progress=False
    ) as llm:
        out = llm.generate(CHAT, GREEDY)[0]
        assert out.prompt_token_ids == list(b"user: hi\nassistant:") and len(out.token_ids) == 6
        assert out.token_ids == llm.generate("user: hi\nassistant:", GREEDY)[0].token_ids
