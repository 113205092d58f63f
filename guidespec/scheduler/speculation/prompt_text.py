"""The n-gram drafter's text lookup (``json_text.py``: ``JsonTextDrafter``): drafts copied from the
prompt's characters rather than its tokens, so a value the prompt writes in prose (unquoted, its
name in words, in another order than the schema's) is drafted as the JSON output will hold it.

:class:`PromptText` indexes a prompt's text: where a name is mentioned (on its letters and digits,
lowercased), where the value after a mention starts and where it ends. :func:`places` says where in
the prompt the output's next characters may be copied from (a string's rest after what the output
began, a value after its name's mention, a list's next item after the previous one);
:func:`text_state` and :func:`json_state` read where the output stands; :func:`openings` and
``TEXT_CLOSINGS`` give the JSON around a copied value, likeliest first (the grammar decides).
"""

from __future__ import annotations

import re
from typing import Sequence

TEXT_WINDOW = 48  # the prompt's characters encoded for one draft (its last token is dropped where cut)
TEXT_SEARCH = 32  # a string's last characters that are looked up in the prompt
_TEXT_MIN_WORDS = 3  # the fewest characters of a string's last words looked up where the string is not found
TEXT_CANDIDATES = 6  # places in the prompt tried for one draft
_MENTION_WORDS = 8  # words after a name's mention that may start its value
_MENTION_STARTS = 3  # words after a name's mention tried as its value's start
_NEXT_QUOTE = 64  # how far after a list's quoted item the next one may open
TEXT_CLOSINGS = {  # (a literal, in a list, more follows in the prompt) -> JSON's closings, likeliest first
    (False, False, True): ('",', '"}', '"]', '"'),
    (False, False, False): ('"}', '"]', '"', '",'),
    (False, True, True): ('",', '"]', '"'),
    (False, True, False): ('"]', '",', '"'),
    (True, False, True): (",", "},", "}", "],", "]"),
    (True, False, False): ("}", "}]", "]", ","),
    (True, True, True): (",", "],", "]"),
    (True, True, False): ("]", "],", "]}", ","),
}
# words that stand between a name and its value in English prose (articles, auxiliaries, prepositions,
# pronouns and conjunctions; no content words)
_FUNCTION_WORDS = frozenset(
    "a an the is are was were be been being has have had do does did will would shall should can could may "
    "might must of in on at by for to from with as about into per than it its this that these those their his "
    "her our we they he she which who and or but so".split()
)
_SEPARATORS = frozenset("is are was were equals as".split())  # a name's copula: its value follows
_DASHES = frozenset(("-", "–", "—", "->", "=>"))
_TYPED_NUMBER = re.compile(r"([:,\[])\s*(-?\d[\d.]*)$")  # a number the output has begun, and what precedes it
_NUMBER_TAIL = re.compile(r"[\s\d.-]*")  # what a text ending in a number may end with
_JSON_PARTS = re.compile(r'"(?:[^"\\]|\\.)*("?)|[\[\]{}]')
_LAST_KEY = re.compile(r'"([^"\\]{1,64})"\s*:\s*\[?\s*"?$')
_LAST_ITEM = re.compile(r'(?:"((?:[^"\\]|\\.)*)"|([-\w.+]+))\s*,\s*"?$')  # a list's last item and its comma
_LITERAL = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?(?![\w-])|(?:true|false|null)\b")
_KEYS = re.compile(r'"([^"\\]{1,64})"\s*:')
_VALUE_END = re.compile(r"\n|;|\.(?=\s|$|<)")
_ITEM_END = re.compile(r"\n|;|,|\.(?=\s|$|<)| and | or ")
_ITEM_FOLLOWS = re.compile(r"\s*(?:[,;]|and\b|or\b)|\n\s*(?:[-*•]|\d+[.)])\s")
_ITEM_MORE = re.compile(r"\n\s*(?:[-*•]|\d+[.)])\s")
_ITEM_START = re.compile(r"(?:\s|[,;]|and\b|or\b|[-*•]\s|\d+[.)]\s)*")
_SPECIAL = re.compile(r"<[^<>\s]+>")


