"""A schema the backend cannot enforce exactly is refused with a message naming the problem,
never compiled into a grammar whose outputs could violate it."""

from __future__ import annotations

from pathlib import Path

import pytest

from guidespec.grammar_backends import GrammarError, create_backend
from guidespec.protocol import GuidedDecoding

OVERLAPPING_ONE_OF = {"type": "object", "properties": {"dimensions": {
    "oneOf": [{"required": ["length", "width"]}, {"required": ["radius"]}],
    "properties": {"length": {"type": "number"}, "width": {"type": "number"}, "radius": {"type": "number"}}}}}
DISJOINT_ONE_OF = {"type": "object", "properties": {"data": {
    "oneOf": [{"type": "integer"}, {"type": "string"}, {"type": "null"}, {"type": "array", "items": {"type": "integer"}}]}}}


@pytest.fixture(scope="module")
def tokenizer(real_model_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


@pytest.mark.parametrize("backend_name", ["xgrammar", "llguidance"])
def test_overlapping_one_of_is_refused_and_disjoint_types_compile(tokenizer, backend_name: str) -> None:  # type: ignore[no-untyped-def]
    backend = create_backend(backend_name, tokenizer, 49152, (2,))
    with pytest.raises(GrammarError, match="oneOf"):
        backend.compile(GuidedDecoding(json_schema=OVERLAPPING_ONE_OF))
    if backend_name == "xgrammar":  # llguidance refuses every oneOf (it would need coerce_one_of)
        assert backend.compile(GuidedDecoding(json_schema=DISJOINT_ONE_OF)) is not None


def test_required_names_missing_from_properties_stay_required(tokenizer) -> None:  # type: ignore[no-untyped-def]
    from tests.grammar_backends.dataset import matcher_accepts

    backend = create_backend("xgrammar", tokenizer, 49152, (2,))
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["text"]}
    compiled = backend.compile(GuidedDecoding(json_schema=schema))
    assert not matcher_accepts(backend, compiled, tokenizer, '{"name": "Sofia"}', 2)
    assert matcher_accepts(backend, compiled, tokenizer, '{"text": [1, "a"]}', 2)
    with pytest.raises(GrammarError, match="additionalProperties: false"):
        backend.compile(GuidedDecoding(json_schema={**schema, "additionalProperties": False}))


@pytest.mark.parametrize("composition", ["anyOf", "oneOf", "allOf"])
def test_keywords_beside_a_composition_are_enforced(tokenizer, composition: str) -> None:  # type: ignore[no-untyped-def]
    """xgrammar drops the keywords beside anyOf/oneOf/allOf; the backend moves them into the
    branches (sweep, Github_medium o22092: a top-level required was not enforced). The oneOf
    here has overlapping branches (an object can hold both), so it stays refused."""
    from tests.grammar_backends.dataset import matcher_accepts

    backend = create_backend("xgrammar", tokenizer, 49152, (2,))
    schema = {"type": "object", "properties": {"target": {"type": "string"}, "routes": {"type": "array"},
                                               "file": {"type": "string"}},
              "required": ["target"], "additionalProperties": False,
              composition: [{"required": ["routes"]}, {"required": ["file"]}]}
    if composition == "oneOf":
        with pytest.raises(GrammarError, match="oneOf"):
            backend.compile(GuidedDecoding(json_schema=schema))
        return
    compiled = backend.compile(GuidedDecoding(json_schema=schema))
    accepts = lambda text: matcher_accepts(backend, compiled, tokenizer, text, 2)  # noqa: E731
    assert not accepts('{"routes": []}')  # the required beside the composition holds
    if composition == "allOf":
        assert accepts('{"target": "a", "routes": [], "file": "f"}') and not accepts('{"target": "a", "routes": []}')
    else:
        assert accepts('{"target": "a", "routes": []}') and accepts('{"target": "a", "file": "f"}')
        assert not accepts('{"target": "a"}')


def test_required_names_a_pattern_property_matches_are_declared_with_its_schema(tokenizer) -> None:  # type: ignore[no-untyped-def]
    """Sweep, Github_medium o83151: "required": ["from"] with "from" only in patternProperties."""
    from tests.grammar_backends.dataset import matcher_accepts

    backend = create_backend("xgrammar", tokenizer, 49152, (2,))
    schema = {"type": "object", "properties": {"user": {"type": "string"}}, "required": ["from"],
              "patternProperties": {"^from": {"type": "object", "properties": {"image": {"type": "string"}},
                                              "required": ["image"]}}}
    compiled = backend.compile(GuidedDecoding(json_schema=schema))
    assert not matcher_accepts(backend, compiled, tokenizer, '{"user": "u"}', 2)
    assert not matcher_accepts(backend, compiled, tokenizer, '{"from": 3}', 2)
    assert matcher_accepts(backend, compiled, tokenizer, '{"from": {"image": "x"}}', 2)
