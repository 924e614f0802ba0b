"""Garbage collection for long-running data-plane processes.

CPython's cyclic collector walks every tracked object of a generation; its full
(oldest-generation) passes then walk everything a process imported and built at
start: modules, a stage's model and engine objects, the web framework. In a
coordinator serving 200 paced sessions such a pass took 18 ms, and every event in
flight waited for it (``docs/benchmarks.md``, section 2). A process that has
finished starting calls ``settle``: what exists then is moved out of the
collector's sight for good (``gc.freeze``), so later passes walk only what the
process created since. Objects frozen are never collected; they are the ones that
live as long as the process anyway.
"""

from __future__ import annotations

import gc


def settle() -> None:
    """Collect once, then exempt every object alive now from later collections."""
    gc.collect()
    gc.freeze()
