"""The JSON of a prediction (``predicted``) and of a runtime run (``runtime``), for the profile
document (DESIGN.md's contract: the ``runtime`` keys are medians over the timed steps; times in ms,
bytes and FLOPs as numbers, null where nothing was measured or predicted)."""

from __future__ import annotations

from fxacct.predict.gpu_kernels import kernel_totals
from fxacct.predict.roofline import PHASES, Prediction
from fxacct.runtime.compare import achieved_flops_per_s, mfu


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else 1e3 * seconds


def _ratio(a, b) -> float | None:
    return a / b if a is not None and b else None


def predicted(prediction: Prediction) -> dict:
    d = prediction.device
    return {
        "device": d.name, "source": d.source, "step_ms": prediction.step_ms,
        **{f"{phase}_ms": _ms(prediction.by_phase[phase]) for phase in PHASES},
        "peaks": {"matmul_flops_per_s": dict(d.matmul_flops_per_s), "other_flops_per_s": d.other_flops_per_s,
                  "bandwidth_bytes_per_s": d.bandwidth_bytes_per_s},
        "modules": [{"module": m, "forward_ms": _ms(f), "backward_ms": _ms(b)}
                    for m, (f, b) in prediction.by_module.items()],
        "kernels": kernels(prediction),
    }


def kernels(prediction: Prediction) -> dict | None:
    """On a --gpu: the kernel model's figures (fxacct.devices) and, per kernel kind, the ops, their
    time without launches and the time-weighted share of the datasheet peak they achieve (FLOP/s of
    a GEMM or attention kernel over the dtype's peak; bytes/s of a memory-bound op over the
    bandwidth); null for a calibrated device."""
    g = prediction.device.gpu
    if g is None:
        return None
    return {"sm_count": g.sm_count, "arch": g.arch, "sdpa_backend": g.sdpa_backend,
            "matmul_efficiency": dict(g.matmul_efficiency),
            "bandwidth_share": g.bandwidth_share, "launch_s": g.launch_s, "sources": dict(g.sources),
            "by_kind": [{"kind": r.kind, "ops": r.ops, "ms": _ms(r.seconds), "peak_fraction": r.peak_fraction}
                        for r in kernel_totals(prediction.ops)]}


def _row(r, key: str) -> dict:
    return {key: r.name, **({"op": r.op} if r.op else {}), "flops": r.flops,
            "predicted_ms": _ms(r.predicted_s), "measured_ms": _ms(r.measured_s), "ratio": r.ratio,
            "achieved_flops_per_s": r.achieved_flops_per_s}


def runtime(result) -> dict:
    m, c = result.measured, result.comparison
    step_ms = _ms(m.step_s)
    t = m.transfer
    return {
        "device": m.device, "steps": m.steps,
        "step_ms": step_ms, "forward_ms": _ms(m.forward_s), "backward_ms": _ms(m.backward_s),
        "optimizer_ms": _ms(m.optimizer_s), "peak_bytes": m.peak_bytes,
        "predicted_step_ms": _ms(c.predicted.get("step")),
        "achieved_flops_per_s": achieved_flops_per_s(c, m), "mfu": mfu(c, m),
        # beyond the contract's keys
        "device_name": m.device_name, "threads": m.threads, "warmup": m.warmup,
        "steps_requested": m.steps_requested, "inference": m.inference, "interrupted": m.interrupted,
        "step_ratio": _ratio(m.step_s, c.predicted.get("step")),
        "predicted_forward_ms": _ms(c.predicted.get("forward")),
        "predicted_backward_ms": _ms(c.predicted.get("backward")),
        "predicted_optimizer_ms": _ms(c.predicted.get("optimizer")),
        "peak_source": m.peak_source, "op_level_peak_bytes": m.op_level_peak_bytes,
        "predicted_peak_bytes": c.predicted_peak_bytes,
        "peak_ratio": _ratio(m.peak_bytes, c.predicted_peak_bytes),
        "op_level_peak_ratio": _ratio(m.op_level_peak_bytes, c.predicted_peak_bytes),
        "model_flops": c.model_flops, "mfu_peak_flops_per_s": c.peak_flops_per_s, "mfu_peak_source": c.peak_source,
        "step_times_ms": [_ms(s.step_s) for s in m.step_times],
        # the median step under the profiler, whose module and node times the rows give
        "profiled_step_ms": _ms(sorted(s.step_s for s in m.profiled_step_times)[(len(m.profiled_step_times) - 1) // 2])
        if m.profiled_step_times else None,
        "transfer": None if t is None else {"bytes": t.bytes, "pageable_ms": _ms(t.pageable_s),
                                            "pinned_ms": _ms(t.pinned_s)},
        "join": None if m.join is None else {"matched_nodes": m.join.matched, "forward_nodes": m.join.expected,
                                             "outside_backward_ms": _ms(m.join.outside_backward_s)},
        "modules": [_row(r, "module") for r in c.modules],
        "nodes": [_row(r, "name") for r in c.nodes],
    }


__all__ = ["predicted", "runtime", "kernels"]
