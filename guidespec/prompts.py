"""A request's prompt, in each form a client gives it, as the token ids the engine runs.

The forms: text (the tokenizer's encoding, its special tokens included), chat messages
(rendered by the chat template: the user's, ``LLM(chat_template=...)`` / ``--chat-template``,
else the tokenizer's own), token ids (a list of ints), and the dicts ``{"prompt_token_ids":
[...]}`` and ``{"prompt": "..."}`` (vLLM's ``TokensPrompt`` and ``TextPrompt``). ``as_prompt_list``
tells one prompt from a batch of them. A prompt the engine cannot serve raises
``InvalidRequest`` naming its field: a chat to a model without a chat template (a base model),
token ids outside the vocabulary, a shape that is none of the forms.

It neither starts nor talks to an engine (``llm``) and does not read HTTP bodies (the server's
``translate`` turns OpenAI's ``prompt`` into one of these forms).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

import numpy as np

from guidespec.protocol import InvalidRequest, validate_prompt

Message = dict[str, str]
Prompt = Union[str, list[Message], list[int], dict[str, Any]]

NO_CHAT_TEMPLATE = (
    "this model has no chat template (a base model?), so it takes no chat messages: send the prompt "
    "as a completion (text or token ids: /v1/completions, LLM.generate('...')), or give the engine a "
    "chat template (guidespec serve --chat-template FILE_OR_JINJA, LLM(chat_template=...))"
)
_JINJA_CHARS = "{}\n"  # (vLLM's rule: a --chat-template with none of these is a file's path)
_DICT_KEYS = ("prompt_token_ids", "prompt")


def load_chat_template(value: str | os.PathLike[str] | None) -> str | None:
    """The Jinja text of a chat template given as vLLM's ``--chat-template`` takes it: a file's
    path, or the template itself (text with ``{``, ``}`` or a newline). It must parse: a bad
    template or a missing file raises ``ValueError`` here, before an engine starts."""
    if value is None:
        return None
    text = str(value)
    if isinstance(value, os.PathLike) or not any(c in text for c in _JINJA_CHARS):
        try:
            text = Path(text).expanduser().read_text()
        except OSError as e:
            raise ValueError(
                f"chat_template {text!r} is neither a readable file nor a Jinja template ({e.strerror})"
            ) from None
    if not text.strip():
        raise ValueError("chat_template is empty")
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except TemplateError as e:
        raise ValueError(f"chat_template does not parse as Jinja: {e}") from None
    return text


def as_prompt_list(prompts: Prompt | Iterable[Prompt]) -> list[Prompt]:
    """``LLM.generate``'s prompts as a list: a string or a dict is one prompt; a list whose first
    item is an int is one prompt of token ids, one whose first item is a dict with ``"role"`` is
    one chat; any other list is a batch (``[[1, 2], [3, 4]]``: two prompts of token ids)."""
    if isinstance(prompts, (str, dict)) or not isinstance(prompts, Iterable) or _is_scalar_array(prompts):
        return [prompts]  # type: ignore[list-item]  # (not a prompt at all: encode says so)
    items = list(prompts)
    if items and (isinstance(items[0], (int, np.integer)) or (isinstance(items[0], dict) and "role" in items[0])):
        return [items]  # type: ignore[list-item]  # one prompt of token ids, or one chat
    return items  # type: ignore[return-value]


@dataclass(frozen=True)
class PromptEncoder:
    """Token ids for a prompt of any form (``encode``); token ids given as such are checked
    against the model's vocabulary and length here (every prompt's again by ``validate_request``).
    ``chat_template``: the user's (``load_chat_template``), used instead of the tokenizer's own;
    None: the tokenizer's, if it has one."""

    tokenizer: Any
    vocab_size: int
    max_model_len: int
    chat_template: str | None = None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template or getattr(self.tokenizer, "chat_template", None))

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self._text(prompt)
        if isinstance(prompt, dict):
            return self._dict(prompt)
        if isinstance(prompt, (list, tuple, np.ndarray)) and not _is_scalar_array(prompt):
            items: list[Any] = list(prompt)
            if items and all(isinstance(m, dict) for m in items):
                return self._chat(items)
            return self._token_ids(items)
        raise InvalidRequest(
            f"a prompt is a string, a list of token ids, a list of chat messages, or "
            f"{{'prompt_token_ids': [...]}}; got {type(prompt).__name__}",
            "prompt",
        )

    def _text(self, text: str) -> list[int]:
        if not text:
            raise InvalidRequest("the prompt is empty", "prompt")
        return [int(t) for t in self.tokenizer.encode(text)]

    def _dict(self, prompt: dict[str, Any]) -> list[int]:
        keys = [k for k in _DICT_KEYS if k in prompt]
        unknown = sorted(str(k) for k in prompt if k not in _DICT_KEYS)
        if len(keys) != 1 or unknown:
            what = f"unknown key(s) {', '.join(unknown)}" if unknown else f"keys {sorted(prompt)}"
            raise InvalidRequest(
                f"a dict prompt is {{'prompt_token_ids': [...]}} or {{'prompt': '...'}}, got {what}", "prompt"
            )
        value = prompt[keys[0]]
        if keys[0] == "prompt":
            if not isinstance(value, str):
                raise InvalidRequest(f"'prompt' must be a string, got {type(value).__name__}", "prompt")
            return self._text(value)
        if not isinstance(value, (list, tuple, np.ndarray)):
            raise InvalidRequest("a dict prompt must have 'prompt_token_ids': a list of token ids", "prompt")
        return self._token_ids(list(value))

    def _token_ids(self, ids: list[Any]) -> list[int]:
        if ids and not isinstance(ids[0], (int, np.integer)) and not isinstance(ids[0], dict):
            raise InvalidRequest(
                f"a list prompt holds token ids (ints) or chat messages (dicts), got a list of "
                f"{type(ids[0]).__name__}: several prompts go as a list of prompts, token ids also as "
                f"{{'prompt_token_ids': [...]}}",
                "prompt",
            )
        validate_prompt(ids, self.vocab_size, self.max_model_len)  # (the length first: a huge list is cheap)
        return [int(t) for t in ids]

    def _chat(self, messages: list[dict[str, Any]]) -> list[int]:
        if not self.has_chat_template:
            raise InvalidRequest(NO_CHAT_TEMPLATE, "messages")
        from jinja2 import TemplateError

        try:
            ids = self.tokenizer.apply_chat_template(
                messages, chat_template=self.chat_template, add_generation_prompt=True, tokenize=True
            )
        except (TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise InvalidRequest(f"the chat template cannot render these messages: {e}", "messages") from None
        return [int(t) for t in (ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)]


def _is_scalar_array(value: object) -> bool:
    return isinstance(value, np.ndarray) and value.ndim == 0
