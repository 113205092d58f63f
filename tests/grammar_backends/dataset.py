"""Feeding JSONSchemaBench test instances to grammar matchers, token by token."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

SCHEMAS = Path(__file__).resolve().parents[2].parent / "shared" / "data" / "jsonschemabench" / "schemas"
# Separators each backend's JSON grammar uses (see guidespec/grammar_backends).
SEPARATORS = {"xgrammar": (", ", ": "), "llguidance": (",", ":")}


def load_cases(every: int = 1, first: int = 0) -> list[tuple[str, dict[str, Any]]]:
    """The data set's cases by name; with ``every`` n, every n-th of them from the ``first``."""
    return [(p.stem, json.loads(p.read_text())) for p in sorted(SCHEMAS.glob("*.json"))[first::every]]


def byte_level_tokenizer() -> Any:
    """A tokenizer of the 256 bytes (GPT-2's byte-level alphabet) and an end token (256): every
    character boundary is a token boundary. Whether a grammar accepts a text does not depend on
    the vocabulary, and compiling against 257 tokens is ~15x cheaper than against SmolLM2's 49152
    (the 470 schemas: xgrammar 70 s -> 5 s)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    alphabet = bytes_to_unicode()
    tokenizer = Tokenizer(models.BPE(vocab={alphabet[b]: b for b in range(256)}, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>")


def order_like_schema(instance: Any, schema: Any) -> Any:
    """Object keys in the order of the schema's ``properties`` (grammars generate in that order)."""
    if not isinstance(schema, dict):
        return instance
    if isinstance(instance, dict):
        props = schema.get("properties", {}) if isinstance(schema.get("properties"), dict) else {}
        keys = [k for k in props if k in instance] + [k for k in instance if k not in props]
        return {k: order_like_schema(instance[k], props.get(k, {})) for k in keys}
    if isinstance(instance, list) and isinstance(schema.get("items"), dict):
        return [order_like_schema(x, schema["items"]) for x in instance]
    return instance


def matcher_accepts(backend: Any, compiled: Any, tokenizer: Any, text: str, stop_token: int) -> bool:
    """True if the grammar accepts ``text`` as a complete output."""
    matcher = backend.create_matcher(compiled)
    for token in tokenizer.encode(text, add_special_tokens=False):
        if not matcher.accept_token(token):
            return False
    return matcher.is_terminated() or matcher.accept_token(stop_token)


UNENFORCED_KEYWORDS = (
    "uniqueItems",
    "multipleOf",
    "not",
    "dependencies",
    "dependentRequired",
    "dependentSchemas",
    "if",
    "contains",
    "format",
    "pattern",
    "patternProperties",
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "minLength",
    "maxLength",
    "minItems",
    "maxItems",
    "minProperties",
    "maxProperties",
    "oneOf",
    "allOf",
    "anyOf",
    "$ref",
    "const",
    "enum",
    "additionalProperties",
    "propertyNames",
    "unevaluatedProperties",
    "prefixItems",
)


def keywords_used(schema: Any) -> set[str]:
    found: set[str] = set()
    if isinstance(schema, dict):
        found |= {k for k in schema if k in UNENFORCED_KEYWORDS}
        for value in schema.values():
            found |= keywords_used(value)
    elif isinstance(schema, list):
        for value in schema:
            found |= keywords_used(value)
    return found


def disagreements(
    backend_name: str, backend: Any, tokenizer: Any, stop_token: int, every: int = 1, first: int = 0
) -> dict[str, Any]:
    """Per case (``load_cases(every, first)``): "compile error" or the test indices whose verdict
    differs from the data set."""
    from guidespec.protocol import GuidedDecoding

    def compile_case(case: dict[str, Any]) -> Any:
        try:
            return backend.compile(GuidedDecoding(json_schema=json.dumps(case["schema"])))
        except Exception:
            return None

    cases = load_cases(every, first)
    # compiles on two threads (the xgrammar test: 63 s -> 53 s here), matching on this one
    with ThreadPoolExecutor(2) as pool:
        compiled_cases = list(pool.map(compile_case, [case for _, case in cases]))
    result: dict[str, Any] = {}
    for (case_id, case), compiled in zip(cases, compiled_cases):
        if compiled is None:
            result[case_id] = "compile error"
            continue
        wrong = []
        for i, test in enumerate(case["tests"]):
            text = json.dumps(
                order_like_schema(test["data"], case["schema"]), separators=SEPARATORS[backend_name], ensure_ascii=False
            )
            if matcher_accepts(backend, compiled, tokenizer, text, stop_token) != test["valid"]:
                wrong.append([i, "valid instance rejected" if test["valid"] else "invalid instance accepted"])
        if wrong:
            result[case_id] = {"tests": wrong, "schema uses": sorted(keywords_used(case["schema"]))}
    return result
