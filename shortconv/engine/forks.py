"""`SamplingParams.n` > 1: one request's forks, made when it is queued.

The parent computes its whole prompt, once. The chunk that ends it carries one sampling row per
fork (`SeqChunk.fork_rows`): the prompt's last position gets one logits row, which the runner
repeats per fork, and each fork draws its first token from it with its own seed (`fork_seed`:
fork 0 keeps the request's), its own controls and its own grammar matcher. Then each fork,
its first token in hand, copies the parent's state into a slot of its own (the cache manager's
`fork`: the recurrent state by a slot copy, full KV pages by reference in every KV group, a
partly filled last page by a copy) and goes on decoding like any request.
"""

from __future__ import annotations

from shortconv.engine.request import Request, Status, fork_id
from shortconv.sampling.sampler import fork_seed


def make_forks(parent: Request) -> None:
    """Give `parent` its forks: requests of their own over the same prompt, each waiting for
    the parent's computed state (`source`) and its first token."""
    parent.forks = [
        Request(
            fork_id(parent.request_id, i),
            list(parent.prompt_token_ids),
            parent.params,
            fork_seed(parent.seed, i),
            index=i,
            parent=parent,
            source=parent,
            lora_slot=parent.lora_slot,
            lora_key=parent.lora_key,
            lora_name=parent.lora_name,
        )
        for i in range(parent.params.n)
    ]


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
