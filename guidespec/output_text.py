"""A request's text, made by the client: the engine sends token ids, and the client's receiver
thread decodes them (``detokenizer``), ends the request at a stop string and holds back text
that could begin one.

None of this is on the scheduler's loop, where at 64 rows it was its largest part after the
step's own messages (the decoding ~10% of the loop's samples, issue 48); vLLM's output processor
does the same in its API process. The engine knows only token stops (EOS, ``stop_token_ids``, a
grammar's end, ``max_tokens``, the model length); a stop string found here ends the request
for the client at once, and the engine is told to abort it. The engine sends a request with
stop strings its tokens every step (``Request.sends_each_step``), with its figures so far. An
output that comes whole (not streamed, no stop strings) is decoded in one call where that gives
the same text (``IncrementalDetokenizer.whole``).

Stops, in order: EOS (unless ``ignore_eos``) and a stop token id, which add no text; then a
stop string, whose text is cut before it; then the engine's other reasons. While a request runs,
text that could be the start of a stop string is held back, so a streamed client never sees
part of a stop string.
"""

from __future__ import annotations

from typing import Any

from guidespec.detokenizer import IncrementalDetokenizer
from guidespec.protocol import SamplingParams


class OutputText:
    """One request's text so far, and how much of it the client has been given."""

    def __init__(
        self, tokenizer: Any, prompt_token_ids: list[int], params: SamplingParams, eos_token_ids: tuple[int, ...]
    ) -> None:
        self.tokenizer, self.prompt_token_ids = tokenizer, prompt_token_ids
        self.stop = params.stop
        self.longest = max((len(s) for s in params.stop), default=0)
        # tokens that end the output with no text of their own (an engine's "stop" for them)
        eos = () if params.ignore_eos else eos_token_ids
        self.silent = frozenset(params.stop_token_ids) | frozenset(eos)
        self.restart()

    def restart(self) -> None:
        """From the prompt again (the engine started the request again: ``RequestOutput.restarted``)."""
        self.detokenizer = IncrementalDetokenizer(self.tokenizer, self.prompt_token_ids)
        self.text = ""
        self.sent = 0  # the text given to the client so far
        self._added = False  # tokens went through the detokenizer (``whole`` is for the first call)

    def add(self, token_ids: list[int], finished: bool) -> tuple[str, int | None]:
        """A delta's tokens: the text it gives the client, and, where one of them completes a
        stop string, how many of its tokens the output keeps (up to that one; else None).
        ``finished``: the engine ended the output with these tokens (nothing is held back)."""
        detokenizer, silent = self.detokenizer, self.silent
        if finished and not self.stop and not self._added:  # the whole output at once (not streamed)
            text = detokenizer.whole([t for t in token_ids if t not in silent])
            if text is not None:
                self.text = text
                return self._take(True), None
        self._added = True
        for count, token in enumerate(token_ids, start=1):
            if token in silent:
                continue
            before = len(self.text)
            self.text += detokenizer.add(token)
            if self.stop and len(self.text) > before and self._cut(before):
                return self._take(True), count
        return self._take(finished), None

    def _cut(self, before: int) -> bool:
        """Cut the text before the first stop string in it. One that ends in the new text starts
        at most ``longest - 1`` characters before it: one that started earlier ended earlier."""
        text = self.text
        search_from = max(0, before - self.longest + 1)
        hits = [i for i in (text.find(s, search_from) for s in self.stop) if i >= 0]
        if not hits:
            return False
        self.text = text[: min(hits)]
        return True

    def _take(self, finished: bool) -> str:
        """The text not yet given, but the last ``longest - 1`` characters while the output goes on."""
        end = len(self.text)
        if not finished and self.stop:
            end = max(self.sent, end - (self.longest - 1))
        new_text = self.text[self.sent : end]
        self.sent = end
        return new_text
