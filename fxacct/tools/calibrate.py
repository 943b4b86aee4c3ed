"""Calibrate: measure this machine's achievable matmul FLOP/s per dtype and its memory bandwidth
with short microbenchmarks, and keep the result as a device profile in the user cache dir.

Predictions (fxacct.predict.roofline) use the profile (fxacct.predict.calibration) for this CPU when no ``--gpu`` is given, and for the
local GPU in runtime mode. Without one, the CPU has no device model and predicted times are null
("not calibrated"), never a made-up number.

What is measured (fxacct.tools.microbench: each the fastest of repetitions that fill a small time
budget, in rounds repeated until two agree within 5%; on a shared machine other work only ever
slows a repetition down, so the fastest is the device's own rate; each measurement's ``spread``,
(slowest − fastest) / fastest over its rounds, is stored beside it):

- matmul FLOP/s per dtype: ``a @ b`` on square n×n operands, 2·n³ FLOPs each (1 FMA = 2 FLOPs,
  fxacct.units). n grows from ``MIN_N`` by doubling until one product takes ``MIN_OP_S`` or n
  reaches the device's cap, and the rate at that n is kept: a sustained rate. Smaller products that fit in
  cache can run faster for a moment (on the 2-core CI machine 512² reached 3× the 2048² rate),
  which no model-sized matmul sustains. float32 on CUDA runs with TF32 off (PyTorch's default for
  matmuls); "tf32" is the same product with it on.
- the same by smallest dimension: (d×n) @ (n×n) for d in ``SKINNY_DIMS``, and the square's n
  (its own smallest dimension). ``MIN_N`` is twice the largest d, so on any machine, however slow,
  the square's n lies above every d: the classes of the curve never coincide. A
  matmul with one small dimension (a batch of 64 rows through a 1024→4096 layer, and the weight
  gradient that contracts over those 64) runs well below the square rate on a CPU (measured here:
  ~half); predictions look the rate up by each matmul's smallest dimension (fxacct.predict.roofline).
- plausibility: a square is the fastest shape of its dtype; a square below 0.8 × a skinny
  product's rate is measured again, and if it still is, the calibration is refused (issue 10: a
  busy machine once stored 0.002 TFLOP/s for the fp32 square beside 161 GFLOP/s for a skinny
  product, and every prediction used it).
- convolution FLOP/s (float32) by channel count: 3×3 convolutions C → C for C in 8, 32, 128
  (microbench.CONV_SHAPES), forward and backward (aten.convolution_backward, input and weight
  gradients) apart; a convolution with few channels runs far below the matmul rate on a CPU. Each
  also has a fixed cost per call (oneDNN's set-up: measured here ~50 µs forward, ~140 µs backward,
  most of a small convolution's time): fit through the 8-channel class at two image sides
  (microbench.fit_latency), stored in ``op_latency_s`` less the trivial op's time (the per-op
  overhead holds that), and taken out of each class's rate (conv_curve).
- per-op overhead in seconds: training steps of a small model (8 × (Linear(64, 64), ReLU) on 256
  rows, AdamW; microbench._Tiny), on the 64 KiB activations a small model's ops work on: each
  phase's median time over ~100 steps (per-op costs are software's: allocation, page faults, the
  autograd engine, Python; a typical step pays them as the median step does, which is what the
  runtime mode measures), less what fxacct's own roofline predicts for that phase on the rates
  measured here (its arithmetic and bytes: fxacct.tools.calibrate_overhead), less its views at the
  trivial op's time (a view allocates nothing and runs no kernel: ``view_s_per_op``), over the
  phase's other ops (``dispatch_s_by_phase``: forward, backward, optimizer), at least the trivial
  op's time. It
  is what an op pays besides its FLOPs and bytes, fit where it is most of the time (measured here:
  ~15 µs forward, ~10 µs backward, ~5 µs optimizer; on a few elements per op, Linear(4, 4), the
  forward's was 3.5 µs: an op on real activations pays allocation and OpenMP's parallel region
  too). A small model's step is mostly this (issue 10: a small CNN was 4.7× slower than a roofline
  without it). Also the whole step under torch.profiler, which `--runtime` runs the model under to
  join modules (it records every op: views pay as much as any op there). The step is timed on one
  thread too: over 3× slower on all of them, the cores are contended (a busy machine once stored
  60× an idle one's figures), and the calibration is refused (below).
- attention's fixed cost per call on the CPU (the fused kernel, forward and backward): fit through
  two query lengths (microbench.attention), in ``op_latency_s``.
- training kernels in bytes/s: the non-matmul kernels a CPU runs far below its streaming rate
  (batch norm, max-pool, layer norm, softmax, GELU, ReLU's backward; forward and backward; and
  dropout's random mask, ~150 M elements/s here) on 1 MiB and 64 KiB activations, each as the
  bytes the roofline counts for it over its time, and its fixed cost per call fit through the two
  (microbench.kernels; in ``op_latency_s`` as above).
- bandwidth in bytes/s, by footprint: three streaming ops, ``dst.copy_(src)`` (reads and writes
  the buffer: 2 × its bytes moved, the STREAM "copy" convention), ``torch.add(a, b, out=c)`` (3 ×)
  and ``a.mul_(s)`` (2 ×), on buffers of ``COPY_SIZES``; per size, the median of the three rates,
  keyed by the footprint of a copy (2 × the buffer). On a
  CPU a footprint that fits in the last-level cache streams several times faster than DRAM, and
  predictions look the rate up by the step's working set (fxacct.predict.roofline).
  ``bandwidth_bytes_per_s`` is the rate at the largest size (DRAM).

Nothing poisoned is stored (issue 22): a figure that fails its own check refuses the whole
calibration (a usage error, exit 2: calibrate again on an idle machine), and the profile stored
before, if any, stays. The checks are the method's own: a figure whose two fastest rounds stayed
more than 10% apart (``Timing.settled``; rounds stop once two agree within 5%) is not established;
a fixed cost per call fit through points that were not settled would be noise (a busy machine stored "0 s" latencies that way, and a small U-Net was then
predicted at 130 ms against 608 ms measured); a square slower than a skinny product, a smaller
footprint streaming slower than a larger one and a convolution with more channels running slower
than one with fewer (its arithmetic intensity grows with the channels: each input pixel is
reused once per output channel) beyond the noise (PLAUSIBLE) after a re-measurement contradict
the device; a small step over CONTENDED × its one-thread time says other work holds the cores.
The spread of every measurement is stored beside its figure.

Where: ``$FXACCT_CACHE_DIR`` if set (tests point it at a tmp dir), else ``$XDG_CACHE_HOME/fxacct``,
else ``~/.cache/fxacct``. One JSON file per device: ``device-cpu.json``, ``device-cuda-<name>.json``.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from dataclasses import replace

import torch

from fxacct.errors import UsageError
from fxacct.predict.calibration import Calibration, check_device, local_name
from fxacct.tools import calibrate_overhead as overhead
from fxacct.tools import microbench
from fxacct.units import format_bytes

MIN_OP_S = 0.01  # s: a product this long is timed reliably and runs at a sustained rate
BUDGET_S = 0.3  # s per measurement: repetitions stop once their total passes it
PLAUSIBLE = 0.8  # a square below 0.8 × a skinny product's rate of its dtype is implausible (noise: ±20%)
MAX_N = {"cpu": 2048, "cuda": 8192}  # largest square operand tried (2048² fp32 = 16 MiB each)
# buffer sizes of the bandwidth ops: from L2-resident (1 MiB) to past the last-level cache of current
# server CPUs (hundreds of MiB); on a GPU one size far past its L2 (50 MiB on H100)
COPY_SIZES = {"cpu": tuple(2**20 * m for m in (1, 4, 16, 64, 256)), "cuda": (2**30,)}
SKINNY_DIMS = (16, 64, 256)  # the small dimension of the (d×n) @ (n×n) products
MIN_N = 2 * max(SKINNY_DIMS)  # first square n tried: above every skinny d (512² fp32 = 1 MiB each)
DTYPES = {"cpu": ("float32", "bfloat16", "float16"),
          "cuda": ("float32", "tf32", "bfloat16", "float16")}


def implausible(square_rate: float, skinny_rates: dict) -> int | None:
    """The smallest dimension d of a skinny product that ran faster than the square of the same dtype
    by more than the noise (PLAUSIBLE), or None. A square is the fastest shape of its dtype (it reuses
    each operand most); one below a skinny product was disturbed (the issue's 0.002 TFLOP/s square
    beside a 161 GFLOP/s skinny one)."""
    fastest = max(skinny_rates, key=skinny_rates.get, default=None)
    if fastest is not None and square_rate < PLAUSIBLE * skinny_rates[fastest]:
        return fastest
    return None


def measure_matmul(kind: str, dtype_key: str, budget_s: float = BUDGET_S) -> tuple[float, int, microbench.Timing]:
    """(FLOP/s, n, timing) of n×n @ n×n products in dtype_key, at the first n whose product takes MIN_OP_S."""
    n = MIN_N
    while True:
        rate, t = microbench.square(kind, dtype_key, n, budget_s / 3)
        if t.seconds >= MIN_OP_S or n >= MAX_N[kind]:
            return rate, n, t
        n *= 2


def measure_skinny(kind: str, dtype_key: str, n: int, budget_s: float = BUDGET_S) -> dict[int, tuple]:
    """{d: (FLOP/s, timing)} of (d×n) @ (n×n) products for d in SKINNY_DIMS; n must lie above them
    all, so that no d is the square's own class."""
    if n <= max(SKINNY_DIMS):
        raise ValueError(f"square n={n} must exceed every skinny dimension {SKINNY_DIMS}")
    return {d: microbench.skinny(kind, dtype_key, d, n, budget_s / 3) for d in SKINNY_DIMS}


