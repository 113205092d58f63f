"""JSON-text drafting from the prompt, for the n-gram drafter (``ngram.py``: ``NGramDrafter``):
where the output is JSON whose values the prompt states, drafts are copied from where the prompt
states them (its tokens after a key's or a word's mention, a list's next string, the next key
the prompt names, or its characters re-encoded as the JSON will hold them), and a copied value
is closed as JSON closes it. It keeps each request's prompt and its cursors into it.

It does not keep n-gram pools or decide the order the drafts are tried in (``NGramDrafter``
does), nor index the prompt's text (``prompt_text.py``).
"""

from __future__ import annotations

import bisect
import re
from typing import Callable, Iterable, Sequence

from guidespec.scheduler.speculation.prompt_text import (
    TEXT_CANDIDATES,
    TEXT_CLOSINGS,
    TEXT_SEARCH,
    TEXT_WINDOW,
    PromptText,
    openings,
    places,
    JsonResume,
    json_scan,
    text_state,
)

ValidPrefix = Callable[[Sequence[int]], int]  # how many of the tokens the request's grammar accepts
_WORD = re.compile(r"[A-Za-z0-9_]{3,}")
_KEY_END = re.compile(r'"([A-Za-z0-9_]{2,})"\s*:\s*"?$')
_STRING_COMMA_END = re.compile(r'("[^"]+")\s*,\s*$')
_KEY_START = re.compile(r'[{,]\s*("?)$')  # an object's next key begins (its quote, or before it)
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_KEY_WORDS = 48  # how many of the prompt's words after the cursor may be the next key


class _OutputText:
    """A request's committed output: its tokens, their texts, the text, and where a JSON scan of
    the text resumes (``prompt_text.json_scan``)."""

    __slots__ = ("tokens", "pieces", "text", "resume")

    def __init__(self) -> None:
        self.tokens: list[int] = []
        self.pieces: list[str] = []
        self.text = ""
        self.resume: JsonResume = (0, ())


