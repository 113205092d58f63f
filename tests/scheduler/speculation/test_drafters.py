"""Drafters in the scheduler: n-gram lookup options (as TensorRT-LLM's), grammar cuts, user drafters."""

from __future__ import annotations

from typing import Any, Callable, Sequence

import pytest

from guidespec.config import SpeculativeConfig
from guidespec.scheduler.speculation.drafters import NGramDrafter, UserDrafter, create_drafter


def _all(tokens: Sequence[int]) -> int:
    return len(tokens)


def test_ngram_finds_the_continuation_of_the_longest_matching_suffix() -> None:
    drafter = NGramDrafter(max_draft_len=3, max_matching_ngram_size=2)
    context = [1, 2, 3, 4, 5, 9, 2, 3, 6, 7, 8, 1, 2, 3]
    # "2 3" was followed by "4 5 9" and by "6 7 8"; the oldest comes first by default
    assert drafter.propose("r", context, len(context), 3, _all) == [4, 5, 9]
    newest = NGramDrafter(max_draft_len=3, max_matching_ngram_size=2, is_use_oldest=False)
    assert newest.propose("r", context, len(context), 3, _all) == [6, 7, 8]
    latest_only = NGramDrafter(max_draft_len=3, max_matching_ngram_size=2, is_keep_all=False)
    assert latest_only.propose("r", context, len(context), 3, _all) == [6, 7, 8]


def test_ngram_draft_is_cut_where_the_grammar_rejects_and_the_best_candidate_wins() -> None:
    drafter = NGramDrafter(max_draft_len=3, max_matching_ngram_size=1)
    context = [7, 1, 2, 3, 7, 1, 5, 6, 7]
    assert drafter.propose("r", context, len(context), 3, lambda t: min(len(t), 1)) == [1]

    def rejects_2(tokens: Sequence[int]) -> int:
        return next((i for i, t in enumerate(tokens) if t == 2), len(tokens))

    # the oldest continuation (1 2 3) is cut after one token; the next (1 5 6) is accepted whole
    assert drafter.propose("r", context, len(context), 3, rejects_2) == [1, 5, 6]
    assert drafter.propose("r", context, len(context), 2, _all) == [1, 2]  # max_len caps it


def test_ngram_pools_are_shared_only_when_public() -> None:
    for public, expected in ((True, [8, 9, 10]), (False, [])):
        drafter = NGramDrafter(max_draft_len=3, max_matching_ngram_size=2, is_public_pool=public)
        first = [5, 6, 8, 9, 10, 11]
        drafter.propose("a", first, len(first), 3, _all)
        assert drafter.propose("b", [1, 5, 6], 3, 3, _all) == expected


def test_a_public_pool_gives_way_to_the_request_s_own_context() -> None:
    """The request's own continuation wins where it is as long; the shared pool's where longer."""
    drafter = NGramDrafter(max_draft_len=3, max_matching_ngram_size=2)
    other = [5, 6, 1, 2, 3, 4]
    drafter.propose("a", other, len(other), 3, _all)
    mine = [5, 6, 7, 8, 9, 0, 5, 6]  # "5 6" was followed by "1 2 3" in a's context, by "7 8 9" in b's
    assert drafter.propose("b", mine, len(mine), 3, _all) == [7, 8, 9]

    def rejects_8(tokens: Sequence[int]) -> int:
        return next((i for i, t in enumerate(tokens) if t == 8), len(tokens))

    assert drafter.propose("b", mine, len(mine), 3, rejects_8) == [1, 2, 3]  # its own is cut short here
    drafter.release("b")
    assert "b" not in drafter.own and drafter.propose("c", [0, 5, 6], 3, 3, _all) == [1, 2, 3]


def test_ngram_uses_only_final_tokens_as_keys_and_values() -> None:
    drafter = NGramDrafter(max_draft_len=2, max_matching_ngram_size=1)
    # the last three tokens are this step's drafts (not final): they must not enter the pool
    context = [1, 2, 3, 4, 1]
    assert drafter.propose("r", context + [9, 9, 1], len(context), 2, _all) == [2, 3]
    assert drafter.propose("r", context, len(context), 2, _all) == [2, 3]
    drafter.release("r")


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


