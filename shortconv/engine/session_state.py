"""A session's kept state in and out of the engine: export/import as a bundle, and the store.

Export reads the session's deepest pinned checkpoint (`cache.kept_state`) off the ranks and
encodes it (`cache.state_bundle`). Import checks the bundle against this engine before it takes
anything (version and checksum in `decode`; model fingerprint, dtype, TP layout, page size and
the windows' extent here), then reserves a slot and pages, writes the tensors (shapes checked
before the first write) and pins a tree entry over them for the session. Any refusal is
counted by reason and leaves nothing held: the session's next turn simply re-prefills, it is
never decoded from a refused bundle.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from shortconv.cache.kept_state import adopt, give_back, kept_state, reserve, window_starts
from shortconv.cache.manager import CacheManager
from shortconv.cache.state_bundle import BundleError, BundleLayout, StateBundle, decode, encode
from shortconv.engine.executor import BaseExecutor
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
        executor cannot read state: counted as refused, `tp`)."""
        held = kept_state(self.cm, session_id)
        if held is None:
            return None
        try:
            tensors = self.executor.read_state(held.slot, held.pages)
        except NotImplementedError as exc:
            self._refuse("tp", str(exc))
            return None
        data = encode(StateBundle(self.layout(), held.token_ids, held.first_page, tensors))
        self.counters.count("exported", len(data))
        return data

    def import_(self, session_id: str, data: bytes) -> bool:
        """Take a bundle in as the session's kept state; False (counted, nothing held) when it
        does not fit this engine or there is no room."""
        try:
            bundle = decode(data)
            self._check(bundle)
        except BundleError as exc:
            self._refuse(exc.reason, str(exc))
            return False
        held = reserve(self.cm, bundle.token_ids)
        if held is None:
            self._refuse("no_room", "no free slot or pages for the session's state")
            return False
        try:
            self.executor.write_state(held.slot, held.pages, bundle.tensors)
        except (ValueError, NotImplementedError) as exc:
            give_back(self.cm, held)
            self._refuse("shape" if isinstance(exc, ValueError) else "tp", str(exc))
            return False
        if not adopt(self.cm, session_id, held):
            self._refuse("no_room", "the checkpoint could not be kept")
            return False
        self.counters.count("imported", len(data))
        return True

    def _check(self, bundle: StateBundle) -> None:
        ours, theirs = self.layout(), bundle.layout
        for what in ("fingerprint", "dtype", "tp_size", "page_size"):
            a, b = getattr(theirs, what), getattr(ours, what)
            if a != b:
                # NOTE: re-slicing another TP degree's shards is a later stage: refused here.
                raise BundleError(what, f"bundle {what} {a!r}, this engine {b!r}")
        if not bundle.token_ids:
            raise BundleError("format", "a bundle covers at least one token")
        if bundle.first_page != window_starts(self.cm, bundle.num_tokens):
            raise BundleError("format", f"KV page ranges {bundle.first_page} do not fit")

    def _refuse(self, reason: str, message: str) -> None:
        self.counters.refused[reason] += 1
        log.warning("session state refused (%s): %s", reason, message)

    # ---- the session store ------------------------------------------------------------
    def spill(self, session_id: str) -> None:
        """Save the session's kept state to the store (before an eviction, at shutdown)."""
        assert self.store is not None
        data = self.export(session_id)
        if data is not None:
            self.store.save(session_id, data)
            self.counters.count("spilled", len(data))

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
        ok = self.import_(session_id, data)
        if ok:
            self.counters.count("restored", len(data))
        return ok
