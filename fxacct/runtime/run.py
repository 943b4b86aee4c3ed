"""Measure: the real model on a real device, under torch.profiler.

The model is built as the account builds it (fxacct.load.source: a file, an importable module or a Hugging Face
config), on the device (random init, seed 0), its linear layers converted by ``--fp8``, cast to ``--dtype`` if given,
its regions compiled in place with ``--compile`` / ``--compile-blocks`` (by the first warm-up step); the inputs come from the ``--input`` specs (random values, integers below ``<N``), the model's own
``example_inputs(batch)`` or the spec form's defaults, on the device. Each step is what fxacct accounts: forward
(under autocast with ``--amp``) and the loss (fxacct.trace.loss, ``--loss``; its target drawn once, at the first
step, and kept like an input), ``loss.backward()``, the optimizer's ``step()`` and ``zero_grad(set_to_none=True)``;
with ``inference``, a forward under ``eval()`` and ``no_grad()``. ``warmup`` steps run first (the optimizer state is
then allocated, caches and kernels are warm); then the timed steps, plain (no profiler, no hooks: the step the user's
own loop runs); then as many under ``torch.profiler`` with CPU (and CUDA) activities, memory profiling and a range
per module call; and one more step, untimed, under the storage tracker.

Timing: ``time.perf_counter`` around each phase on CPU; CUDA events on CUDA, synchronized at the end
of each step. Step and phase times are low medians over the plain steps (each an actual step's value);
module and node times are those of the median profiled step (fxacct.runtime.join), so they add up
within it, and include the profiler's overhead (a few µs per op).

Peak memory of a steady-state step (parameters, buffers, inputs and optimizer state resident,
gradients None when it begins):
- ``peak_bytes``, allocator level. CUDA: ``torch.cuda.max_memory_allocated`` over the timed steps
  (the caching allocator's bytes in use, rounded to its 512-byte blocks, cuBLAS workspaces included). CPU: the bytes resident when the timed steps begin plus the highest running sum of
  the profiler's memory events (every allocation and free of the CPU allocator, kernel scratch
  such as oneDNN buffers included) over the timed steps.
- ``op_level_peak_bytes``: fxacct.runtime.storage_tracker over one step, what fxacct's
  ``peak_train_bytes`` predicts (aten-op level: no kernel-internal buffers, no allocator rounding);
  none for a compiled step, whose buffers inductor allocates below the dispatcher.
- ``reserved_bytes`` (CUDA): ``torch.cuda.max_memory_reserved``, what ``peak_reserved_bytes`` predicts.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.autograd.profiler import record_function

from fxacct.errors import FxacctError, ModelError, classify, first_line
from fxacct.heap import collector_on
from fxacct.load.config import Config
from fxacct.load.hf import is_causal_lm
from fxacct.predict.calibration import cpu_name
from fxacct.runtime.build import SEED, build_model, make_inputs
from fxacct.runtime.join import MODULE_PREFIX, STEP, Join, join
from fxacct.runtime.storage_tracker import StorageTracker
from fxacct.runtime.transfer import Transfer, measure_transfer
from fxacct.trace import torch_private as tp
from fxacct.trace.loss import LossSpec, target_spec, training_loss
from fxacct.trace.module_hooks import global_module_hooks


@dataclass(frozen=True)
class StepTime:
    step_s: float
    forward_s: float  # the model's forward and the loss
    backward_s: float
    optimizer_s: float  # step() and zero_grad()


@dataclass(frozen=True)
class Measured:
    device: str  # "cpu", "cuda:0"
    device_name: str
    inference: bool
    warmup: int
    steps_requested: int
    step_times: tuple[StepTime, ...]  # the timed steps completed
    peak_bytes: int | None  # allocator level (module docstring)
    peak_source: str
    op_level_peak_bytes: int | None
    join: Join | None
    transfer: Transfer | None  # CUDA only
    interrupted: bool
    threads: int  # torch.get_num_threads()
    trace_events: tuple = ()  # the profiler's Chrome trace events, when asked for
    profiled_step_times: tuple = ()  # the steps under the profiler: module and node times are of their median
    reserved_bytes: int | None = None  # CUDA: torch.cuda.max_memory_reserved (module docstring)

    def _median(self, field: str) -> float | None:
        values = [getattr(s, field) for s in self.step_times]
        return statistics.median_low(values) if values else None

    @property
    def steps(self) -> int:
        return len(self.step_times)

    @property
    def step_s(self) -> float | None:
        return self._median("step_s")

    @property
    def forward_s(self) -> float | None:
        return self._median("forward_s")

    @property
    def backward_s(self) -> float | None:
        return self._median("backward_s")

    @property
    def optimizer_s(self) -> float | None:
        return self._median("optimizer_s")


def median_step(times: list[StepTime]) -> int:
    """The index of the step whose time is the (low) median: the step per-module figures are of."""
    order = sorted(range(len(times)), key=lambda i: times[i].step_s)
    return order[(len(order) - 1) // 2]


def loss_spec(config: Config, model) -> LossSpec:
    return LossSpec(config.loss, config.loss_output, is_causal_lm(model))


class _Clock:
    """Marks within a step; seconds between them. CUDA events on CUDA, perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def intervals(self, marks) -> list[float]:
        if self.cuda:
            marks[-1].synchronize()
            return [a.elapsed_time(b) / 1e3 for a, b in zip(marks, marks[1:])]  # ms -> s
        return [b - a for a, b in zip(marks, marks[1:])]


