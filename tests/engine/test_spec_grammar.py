"""Speculative decoding under a grammar (json_schema, a forced tool call) is lossless: the same
engine with speculation off is the oracle, token for token, greedy.

The prompts repeat the document the grammar forces (a tool's call, an object's keys), so the
n-gram lookup proposes the grammar's own text: proposals are accepted where the grammar leaves
one choice and rejected where the model picks other characters. Every test asserts both
happened, or it would prove nothing."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import jsonschema
import pytest
from test_spec_decode import run as run_ids

from deployments.frontend.openai.tools import NamedToolChoice, ToolDef, plan_tools
from shortconv.configs.config import EngineConfig
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.outputs import RequestOutput
from shortconv.engine.plan import StepPlan
from shortconv.llm import build_engine
from shortconv.sampling.grammar import GrammarSpec
from shortconv.sampling.sampling_params import SamplingParams
from shortconv.tiny.checkpoint import make_tiny_checkpoint

xgr = pytest.importorskip("xgrammar")

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}
SHOWN = '{"city":"Paris","unit":"celsius","days":3} {"city":"Oslo","unit":"fahrenheit","days":2}'


def tool_grammar(choice: NamedToolChoice | Literal["required"]) -> tuple[GrammarSpec, dict]:
    """The grammar a chat request with `tools` and this `tool_choice` decodes under (the
    serving layer's own path), and the schema its output validates against."""
    tools = [ToolDef.model_validate(WEATHER)]
    plan = plan_tools(tools, choice, False, None)  # one call: bounded output
    assert plan is not None and plan.grammar is not None
    return plan.grammar, json.loads(plan.grammar.schema or "{}")


CASES = {
    "json_schema": (GrammarSpec.json_schema(SCHEMA), SCHEMA),
    "named_tool": tool_grammar(
        NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})
    ),
    "required_tool": tool_grammar("required"),
}


@pytest.fixture(scope="module", params=["lfm2", "zaya1"])
def ckpt(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param), seed=3)


def engine(ckpt: Path, spec: dict[str, object] | None) -> LLMEngine:
    cfg = EngineConfig(speculative_config=spec, kv_page_size=4)  # type: ignore[arg-type]
    return build_engine(ckpt, dtype="float32", engine_config=cfg)


def run(
    eng: LLMEngine, prompts: Sequence[str], params: Sequence[SamplingParams]
) -> tuple[list[RequestOutput], list[StepPlan]]:
    got = run_ids(eng, [eng.encode_prompt(t) for t in prompts], params)
    return got.outputs, got.plans  # type: ignore[return-value]


def assert_nothing_held(eng: LLMEngine) -> None:
    eng.flush_prefix_cache()
    stats = eng.stats()
    assert (stats.slots_used, stats.kv_pages_used) == (0, 0)
    assert not eng.scheduler.requests and eng.grammars.num_active == 0


def greedy(grammar: GrammarSpec, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=120, grammar=grammar, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("case", list(CASES))
def test_lossless_against_speculation_off(ckpt: Path, case: str) -> None:
    """Two constrained requests and a free one in one batch: token-identical to speculation
    off, documents that validate, proposals both accepted and rejected, verify rows that
    carried a mask per position, and nothing held after."""
    grammar, schema = CASES[case]
    prompts = [f"Answer like {SHOWN}: ", f"Again {SHOWN} {SHOWN}", "free text 1 2 1 2 1 2"]
    free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    params = [greedy(grammar), greedy(grammar), free]
    ref, _ = run(engine(ckpt, None), prompts, params)
    eng = engine(ckpt, SPEC)
    ours, plans = run(eng, prompts, params)
    for a, b in zip(ours, ref, strict=True):
        assert (a.token_ids, a.text, a.finish_reason) == (b.token_ids, b.text, b.finish_reason)
    for out in ours[:2]:
        assert out.finish_reason == "stop", out.text
        jsonschema.validate(json.loads(out.text), schema)
    s = eng.stats()
    assert 0 < s.spec_decode_num_accepted_tokens < s.spec_decode_num_draft_tokens
    verify = [c for p in plans for c in p.seqs if c.num_draft and c.samples[0][1].params.grammar]
    assert verify, "no constrained request speculated"
    assert all(r.token_mask for c in verify for _, r in c.samples)
    assert_nothing_held(eng)


def test_a_forbidden_proposal_is_cut_before_the_verify(ckpt: Path) -> None:
    """The prompt repeats text the grammar forbids (`{"x":`), so the lookup proposes it: no
    verify row ever carries a proposal the grammar refuses at its position."""
    grammar, schema = CASES["json_schema"]
    eng = engine(ckpt, SPEC)
    prompt = '{"x":1,"y":2} {"x":1,"y":2} {"'
    (out,), plans = run(eng, [prompt], [greedy(grammar)])
    jsonschema.validate(json.loads(out.text), schema)

    compiled = eng.grammars.cache.get(grammar)
    rows = [c for p in plans for c in p.seqs if c.num_draft]
    assert rows
    for c in rows:  # a fresh matcher per row: the output before it, then its proposals
        matcher = xgr.GrammarMatcher(compiled)
        before = c.start_pos - len(out.prompt_token_ids) + 1
        assert all(matcher.accept_token(t) for t in out.token_ids[:before])
        assert all(matcher.accept_token(t) for t in c.token_ids[1:]), c.token_ids
    assert_nothing_held(eng)


def test_an_abort_mid_verify_frees_its_matcher_and_spec_slots(ckpt: Path) -> None:
    """Aborted while a verify row of it is in flight: its tokens are dropped, its matcher
    goes at the next step, its slot, spec slots and pages come back, and the other request
    ends as it would alone."""
    grammar, _ = CASES["json_schema"]
    eng = engine(ckpt, SPEC)
    prompt = eng.encode_prompt(f"Answer like {SHOWN}: ")
    victim = eng.add_request(prompt, greedy(grammar))
    other = eng.add_request(prompt, greedy(grammar, seed=1))
    execute = eng.executor.execute
    aborted: list[str] = []

    def abort_inside(plan: StepPlan):  # noqa: ANN202 - the executor's StepResult
        if not aborted and any(c.num_draft and c.request_id == victim for c in plan.seqs):
            eng.abort_request(victim)
            aborted.append(victim)
        return execute(plan)

    eng.executor.execute = abort_inside  # type: ignore[method-assign]
    done: dict[str, RequestOutput] = {}
    while eng.has_unfinished():
        done.update({o.request_id: o for o in eng.step() if o.finished})
    eng.executor.execute = execute  # type: ignore[method-assign]
    assert aborted and set(done) == {other}
    (alone,), _ = run(engine(ckpt, SPEC), [f"Answer like {SHOWN}: "], [greedy(grammar, seed=1)])
    assert done[other].token_ids == alone.token_ids
    eng.step()  # an idle step: nothing left to prune, nothing scheduled
    assert_nothing_held(eng)
