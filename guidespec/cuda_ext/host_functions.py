"""Host functions in stream order: the draft channel's C trampolines run where a stream reaches
them, with no Python in between.

- On CUDA, :class:`HostFunctions` enqueues a trampoline on the current stream with the driver's
  ``cuLaunchHostFunc`` (``libcuda.so.1``, called through ctypes: no build step, nothing but the
  driver needed on the GPU machine). Inside ``torch.cuda.graph`` capture the call records a host
  node, so every replay calls the trampoline again, with the same argument block: the block and
  the buffers its pointers lead to live as long as the graph, and the values in them (the step
  number, the rows' tokens) are read when the callback runs.
- On the CPU, torch runs each operation before the next is issued, so calling the trampoline at
  the point it is enqueued is stream order: :class:`HostFunctions` calls it there.

``GraphStepArgs`` is ``gs_graph_step_args`` of ``draft_channel.h``: one block per draft step of
a fixed-shape graph (``worker/drafting/draft_graph.py``).
"""

from __future__ import annotations

import ctypes
from functools import lru_cache
from typing import Any

import torch

from guidespec.cuda_ext import library

_p = ctypes.c_void_p


class GraphStepArgs(ctypes.Structure):
    _fields_ = [
        ("channel", _p),
        ("step", _p),
        ("draft_index", ctypes.c_int32),
        ("batch", ctypes.c_int32),
        ("max_produced", ctypes.c_int32),
        ("num_words", ctypes.c_int32),
        ("timeout_us", ctypes.c_int64),
        ("peer_pid", ctypes.c_int32),
        ("batch_rows", _p),
        ("wanted", _p),
        ("masked", _p),
        ("produced", _p),
        ("produced_len", _p),
        ("drafts", _p),
        ("rows", _p),
        ("lens", _p),
        ("tokens", _p),
        ("mask_rows", _p),
        ("out", _p),
        ("published", _p),
        ("status", _p),
        ("times", _p),
    ]


class VerifyWaitArgs(ctypes.Structure):
    """``gs_verify_args``: a fused step's wait for its verify masks (``worker/drafting/step_graph.py``)."""

    _fields_ = [
        ("channel", _p),
        ("step", _p),
        ("timeout_us", ctypes.c_int64),
        ("peer_pid", ctypes.c_int32),
        ("num_rows", ctypes.c_int32),
        ("num_words", ctypes.c_int32),
        ("num_ids", ctypes.c_int32),
        ("padded_of", _p),
        ("enabled", _p),
        ("out", _p),
        ("status", _p),
        ("times", _p),
    ]


@lru_cache(maxsize=1)
def _launch_host_func() -> Any:
    """The driver's ``cuLaunchHostFunc(stream, fn, user_data)``."""
    driver = ctypes.CDLL("libcuda.so.1")
    fn = driver.cuLaunchHostFunc
    fn.argtypes, fn.restype = [_p, _p, _p], ctypes.c_int
    return fn


_TRAMPOLINES = ("gs_cb_graph_publish", "gs_cb_graph_wait", "gs_cb_verify_wait")


class HostFunctions:
    """Enqueue the cuda_ext library's trampolines (``gs_cb_*``) in stream order on ``device``."""

    def __init__(self, device: torch.device) -> None:
        lib = library()
        if lib is None:
            raise RuntimeError("the cuda_ext host library is not built (no C compiler)")
        self.device = device
        self.cuda = device.type == "cuda"
        self._functions = {name: ctypes.cast(getattr(lib, name), _p) for name in _TRAMPOLINES}
        self._direct = {name: ctypes.CFUNCTYPE(None, _p)((name, lib)) for name in self._functions}
        if self.cuda:
            _launch_host_func()  # a driver without it fails here, at start, not inside a capture

    def enqueue(self, name: str, args: ctypes.Structure) -> None:
        if not self.cuda:
            self._direct[name](ctypes.addressof(args))
            return
        stream = torch.cuda.current_stream(self.device).cuda_stream
        code = _launch_host_func()(_p(stream), self._functions[name], _p(ctypes.addressof(args)))
        if code != 0:
            raise RuntimeError(f"cuLaunchHostFunc({name}) failed: CUresult {code}")
