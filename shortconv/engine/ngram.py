"""Prompt-lookup (n-gram) proposals: a pure function over a request's token ids."""

from __future__ import annotations

from collections.abc import Sequence


def propose_ngram(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> tuple[int, ...]:
    """Up to k tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, trying n from max_n down to min_n; () when no suffix of those lengths recurs.

    Why the latest occurrence: in repetitive text (code, lists, quoted input) the most recent
    match is the one most likely to continue the same way. A match may run into the suffix
    itself (a period shorter than n repeats), so fewer than k tokens may follow it."""
    ids = list(token_ids)
    total = len(ids)
    if k < 1:
        return ()
    for n in range(min(max_n, total - 1), min_n - 1, -1):
        start = _latest_match(ids, n)
        if start is not None:
            follow = ids[start + n : start + n + k]
            if follow:
                return tuple(follow)
    return ()


def _latest_match(ids: list[int], n: int) -> int | None:
    """Start of the latest occurrence of ids[-n:] that ends before the last token."""
    suffix = ids[-n:]
    for start in range(len(ids) - n - 1, -1, -1):
        if ids[start : start + n] == suffix:
            return start
    return None