def attention_kernel(backend: str, device: torch.device):
    """--sdpa-backend on CUDA: the run forces the attention kernel the prediction times
    (torch.nn.attention.sdpa_kernel); "auto", or a CPU (whose SDPA has one kernel), runs as torch picks."""
    if device.type != "cuda" or backend == "auto":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
                        "efficient": SDPBackend.EFFICIENT_ATTENTION}[backend])


class _Step:
    """One training (or inference) step of the model, phases marked for the profiler and clock."""

    def __init__(self, config: Config, model, args, kwargs, inference: bool, device: torch.device):
        self.model, self.args, self.kwargs = model, args, kwargs
        self.config, self.inference, self.device = config, inference, device
        self.optimizer = None
        if not inference:
            params = [p for p in model.parameters() if p.requires_grad]
            self.optimizer = config.optimizer_spec().build(params)
        self.inputs_with_grad = [t for t in tp.tree_leaves((args, kwargs))
                                 if isinstance(t, torch.Tensor) and t.requires_grad]
        self.loss_spec = loss_spec(config, model)
        self.target = None  # drawn at the first step (its shape is the output's), then reused
        model.train(not inference)

    def loss(self, output) -> torch.Tensor:
        """fxacct.trace.loss, the definition the account differentiates."""
        spec = target_spec(output, self.loss_spec)
        if spec is not None and self.target is None:
            self.target = spec.make(self.device, torch.Generator().manual_seed(SEED))
        return training_loss(output, self.loss_spec, self.target)

    def autocast(self):
        if self.config.amp is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.config.amp)

    def __call__(self, clock: _Clock | None = None) -> StepTime | None:
        with attention_kernel(self.config.sdpa_backend, self.device):
            return self._step(clock)

    def _step(self, clock: _Clock | None) -> StepTime | None:
        marks = [clock.mark()] if clock else None
        if self.inference:
            with record_function("fxacct.forward"), torch.no_grad(), self.autocast():
                self.model(*self.args, **self.kwargs)
            if clock:
                marks.append(clock.mark())
                (forward,) = clock.intervals(marks)
                return StepTime(forward, forward, 0.0, 0.0)
            return None
        with record_function("fxacct.forward"):
            with self.autocast():
                output = self.model(*self.args, **self.kwargs)
                loss = self.loss(output)
            del output
        if clock:
            marks.append(clock.mark())
        with record_function("fxacct.backward"):
            loss.backward()
        if clock:
            marks.append(clock.mark())
        with record_function("fxacct.optimizer"):
            if self.optimizer is not None:
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            else:
                self.model.zero_grad(set_to_none=True)
            for t in self.inputs_with_grad:
                t.grad = None
        del loss
        if clock:
            marks.append(clock.mark())
            f, b, o = clock.intervals(marks)
            return StepTime(f + b + o, f, b, o)
        return None


@contextlib.contextmanager
def module_ranges(model: torch.nn.Module):
    """A record_function range ``fxacct.module:<FQN>`` around every module call (global hooks)."""
    names = {id(m): n for n, m in model.named_modules()}
    stack: list = []

    def pre(module, args):
        name = names.get(id(module))
        r = record_function(MODULE_PREFIX + name) if name is not None else contextlib.nullcontext()
        r.__enter__()
        stack.append(r)

    def post(module, args, output):
        stack.pop().__exit__(None, None, None)

    with global_module_hooks(pre, post):
        yield


@contextlib.contextmanager
def _model_errors(device: torch.device, batch: int):
    try:
        yield
    except (FxacctError, KeyboardInterrupt):
        raise
    except torch.cuda.OutOfMemoryError as e:
        raise ModelError(f"out of memory on {device} at batch {batch} ({first_line(e)}); "
                         "lower --batch") from e
    except Exception as e:
        if "out of memory" in str(e).lower():
            raise ModelError(f"out of memory on {device} at batch {batch}; lower --batch") from e
        raise classify(e, "the real run") from e


