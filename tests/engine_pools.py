"""What an engine holds, for tests that check a failure leaks nothing, and one request run
to its end."""

from __future__ import annotations

from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.outputs import RequestOutput
from shortconv.sampling.sampling_params import SamplingParams


def pools(eng: LLMEngine) -> tuple[int, tuple[int, ...], int, tuple[str, ...]]:
    """Slots, pages per KV group, checkpoints in the tree, and the sessions held."""
    cm = eng.scheduler.cache_manager
    pages = tuple(a.num_used for a in cm.kv.allocators)
    return cm.slots.num_used, pages, cm.tree.num_checkpoints, tuple(cm.sessions.session_ids())


def finish(
    eng: LLMEngine, prompt: list[int], params: SamplingParams, session: str | None
) -> RequestOutput:
    """Run one request to its end; its last output (an error included)."""
    rid = eng.add_request(prompt, params, session_id=session)
    while True:
        for out in eng.step():
            if out.request_id == rid and out.finished:
                return out
