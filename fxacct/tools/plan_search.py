"""The search of ``fxacct plan`` over the layouts (steps 1-3 of fxacct.tools.plan's docstring),
one mesh at a time, in this process or in a pool of worker processes (``jobs``).

Each mesh (pp, fsdp, tp) is searched on its own (its group without checkpointing, then with): no
mesh's result changes another's search, so meshes run in parallel, one per worker process, each
worker with a Planner of its own (the model built once per worker; its traces in its memory and,
with a TraceCache, on disk for the others and for reruns). Workers are spawned, not forked: the
parent has torch's threads and a fake process group may be live in a forked copy. The results
are put together in the mesh order, whatever order the workers finish in, so a plan does not
depend on ``jobs``.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import signal
import sys
from dataclasses import replace

from fxacct.heap import with_frozen_heap
from fxacct.tools.plan_cache import TraceCache
from fxacct.tools.plan_layouts import Layout, exact_rejection
from fxacct.tools.plan_probe import Candidate, Planner
from fxacct.units import format_bytes


def _others(group: list[Layout], probed: dict) -> dict:
    """The untraced layouts of a group: below the largest that fits (slower), above one over
    memory (over too), or, where the group failed, the same reason."""
    fit = max((lay.micro_batch for lay, c in probed.items() if c.fits), default=None)
    over = min((c for c in probed.values() if c.over_memory), key=lambda c: c.micro_batch, default=None)
    failed = next((c for c in probed.values() if c.rejected and not c.over_memory), None)
    out = {}
    for lay in group:
        if lay in probed:
            continue
        if fit is not None and lay.micro_batch < fit:
            out[lay] = Candidate(lay, dominated=f"slower than mb {fit}")
        elif over is not None and lay.micro_batch > over.micro_batch:
            least = over.source == "screen" or "at least" in over.rejected  # a lower bound
            out[lay] = Candidate(lay, rejected=f"over memory (mb {over.micro_batch} is, by "
                                               f"{'≥ ' if least else ''}"
                                               f"{format_bytes(over.over_bytes)})")
        elif failed is not None:
            out[lay] = Candidate(lay, rejected=f"as mb {failed.micro_batch}: {failed.rejected}")
    return out


def _bisect(planner: Planner, group: list[Layout], probed: dict) -> None:
    """group[0] fits and group[-1] does not: the largest fitting micro-batch between them."""
    lo, hi = 0, len(group) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        c = probed[group[mid]] = planner.probe(group[mid])
        if c.fits:
            lo = mid
        elif c.over_memory:
            hi = mid
        else:
            return


def _search_group(planner: Planner, group: list[Layout]) -> dict:
    """Every layout of a group (by micro-batch): micro-batch 1 first (over memory: all are), then
    the largest, then bisection between them; a pipeline's upwards from 1."""
    probed = {group[0]: planner.probe(group[0])}
    if group[0].pp > 1:  # the bubble shrinks with more micro-batches: every one that fits is traced,
        # upwards until one does not (a larger one holds more; its M = share ÷ mb is smaller still)
        for prev, lay in zip(group, group[1:]):
            if not probed[prev].fits:
                break
            probed[lay] = planner.probe(lay)
    elif probed[group[0]].fits and len(group) > 1:
        top = probed[group[-1]] = planner.probe(group[-1])
        if top.over_memory:
            _bisect(planner, group, probed)
    fit = max((lay.micro_batch for lay, c in probed.items() if c.fits), default=0)
    slower = {} if group[0].pp > 1 else {lay: replace(c, dominated=f"slower than mb {fit}")
                                         for lay, c in probed.items() if c.fits and lay.micro_batch < fit}
    return {**probed, **slower, **_others(group, probed)}


def _groups(planner: Planner, layouts: list[Layout]) -> tuple[dict, dict, int]:
    """({layout: Candidate} rejected before tracing, one row per mesh; {group: its layouts by
    micro-batch}; how many layouts were rejected before tracing)."""
    out, groups, meshes, pruned = {}, {}, {}, 0
    for lay in layouts:
        key = (lay.pp, lay.fsdp, lay.tp)
        if key not in meshes:
            meshes[key] = exact_rejection(lay, planner.facts, planner.model, planner.gpus, planner.global_batch,
                                          planner.capacity, planner.titan)
            if meshes[key]:  # no reason depends on the micro-batch or checkpointing: one row per mesh
                row = replace(lay, micro_batch=0, accumulation=0, checkpoint=None if lay.checkpoint is None else False)
                out[row] = Candidate(row, rejected=meshes[key])
        if meshes[key]:
            pruned += 1
            continue
        few = _too_few_microbatches(lay, planner.schedule)
        if few:
            out[lay] = Candidate(lay, rejected=few)
            pruned += 1
        else:
            groups.setdefault(lay.group, []).append(lay)
    return out, groups, pruned


