"""`SamplingParams.n` > 1: n forks from one prefill (engine/forks.py, CacheManager.fork).

The parent computes the whole prompt once and its last position's logits row gives every fork
its first token; each fork then copies the state after the full prompt. Tiny random LFM2 (short
conv + full attention), ZAYA1 (CCA conv and previous-token state) and LFM3 (sliding windows of
8 tokens over 4-token pages, so a fork shares full pages, copies a partly filled one and drops
pages behind the window) checkpoints; greedy forks are checked against the transformers oracle
too.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from oracle import assert_matches_oracle, oracle_greedy

from shortconv.configs.config import EngineConfig
from shortconv.configs.hf.availability import transformers_lacks
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.outputs import RequestOutput
from shortconv.llm import build_engine
from shortconv.sampling.sampling_params import InvalidRequest, SamplingParams
from shortconv.tiny.checkpoint import build_hf_model

PAGE = 4
PROMPT = [11, 7, 300, 42, 5, 99, 123, 8, 17]  # 9 tokens: the forks copy a partly filled page
LONG = [*PROMPT, 64, 3, 250]  # 12 tokens: a page boundary, past LFM3's window (8 tokens)


class Model:
    def __init__(self, arch: str, tmp_dir) -> None:
        self.arch = arch
        self.hf = build_hf_model(arch, {}, seed=13)
        self.hf.save_pretrained(str(tmp_dir))
        self.path = tmp_dir

    def engine(self, **kw: object) -> LLMEngine:
        cfg = EngineConfig(**{"kv_page_size": PAGE, "max_num_seqs": 8, **kw})  # type: ignore[arg-type]
        return build_engine(self.path, dtype="float32", engine_config=cfg)


@pytest.fixture(scope="module", params=["lfm2", "lfm3", "zaya1"])
def model(request, tmp_path_factory) -> Model:
    if request.param == "lfm3" and (why := transformers_lacks("lfm3")) is not None:
        pytest.skip(why)
    return Model(request.param, tmp_path_factory.mktemp(request.param))


def run(
    eng: LLMEngine,
    prompt: list[int],
    params: SamplingParams,
    each_step: Callable[[], None] = lambda: None,
) -> list[RequestOutput]:
    """Every fork's final output, by index; the engine holds nothing of the request after.
    `each_step` runs after every step."""
    rid = eng.add_request(prompt, params)
    done: dict[int, RequestOutput] = {}
    while eng.has_unfinished():
        outs = eng.step()
        each_step()
        for out in outs:
            assert out.error is None, out.error
            assert out.request_id == rid
            if out.finished:
                done[out.index] = out
    assert sorted(done) == list(range(params.n))
    return [done[i] for i in range(params.n)]


def assert_idle(eng: LLMEngine) -> None:
    eng.flush_prefix_cache()
    stats = eng.stats()
    assert (stats.slots_used, stats.kv_pages_used) == (0, 0)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert not eng.scheduler.requests
    for group in eng.scheduler.cache_manager.windows:
        assert group.pages.num_used == 0


def greedy(n: int, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, n=n)


@pytest.mark.parametrize("length", [1, 4, 9, 12])
def test_greedy_forks_equal_the_single_output_and_the_oracle(model: Model, length: int) -> None:
    """One token, one full page, a partly filled page, and a page boundary past the window."""
    eng = model.engine(enable_prefix_caching=False)
    prompt = LONG[:length]
    forks = run(eng, prompt, greedy(4))
    (single,) = run(eng, prompt, greedy(1))
    assert [f.token_ids for f in forks] == [single.token_ids] * 4
    assert [f.index for f in forks] == [0, 1, 2, 3]
    assert_matches_oracle(forks[0].token_ids, oracle_greedy(model.hf, prompt, 8), model.arch)
    assert_idle(eng)


def test_seeded_forks_differ_and_reproduce(model: Model) -> None:
    eng = model.engine()
    params = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True, n=4)
    first = [f.token_ids for f in run(eng, PROMPT, params)]
    again = [f.token_ids for f in run(eng, PROMPT, params)]  # a prefix-cache hit this time
    assert first == again
    assert len({tuple(t) for t in first}) == 4
    one = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    assert run(eng, PROMPT, one)[0].token_ids == first[0]  # fork 0 keeps the request's seed
    assert_idle(eng)


def count_prompt_positions(eng: LLMEngine, prompt_len: int) -> list[int]:
    """Counts, in test code, the prompt positions every executed step computes."""
    counted = [0]
    execute = eng.executor.execute

    def counting(plan):  # noqa: ANN001, ANN202
        for chunk in plan.seqs:
            end = chunk.start_pos + chunk.num_tokens
            counted[0] += max(0, min(end, prompt_len) - chunk.start_pos)
        return execute(plan)

    eng.executor.execute = counting  # type: ignore[method-assign]
    return counted


def count_forward_tokens(eng: LLMEngine) -> list[int]:
    """Counts, in test code, the tokens the model's forward computes (every step's input)."""
    model = eng.executor.runner.model  # type: ignore[attr-defined]
    counted = [0]
    forward = model.forward

    def counting(input_ids, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        counted[0] += input_ids.numel()
        return forward(input_ids, *args, **kw)

    model.forward = counting
    return counted


def test_the_prompt_is_computed_once_for_eight_forks(model: Model) -> None:
    eng = model.engine(enable_prefix_caching=False)
    prompt = PROMPT * 3  # 27 tokens
    counted = count_prompt_positions(eng, len(prompt))
    forward = count_forward_tokens(eng)
    forks = run(eng, prompt, greedy(8, max_tokens=3))
    assert counted[0] == len(prompt)
    # The prompt once, then each fork's tokens 1 and 2 (token 0 came from the prompt's row).
    assert forward[0] == len(prompt) + 8 * 2
    assert eng.stats().prompt_tokens_total == len(prompt)
    assert eng.stats().generation_tokens_total == 8 * 3
    assert len({tuple(f.token_ids) for f in forks}) == 1
    assert_idle(eng)


def test_a_one_token_last_chunk_samples_the_forks_in_a_graph_replay(model: Model) -> None:
    """Chunked (4 tokens a step), the 9-token prompt ends with a one-token chunk resuming kept
    state: a decode-shaped step, replayed in a captured graph, whose one row gives all forks
    their first tokens."""
    kw = {"enable_graphs": True, "graph_batch_sizes": (1, 4), "graph_context_sizes": (16, 32)}
    eng = model.engine(enable_prefix_caching=False, max_num_batched_tokens=4, **kw)
    execute, replayed = eng.executor.execute, []

    def recording(plan):  # noqa: ANN001, ANN202
        result = execute(plan)
        if any(c.fork_rows for c in plan.seqs):
            replayed.append((plan.is_decode, result.used_graph, len(result.token_ids)))
        return result

    eng.executor.execute = recording  # type: ignore[method-assign]
    forks = run(eng, PROMPT, greedy(3))
    assert replayed == [(True, True, 3)]
    (single,) = run(eng, PROMPT, greedy(1))
    assert [f.token_ids for f in forks] == [single.token_ids] * 3
    assert_idle(eng)


def test_forks_wait_for_slots_and_pages(model: Model) -> None:
    """max_num_seqs below n: the forks that find no seat wait; few pages: forks are preempted
    and recomputed; all finish with the single request's output."""
    eng = model.engine(max_num_seqs=2, enable_prefix_caching=False)
    (single,) = run(eng, PROMPT, greedy(1))
    waited: list[int] = []  # forks seen waiting for a seat with their first token in hand

    def count_waiting() -> None:
        waiting = eng.scheduler.waiting
        waited.append(sum(r.parent is not None and len(r.output_token_ids) == 1 for r in waiting))

    forks = run(eng, PROMPT, greedy(5), count_waiting)
    assert max(waited) == 5 and 3 in waited  # all 5 sampled, then 3 wait while 2 decode
    assert [f.token_ids for f in forks] == [single.token_ids] * 5
    assert_idle(eng)
    tight = model.engine(max_num_seqs=4, num_kv_pages=13, enable_prefix_caching=False)
    preempt, preempted = tight.scheduler._preempt, []
    # (the fork, the tokens it had generated): it recomputes its prompt and those tokens.
    tight.scheduler._preempt = lambda req: (  # type: ignore[method-assign]
        preempted.append((req, len(req.output_token_ids))),
        preempt(req),
    )
    forks = run(tight, PROMPT, greedy(4, max_tokens=12))
    assert preempted and all(r.parent is not None for r, _ in preempted)
    assert any(generated > 1 for _, generated in preempted)
    (single,) = run(tight, PROMPT, greedy(1, max_tokens=12))
    assert [f.token_ids for f in forks] == [single.token_ids] * 4
    assert_idle(tight)


