"""Predicted time: a roofline estimate per op of the captured step, summed per node, module and phase.

For every op node of the training graph (forward, loss, backward, optimizer):

    t_compute = (matmul + attention FLOPs) / P_mm(dtype) + other FLOPs / P_other
    t_memory  = (bytes read + bytes written) / bandwidth
    t         = max(t_compute, t_memory)                    (Williams et al., "Roofline", CACM 2009)

on a GPU, whose memory system streams while the cores compute. On a calibrated CPU the two add
up, t = t_compute + t_memory (the no-overlap bound of the ECM model, Hager et al., CCPE 2016):
measured here, the MLP example's skinny matmuls, whose weights stream from DRAM once per step,
ran at about half their in-cache rate, and the sum brought the step's prediction from 1.35× to
1.21× of measured (bench/calibrated_cpu.py).

- A GPU of the table (--gpu): every op takes its achievable time from fxacct.predict.gpu_kernels
  instead (GEMMs with tile and wave quantization at cuBLAS's measured share of the peak, attention
  at its backend's published rate, memory-bound ops at a measured share of the bandwidth); the
  plain roofline below (datasheet peaks: bf16, fp16, fp8 on tensor cores, fp32 matmuls at the fp32
  rate, convolutions at TF32) remains op_seconds's, for a DeviceModel without ``gpu``.
- P_mm on a calibrated device (fxacct.predict.calibration; measured by fxacct.tools.calibrate): the rate measured for matmuls whose smallest
  dimension is the op's (log-linear between the calibrated ones), since a skinny matmul runs
  below the square rate; P_other is the measured fp32 square rate (ops of the other class are
  memory-bound there).
- bytes: every tensor input read once and every output written once (numel × element size); a
  view moves nothing and takes no time. For a gather (embedding, index) this counts the whole
  table read: an upper bound.
- bandwidth: the datasheet's DRAM figure on a GPU. On a calibrated CPU, the rate measured for
  streaming a footprint the size of the step's working set (its predicted peak bytes;
  log-linear between the calibrated sizes, clamped at the ends): a step whose tensors all fit in
  the last-level cache streams from it, a larger one from DRAM, even for its small ops, because
  what an op reads was evicted since its last use by the rest of the step (the "working set"
  reading of the cache-aware roofline, Ilic et al., IEEE CAL 2014). Measured here: the MLP
  example at batch 64 (545 MiB) runs AdamW at ~27 GB/s, the DRAM rate, although each of its
  ops touches only 32-64 MiB, which stream at ~55 GB/s from the cache in isolation.
- An op the optimizer step repeats for parameters of one shape (node.meta["repeat"]) counts that
  many times. The capture steps the optimizer once from scratch, so it creates the optimizer state
  (``zeros_like``); a steady-state step does not, and those creations take no time here (INIT).
  A creation op (zeros, ones_like...) writes its output and reads nothing.
- Per-op overhead: every op (a view too: it is dispatched) but the state init also costs a fixed
  ``op_overhead_s``, added to its time and reported as its own line (ops × overhead): on a GPU of the
  table the kernel launch latency (fxacct.devices.LAUNCH_S, sourced there), on a calibrated
  device what an op of a small model's training step costs beyond this roofline, by the op's phase
  (forward with the loss, backward, optimizer: fxacct.tools.calibrate ``dispatch_s_by_phase``), a
  view the trivial op's dispatch alone (``view_overhead_s``); on a GPU of the table a view launches
  no kernel and costs nothing. A small model's step is mostly this
  (issue 10: a small CNN ran 4.7× and its optimizer 51× slower than the roofline without it).
- A non-matmul kernel the calibration timed (batch norm, max-pool, layer norm, softmax, GELU and
  their backward, dropout's mask: fxacct.tools.microbench.kernels) takes bytes / its measured rate instead: on
  a CPU these run far below the streaming rate (measured here: max-pool 0.7 GB/s, batch norm
  3.3 GB/s, against ~20 GB/s for a copy of the same size).
- Convolutions on a calibrated device run at the rate measured for their channel count (the
  smaller of in and out channels, log-linear between the calibrated ones; the backward at its
  own), else at P_mm.
- An op with a calibrated fixed cost per call (convolutions and the kernels above:
  fxacct.tools.calibrate ``op_latency_s``) adds it to its time: the α of t = α + work / rate.
- No overlap between ops.

Attribution is the annotation's (fxacct.account.annotate): each op's time goes to its owner, the
forward node its FLOPs belong to; loss and optimizer ops belong to no node. Module times are
inclusive, like the module FLOPs."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxacct.account.rollup import inclusive
from fxacct.devices import DEVICES, LAUNCH_SOURCE, Device, get_device
from fxacct.load.config import Config
from fxacct.predict import calibration, gpu_kernels
from fxacct.trace.capture import BACKWARD, FORWARD, LOSS, OPTIMIZER, tensor_metas
from fxacct.trace.graph_builder import target_name, trace_of

PHASES = (FORWARD, LOSS, BACKWARD, OPTIMIZER)
# what bounds an op; FREE: a view; INIT: creates optimizer state (not in a steady-state step)
COMPUTE, MEMORY, FREE, INIT = "compute", "memory", "free", "state init"


@dataclass(frozen=True)
class DeviceModel:
    """Peak rates a prediction divides by. ``matmul_flops_per_s``: dtype key ("float32", "tf32",
    "bfloat16", "float16", "float8") -> FLOP/s for the matmul and attention classes."""

    name: str
    matmul_flops_per_s: dict
    other_flops_per_s: float  # FLOP/s of pointwise ops, reductions, norms...
    bandwidth_bytes_per_s: float
    source: str  # datasheet, or the calibration file and date
    tf32_convolutions: bool = False  # cuDNN runs fp32 convolutions in TF32 by default
    bandwidth_curve: tuple = ()  # ((footprint bytes, bytes/s), ...) ascending; () -> the flat figure
    matmul_curves: dict = dataclasses.field(default_factory=dict)  # dtype key -> ((smallest dim, FLOP/s), ...)
    overlap: bool = True  # compute and memory traffic overlap (GPU); False: they add up (CPU)
    op_overhead_s: float = 0.0  # seconds every op costs besides its FLOPs and bytes
    overhead_source: str = ""
    conv_curves: dict = dataclasses.field(default_factory=dict)  # dtype key -> ((channels, FLOP/s), ...)
    kernel_rates: dict = dataclasses.field(default_factory=dict)  # str(aten op) -> bytes/s (calibrated)
    conv_backward_curves: dict = dataclasses.field(default_factory=dict)  # as conv_curves, for the backward
    op_latency: dict = dataclasses.field(default_factory=dict)  # str(aten op) -> fixed s per call (calibrated)
    overhead_by_phase: dict = dataclasses.field(default_factory=dict)  # PHASES key -> s per op (else op_overhead_s)
    view_overhead_s: float | None = None  # s per view op (dispatch alone); None: a view pays as any op
    gpu: Device | None = None  # a --gpu entry: ops take its achievable rates (fxacct.predict.gpu_kernels)

    def overhead(self, phase: str) -> float:
        """Seconds of per-op overhead of an op of ``phase`` (the loss's ops are the forward's)."""
        return self.overhead_by_phase.get(FORWARD if phase == LOSS else phase, self.op_overhead_s)

    def bandwidth(self, nbytes: int) -> float:
        """Bytes/s when streaming over a footprint of ``nbytes``."""
        return _log_linear(self.bandwidth_curve, nbytes) if self.bandwidth_curve else self.bandwidth_bytes_per_s

    def matmul_peak(self, dtype: torch.dtype | None, convolution: bool = False, min_dim: int | None = None,
                    backward: bool = False) -> float:
        key = str(dtype).removeprefix("torch.") if dtype is not None else "float32"
        if key.startswith("float8"):
            key = "float8"
        if key == "float32" and convolution and self.tf32_convolutions and "tf32" in self.matmul_flops_per_s:
            key = "tf32"
        if key not in self.matmul_flops_per_s:
            key = "float32"
        curves = self.matmul_curves
        if convolution:
            curves = self.conv_backward_curves if backward and key in self.conv_backward_curves else self.conv_curves
        curve = curves.get(key)
        if min_dim and curve:
            return _log_linear(curve, min_dim)
        return self.matmul_flops_per_s[key]


def _log_linear(curve, x: float) -> float:
    """y at x on ((x, y), ...) ascending: linear in log x between points, clamped at the ends."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
        if x <= x1:
            return y0 + math.log(x / x0) / math.log(x1 / x0) * (y1 - y0)
    return curve[-1][1]


