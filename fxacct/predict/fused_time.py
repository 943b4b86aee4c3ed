"""The prediction of a profile (predict_profile), and for a compiled step (--compile,
--compile-blocks) inductor's kernels instead of its ops.

A node of a compiled region that the fusion model (fxacct.trace.fusion) puts in a fused kernel
pays no time of its own: each kernel pays once, ``op_seconds`` of the FLOPs of its ops (all
classes, as fxacct.costs counts them) and of the bytes it moves (what it reads from outside and
writes for outside, each tensor once), on a GPU of the table at its achievable rates
(fxacct.predict.gpu_kernels.op_time), plus one per-op overhead of its phase; a view inside a
compiled region is index arithmetic (no time). Every other op (extern kernels, the loss, the
optimizer, eager code outside the regions) keeps the roofline time fxacct.predict.roofline gave it.
"""

from __future__ import annotations

from dataclasses import replace

import torch.fx as fx

from fxacct.costs.registry import Flops
from fxacct.predict import gpu_kernels
from fxacct.predict.roofline import DeviceModel, Prediction, assemble, for_config, op_seconds, predict
from fxacct.trace.fusion import FREE
from fxacct.trace.records import tensor_metas


def _node_seconds(prediction: Prediction, graph: fx.Graph, kernel_of: dict, kernel_bytes: dict) -> dict[str, float]:
    """{node: seconds} with the compiled regions' fused kernels (module docstring): each kernel's
    time on the last of its nodes, its other nodes and views 0, every other op its own time."""
    device = prediction.device
    nodes = {n.name: n for n in graph.nodes}
    seconds: dict[str, float] = {}
    kernels: dict[tuple, list] = {}  # key -> [Flops, dtype, phase, last node]
    for op in prediction.ops:
        key = kernel_of.get(op.node)
        if key is None:
            seconds[op.node] = seconds.get(op.node, 0.0) + op.seconds
            continue
        seconds.setdefault(op.node, 0.0)
        if key[1] == FREE:
            continue
        node = nodes[op.node]
        metas = tensor_metas(node.meta.get("val"))
        entry = kernels.setdefault(key, [Flops(), metas[0].dtype if metas else None, op.phase, node])
        entry[0], entry[3] = entry[0] + node.meta["fxacct"].flops, node
    for key, (flops, dtype, phase, last) in kernels.items():
        if device.gpu is not None:  # a GPU of the table: the kernel at its achievable rates
            kernel_s = gpu_kernels.op_time(last, flops, kernel_bytes[key], dtype, device.gpu).seconds
        else:
            kernel_s, _ = op_seconds(flops, kernel_bytes[key], dtype, device)
        seconds[last.name] += kernel_s + device.overhead(phase)
    return seconds


def fused(prediction: Prediction, graph: fx.Graph, kernel_of: dict, kernel_bytes: dict) -> Prediction:
    """``prediction`` with each op's time as _node_seconds gives it (a fused kernel's time on its
    last node, launch overhead included); the mesh's critical path (fxacct.parallel.timing) takes
    its op times as it takes the per-op ones."""
    seconds = _node_seconds(prediction, graph, kernel_of, kernel_bytes)
    device = prediction.device
    ops = []
    for op in prediction.ops:
        if op.node in kernel_of:
            paid = seconds[op.node] > 0  # the last node of its kernel: the kernel's launch
            op = replace(op, seconds=seconds[op.node], overhead_s=device.overhead(op.phase) if paid else 0.0,
                         calls=1 if paid else 0)
        ops.append(op)
    return assemble(device, graph, ops)


def predict_capture(cap, device: DeviceModel, working_set_bytes: int | None) -> Prediction:
    """The roofline over a Capture's graph on ``device``; a compiled step's regions (--compile,
    --compile-blocks) as fused kernels. One device's profile and a rank's step schedule
    (fxacct.parallel.timing) both predict through it."""
    state = frozenset(s.key for s in cap.optimizer_state)
    prediction = predict(cap.graph, device, state, working_set_bytes)
    return fused(prediction, cap.graph, cap.kernel_of, cap.kernel_bytes) if cap.kernel_of else prediction


def predict_profile(profile, device: DeviceModel | None = None) -> Prediction | None:
    """The prediction for a fxacct.Profile on ``device`` (default: for_config(profile.config));
    None when there is no device model (a CPU that was never calibrated)."""
    device = device or for_config(profile.config)
    if device is None:
        return None
    peak = profile.memory.rank_peak
    return predict_capture(profile.capture, device, peak.bytes if peak is not None else None)
