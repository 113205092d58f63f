"""The kernels built for instruction sets other than the engine's ``-march=native``."""

from __future__ import annotations

from pathlib import Path

from guidespec.worker import kernels


def build_for(arch: str) -> Path | None:
    """The kernels at ``arch``: at -O1 unless it is the engine's own build (``-march=native``,
    -O3, shared with every engine the tests start). vec.h picks each width's intrinsics by the
    preprocessor, so -O1 runs the same paths in a third of -O3's build (x86-64-v4 at -O3: 46 s of
    one core on a Zen 3); the engine's build is what every other test runs."""
    return kernels.build([arch] if arch == "-march=native" else [arch, "-O1"])
