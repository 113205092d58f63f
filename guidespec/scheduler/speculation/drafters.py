"""The scheduler's drafter interface, and ``create_drafter``, which picks a drafter by the config:
none (grammar-forced drafts alone), a user's, a model's proposals handed on, or prompt lookup.

A drafter proposes up to ``max_len`` tokens to follow a request's context (prompt, output, and
any grammar-forced drafts already chosen). ``valid_prefix(tokens)`` says how many of ``tokens``
the request's grammar accepts (all of them for an unguided request): drafts are cut there, and
a drafter with several candidates keeps the one the grammar accepts furthest.

Grammar-forced drafts are not a drafter here: they come from the grammar itself
(``scheduler/speculation/proposer.py`` puts them first, a drafter continues after them). Prompt
lookup is ``ngram.py`` (its drafts from the prompt's JSON text, ``json_text.py``). The draft model
runs on the workers (``draft_model.py``); ``ModelDrafter`` hands its proposals on.
"""

from __future__ import annotations

import importlib
from typing import Any, Protocol, Sequence

from guidespec.config import MODEL_DRAFTERS, SpeculativeConfig
from guidespec.scheduler.speculation.json_text import ValidPrefix
from guidespec.scheduler.speculation.ngram import NGramDrafter, ngram_drafter


class Drafter(Protocol):
    def propose(
        self, request_id: str, context: Sequence[int], num_committed: int, max_len: int, valid_prefix: ValidPrefix
    ) -> list[int]:
        """Up to ``max_len`` drafts after ``context``, whose first ``num_committed`` tokens are
        final (prompt and accepted output) and the rest drafts already chosen this step."""
        ...

    def release(self, request_id: str) -> None: ...


class NoDrafter:
    """Only grammar-forced tokens are drafted (method ``forced``)."""

    def propose(
        self, request_id: str, context: Sequence[int], num_committed: int, max_len: int, valid_prefix: ValidPrefix
    ) -> list[int]:
        return []

    def release(self, request_id: str) -> None:
        pass


class UserDrafter:
    """A user's class with one method, ``propose(context: list[int], max_len: int) -> list[int]``,
    named ``"module:Class"`` (built with no arguments) and importable in the scheduler process."""

    def __init__(self, path: str) -> None:
        module_name, _, class_name = path.partition(":")
        if not module_name or not class_name:
            raise ValueError(f"user_drafter must look like 'module:Class', got {path!r}")
        cls = getattr(importlib.import_module(module_name), class_name)
        self.impl = cls()
        if not callable(getattr(self.impl, "propose", None)):
            raise ValueError(f"{path} has no propose(context, max_len) method")

    def propose(
        self, request_id: str, context: Sequence[int], num_committed: int, max_len: int, valid_prefix: ValidPrefix
    ) -> list[int]:
        draft = [int(t) for t in self.impl.propose(list(context), max_len)][:max_len]
        return draft[: valid_prefix(draft)]

    def release(self, request_id: str) -> None:
        pass


class ModelDrafter:
    """The draft model's (or EAGLE head's) proposals, made by rank 0 after the previous step
    (``draft_model.py``, ``eagle.py``). They follow the request's final tokens; where the grammar
    forced drafts first, the proposals are used only if they begin with those same tokens.

    With ``ngram`` (``SpeculativeConfig.combine_ngram``), prompt lookup runs too and the longer
    draft the grammar accepts wins (n-gram on a tie): lookup copies values from the prompt that
    a small drafter cannot know, the model drafts where lookup finds nothing."""

    def __init__(self, ngram: NGramDrafter | None = None) -> None:
        self.proposals: dict[str, list[int]] = {}
        self.ngram = ngram

    def store(self, request_id: str, tokens: list[int]) -> None:
        self.proposals[request_id] = tokens

    def propose(
        self, request_id: str, context: Sequence[int], num_committed: int, max_len: int, valid_prefix: ValidPrefix
    ) -> list[int]:
        proposals = self.proposals.pop(request_id, [])
        lookup = self.ngram.propose(request_id, context, num_committed, max_len, valid_prefix) if self.ngram else []
        forced = list(context[num_committed:])
        if proposals[: len(forced)] != forced:
            return lookup
        draft = proposals[len(forced) : len(forced) + max_len]
        draft = draft[: valid_prefix(draft)]
        return lookup if len(lookup) >= len(draft) else draft

    def release(self, request_id: str) -> None:
        self.proposals.pop(request_id, None)
        if self.ngram is not None:
            self.ngram.release(request_id)


def create_drafter(cfg: SpeculativeConfig, tokenizer: Any = None) -> Drafter:
    if cfg.method == "ngram":
        return ngram_drafter(cfg, tokenizer)
    if cfg.method == "user":
        return UserDrafter(cfg.user_drafter or "")
    if cfg.method in MODEL_DRAFTERS:
        return ModelDrafter(ngram_drafter(cfg, tokenizer) if cfg.combine_ngram else None)
    return NoDrafter()
