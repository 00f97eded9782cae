"""A session's kept state in and out of the engine: export/import as a bundle, and the store.

Export reads every checkpoint the session pins (`cache.kept_state`) off the ranks and encodes
them (`cache.state_bundle`). Import checks the bundle against this engine before it takes
anything (version and checksum in `decode`; model fingerprint, dtype, TP layout, page size and
each checkpoint's page tables here), then reserves slots and pages, writes the tensors (shapes
checked before the first write) and pins tree entries over them for the session. Any refusal is
counted by reason and leaves nothing held: the session's next turn simply re-prefills, it is
never decoded from a refused bundle.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shortconv.cache import state_bundle
from shortconv.cache.kept_state import (
    HeldIds,
    adopt,
    give_back,
    kept_state,
    reserve,
    window_starts,
)
from shortconv.cache.manager import CacheManager
from shortconv.cache.state_bundle import BundleCheckpoint, BundleError, BundleLayout, StateBundle
from shortconv.engine.executor import BaseExecutor, ExecutorError
from shortconv.engine.model_fingerprint import model_fingerprint
from shortconv.engine.session_store import SessionStore

log = logging.getLogger(__name__)


@dataclass
class StateCounters:
    """Bundles by what happened to them, and their bytes (the metrics read these)."""

    events: Counter[str] = field(default_factory=Counter)  # exported imported spilled restored
    bytes: Counter[str] = field(default_factory=Counter)
    refused: Counter[str] = field(default_factory=Counter)  # by reason

    def count(self, event: str, nbytes: int) -> None:
        self.events[event] += 1
        self.bytes[event] += nbytes


class SessionState:
    """Export/import of sessions' kept state over one engine's cache manager and executor."""

    def __init__(
        self,
        cm: CacheManager,
        executor: BaseExecutor,
        model_dir: Path,
        dtype: str,
        store: SessionStore | None,
    ) -> None:
        self.cm, self.executor, self.store = cm, executor, store
        self._model_dir, self._dtype = Path(model_dir), dtype
        self.counters = StateCounters()
        if store is not None:
            cm.spill = self.spill  # NOTE: bound once: the cache calls it before a pinned eviction

    def layout(self) -> BundleLayout:
        """This engine's side of every match (the fingerprint is hashed on first use)."""
        fp = model_fingerprint(self._model_dir)
        return BundleLayout(fp, self._dtype, self.executor.tp_size, self.cm.page_size)

    def export(self, session_id: str) -> bytes | None:
        """The session's kept state as a bundle; None when it keeps none here (or this
        executor cannot read state: counted as refused, `tp`). ExecutorError (counted
        `executor`) when a rank dies or fails while its shard is read."""
        held = kept_state(self.cm, session_id)
        if held is None:
            return None
        try:
            tensors = self.executor.read_state(held.ids.slots, held.ids.pages)
        except NotImplementedError as exc:
            self._refuse("tp", str(exc))
            return None
        except ExecutorError as exc:  # nothing was taken: the session keeps its pins
            self._refuse("executor", str(exc))
            raise
        bundle = StateBundle(self.layout(), held.token_ids, held.checkpoints, tensors)
        data = state_bundle.encode(bundle)
        self.counters.count("exported", len(data))
        return data

    def import_(self, session_id: str, data: bytes) -> bool:
        """Take a bundle in as the session's kept state; False (counted, nothing held) when it
        does not fit this engine or there is no room. A rank that dies or fails while the
        bundle is written raises ExecutorError (counted `executor`, nothing held): the
        executor is failed then, and the session's next turn fails with the same error."""
        try:
            bundle = state_bundle.decode(data)
            self._check(bundle)
        except BundleError as exc:
            self._refuse(exc.reason, str(exc))
            return False
        ids = reserve(
            self.cm, len(bundle.checkpoints), _num_pages(bundle, 1 + len(self.cm.windows))
        )
        if ids is None:
            self._refuse("no_room", "no free slot or pages for the session's state")
            return False
        if not self._write(ids, bundle):
            return False
        if not adopt(self.cm, session_id, bundle.token_ids, bundle.checkpoints, ids):
            self._refuse("no_room", "the checkpoint could not be kept")
            return False
        self.counters.count("imported", len(data))
        return True

    def _write(self, ids: HeldIds, bundle: StateBundle) -> bool:
        """Write the bundle's tensors into the reserved `ids`, their one owner until `adopt`
        takes them: on a refusal (False) or any exception they all go back to the pools."""
        written = False
        try:
            self.executor.write_state(ids.slots, ids.pages, bundle.tensors)
            written = True
        except (ValueError, NotImplementedError) as exc:
            self._refuse("shape" if isinstance(exc, ValueError) else "tp", str(exc))
        except ExecutorError as exc:
            self._refuse("executor", str(exc))
            raise
        finally:
            if not written:
                give_back(self.cm, ids)
        return written

    def _check(self, bundle: StateBundle) -> None:
        ours, theirs = self.layout(), bundle.layout
        # NOTE: not tp_size: tensors travel unsharded (`execution.state_shards`), so a bundle
        # from any TP degree re-slices into this engine's ranks.
        for what in ("fingerprint", "dtype", "page_size"):
            a, b = getattr(theirs, what), getattr(ours, what)
            if a != b:
                raise BundleError(what, f"bundle {what} {a!r}, this engine {b!r}")
        if not bundle.checkpoints:
            raise BundleError("format", "a bundle holds at least one checkpoint")
        for c in bundle.checkpoints:
            self._check_checkpoint(c, bundle.num_tokens)

    def _check_checkpoint(self, c: BundleCheckpoint, num_tokens: int) -> None:
        """A checkpoint covers a prefix of the bundle's tokens, and its page tables are
        exactly the logical pages this engine's groups keep after that many tokens."""
        if not 0 < c.num_tokens <= num_tokens:
            raise BundleError("format", f"a checkpoint of {c.num_tokens}/{num_tokens} tokens")
        starts = window_starts(self.cm, c.num_tokens)
        need = -(-c.num_tokens // self.cm.page_size)
        lengths = tuple(len(p) for p in c.pages)
        negative = any(i < 0 for index in c.pages for i in index)
        if c.first_page != starts or lengths != tuple(need - s for s in starts) or negative:
            raise BundleError("format", f"KV page ranges {c.first_page} x {lengths} do not fit")

    def _refuse(self, reason: str, message: str) -> None:
        self.counters.refused[reason] += 1
        log.warning("session state refused (%s): %s", reason, message)

    # ---- the session store ------------------------------------------------------------
    def spill(self, session_id: str) -> None:
        """Save the session's kept state to the store (before an eviction, at shutdown).
        NOTE: best effort, and never raises: the cache calls it in the middle of an eviction.
        A spill that fails (a dead rank: counted `executor` by `export`, and the executor's
        next step reports it; the store's disk: counted `store`) costs only a re-prefill."""
        assert self.store is not None
        try:
            data = self.export(session_id)
            if data is not None:
                self.store.save(session_id, data)
                self.counters.count("spilled", len(data))
        except ExecutorError:
            return
        except OSError as exc:
            self._refuse("store", f"session {session_id!r} not saved: {exc}")

    def spill_all(self) -> None:
        if self.store is not None:
            for sid in self.cm.sessions.session_ids():
                self.spill(sid)

    def restore(self, session_id: str) -> bool:
        """Resume a session this engine does not hold from its file, if any; the file goes
        either way (a refused one is never read again; a taken one is rewritten on spill)."""
        if self.store is None or session_id in self.cm.sessions:
            return False
        data = self.store.load(session_id)
        if data is None:
            return False
        self.store.remove(session_id)
        try:
            ok = self.import_(session_id, data)
        except ExecutorError:
            return False  # counted by import_; the request's own step fails with the error
        if ok:
            self.counters.count("restored", len(data))
        return ok


def _num_pages(bundle: StateBundle, num_groups: int) -> list[int]:
    """Per KV group, the distinct pages the bundle's checkpoints read (a tensor of another
    length is then refused by its shape check)."""
    return [
        max((i + 1 for c in bundle.checkpoints for i in c.pages[g]), default=0)
        for g in range(num_groups)
    ]
