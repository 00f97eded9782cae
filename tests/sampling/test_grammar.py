"""Grammar-constrained decoding in the engine (no Ray): the schema subset, the sampler's mask,
and the tiny random model, whose output only the grammar can make valid."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import random
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import pytest
import torch
from grammar_schemas import INVALID, SCHEMAS, UNSUPPORTED

from shortconv import LLM, SamplingParams
from shortconv.engine.outputs import RequestOutput
from shortconv.engine.plan import StepPlan
from shortconv.sampling.grammar import GrammarError, GrammarSpec
from shortconv.sampling.grammar.schema_check import find_unsupported
from shortconv.sampling.grammar.token_mask import apply_token_masks, unpack_bitmask
from shortconv.sampling.sampler import Sampler, SamplingRow
from shortconv.tiny.checkpoint import make_tiny_checkpoint

xgr = pytest.importorskip("xgrammar")
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
ROOT = Path(__file__).resolve().parents[2]


def valid(text: str, schema: dict) -> object:
    value = json.loads(text)  # strict: raw control characters are refused, as clients do
    jsonschema.validate(value, schema, format_checker=FORMATS)
    return value


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint("lfm2", tmp_path_factory.mktemp("grammar"), seed=0)


@pytest.fixture(scope="module")
def llm(ckpt: Path) -> Iterator[LLM]:
    llm = LLM(model=ckpt, dtype="float32", seed=0, max_num_seqs=32)
    yield llm
    llm.shutdown()


# ---- the grammar alone: random walks through the matcher ------------------------------------
@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_path_through_the_grammar_is_valid(llm: LLM, name: str) -> None:
    """Any token sequence the masks allow ends in a document the schema accepts: 20 random
    walks, each picking uniformly among the allowed tokens until the grammar terminates."""
    schema = SCHEMAS[name]
    compiled = llm.engine.grammars.cache.get(GrammarSpec.json_schema(schema))
    vocab = llm.engine.model_cfg.vocab_size
    for seed in range(20):
        matcher, mask, rng, ids = xgr.GrammarMatcher(compiled), None, random.Random(seed), []
        mask = xgr.allocate_token_bitmask(1, vocab)
        while not matcher.is_terminated():
            matcher.fill_next_token_bitmask(mask)
            allowed = unpack_bitmask(mask, vocab)[0].nonzero().flatten().tolist()
            tok = rng.choice(allowed)
            assert matcher.accept_token(tok)
            ids.append(tok)
            assert len(ids) < 400, "a bounded schema must end"
        assert ids[-1] in llm.engine.scheduler.cfg.eos_token_ids
        valid(llm.tokenizer.decode(ids[:-1]), schema)


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_keywords_the_grammar_would_ignore_are_refused(llm: LLM, name: str) -> None:
    schema, where = UNSUPPORTED[name]
    bad = find_unsupported(schema)
    assert bad is not None and bad[0] == where
    with pytest.raises(GrammarError, match=where.split(".")[-1]):
        llm.engine.validate([5], SamplingParams(grammar=GrammarSpec.json_schema(schema)))


def test_uncompilable_schema_is_refused_before_queueing(llm: LLM) -> None:
    spec = GrammarSpec.json_schema({"type": "string", "pattern": "(?<=a)b"})
    with pytest.raises(GrammarError, match="cannot be compiled"):
        llm.engine.validate([5], SamplingParams(grammar=spec))
    assert not llm.engine.has_unfinished()


def test_compiled_grammars_are_cached_per_schema(llm: LLM) -> None:
    cache = llm.engine.grammars.cache
    spec = GrammarSpec.json_schema({"type": "boolean", "title": "cached"})
    hits, misses = cache.hits, cache.misses
    first, again = (
        cache.get(spec),
        cache.get(GrammarSpec.json_schema({"type": "boolean", "title": "cached"})),
    )
    assert first is again and (cache.hits, cache.misses) == (hits + 1, misses + 1)


# ---- the sampler ------------------------------------------------------------------------------
def test_the_mask_applies_to_its_rows_only() -> None:
    torch.manual_seed(0)
    vocab = 70  # not a multiple of 32: the mask's last word is partial
    logits = torch.randn(3, vocab)
    words = torch.zeros(3, dtype=torch.int32)
    words[0] = 1 << 5
    words[2] = 1 << 1  # token 65
    words[1] = -(1 << 31)  # token 63: bit 31 is the sign bit of an int32 word
    greedy = SamplingParams(temperature=0.0, logprobs=0)
    rows = [
        SamplingRow(greedy, 0, 0),
        SamplingRow(greedy, 0, 0, token_mask=words.numpy().tobytes()),
        SamplingRow(SamplingParams(temperature=1.0, seed=3), 3, 0),
    ]
    out = Sampler()(logits, rows)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[1] in (5, 63, 65)
    assert out.logprobs[1] == pytest.approx(float(logits[1].log_softmax(-1)[out.token_ids[1]]))
    alone = Sampler()(logits[2:], rows[2:])
    assert out.token_ids[2] == alone.token_ids[0]  # an unmasked sampled row is untouched
    masked = apply_token_masks(logits, [None, words.numpy().tobytes(), None])
    assert torch.isinf(masked[1]).sum() == vocab - 3 and torch.equal(masked[0], logits[0])


# ---- the engine on the tiny random model -----------------------------------------------------
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_model_output_validates_for_every_schema(llm: LLM, temperature: float) -> None:
    """All schemas in one batch (mixed grammars), greedy and sampled."""
    names = list(SCHEMAS)
    params = [
        SamplingParams(
            temperature=temperature,
            seed=i,
            max_tokens=200,
            grammar=GrammarSpec.json_schema(SCHEMAS[n]),
        )
        for i, n in enumerate(names)
    ]
    outs = llm.generate(prompts=[f"prompt {n}" for n in names], sampling_params=params)
    for name, out in zip(names, outs, strict=True):
        assert out.finish_reason == "stop", (name, out.text)
        valid(out.text, SCHEMAS[name])
    assert llm.engine.grammars.num_active == 0


def test_constrained_and_unconstrained_rows_mix_in_one_batch(llm: LLM) -> None:
    free = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    alone = llm.generate(prompts=["free one", "free two"], sampling_params=free)
    obj = SamplingParams(temperature=0.7, seed=5, max_tokens=300, grammar=GrammarSpec.json_object())
    mixed = llm.generate(
        prompts=["free one", "json please", "free two"], sampling_params=[free, obj, free]
    )
    assert [o.token_ids for o in (mixed[0], mixed[2])] == [o.token_ids for o in alone]
    assert isinstance(json.loads(mixed[1].text), dict)


def test_each_fork_follows_the_grammar_with_a_matcher_of_its_own(llm: LLM) -> None:
    """n=3 under a json_schema: the forks' first tokens are drawn from one logits row, each
    under its own mask; they then diverge (seeded), so one shared matcher would refuse a
    token. Every choice parses and validates."""
    schema = SCHEMAS["array-of-objects"]
    spec = GrammarSpec.json_schema(schema)
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=300, n=3, grammar=spec)
    outs = llm.generate(prompts=["three answers"], sampling_params=params)
    assert [o.index for o in outs] == [0, 1, 2]
    for out in outs:
        assert out.error is None and out.finish_reason == "stop", out.text
        valid(out.text, schema)
    assert len({o.text for o in outs}) == 3
    assert llm.engine.grammars.num_active == 0


def test_a_complete_grammar_ends_the_request_even_with_ignore_eos(llm: LLM) -> None:
    spec = GrammarSpec.json_schema(SCHEMAS["booleans"])
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True, grammar=spec)
    (out,) = llm.generate(prompts=["x"], sampling_params=params)
    assert out.finish_reason == "stop" and len(out.token_ids) < 40
    valid(out.text, SCHEMAS["booleans"])


def _run(llm: LLM, params: list[SamplingParams]) -> list:
    eng = llm.engine
    ids = [eng.add_request([5, 6, 7], p) for p in params]
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
    return [done[i] for i in ids]


@pytest.fixture(params=["no-allowed-token", "token-refused"])
def grammar_fault(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Every matcher allows no next token, or refuses every token it is given."""
    if request.param == "no-allowed-token":
        monkeypatch.setattr(
            xgr.GrammarMatcher, "fill_next_token_bitmask", lambda self, m, i=0: m[i].zero_()
        )
    else:
        monkeypatch.setattr(xgr.GrammarMatcher, "accept_token", lambda self, t: False)
    return request.param