@pytest.mark.parametrize("steps", [1, 2, 4])
def test_abort_frees_every_fork(model: Model, steps: int) -> None:
    """Aborted while the parent prefills, while forks wait for a seat, and mid-decode."""
    eng = model.engine(max_num_seqs=2, max_num_batched_tokens=4)
    rid = eng.add_request(PROMPT, greedy(4, max_tokens=20))
    other = eng.add_request(PROMPT[:5], greedy(1, max_tokens=20))
    for _ in range(steps):
        eng.step()
    out = eng.abort_request(rid)
    assert out is not None and out.finish_reason == "abort" and out.request_id == rid
    while eng.has_unfinished():
        assert all(o.request_id == other for o in eng.step())
    assert_idle(eng)


def test_abort_mid_decode_frees_every_fork(model: Model) -> None:
    """Three forks decode (a few tokens each) and one waits for a seat when the request is
    aborted: every fork ends, every slot and page (the parent's too) comes back."""
    eng = model.engine(max_num_seqs=3)
    rid = eng.add_request(LONG, greedy(4, max_tokens=20))
    forks = eng.scheduler.requests[rid].forks
    while max(len(f.output_token_ids) for f in forks) < 4:
        assert all(o.error is None and not o.finished for o in eng.step())
    assert sum(f.slot is not None for f in forks) == 3
    out = eng.abort_request(rid)
    assert out is not None and out.finish_reason == "abort"
    assert all(f.finish_reason == "abort" for f in forks)
    assert not eng.has_unfinished() and eng.step() == []
    assert_idle(eng)


def test_n_above_the_maximum_is_refused_naming_n(model: Model) -> None:
    eng = model.engine(max_n=3)
    with pytest.raises(InvalidRequest) as err:
        eng.add_request(PROMPT, greedy(4))
    assert err.value.param == "n"
    with pytest.raises(InvalidRequest) as err:
        SamplingParams(n=0)
    assert err.value.param == "n"
    assert_idle(eng)
