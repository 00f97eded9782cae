"""Multi-LoRA through `serve run` (tiny LFM2, one replica, the engine in its core process).

The oracle is the offline engine with the same adapter (itself checked against transformers +
PEFT in tests/lora/): two adapters from the YAML's `lora_modules` and one loaded at run time
answer greedily exactly as it does, on completions, chat and Responses, and differently from
the base (so a server that ignored the adapter fails). Then: an unloaded name is a 404; no
prefix-cache hit crosses adapters while the same adapter hits; a session's next turn keeps its
adapter and resumes; every bad adapter is a 400 and the service keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from lora_adapters import make_adapter
from safetensors.torch import load_file, save_file
from serve_apps import openai_client, yaml_app

from shortconv import LLM, SamplingParams
from shortconv.lora.adapter import WEIGHTS_FILE

pytestmark = pytest.mark.timeout(900)

BASE = "tiny-lfm2-base"
MAX_TOKENS = 8
PROMPT = [5, 9, 13, 20, 33, 47, 61, 80]
LONG_PROMPT = [(7 * i) % 500 + 3 for i in range(100)]  # past one 64-token checkpoint
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
YAML_ADAPTERS = ("alpha", "beta")
RUNTIME = "gamma"


@dataclass
class Service:
    url: str
    client: openai.OpenAI
    http: httpx.Client
    oracle: LLM
    root: Path


@pytest.fixture(scope="module")
def svc(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("serve-lora")
    ckpt = make_tiny_checkpoint("lfm2", root / "base", seed=0)
    paths = {}
    for seed, name in enumerate((*YAML_ADAPTERS, RUNTIME), start=1):
        make_adapter("lfm2", root / name, seed=seed)
        paths[name] = str(root / name)
    lora = {"enable_lora": True, "max_loras": 4, "max_lora_rank": 8}
    yaml_modules = {n: paths[n] for n in YAML_ADAPTERS}
    oracle = LLM(ckpt, dtype="float32", lora_modules=paths, **lora)
    args = {
        "model": str(ckpt),
        "served_model_name": BASE,
        "dtype": "float32",
        "replica_num_cpus": 0.5,
        "lora_modules": yaml_modules,
        "runtime_lora_updating": True,
        **lora,
    }
    try:
        with yaml_app("lfm2", tmp_path_factory, **args) as url, httpx.Client(timeout=120) as http:
            yield Service(url, openai_client(url), http, oracle, root)
    finally:
        oracle.shutdown()


def _offline_tokens(svc: Service, prompt: list[int], name: str | None) -> list[int]:
    engine = svc.oracle.engine
    rid = engine.add_request(prompt, GREEDY, lora_name=name)
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished and out.request_id == rid:
                tokens = list(out.token_ids)
    return tokens


def _offline_pieces(svc: Service, prompt: list[int], name: str | None) -> list[str]:
    """The oracle's tokens as the server names them in logprobs (one decoded piece each)."""
    tok = svc.oracle.engine.tokenizer
    return [tok.decode([t], skip_special_tokens=False) for t in _offline_tokens(svc, prompt, name)]


def _offline_text(svc: Service, prompt: list[int], name: str | None) -> str:
    tok = svc.oracle.engine.tokenizer
    return tok.decode(_offline_tokens(svc, prompt, name), skip_special_tokens=True)


def _completion(svc: Service, model: str, prompt: list[int] = PROMPT, **kw: Any) -> Any:
    return svc.client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        logprobs=0,
        extra_body={"ignore_eos": True},
        **kw,
    )


def _pieces(svc: Service, model: str) -> list[str]:
    r = _completion(svc, model)
    assert r.model == model
    return list(r.choices[0].logprobs.tokens)


def _chat_prompt(svc: Service, messages: list[dict[str, str]]) -> list[int]:
    """The chat prompt's ids as the server renders it (rendering is not under test here)."""
    r = svc.http.post(f"{svc.url}/tokenize", json={"messages": messages})
    assert r.status_code == 200, r.text
    return list(r.json()["tokens"])


def _post(svc: Service, route: str, body: dict[str, Any]) -> httpx.Response:
    return svc.http.post(f"{svc.url}/v1/{route}", json=body)


def _load(svc: Service, name: str, path: Path | str) -> httpx.Response:
    return _post(svc, "load_lora_adapter", {"lora_name": name, "lora_path": str(path)})


def test_models_lists_base_and_yaml_adapters(svc: Service) -> None:
    data = svc.http.get(f"{svc.url}/v1/models").json()["data"]
    assert [m["id"] for m in data] == [BASE, *YAML_ADAPTERS]
    assert all(m["parent"] == BASE for m in data[1:])
    assert data[1]["root"] == str(svc.root / YAML_ADAPTERS[0])


def test_runtime_load_then_every_adapter_matches_offline(svc: Service) -> None:
    r = _load(svc, RUNTIME, svc.root / RUNTIME)
    assert r.status_code == 200, r.text
    base = _pieces(svc, BASE)
    assert base == _offline_pieces(svc, PROMPT, None)
    for name in (*YAML_ADAPTERS, RUNTIME):
        got = _pieces(svc, name)
        assert got == _offline_pieces(svc, PROMPT, name), name
        assert got != base, f"{name} answers as the base: the oracle would not bite"
    ids = [m["id"] for m in svc.http.get(f"{svc.url}/v1/models").json()["data"]]
    assert RUNTIME in ids