def assert_nothing_held(llm: LLM) -> None:
    stats = llm.engine.stats()
    # NOTE: a prefix cache (when the engine has one) keeps what finished requests leave; all
    # the rest must be free.
    cached = getattr(stats, "prefix_cache_checkpoints", 0), getattr(stats, "prefix_cache_pages", 0)
    assert (stats.slots_used - cached[0], stats.kv_pages_used - cached[1]) == (0, 0)
    assert not llm.engine.scheduler.requests and llm.engine.grammars.num_active == 0


def test_a_grammar_that_cannot_go_on_fails_its_request_alone(llm: LLM, grammar_fault: str) -> None:
    """Ends with a clear error, never a hang; slot and pages come back; the rest goes on."""
    spec = GrammarSpec.json_schema(SCHEMAS["enum"])
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    bad, ok = _run(llm, [SamplingParams(max_tokens=50, grammar=spec), free])
    assert bad.finish_reason == "error" and "grammar" in (bad.error or "")
    assert ok.finish_reason == "length" and len(ok.token_ids) == 6
    assert_nothing_held(llm)


def test_a_grammar_that_cannot_go_on_fails_every_fork(llm: LLM, grammar_fault: str) -> None:
    """n=2: no first token allowed (the parent's chunk is dropped) or each fork's first token
    refused (each fork fails on its own): both forks end with an error, their parent's slot and
    pages come back, and the other request goes on."""
    spec = GrammarSpec.json_schema(SCHEMAS["enum"])
    eng = llm.engine
    bad = eng.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=50, n=2, grammar=spec))
    ok = eng.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    done: dict[tuple[str, int], RequestOutput] = {}
    while eng.has_unfinished():
        done.update({(o.request_id, o.index): o for o in eng.step() if o.finished})
    assert set(done) == {(bad, 0), (bad, 1), (ok, 0)}
    for i in range(2):
        assert done[bad, i].finish_reason == "error" and "grammar" in (done[bad, i].error or "")
    assert done[ok, 0].finish_reason == "length"
    assert_nothing_held(llm)


