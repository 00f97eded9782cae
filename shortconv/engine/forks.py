"""`SamplingParams.n` > 1: one request's forks, made when it is queued.

The parent computes its prompt but the last token, once; then each of its n forks copies that
state into a slot of its own (the cache manager's `fork`: the recurrent state by a slot copy,
full KV pages by reference, a partly filled last page by a copy), computes the last prompt token
itself, and samples with its own seed (`fork_seed`: fork 0 keeps the request's). Why the last
token is the forks': each fork's first token needs a logits row of its own, and a row is one
position's forward (vLLM's forks recompute it too, as a prefix-cache hit always leaves a token).
"""

from __future__ import annotations

from shortconv.engine.request import Request, Status, fork_id
from shortconv.sampling.sampler import fork_seed


def make_forks(parent: Request) -> None:
    """Give `parent` its forks and cut its own prompt to what it computes for them (a one-token
    prompt leaves it nothing: its forks then start fresh, with no state to copy)."""
    prompt = parent.prompt_token_ids
    source = parent if len(prompt) > 1 else None
    parent.forks = [
        Request(
            fork_id(parent.request_id, i),
            list(prompt),
            parent.params,
            fork_seed(parent.seed, i),
            index=i,
            parent=parent,
            source=source,
        )
        for i in range(parent.params.n)
    ]
    parent.prompt_token_ids = list(prompt[:-1])


def ready_to_fork(req: Request) -> bool:
    """A running parent whose computed state is what its forks copy."""
    return bool(req.forks) and req.status is Status.RUNNING and req.num_computed == req.num_tokens


def copied_by_all(parent: Request) -> bool:
    """No fork of `parent` still waits to copy its state (admitted, finished or aborted)."""
    return all(f.source is None for f in parent.forks)


def seq_ids(request_id: str, n: int) -> list[tuple[str, int]]:
    """(scheduler id, choice index) of each sequence a request samples: itself, or its forks."""
    if n == 1:
        return [(request_id, 0)]
    return [(fork_id(request_id, i), i) for i in range(n)]
