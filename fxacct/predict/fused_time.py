"""The roofline step time of a compiled step (--compile): inductor's kernels instead of its ops.

A node of a compiled region that the fusion model (fxacct.trace.fusion) puts in a fused kernel
pays no time of its own: each kernel pays once, ``op_seconds`` of the FLOPs of its ops (all
classes, as fxacct.costs counts them) and of the bytes it moves (what it reads from outside and
writes for outside, each tensor once), plus one per-op overhead of its phase; a view inside a
compiled region is index arithmetic (no time). Every other op (extern kernels, the loss, the
optimizer, eager code outside the regions) keeps the roofline time fxacct.predict.roofline gave it.
"""

from __future__ import annotations

import torch.fx as fx

from fxacct.costs.registry import Flops
from fxacct.predict.roofline import Prediction, op_seconds
from fxacct.trace.fusion import FREE
from fxacct.trace.records import tensor_metas


def fused_step_ms(prediction: Prediction, graph: fx.Graph, kernel_of: dict, kernel_bytes: dict) -> float:
    """The step time in ms with the compiled regions' fused kernels (module docstring)."""
    device = prediction.device
    nodes = {n.name: n for n in graph.nodes}
    seconds = 0.0
    kernels: dict[tuple, list] = {}  # key -> [Flops, dtype, phase]
    for op in prediction.ops:
        key = kernel_of.get(op.node)
        if key is None:
            seconds += op.seconds
            continue
        if key[1] == FREE:
            continue
        node = nodes[op.node]
        metas = tensor_metas(node.meta.get("val"))
        entry = kernels.setdefault(key, [Flops(), metas[0].dtype if metas else None, op.phase])
        entry[0] = entry[0] + node.meta["fxacct"].flops
    for key, (flops, dtype, phase) in kernels.items():
        kernel_s, _ = op_seconds(flops, kernel_bytes[key], dtype, device)
        seconds += kernel_s + device.overhead(phase)
    return 1e3 * seconds