def from_gpu(device: Device) -> DeviceModel:

    return DeviceModel(device.name, dict(device.peak_flops), device.peak_flops["float32"], device.bandwidth,
                       f"datasheet: {device.source}", tf32_convolutions=True, op_overhead_s=device.launch_s,
                       overhead_source=f"kernel launch, {LAUNCH_SOURCE}",
                       # a view changes a tensor's metadata on the host and launches no kernel: the
                       # GPU's stream does not wait for it (the host runs ahead of the stream)
                       view_overhead_s=0.0, gpu=device)


def from_calibration(cal, profiled: bool = False) -> DeviceModel:
    """A device model from a fxacct.predict.calibration.Calibration (measured, not datasheet, rates);
    ``profiled``: with the per-op overhead measured under torch.profiler, for a runtime run's
    comparison (the run is timed under the profiler)."""
    overhead = cal.dispatch_s_per_op
    what = "dispatch" if cal.kind == "cpu" else "dispatch and launch"
    if profiled and cal.profiled_dispatch_s_per_op:
        overhead, what = cal.profiled_dispatch_s_per_op, what + " under torch.profiler"
    rates = dict(cal.matmul_flops_per_s)
    curve = tuple(sorted((int(k), v) for k, v in cal.bandwidth_by_bytes.items()))
    matmul = {key: tuple(sorted((int(d), r) for d, r in by.items())) for key, by in cal.matmul_by_min_dim.items()}
    conv = {key: tuple(sorted((int(c), r) for c, r in by.items())) for key, by in cal.convolution_by_channels.items()}
    return DeviceModel(cal.name, rates, rates["float32"], cal.bandwidth_bytes_per_s,
                       f"calibrated {cal.measured_at} ({cal.threads} threads, torch {cal.torch_version})",
                       tf32_convolutions=cal.kind == "cuda", bandwidth_curve=curve, matmul_curves=matmul,
                       overlap=cal.kind != "cpu", op_overhead_s=overhead or 0.0,
                       overhead_source=(f"{what}, calibrated {cal.measured_at}" if overhead
                                        else "not calibrated (a profile from before fxacct measured it)"),
                       conv_curves=conv, kernel_rates=dict(cal.kernel_bytes_per_s),
                       conv_backward_curves={key: tuple(sorted((int(c), r) for c, r in by.items()))
                                             for key, by in cal.convolution_backward_by_channels.items()},
                       op_latency=dict(cal.op_latency_s),
                       overhead_by_phase={} if profiled else dict(cal.dispatch_s_by_phase),
                       view_overhead_s=None if profiled else cal.view_s_per_op)


