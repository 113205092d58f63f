"""The prompt's text index for the text lookup (``prompt_text.py``)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st


def test_text_lookup_reads_where_a_value_starts_and_ends_in_the_prompt() -> None:
    """The prompt's text alone (no tokenizer): a name's mentions matched on letters and digits,
    the value after a copula or a colon (past the names of the fields around it), a quoted word
    first; a value's end and whether more follows, in a list or in the record; how a value opens
    (a list first where the prompt lists items; without the space for a compact grammar)."""
    from guidespec.scheduler.speculation.prompt_text import PromptText, json_state, openings, places

    def prompt_of(text: str) -> PromptText:
        pieces = text.split(" ")
        pieces = [piece if i == 0 else " " + piece for i, piece in enumerate(pieces)]
        return PromptText(list(range(len(pieces))), pieces)

    prose = prompt_of("The heart rate of metrics is 78. We have it: the patient ID, PAT654321; notes: none.")
    start = prose.text.index("78")
    assert prose.value_starts("heartRate", {"metrics"}, 0) == [(start, start, False)]
    assert prose.value_end(start, quoted=False, in_list=False, literal=True) == (start + 2, True)
    patient = prose.text.index("PAT")
    assert prose.value_starts("patientID", set(), 0) == [(patient, patient, False)]
    assert prose.value_end(patient, quoted=False, in_list=False) == (patient + 9, True)
    last = prose.text.index("none")
    assert prose.value_end(last, quoted=False, in_list=False) == (last + 4, False)  # the record ends there
    quoted = prompt_of('summary is "Tech, Innovators. 2023"; days are Monday, Tuesday and Friday.')
    opening = quoted.text.index("Tech")
    assert quoted.value_starts("summary", set(), 0) == [(opening, opening, True)]
    assert quoted.value_end(opening, quoted=True, in_list=False) == (quoted.text.index('";'), True)
    tuesday = quoted.text.index("Tuesday")
    assert quoted.value_end(tuesday, quoted=False, in_list=True) == (tuesday + 7, True)
    friday = quoted.text.index("Friday")
    assert quoted.value_end(friday, quoted=False, in_list=True) == (friday + 6, False)
    assert quoted.next_item("Monday", 0) == [(tuesday, tuesday, False)]
    paths = prompt_of("For the heart rate of metrics, use 78. The name of entry 1 of items is Wireless Mouse.")
    starts = [paths.text[at:].split(" ")[0] for at, _, _ in paths.value_starts("heartRate", {"metrics"}, 0)]
    assert starts == ["use", "78."]  # the clause's words in turn (the grammar takes a number's)
    starts = [paths.text[at:].split(" ")[0] for at, _, _ in paths.value_starts("name", {"items"}, 0)]
    assert starts[0] == "Wireless"  # after the copula, before the words of the path
    assert openings('{"a":', False, "1, 2 and 3.", False)[:2] == (" [", ' ["')  # a list's items: a list first
    assert openings('{"a":', False, "Glen Oak.", False) == (' "', ' ["', " ", " [", '"', '["', "", "[")
    assert openings('{"a": ', False, "Glen Oak.", False) == ('"', '["', "", "[")  # its space is out
    assert json_state('{"a": ["x", "y') == (len('{"a": ["x", "'), "[")
    assert json_state('{"a": {"b": "x\\" y"}, "c"') == (None, "{")
    # after an empty item (an output of the JME benchmark, 2026-11-25: StopIteration failed its request)
    assert places(quoted, '{"days": ["", ', "", True, 0) == []


@given(st.lists(st.sampled_from(['"', "\\", "[", "]", "{", "}", ":", ",", " ", "a", "1"]), max_size=40), st.data())
@settings(max_examples=400, deadline=None)
def test_a_json_scan_resumed_from_a_prefix_equals_a_whole_one(chars: list[str], data: st.DataObject) -> None:
    """The text drafter scans a growing output once (``json_scan`` from the safe point a scan of
    its committed prefix returned): the same state as a scan of the whole text, at every cut."""
    from guidespec.scheduler.speculation.prompt_text import _JSON_PARTS, json_scan

    def whole(text: str) -> tuple[int | None, list[str]]:  # the scan as it was, of the whole text
        stack: list[str] = []
        string_at = None
        for part in _JSON_PARTS.finditer(text):
            token = part.group()
            if token[0] == '"':
                if not part.group(1) and part.end() == len(text):
                    string_at = part.start() + 1
            elif token in "[{":
                stack.append(token)
            elif stack:
                stack.pop()
        return string_at, stack

    text = "".join(chars)
    resume: tuple[int, tuple[str, ...]] = (0, ())
    for cut in sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=4))) + [len(text)]:
        string_at, stack, resume_next = json_scan(text[:cut], resume)
        assert (string_at, list(stack)) == whole(text[:cut])
        string_at, stack, _ = json_scan(text, resume)
        assert (string_at, list(stack)) == whole(text)
        resume = resume_next


@given(
    st.lists(st.sampled_from([":", ",", "[", " ", "\n", "-", ".", "1", "7", "a", '"']), max_size=40),
    st.integers(0, 90),
    st.sampled_from(["", "-", " -", "  "]),
)
@settings(max_examples=400, deadline=None)
def test_a_typed_number_is_found_as_a_search_of_the_whole_text_finds_it(
    chars: list[str], digits: int, sign: str
) -> None:
    """``text_state`` looks for a number the output has begun in the text's last characters (a
    whole search at each step grew with the output): the same match as a search of all of it,
    numbers longer than that window included."""
    from guidespec.scheduler.speculation.prompt_text import _TYPED_NUMBER, _typed_number

    text = "".join(chars) + sign + "3" * digits
    found, expected = _typed_number(text), _TYPED_NUMBER.search(text)
    assert (found and (found.span(), found.groups())) == (expected and (expected.span(), expected.groups()))
