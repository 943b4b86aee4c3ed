"""The microbenchmarks behind `fxacct calibrate` (fxacct.tools.calibrate documents what each
measures and why). Each returns rates and the relative spread of its repeated rounds.

Repetition: a round is the fastest of repetitions that fill a time budget (at least 3), after one
warm-up: on a shared machine other work only ever slows a repetition down, so the fastest is the
device's own rate. Rounds repeat until the two fastest agree within ``STABLE_REL`` (at most
``MAX_ROUNDS``); the figure is the fastest round, and ``spread`` = (slowest − fastest) / fastest over
the rounds says how much the machine disturbed it.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.utils.benchmark as benchmark
from torch.profiler import ProfilerActivity, profile

from fxacct.trace import torch_private as tp

STABLE_REL = 0.05  # two rounds within 5% of each other: stable, no more rounds
# the two fastest rounds further apart than this refuse the calibration (fxacct.tools.calibrate): a
# poisoned figure is off by multiples (issue 22: a 0.000 TFLOP/s square, "0 s" latencies), while a
# kernel timed on all of a small machine's threads moves 5-10% between rounds of an idle machine
# (two fp16 skinny products 9% apart on this project's 2-core machines)
SETTLED_REL = 0.10
# rounds before a figure is given up as unsettled (which refuses the calibration: fxacct.tools.calibrate):
# on a lightly disturbed machine more rounds find two that agree; a busy one stays unsettled
MAX_ROUNDS = 8
MAX_REPS = 200
TINY_LAYERS = 8  # Linear + ReLU pairs of the small model whose training step times the per-op overhead
# its width and batch: (256, 64) float32 activations, 64 KiB, the size a small model's ops work on (the
# examples' small configs: 8 × 32 tokens × 64 = 16K elements); on a few elements (Linear(4, 4), batch 2)
# an op skips what such an op pays besides its arithmetic (allocation, OpenMP's parallel region,
# autograd's buffers): measured here 3.5 µs against 10 µs per forward op beyond the roofline
TINY_WIDTH, TINY_BATCH = 64, 256
# convolution: 3×3, stride 1, padding 1, batch 8, on (channels, image side): the channel counts of
# small CNNs (8-32) up to a ResNet stage (128); the image shrinks as channels grow, as in a CNN
CONV_SHAPES = ((8, 32), (32, 32), (128, 16))
# the first class again on an image 16× smaller: the two fix a convolution's fixed cost per call
# (fit_latency), which a small convolution mostly is
CONV_SMALL = (8, 8)
KERNEL_SIDES = (32, 8)  # image side of the training-kernel cases: 1 MiB and 64 KiB activations
ATTENTION_LENGTHS = (8, 32)  # query lengths of the attention cases (small models' contexts)


class Timer:
    """Seconds of one fn() call, timed by torch.utils.benchmark.Timer (which synchronizes CUDA
    around the statement); one benchmark timer per function, reused across its repetitions. At the
    process's torch thread count when the timer is made: benchmark.Timer runs its statement on
    ``num_threads`` threads, 1 unless told, while the steps a calibration predicts run on
    torch.get_num_threads() (the count the calibration records)."""

    def __init__(self, kind: str):
        self.kind = kind
        self._timers: dict[int, tuple[Callable[[], object], benchmark.Timer]] = {}

    def __call__(self, fn: Callable[[], object]) -> float:
        held = self._timers.get(id(fn))
        if held is None or held[0] is not fn:
            held = self._timers[id(fn)] = (fn, benchmark.Timer(stmt="fn()", globals={"fn": fn},
                                                               num_threads=torch.get_num_threads()))
        return held[1].timeit(1).mean


@dataclass(frozen=True)
class Timing:
    seconds: float  # the fastest round
    spread: float  # (slowest round − fastest) / fastest
    rounds: int
    stable: bool  # the two fastest rounds agree within STABLE_REL
    apart: float | None = None  # (second fastest round − fastest) / fastest; None: not known

    @property
    def settled(self) -> bool:
        """The two fastest rounds agree within SETTLED_REL (stable, or not known to be apart by
        less): a figure a calibration may store."""
        return self.stable or (self.apart is not None and self.apart <= SETTLED_REL)


def best_of(timer, fn, budget_s: float) -> float:
    """The fastest seconds of fn() over repetitions that fill budget_s (at least 3), after one warm-up."""
    fn()
    times, spent = [], 0.0
    while len(times) < 3 or spent < budget_s:
        t = timer(fn)
        times.append(t)
        spent += t
        if len(times) >= MAX_REPS:
            break
    return min(times)


def stable(timer, fn, budget_s: float) -> Timing:
    """Rounds of best_of until the two fastest agree within STABLE_REL, at most MAX_ROUNDS."""
    bests = [best_of(timer, fn, budget_s / 2)]
    apart = float("inf")  # (second fastest − fastest) / fastest
    while len(bests) < MAX_ROUNDS and apart > STABLE_REL:
        bests.append(best_of(timer, fn, budget_s / 2))
        first, second = sorted(bests)[:2]
        apart = (second - first) / first
    first = min(bests)
    return Timing(first, (max(bests) - first) / first, len(bests), apart <= STABLE_REL, apart)


def _dtype(dtype_key: str) -> torch.dtype:
    return torch.float32 if dtype_key == "tf32" else getattr(torch, dtype_key)


class _TF32:
    """TF32 matmuls on for the "tf32" key only, restored afterwards."""

    def __init__(self, dtype_key: str):
        self.on = dtype_key == "tf32"

    def __enter__(self):
        self.was = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = self.on

    def __exit__(self, *exc):
        torch.backends.cuda.matmul.allow_tf32 = self.was


def square(kind: str, dtype_key: str, n: int, budget_s: float, timer=None) -> tuple[float, Timing]:
    """(FLOP/s, timing) of an n×n @ n×n product: 2·n³ FLOPs (n³ multiply-adds)."""
    timer = timer or Timer(kind)
    with _TF32(dtype_key):
        a = torch.randn(n, n, device=kind).to(_dtype(dtype_key))
        b = torch.randn(n, n, device=kind).to(_dtype(dtype_key))
        t = stable(timer, lambda: torch.mm(a, b), budget_s)
    return 2 * n**3 / t.seconds, t


def skinny(kind: str, dtype_key: str, d: int, n: int, budget_s: float, timer=None) -> tuple[float, Timing]:
    """(FLOP/s, timing) of a (d×n) @ (n×n) product: 2·d·n·n FLOPs."""
    timer = timer or Timer(kind)
    with _TF32(dtype_key):
        a = torch.randn(d, n, device=kind).to(_dtype(dtype_key))
        b = torch.randn(n, n, device=kind).to(_dtype(dtype_key))
        t = stable(timer, lambda: torch.mm(a, b), budget_s)
    return 2 * d * n * n / t.seconds, t


def convolution(kind: str, channels: int, side: int, budget_s: float, timer=None,
                backward: bool = False) -> tuple[float, Timing]:
    """(FLOP/s, timing) of a float32 3×3 convolution, batch 8, channels → channels on side×side
    images (stride 1, padding 1: the output is side×side): 2·8·C·C·9·side² FLOPs; ``backward``:
    its aten.convolution_backward for the input and weight gradients, twice those FLOPs
    (fxacct.costs.matmul.convolution_backward)."""
    timer = timer or Timer(kind)
    aten = torch.ops.aten
    x = torch.randn(8, channels, side, side, device=kind)
    w = torch.randn(channels, channels, 3, 3, device=kind)
    conv = (x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    if backward:
        g = aten.convolution.default(*conv)
        t = stable(timer, lambda: aten.convolution_backward.default(g, *conv[:2], [0], *conv[3:], [True, True, False]),
                   budget_s)
    else:
        t = stable(timer, lambda: aten.convolution.default(*conv), budget_s)
    return (2 if backward else 1) * 2 * 8 * channels * channels * 9 * side * side / t.seconds, t


def trivial(kind: str, budget_s: float, timer=None) -> tuple[float, Timing]:
    """(seconds, timing) of the smallest op, a 2×2 add: the share of an op's fixed cost that the
    per-op overhead (dispatch) already holds."""
    timer = timer or Timer(kind)
    a = torch.ones(2, 2, device=kind)
    t = stable(timer, lambda: torch.add(a, a), budget_s)
    return t.seconds, t


def fit_latency(small: tuple[float, float], large: tuple[float, float]) -> tuple[float, float]:
    """(rate, latency) of t = latency + work / rate through two (work, seconds) points of one op, the
    latency at least 0: the fixed cost per call and the rate of the work beyond it (the α-β model of
    Hockney, Parallel Computing 20, 1994). A large point no slower than the small one (noise) gives
    the large point's own rate and no latency."""
    (w0, t0), (w1, t1) = small, large
    if t1 <= t0 or w1 <= w0:
        return w1 / t1, 0.0
    rate = (w1 - w0) / (t1 - t0)
    latency = t0 - w0 / rate
    return (rate, latency) if latency > 0 else (w1 / t1, 0.0)


