"""The n-gram drafter (prompt lookup, as TensorRT-LLM's): pools that map each n-gram of a
request's final tokens (and, shared, of every request's) to the tokens that followed it, and the
order in which a draft is sought, its pools' lookups around the JSON-text drafts from the prompt
(``json_text.py``) where each token's text is known.

It does not read the prompt's text or JSON (``json_text.py``, ``prompt_text.py`` do).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Sequence

from guidespec.config import SpeculativeConfig
from guidespec.model_files import text_encoder
from guidespec.scheduler.speculation.json_text import JsonTextDrafter, ValidPrefix

_Pool = OrderedDict  # key n-gram -> OrderedDict of continuations (oldest first)


class NGramDrafter:
    """Prompt lookup with a pool, as TensorRT-LLM's NGram drafter: every n-gram of the final
    context (n = 1 .. ``max_matching_ngram_size``) maps to the ``max_draft_len`` tokens that
    followed it. A lookup tries the longest suffix of the context first. ``is_keep_all`` keeps
    every distinct continuation of a key (else only the latest); ``is_use_oldest`` tries the
    oldest first (else the newest). Of the first ``max_candidates`` continuations, the one the
    grammar accepts furthest wins.

    Each request has a pool of its own context. ``is_public_pool`` adds one pool shared by all
    requests, used where it gives a longer valid draft than the request's own: on the JME cases'
    greedy outputs (draft length 3, forced drafts first) the own pool first gave 2.92 and 3.00
    tokens per step on 9 and 20 cases, against 2.74 and 2.91 for the shared pool alone and 2.88
    and 2.89 for the own pool alone: another request's continuations of a short key are mostly
    noise, though the shared pool does fill gaps.

    ``token_texts`` (each token id's text) and ``encode`` turn on the drafts copied from the
    prompt where the output is JSON (``json_text.py``: ``JsonTextDrafter``, whose docstring tells
    where ``propose`` tries each and what each gained in replays); ``text_lookup`` the ones drafted
    from the prompt's characters."""

    def __init__(
        self,
        max_draft_len: int,
        max_matching_ngram_size: int,
        is_keep_all: bool = True,
        is_use_oldest: bool = True,
        is_public_pool: bool = True,
        max_keys: int = 1 << 20,
        max_continuations: int = 32,
        max_candidates: int = 8,
        token_texts: Sequence[str] | None = None,
        encode: Callable[[str], list[int]] | None = None,
        text_lookup: bool = True,
    ) -> None:
        self.max_draft_len = max_draft_len
        self.max_ngram = max_matching_ngram_size
        self.keep_all, self.use_oldest = is_keep_all, is_use_oldest
        self.max_keys, self.max_continuations, self.max_candidates = max_keys, max_continuations, max_candidates
        self.public: _Pool | None = OrderedDict() if is_public_pool else None
        self.own: dict[str, _Pool] = {}
        self.seen: dict[str, int] = {}  # request -> final tokens already in its pools
        self.text = JsonTextDrafter(token_texts, encode, text_lookup) if token_texts is not None else None

    def propose(
        self, request_id: str, context: Sequence[int], num_committed: int, max_len: int, valid_prefix: ValidPrefix
    ) -> list[int]:
        own = self.own.setdefault(request_id, OrderedDict())
        pools = [own] if self.public is None else [own, self.public]
        self._update(pools, request_id, context[:num_committed])
        text = self.text
        text_lookup = text is not None and text.text_lookup
        best: list[int] = []
        key = None
        if text is not None:
            key = text.key_before(context)
            if key is not None:  # a value after its key: copied from where the key is in the prompt, first
                best = text.anchored(request_id, context, num_committed, max_len, valid_prefix, key)
            else:  # after a string and its comma: the prompt's next string, first
                best = text.next_quoted(request_id, context, num_committed, max_len, valid_prefix)
        settled = False  # inside a string the prompt holds: its copy by text, however short, is the draft
        if text is not None and text_lookup:
            by_text, settled = text.from_text(request_id, context, num_committed, max_len, valid_prefix)
            if by_text and (settled or len(by_text) >= len(best)):
                best = by_text
        if len(best) < max_len and not settled:
            mine = self._lookup(own, context, max_len, valid_prefix)
            if len(mine) > len(best):
                best = mine
        if not best and text is not None and key is None:
            best = text.anchored(request_id, context, num_committed, max_len, valid_prefix)
        if self.public is not None and len(best) < max_len and not settled:
            shared = self._lookup(self.public, context, max_len, valid_prefix)
            if len(shared) > len(best):
                best = shared
        if not best and text is not None and text_lookup:  # an object's next key, where nothing else drafts
            best = text.next_key(request_id, context, num_committed, max_len, valid_prefix)
        while best and len(best) < max_len:  # chained: the list's next item or the next key, else the own pool
            head = best
            after = list(context) + head
            valid_rest: ValidPrefix = lambda ts: max(0, valid_prefix(head + list(ts)) - len(head))  # noqa: E731
            rest: list[int] = []
            for candidate in text.chained if text is not None else ():
                found = candidate(request_id, after, num_committed, max_len - len(head), valid_rest)
                if len(found) > len(rest):
                    rest = found
            if not rest:
                rest = self._lookup(own, after, max_len - len(head), valid_rest)
            if not rest:
                break
            best = head + rest
        return best

    def release(self, request_id: str) -> None:
        self.seen.pop(request_id, None)
        self.own.pop(request_id, None)
        if self.text is not None:
            self.text.release(request_id)

    def _lookup(self, pool: _Pool, context: Sequence[int], max_len: int, valid_prefix: ValidPrefix) -> list[int]:
        for n in range(min(self.max_ngram, len(context)), 0, -1):
            continuations = pool.get(tuple(context[len(context) - n :]))
            if not continuations:
                continue
            ordered = list(continuations) if self.use_oldest else list(reversed(continuations))
            best: list[int] = []
            for candidate in ordered[: self.max_candidates]:
                draft = self._closed(list(candidate[:max_len]), valid_prefix)
                if len(draft) > len(best):
                    best = draft
                if len(best) == max_len:
                    break
            if best:
                return best
        return []

    def _update(self, pools: list[_Pool], request_id: str, final: Sequence[int]) -> None:
        """Add the full-length continuations that the final tokens since the last call completed:
        each under the keys that end where it starts, in each pool (a key's continuations in the
        order added, the oldest dropped past ``max_continuations``; the oldest key dropped past
        ``max_keys``). Written out in one loop: a method call a key and pool cost a tenth of it
        (5.1 -> 4.6 µs a token, two pools, keys of 1-3 tokens)."""
        d = self.max_draft_len
        keep_all, max_keys, max_continuations = self.keep_all, self.max_keys, self.max_continuations
        first = max(1, self.seen.get(request_id, 0) - d + 1)
        for pos in range(first, len(final) - d + 1):  # a continuation starts at pos, its keys end there
            value = tuple(final[pos : pos + d])
            for n in range(1, min(self.max_ngram, pos) + 1):
                key = tuple(final[pos - n : pos])
                for pool in pools:
                    continuations = pool.get(key)
                    if continuations is None:
                        continuations = pool[key] = OrderedDict()
                        if len(pool) > max_keys:
                            pool.popitem(last=False)
                    if not keep_all:
                        continuations.clear()
                    if value not in continuations:
                        continuations[value] = None
                        if len(continuations) > max_continuations:
                            continuations.popitem(last=False)
        self.seen[request_id] = max(self.seen.get(request_id, 0), len(final))

    def _closed(self, draft: list[int], valid_prefix: ValidPrefix) -> list[int]:
        """``draft`` cut where the grammar rejects one, closed as JSON closes a value where the
        token texts are known (``JsonTextDrafter.closed``)."""
        if self.text is not None:
            return self.text.closed(draft, valid_prefix)
        return draft[: valid_prefix(draft)]


def ngram_drafter(cfg: SpeculativeConfig, tokenizer: Any = None, text_lookup: bool = True) -> NGramDrafter:
    """The n-gram drafter; with a tokenizer and ``cfg.anchored_lookup``, its anchored lookup (the
    token texts are made here, not in a request's step: ``token_texts``)."""
    texts = None
    if tokenizer is not None and cfg.anchored_lookup:
        texts = token_texts(tokenizer)
    # the next-key lookup tokenizes the same few names step after step
    encode = text_encoder(tokenizer) if texts is not None else None
    return NGramDrafter(
        cfg.max_draft_len,
        cfg.max_matching_ngram_size,
        cfg.is_keep_all,
        cfg.is_use_oldest,
        cfg.is_public_pool,
        token_texts=texts,
        encode=encode,
        text_lookup=text_lookup,
    )


def token_texts(tokenizer: Any) -> list[str]:
    """Each token id's text, as ``tokenizer.batch_decode`` gives it one id at a time: by the fast
    tokenizer's own batch decode where the wrapper would add nothing (no clean-up of spaces), 5x
    less time at SmolLM2's 49k tokens (0.4 s against 2 s on a loaded 2-core host) and 2x at
    Gemma 3's 262k."""
    ids = [[i] for i in range(len(tokenizer))]
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return list(tokenizer.batch_decode(ids))
    return list(backend.decode_batch(ids, skip_special_tokens=False))