class JsonTextDrafter:
    """Drafts copied from the prompt where the output is JSON, for ``NGramDrafter`` (``ngram.py``),
    which tries them around its pools' lookups in the order told here.

    ``token_texts`` (each token id's text) turns on the anchored lookup, where the request's own
    pool has no draft (before the shared pool, whose hits there are mostly noise): the context's
    last word (3+ letters, digits or ``_``, in its last 12 tokens) is found in the prompt's text,
    and what follows each occurrence there, from 0 to ``_ANCHOR_SKIP`` tokens after it, is a
    candidate; the one the grammar accepts furthest wins. Tokens differ between
    the prompt and the output (`` productName`` after a space there, ``productName`` after a
    quote here) and so do the words between a name and its value (``name is "x"`` there,
    ``"name": "x"`` here), so the key is text and the grammar picks the offset. Replayed on the
    JME cases' greedy outputs (draft length 3, forced drafts first), it took tokens per step
    from 2.92 to 3.14 on the benchmark's 10 cases and from 3.00 to 3.08 on the first 30 where it
    came after both pools; before the shared pool, with a complete output ending without a step,
    3.31 → 3.42 and 3.23 → 3.33 (``benchmarks/replay_drafters.py``). Tried before the own pool's
    lookup (where it gives a whole draft, or as long a one) it lost (2.46–2.70): the last word is
    more often inside a value than a key.

    Where the context ends with a JSON key and its colon (``"price":``, often forced by the grammar),
    that key is looked up in the prompt first, before the own pool (whose draft there is the
    previous value after ``":``), and from the prompt position where the last key's value was found
    on (records list their values in the prompt's order: the second item's ``name`` is the prompt's
    second ``name``). Where it ends with a string and a comma (``"Tuesday",``, a list's item), the
    string after that one in the prompt is tried first (``"Wednesday"``). A copy from the prompt
    that the grammar cuts where the prompt closes a string its own way (``";``) ends with the
    closing the grammar takes (``",``, ``"}``, ``"]``). Replayed as above, with the prefill step
    drafting too: 3.61 → 3.69 tokens per step on the 10 cases and 3.46 → 3.67 on 30 for the key
    first, 3.75 and 3.72 with the list's next string and the closing.

    A value's end is read from the prompt's punctuation (``closed``): ``";``, ``;``, ``,``, a
    number's sentence period and a line's end after a value close it, with ``",``, ``,``, ``},`` ...
    where more of the prompt's content follows, ``"}``, ``}`` ... where none does (the own pool's
    continuations, whose place in the prompt is not known: where the punctuation is not a
    period); a string the grammar wants as a list opens with `` ["``. A draft shorter than
    ``max_len`` is chained: after a closing, the list's next item (``next_quoted``) or the next
    key the prompt names (``next_key``), the longer, else the own pool's continuation of the
    draft so far. Replayed as above: 3.75 → 4.05 on the 10 cases, 3.72 → 3.91 on 30.

    All of that copies the prompt's tokens, and so depends on the prompt writing a value as JSON
    does (``name is "value";``): a value written unquoted in prose (`` Glen Oak``) has other
    tokens than inside a JSON string (``"G len Oak``), and a name written as words (``device ID``)
    is not the key. The text lookup (``from_text``, on with ``text_lookup`` and ``encode``) drafts
    from the prompt's characters instead, encoded the way the output will hold them; inside a
    string (or number) it drafts its copy alone, however short, and the chain goes on after its
    closing. Replayed on the 10 JME cases and on the same facts written four other ways
    (``benchmarks/rephrase.py``: sentences, ``key: value`` lines, quoted values in a shuffled
    order, a paragraph), tokens per step went from 4.03 and 3.15 to 4.12 and 3.75 (on the first
    30 cases, 20 of them not looked at while writing it: 3.91 and 3.30 to 3.94 and 3.69)."""

    def __init__(
        self, token_texts: Sequence[str], encode: Callable[[str], list[int]] | None = None, text_lookup: bool = True
    ) -> None:
        self.token_texts = token_texts
        self.encode = encode
        self.prompts: dict[str, PromptText] = {}  # request -> its prompt's tokens and text
        self.cursors: dict[str, int] = {}  # request -> the prompt token where its last anchored draft began
        self.text_lookup = text_lookup and encode is not None
        self.text_cursors: dict[str, int] = {}  # request -> where the prompt's last value drafted by text starts
        self.outputs: dict[str, _OutputText] = {}  # request -> its committed output's text, kept as it grows
        # JSON's closings of a value, most likely first: where the prompt's own closing (``";``,
        # ``;``) says more follows, and where its period says the record ends
        ids = {text: i for i, text in enumerate(token_texts)}
        self.closers = {kind: [ids[text] for text in texts if text in ids] for kind, texts in _CLOSINGS.items()}
        self.list_opening = ids.get(' ["')

    def release(self, request_id: str) -> None:
        self.prompts.pop(request_id, None)
        self.cursors.pop(request_id, None)
        self.text_cursors.pop(request_id, None)
        self.outputs.pop(request_id, None)

    @property
    def chained(self) -> tuple[Callable[[str, Sequence[int], int, int, ValidPrefix], list[int]], ...]:
        """What may follow a draft's closing: the list's next item, the next key."""
        if not self.text_lookup:
            return (self.next_quoted, self.next_key)
        return (lambda *args: self.from_text(*args)[0], self.next_quoted, self.next_key)

    def _pieces(self, tokens: Sequence[int]) -> list[str]:
        texts = self.token_texts
        return [texts[t] if 0 <= t < len(texts) else "" for t in tokens]

    def key_before(self, context: Sequence[int]) -> str | None:
        """The key when the context ends with a JSON object key and its colon (``"name":``)."""
        found = _KEY_END.search("".join(self._pieces(context[-12:])))
        return found.group(1) if found else None

    def _prompt(self, request_id: str, context: Sequence[int], num_committed: int) -> PromptText:
        """The request's prompt as the first call sees it (at the prefill step, or after it)."""
        source = self.prompts.get(request_id)
        if source is None:
            source = self.prompts[request_id] = PromptText(
                context[:num_committed], self._pieces(context[:num_committed])
            )
        return source

    def _copy(self, prompt: PromptText, start: int, max_len: int, valid_prefix: ValidPrefix) -> list[int]:
        """The prompt's tokens from ``start`` (``closed``, told whether more of the prompt's content
        follows where the grammar cuts the copy)."""
        draft = list(prompt.tokens[start : start + max_len])
        return self.closed(draft, valid_prefix, lambda cut: prompt.more_after(prompt.offsets[start + cut]))

    def closed(
        self, draft: list[int], valid_prefix: ValidPrefix, more_after: Callable[[int], bool] | None = None
    ) -> list[int]:
        """``draft`` (the prompt's or the output's tokens) cut where the grammar rejects one. Where
        that one closes the value in the prompt's own way (``";``, ``;``, ``,``, a period or a line's
        end), the first of JSON's closings for the case that the grammar accepts takes its place:
        where more follows (``more_after(index)``, where the draft comes from the prompt; else ``;``
        and ``,`` say so) ``",``, ``,``, ``},`` ..., where the record ends ``"}``, ``}`` ...; where the
        prompt opens a string and the grammar wants a list, `` ["`` opens it."""
        valid = valid_prefix(draft)
        if valid == len(draft):
            return draft[:valid]
        pieces = self._pieces(draft)
        rejected = pieces[valid]
        if valid > 1 and pieces[valid - 1] == "." and pieces[valid - 2][-1:].isdigit() and not rejected[:1].isdigit():
            valid, rejected = valid - 1, "."  # a sentence's period after a number, not its decimals
        kind = None
        if rejected.startswith('"'):
            kind = "string"
        elif rejected[:1] in (";", ",", "."):
            kind = "value"
        elif rejected[:1] == "\n" and valid and pieces[valid - 1][-1:].isalnum():  # a line's end after a value
            kind = "line"
        if kind is not None:
            more = more_after(valid) if more_after is not None else rejected.lstrip('"')[:1] != "."
            kind = kind if more else f"{kind} end"
            for closer in self.closers[kind]:
                if valid_prefix(draft[:valid] + [closer]) == valid + 1:
                    return draft[:valid] + [closer]
        elif valid == 0 and rejected == ' "' and self.list_opening is not None:
            opened = [self.list_opening] + draft[1:]
            return opened[: valid_prefix(opened)]
        return draft[:valid]

    def next_quoted(
        self, request_id: str, context: Sequence[int], num_committed: int, max_len: int, valid_prefix: ValidPrefix
    ) -> list[int]:
        """Where the context ends with a string and a comma (``"Monday",``): the string that follows
        it in the prompt, from the token holding its opening quote (a list's next item)."""
        found = _STRING_COMMA_END.search("".join(self._pieces(context[-16:])))
        if found is None:
            return []
        prompt = self._prompt(request_id, context, num_committed)
        text, offsets = prompt.text, prompt.offsets
        quotes = (text.find('"', match.end()) for match in re.finditer(re.escape(found.group(1)), text))
        starts = (bisect.bisect_right(offsets, quote) - 1 for quote in quotes if quote >= 0)
        return self._longest(prompt, starts, max_len, valid_prefix)[0]

    def next_key(
        self, request_id: str, context: Sequence[int], num_committed: int, max_len: int, valid_prefix: ValidPrefix
    ) -> list[int]:
        """Where the context opens an object's key (``{"``, ``, "``, or ``,`` before the key's quote):
        the first of the prompt's words after the cursor that the grammar takes as a whole key
        (``patientID":``). The prompt names the fields in the order the output gives them: the next
        key is the name after the last value."""
        encode = self.encode
        found = _KEY_START.search("".join(self._pieces(context[-4:]))) if encode is not None else None
        if encode is None or found is None:
            return []
        opening = "" if found.group(1) else ' "'
        if opening and not valid_prefix(encode(opening)):
            return []  # not an object's key here (a list's next number)
        prompt = self._prompt(request_id, context, num_committed)
        cursor = self.cursors.get(request_id, 0)
        start = prompt.offsets[cursor] if cursor < len(prompt.offsets) else 0
        tried: set[str] = set()
        for match in _NAME.finditer(prompt.text, start):
            name = match.group()
            if name in tried:
                continue
            tried.add(name)
            draft = encode(opening + name + '":')[:max_len]
            if valid_prefix(draft) == len(draft):
                return draft
            if len(tried) >= _KEY_WORDS:
                break
        return []

    def _longest(
        self, prompt: PromptText, starts: Iterable[int], max_len: int, valid_prefix: ValidPrefix
    ) -> tuple[list[int], int]:
        """Of the prompt copies from ``starts`` (``_copy``), the first longest, and where it starts;
        the first of full length ends the search."""
        best: list[int] = []
        best_start = 0
        for start in starts:
            draft = self._copy(prompt, start, max_len, valid_prefix)
            if len(draft) > len(best):
                best, best_start = draft, start
                if len(best) == max_len:
                    break
        return best, best_start

    def anchored(
        self,
        request_id: str,
        context: Sequence[int],
        num_committed: int,
        max_len: int,
        valid_prefix: ValidPrefix,
        word: str | None = None,
    ) -> list[int]:
        pieces = self._pieces
        prompt = self._prompt(request_id, context, num_committed)
        tokens, offsets, text = prompt.tokens, prompt.offsets, prompt.text
        keyed = word is not None
        if word is None:
            words = _WORD.findall("".join(pieces(context[-12:])))
            if not words:
                return []
            word = words[-1]
        # a key's occurrences from the cursor on first (records list their values in the prompt's order)
        cursor = self.cursors.get(request_id, 0) if keyed else 0
        firsts = [bisect.bisect_left(offsets, match.end()) for match in re.finditer(re.escape(word), text)]
        firsts = [f for f in firsts if f >= cursor] + [f for f in firsts if f < cursor]
        starts = (start for first in firsts for start in range(first, min(first + _ANCHOR_SKIP + 1, len(tokens))))
        best, best_start = self._longest(prompt, starts, max_len, valid_prefix)
        if best and keyed:
            self.cursors[request_id] = best_start
        return best

    def from_text(
        self, request_id: str, context: Sequence[int], num_committed: int, max_len: int, valid_prefix: ValidPrefix
    ) -> tuple[list[int], bool]:
        """A value (a string or a number; an object's, or a list's item) drafted from the prompt's
        characters rather than its tokens, so that a value the prompt writes unquoted (`` Glen Oak``
        after a space) is drafted as the JSON string's tokens (``G len Oak`` after a quote):

        - inside a string the output has begun, its last characters are found in the prompt, and
          what follows them there is the draft;
        - at a value's start (after ``"name":`` or its opening quote), the value follows a mention
          of the name in the prompt, matched on letters and digits alone (``device ID`` for
          ``deviceID``), past the words between (``is``, ``:``, the names of the fields around it);
        - at a list's next item, it follows the previous value in the prompt.

        A value opens as the grammar takes it (a string, a list, a number: ``openings``). The text
        from there to the value's end in the prompt (its closing quote where quoted, else the end
        of its line, clause or sentence, and for a list's item also a comma or ``and``) is encoded
        after the characters of the value the output has begun (a token depends on what precedes
        it) and before the closing JSON needs next there: ``",`` where more follows in the prompt,
        ``"}`` or ``"]`` where the record or the list ends; the grammar has the last word."""
        prompt = self._prompt(request_id, context, num_committed)
        output = list(context[len(prompt.tokens) :])
        committed = num_committed - len(prompt.tokens)
        known = self._output_text(request_id, output[:committed])
        drafted = self._pieces(output[committed:])  # (a chained call's draft so far)
        pieces, out_text = known.pieces + drafted, known.text + "".join(drafted)
        string_at, containers, _ = json_scan(out_text, known.resume)
        state = text_state(out_text, (string_at, containers[-1] if containers else ""))
        if state is None:
            return [], False
        typed_at, literal, in_list, first_item = state
        head_tokens = self._string_tokens(output, typed_at, pieces, len(out_text)) if typed_at is not None else []
        if head_tokens is None:
            return [], False
        typed = out_text[typed_at:] if typed_at is not None else ""
        starts = places(prompt, out_text, typed, in_list and not first_item, self.text_cursors.get(request_id, 0))
        head_text = "".join(self._pieces(head_tokens))
        after_colon = typed_at is None and out_text.rstrip().endswith(":")
        opens: dict[str, bool] = {}  # opening -> whether the grammar takes it here
        for value_start, start, quoted in starts[:TEXT_CANDIDATES]:
            for opening in openings(out_text, typed_at is not None, prompt.text[start : start + 32], quoted):
                if opening not in opens:
                    opens[opening] = not opening or valid_prefix(self._encode(opening)) == len(self._encode(opening))
                if not opens[opening]:
                    continue
                is_literal = literal if typed_at is not None else not opening.endswith('"')
                listed = opening.lstrip(" ").startswith("[") if after_colon else in_list
                kind = (quoted, is_literal, listed)
                draft = self._text_draft(prompt, (opening + head_text, head_tokens), start, kind, max_len, valid_prefix)
                if len(draft) > (len(self._encode(opening)) if opening else 0):  # more than the opening
                    self.text_cursors[request_id] = value_start
                    self.cursors[request_id] = bisect.bisect_right(prompt.offsets, value_start) - 1
                    return draft, True
        return [], False

    def _encode(self, text: str) -> list[int]:
        encode = self.encode
        assert encode is not None
        return encode(text)

    def _output_text(self, request_id: str, committed: list[int]) -> _OutputText:
        """The request's committed output tokens as text (and where a JSON scan of it resumes),
        extended by the tokens committed since the last call rather than made again."""
        known = self.outputs.get(request_id)
        n = len(known.tokens) if known is not None else 0
        if known is None or len(committed) < n or committed[:n] != known.tokens:
            known, n = _OutputText(), 0
            self.outputs[request_id] = known
        if len(committed) > n:
            new = self._pieces(committed[n:])
            known.tokens += committed[n:]
            known.pieces += new
            known.text += "".join(new)
            known.resume = json_scan(known.text, known.resume)[2]
        return known

    def _string_tokens(self, output: list[int], string_at: int, pieces: list[str], length: int) -> list[int] | None:
        """The output's tokens after the one that holds the open string's quote (the string's text
        starts at character ``string_at``), only the last ones from a word's start where the string
        is long; None where one token holds both the quote and what follows it. ``pieces``: the
        output's tokens' texts, ``length`` their characters (the text's: summed a call, they were
        a quarter of a JSON row's drafting)."""
        first, start = len(pieces), length
        while first > 0 and start - len(pieces[first - 1]) >= string_at:
            first -= 1
            start -= len(pieces[first])
        if start != string_at:
            return None
        rest = length - start  # the characters from piece i on
        for i in range(first, len(pieces)):  # a word's start: the tokens after it do not depend on those before
            if rest < TEXT_SEARCH:
                break
            if pieces[i][:1] == " " and i > first:
                first = i
            rest -= len(pieces[i])
        return list(output[first:])

    def _text_draft(
        self,
        prompt: PromptText,
        head: tuple[str, list[int]],
        start: int,
        kind: tuple[bool, bool, bool],
        max_len: int,
        valid_prefix: ValidPrefix,
    ) -> list[int]:
        """The tokens after ``head``'s tokens of its text, the prompt's value from ``start`` and,
        where the value ends within reach, the JSON closing the grammar takes (in the order the
        prompt suggests); ``kind``: whether the value is quoted in the prompt, a literal (a number,
        ``true`` ...) in the output, in a list."""
        (head_text, head_tokens), (quoted, literal, in_list) = head, kind
        end, more = prompt.value_end(start, quoted, in_list, literal)
        window = min(end, start + TEXT_WINDOW)
        body = head_text + prompt.text[start:window]
        best: list[int] = []
        for closing in ("",) if window < end else TEXT_CLOSINGS[literal, in_list, more]:
            tokens = self._encode(body + closing)
            if tokens[: len(head_tokens)] != head_tokens:
                break
            draft = tokens[len(head_tokens) : -1 if window < end else None][:max_len]  # a cut word's last token differs
            valid = valid_prefix(draft)
            if valid > len(best):
                best = draft[:valid]
            if valid == len(draft) or len(tokens) > len(head_tokens) + max_len + 1:
                break  # the closing is out of the draft's reach
        return best


_ANCHOR_SKIP = 4  # an anchored candidate starts up to this many tokens after its word
_CLOSINGS = {
    "string": ('",', '"}', '"]', '"'),
    "string end": ('"}', '"]', '"', '",'),
    "value": (",", "},", "}", "],", "]"),
    "value end": ("}", "}]", "]", ","),
    "line": ('",', '"}', '"]', ",", "},", "}", "],", "]"),  # a line's end closes a string or a number
    "line end": ('"}', '"]', "}", "}]", "]", '",', ","),
}
