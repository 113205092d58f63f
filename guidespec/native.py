"""C sources built at first use into cached shared libraries (the CPU kernels, ``cuda_ext``'s
host library), loaded with ctypes: no torch headers; a build's sources compile side by side.

A library is cached under ``<cache dir>/native`` by a hash of its sources, the compiler, the
flags, the machine and its CPU's features (``-march=native`` output must not reach another
CPU through a shared cache); a build writes a temporary file and renames it, so concurrent
processes never load half a library.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from guidespec import envs

logger = logging.getLogger(__name__)


def compiler() -> str | None:
    return shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")


def build_shared(name: str, sources: list[Path], headers: list[Path], flags: list[str], libs: list[str]) -> Path | None:
    """``sources`` compiled and linked into ``lib<name>-<key>.so``; None (with a warning) where
    there is no C compiler or the build fails."""
    cc = compiler()
    if cc is None:
        logger.warning("no C compiler found: %s is not built", name)
        return None
    all_flags = [*flags, "-shared", "-fPIC"]
    text = b"".join(path.read_bytes() for path in sources + headers)
    key = hashlib.sha256(
        b"\0".join([text, cc.encode(), " ".join(all_flags + libs).encode(), os.uname().machine.encode(), cpu_flags()])
    ).hexdigest()[:16]
    target = envs.cache_dir() / "native" / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}.so")
        error = _compile_and_link(cc, sources, all_flags, libs, tmp)
        if error is not None:
            logger.warning("building %s failed: %s", name, error[-2000:])
            return None
        os.replace(tmp, target)
    return target


def _compile_and_link(cc: str, sources: list[Path], flags: list[str], libs: list[str], out: Path) -> str | None:
    """Each source compiled in a compiler of its own, all at once (the CPU kernels' two largest
    files take 18 s and 9 s at -O3: a first build on two cores is the larger one's), then linked
    into ``out``; the compiler's message where a step fails."""
    with tempfile.TemporaryDirectory(dir=out.parent) as folder:
        objects = [Path(folder) / f"{i}-{source.stem}.o" for i, source in enumerate(sources)]
        compiles = [
            subprocess.Popen(
                [cc, *flags, "-c", str(source), "-o", str(obj)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            for source, obj in zip(sources, objects)
        ]
        messages = [proc.communicate()[1] for proc in compiles]
        failed = [msg or f"{cc}: exit {proc.returncode}" for proc, msg in zip(compiles, messages) if proc.returncode]
        if failed:
            return "\n".join(failed)
        result = subprocess.run([cc, *flags, *map(str, objects), "-o", str(out), *libs], capture_output=True, text=True)
        return result.stderr if result.returncode != 0 else None


def cpu_flags() -> bytes:
    """The CPU's feature flags as Linux reports them (empty where it does not)."""
    try:
        with open("/proc/cpuinfo", "rb") as f:
            return next((line for line in f if line.startswith((b"flags", b"Features"))), b"")
    except OSError:
        return b""
