"""The offline benchmark's workloads (a, b, c): prompts, output lengths, session turns."""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """`turns` > 1: prompts are sessions' first turns; each later turn appends the reply plus
    `user_len` new tokens. Outputs are per request (per turn for sessions)."""

    name: str
    prompts: list[list[int]]
    outputs: list[int]
    turns: int = 1
    user_len: int = 0

    @property
    def useful_tokens(self) -> int:
        return sum(self.outputs) * self.turns


def make_workloads(vocab: int, quick: bool, seed: int = 0) -> dict[str, Workload]:
    rng = random.Random(seed)
    lo = 3 if vocab > 3 else 0  # skip pad/bos/eos: a prompt of random ordinary tokens

    def toks(n: int) -> list[int]:
        return [rng.randrange(lo, vocab) for _ in range(n)]

    def spread(a: int, b: int, n: int) -> list[int]:
        vals = [a + (b - a) * i // max(1, n - 1) for i in range(n)]
        rng.shuffle(vals)
        return vals

    n_b, (p_lo, p_hi), (o_lo, o_hi) = (8, (8, 64), (4, 24)) if quick else (32, (16, 512), (16, 256))
    a_len = 16 if quick else 128
    n_c, turns, sys_len, user, reply = (4, 2, 16, 8, 8) if quick else (64, 4, 64, 32, 32)
    return {
        "a": Workload("a", [toks(a_len)], [a_len]),
        "b": Workload("b", [toks(n) for n in spread(p_lo, p_hi, n_b)], spread(o_lo, o_hi, n_b)),
        "c": Workload("c", [toks(sys_len + user) for _ in range(n_c)], [reply] * n_c, turns, user),
    }


def next_turn(w: Workload, convs: list[list[int]], replies: list[list[int]]) -> list[list[int]]:
    """Conversation + the model's reply + a new user message (the first turn's last tokens)."""
    user = [p[-w.user_len :] for p in w.prompts]
    return [c + r + u for c, r, u in zip(convs, replies, user, strict=True)]


def warmup_of(w: Workload) -> Workload:
    """A short version of `w` with the same kinds of steps (prefill, decode, session resume)."""
    n = min(4, len(w.prompts))
    return Workload(
        w.name, w.prompts[:n], [min(8, o) for o in w.outputs[:n]], min(2, w.turns), w.user_len
    )
