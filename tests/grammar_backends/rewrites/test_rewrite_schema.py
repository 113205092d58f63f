"""``rewrite_schema`` on hand-written schemas (``cases.py``): each exact rewrite gives what it
should, what cannot be rewritten exactly is left alone, a schema no value matches is refused with
the reason, and a disabled rewrite is not applied."""

from __future__ import annotations

import pytest

from guidespec.grammar_backends.rewrites import rewrite_schema
from tests.grammar_backends.rewrites.cases import HAND, LEFT_ALONE, MATCH_NOTHING


@pytest.mark.parametrize("name", list(HAND))
def test_each_rewrite_gives_what_it_should(name: str) -> None:
    schema, expected, applied = HAND[name]
    assert rewrite_schema(schema) == (expected, applied)


@pytest.mark.parametrize("name", list(LEFT_ALONE))
def test_what_cannot_be_rewritten_exactly_is_left_alone(name: str) -> None:
    assert rewrite_schema(LEFT_ALONE[name]) == (LEFT_ALONE[name], [])


@pytest.mark.parametrize("name", sorted(MATCH_NOTHING))
def test_a_schema_no_value_matches_is_refused_with_the_reason(name: str) -> None:
    from guidespec.grammar_backends import GrammarError
    from guidespec.grammar_backends.interface import is_refusal

    schema, reason = MATCH_NOTHING[name]
    with pytest.raises(GrammarError) as raised:
        rewrite_schema(schema)
    assert str(raised.value).startswith("no JSON value can match this json_schema") and reason in str(raised.value)
    assert not is_refusal(str(raised.value))  # (no other backend is tried: the schema is at fault)


@pytest.mark.parametrize("name", list(HAND))
def test_a_disabled_rewrite_is_not_applied(name: str) -> None:
    """``rewrite_schema(schema, disabled)``, which ``benchmarks/coverage.py --by-rewrite`` uses to
    count what each rewrite unlocks, applies none of the disabled ones."""
    from guidespec.grammar_backends.rewrites import REWRITES

    schema, _, applied = HAND[name]
    assert set(applied) <= set(REWRITES)
    assert rewrite_schema(schema, frozenset(REWRITES)) == (schema, [])
    assert not set(applied) & set(rewrite_schema(schema, frozenset(applied))[1])