def _unsettled(what: str, timings, problems: list) -> None:
    """A problem for a timing whose two fastest rounds stayed more than SETTLED_REL apart
    (microbench.Timing.settled)."""
    apart = max(((t.apart if t.apart is not None else t.spread) for t in timings if not t.settled), default=None)
    if apart is not None:
        problems.append(f"{what}: its rounds never agreed within {100 * microbench.SETTLED_REL:.0f}% "
                        f"({100 * apart:.0f}% apart)")


def _matmul(kind: str, key: str, budget_s: float, problems: list) -> tuple[float, int, dict, float]:
    """(square FLOP/s, n, {d: FLOP/s} with the square's n, spread) of one dtype; a square slower
    than a skinny product is measured again, and if it still is, a problem."""
    rate, n, t = measure_matmul(kind, key, budget_s)
    skinny = measure_skinny(kind, key, n, budget_s)
    if implausible(rate, {d: r for d, (r, _) in skinny.items()}) is not None:
        again, t_again = microbench.square(kind, key, n, budget_s / 3)
        rate, t = max((rate, t), (again, t_again), key=lambda rt: rt[0])
        skinny = measure_skinny(kind, key, n, budget_s)
        d = implausible(rate, {d: r for d, (r, _) in skinny.items()})
        if d is not None:
            problems.append(f"matmul {key}: the {n}² square measured {rate / 1e9:.3g} GFLOP/s twice, below "
                            f"the {d}-row product's {skinny[d][0] / 1e9:.3g}")
    _unsettled(f"matmul {key}", [t] + [st for _, st in skinny.values()], problems)
    by_dim = {str(d): r for d, r in sorted({**{d: r for d, (r, _) in skinny.items()}, n: rate}.items())}
    return rate, n, by_dim, max([t.spread] + [st.spread for _, st in skinny.values()])