class _Tiny:
    """One training step of a small model (TINY_LAYERS × (Linear(TINY_WIDTH, TINY_WIDTH), ReLU) on
    TINY_BATCH rows, the float sum as loss, AdamW): ops on small-model activations, whose time is
    mostly per-op cost, paid the way a real step pays it (module calls, autograd recording, the
    backward engine, the optimizer's Python loop). fxacct.tools.calibrate_overhead takes the roofline's
    share out (its arithmetic and bytes) and keeps the rest per op."""

    def __init__(self, kind: str):
        torch.manual_seed(0)
        layers = [m for _ in range(TINY_LAYERS) for m in (torch.nn.Linear(TINY_WIDTH, TINY_WIDTH), torch.nn.ReLU())]
        self.model = torch.nn.Sequential(*layers).to(kind)
        self.optimizer = torch.optim.AdamW(self.model.parameters())
        self.x = torch.randn(TINY_BATCH, TINY_WIDTH, device=kind)

        self.kind, self.loss, self.splits = kind, None, []  # splits: (forward, backward, optimizer) s per step

    def forward(self) -> None:
        self.loss = self.model(self.x).float().sum()

    def backward(self) -> None:
        self.loss.backward()
        self.loss = None

    def optimize(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def __call__(self) -> None:
        # per-phase splits on the CPU only: on CUDA they would need a synchronize between phases,
        # which the timed step must not pay (the whole step's figure stands for every phase there)
        with torch.enable_grad():
            marks = [time.perf_counter()]
            for phase in (self.forward, self.backward, self.optimize):
                phase()
                marks.append(time.perf_counter())
        if self.kind == "cpu":
            self.splits.append(tuple(b - a for a, b in zip(marks, marks[1:])))


TINY_PHASES = ("forward", "backward", "optimizer")


@dataclass(frozen=True)
class TinyTiming:
    """The small model's training step: the whole step (its Timing: the fastest) and each phase's
    median time over the timed steps (CPU only; {} on CUDA)."""

    step: Timing
    phases: dict  # TINY_PHASES key -> seconds


def per_op(seconds: float, roofline_s: float, ops: int, floor_s: float) -> float:
    """Seconds per op of what a measured time holds beyond the roofline's share of it: (seconds −
    roofline_s) / ops, at least ``floor_s`` (the trivial op's time: no op costs less, and a roofline
    that over-predicts the model says nothing about its per-op cost)."""
    return max(floor_s, (seconds - roofline_s) / ops) if ops else floor_s


def dispatch(kind: str, budget_s: float, timer=None, profiled: bool = False) -> TinyTiming:
    """The small model's training step (_Tiny), timed: the whole step and, on the CPU, each phase
    (the forward's module calls and autograd recording, the backward engine, the optimizer's loop
    cost an op differently). ``profiled``: under torch.profiler (CPU activity and memory events),
    which records every op."""
    timer = timer or Timer(kind)
    step = _Tiny(kind)
    step()  # the optimizer state: a steady-state step follows
    step.splits.clear()
    tp.quiet_kineto()
    context = profile(activities=[ProfilerActivity.CPU], profile_memory=True) if profiled else contextlib.nullcontext()
    with context:
        t = stable(timer, step, budget_s)
    # per-op costs are software's (allocation, page faults, the autograd engine, Python): a typical
    # step pays them as the median step does, which is what the runtime mode measures of a model
    phases = {name: statistics.median(s[i] for s in step.splits) for i, name in enumerate(TINY_PHASES)} \
        if step.splits else {}
    return TinyTiming(t, phases)


def _moved(args, out) -> int:
    """Bytes an op moves as the roofline counts them: every distinct tensor input read once, every
    output written once, an in-place op's output too (fxacct.predict.roofline.op_bytes)."""
    inputs = {id(t): t for t in args if isinstance(t, torch.Tensor)}
    outputs = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]
    return sum(t.nbytes for t in inputs.values()) + sum(t.nbytes for t in outputs)


