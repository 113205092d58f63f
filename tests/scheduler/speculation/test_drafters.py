"""Drafters in the scheduler: user drafters, a model's proposals combined with lookup, the factory."""

from __future__ import annotations

from typing import Sequence

import pytest

from guidespec.config import SpeculativeConfig
from guidespec.scheduler.speculation.drafters import UserDrafter, create_drafter
from guidespec.scheduler.speculation.ngram import NGramDrafter


def _all(tokens: Sequence[int]) -> int:
    return len(tokens)


class _Echo:
    def propose(self, context: list[int], max_len: int) -> list[int]:
        return [context[-1]] * (max_len + 2)  # too many on purpose: the drafter caps it


def test_user_drafter_is_loaded_by_path_and_capped() -> None:
    drafter = UserDrafter(f"{__name__}:_Echo")
    assert drafter.propose("r", [4, 5], 2, 3, _all) == [5, 5, 5]
    assert drafter.propose("r", [4, 5], 2, 3, lambda t: 1) == [5]
    with pytest.raises(ValueError, match="module:Class"):
        UserDrafter("no_colon_here")
    assert isinstance(create_drafter(SpeculativeConfig(method="ngram")), NGramDrafter)


def test_model_proposals_combined_with_lookup_the_longer_valid_draft_wins() -> None:
    drafter = create_drafter(SpeculativeConfig(method="eagle", draft_model="head", combine_ngram=True, max_draft_len=3))
    context = [5, 6, 7, 8, 1, 2, 5, 6]  # lookup: after "5 6" comes "7 8 1"
    everything = lambda tokens: len(tokens)  # noqa: E731
    drafter.store("r", [9, 9])  # the model's two drafts
    assert drafter.propose("r", context, len(context), 3, everything) == [7, 8, 1]
    drafter.store("r", [9, 9, 9])
    assert drafter.propose(
        "r", context, len(context), 3, lambda tokens: min(len(tokens), 1 if tokens[0] == 7 else 3)
    ) == [9, 9, 9]  # the grammar cuts lookup's draft after one token: the model's is longer
    assert drafter.propose("r", [1, 2, 3], 3, 3, everything) == []  # no proposals stored, no lookup match
    with pytest.raises(ValueError, match="combine_ngram"):
        SpeculativeConfig(method="ngram", combine_ngram=True).validate()


class _Faulty:
    """A user's drafter with bugs: it raises where the context holds token 7777, and proposes a
    token id past the vocabulary where it holds 8888 (``tests/test_speculative.py``)."""

    def propose(self, context: list[int], max_len: int) -> list[int]:
        if 7777 in context:
            raise KeyError("a bug in the user's drafter")
        return [10**9] * max_len if 8888 in context else [context[-1]] * max_len
