"""The one step driver: a training step (and a forward for inference) accounted once, whatever
captures it. A ``Capturer`` says how: one device (``OneDevice``), one rank of a mesh
(fxacct.parallel.rank_capture.RankCapturer) or one pipeline stage (either of them over the
stage's module). Everything else — the capture options from the Config, annotation, the
accounting, the inference capture, lifetimes and the memory roll-up — happens here, in one place,
so a flag reaches one device, a rank and a stage alike."""

from __future__ import annotations

import html
from dataclasses import dataclass
from typing import Protocol

import torch

from fxacct.account.accounting import Accounting, account
from fxacct.account.annotate import annotate
from fxacct.account.notes import (
    fastpath_warnings,
    idle_count_recompute,
    ignored_input_grad,
    precision_warnings,
    untrained,
)
from fxacct.costs.user import load_costs
from fxacct.devices import get_device
from fxacct.load import fp8, model_spec
from fxacct.load.config import Config
from fxacct.load.hf import is_causal_lm
from fxacct.load.mesh import MeshSpec
from fxacct.memory import account as memory_account
from fxacct.memory import sharding
from fxacct.memory.fixed import device_key
from fxacct.memory.peak import PARAMETERS, Lifetimes, Peak, lifetimes, walk
from fxacct.memory.reserved import ReservedAccount, communicators, fsdp_streams, reserved_account
from fxacct.predict.roofline import Prediction
from fxacct.trace import torch_private as tp
from fxacct.trace.capture import Capture, CaptureOptions, capture
from fxacct.trace.checkpointing import CheckpointWhatIf
from fxacct.trace.compiled import CompileSpec, CompileWhatIf
from fxacct.trace.fake_reuse import FakeReuse
from fxacct.trace.loss import MODEL, ignored_loss_warning
from fxacct.units import format_bytes, format_count


class MeshAccount(Protocol):
    """What the layer above adds to a Profile under --mesh (fxacct.parallel.accounts.ParallelAccount:
    the rank's collectives, time and pipeline); the step itself reads only these."""

    @property
    def mesh(self) -> MeshSpec: ...

    @property
    def step_peak_bytes(self) -> int | None: ...


@dataclass(frozen=True)
class Profile:
    config: Config
    accounting: Accounting
    memory: memory_account.MemoryAccount
    capture: Capture
    warnings: tuple[str, ...] = ()
    parallel: MeshAccount | None = None  # under --mesh
    checkpoint: CheckpointWhatIf | None = None  # under --checkpoint, on one device
    compiled: CompileWhatIf | None = None  # under --compile / --compile-blocks, on one device
    model_class: str | None = None  # the class of the model built (hf: targets: the one transformers chose)
    prediction: Prediction | None = None  # the roofline's step time, where a device model is known

    @property
    def title(self) -> str:
        """The target, with the class built where the target does not name it (an hf: config, a
        factory function): 'hf:llama.json (LlamaForCausalLM)'."""
        target = self.config.target or "module"
        if self.model_class is None or target.rpartition(":")[2] == self.model_class:
            return target
        return f"{target} ({self.model_class})"

    def summary(self) -> list[tuple[str, str]]:
        """(label, value) of the headline figures: what a notebook shows for a Profile (the full
        report: fxacct.report.render)."""
        t, mem, par = self.accounting.totals, self.memory, self.parallel
        scope = " per rank" if par is not None else ""
        peak = par.step_peak_bytes if par is not None and par.step_peak_bytes is not None else (
            mem.rank_peak.bytes if mem.rank_peak is not None else None)
        rows = [("FLOPs, forward + backward" + scope, f"{format_count(t.forward.total)} + {format_count(t.backward.total)}"),
                ("parameters" + scope, f"{t.params:,}"),
                ("training peak" + scope, format_bytes(peak) if peak is not None else "no training step"),
                ("inference peak" + scope, format_bytes(mem.peak_inference.bytes) if mem.peak_inference else "-")]
        if par is not None:
            rows.insert(0, ("mesh", str(par.mesh)))
        if self.prediction is not None:
            rows.append(("predicted step time", f"{self.prediction.step_ms:.3g} ms"))
        return rows

    def __repr__(self) -> str:
        return f"<fxacct.Profile {self.title}: " + "; ".join(f"{k} {v}" for k, v in self.summary()) + ">"

    def _repr_html_(self) -> str:
        """The headline figures as a table in a notebook."""
        cells = "".join(f"<tr><th style='text-align:left'>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>"
                        for k, v in self.summary())
        return f"<table><caption>fxacct profile: {html.escape(self.title)}</caption>{cells}</table>"


