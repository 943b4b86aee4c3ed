"""A Chrome/Perfetto trace (the Trace Event Format, "X" complete events, times in µs) with the
measured profile and the predicted timeline side by side.

The measured part is torch.profiler's own Chrome trace of the timed steps, unchanged. The
predicted part is one extra process, "fxacct predicted (<device>)", that lays the step's ops end to
end in program order, each as its roofline time (fxacct.predict.roofline), starting where the first
measured step starts; one thread shows the ops, one the phases. Open the file in
https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

from fxacct.predict.roofline import Prediction

PREDICTED_PID = "fxacct predicted"
OPS_TID, PHASES_TID = 1, 2


def _first_step_us(events) -> float:
    starts = [e["ts"] for e in events if e.get("name") == "fxacct.step" and "ts" in e]
    if starts:
        return float(min(starts))
    stamps = [e["ts"] for e in events if "ts" in e]
    return float(min(stamps)) if stamps else 0.0


def predicted_events(prediction: Prediction, start_us: float = 0.0) -> list[dict]:
    pid = f"{PREDICTED_PID} ({prediction.device.name})"
    out = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": pid}},
           {"ph": "M", "name": "thread_name", "pid": pid, "tid": OPS_TID, "args": {"name": "ops (roofline)"}},
           {"ph": "M", "name": "thread_name", "pid": pid, "tid": PHASES_TID, "args": {"name": "phases"}}]
    t = start_us
    phase, phase_start = None, start_us
    for op in prediction.ops:
        if op.phase != phase:
            if phase is not None:
                out.append({"ph": "X", "name": phase, "pid": pid, "tid": PHASES_TID, "ts": phase_start,
                            "dur": t - phase_start})
            phase, phase_start = op.phase, t
        dur = 1e6 * op.seconds  # s -> µs
        if dur > 0:
            out.append({"ph": "X", "name": op.op.removeprefix("aten.").removesuffix(".default"), "pid": pid,
                        "tid": OPS_TID, "ts": t, "dur": dur,
                        "args": {"node": op.node, "module": op.module, "phase": op.phase, "owner": op.owner,
                                 "flops": op.flops, "bytes": op.bytes, "bound": op.bound}})
        t += dur
    if phase is not None:
        out.append({"ph": "X", "name": phase, "pid": pid, "tid": PHASES_TID, "ts": phase_start, "dur": t - phase_start})
    return out


def trace_document(measured_events, prediction: Prediction | None) -> dict:
    events = list(measured_events)
    if prediction is not None:
        events += predicted_events(prediction, _first_step_us(events))
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "fxacct", "predicted": prediction is not None}}


__all__ = ["trace_document", "predicted_events"]