def _too_few_microbatches(lay: Layout, schedule: str) -> str | None:
    """A pipeline layout whose step has fewer micro-batches than 1F1B has stages (torch's
    Schedule1F1B refuses it), said in the plan's own terms: the planner, not the user, chose M."""
    if lay.pp > 1 and schedule == "1f1b" and lay.accumulation < lay.pp:
        return (f"{lay.accumulation} micro-batch{'es' if lay.accumulation > 1 else ''} per step, fewer than the "
                f"{lay.pp} stages 1F1B needs (a smaller micro-batch makes more)")
    return None


def _search_mesh(planner: Planner, groups: dict) -> dict:
    """{layout: Candidate} for one mesh's groups. Its group without checkpointing goes first:
    where it fits at a micro-batch, checkpointing at that micro-batch only adds time (the
    recompute)."""
    out = {}
    for g in sorted(groups, key=lambda g: g[3]):
        lays = groups[g]
        off = {lay.micro_batch for lay, c in out.items() if lay.group == g[:3] + (False,) and c.fits}
        if g[3] and off:
            twins = {lay: _ckpt_off_twin(lay, off) for lay in lays}
            got = {lay: Candidate(lay, dominated=f"slower than ckpt off at mb {mb}") for lay, mb in twins.items()
                   if mb is not None}
            rest = [lay for lay, mb in twins.items() if mb is None]
            got.update(_search_group(planner, rest) if rest else {})
        else:
            got = _search_group(planner, lays)
        out.update(got)
    return out


def _ckpt_off_twin(lay: Layout, off: set[int]) -> int | None:
    """The micro-batch of the same mesh without checkpointing, ranked (``off``), that makes ``lay``
    only slower (the recompute), or None. Without pp the largest that fits is faster than any
    smaller micro-batch; a pipeline ranks each that fits (its bubble differs): the same one only."""
    if lay.pp > 1:
        return lay.micro_batch if lay.micro_batch in off else None
    return max(off) if lay.micro_batch <= max(off) else None


_WORKER: Planner | None = None  # a pool worker's own Planner (_start)


def _start(config, gpus: int, global_batch: int, cache_dir) -> None:
    global _WORKER
    sys.stdout = sys.stderr  # a worker's results go back through its pipe: what the model prints, to stderr
    # Ctrl-C reaches the whole process group: the plan's own process says it was interrupted and stops
    # its workers; each worker printed its KeyboardInterrupt's traceback besides
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _WORKER = Planner(config, gpus, global_batch, TraceCache(cache_dir) if cache_dir is not None else None)


@with_frozen_heap
def _work(groups: dict) -> tuple[dict, list, dict, set]:
    """One mesh in a worker: its candidates, its probes, the traces it holds and those that raised."""
    planner = _WORKER
    planner.probes = []
    out = _search_mesh(planner, groups)
    return out, planner.probes, dict(planner.cache), set(planner.failed)


def search(planner: Planner, layouts: list[Layout], jobs: int = 1, cache_dir=None) -> tuple[dict, int]:
    """({layout: Candidate} for every layout, how many were rejected before any trace); ``jobs``
    worker processes where there is more than one mesh to search (1: this process)."""
    out, groups, pruned = _groups(planner, layouts)
    meshes: dict = {}
    for g in sorted(groups, key=lambda g: (g[0], g[2], g[3])):
        meshes.setdefault(g[:3], {})[g] = groups[g]
    if jobs <= 1 or len(meshes) <= 1:
        for mesh_groups in meshes.values():
            out.update(_search_mesh(planner, mesh_groups))
        return out, pruned
    ctx = multiprocessing.get_context("spawn")
    pool = concurrent.futures.ProcessPoolExecutor(min(jobs, len(meshes)), mp_context=ctx, initializer=_start,
                                                  initargs=(planner.config, planner.gpus, planner.global_batch,
                                                            cache_dir))
    try:
        futures = {pool.submit(_work, mesh_groups): mesh for mesh, mesh_groups in meshes.items()}
        done = {}
        for fut in concurrent.futures.as_completed(futures):
            got, probes, traces, failed = fut.result()
            done[futures[fut]] = got
            planner.cache.update(traces)
            planner.failed |= failed
            for p in probes:  # the worker's progress, as its mesh completes
                planner.probes.append(p)
                if planner.on_probe is not None:
                    planner.on_probe(p)
    except BaseException:  # an interrupt or a worker's error: start no other mesh, wait for none
        for worker in multiprocessing.active_children():  # the meshes under way: stopped, not finished
            worker.terminate()
        # then joined: the pool's manager thread ends and frees its queues' five semaphores here. A
        # shutdown(wait=False) first dropped the thread unjoined, so whether they were freed before
        # the CLI's os._exit was a race; lost, multiprocessing's tracker warned of them as leaked
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown()
    for mesh in meshes:  # in mesh order, whatever order the workers finished in
        out.update(done[mesh])
    return out, pruned


__all__ = ["search"]
