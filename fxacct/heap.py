"""The Python heap while fxacct traces: what existed before the call is left out of the cyclic
garbage collector's scans.

A trace allocates hundreds of thousands of small objects (fake tensors, records, FX nodes), so
CPython's collector runs its full collection about ten times per profile, and each full
collection walks every tracked object of the process: torch, sympy and transformers' modules,
classes and functions included (about 500k objects after ``import fxacct``). None of them is
garbage made by the trace. ``gc.freeze()`` moves them to the permanent generation, which no
collection scans (CPython docs, gc.freeze: "move all objects tracked by the garbage collector
into a permanent generation, i.e. ignore them in all the future collections"), and
``gc.unfreeze()`` gives the old objects back on the way out.

While it traces, the collector runs only where fxacct asks. A trace allocates hundreds of
thousands of objects that stay alive until the account is built (records, FX nodes, fake
tensors), so every automatic collection walks a young heap that only grows and frees almost
nothing: on the 70B ``--mesh fsdp=8,tp=8`` profile 2 full and 1,696 young collections took
0.32 s and freed 35k objects (gc.callbacks; at the default thresholds but the full one ten times
rarer; on one device 1 and 1,124 took 0.14 s). Reference counts free what a trace drops as it
drops it; what is left is cyclic garbage, and one kind of it is large: a dropped capture's FX
graph (each node links its neighbours and its users both ways). fxacct drops whole captures only
between the traces of a search (the largest batch that fits, each layout of ``fxacct plan``),
and frees each there (``collect_dropped``; for a layout whose trace failed, once its exception
is handled: the traceback holds the trace), scanning only what was made since the last such
call. Within one profile the rest of its cyclic garbage (the inference capture's graph, once its
peak is read) waits for the end of the call, when the collector is switched back on (it is the
process's: another thread's cyclic garbage waits as long). Measured on the 70B profiles
(bench/speed.py): see docs/speed.md.

A process that runs one command and exits (the CLI, ``fxacct_cli.main.main``) makes full
collections rarer for its whole life (``rarer_full_collections``): importing torch and
transformers builds about 450k long-lived objects, and the default thresholds walk them all in
four full collections that free nothing of note (0.25 s of a 3.4 s small Hugging Face profile,
measured with gc.callbacks on a 2-core machine; 0.47 s of the 70B --mesh fsdp=8,tp=8 profile), at
the same peak RSS. Inside it a trace's ``frozen_heap`` switches the collector off as above.

A process that froze its own heap (a forking server does, before ``fork``) keeps it as it is:
fxacct freezes only when nothing is frozen, so it never unfreezes what the caller froze, and a
nested call (``profile`` calls ``profile_module``) leaves it to the outer one.
"""

from __future__ import annotations

import contextlib
import functools
import gc

FULL_COLLECTIONS_RARER = 10  # for a one-command process (module docstring)


_inside = False  # a frozen_heap of fxacct's own is open (a nested call asks nothing of gc)


@contextlib.contextmanager
def frozen_heap():
    global _inside
    # gc.get_freeze_count walks the whole permanent generation (10 ms once torch is frozen):
    # asked only on the way in from outside fxacct, where the caller's own freeze is the question
    if _inside or gc.get_freeze_count():
        yield
        return
    enabled = gc.isenabled()  # a caller who switched the collector off keeps it off
    gc.freeze()
    gc.disable()
    _inside = True
    try:
        yield
    finally:
        _inside = False
        if enabled:
            gc.enable()
        gc.unfreeze()


def collect_dropped() -> None:
    """Inside fxacct's own frozen heap, after a search dropped a trace: its cyclic garbage freed
    now (module docstring). A young collection: what the heap held before the last call survived
    it and is not walked again. Outside one (a caller's own freeze) the collector runs as the
    caller set it, and this does nothing."""
    if _inside:
        gc.collect(0)


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