def _cpu_allocator_peak(prof, baseline: int) -> int | None:
    """Resident bytes + the highest running sum of the CPU allocator's events in the window."""
    events = tp.kineto_events(prof)
    if events is None:  # a torch release moved the kineto results
        return None
    mem = sorted((e.start_ns(), e.nbytes()) for e in events
                 if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU)
    live = best = 0
    for _, nbytes in mem:
        live += nbytes
        best = max(best, live)
    return baseline + best


def _chrome_trace(prof) -> tuple:
    fd, path = tempfile.mkstemp(suffix=".json", prefix="fxacct-trace-")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            return tuple(json.load(f).get("traceEvents", ()))
    finally:
        os.unlink(path)


def _op_level_peak(step: _Step, progress) -> int:
    progress("op-level peak", 0, 1)
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        with StorageTracker() as tracker:
            tracker.track(step.model, step.optimizer, step.args, step.kwargs, step.target)
            step()
    finally:
        if was:
            gc.enable()
    progress("op-level peak", 1, 1)
    return tracker.peak_bytes


def _timed_steps(step: _Step, clock: _Clock, steps: int, prof, times: list, profiled: list, progress) -> None:
    """``steps`` plain steps, timed into ``times``: the step time the user's own training loop sees
    (no profiler, no module hooks); then as many under ``prof`` (torch.profiler) with a range per
    module call, timed into ``profiled``: the steps the join and the CPU allocator peak read."""
    progress("timed", 0, steps)
    for i in range(steps):
        times.append(step(clock))
        progress("timed", i + 1, steps)
    progress("profiled", 0, steps)
    with prof, module_ranges(step.model):
        for i in range(steps):
            with record_function(STEP):
                profiled.append(step(clock))
            progress("profiled", i + 1, steps)


def measure(config: Config, device: torch.device, steps: int, warmup: int, node_rows=(),
            inference: bool = False, keep_trace: bool = False,
            progress: Callable[[str, int, int], None] | None = None) -> Measured:
    """Run ``warmup`` + ``steps`` steps of config's model on ``device`` (see the module docstring)
    and join the profile to ``node_rows`` (the account's forward NodeRows, fxacct.runtime.join).
    A KeyboardInterrupt during the steps ends them; what was measured is returned, interrupted."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    if cuda and config.alloc_conf is not None:  # the run uses the allocator settings the account replayed
        tp.set_cuda_allocator_settings(config.alloc_conf)
    with _model_errors(device, config.batch):
        model, source = build_model(config, device)
        args, kwargs = make_inputs(config, model, source, device)
        step = _Step(config, model, args, kwargs, inference, device)
        transfer = measure_transfer(args, kwargs, device) if cuda else None
    clock = _Clock(device)
    interrupted = False
    times: list[StepTime] = []
    profiled: list[StepTime] = []  # the steps under the profiler, for the join and the allocator peak
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    prof = None
    progress = progress or (lambda phase, done, total: None)
    tp.quiet_kineto()  # before the profiler's first start in this process
    try:
        with _model_errors(device, config.batch), collector_on():  # as the user's training loop has it
            progress("warm-up", 0, warmup)
            for i in range(warmup):
                step()
                progress("warm-up", i + 1, warmup)
            if cuda:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            baseline = StorageTracker().track(model, step.optimizer, args, kwargs, step.target).live_bytes
            prof = profile(activities=activities, profile_memory=True)
            _timed_steps(step, clock, steps, prof, times, profiled, progress)
    except KeyboardInterrupt:
        interrupted = True
    peak, source, reserved = None, "none", None
    if cuda and times:
        peak, source = torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated"
        reserved = torch.cuda.max_memory_reserved(device)
    elif prof is not None and profiled:
        peak, source = _cpu_allocator_peak(prof, baseline), "profiler memory events + resident bytes"
    joined, trace = None, ()
    if prof is not None and profiled:
        joined = join(prof.events(), node_rows, device_time=cuda, step=median_step(profiled))
        if keep_trace:
            trace = _chrome_trace(prof)
    op_peak = None
    if not interrupted and not config.compiled:  # compiled: no op level to track (module docstring)
        try:
            with _model_errors(device, config.batch):
                op_peak = _op_level_peak(step, progress)
        except KeyboardInterrupt:
            interrupted = True

    name = torch.cuda.get_device_name(device) if cuda else cpu_name()
    return Measured(str(device), name, inference, warmup, steps, tuple(times), peak, source, op_peak, joined,
                    transfer, interrupted, torch.get_num_threads(), trace, tuple(profiled), reserved)


__all__ = ["Measured", "StepTime", "measure"]