def test_the_engine_runs_without_xgrammar_when_no_grammar_is_asked(ckpt: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys
        sys.modules["xgrammar"] = None  # import xgrammar now raises ImportError
        from shortconv import LLM, SamplingParams
        from shortconv.sampling.grammar import GrammarError, GrammarSpec
        llm = LLM(model={str(ckpt)!r}, dtype="float32")
        short = SamplingParams(max_tokens=3)
        (out,) = llm.generate(prompt_token_ids=[[5, 6]], sampling_params=short)
        assert len(out.token_ids) == 3
        json_object = SamplingParams(grammar=GrammarSpec.json_object())
        try:
            llm.generate(prompt_token_ids=[[5]], sampling_params=json_object)
        except GrammarError as exc:
            assert "xgrammar" in str(exc)
        else:
            raise AssertionError("a grammar without xgrammar must be refused")
        print("ok")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT, env=env
    )
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


def test_invalid_schemas_listed_are_really_invalid() -> None:
    for schema, _ in INVALID.values():
        with pytest.raises(jsonschema.SchemaError):
            jsonschema.Draft202012Validator.check_schema(schema)


def test_the_plan_with_its_masks_pickles_small(llm: LLM) -> None:
    """The plan crosses Ray to the TP ranks: each constrained row carries its own mask bytes
    (ceil(V/32) int32 words), not a view of the whole batch's bitmask."""
    eng = llm.engine
    spec = GrammarSpec.json_schema(SCHEMAS["enum"])
    rids = [
        eng.add_request([5, 6, 7], SamplingParams(max_tokens=4, grammar=spec)) for _ in range(8)
    ]
    free = eng.add_request([5, 6], SamplingParams(max_tokens=4))
    try:
        plan = eng.scheduler.schedule()  # the masks are made as the rows are planned
        assert plan is not None and not eng.scheduler.take_failed()
        bare = len(pickle.dumps(unmasked(plan)))
        back = pickle.loads(pickle.dumps(plan))
        width = 4 * -(-eng.model_cfg.vocab_size // 32)
        rows = {c.request_id: c.sampling for c in back.seqs}
        assert all(len(rows[r].token_mask) == width for r in rids)
        assert rows[free].token_mask is None
        # Each mask once (a view of the batch's bitmask would carry all 8 in every row).
        assert len(pickle.dumps(plan)) - bare < 2 * 8 * width
    finally:
        for rid in [*rids, free]:
            eng.abort_request(rid)


def unmasked(plan: StepPlan) -> StepPlan:
    """`plan` with no row's mask (its size without them)."""
    seqs = tuple(
        dataclasses.replace(c, sampling=dataclasses.replace(c.sampling, token_mask=None))
        if c.sampling is not None
        else c
        for c in plan.seqs
    )
    return dataclasses.replace(plan, seqs=seqs)


def test_a_model_vocab_wider_than_the_tokenizer_never_allows_the_extra_ids(llm: LLM) -> None:
    from shortconv.sampling.grammar.compiler import GrammarCache

    tok_size = len(llm.tokenizer.hf)
    cache = GrammarCache(llm.tokenizer.hf, tok_size + 70, [2])
    matcher = xgr.GrammarMatcher(cache.get(GrammarSpec.json_schema(SCHEMAS["string-lengths"])))
    mask = xgr.allocate_token_bitmask(1, tok_size + 70)
    for _ in range(3):  # inside the string, where almost every token is allowed
        matcher.fill_next_token_bitmask(mask)
        allowed = unpack_bitmask(mask, tok_size + 70)[0]
        assert allowed[:tok_size].any() and not allowed[tok_size:].any()
        assert matcher.accept_token(int(allowed.nonzero()[-1]))