def _kernel_cases(kind: str, side: int = 32) -> dict:
    """{aten op: (args)} of the non-matmul training kernels a CPU runs far below its streaming
    rate (issue 10: in the small CNN, max-pool and batch norm took most of the forward, and
    dropout's random mask costs more than both of its neighbours), on float32
    activations of 8 × 32 × side² elements (side 32: 1 MiB): (8, 32, side, side) images, (2·side², 128) rows."""
    aten = torch.ops.aten
    x = torch.randn(8, 32, side, side, device=kind)
    c = torch.ones(32, device=kind)
    rows, w = torch.randn(2 * side * side, 128, device=kind), torch.ones(128, device=kind)
    y, mean, invstd = aten.native_batch_norm.default(x, c, c, c.clone(), c.clone(), True, 0.1, 1e-5)
    pooled, idx = aten.max_pool2d_with_indices.default(x, [2, 2], [2, 2])
    _, rmean, rstd = aten.native_layer_norm.default(rows, [128], w, w, 1e-5)
    soft = aten._softmax.default(rows, -1, False)
    return {
        aten.native_batch_norm.default: (x, c, c, c.clone(), c.clone(), True, 0.1, 1e-5),
        aten.native_batch_norm_backward.default: (y, x, c, c, c, mean, invstd, True, 1e-5, [True] * 3),
        aten.max_pool2d_with_indices.default: (x, [2, 2], [2, 2]),
        aten.max_pool2d_with_indices_backward.default: (pooled, x, [2, 2], [2, 2], [0, 0], [1, 1], False, idx),
        aten.threshold_backward.default: (y, x, 0.0),
        aten.native_layer_norm.default: (rows, [128], w, w, 1e-5),
        aten.native_layer_norm_backward.default: (rows, rows, [128], rmean, rstd, w, w, [True] * 3),
        aten._softmax.default: (rows, -1, False),
        aten._softmax_backward_data.default: (rows, soft, -1, torch.float32),
        aten.gelu.default: (rows,),
        aten.gelu_backward.default: (rows, rows),
        # dropout's mask in training (nn.Dropout on the CPU draws it in place): one random draw per
        # element, measured here at ~150 M elements/s, far below any streaming rate
        aten.bernoulli_.float: (torch.empty(8 * 32 * side * side, device=kind), 0.75),
    }


