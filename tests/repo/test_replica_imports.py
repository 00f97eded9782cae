"""A replica whose engine runs in a core process imports no torch: not to start, not to serve.

torch's import was 4.9 s of the replica's start on the 2-core machine (docs/serving_path.md,
"Start-up"), and the replica computes nothing. The probe does, in a fresh interpreter and
without Ray, what `LLMServer.__init__` does (deployments/serve/server.py): the engine's
threads, the core process, the chat images, the loop, the OpenAI methods; then it serves a
chat, a structured one, and one whose grammar only the compiler refuses (the core compiles it:
xgrammar imports torch), and lists what of torch and transformers' torch-bound modules it
imported.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from probe import run_probe

PROBE = """
import asyncio, json, sys
from deployments.serve import server
from deployments.frontend.config.args import AppArgs
from deployments.frontend.engine.async_engine import AsyncEngine
from deployments.frontend.images.chat_images import ChatImages
from deployments.frontend.openai.api import ApiConfig, OpenAIReplica
from deployments.frontend.openai.errors import APIError
from deployments.frontend.openai.protocol import ChatCompletionRequest
from deployments.frontend.openai.replica import RequestContext
from workers.startup import PhaseClock

args = AppArgs(model=sys.argv[1], device="cpu", engine_process=sys.argv[2] == "core")
engine = server.start_engine(args, None, PhaseClock(), server.engine_threads(args))
images = ChatImages.for_engine(engine, args.images)
loop = AsyncEngine(engine, admission_limit=4)
loop.start()
replica = OpenAIReplica(loop, ApiConfig("m", "r0"), images)
MSGS = [{"role": "user", "content": "hi"}]


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}


async def main():
    out = {}
    ctx = RequestContext()
    plain = await replica.chat(ChatCompletionRequest(messages=MSGS, max_tokens=3), ctx)
    out["plain"] = plain.body["choices"][0]["finish_reason"]
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    req = ChatCompletionRequest(messages=MSGS, max_tokens=8, response_format=fmt(schema))
    out["json"] = (await replica.chat(req, ctx)).body["choices"][0]["message"]["content"]
    bad = fmt({"type": "string", "pattern": "(?<=a)b"})  # passes the edge, fails to compile
    req = ChatCompletionRequest(messages=MSGS, max_tokens=3, response_format=bad)
    try:
        await replica.chat(req, ctx)
    except APIError as exc:
        out["bad"] = [exc.status, exc.body()["error"]["param"]]
    return out


out = asyncio.run(main())
loop.shutdown()
heavy = ("torch", "xgrammar", "transformers.configuration_utils")
out["imported"] = [m for m in heavy if m in sys.modules]
print(json.dumps(out))
"""


def _serve(tmp_path: Path, where: str) -> dict[str, Any]:
    from shortconv.tiny.checkpoint import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint("lfm2", tmp_path / "lfm2", seed=1)
    env = {"SHORTCONV_CACHE": str(tmp_path / "cache")}
    got: dict[str, Any] = json.loads(run_probe(PROBE, str(ckpt), where, env=env).splitlines()[-1])
    assert got["plain"] in ("length", "stop")
    assert got["json"].startswith("{")  # constrained by the compiled grammar
    assert got["bad"] == [400, "response_format"]  # the compiler's refusal, a 400 either way
    return got


def test_replica_on_the_core_path_imports_no_torch(tmp_path: Path) -> None:
    got = _serve(tmp_path, "core")
    assert got["imported"] == [], f"the replica imported {got['imported']}"


def test_an_in_process_engine_still_refuses_a_bad_grammar_with_400(tmp_path: Path) -> None:
    """The engine in this process (tp_size > 1's path): `validate` compiles it, as before."""
    got = _serve(tmp_path, "thread")
    assert "torch" in got["imported"]  # the probe does see an import when there is one
