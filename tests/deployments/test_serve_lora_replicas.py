"""LoRA over 2 replicas through `serve run` (tiny LFM2): an adapter loaded at run time lives on
the replica that loaded it, and SessionAffinityRouter sends its requests there (the
`x-shortconv-replica` header names the answering replica); each answer equals the offline
engine with that adapter. Unloading goes to the holder, after which the name is a 404."""

from __future__ import annotations

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
