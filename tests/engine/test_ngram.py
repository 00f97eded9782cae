"""The n-gram (prompt-lookup) proposer: a pure function over a request's token ids."""

from __future__ import annotations

from shortconv.engine.ngram import propose_ngram


def test_proposes_what_followed_the_latest_occurrence_of_the_suffix() -> None:
    ids = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3]
    # Suffix [1, 2, 3] last occurred at 5..7, followed by 7, 8, 5.
    assert propose_ngram(ids, 3, 1, 3) == (7, 8, 5)
    assert propose_ngram(ids, 2, 1, 3) == (7, 8)


def test_longest_suffix_first() -> None:
    # [4, 5] occurs followed by 6; the one-token suffix [5] last occurred followed by 0.
    ids = [4, 5, 6, 5, 0, 4, 5]
    assert propose_ngram(ids, 1, 1, 2) == (6,)
    assert propose_ngram(ids, 1, 1, 1) == (0,)


def test_no_match_no_proposal() -> None:
    assert propose_ngram([1, 2, 3, 4], 4, 1, 3) == ()
    assert propose_ngram([1, 2, 1, 2], 4, 3, 3) == ()  # [2, 1, 2] never occurred before
    assert propose_ngram([7], 4, 1, 3) == ()
    assert propose_ngram([1, 1, 1], 0, 1, 3) == ()


def test_a_match_running_into_the_suffix_proposes_fewer() -> None:
    # Period 1: [3] occurred at index 1, followed by only the last token.
    assert propose_ngram([2, 3, 3], 4, 1, 1) == (3,)
    # Period 2 with n = 2: [1, 2] at 0..1 is followed by 1, 2 (then the end).
    assert propose_ngram([1, 2, 1, 2], 4, 2, 2) == (1, 2)