def kernels(kind: str, budget_s: float, timer=None) -> tuple[dict, dict, float, list]:
    """({str(aten op): bytes/s}, {str(aten op): seconds per call}, largest spread, [str(aten op) whose
    points were not stable]): the rate at which each kernel of _kernel_cases moves the bytes the
    roofline counts for it (its arithmetic included) and its fixed cost per call, fit (fit_latency)
    through its times at KERNEL_SIDES when both were stable (a fit through noise is noise; else the
    larger case's rate and no latency, and the op is listed)."""
    timer = timer or Timer(kind)
    points, spreads = {}, []
    for side in KERNEL_SIDES:
        for op, args in _kernel_cases(kind, side).items():
            nbytes = _moved(args, op(*args))
            t = stable(timer, lambda op=op, args=args: op(*args), budget_s)
            points.setdefault(str(op), []).append((nbytes, t.seconds, t.settled))
            spreads.append(t.spread)
    fits = {op: fit_latency(*[(w, s) for w, s, _ in sorted(p)]) if all(ok for *_, ok in p)
            else (max(p)[0] / max(p)[1], 0.0) for op, p in points.items()}  # unstable points: no fit
    unfit = [op for op, p in points.items() if not all(ok for *_, ok in p)]
    return {op: r for op, (r, _) in fits.items()}, {op: lat for op, (_, lat) in fits.items()}, max(spreads), unfit


