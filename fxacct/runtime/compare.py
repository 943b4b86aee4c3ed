"""The comparison: predicted (fxacct.predict.roofline, fxacct.memory) beside measured (fxacct.runtime.run),
per module, per node and in total. Ratios are measured / predicted (above 1: slower or bigger than
predicted). Achieved FLOP/s are the account's FLOPs over the measured time; MFU (model FLOPs
utilization, Chowdhery et al., PaLM, 2022, §B) uses model FLOPs only, matmul + attention, over the
measured step time and the device's matmul peak for the compute dtype."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fxacct.devices import DEVICES
from fxacct.predict.roofline import DeviceModel, Prediction, for_local, from_gpu
from fxacct.runtime.run import Measured


@dataclass(frozen=True)
class Row:
    name: str  # module FQN ("" is the root) or node name
    op: str  # the node's op; "" for a module
    depth: int  # module nesting depth; 0 for a node
    flops: int  # forward + backward (forward only for inference), all classes
    predicted_s: float | None
    measured_s: float | None

    @property
    def ratio(self) -> float | None:
        if self.predicted_s is None or self.measured_s is None or self.predicted_s <= 0:
            return None
        return self.measured_s / self.predicted_s

    @property
    def achieved_flops_per_s(self) -> float | None:
        return self.flops / self.measured_s if self.measured_s else None


@dataclass(frozen=True)
class Comparison:
    modules: tuple[Row, ...]
    nodes: tuple[Row, ...]
    predicted: dict  # "step", "forward" (with the loss), "backward", "optimizer" -> seconds; {} if none
    predicted_peak_bytes: int | None  # peak_train_bytes (peak_inference_bytes for inference)
    model_flops: int  # matmul + attention of the measured step
    peak_flops_per_s: float | None  # the MFU denominator
    peak_source: str

    def ratio(self, measured: float | None, key: str) -> float | None:
        p = self.predicted.get(key)
        return measured / p if measured is not None and p else None


def mfu_peak(kind: str, gpu: str | None, dtype: torch.dtype) -> tuple[float | None, str]:
    """The MFU denominator: the datasheet matmul peak of a known GPU; else the calibrated rate."""
    device: DeviceModel | None = None
    if kind == "cuda" and gpu in DEVICES:
        device = from_gpu(DEVICES[gpu])
    else:
        device = for_local(kind, gpu)
    if device is None:
        return None, "not calibrated"
    return device.matmul_peak(dtype), device.source


def compare(profile, prediction: Prediction | None, measured: Measured, gpu: str | None) -> Comparison:
    a, c, t = profile.accounting, profile.config, profile.accounting.totals
    inference = measured.inference
    j = measured.join

    def flops_of(fwd, bwd) -> int:
        return fwd.total if inference else fwd.total + bwd.total

    def predicted_of(pair) -> float | None:
        if pair is None:
            return None
        return pair[0] if inference else pair[0] + pair[1]

    def measured_of(pair) -> float | None:
        if pair is None or pair[0] is None:
            return None
        return pair[0] if inference else pair[0] + (pair[1] or 0.0)

    modules = tuple(
        Row(m.module, "", m.depth, flops_of(m.forward, m.backward),
            predicted_of(prediction.by_module.get(m.module)) if prediction else None,
            measured_of(j.modules.get(m.module)) if j else None)
        for m in a.modules)
    nodes = tuple(
        Row(n.name, n.op, 0, flops_of(n.forward, n.backward),
            predicted_of(prediction.by_node.get(n.name)) if prediction else None,
            measured_of(j.nodes.get(n.name)) if j else None)
        for n in a.nodes if n.op != "input")
    predicted = {}
    if prediction is not None:
        ph = prediction.by_phase
        if inference:
            predicted = {"step": ph["forward"], "forward": ph["forward"], "backward": 0.0, "optimizer": 0.0}
        else:
            predicted = {"step": prediction.step_s, "forward": ph["forward"] + ph["loss"],
                         "backward": ph["backward"], "optimizer": ph["optimizer"]}
    m = profile.memory
    peak = (m.peak_inference if inference else m.rank_peak)
    model_flops = (t.forward.matmul + t.forward.attention) if inference else t.model_flops
    dtype = c.amp or c.dtype or torch.float32
    kind = "cuda" if measured.device.startswith("cuda") else "cpu"
    peak_flops, source = mfu_peak(kind, gpu, dtype)
    return Comparison(modules, nodes, predicted, peak.bytes if peak is not None else None, model_flops,
                      peak_flops, source)


def achieved_flops_per_s(comparison: Comparison, measured: Measured) -> float | None:
    return comparison.model_flops / measured.step_s if measured.step_s else None


def mfu(comparison: Comparison, measured: Measured) -> float | None:
    achieved = achieved_flops_per_s(comparison, measured)
    if achieved is None or not comparison.peak_flops_per_s:
        return None
    return achieved / comparison.peak_flops_per_s


__all__ = ["Row", "Comparison", "compare", "mfu", "achieved_flops_per_s", "mfu_peak"]
