"""Durable sessions: one state bundle file per session in a directory, with a TTL and a size cap.

A session's kept state is written here when the cache evicts it for memory and when the engine
shuts down; any engine started later on the same directory resumes the session from its file
on its next turn. A write is atomic (a temp file in the same directory, then a rename), so a
reader sees a whole old file or a whole new one, never half of one; whatever is wrong with a
file that is read anyway (another model, a flipped byte) is the bundle's checks' to refuse.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from shortconv.configs.session_store import SessionStoreConfig

_SUFFIX = ".state"


@dataclass(frozen=True)
class StoredFile:
    path: Path
    size: int
    mtime: float


class SessionStore:
    """The files of `cfg.path`; a session id maps to one file name (a digest: ids are the
    client's, so never a path)."""

    def __init__(self, cfg: SessionStoreConfig) -> None:
        self.cfg = cfg
        self.root = Path(cfg.path)
        self.root.mkdir(parents=True, exist_ok=True)
        self.prune()

    def file_of(self, session_id: str) -> Path:
        digest = hashlib.sha256(session_id.encode()).hexdigest()[:40]
        return self.root / f"{digest}{_SUFFIX}"

    def save(self, session_id: str, data: bytes) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".tmp-", suffix=_SUFFIX)
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, self.file_of(session_id))
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self.prune()

    def load(self, session_id: str) -> bytes | None:
        """The session's file (None: none, or expired, which is removed)."""
        path = self.file_of(session_id)
        try:
            if time.time() - path.stat().st_mtime > self.cfg.ttl_s:
                path.unlink(missing_ok=True)
                return None
            return path.read_bytes()
        except FileNotFoundError:
            return None

    def remove(self, session_id: str) -> None:
        self.file_of(session_id).unlink(missing_ok=True)

    def prune(self, now: float | None = None) -> int:
        """Remove expired files, then the oldest until the rest fit `max_bytes`; returns how
        many were removed."""
        now = time.time() if now is None else now
        files = sorted(self._files(), key=lambda f: f.mtime)
        removed = [f for f in files if now - f.mtime > self.cfg.ttl_s]
        kept = [f for f in files if f not in removed]
        total = sum(f.size for f in kept)
        for f in kept:
            if total <= self.cfg.max_bytes:
                break
            removed.append(f)
            total -= f.size
        for f in removed:
            f.path.unlink(missing_ok=True)
        return len(removed)

    def _files(self) -> list[StoredFile]:
        out = []
        for p in self.root.glob(f"*{_SUFFIX}"):
            if p.name.startswith(".tmp-"):
                continue
            try:
                st = p.stat()
            except FileNotFoundError:
                continue
            out.append(StoredFile(p, st.st_size, st.st_mtime))
        return out
