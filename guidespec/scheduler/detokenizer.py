"""Incremental detokenization: the text each new token adds, without re-decoding everything.

With a fast (Rust) tokenizer, ``tokenizers``' own ``DecodeStream`` does it, primed with the
prompt's last tokens (one call per token: ~0.5 µs against ~4 for two ``decode`` calls). Otherwise
a short window ending at the new tokens is decoded and only the part past the previous window's
text is emitted; a window whose text ends in an incomplete UTF-8 character ("\ufffd") waits for
the next token. Same idea as vLLM's and TGI's incremental decoders.
"""

from __future__ import annotations

from typing import Any

from tokenizers.decoders import DecodeStream  # (tokenizers 0.21 and later; transformers 4.56 needs 0.22)

_WINDOW = 5


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.ids = list(prompt_token_ids[-_WINDOW:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream: Any = None
        if backend is not None:
            self._backend, self._stream = backend, DecodeStream(skip_special_tokens=True)
            for token_id in self.ids:  # the context a token's text can depend on (a leading space)
                self._stream.step(backend, token_id)

    def add(self, token_id: int) -> str:
        """Append a token; return the text it completes (maybe empty)."""
        if self._stream is not None:
            return self._stream.step(self._backend, token_id) or ""
        self.ids.append(token_id)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], skip_special_tokens=True)
        new_text = decode(self.ids[self.prefix_offset :], skip_special_tokens=True)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.prefix_offset > 4 * _WINDOW:  # keep the list short
            drop = self.prefix_offset
            self.ids = self.ids[drop:]
            self.prefix_offset, self.read_offset = 0, self.read_offset - drop
        return delta
