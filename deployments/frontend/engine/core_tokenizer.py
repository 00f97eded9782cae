"""The replica's tokenizer when its engine runs in a core process: loaded here, beside the
core's build, instead of pickled across the pipe in its `Ready` message.

Why: the LFM2-350M-shaped checkpoint's tokenizer (65k added tokens) pickles to 15 MB; the core
took 1.1 s to pickle it and the replica 1.7 s to unpickle it, both on the start's critical path
after the engine was built (docs/serving_path.md, "Start-up"). Loaded from the checkpoint here
(through the same tokenizer cache the core uses) it overlaps the core's imports and weights.

Only the real engine's tokenizer is `Tokenizer.load(model_dir)`: an injected engine factory's
may be anything, so with one the core still sends its own.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from deployments.frontend.config.args import AppArgs
from deployments.frontend.config.model_source import resolve_model


def core_sends_tokenizer(factory: str | None) -> bool:
    """Whether the core's `Ready` carries the tokenizer (bound once, on both sides)."""
    return factory is not None


def _load(args: AppArgs) -> Any:
    # NOTE: transformers' tokenizer classes, not torch, for the generic fast tokenizer our
    # checkpoints declare (shortconv/engine/tokenizer_backend.py); else AutoTokenizer, and torch.
    from shortconv.engine.tokenizer import Tokenizer

    return Tokenizer.load(resolve_model(args))


class TokenizerPreload:
    """Starts loading the checkpoint's tokenizer on a thread at once when `model` names a
    checkpoint (a tiny one is built by the core on its first start: not raced here)."""

    def __init__(self, args: AppArgs) -> None:
        self._args = args
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="tokenizer-preload")
        self._future: Future[Any] | None = None
        if args.model is not None:
            self._future = self._pool.submit(_load, args)

    def result(self) -> Any:
        """The tokenizer (after the core is ready: its model_dir exists by then)."""
        try:
            return self._future.result() if self._future else _load(self._args)
        finally:
            self._pool.shutdown(wait=False)
