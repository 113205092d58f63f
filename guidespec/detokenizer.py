"""Incremental detokenization: the text each new token adds, without re-decoding everything.

With a fast (Rust) tokenizer, ``tokenizers``' own ``DecodeStream`` does it, primed with the
prompt's last tokens (one call per token: ~0.5 µs against ~4 for two ``decode`` calls). Otherwise
a short window ending at the new tokens is decoded and only the part past the previous window's
text is emitted; a window whose text ends in an incomplete UTF-8 character ("\ufffd") waits for
the next token (with the tokenizers backend where there is one, as the stream: transformers'
``decode`` adds ~3 µs of Python a call). Same idea as vLLM's and TGI's incremental decoders.

Both wait by decoding a longer window at each token, which an output that never completes a
character (a run of stray UTF-8 bytes: a random model's, a sampled one's) made grow without end:
a step cost O(n), 0.5 ms a token by the 1,500th. Past ``_MAX_HELD`` tokens held back, the text up
to the last ``_KEEP`` tokens is sent where those tokens leave it unchanged (they hold at least the
three bytes an incomplete character can still need: what is sent is what a whole decode has
there), and the window moves on; a stream that held back that long hands over to the window,
which leaves out the special tokens a decode skips (they hold no bytes: a character's bytes can
come on either side of them).
"""

from __future__ import annotations

import weakref
from collections import deque
from typing import Any

from tokenizers.decoders import DecodeStream  # (tokenizers 0.21 and later; transformers 4.56 needs 0.22)

_WINDOW = 5
_MAX_HELD = 16  # tokens held back (no text) before the text before the last _KEEP is sent
_KEEP = 3


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self._skipped = _skipped_ids(tokenizer)
        self.ids = [t for t in prompt_token_ids[-4 * _WINDOW :] if t not in self._skipped][-_WINDOW:]
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._backend: Any = backend
        self._stream: Any = None
        if backend is not None:
            self._stream = DecodeStream(skip_special_tokens=True)
            for token_id in self.ids:  # the context a token's text can depend on (a leading space)
                self._stream.step(backend, token_id)
            # the stream's last tokens but skipped ones, and how many of the newest it holds back,
            # how many of those not skipped (``_to_window``)
            self._recent: deque[int] = deque(self.ids, maxlen=_WINDOW + _MAX_HELD)
            self._held = self._held_read = 0

    def whole(self, token_ids: list[int]) -> str | None:
        """The text ``add`` gives for all of ``token_ids`` from the start, in one decode where
        that is sure to be it (two decodes, against a call a token): the decode of the context
        and the tokens, past the context's own text, where it starts with that text and holds no
        incomplete character ("\ufffd": ``add`` holds those back, or sends what a window has
        there); else None. Only before the first ``add``."""
        context = self.ids[: self.read_offset]
        decode = self._decode
        before = decode(context) if context else ""
        text = decode(context + token_ids)
        if "\ufffd" in text or not text.startswith(before):
            return None
        return text[len(before) :]

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes (maybe empty)."""
        if self._stream is not None:
            text = self._stream.step(self._backend, token_id)
            skipped = token_id in self._skipped
            if not skipped:
                self._recent.append(token_id)
            if text:
                self._held = self._held_read = 0
                return str(text)
            self._held += 1
            self._held_read += not skipped
            if self._held < _MAX_HELD:
                return ""
            self._to_window()
            return self._flush(self._decode(self.ids[self.prefix_offset : self.read_offset]))
        if token_id in self._skipped:
            return ""
        self.ids.append(token_id)
        decode = self._decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset])
        new_text = decode(self.ids[self.prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return self._flush(prefix_text) if len(self.ids) - self.read_offset >= _MAX_HELD else ""
        delta = new_text[len(prefix_text) :]
        self._moved_to(len(self.ids))
        return delta

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:  # (what the tokenizer's own decode calls, without its ~3 µs of Python)
            return str(self._backend.decode(ids, skip_special_tokens=True))
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def _moved_to(self, read_offset: int) -> None:
        """The window's text is out up to ``read_offset``: the next window starts where the last read did."""
        self.prefix_offset, self.read_offset = self.read_offset, read_offset
        if self.prefix_offset > 4 * _WINDOW:  # keep the list short
            drop = self.prefix_offset
            self.ids = self.ids[drop:]
            self.prefix_offset, self.read_offset = 0, self.read_offset - drop

    def _flush(self, prefix_text: str) -> str:
        """The text of the held tokens but the last few, where those leave it as it is: the last
        ``_KEEP`` or more, as many as hold ``_KEEP`` characters (so at least as many bytes, what
        an incomplete character can still need: tokens a decode skips hold none)."""
        decode, ids = self._decode, self.ids
        for cut_at in range(len(ids) - _KEEP, max(self.read_offset, len(ids) - 2 * _KEEP - 2), -1):
            if len(decode(ids[cut_at:])) >= _KEEP:
                break
        else:
            return ""  # (tried again at the next token)
        cut = decode(ids[self.prefix_offset : cut_at])
        whole = decode(ids[self.prefix_offset :])
        if not (whole.startswith(cut) and cut.startswith(prefix_text)):
            return ""
        self._moved_to(cut_at)  # (also where they have no text: a run of special tokens, skipped)
        return cut[len(prefix_text) :]

    def _to_window(self) -> None:
        """Hand a stream that holds back ``_MAX_HELD`` tokens over to the window: its last read
        tokens before them as the window's start, the held ones unread."""
        recent = list(self._recent)
        self.ids = recent[max(0, len(recent) - self._held_read - _WINDOW) :]
        self.prefix_offset, self.read_offset = 0, len(self.ids) - self._held_read
        self._stream = None


_SKIPPED: weakref.WeakKeyDictionary[Any, frozenset[int]] = weakref.WeakKeyDictionary()


def _skipped_ids(tokenizer: Any) -> frozenset[int]:
    """The tokens a decode with ``skip_special_tokens`` leaves out (a tokenizer's special ones,
    its added special tokens among them), kept per tokenizer."""
    try:
        return _SKIPPED[tokenizer]
    except (KeyError, TypeError):
        pass
    ids = set(getattr(tokenizer, "all_special_ids", None) or ())
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids |= {i for i, token in added.items() if getattr(token, "special", False)}
    skipped = frozenset(ids)
    try:
        _SKIPPED[tokenizer] = skipped
    except TypeError:  # (not weakly referable: found again each time)
        pass
    return skipped
