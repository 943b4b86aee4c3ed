"""One representative rank (rank 0) of the parallelized model, captured below the DTensor layer.

The model is parallelized on meta outside any FakeTensorMode, then materialized with
``to_empty`` inside the FakeTensorMode the capture then runs in (DESIGN.md: what works with
torch 2.13); its parameters are then fake DTensors whose local shards are this rank's, so the
capture takes them as they are (no swap) and records the local ops and the collectives DTensor
and FSDP2 issue. Rank 0 holds the largest shard of every dim-0 split (torch.chunk order), so its
bytes are FSDP2's padded per-rank bytes.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field, replace

import torch

from fxacct.errors import classify
from fxacct.memory.peak import lifetimes
from fxacct.parallel import ddp
from fxacct.parallel.collectives import alias_waits, mark, register_fsdp_copies
from fxacct.parallel.engine import parallelize
from fxacct.parallel.fsdp_replay import GatherReplay, gathers_replayed
from fxacct.parallel.fsdp_storage import StorageResizes, unsave_resized, with_resizes
from fxacct.parallel.plans import retie, tied_aliases
from fxacct.trace import torch_private as tp
from fxacct.trace.capture import Capture, CaptureOptions, capture
from fxacct.trace.fake_mode import FakeTensorMode
from fxacct.trace.fake_model import FakeModel, fake_like


@dataclass(frozen=True)
class Prepared:
    """What CaptureOptions.prepared carries: the mode the model's tensors were made in, the model's
    own tensors as the capture's FakeModel, and the tensor subclasses the recorder defers to."""

    mode: FakeTensorMode
    fake: FakeModel
    defer: tuple
    resizes: StorageResizes  # FSDP2's frees and re-allocations of unsharded parameters
    gathers: GatherReplay | None = None  # FSDP2's gathers replayed (None: --no-dedup, all traced)

    def attach(self, recorder) -> None:
        """The capture's recorder: resizes are noted and gathers replayed against its records."""
        self.resizes.attach(recorder)
        if self.gathers is not None:
            self.gathers.attach(recorder)


def own_tensors(model: torch.nn.Module) -> FakeModel:
    """The model's own (already fake) parameters and buffers; tied names share one entry. Call
    inside the mode: tensors kept as plain attributes get fake stand-ins."""
    fake = FakeModel({}, {}, {}, {}, [])
    for named, groups in ((model.named_parameters, fake.param_groups), (model.named_buffers, fake.buffer_groups)):
        for name, t in named(remove_duplicate=False):
            fake.fake_of.setdefault(id(t), t)
            groups.setdefault(id(t), []).append(name)
    fake.attributes = [(m, k, v, fake_like(v, None)) for m in model.modules() for k, v in vars(m).items()
                       if isinstance(v, torch.Tensor) and not isinstance(v, torch.nn.Parameter)]
    return fake


def prepare(model: torch.nn.Module, spec, mesh, config, inputs: tuple = ((), {})) -> Prepared:
    """``inputs``: (args, kwargs) of the step, for DDP's warm-up step (fxacct.parallel.ddp.ready)."""
    register_fsdp_copies()
    if config.dtype is not None:
        model.to(config.dtype)  # on meta: casts the floating parameters and buffers, allocates nothing
    with tp.shared_mesh_concatenation():
        parallelize(model, spec, mesh, config)
    warm_up = (lambda: ddp.ready(model, *inputs)) if ddp.is_ddp(spec) and not config.parallelize else None
    return materialize(model, warm_up=warm_up)


def materialize(model: torch.nn.Module, shape_env=None, warm_up=None) -> Prepared:
    """The parallelized model's parameters made fake in the capture's FakeTensorMode (with
    ``shape_env``: values read from tensors become symbols, e.g. MoE token splits); ``warm_up``
    runs in the mode once they are (DDP's warm-up step and bucket rebuild)."""
    from torch.distributed.tensor import DTensor

    register_fsdp_copies()
    aliases = tied_aliases(model)
    mode = FakeTensorMode(allow_non_fake_inputs=True, shape_env=shape_env)
    try:
        with mode:
            # to_empty from meta gives each module a new Parameter (the types differ, so no .data
            # swap), which unties a plain module's tied weights (FSDP2's own _apply keeps them): tie again
            model.to_empty(device="cpu")
            retie(model, {a: n for a, n in aliases.items() if model.get_parameter(a) is not model.get_parameter(n)})
            if warm_up is not None:
                warm_up()
            fake = own_tensors(model)
    except Exception as e:
        raise classify(e, "materializing the parallelized model") from e
    return Prepared(mode, fake, (DTensor,), StorageResizes())


@dataclass
class RankCapturer:
    """fxacct.step's Capturer for rank 0 of the parallelized model: each capture records FSDP2's
    storage resizes (their lifetimes join the walk) and replays its gathers; collectives are
    marked once the graph is annotated."""

    model: torch.nn.Module
    args: tuple
    kwargs: dict
    prepared: Prepared
    groups: dict  # process group name -> (mesh dim, size): fxacct.parallel.collectives.mesh_groups
    resizes: dict = field(default_factory=dict)  # id(capture) -> its resize events
    collectives: tuple = ()  # CollectiveNode of the training capture, in issue order

    def capture(self, options: CaptureOptions) -> Capture:
        """One capture of the prepared model. One prepared model serves the training capture and
        then the inference one: a capture leaves no tags on the tensors FSDP2 keeps
        (fxacct.trace.dispatch_recorder.Recorder.untag), and the gradients the training step left
        are dropped first, as no inference holds them."""
        resizes = StorageResizes()
        prepared = replace(self.prepared, resizes=resizes, gathers=GatherReplay(resizes) if options.dedup else None)
        if options.inference:
            self.model.zero_grad(set_to_none=True)
        with tp.dtensor_meta_unrecorded(), resizes.watching(), gathers_replayed(prepared.gathers), \
                warnings.catch_warnings():
            # FSDP2 warns that an in-place op on a returned view would skip its hook: the traced step
            # makes none (the loss reads the outputs), so the warning says nothing about this account
            warnings.filterwarnings("ignore", message="FSDP2-wrapped module")
            # repeated blocks replay (FSDP2's hooks run around each block's forward and backward,
            # replayed or not, so its frees and reduce-scatters stay recorded; its gathers replay
            # from their own templates: fxacct.parallel.fsdp_replay)
            cap = capture(self.model, tuple(self.args), self.kwargs, replace(options, prepared=prepared))
        alias_waits(cap)
        if not options.inference:
            cap = unsave_resized(cap, resizes.events)
        self.resizes[id(cap)] = resizes.events
        return cap

    def lifetimes(self, cap: Capture):
        return with_resizes(lifetimes(cap), self.resizes[id(cap)])

    def annotated(self, cap: Capture) -> None:
        self.collectives = mark(cap.graph, self.groups)

    def training_resizes(self, cap: Capture) -> tuple:
        return tuple(self.resizes[id(cap)])