def attention(kind: str, budget_s: float, timer=None) -> tuple[dict, float, list]:
    """({str(aten op): seconds per call}, largest spread, [str(aten op) whose points were not stable]):
    the fixed cost per call of the CPU's fused
    attention kernel, forward and backward (causal, no dropout), fit (fit_latency) through query
    lengths ATTENTION_LENGTHS at 8 × 4 heads × 16 dims, work ∝ T²: measured here ~30 µs forward and
    ~45 µs backward, most of a small model's attention time, which its FLOPs do not show. {} on CUDA
    (its kernels are other ops, and their fixed cost is the launch latency)."""
    if kind != "cpu":
        return {}, 0.0, []
    timer = timer or Timer(kind)
    aten = torch.ops.aten
    fwd, bwd = aten._scaled_dot_product_flash_attention_for_cpu.default, \
        aten._scaled_dot_product_flash_attention_for_cpu_backward.default
    points, spreads = {str(fwd): [], str(bwd): []}, []
    for length in ATTENTION_LENGTHS:
        q, k, v = (torch.randn(8, 4, length, 16) for _ in range(3))
        out, lse = fwd(q, k, v, 0.0, True)[:2]
        grad = torch.randn_like(out)
        work = length * length  # FLOPs ∝ T² (fit_latency's intercept does not depend on the scale)
        for op, call in ((fwd, lambda q=q, k=k, v=v: fwd(q, k, v, 0.0, True)),
                         (bwd, lambda q=q, k=k, v=v, g=grad, o=out, s=lse: bwd(g, q, k, v, o, s, 0.0, True))):
            t = stable(timer, call, budget_s)
            points[str(op)].append((work, t.seconds, t.settled))
            spreads.append(t.spread)
    unfit = [op for op, p in points.items() if not all(ok for *_, ok in p)]
    return {op: fit_latency(*[(w, s) for w, s, _ in p])[1] for op, p in points.items()
            if op not in unfit}, max(spreads), unfit


def bandwidth(kind: str, nbytes: int, budget_s: float, timer=None) -> tuple[float, Timing]:
    """(bytes/s, timing) streaming buffers of nbytes: the median rate of ``dst.copy_(src)`` (2 × the
    bytes moved: read and write), ``torch.add(a, b, out=c)`` (3 ×) and ``a.mul_(s)`` (2 ×); the timing
    is the copy's."""
    timer = timer or Timer(kind)
    a = torch.ones(nbytes // 4, dtype=torch.float32, device=kind)
    b, c = torch.ones_like(a), torch.ones_like(a)
    share = budget_s / 3
    copy = stable(timer, lambda: c.copy_(a), share)
    rates = [2 * nbytes / copy.seconds,  # read a, write c
             3 * nbytes / stable(timer, lambda: torch.add(a, b, out=c), share).seconds,  # a, b -> c
             2 * nbytes / stable(timer, lambda: a.mul_(1.0), share).seconds]  # read and write a
    return statistics.median(rates), copy


__all__ = ["Timer", "Timing", "TinyTiming", "best_of", "stable", "square", "skinny", "convolution", "dispatch",
           "attention", "bandwidth", "per_op", "kernels", "trivial", "fit_latency", "CONV_SHAPES", "CONV_SMALL",
           "STABLE_REL", "MAX_ROUNDS"]
