"""The n-gram drafter's pools: lookup options (as TensorRT-LLM's), grammar cuts, shared pools."""

from __future__ import annotations

from typing import Sequence

from guidespec.scheduler.speculation.ngram import NGramDrafter


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


def test_token_texts_are_each_ids_batch_decode(real_model_dir) -> None:  # type: ignore[no-untyped-def]
    """The anchored lookup's token texts, read by the fast tokenizer's own batch decode, are what
    ``tokenizer.batch_decode`` gives each id alone (special tokens, partial UTF-8 bytes and all)."""
    from guidespec.model_files import load_tokenizer
    from guidespec.scheduler.speculation.ngram import token_texts

    tokenizer = load_tokenizer(real_model_dir)
    texts = token_texts(tokenizer)
    assert len(texts) == len(tokenizer)
    assert texts == tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    assert texts[tokenizer.eos_token_id] == tokenizer.eos_token
