"""The workload's JME cases with their facts written other ways than ``name is "value";``.

    python benchmarks/rephrase.py [--cases 10] [--styles sentences,lines,shuffled,paragraph] [--output FILE]

The workload's JSON-extraction prompts list every fact as ``name is "value";`` (nested ones as
``a -> b is ...``, list items as ``a item 1 is ...``), in the schema's order. Prompt lookup finds
that convention easy to copy from; prompts written by people are not so regular. Each style here
writes the same facts (every value of the case's ``reference``, the right answer, so the same JSON
is still right) from the reference itself, another way:

- ``sentences``: one sentence per fact, names in words (``The start date is 2023-04-15.``),
  values unquoted, lists as ``a, b and c``;
- ``lines``: ``key: value`` lines with the schema's names, values unquoted, nested names dotted,
  list items as ``- item`` lines;
- ``shuffled``: one sentence of quoted values (``summary "Tech ..."``) in a shuffled order;
- ``paragraph``: a short paragraph of prose, names in words, values unquoted, with varied
  wording between them, in a shuffled order.

The wording is picked by a random generator seeded with the case's id and the style: the same
cases come out the same every time. The system message (the schema) is kept as it is.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

STYLES = ("sentences", "lines", "shuffled", "paragraph")
Path_ = tuple[Any, ...]  # a fact's place in the record: keys and list indices
Fact = tuple[Path_, Any]  # a scalar, or a list of scalars

_INSTRUCTIONS = (
    "Extract the record described here as JSON.",
    "Turn the following description into a JSON object.",
    "Please fill in the JSON from these details.",
    "Read the text below and return the data as JSON.",
)
_PROSE = (  # a fact in prose: {name} and {value}
    "The {name} is {value}.",
    "Its {name} is {value}.",
    "As for the {name}, it is {value}.",
    "We have {value} as the {name}.",
    "The {name} should be recorded as {value}.",
    "For the {name}, use {value}.",
)


def jme_cases(n: int) -> list[dict[str, Any]]:
    """The first ``n`` JME cases of the workload, as the benchmarks pick them."""
    from guidespec.entrypoints.sweep import default_workload, load_workload

    return load_workload(default_workload(), "JME_", n)


def phrased_groups(phrasing: str, n: int) -> list[list[dict[str, Any]]]:
    """The first ``n`` JME cases as the workload words them (``original``, one group), or rephrased
    (``rephrased``: one group per style; or one style by name). A benchmark serves each group with a
    fresh drafter: the styles are the same records, and a drafter's shared pool would otherwise
    learn one style's answers from another's."""
    cases = jme_cases(n)
    if phrasing == "original":
        return [cases]
    return [rephrased_cases(cases, (style,)) for style in (STYLES if phrasing == "rephrased" else (phrasing,))]


def rephrased_cases(cases: list[dict[str, Any]], styles: tuple[str, ...] = STYLES) -> list[dict[str, Any]]:
    """Every case in every style (ids ``JME_5~lines``), style by style."""
    return [rephrase(case, style) for style in styles for case in cases]


def rephrase(case: dict[str, Any], style: str) -> dict[str, Any]:
    """``case`` with its user message written in ``style`` from its reference; checked to hold
    every value of the reference."""
    rng = random.Random(f"{case['id']}~{style}")
    facts = _facts(case["reference"], ())
    text = _WRITERS[style](facts, rng)
    missing = [value for _, value in facts for value in _texts(value) if value not in text]
    if missing:
        raise AssertionError(f"{case['id']} {style}: values missing from the prompt: {missing}")
    messages = [dict(m) for m in case["messages"]]
    messages[-1]["content"] = text
    return {**case, "id": f"{case['id']}~{style}", "messages": messages}


def _sentences(facts: list[Fact], rng: random.Random) -> str:
    lines = [rng.choice(_INSTRUCTIONS)]
    for path, value in facts:
        lines.append(_sentence(f"The {_spoken(path)}", "is" if not isinstance(value, list) else "are", value))
    return " ".join(lines)


def _lines(facts: list[Fact], rng: random.Random) -> str:
    lines = [rng.choice(_INSTRUCTIONS), ""]
    for path, value in facts:
        name = ".".join(str(p + 1) if isinstance(p, int) else p for p in path)
        if isinstance(value, list):
            lines.append(f"{name}:")
            lines.extend(f"- {_plain(item)}" for item in value)
        else:
            lines.append(f"{name}: {_plain(value)}")
    return "\n".join(lines)


def _shuffled(facts: list[Fact], rng: random.Random) -> str:
    facts = list(facts)
    rng.shuffle(facts)
    named = []
    for path, value in facts:
        name = " ".join(f"entry {p + 1}" if isinstance(p, int) else p for p in path)
        if isinstance(value, list):
            named.append(f"{name} " + " then ".join(json.dumps(item) for item in value))
        else:
            named.append(f"{name} {json.dumps(value)}")
    return f"{rng.choice(_INSTRUCTIONS)} In no particular order: " + ", ".join(named) + "."


def _paragraph(facts: list[Fact], rng: random.Random) -> str:
    facts = list(facts)
    rng.shuffle(facts)
    sentences = [rng.choice(_INSTRUCTIONS), "Here is what we know."]
    for path, value in facts:
        template = rng.choice(_PROSE)
        shown = _listed(value) if isinstance(value, list) else _plain(value)
        sentences.append(_capital(template.format(name=_spoken(path), value=shown)).replace("..", "."))
    return " ".join(sentences)


_WRITERS: dict[str, Callable[[list[Fact], random.Random], str]] = {
    "sentences": _sentences,
    "lines": _lines,
    "shuffled": _shuffled,
    "paragraph": _paragraph,
}


def _facts(value: Any, path: Path_) -> list[Fact]:
    """The record's scalars and lists of scalars, each with its place, in the record's order."""
    if isinstance(value, dict):
        return [fact for key, item in value.items() for fact in _facts(item, path + (key,))]
    if isinstance(value, list) and any(isinstance(item, (dict, list)) for item in value):
        return [fact for i, item in enumerate(value) for fact in _facts(item, path + (i,))]
    return [(path, value)]


def _texts(value: Any) -> list[str]:
    """How each of a fact's values must appear in the prompt."""
    items = value if isinstance(value, list) else [value]
    return [item if isinstance(item, str) else json.dumps(item) for item in items if item is not None]