class PromptText:
    """A prompt's text for the text lookup: where a name is mentioned (matched on its letters and
    digits, lowercased), where the value after a mention starts, and where a value ends. The chat
    template's closing (the special tokens among the prompt's last 8 and what follows them) is not
    part of the content."""

    def __init__(self, tokens: Sequence[int], pieces: list[str]) -> None:
        self.tokens, self.text = list(tokens), "".join(pieces)
        offsets = self.offsets = [0] * len(pieces)  # each token's first character in the text
        for i in range(1, len(pieces)):
            offsets[i] = offsets[i - 1] + len(pieces[i - 1])
        text = self.text
        self.lower = text.lower() if len(text.lower()) == len(text) else text
        kept = [(i, c.lower()) for i, c in enumerate(text) if c.isalnum()]
        self.letters = "".join(c for _, c in kept)
        self.letter_at = [i for i, _ in kept]
        tail = [i for i in range(max(0, len(pieces) - 8), len(pieces)) if _SPECIAL.fullmatch(pieces[i])]
        self.content_end = offsets[tail[0]] if tail else len(text)

    def value_starts(self, key: str, known: set[str], after: int) -> list[tuple[int, int, bool]]:
        """(value's start, where the draft copies from, whether quoted) after each mention of
        ``key`` outside quotes, the mentions from ``after`` on first (``_after_mention``; ``known``:
        the output's keys)."""
        name = _normalized(key)
        if len(name) < 2:
            return []
        found = []
        at = self.letters.find(name)
        while at >= 0:
            begin, end = self.letter_at[at], self.letter_at[at + len(name) - 1] + 1
            at = self.letters.find(name, at + 1)
            if _inside_word(self.text, begin, end) or self.text[begin - 1 : begin] == '"' == self.text[end : end + 1]:
                continue
            found.append(self._after_mention(end, name, known))
        ordered = [s for s in found if s and s[0][0] >= after] + [s for s in found if s and s[0][0] < after]
        return [start for starts in ordered for start in starts]

    def _after_mention(self, end: int, name: str, known: set[str]) -> list[tuple[int, int, bool]]:
        """Where the value after a mention that ends at ``end`` may start, likeliest first: the
        first quoted word of its clause, else the first word after a copula or a colon (``is``,
        ``:``, ``=`` ...), then the clause's other words, that are not function words, punctuation
        or part of a field's name (the grammar rejects those that cannot be the value's start)."""
        words: list[tuple[int, int, bool]] = []
        separated_at = None  # how many words there were before the first after a separator
        for count, word in enumerate(re.finditer(r"\S+", self.text[end : self.content_end])):
            if count >= _MENTION_WORDS:
                break
            raw = word.group()
            if raw.startswith('"'):
                at = end + word.start() + 1
                return [(at, at, True)]
            core = raw.strip(":=,;()-–>.")
            letters = _normalized(core)
            if core.lower() not in _FUNCTION_WORDS and letters not in name and letters not in known:
                at = end + word.start() + raw.find(core[:1])
                words.append((at, at, False))
            if separated_at is None and (core.lower() in _SEPARATORS or raw.endswith((":", "=")) or raw in _DASHES):
                separated_at = len(words)
            if raw.endswith((".", ";")) or (core and self.text[end + word.end() : end + word.end() + 1] == "\n"):
                break  # the clause ends (not at a colon before the value's line: ``name:\n- value``)
        if separated_at is not None and separated_at < len(words):
            words.insert(0, words.pop(separated_at))
        return words[:_MENTION_STARTS]

    def find_typed(self, typed: str, after: int) -> list[tuple[int, int, bool]]:
        """Where the string the output has begun is in the prompt, in any case: (the value's start,
        the character after the string so far, whether quoted), from ``after`` on first. Where the
        string (its last characters) is not there, its last words are looked up instead (the model
        wrote the value's start its own way)."""
        typed = typed.lower() if len(typed.lower()) == len(typed) else typed
        search = typed[-TEXT_SEARCH:]
        found = self._occurrences(search, whole=len(search) == len(typed))
        back = len(typed) - len(search)  # from a match to its value's start
        words = [m.start() for m in re.finditer(r"(?<=\s)\S", search)]
        while not found and words:  # the last words, from the longest
            search, back = search[words.pop(0) :], 0
            if len(search) >= _TEXT_MIN_WORDS:
                found = self._occurrences(search, whole=True)
        starts = [(at - back, at + len(search), self.text[at - back - 1 : at - back] == '"') for at in found]
        return [s for s in starts if s[0] >= after] + [s for s in starts if s[0] < after]

    def _occurrences(self, search: str, whole: bool) -> list[int]:
        """Where ``search`` (lowercased) is in the prompt's content; with ``whole``, only where a
        word starts."""
        found = []
        at = self.lower.find(search, 0, self.content_end)
        while at >= 0:
            if not whole or not self.text[at - 1 : at].isalnum():
                found.append(at)
            at = self.lower.find(search, at + 1, self.content_end)
        return found

    def next_item(self, previous: str, after: int) -> list[tuple[int, int, bool]]:
        """A list's next item, after the previous one (``previous``, found in the prompt from
        ``after`` on first): the next quoted string where that one was quoted, else what follows
        the separator (``,``, ``and``, a line's ``- ``)."""
        found = []
        for _, end, _ in self.find_typed(previous, after)[:TEXT_CANDIDATES] if previous else ():
            if self.text[end : end + 1] == '"':  # quoted: the next string near it
                opening = self.text.find('"', end + 1, min(self.content_end, end + _NEXT_QUOTE))
                if opening >= 0:
                    found.append((opening + 1, opening + 1, True))
                continue
            start = _ITEM_START.match(self.text, end, min(self.content_end, end + 16))
            at = start.end() if start else end
            if at > end and at < self.content_end and self.text[at].strip():
                found.append((at, at, False))
        return found

    def value_end(self, start: int, quoted: bool, in_list: bool, literal: bool = False) -> tuple[int, bool]:
        """Where the value from ``start`` ends (a closing quote, a literal's last character, else
        the end of a line, clause or sentence, and in a list a comma or ``and``) and whether more
        follows it: the list's next item, or for an object's value more of the prompt's content."""
        text, content_end = self.text, self.content_end
        number = _LITERAL.match(text, start, content_end) if literal and not quoted else None
        if quoted:
            end = text.find('"', start, content_end)
            end = content_end if end < 0 else end
            after = text[end + 1 : end + 2]
            more_in_list = bool(after) and after not in ".\n<" and end + 1 < content_end
        elif number is not None:
            end = number.end()
            more_in_list = bool(_ITEM_FOLLOWS.match(text, end, content_end))
        else:
            found = (_ITEM_END if in_list else _VALUE_END).search(text, start, content_end)
            end = found.start() if found else content_end
            sign = found.group() if found else ""
            more_in_list = sign not in ("", ".", "\n") or bool(_ITEM_MORE.match(text, end, content_end))
        return end, more_in_list if in_list else self.more_after(end)

    def more_after(self, at: int) -> bool:
        """Whether the prompt's content goes on after character ``at`` (a letter or a digit)."""
        return any(c.isalnum() for c in _SPECIAL.sub("", self.text[at + 1 : self.content_end]))