def for_config(config: Config) -> DeviceModel | None:
    """The target of a static profile: --gpu's datasheet entry, else this CPU if calibrated, else None."""
    if config.gpu is not None:
        return from_gpu(dataclasses.replace(get_device(config.gpu), sdpa_backend=config.sdpa_backend))
    cal = calibration.load("cpu")
    return from_calibration(cal) if cal is not None else None


def gpu_key(name: str) -> str | None:
    """The fxacct.devices key of a GPU as torch.cuda.get_device_name() names it, or None."""
    n = name.lower()
    if "h200" in n:
        return "h200"
    if "h100" in n:
        return "h100-pcie" if "pcie" in n else "h100-96gb" if "96gb" in n else "h100"
    if "a100" in n:
        return "a100-40gb" if "40gb" in n else "a100"
    return next((k for k in ("b200", "l40s") if k in n), None)


def for_local(kind: str, gpu: str | None = None, profiled: bool = False, sdpa_backend: str = "auto") -> DeviceModel | None:
    """The device a runtime run executes on: its calibration if stored (``profiled``: its per-op
    overhead under torch.profiler), else (CUDA) the datasheet entry of ``gpu`` (a DEVICES key)
    with attention on ``sdpa_backend`` (the run forces it: fxacct.runtime.run), else None."""
    cal = calibration.load(kind)
    if cal is not None:
        return from_calibration(cal, profiled)
    if kind == "cuda" and gpu in DEVICES:
        return from_gpu(dataclasses.replace(DEVICES[gpu], sdpa_backend=sdpa_backend))
    return None


@dataclass(frozen=True)
class OpTime:
    node: str  # graph node name
    op: str
    phase: str
    module: str
    owner: str | None  # the forward node the time is attributed to (None: loss, optimizer)
    flops: int  # all classes, times the repeat count
    bytes: int  # read + written, times the repeat count
    seconds: float  # roofline time + overhead_s, times the repeat count
    bound: str  # COMPUTE, MEMORY or FREE
    overhead_s: float = 0.0  # the per-op overhead in seconds, times the repeat count
    calls: int = 1  # the repeat count: how many ops pay the overhead
    kernel: str = ""  # on a --gpu: the kernel model's kind ("gemm 128x128, 2 waves", "memory"...)
    peak_fraction: float | None = None  # on a --gpu: the share of the datasheet peak it achieves


