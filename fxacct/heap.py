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

What the trace makes stays collectable, but its full collections are made ten times rarer
(the third ``gc.set_threshold`` value, 10 by default: full collections per 10 collections of the
middle generation). The trace's objects live until the account is built (records, FX nodes, fake
tensors), so each full collection walks a heap that only grows and finds almost nothing: on the
70B ``--mesh fsdp=8,tp=8`` profile 11 of them took 1.3 s and freed 159 objects; with the
threshold ten times higher, 3 took 0.3 s, at the same peak RSS. Measured on the 70B profiles
(bench/speed.py): see docs/speed.md.

A process that runs one command and exits (the CLI, ``fxacct_cli.main.main``) makes full
collections rarer for its whole life (``rarer_full_collections``): importing torch and
transformers builds about 450k long-lived objects, and the default thresholds walk them all in
four full collections that free nothing of note (0.25 s of a 3.4 s small Hugging Face profile,
measured with gc.callbacks on a 2-core machine; 0.47 s of the 70B --mesh fsdp=8,tp=8 profile), at
the same peak RSS. Inside it a trace's ``frozen_heap`` makes them rarer again.

A process that froze its own heap (a forking server does, before ``fork``) keeps it as it is:
fxacct freezes only when nothing is frozen, so it never unfreezes what the caller froze, and a
nested call (``profile`` calls ``profile_module``) leaves it to the outer one.
"""

from __future__ import annotations

import contextlib
import functools
import gc

FULL_COLLECTIONS_RARER = 10  # while tracing (module docstring)


_inside = False  # a frozen_heap of fxacct's own is open (a nested call asks nothing of gc)


@contextlib.contextmanager
def frozen_heap():
    global _inside
    # gc.get_freeze_count walks the whole permanent generation (10 ms once torch is frozen):
    # asked only on the way in from outside fxacct, where the caller's own freeze is the question
    if _inside or gc.get_freeze_count():
        yield
        return
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(*thresholds[:2], thresholds[2] * FULL_COLLECTIONS_RARER)
    _inside = True
    try:
        yield
    finally:
        _inside = False
        gc.set_threshold(*thresholds)
        gc.unfreeze()


def rarer_full_collections() -> None:
    """Full collections FULL_COLLECTIONS_RARER times rarer from here to the process's end: for a
    process that runs one command and exits (module docstring)."""
    young, middle, full = gc.get_threshold()
    gc.set_threshold(young, middle, full * FULL_COLLECTIONS_RARER)


def with_frozen_heap(fn):
    """``fn`` run inside ``frozen_heap()``."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with frozen_heap():
            return fn(*args, **kwargs)

    return run