def _spoken(path: Path_) -> str:
    """A fact's place in words, the field first: ``heart rate of metrics``, ``name of entry 2 of items``."""
    words = [f"entry {p + 1}" if isinstance(p, int) else _words(p) for p in path]
    return " of ".join(reversed(words)) if words else "value"


def _words(name: str) -> str:
    """``startDate`` -> ``start date``, ``file_system_type`` -> ``file system type``; acronyms kept."""
    spaced = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", " ", name).replace("_", " ")
    return " ".join(w if w.isupper() and len(w) > 1 else w.lower() for w in spaced.split()) or name


def _sentence(subject: str, verb: str, value: Any) -> str:
    shown = _listed(value) if isinstance(value, list) else _plain(value)
    return f"{subject} {verb} {shown}" + ("" if shown.endswith(".") else ".")


def _listed(items: list[Any]) -> str:
    shown = [_plain(item) for item in items]
    if len(shown) < 2:
        return "".join(shown)
    glue = "; " if any("," in s for s in shown) else ", "
    return glue.join(shown[:-1]) + " and " + shown[-1]


def _plain(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _capital(text: str) -> str:
    return text[:1].upper() + text[1:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=10)
    parser.add_argument("--styles", default=",".join(STYLES))
    parser.add_argument("--output", type=Path, default=None, help="a JSONL file (else the prompts are printed)")
    args = parser.parse_args()
    cases = rephrased_cases(jme_cases(args.cases), tuple(args.styles.split(",")))
    if args.output is None:
        for case in cases:
            print(f"{case['id']}: {case['messages'][-1]['content']}\n")
        return
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text("".join(json.dumps(case) + "\n" for case in cases))
    print(f"{len(cases)} cases written to {args.output}")


if __name__ == "__main__":
    main()
