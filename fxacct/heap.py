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
call. Before a search's first probe the call's own objects so far join the frozen heap
(``freeze_made``): its young heap then holds the probes alone, where it held the profile's
captures, the model and what torch imported on the first trace (the tiny Qwen2's ``--gpu h100``
profile: 3.85-3.90 s wall against 4.00-4.28 s, the same machine, alternating). Within one
profile the rest of its cyclic garbage (the inference capture's graph, once its peak is read)
waits for the end of the call, when the collector is switched back on (it is the process's:
another thread's cyclic garbage waits as long), or, frozen before a search, for the next call's
way in or the collector's own next full collection. A caller's results dropped between two calls are cyclic garbage too, and
``freeze()`` on the next call's way in would keep them from every collection but a full one, which
a loop of profiles may never reach (forty profiles of a two-layer model left forty FX graphs
alive). So after a first call, each call's way in collects where the last one left what it made:
the young generations (what it made stayed there; a few milliseconds for a small model) or, after
a search froze it, a full collection (about 0.1 s with torch in the heap, beside a search's
traces). The CLI's one call pays neither.
Measured on the 70B profiles (bench/speed.py): see docs/speed.md.

A process that runs one command and exits (the CLI, ``fxacct_cli.main.main``, which leaves by
``os._exit``) says so once (``one_command_process``), and its collector is switched off for the
rest of its life: what it would collect is freed by the exit anyway, and collecting costs.
Measured with gc.callbacks on the tiny Qwen2's 3 s CLI profile (2-core machine):
- importing torch and transformers builds about 450k long-lived objects; the default thresholds
  walk them all in four full collections that free nothing of note (0.25 s; 0.47 s of the 70B
  --mesh fsdp=8,tp=8 profile) and in about 370 young ones (0.05 s);
- as a call returns and the collector comes back, the first allocation starts a young
  collection of everything the call made (its young count is every allocation since its way in),
  which walks the captures and frees their cyclic garbage (the inference capture, the probes'
  fake tensors and their finalizers): one collection of 14k objects, 0.11-0.12 s, and 0.2 s of
  wall time with what it frees (8 runs alternating with the collector back on).
fxacct's own collections still run there: a search frees each probe it drops, and a later call of
the same command (``fxacct diff`` profiles twice) collects on its way in where the last one left
what it made. Peak RSS is the same: the collections skipped free nothing the command needs. The
real model's steps a runtime run measures have the collector on (``collector_on``), as a
training loop has it.

A process that froze its own heap (a forking server does, before ``fork``) keeps it as it is:
fxacct freezes only when nothing is frozen, so it never unfreezes what the caller froze, and a
nested call (``profile`` calls ``profile_module``) leaves it to the outer one.
"""

from __future__ import annotations

import contextlib
import functools
import gc

_inside = False  # a frozen_heap of fxacct's own is open (a nested call asks nothing of gc)
# how the last of them left what it made, as the generation gc.collect takes to reach it: None (none
# has closed), in the young generations (YOUNG: collecting 0 and 1 finds what the caller dropped
# since) or in the oldest (OLD: a search froze it before its probes, and gc.unfreeze gives the
# frozen heap back to the oldest generation: only a full collection reaches it)
YOUNG, OLD = 1, 2
_returned: int | None = None
_froze_made = False
_one_command = False  # one_command_process(): the process leaves after its one command, collector off


@contextlib.contextmanager
def frozen_heap():
    global _inside, _returned, _froze_made
    # gc.get_freeze_count walks the whole permanent generation (10 ms once torch is frozen):
    # asked only on the way in from outside fxacct, where the caller's own freeze is the question
    if _inside or gc.get_freeze_count():
        yield
        return
    enabled = gc.isenabled()  # a caller who switched the collector off keeps it off
    if (enabled or _one_command) and _returned is not None:
        gc.collect(_returned)  # an earlier call's dropped results, before freeze() keeps them (module docstring)
    gc.freeze()
    gc.disable()
    _inside = True
    try:
        yield
    finally:
        _inside, _returned, _froze_made = False, OLD if _froze_made else YOUNG, False
        if enabled:
            gc.enable()
        gc.unfreeze()


def freeze_made() -> None:
    """Inside fxacct's own frozen heap, before a search traces again and again: what the call has
    made so far (its own captures and account, the modules torch imported lazily on its first
    trace) joins the frozen heap, so that ``collect_dropped`` after each probe walks that probe's
    objects alone, not the call's whole young heap again. Cyclic garbage made so far (the
    inference capture's graph) is frozen with it and waits for the next call's way in (a full
    collection there) or the collector's own next full one. Outside one it does nothing."""
    global _froze_made
    if _inside:
        gc.freeze()
        _froze_made = True


def collect_dropped() -> None:
    """Inside fxacct's own frozen heap, after a search dropped a trace: its cyclic garbage freed
    now (module docstring). A young collection: what the heap held before the last call survived
    it and is not walked again. Outside one (a caller's own freeze) the collector runs as the
    caller set it, and this does nothing."""
    if _inside:
        gc.collect(0)


def one_command_process() -> None:
    """For a process that runs one command and exits (module docstring): the collector off from
    here to its end; fxacct's own collections (a search's dropped probes, a later call's way in)
    still run."""
    global _one_command
    gc.disable()
    _one_command = True


@contextlib.contextmanager
def collector_on():
    """The collector on, as the user's own training loop has it, where ``one_command_process``
    switched it off: the real steps fxacct.runtime times and measures, whose cyclic garbage (a
    model may make some every step) is freed as in that loop, not held to the exit. A caller who
    switched it off keeps it off."""
    if not _one_command or gc.isenabled():
        yield
        return
    gc.enable()
    try:
        yield
    finally:
        gc.disable()


def with_frozen_heap(fn):
    """``fn`` run inside ``frozen_heap()``."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        with frozen_heap():
            return fn(*args, **kwargs)

    return run
