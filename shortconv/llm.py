"""Offline, vLLM-shaped API: `LLM(model=...).generate(...)`, and the engine factory.

NOTE: this facade picks the executor and hands it to the engine. tp_size=1 runs the runner in
this process (shortconv/execution/local_executor.py, nothing above shortconv/); only tp_size > 1
names `workers/` (its Ray actors), inside `build_executor`, so tp_size=1 runs where Ray is not
installed and the engine never depends on the layers above it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from shortconv.configs.config import EngineConfig
from shortconv.engine.executor import BaseExecutor
from shortconv.engine.images import AnyImage
from shortconv.engine.llm_engine import LLMEngine
from shortconv.engine.outputs import RequestOutput
from shortconv.engine.tokenizer import Tokenizer
from shortconv.execution.worker_spec import WorkerSpec, plan_worker_spec
from shortconv.sampling.sampling_params import SamplingParams


def build_executor(spec: WorkerSpec, tp_size: int = 1, **ray_options: object) -> BaseExecutor:
    """LocalExecutor for tp_size=1 (no Ray), else a RayExecutor with `ray_options`."""
    if tp_size == 1:
        from shortconv.execution.local_executor import LocalExecutor

        return LocalExecutor(spec)
    from workers.ray_executor import RayExecutor

    return RayExecutor(spec, tp_size, **ray_options)  # type: ignore[arg-type]


def build_engine(
    model: str | Path,
    tp_size: int = 1,
    dtype: str = "auto",
    device: str | torch.device = "cpu",
    seed: int = 0,
    engine_config: EngineConfig | None = None,
    executor_options: Mapping[str, object] | None = None,
) -> LLMEngine:
    """Plan the worker spec, start its executor (`executor_options`: RayExecutor's, with
    tp_size > 1), and give both to a new engine.

    NOTE: the tokenizer loads on a thread of its own meanwhile. It is Python (seconds for a
    vocabulary of many added tokens: transformers deep-copies them), the weights' copy and the
    kernels' build are not, so on a 2-core machine the two overlap instead of adding up."""
    with ThreadPoolExecutor(1, thread_name_prefix="tokenizer-load") as pool:
        tokenizer = pool.submit(Tokenizer.load, Path(model))
        spec = plan_worker_spec(model, engine_config, dtype, device, tp_size)
        executor = build_executor(spec, tp_size, **(executor_options or {}))
        return LLMEngine(spec, executor, seed=seed, tokenizer=tokenizer)


class LLM:
    """Run batches of prompts to completion with continuous batching.

    >>> llm = LLM(model="ckpt_dir", tp_size=1, dtype="float32", device="cpu", seed=0)
    >>> outs = llm.generate(prompt_token_ids=[[5, 9, 13]], sampling_params=SamplingParams())
    """

    def __init__(
        self,
        model: str | Path,
        tp_size: int = 1,
        dtype: str = "auto",
        device: str = "cpu",
        seed: int = 0,
        **engine_kwargs: object,
    ) -> None:
        self.engine = build_engine(
            model,
            tp_size=tp_size,
            dtype=dtype,
            device=device,
            seed=seed,
            engine_config=_engine_config(engine_kwargs),
        )

    @property
    def tokenizer(self):  # noqa: ANN201 - Tokenizer | None
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        prompt_token_ids: Sequence[Sequence[int]] | None = None,
        images: Sequence[Sequence[AnyImage]] | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt; returns outputs in input order (a prompt whose params
        have `n` > 1: its n outputs, by `index`, in its place). `images[i]` are prompt i's
        images (a vision model's), filling its image placeholder tokens in order.

        Every request is validated before any is queued, so one bad prompt changes nothing.
        """
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("pass exactly one of prompts= or prompt_token_ids=")
        if prompts is not None:
            texts = [prompts] if isinstance(prompts, str) else list(prompts)
            token_lists = [self.engine.encode_prompt(p) for p in texts]
        else:
            token_lists = [list(p) for p in prompt_token_ids]  # type: ignore[union-attr]
        params = _broadcast(sampling_params, len(token_lists))
        per_prompt = [list(i) for i in images] if images is not None else [[]] * len(token_lists)
        if len(per_prompt) != len(token_lists):
            raise ValueError(f"got images for {len(per_prompt)} prompts, not {len(token_lists)}")
        for toks, p, imgs in zip(token_lists, params, per_prompt, strict=True):
            self.engine.validate(toks, p)
            self.engine.place_images(toks, imgs, p.n)
        ids = [
            self.engine.add_request(t, p, images=i)
            for t, p, i in zip(token_lists, params, per_prompt, strict=True)
        ]
        keys = [(rid, i) for rid, p in zip(ids, params, strict=True) for i in range(p.n)]
        done: dict[tuple[str, int], RequestOutput] = {}
        try:
            while len(done) < len(keys):
                for out in self.engine.step():
                    if out.finished:
                        done[(out.request_id, out.index)] = out
                if not self.engine.has_unfinished() and len(done) < len(keys):
                    break
        except BaseException:
            for rid in ids:
                if any((rid, i) not in done for rid2, i in keys if rid2 == rid):
                    self.engine.abort_request(rid)
            raise
        errors = [o.error for o in done.values() if o.error]
        if errors:
            raise RuntimeError(f"generation failed: {errors[0]}")
        return [done[key] for key in keys]

    def shutdown(self) -> None:
        self.engine.shutdown()


def _engine_config(kwargs: dict[str, object]) -> EngineConfig:
    known = set(EngineConfig.__dataclass_fields__)
    unknown = sorted(set(kwargs) - known)
    if unknown:
        raise ValueError(f"unknown LLM option(s) {unknown}; engine options are {sorted(known)}")
    return EngineConfig(**kwargs)  # type: ignore[arg-type]


def _broadcast(
    sp: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sp is None:
        return [SamplingParams()] * n
    if isinstance(sp, SamplingParams):
        return [sp] * n
    if len(sp) != n:
        raise ValueError(f"got {len(sp)} sampling_params for {n} prompts")
    return list(sp)