@dataclass(frozen=True)
class Prediction:
    device: DeviceModel
    ops: tuple[OpTime, ...]  # every op of the step, in program order
    by_phase: dict  # phase -> seconds
    by_node: dict  # forward node name -> (forward s, backward s)
    by_module: dict  # module FQN -> (forward s, backward s), inclusive

    @property
    def step_s(self) -> float:
        return sum(self.by_phase.values())

    @property
    def overhead_s(self) -> float:
        """The per-op overhead of the step (inside the phase times)."""
        return sum(op.overhead_s for op in self.ops)

    @property
    def overhead_ops(self) -> int:
        """How many ops pay the per-op overhead."""
        return sum(op.calls for op in self.ops if op.overhead_s)

    @property
    def step_ms(self) -> float:
        return 1e3 * self.step_s

    @property
    def inference_s(self) -> float:
        """The forward alone (the training graph's forward: dropout and such ops included)."""
        return self.by_phase[FORWARD]


def op_bytes(node: fx.Node, creation: bool = False) -> int:
    written = sum(t.nbytes for t in tensor_metas(node.meta.get("val")))
    if creation:
        return written
    return written + sum(t.nbytes for n in node.all_input_nodes for t in tensor_metas(n.meta.get("val")))


def _dtype(node: fx.Node) -> torch.dtype | None:
    for n in node.all_input_nodes:
        for t in tensor_metas(n.meta.get("val")):
            if t.dtype.is_floating_point:
                return t.dtype
    out = tensor_metas(node.meta.get("val"))
    return out[0].dtype if out else None


def matmul_dtype(graph: fx.Graph) -> torch.dtype:
    """The dtype the step's matmuls and attention run in, as traced (under autocast or a
    MixedPrecisionPolicy the parameters' dtype is not it): the input dtype carrying the most
    matmul + attention FLOPs; float32 for a graph with none. MFU divides by this dtype's peak."""
    flops: dict[torch.dtype, int] = {}
    for node in graph.nodes:
        cost = node.meta.get("fxacct")
        if node.op != "call_function" or cost is None or not (cost.flops.matmul + cost.flops.attention):
            continue
        dtype = _dtype(node) or torch.float32
        flops[dtype] = flops.get(dtype, 0) + cost.flops.matmul + cost.flops.attention
    return max(flops, key=flops.get) if flops else torch.float32


def min_dim(node: fx.Node) -> int | None:
    """The smallest of m, k, n of a matmul (the last two dims of its first two ≥2-d tensor inputs;
    for attention q·kᵀ, the query length, key length and head dim); for a convolution the smaller of
    its weight's out and in channels (aten.convolution's args[1], convolution_backward's args[2])."""
    if "convolution" in target_name(node.target):
        i = 2 if "backward" in target_name(node.target) else 1
        weight = node.args[i] if len(node.args) > i and isinstance(node.args[i], fx.Node) else None
        shapes = [t.shape for t in tensor_metas(weight.meta.get("val"))] if weight is not None else []
        return min(shapes[0][:2]) if shapes and len(shapes[0]) >= 2 else None
    mats = [t.shape for n in node.all_input_nodes for t in tensor_metas(n.meta.get("val")) if len(t.shape) >= 2][:2]
    dims = [d for shape in mats for d in shape[-2:]]
    return min(dims) if dims else None


def op_seconds(flops, nbytes: int, dtype: torch.dtype | None, device: DeviceModel,
               convolution: bool = False, bandwidth: float | None = None,
               smallest: int | None = None, backward: bool = False) -> tuple[float, str]:
    """(seconds, bound) of one op: max(compute, memory) of the roofline; ``bandwidth`` in bytes/s
    (default: the device's DRAM figure); ``smallest``: the matmul's smallest dimension;
    ``backward``: a convolution's backward (its own calibrated curve)."""
    compute = ((flops.matmul + flops.attention) / device.matmul_peak(dtype, convolution, smallest, backward)
               + flops.other / device.other_flops_per_s)
    memory = nbytes / (bandwidth or device.bandwidth_bytes_per_s)
    bound = COMPUTE if compute >= memory else MEMORY
    return (max(compute, memory) if device.overlap else compute + memory), bound


def _owner(cost) -> str | None:
    """The forward node an op's time is attributed to, as the annotation decided (None: loss, optimizer)."""
    return cost.owner if cost.phase in (FORWARD, BACKWARD) else None


