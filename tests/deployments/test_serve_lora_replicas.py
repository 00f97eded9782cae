"""LoRA over 2 replicas through `serve run` (tiny LFM2): an adapter loaded at run time lives on
the replica that loaded it, and SessionAffinityRouter sends its requests there (the
`x-shortconv-replica` header names the answering replica); each answer equals the offline
engine with that adapter; `/v1/models` lists it whichever replica answers. Unloading goes to
the holder, after which the name is a 404 and no longer listed; unloading a YAML adapter
(on both replicas) leaves neither replica holding it."""

from __future__ import annotations

import time

import httpx
import pytest
from lora_adapters import make_adapter
from serve_apps import yaml_app

from shortconv import LLM, SamplingParams

pytestmark = pytest.mark.timeout(900)

REPLICA_HEADER = "x-shortconv-replica"
PROMPT = [5, 9, 13, 20, 33, 47, 61, 80]
MAX_TOKENS = 6


def _offline(oracle: LLM, prompt: list[int], params: SamplingParams) -> list[str]:
    """The offline engine's greedy tokens under gamma, as the server names them in logprobs."""
    rid = oracle.engine.add_request(prompt, params, lora_name="gamma")
    ids: list[int] = []
    while oracle.engine.has_unfinished():
        ids += [t for o in oracle.engine.step() if o.request_id == rid for t in o.new_token_ids]
    assert len(ids) == MAX_TOKENS
    return [oracle.engine.tokenizer.decode([t], skip_special_tokens=False) for t in ids]


def test_runtime_adapter_requests_go_to_its_replica(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("serve-lora-2")
    ckpt = make_tiny_checkpoint("lfm2", root / "base", seed=0)
    make_adapter("lfm2", root / "gamma", seed=3)
    make_adapter("lfm2", root / "alpha", seed=1)  # from the YAML: on both replicas
    lora = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    oracle = LLM(ckpt, dtype="float32", lora_modules={"gamma": str(root / "gamma")}, **lora)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    # NOTE: a prompt each, so no prefix key leads a request to the holder: only its adapter.
    prompts = [[*PROMPT, 100 + i] for i in range(6)]
    want = [_offline(oracle, p, params) for p in prompts]
    oracle.shutdown()
    args = {
        "model": str(ckpt),
        "served_model_name": "base",
        "dtype": "float32",
        "replica_num_cpus": 0.25,
        "min_replicas": 2,
        "max_replicas": 2,
        "runtime_lora_updating": True,
        "lora_modules": {"alpha": str(root / "alpha")},
        **lora,
    }
    body = {
        "model": "gamma",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "logprobs": 0,
        "ignore_eos": True,
    }
    with yaml_app("lfm2", tmp_path_factory, **args) as url, httpx.Client(timeout=120) as http:
        load = {"lora_name": "gamma", "lora_path": str(root / "gamma")}
        r = http.post(f"{url}/v1/load_lora_adapter", json=load)
        assert r.status_code == 200, r.text
        holder = r.headers[REPLICA_HEADER]
        listing = _models_from_another(http, url, holder)
        assert {"id": "gamma", "parent": "base"}.items() <= listing["gamma"].items()
        for prompt, tokens in zip(prompts, want, strict=True):
            r = http.post(f"{url}/v1/completions", json={**body, "prompt": prompt})
            assert r.status_code == 200, r.text
            assert r.headers[REPLICA_HEADER] == holder
            assert r.json()["choices"][0]["logprobs"]["tokens"] == tokens
        r = http.post(f"{url}/v1/completions", json={**body, "model": "base", "prompt": prompts[0]})
        assert r.json()["choices"][0]["logprobs"]["tokens"] != want[0]  # so the oracle bites
        r = http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "gamma"})
        assert r.status_code == 200 and r.headers[REPLICA_HEADER] == holder, r.text
        r = http.post(f"{url}/v1/completions", json={**body, "prompt": prompts[0]})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found", r.text
        assert "gamma" not in _models(http, url)[1]
        _unload_reaches_every_holder(http, url, body)


def _unload_reaches_every_holder(http: httpx.Client, url: str, body: dict) -> None:
    """alpha (the YAML's) is on both replicas: one unload leaves neither with it."""
    assert all("alpha" in cards for cards in _models_of_each(http, url).values())
    r = http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": "alpha"})
    assert r.status_code == 200, r.text
    assert not any("alpha" in cards for cards in _models_of_each(http, url).values())
    r = http.post(f"{url}/v1/completions", json={**body, "model": "alpha", "prompt": PROMPT})
    assert r.status_code == 404, r.text


def _models_of_each(http: httpx.Client, url: str) -> dict[str, dict[str, dict]]:
    """Each replica's `/v1/models` cards (random routing: 40 tries reach both, but 1e-12)."""
    seen: dict[str, dict[str, dict]] = {}
    for _ in range(40):
        replica, cards = _models(http, url)
        seen[replica] = cards
        if len(seen) == 2:
            return seen
    raise AssertionError(f"/v1/models reached only {sorted(seen)}")


def _models(http: httpx.Client, url: str) -> tuple[str, dict[str, dict]]:
    """The answering replica and its `/v1/models` cards by id."""
    r = http.get(f"{url}/v1/models")
    assert r.status_code == 200, r.text
    return r.headers[REPLICA_HEADER], {card["id"]: card for card in r.json()["data"]}


def _models_from_another(http: httpx.Client, url: str, holder: str) -> dict[str, dict]:
    """`/v1/models` as a replica other than `holder` answers it. The router picks between the
    two by their queue lengths, which it probes: on a loaded machine a late probe can leave it
    on the holder for a while (the full suite once saw 40 calls in a row there), so the tries
    are spread over up to 30 s."""
    for _ in range(120):
        replica, cards = _models(http, url)
        if replica != holder:
            return cards
        time.sleep(0.25)
    raise AssertionError("every /v1/models call went to the holder")