def _slower_than_larger(curve: dict, problems: list | None) -> list:
    """The footprints of ``curve`` ({bytes: bytes/s}) that stream below PLAUSIBLE × the next larger
    footprint's rate (a problem each when ``problems`` is given)."""
    sizes = sorted(curve)
    low = [(small, large) for small, large in zip(sizes, sizes[1:]) if curve[small] < PLAUSIBLE * curve[large]]
    for small, large in low if problems is not None else ():
        problems.append(f"memory bandwidth: a {format_bytes(small)} footprint streamed at {curve[small] / 1e9:.3g} "
                        f"GB/s twice, below {format_bytes(large)}'s {curve[large] / 1e9:.3g} GB/s")
    return [small for small, _ in low]


def measure_bandwidth(kind: str, budget_s: float = BUDGET_S, problems: list | None = None
                      ) -> tuple[dict[int, float], float]:
    """({footprint bytes: bytes/s} over COPY_SIZES, the largest spread) (module docstring). A
    footprint that streams slower than a larger one (from further out in the memory hierarchy)
    beyond the noise is measured again, and if it still is, a problem; so is a size whose rounds
    never agreed."""
    out, timings = {}, []
    for nbytes in COPY_SIZES[kind]:
        rate, t = microbench.bandwidth(kind, nbytes, budget_s)
        out[2 * nbytes] = rate
        timings.append(t)
    for small in _slower_than_larger(out, None):
        rate, t = microbench.bandwidth(kind, small // 2, budget_s)
        out[small] = max(out[small], rate)
        timings.append(t)
    _slower_than_larger(out, problems)
    if problems is not None:
        _unsettled("memory bandwidth", timings, problems)
    return out, max(t.spread for t in timings)


def conv_curve(times: dict, small: tuple, trivial_s: float, fit: bool = True) -> tuple[dict[str, float], float]:
    """({str(channels): FLOP/s}, latency s) from {(channels, side): (FLOPs, seconds)}: the fixed
    cost per call fit through the first class at ``small`` and at its CONV_SHAPES side
    (microbench.fit_latency), less the trivial op's time (the per-op overhead holds that); each
    class's rate is its FLOPs over its time less that latency (at most half its time). ``fit``
    False (the two points were not stable): no latency, the plain rates."""
    first = microbench.CONV_SHAPES[0]
    _, latency = microbench.fit_latency(times[small], times[first]) if fit else (0.0, 0.0)
    latency = max(0.0, latency - trivial_s)
    return {str(c): times[c, side][0] / max(times[c, side][1] - latency, times[c, side][1] / 2)
            for c, side in microbench.CONV_SHAPES}, latency


def measure_convolutions(kind: str, trivial_s: float, budget_s: float = BUDGET_S,
                         problems: list | None = None) -> tuple[dict, dict, dict, float]:
    """(forward {str(channels): FLOP/s}, backward the same, {str(aten op): latency s}, the largest
    spread) of float32 3×3 convolutions (conv_curve), forward and backward (input and weight
    gradients). Problems: a timing whose rounds never agreed, a class with more channels slower
    than one with fewer."""
    curves, latency, spreads = {}, {}, []
    for backward, op in ((False, "aten.convolution.default"), (True, "aten.convolution_backward.default")):
        times, timings = {}, []
        for channels, side in microbench.CONV_SHAPES + (microbench.CONV_SMALL,):
            rate, t = microbench.convolution(kind, channels, side, budget_s / 4, backward=backward)
            times[channels, side] = (rate * t.seconds, t.seconds)
            timings.append(t)
        spreads += [t.spread for t in timings]
        what = "convolution backward float32" if backward else "convolution float32"
        curves[backward], latency[op] = conv_curve(times, microbench.CONV_SMALL, trivial_s,
                                                   all(t.settled for t in timings))
        if problems is not None:
            _unsettled(what, timings, problems)
            # more channels, more reuse of each pixel: the rate grows with the channels (module docstring)
            by_channels = {int(c): r for c, r in curves[backward].items()}
            for few, more in zip(sorted(by_channels), sorted(by_channels)[1:]):
                if by_channels[more] < PLAUSIBLE * by_channels[few]:
                    problems.append(f"{what}: {more} channels ran at {by_channels[more] / 1e9:.3g} GFLOP/s, "
                                    f"below {few} channels' {by_channels[few] / 1e9:.3g}")
    return curves[False], curves[True], latency, max(spreads)


def calibrate(device: str = "cpu", budget_s: float = BUDGET_S,
              progress: Callable[[str], None] | None = None) -> Calibration:
    """Measure the local CPU or GPU (< 30 s on 2 CPU cores). A figure that fails its own check
    (module docstring) refuses the whole calibration: a UsageError naming it, nothing returned."""
    kind = check_device(device)
    say = progress or (lambda what: None)
    t0 = time.perf_counter()
    rates, sizes, by_dim, spread, problems = {}, {}, {}, {}, []
    with torch.no_grad():
        for key in DTYPES[kind]:
            say(f"matmul {key}")
            rates[key], sizes[key], by_dim[key], spread[f"matmul {key}"] = _matmul(kind, key, budget_s, problems)
        trivial_s, t_trivial = microbench.trivial(kind, budget_s / 6)
        _unsettled("the trivial op", [t_trivial], problems)
        say("convolution float32")
        conv, conv_bwd, latency, spread["convolution float32"] = measure_convolutions(kind, trivial_s, budget_s,
                                                                                     problems)
        say("per-op overhead")
        tiny, profiled, contention = overhead.small_steps(kind, budget_s)
        problems += [contention] if contention else []
        _unsettled("per-op overhead", [tiny.step, profiled.step], problems)
        spread["per-op overhead"] = tiny.step.spread
        spread["per-op overhead under torch.profiler"] = profiled.step.spread
        say("training kernels")
        kernel_rates, kernel_latency, spread["training kernels"], unfit = microbench.kernels(kind, budget_s / 6)
        problems += [f"kernel {op}: its fixed cost per call could not be fit (rounds never agreed)" for op in unfit]
        latency.update({op: max(0.0, s - trivial_s) for op, s in kernel_latency.items()})
        say("attention")
        attention_latency, spread["attention"], unfit = microbench.attention(kind, budget_s / 6)
        problems += [f"{op}: its fixed cost per call could not be fit (rounds never agreed)" for op in unfit]
        latency.update({op: max(0.0, s - trivial_s) for op, s in attention_latency.items()})
        say("memory bandwidth")
        curve, spread["memory bandwidth"] = measure_bandwidth(kind, budget_s, problems)
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise UsageError(f"calibration refused, nothing stored: {problems[0]}{more}; other work disturbed the "
                         f"measurements: calibrate again on an idle machine")
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    cal = Calibration(kind, local_name(kind), torch.get_num_threads(), torch.__version__, rates, by_dim,
                      curve[max(curve)], {str(k): v for k, v in sorted(curve.items())}, now, sizes,
                      0.0, {"float32": conv}, None, spread, [], None, kernel_rates,
                      {"float32": conv_bwd}, latency)
    say("per-op overhead beyond the roofline")
    return replace(cal, seconds=time.perf_counter() - t0, **overhead.fit(cal, tiny, profiled, trivial_s))


__all__ = ["calibrate", "implausible", "measure_matmul", "measure_skinny", "measure_bandwidth", "conv_curve"]
