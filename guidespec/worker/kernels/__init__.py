"""CPU kernels built at first use: the C source is compiled with the system's C compiler into
the cache directory and called through ctypes (no torch headers, so it builds in a second).

``skinny_linear`` is the only kernel: see ``skinny_linear.c`` for why it exists. Without a
compiler, or with ``GUIDESPEC_CPU_KERNELS=0``, everything falls back to ``torch.nn.functional``.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

import torch
import torch.nn.functional as F

from guidespec import envs

logger = logging.getLogger(__name__)
MAX_SKINNY_ROWS = 16
_SOURCE = Path(__file__).with_name("skinny_linear.c")


@lru_cache(maxsize=1)
def _library() -> ctypes.CDLL | None:
    if not envs.cpu_kernels_enabled():
        return None
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        logger.warning("no C compiler found: using torch's linear layers for decoding")
        return None
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + compiler.encode() + os.uname().machine.encode()).hexdigest()[:16]
    target = envs.cache_dir() / "kernels" / f"skinny_linear-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}.so")
        cmd = [compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", str(_SOURCE), "-o", str(tmp)]
        result = subprocess.run(cmd, capture_output=True, text=True)
        if result.returncode != 0:
            logger.warning("building the CPU kernel failed, using torch: %s", result.stderr[-2000:])
            return None
        os.replace(tmp, target)
    lib = ctypes.CDLL(str(target))
    lib.skinny_linear_f32.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4
    lib.skinny_linear_f32.restype = None
    return lib


def available() -> bool:
    return _library() is not None


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` for 2-D x; few-row fp32 CPU products go to the skinny kernel."""
    lib = _library()
    if (lib is None or x.shape[0] > MAX_SKINNY_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
            or weight.dtype != torch.float32 or not weight.is_contiguous()):
        return F.linear(x, weight, bias)
    x = x.contiguous()
    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32)
    lib.skinny_linear_f32(x.data_ptr(), weight.data_ptr(), None if bias is None else bias.data_ptr(),
                          out.data_ptr(), x.shape[0], weight.shape[0], x.shape[1], torch.get_num_threads())
    return out
