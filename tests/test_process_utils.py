"""process_utils: what every engine process does at start."""

from __future__ import annotations

import subprocess
import sys

_FREEZE = """
import gc, weakref
from guidespec.process_utils import freeze_startup_objects
kept = [[i] for i in range(50_000)]
class Node: pass
a, b = Node(), Node()
a.other, b.other = b, a
dead = weakref.ref(a)
del a, b  # a cycle: garbage that only a collection finds
frozen = freeze_startup_objects()
print(dead() is None, frozen >= 50_000, len(gc.get_objects()) < 1_000)
"""


def test_the_starts_objects_are_frozen_once_its_garbage_is_collected() -> None:
    """The start's garbage is collected, not kept; what is left stays out of every later
    collection (a full one walks none of it). In a process of its own: freezing is for life."""
    out = subprocess.run([sys.executable, "-c", _FREEZE], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True", "True"]