def test_chat_and_responses_honour_the_adapter(svc: Service) -> None:
    messages = [{"role": "user", "content": "Tell me a story."}]
    prompt = _chat_prompt(svc, messages)
    for name in (YAML_ADAPTERS[1], RUNTIME):
        want = _offline_text(svc, prompt, name)
        assert want != _offline_text(svc, prompt, None)
        chat = svc.client.chat.completions.create(
            model=name,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )
        assert chat.model == name and chat.choices[0].message.content == want
        resp = svc.client.responses.create(
            model=name,
            input="Tell me a story.",
            max_output_tokens=MAX_TOKENS,
            temperature=0.0,
            store=False,
            extra_body={"ignore_eos": True},
        )
        assert resp.model == name and resp.output_text == want


def _cached(r: Any) -> int:
    return int(r.usage.prompt_tokens_details.cached_tokens or 0)


def test_prefix_cache_is_per_adapter(svc: Service) -> None:
    first = _completion(svc, YAML_ADAPTERS[0], LONG_PROMPT)
    assert _cached(first) == 0
    assert _cached(_completion(svc, YAML_ADAPTERS[1], LONG_PROMPT)) == 0  # another adapter
    assert _cached(_completion(svc, BASE, LONG_PROMPT)) == 0  # nor the base
    again = _completion(svc, YAML_ADAPTERS[0], LONG_PROMPT)
    assert _cached(again) > 0  # the same adapter hits
    assert again.choices[0].logprobs.tokens == first.choices[0].logprobs.tokens


def test_session_keeps_its_adapter(svc: Service) -> None:
    session = {"x-session-id": "lora-session-1"}
    name = YAML_ADAPTERS[1]
    turn: list[dict[str, str]] = [{"role": "user", "content": "Remember me."}]

    def ask() -> Any:
        return svc.client.chat.completions.create(
            model=name,
            messages=turn,  # type: ignore[arg-type]
            max_tokens=MAX_TOKENS,
            temperature=0.0,
            extra_body={"ignore_eos": True},
            extra_headers=session,
        )

    first = ask()
    turn += [
        {"role": "assistant", "content": first.choices[0].message.content or ""},
        {"role": "user", "content": "And now?"},
    ]
    want = _offline_text(svc, _chat_prompt(svc, turn), name)
    second = ask()
    assert _cached(second) > 0
    assert second.choices[0].message.content == want


def test_unload_then_the_name_is_404(svc: Service) -> None:
    if RUNTIME not in [m.id for m in svc.client.models.list().data]:
        assert _load(svc, RUNTIME, svc.root / RUNTIME).status_code == 200
    r = _post(svc, "unload_lora_adapter", {"lora_name": RUNTIME})
    assert r.status_code == 200, r.text
    with pytest.raises(openai.NotFoundError) as err:
        _completion(svc, RUNTIME)
    assert err.value.code == "model_not_found"
    assert RUNTIME not in [m.id for m in svc.client.models.list().data]
    r = _post(svc, "unload_lora_adapter", {"lora_name": RUNTIME})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_unknown_model_is_404(svc: Service) -> None:
    with pytest.raises(openai.NotFoundError) as err:
        _completion(svc, "no-such-adapter")
    assert err.value.code == "model_not_found"


def _unknown_module(d: Path) -> None:
    tensors = load_file(str(d / WEIGHTS_FILE))
    renamed = {k.replace(".feed_forward.w1.", ".feed_forward.gate."): v for k, v in tensors.items()}
    save_file(renamed, str(d / WEIGHTS_FILE))


def _corrupt(d: Path) -> None:
    (d / WEIGHTS_FILE).write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not a header")


BAD: dict[str, tuple[dict[str, Any], Any, str]] = {
    # case: (make_adapter kwargs or None: no files, breaker, message part)
    "other_base": ({"overrides": {"hidden_size": 96}}, None, "in the adapter"),
    "rank_too_high": ({"rank": 16}, None, "rank 16 is above max_lora_rank 8"),
    "unknown_module": ({}, _unknown_module, "is not a projection"),
    "corrupt_files": ({}, _corrupt, "not a readable safetensors"),
    "missing_files": ({}, lambda d: None, "no adapter_config.json"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_adapter_is_400_and_service_keeps_serving(svc: Service, case: str) -> None:
    kwargs, breaker, message = BAD[case]
    d = svc.root / f"bad-{case}"
    if case == "missing_files":
        d.mkdir()
    else:
        make_adapter("lfm2", d, seed=9, **kwargs)
        if breaker is not None:
            breaker(d)
    r = _load(svc, case, d)
    assert r.status_code == 400, r.text
    assert message in r.json()["error"]["message"]
    assert case not in [m.id for m in svc.client.models.list().data]
    name = YAML_ADAPTERS[0]
    assert _pieces(svc, name) == _offline_pieces(svc, PROMPT, name)


def test_name_loaded_twice_is_400(svc: Service) -> None:
    name = YAML_ADAPTERS[0]
    r = _load(svc, name, svc.root / YAML_ADAPTERS[1])
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    assert _pieces(svc, name) == _offline_pieces(svc, PROMPT, name)  # still the first one