def _op_time(node: fx.Node, cost, device: DeviceModel, state_storages: frozenset, bandwidth: float) -> OpTime:
    """One op's roofline time, attributed to the owner the annotation decided."""
    outputs = tensor_metas(node.meta.get("val"))
    overhead = device.overhead(cost.phase)
    what, fraction = "", None
    if cost.kind == "view":
        seconds, bound, nbytes = 0.0, FREE, 0
        if device.view_overhead_s is not None:
            overhead = device.view_overhead_s
    elif cost.phase == OPTIMIZER and cost.kind == "creation" and outputs and all(
            t.storage in state_storages for t in outputs):
        seconds, bound, nbytes, overhead = 0.0, INIT, 0, 0.0
    else:
        nbytes = op_bytes(node, cost.kind == "creation")
        smallest = min_dim(node) if cost.flops.matmul or cost.flops.attention else None
        kernel = device.kernel_rates.get(target_name(node.target)) if smallest is None else None
        if device.gpu is not None:  # a GPU of the table: kernels at their achievable rates
            timed = gpu_kernels.op_time(node, cost.flops, nbytes, _dtype(node), device.gpu)
            seconds, bound, what, fraction = timed.seconds, timed.bound, timed.kernel, timed.peak_fraction
        elif kernel:  # a calibrated kernel: its own measured rate, arithmetic included
            seconds, bound = nbytes / kernel, MEMORY
        else:
            target = target_name(node.target)
            seconds, bound = op_seconds(cost.flops, nbytes, _dtype(node), device, "convolution" in target,
                                        bandwidth, smallest, "convolution_backward" in target)
        seconds += device.op_latency.get(target_name(node.target), 0.0)
    return OpTime(node.name, target_name(node.target), cost.phase, cost.module, _owner(cost), cost.flops.total * cost.repeat,
                  nbytes * cost.repeat, (seconds + overhead) * cost.repeat, bound, overhead * cost.repeat,
                  cost.repeat, what, fraction)


def predict(graph: fx.Graph, device: DeviceModel, state_storages: frozenset = frozenset(),
            working_set_bytes: int | None = None) -> Prediction:
    """Roofline times of every op of an annotated training graph. ``state_storages``: storage ids
    of the optimizer state (capture.optimizer_state keys); ``working_set_bytes``: the step's
    footprint, which picks the bandwidth (module docstring; None: the DRAM figure)."""
    bandwidth = device.bandwidth(working_set_bytes) if working_set_bytes else device.bandwidth_bytes_per_s
    repeated: dict[int, OpTime] = {}  # template record -> its first replica's time (annotate's memo)
    ops = []
    for node in graph.nodes:
        cost = node.meta.get("fxacct")
        if node.op != "call_function" or cost is None:
            continue
        origin = trace_of(node).origin
        first = repeated.get(id(origin)) if origin is not None else None
        if first is None:
            op = _op_time(node, cost, device, state_storages, bandwidth)
            if origin is not None:
                repeated[id(origin)] = op
        else:  # the same op on the same shapes: its seconds, under this node's name and owner
            op = OpTime(node.name, first.op, first.phase, cost.module, _owner(cost), first.flops, first.bytes,
                        first.seconds, first.bound, first.overhead_s, first.calls, first.kernel, first.peak_fraction)
        ops.append(op)
    return assemble(device, graph, ops)


def assemble(device: DeviceModel, graph: fx.Graph, ops) -> Prediction:
    """The Prediction of ``ops`` (OpTimes of ``graph``'s nodes, in program order): their seconds
    summed by phase, by owning forward node and by module (inclusive)."""
    by_phase = {p: 0.0 for p in PHASES}
    by_node: dict[str, list[float]] = {}
    module_of: dict[str, str] = {}
    for node in graph.nodes:
        cost = node.meta.get("fxacct")
        if cost is not None and cost.owner == node.name:
            by_node[node.name] = [0.0, 0.0]
            module_of[node.name] = cost.module
    for op in ops:
        by_phase[op.phase] += op.seconds
        if op.owner is not None:
            by_node[op.owner][0 if op.phase == FORWARD else 1] += op.seconds
    by_module = inclusive((module_of[name], tuple(v)) for name, v in by_node.items())
    return Prediction(device, tuple(ops), by_phase, {k: tuple(v) for k, v in by_node.items()}, by_module)


__all__ = ["DeviceModel", "Prediction", "OpTime", "predict", "assemble", "for_config", "for_local",
           "from_gpu", "from_calibration", "gpu_key", "op_seconds", "op_bytes", "PHASES", "COMPUTE", "MEMORY",
           "FREE", "INIT"]
