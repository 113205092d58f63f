"""Compiled grammars shared between engines (``grammar_cache_dir``): a folder of their texts,
one file each, named by a hash of the grammar's cache key and of what else decides the compiled
grammar (the model's tokenizer, the backend and its version, the schema rewrites). Data-parallel
replicas on one machine (or on a shared filesystem) point their engines at one folder, so a
schema that N replicas see is compiled once: the compile process looks a job up here before it
compiles it, and writes what it compiled for the others. Engines that meet a grammar at the same
time compile it once too: the first claims it (a lock file made with ``O_EXCL``), the others
wait for its text (``wait``), and compile it themselves only when the claimant gave up (its lock
gone without a text: a failed compile, a killed process) or took longer than their own deadline.

A text is a backend's own serialized form (JSON for xgrammar, the grammar itself for
llguidance): nothing here is pickled. Files are written whole (a temporary file renamed into
place), so a reader never sees half of one; the folder keeps the most recently written
``max_entries`` and removes the oldest past that.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from importlib import metadata
from pathlib import Path


def fingerprint(model_dir: str, vocab_size: int, stop_token_ids: list[int], rewrites: bool) -> str:
    """What, besides the grammar, decides a compiled grammar: two engines with equal
    fingerprints compile a grammar to the same text."""
    versions = []
    for package in ("xgrammar", "llguidance"):
        try:
            versions.append(f"{package}={metadata.version(package)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{package}=none")
    parts = [str(Path(model_dir).resolve()), str(vocab_size), ",".join(map(str, stop_token_ids)), str(rewrites)]
    return "\0".join(parts + versions)


class GrammarStore:
    """``get``: a grammar's text if some engine compiled it; ``put``: share one compiled here."""

    SUFFIX = ".grammar"

    def __init__(
        self, folder: str | os.PathLike[str], fingerprint: str, max_entries: int = 4096, stale_claim_s: float = 600.0
    ) -> None:
        self.stale_claim_s = stale_claim_s
        self.folder = Path(folder)
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._fingerprint = fingerprint
        self.max_entries = max_entries

    def path(self, cache_key: str) -> Path:
        digest = hashlib.sha256(f"{self._fingerprint}\0{cache_key}".encode()).hexdigest()[:40]
        return self.folder / f"{digest}{self.SUFFIX}"

    def get(self, cache_key: str) -> str | None:
        try:
            return self.path(cache_key).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            return None

    def claim(self, cache_key: str) -> bool:
        """True: this engine compiles the grammar (``release`` it after its ``put``); False:
        another engine is compiling it now (``wait`` for its text)."""
        lock = self._lock(cache_key)
        try:
            os.close(os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
        except FileExistsError:
            try:  # a claim older than any compile may take: its owner died without releasing it
                if time.time() - lock.stat().st_mtime > self.stale_claim_s:
                    lock.unlink()
                    return self.claim(cache_key)
            except OSError:
                pass
            return False
        except OSError:
            return True  # (an unwritable folder: compile without claiming)

    def release(self, cache_key: str) -> None:
        try:
            self._lock(cache_key).unlink()
        except OSError:
            pass

    def wait(self, cache_key: str, timeout_s: float, poll_s: float = 0.02) -> str | None:
        """The text another engine is compiling, once it is written; None when its claim ends
        without one or ``timeout_s`` passes (then compile it here)."""
        deadline = time.monotonic() + timeout_s
        lock = self._lock(cache_key)
        while True:
            text = self.get(cache_key)
            if text is not None or not lock.exists() or time.monotonic() > deadline:
                return text if text is not None else self.get(cache_key)
            time.sleep(poll_s)

    def _lock(self, cache_key: str) -> Path:
        return self.path(cache_key).with_suffix(".compiling")

    def put(self, cache_key: str, text: str) -> None:
        """Share a compiled grammar (best effort: a full disk or a read-only folder only costs
        the other engines a compile)."""
        target = self.path(cache_key)
        try:
            fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".tmp-")
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, target)
        except OSError:
            return
        self._trim()

    def _trim(self) -> None:
        try:
            entries = [p for p in self.folder.iterdir() if p.suffix == self.SUFFIX]
        except OSError:
            return
        if len(entries) <= self.max_entries:
            return

        def mtime(p: Path) -> float:
            try:
                return p.stat().st_mtime
            except OSError:
                return 0.0

        for old in sorted(entries, key=mtime)[: len(entries) - self.max_entries]:
            try:
                old.unlink()
            except OSError:
                pass
