"""``cuda_ext``: our C library for the draft/mask hand-off between rank 0 and the scheduler.

- ``draft_channel.c`` (plain C, built with the system's C compiler at first use, everywhere):
  the shared-memory draft channel (publish drafts, wait for a mask, and the scheduler's side),
  the host-callback trampolines a stream calls (``gs_cb_*``: one draft step at a time, and the
  fixed-shape draft steps of a graph), and a CPU "host stream" that runs enqueued host
  functions in order on a thread (what ``cudaLaunchHostFunc`` does on a CUDA stream);
- ``host_functions.py``: the trampolines enqueued in stream order from Python: on CUDA with the
  driver's ``cuLaunchHostFunc`` (captured into CUDA graphs as host nodes: ``worker/drafting/draft_graph.py``),
  on the CPU called where they stand;
- ``host_callbacks.cu`` (CUDA): the same enqueueing as C++ entry points (``cudaLaunchHostFunc``,
  the mask's host-to-device copy, page-locking), for a build that links the runtime. The tests
  compile it with ``nvcc``; the Python worker enqueues through the driver and does not load it.

``library()`` loads the host library (None without a C compiler); ``channel.py`` wraps it.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path

from guidespec import native

HERE = Path(__file__).parent
HOST_SOURCES = [HERE / "draft_channel.c"]
HEADERS = [HERE / "draft_channel.h"]
CUDA_SOURCES = [HERE / "host_callbacks.cu"]

_i32, _i64, _ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p


@lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The host library, built at first use (None where there is no C compiler)."""
    path = native.build_shared(
        "guidespec-cuda-ext-host", HOST_SOURCES, HEADERS, ["-O2", "-std=c11", "-pthread"], ["-pthread"]
    )
    return None if path is None else _typed(ctypes.CDLL(str(path)))


def _typed(lib: ctypes.CDLL) -> ctypes.CDLL:
    p32 = ctypes.POINTER(_i32)
    signatures = {
        "gs_channel_bytes": ([_i32, _i32, _i32], ctypes.c_size_t),
        "gs_channel_init": ([_ptr, _i32, _i32, _i32, _i32], _i32),
        "gs_channel_check": ([_ptr, _i32, _i32, _i32], _i32),
        "gs_channel_offset": ([_ptr, _i32], ctypes.c_size_t),
        "gs_publish_drafts": ([_ptr, _i64, _i32, _ptr, _i32, _ptr, _ptr, _i32], _i32),
        "gs_publish_done": ([_ptr, _i64], _i32),
        "gs_wait_mask": ([_ptr, _i64, _i32, _i64, _i32, _ptr, _i32], _i32),
        "gs_wait_drafts": ([_ptr, _i64, _i32, _i64, _i32, p32, p32, p32], _i32),
        "gs_publish_mask": ([_ptr, _i64, _i32, _i32], _i32),
        "gs_publish_verify_mask": ([_ptr, _i64, _ptr, _i32], _i32),
        "gs_last_error": ([_ptr, ctypes.POINTER(_i64), p32], _i32),
        "gs_clear_error": ([_ptr], None),
        "gs_host_stream_create": ([_i32], _ptr),
        "gs_host_stream_enqueue": ([_ptr, _ptr, _ptr], _i32),
        "gs_host_stream_synchronize": ([_ptr], None),
        "gs_host_stream_destroy": ([_ptr], None),
    }
    for name, (args, result) in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, result
    return lib


def nvcc() -> str | None:
    return shutil.which("nvcc")


def compile_cuda(output: Path, arch: str = "sm_90") -> subprocess.CompletedProcess[str]:
    """``host_callbacks.cu`` compiled by nvcc into an object file (what CI checks on a machine
    without a GPU)."""
    cmd = [
        nvcc() or "nvcc",
        "-O2",
        f"-arch={arch}",
        "-Xcompiler",
        "-fPIC",
        "-I",
        str(HERE),
        "-c",
        str(CUDA_SOURCES[0]),
        "-o",
        str(output),
    ]
    return subprocess.run(cmd, capture_output=True, text=True)