def test_anchored_lookup_copies_a_value_from_where_its_name_is_in_the_prompt(real_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Where no suffix of the output matches, the output's last word (the key) is found in the
    prompt's text and the grammar picks what follows it: the value, not the words between
    ("productName is "Glen Oak"" in the prompt, "productName": "..." in the output)."""
    from guidespec.grammar_backends import create_backend
    from guidespec.protocol import GuidedDecoding
    from guidespec.scheduler.speculation.drafters import ngram_drafter
    from guidespec.model_files import load_tokenizer

    tokenizer = load_tokenizer(real_model_dir)
    backend = create_backend("xgrammar", tokenizer, 49152, (2,))
    schema = (
        '{"type": "object", "properties": {"productName": {"type": "string"}, "price": {"type": "integer"}},'
        ' "required": ["productName", "price"]}'
    )
    compiled = backend.compile(GuidedDecoding(json_schema=schema))
    prompt = tokenizer.encode('Extract the record as JSON. productName is "Glen Oak"; price is 40.')
    # after `":` no suffix of the output occurs in the prompt (nor, for price, one the grammar takes)
    for output, value in (('{"productName":', ' "Glen Oak"'), ('{"productName": "Glen Oak", "price":', " 40")):
        tokens = prompt + tokenizer.encode(output)
        matcher = backend.create_matcher(compiled)
        assert all(matcher.accept_token(t) for t in tokenizer.encode(output))
        valid_prefix = _valid_prefix(matcher)
        drafts = {}
        for anchored in (True, False):
            drafter = ngram_drafter(
                SpeculativeConfig(max_draft_len=3, is_public_pool=False, anchored_lookup=anchored), tokenizer
            )
            drafter.propose("r", prompt, len(prompt), 3, valid_prefix)  # the first call sees the prompt
            drafts[anchored] = drafter.propose("r", tokens, len(tokens), 3, valid_prefix)
        assert len(drafts[True]) == 3 and value.startswith(tokenizer.decode(drafts[True]))
        assert drafts[False] == []  # plain lookup has nothing here


def test_a_value_after_its_key_comes_from_the_keys_next_mention_in_the_prompt(real_model_dir) -> None:  # type: ignore[no-untyped-def]
    """After ``"name":`` the key is looked up in the prompt before the output's own n-grams (which
    would repeat the previous item's value), and from where the last key's value was found on: the
    second item's name is the prompt's second name."""
    from guidespec.grammar_backends import create_backend
    from guidespec.protocol import GuidedDecoding
    from guidespec.scheduler.speculation.drafters import ngram_drafter
    from guidespec.model_files import load_tokenizer

    tokenizer = load_tokenizer(real_model_dir)
    backend = create_backend("xgrammar", tokenizer, 49152, (2,))
    item = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "price": {"type": "integer"}},
        "required": ["name", "price"],
    }
    schema = {"type": "object", "properties": {"items": {"type": "array", "items": item}}, "required": ["items"]}
    compiled = backend.compile(GuidedDecoding(json_schema=schema))
    prompt = tokenizer.encode(
        'Extract the order as JSON. items item 1 -> name is "Wireless Mouse"; items item 1 -> '
        'price is 15; items item 2 -> name is "Webcam HD"; items item 2 -> price is 45.'
    )
    output = '{"items": [{"name": "Wireless Mouse", "price": 15}, {"name": "Webcam HD", "price": 45}]}'
    values = {
        '{"items": [{"name":': ' "Wireless Mouse"',
        '{"items": [{"name": "Wireless Mouse", "price":': " 15",
        '{"items": [{"name": "Wireless Mouse", "price": 15}, {"name":': ' "Webcam HD"',
        '{"items": [{"name": "Wireless Mouse", "price": 15}, {"name": "Webcam HD", "price":': " 45",
    }
    assert all(output.startswith(prefix) for prefix in values)
    drafter = ngram_drafter(SpeculativeConfig(max_draft_len=3, is_public_pool=False), tokenizer)
    drafter.propose("r", prompt, len(prompt), 3, lambda tokens: len(tokens))  # the prefill step's call
    for prefix, value in values.items():
        drafts = _draft_after(drafter, backend.create_matcher(compiled), tokenizer, prompt, prefix)
        assert drafts and value.startswith(tokenizer.decode(drafts)), (prefix, tokenizer.decode(drafts))


def _draft_after(drafter: Any, matcher: Any, tokenizer: Any, prompt: list[int], output: str) -> list[int]:
    """The drafter's draft (length 3) after ``prompt`` and the output text so far, checked by a
    fresh ``matcher`` that has taken that output."""
    done = tokenizer.encode(output)
    assert all(matcher.accept_token(t) for t in done)
    tokens = prompt + done
    return list(drafter.propose("r", tokens, len(tokens), 3, _valid_prefix(matcher)))


def _valid_prefix(matcher: Any) -> Callable[[Sequence[int]], int]:
    """How many of the drafts ``matcher`` accepts from where it is (left as it was)."""

    def valid_prefix(drafts: Sequence[int]) -> int:
        count = 0
        for t in drafts:
            if not matcher.accept_token(int(t)):
                break
            count += 1
        matcher.rollback(count)
        return count

    return valid_prefix


def test_a_lists_next_item_is_the_prompts_next_string_closed_the_outputs_way(real_model_dir) -> None:  # type: ignore[no-untyped-def]
    """After ``"Tuesday",`` the draft is the string after ``"Tuesday"`` in the prompt, not the
    output's own n-gram (which repeats an earlier item), and the prompt's ``";`` after a value
    becomes the output's ``",``; the prompt's last item, closed by its period, closes the list."""
    from guidespec.grammar_backends import create_backend
    from guidespec.protocol import GuidedDecoding
    from guidespec.scheduler.speculation.drafters import ngram_drafter
    from guidespec.model_files import load_tokenizer

    tokenizer = load_tokenizer(real_model_dir)
    backend = create_backend("xgrammar", tokenizer, 49152, (2,))
    schema = {
        "type": "object",
        "properties": {"storeID": {"type": "string"}, "daysOpen": {"type": "array", "items": {"type": "string"}}},
    }
    compiled = backend.compile(GuidedDecoding(json_schema=schema))
    prompt = tokenizer.encode(
        'Extract the record as JSON. storeID is "CS-1123"; daysOpen item 1 is "Monday"; '
        'daysOpen item 2 is "Tuesday"; daysOpen item 3 is "Wednesday"; '
        'daysOpen item 4 is "Thursday".'
    )
    drafter = ngram_drafter(SpeculativeConfig(max_draft_len=3, is_public_pool=False), tokenizer)
    drafter.propose("r", prompt, len(prompt), 3, lambda tokens: len(tokens))  # the prefill step's call
    expected = {
        '{"storeID": "CS-1123", "daysOpen": ["Monday", "Tuesday",': ' "Wednesday",',
        '{"storeID": "CS-1123", "daysOpen": ["Monday", "Tuesday", "Wednesday",': ' "Thursday"]',
    }
    for before, draft in expected.items():
        assert (
            tokenizer.decode(_draft_after(drafter, backend.create_matcher(compiled), tokenizer, prompt, before))
            == draft
        )


def test_a_values_end_closes_it_the_jsons_way_and_the_next_key_follows(real_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Where the prompt's copy of a value ends (``";``, ``;``, a sentence's period), the draft closes
    the value as JSON does (``",``, ``,``, ``}``) and goes on with the next field the prompt names
    (``"patientID":``); where the prompt opens a string and the grammar wants a list, `` ["``."""
    from guidespec.grammar_backends import create_backend
    from guidespec.protocol import GuidedDecoding
    from guidespec.scheduler.speculation.drafters import ngram_drafter
    from guidespec.model_files import load_tokenizer

    tokenizer = load_tokenizer(real_model_dir)
    backend = create_backend("xgrammar", tokenizer, 49152, (2,))
    schema = {
        "type": "object",
        "properties": {
            "deviceID": {"type": "string"},
            "patientID": {"type": "string"},
            "heartRate": {"type": "integer"},
            "alerts": {"type": "array", "items": {"type": "string"}},
            "stock": {"type": "integer"},
        },
    }
    compiled = backend.compile(GuidedDecoding(json_schema=schema))
    prompt = tokenizer.encode(
        'Extract the record as JSON. deviceID is "MON123456"; patientID is "PAT654321"; '
        'heartRate is 78; alerts item 1 is "Gate oxide integrity"; stock is 150.'
    )
    drafter = ngram_drafter(SpeculativeConfig(max_draft_len=3, is_public_pool=False), tokenizer)
    drafter.propose("r", prompt, len(prompt), 3, lambda tokens: len(tokens))  # the prefill step's call
    expected = {
        '{"deviceID": "MON123456': '", "patient',  # the string's end, then the next key
        '{"deviceID": "MON123456", "patientID": "PAT654321", "heartRate": 78': ', "alert',  # the number's end (``;``)
        '{"deviceID": "MON123456", "patientID": "PAT654321", "heartRate": 78, "alerts":': ' ["Gate oxide',
        '{"deviceID": "MON123456", "patientID": "PAT654321", "heartRate": 78, "alerts": ["Gate oxide '
        'integrity"], "stock": 150': "}",
    }  # the sentence's period ends the record
    for before, draft in expected.items():
        drafts = _draft_after(drafter, backend.create_matcher(compiled), tokenizer, prompt, before)
        assert tokenizer.decode(drafts) == draft, before


def test_text_lookup_drafts_values_the_prompt_writes_in_prose(real_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Values written unquoted (`` Glen Oak`` after a space, other tokens than ``G len Oak`` after
    JSON's quote) and names written as words (``device ID`` for ``deviceID``) are drafted from the
    prompt's characters: a string's start after its name, its rest after what the output began (in
    any case), its end closed as JSON does, a number, a list's next line and its end."""
    from guidespec.grammar_backends import create_backend
    from guidespec.protocol import GuidedDecoding
    from guidespec.scheduler.speculation.drafters import ngram_drafter
    from guidespec.model_files import load_tokenizer

    tokenizer = load_tokenizer(real_model_dir)
    backend = create_backend("xgrammar", tokenizer, 49152, (2,))
    strings = {"type": "array", "items": {"type": "string"}}
    properties = {"deviceID": {"type": "string"}, "productName": {"type": "string"}, "heartRate": {"type": "integer"}}
    compiled = backend.compile(
        GuidedDecoding(json_schema={"type": "object", "properties": {**properties, "alerts": strings}})
    )
    prompt = tokenizer.encode(
        "Turn this into JSON. The device ID is MON123456. The product name is whiskey Glen Oak. "
        "The heart rate is 78.\nalerts:\n- low battery\n- Gate oxide integrity"
    )
    record = '{"deviceID": "MON123456", "productName": "Glen Oak", "heartRate": 78, "alerts": ["low battery",'
    expected = {
        '{"deviceID":': ' "MON1',  # the value after its name, past "is", opened as a JSON string
        '{"deviceID": "MON123456': '", "product',  # the sentence's end closes it; more follows
        '{"deviceID": "MON123456", "productName": "Whis': "key Glen Oak",  # found in any case
        '{"deviceID": "MON123456", "productName": "G': 'len Oak",',  # the word's tokens after a quote
        '{"deviceID": "MON123456", "productName": "Glen Oak", "heartRate":': " 78",  # a number
        '{"deviceID": "MON123456", "productName": "Glen Oak", "heartRate": 7': '8, "',  # its rest, its end
        record: ' "Gate oxide',  # the list's next line
        record + ' "Gate oxide': ' integrity"]',  # the prompt's last item ends the list
    }
    drafts: dict[bool, dict[str, str]] = {}
    for text_lookup in (True, False):
        drafter = ngram_drafter(SpeculativeConfig(max_draft_len=3, is_public_pool=False), tokenizer, text_lookup)
        drafter.propose("r", prompt, len(prompt), 3, lambda tokens: len(tokens))  # the prefill step's call
        drafts[text_lookup] = {
            before: tokenizer.decode(_draft_after(drafter, backend.create_matcher(compiled), tokenizer, prompt, before))
            for before in expected
        }
    assert drafts[True] == expected
    assert all(drafts[False][before] != draft for before, draft in expected.items())  # token lookup alone misses


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


class _Faulty:
    """A user's drafter with bugs: it raises where the context holds token 7777, and proposes a
    token id past the vocabulary where it holds 8888 (``tests/test_speculative.py``)."""

    def propose(self, context: list[int], max_len: int) -> list[int]:
        if 7777 in context:
            raise KeyError("a bug in the user's drafter")
        return [10**9] * max_len if 8888 in context else [context[-1]] * max_len
