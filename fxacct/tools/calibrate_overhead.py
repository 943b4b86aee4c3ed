"""The per-op overhead of a calibrated device: what a small model's training step (microbench._Tiny)
holds beyond fxacct's own roofline of it, per op (fxacct.tools.calibrate documents why)."""

from __future__ import annotations

import contextlib
from dataclasses import replace

import torch

from fxacct.api import profile_module
from fxacct.load.config import Config
from fxacct.predict.fused_time import predict_profile
from fxacct.predict.roofline import FREE, INIT, LOSS, from_calibration
from fxacct.tools import microbench

# The small step on every thread against one thread: measured on the 2-core CI machine, idle
# 1.0-1.3×; with two busy processes on its cores 116-130× (OpenMP's threads wait at each parallel
# region for a core other work holds, while one thread is merely time-sliced). Above 3× the
# machine is contended and the calibration is refused (fxacct.tools.calibrate).
CONTENDED = 3.0


def small_steps(kind: str, budget_s: float) -> tuple[microbench.TinyTiming, microbench.TinyTiming, str | None]:
    """(the small step, the same under torch.profiler, a problem or None). On a CPU running more
    than one thread the step is also timed on one thread: where other work holds the cores (a
    contended machine: CONTENDED), the problem says so."""
    tiny = microbench.dispatch(kind, budget_s)  # a median over ~100 steps: the steadiest figure
    profiled = microbench.dispatch(kind, budget_s / 3, profiled=True)
    threads = torch.get_num_threads()
    if kind != "cpu" or threads == 1:
        return tiny, profiled, None
    with _one_thread():
        alone = microbench.dispatch(kind, budget_s / 3)
    return tiny, profiled, contended(tiny.step.seconds, alone.step.seconds, threads)


def contended(step_s: float, one_thread_s: float, threads: int) -> str | None:
    """The problem of a small step that took over CONTENDED × its one-thread time, else None."""
    if step_s <= CONTENDED * one_thread_s:
        return None
    return (f"per-op overhead: the small training step took {step_s * 1e3:.3g} ms on {threads} threads and "
            f"{one_thread_s * 1e3:.3g} ms on one: other work holds this CPU's cores")


@contextlib.contextmanager
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def fit(cal, tiny: microbench.TinyTiming, profiled: microbench.TinyTiming, trivial_s: float) -> dict:
    """The overhead fields of a Calibration (``cal``: its rates, no overhead yet) from the small
    step's timings, plain and under torch.profiler, and the trivial op's time (the floor)."""
    roofline_s, ops, views = tiny_roofline(cal)
    # a view allocates nothing and runs no kernel: on the CPU it pays dispatch alone, the trivial op's
    # time; on CUDA the trivial op's time is a kernel launch, which a view never pays, and under
    # torch.profiler (which records each op alike) every op pays one figure
    views_apart = cal.kind == "cpu"

    def overhead_of(seconds: float, phases, apart: bool = views_apart) -> float:
        n_views = sum(views[p] for p in phases)
        n_ops = sum(ops[p] for p in phases) + (0 if apart else n_views)
        beyond_views = seconds - (trivial_s * n_views if apart else 0.0)
        return microbench.per_op(beyond_views, sum(roofline_s[p] for p in phases), n_ops, trivial_s)

    every = microbench.TINY_PHASES
    step_s = sum(tiny.phases.values()) if tiny.phases else tiny.step.seconds  # CUDA: no phase splits
    return {"dispatch_s_per_op": overhead_of(step_s, every),
            "profiled_dispatch_s_per_op": overhead_of(profiled.step.seconds, every, apart=False),
            "dispatch_s_by_phase": {p: overhead_of(s, (p,)) for p, s in tiny.phases.items()},
            "view_s_per_op": trivial_s if views_apart else None}


def tiny_roofline(cal) -> tuple[dict, dict, dict]:
    """({phase: seconds}, {phase: ops}, {phase: views}) of the small model's training step
    (microbench._Tiny) as fxacct predicts it on ``cal``'s rates, without any per-op overhead: its
    arithmetic and bytes, the ops that pay the per-op overhead and the view ops (the loss's
    counted with the forward's, as fxacct.predict.roofline.DeviceModel.overhead charges them).
    The measured step less this and less the views' dispatch, per op, is the per-op overhead: what
    the roofline does not hold, fit where it is most of the time."""
    tiny = microbench._Tiny("cpu")  # traced on fake tensors: only shapes and dtypes are read
    profile = profile_module(tiny.model, (tiny.x,), {}, Config(batch=microbench.TINY_BATCH, optimizer="adamw"))
    rates_only = replace(cal, dispatch_s_per_op=None, profiled_dispatch_s_per_op=None, dispatch_s_by_phase={},
                         view_s_per_op=None)
    prediction = predict_profile(profile, from_calibration(rates_only))
    seconds, ops, views = ({p: 0 for p in microbench.TINY_PHASES} for _ in range(3))
    for op in prediction.ops:
        if op.bound == INIT:  # the optimizer state's first allocation: no op of a steady-state step
            continue
        phase = "forward" if op.phase == LOSS else op.phase
        seconds[phase] += op.seconds
        (views if op.bound == FREE else ops)[phase] += op.calls
    return seconds, ops, views


__all__ = ["contended", "fit", "small_steps", "tiny_roofline"]