class Capturer(Protocol):
    """How a step is captured: the module and its inputs, a capture under given options, the
    storages' lifetimes (a rank adds FSDP2's resizes) and what it marks once the graph is
    annotated (a rank its collectives)."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict

    def capture(self, options: CaptureOptions) -> Capture: ...

    def lifetimes(self, cap: Capture) -> Lifetimes: ...

    def annotated(self, cap: Capture) -> None: ...


@dataclass
class OneDevice:
    """The plain capture: the model on one device."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict

    def capture(self, options: CaptureOptions) -> Capture:
        return capture(self.model, tuple(self.args), self.kwargs, options)

    def lifetimes(self, cap: Capture) -> Lifetimes:
        return lifetimes(cap)

    def annotated(self, cap: Capture) -> None:
        return None


def capture_options(config: Config, model: torch.nn.Module, inference: bool = False, **extra) -> CaptureOptions:
    """Every flag that shapes the traced step, from the Config: the one place they are read."""
    return CaptureOptions(
        dtype=config.dtype, input_requires_grad=config.input_requires_grad, loss_output=config.loss_output,
        optimizer=None if inference else config.optimizer_spec(), inference=inference, amp=config.amp,
        master_weights=config.master_weights, cuda=config.gpu is not None, dedup=config.dedup,
        loss=config.loss, causal_lm=is_causal_lm(model), checkpoint=config.checkpoint,
        checkpoint_policy=config.checkpoint_policy,
        defer=(fp8.float8_tensor_type(),) if config.fp8 else (),
        compile=CompileSpec(config.compile_blocks, config.compile_mode) if config.compiled else None, **extra)


def inputs_batch(args, kwargs) -> int:
    """The batch inputs laid out batch first carry: the first dimension of the first input tensor
    that has one (1 where none has)."""
    return next((t.shape[0] for t in tp.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.dim() > 0), 1)


def input_sizes(args, kwargs) -> set[int]:
    """Every size of every dimension of the input tensors (a sequence-first input's batch is its second)."""
    return {d for t in tp.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) for d in t.shape}


def tokens_per_example(args, kwargs, batch: int) -> int | None:
    """The per-example element count of the first integer input (T for long[B, T])."""
    for t in tp.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dtype != torch.bool and t.dim() > 0:
            if t.shape[0] == batch:
                return t.numel() // batch
    return None


def _sharding(model, config: Config) -> tuple[dict, dict, tuple[str, int] | None]:
    """--world-size N --shard S on one device: (ways each category is partitioned, the bytes
    resident throughout besides, the largest unit FSDP/ZeRO-3 gathers)."""
    if config.shard == "none":
        return {}, {}, None
    extra, unit = {}, None
    if config.shard in ("zero3", "fsdp"):
        unit = sharding.largest_unit_bytes(model, config.dtype)
        extra = {PARAMETERS: unit[1]}
    return sharding.partitioned(config.shard, config.world_size), extra, unit


def sharded_peak(life: Lifetimes, model, config: Config) -> tuple[Peak | None, tuple[str, int] | None]:
    """--world-size N --shard S on one device: (the per-rank peak, the largest unit FSDP/ZeRO-3
    gathers), or (None, None) unsharded."""
    if config.shard == "none":
        return None, None
    shards, extra, unit = _sharding(model, config)
    return walk(life, shards, extra), unit


def reserved_step(config: Config, cap: Capture, life: Lifetimes, model) -> ReservedAccount | None:
    """The training step through the CUDA caching allocator, per rank, on config.gpu (None on a
    CPU target or without a backward): fxacct.memory.reserved."""
    return _reserved(config, cap.has_backward, fsdp_streams(cap.graph) if config.gpu else {}, life, model)


def _reserved(config: Config, has_backward: bool, streams: dict, life: Lifetimes, model) -> ReservedAccount | None:
    if config.gpu is None or not has_backward:
        return None
    shards, extra, _ = _sharding(model, config)
    # --world-size N --shard S on one device: the ranks reduce (and gather) over one process group
    comms = communicators(config.mesh) if config.mesh is not None else int(bool(shards) and config.world_size > 1)
    return reserved_account(life, device_key(config.gpu), get_device(config.gpu).capacity_reported,
                            config.allocator_conf(), streams, shards, extra, comms)