def json_state(text: str) -> tuple[int | None, str]:
    """Where the output's open string starts (None: not in one) and its innermost open container."""
    string_at, stack, _ = json_scan(text)
    return string_at, stack[-1] if stack else ""


JsonResume = tuple[int, tuple[str, ...]]  # a scan's safe point: (position, open containers there)


def json_scan(text: str, resume: JsonResume = (0, ())) -> tuple[int | None, tuple[str, ...], JsonResume]:
    """:func:`json_state`'s scan from ``resume`` (a point an earlier scan of a prefix of ``text``
    returned): (open string's start or None, open containers, the safe point to resume a scan
    of a longer text from). Every part but an open string at the end (or before a last lone
    backslash) ends where no later character can change it: the safe point is the end of the
    last such part, so a text that grows is scanned once, not again at every token."""
    position, containers = resume
    stack = list(containers)
    string_at = None
    safe = resume
    open_string = False
    for part in _JSON_PARTS.finditer(text, position):
        token = part.group()
        if token[0] == '"':
            if not part.group(1):  # an open string: nothing after it is safe
                open_string = True
                if part.end() == len(text):
                    string_at = part.start() + 1
                continue
        elif token in "[{":
            stack.append(token)
        elif stack:
            stack.pop()
        safe = (part.end(), tuple(stack))
    if not open_string:  # (the characters after the last part start none: a list of numbers is scanned once)
        safe = (len(text), tuple(stack))
    return string_at, tuple(stack), safe


