"""The Python heap while fxacct traces: what existed before the call is left out of the cyclic
garbage collector's scans.

A trace allocates hundreds of thousands of small objects (fake tensors, records, FX nodes), so
CPython's collector runs its full collection about ten times per profile, and each full
collection walks every tracked object of the process: torch, sympy and transformers' modules,
classes and functions included (about 500k objects after ``import fxacct``). None of them is
garbage made by the trace. ``gc.freeze()`` moves them to the permanent generation, which no
collection scans (CPython docs, gc.freeze: "move all objects tracked by the garbage collector
into a permanent generation, i.e. ignore them in all the future collections"); what the trace
makes is collected as before, and ``gc.unfreeze()`` gives the old objects back on the way out.
Measured on the 70B profiles (bench/speed.py): see the README's "Speed".

A process that froze its own heap (a forking server does, before ``fork``) keeps it as it is:
fxacct freezes only when nothing is frozen, so it never unfreezes what the caller froze, and a
nested call (``profile`` calls ``profile_module``) leaves it to the outer one.
"""

from __future__ import annotations

import contextlib
import functools
import gc


@contextlib.contextmanager
def frozen_heap():
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def with_frozen_heap(fn):
    """``fn`` run inside ``frozen_heap()``."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with frozen_heap():
            return fn(*args, **kwargs)

    return run
