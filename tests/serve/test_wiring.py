"""The serving process's heap settles once it listens (`settle_heap`), in a process of its own:
the collector's settings are the whole interpreter's."""

from __future__ import annotations

import subprocess
import sys

from proxy.serve.wiring import YOUNG_THRESHOLD

PROBE = """
import gc
from proxy.serve.wiring import settle_heap
before = gc.get_threshold()
settle_heap()
after = gc.get_threshold()
print(gc.get_freeze_count() > 1000, after[0], after[1:] == before[1:])
"""


def test_settle_heap_freezes_the_start_up_heap_and_raises_the_young_threshold() -> None:
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["True", str(YOUNG_THRESHOLD), "True"]


def test_a_cycle_made_after_it_is_still_collected() -> None:
    probe = PROBE + """
import weakref
class Node: pass
node = Node(); node.self = node
alive = weakref.ref(node)
del node
gc.collect()
print(alive() is None)
"""
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split()[-1] == "True"