def training_peak(config: Config, capturer: Capturer) -> Peak:
    """The step's training peak alone (per rank under --shard)."""
    cap = capturer.capture(capture_options(config, capturer.model))
    life = capturer.lifetimes(cap)
    return sharded_peak(life, capturer.model, config)[0] or walk(life)


@dataclass(frozen=True)
class TracedFit:
    """A traced step as the largest-batch search keeps it: its storages' lifetimes and, of its
    graph, only what the reserved bytes read (a backward or not; FSDP2's side-stream storages)."""

    life: Lifetimes
    has_backward: bool
    streams: dict

    @classmethod
    def of(cls, cap: Capture, life: Lifetimes) -> TracedFit:
        return cls(life, cap.has_backward, fsdp_streams(cap.graph))


def step_fit(config: Config, capturer: Capturer) -> TracedFit:
    """A fresh trace of the training step, as a fit is read from it."""
    cap = capturer.capture(capture_options(config, capturer.model))
    return TracedFit.of(cap, capturer.lifetimes(cap))


def fit_of(config: Config, traced: TracedFit, model, life: Lifetimes | None = None) -> tuple[int, int]:
    """(what one rank needs of config.gpu for the step: reserved at its peak plus the fixed costs
    outside the allocator, as MemoryAccount.fit_bytes; the op-level peak), from the traced step's
    lifetimes or ``life``, the same program's at config.batch (its storages on their lines:
    fxacct.memory.fit_lines). Without a CUDA target both are the op-level peak."""
    life = traced.life if life is None else life
    peak = (sharded_peak(life, model, config)[0] or walk(life)).bytes
    reserved = _reserved(config, traced.has_backward, traced.streams, life, model)
    return (reserved.fit_bytes if reserved is not None else peak), peak


def fit_probe(config: Config, capturer: Capturer) -> tuple[int, int]:
    """fit_of a fresh trace of the step: the largest-batch search's probe."""
    return fit_of(config, step_fit(config, capturer), capturer.model)


def fit_bytes(config: Config, capturer: Capturer) -> int:
    """fit_probe's first figure: what is compared with the GPU's capacity."""
    return fit_probe(config, capturer)[0]


def account_step(config: Config, capturer: Capturer, with_inference: bool = True) -> Profile:
    """Account one training step of the capturer's module: forward, loss, backward and the
    optimizer step, and (``with_inference``) a forward for inference. Nothing of the model's own
    tensors is allocated or changed."""
    model, args, kwargs = capturer.model, tuple(capturer.args), capturer.kwargs
    for path in config.costs:
        load_costs(path)
    model_spec.check_signature(model, args, kwargs)
    # the inference capture takes the training step's fake tensors (fxacct.trace.fake_reuse); a
    # compiled step's regions and fp8's tensor subclasses keep their own
    reuse = FakeReuse() if not (config.compiled or config.fp8) else None
    cap = capturer.capture(capture_options(config, model, reuse=reuse))
    annotate(cap.graph, config.causal_attention)
    capturer.annotated(cap)
    tokens = config.tokens_per_example or tokens_per_example(args, kwargs, config.batch)
    acct = account(cap, config.batch, tokens, config.count_recompute)
    inference = capturer.capture(capture_options(config, model, inference=True, nodes=False, reuse=reuse)) if with_inference else None
    life = capturer.lifetimes(cap)
    per_rank, unit = sharded_peak(life, model, config)
    memory = memory_account.assemble(cap, acct, model, config.dtype, walk(life) if cap.has_backward else None,
                                     walk(capturer.lifetimes(inference)) if inference is not None else None,
                                     per_rank, unit, reserved_step(config, cap, life, model))
    notes = precision_warnings(cap)
    notes += (ignored_loss_warning(config.loss),) if cap.returned_loss and config.loss != MODEL else ()
    notes += fastpath_warnings(model) + untrained(cap) + ignored_input_grad(config.input_requires_grad, cap)
    notes += idle_count_recompute(config, acct.totals.recompute_flops)
    return Profile(config, acct, memory, cap, notes, model_class=type(model).__name__)


__all__ = ["Profile", "Capturer", "OneDevice", "account_step", "training_peak", "fit_bytes", "fit_probe", "fit_of",
           "step_fit", "TracedFit", "capture_options",
           "tokens_per_example", "inputs_batch", "input_sizes"]