def places(prompt: PromptText, out_text: str, typed: str, next_item: bool, after: int) -> list[tuple[int, int, bool]]:
    """Where in the prompt the value the output is at may be (``PromptText``'s lookups): after the
    string it has begun (``typed``), after a list's previous item (``next_item``), else after a
    mention of its key; the places from ``after`` on first."""
    if typed:
        return prompt.find_typed(typed, after)
    if next_item:
        found = _LAST_ITEM.search(out_text[-256:])
        previous = next((g for g in found.groups() if g), "") if found else ""
        if not previous or out_text.count(f'"{previous}"') > 1:  # an empty item, or a list that repeats
            return []  # an item: not the prompt's list
        return prompt.next_item(previous, after)
    key = _LAST_KEY.search(out_text[-96:])
    if key is None:
        return []
    return prompt.value_starts(key.group(1), {_normalized(name) for name in _KEYS.findall(out_text)}, after)


def text_state(
    out_text: str, scanned: tuple[int | None, str] | None = None
) -> tuple[int | None, bool, bool, bool] | None:
    """Where the output stands for the text lookup: where the value it has begun starts (None:
    none begun), whether that value is a literal (a number), whether it is in a list and the
    list's first item; None where no value is due (an object's key, between values).
    ``scanned``: :func:`json_state` of ``out_text``, where the caller has it."""
    string_at, container = json_state(out_text) if scanned is None else scanned
    in_list = container == "["
    if string_at is not None:
        before = out_text[: string_at - 1].rstrip()[-1:]
        if before not in (":", "[", ","):  # an object's key
            return None
        return string_at, False, in_list, before != ","
    number = _typed_number(out_text)
    if number is not None:
        return number.start(2), True, in_list, number.group(1) == "["
    end = out_text.rstrip()[-1:]
    if end == ":" or (in_list and end in ",["):
        return None, False, in_list, end != ","
    return None


def _typed_number(out_text: str) -> re.Match[str] | None:
    """``_TYPED_NUMBER`` searched in the text's last characters, and in all of it only where they
    could all be the number's (a search of all of it at every step grew with the output: a
    separator, space, sign and digits end the text, so at most one place can match)."""
    at = max(0, len(out_text) - 64)
    found = _TYPED_NUMBER.search(out_text, at)
    if found is None and at and _NUMBER_TAIL.fullmatch(out_text, at):
        found = _TYPED_NUMBER.search(out_text)
    return found


def openings(out_text: str, in_string: bool, value: str, quoted: bool) -> tuple[str, ...]:
    """How the value in the prompt's ``value`` (from its start on) may open in the output: nothing
    in a string the output has begun, else after ``:`` a string, a list of strings, a literal or a
    list of literals (after a list's comma a string or a literal), literals first where the
    prompt's value looks like one and lists first where a list's separator follows its first
    item; each after a space, then without (a compact grammar's); the grammar picks."""
    if in_string:
        return ("",)
    strings: tuple[str, ...] = (' "', ' ["')
    literals: tuple[str, ...] = (" ", " [")
    end = out_text.rstrip()[-1:]
    if end == ",":
        strings, literals = (' "',), (" ",)
    elif end == "[":
        strings, literals = ('"',), ("",)
    literal = None if quoted else _LITERAL.match(value)
    openings = literals + strings if literal else strings + literals
    first = literal.end() if literal else next(_VALUE_END.finditer(value + "\n")).start()
    if end == ":" and not quoted and _ITEM_FOLLOWS.match(value, first):  # "1, 2 and 3": a list's items
        openings = tuple(sorted(openings, key=lambda opening: "[" not in opening))
    if out_text.endswith(" "):
        return tuple(dict.fromkeys(o[1:] for o in openings))  # the space is out already
    return openings + tuple(o[1:] for o in openings if o.startswith(" "))


def _normalized(name: str) -> str:
    return "".join(c for c in name.lower() if c.isalnum())


def _inside_word(text: str, begin: int, end: int) -> bool:
    return text[begin - 1 : begin].isalnum() or text[end : end + 1].isalnum()
