"""Drafts copied from the prompt where the output is JSON (``json_text.py``), through the n-gram
drafter with a real tokenizer and grammar: a value after its key's mention, a list's next string,
a value's end closed as JSON does, values the prompt writes in prose."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from guidespec.config import SpeculativeConfig


def test_anchored_lookup_copies_a_value_from_where_its_name_is_in_the_prompt(real_model_dir) -> None:  # type: ignore[no-untyped-def]
    """Where no suffix of the output matches, the output's last word (the key) is found in the
    prompt's text and the grammar picks what follows it: the value, not the words between
    ("productName is "Glen Oak"" in the prompt, "productName": "..." in the output)."""
    from guidespec.grammar_backends import create_backend
    from guidespec.protocol import GuidedDecoding
    from guidespec.scheduler.speculation.ngram import ngram_drafter
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
    from guidespec.scheduler.speculation.ngram import ngram_drafter
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
    from guidespec.scheduler.speculation.ngram import ngram_drafter
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
    from guidespec.scheduler.speculation.ngram import ngram_drafter
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
    from guidespec.scheduler.speculation.ngram import ngram_drafter
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


def test_the_text_lookup_reads_a_growing_output_as_it_would_from_nothing(real_model_dir) -> None:  # type: ignore[no-untyped-def]
    """The text lookup keeps each request's committed output as text (and its JSON scan) from one
    step to the next: token by token through an output, with chained drafts past it, its drafts
    are those of a drafter that makes the text again at every call."""
    from guidespec.scheduler.speculation.ngram import ngram_drafter
    from guidespec.model_files import load_tokenizer

    tokenizer = load_tokenizer(real_model_dir)
    prompt = tokenizer.encode(
        "Turn this into JSON. The device ID is MON123456. The product name is whiskey Glen Oak. "
        'The heart rate is 78.\nalerts:\n- low battery\n- Gate oxide integrity\nnote: "say \\"hi\\"".'
    )
    output = tokenizer.encode(
        '{"deviceID": "MON123456", "productName": "Glen Oak", "heartRate": 78, '
        '"alerts": ["low battery", "Gate oxide integrity"], "note": "say \\"hi\\"", "x": [{"y": []}]}'
    )
    config = SpeculativeConfig(max_draft_len=6, is_public_pool=False)
    kept, fresh = (ngram_drafter(config, tokenizer, True) for _ in range(2))
    for drafter in (kept, fresh):
        drafter.propose("r", prompt, len(prompt), 6, len)  # the prefill step's call
    for n in range(len(output) + 1):
        context = prompt + output[:n]
        assert fresh.text is not None
        fresh.text.outputs.clear()
        assert kept.propose("r", context, len(context), 6, len) == fresh.propose("r", context, len(context), 6, len), n
    assert kept.text is not None and kept.text.outputs["r"].tokens == output
