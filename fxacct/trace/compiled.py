"""The compiled step (--compile, --compile-blocks PATTERN): the model, or each matching module, run
as ``torch.compile`` (inductor) would split it, inside a capture.

How. On a region's first call in a training capture, AOTAutograd traces the region on the capture's
fake tensors into its joint forward+backward graph, with inductor's decomposition table, and splits
it with inductor's own partition function (its joint-graph passes, then
``min_cut_rematerialization_partition``): the same calls ``torch._inductor.compile_fx`` makes in
this torch release (fxacct.trace.torch_private.compile). Where inductor would generate code, the
"compilers" here keep the partitioned forward and backward aten graphs and return runners that
execute them op by op. So in the capture the region is one ``autograd.Function`` (AOTAutograd's
CompiledFunction) exactly as at run time: what it saves for the backward is the partitioner's
choice (autograd's saved-tensor hooks see it as they see a real compiled step's), its forward and
backward ops are recorded like any other, and a value dies after its last use in the graph, as an
inductor buffer does. Each recorded op of a graph node carries the node's module (the FQN the
module hooks saw while AOTAutograd traced it) and, in the backward, the forward record of the
node with the same autograd sequence number; a forward op the partitioner chose to recompute in
the backward is marked as a recompute.

What differs from torch.compile. Dynamo is not run: the region's Python is traced whole by
AOTAutograd's make_fx, so a model with graph breaks is accounted as one graph per region (dynamo
would partition each piece separately). Inductor's code generation (fusion, buffer reuse,
post-grad passes) does not run; the kernels inductor would make are modelled in
fxacct.trace.fusion, and a result that stays inside its fused kernel holds no bytes in the
memory timeline (inductor allocates no buffer for it). Inference (no_grad) runs the region eagerly. ``compile_mode`` does not
change the split: max-autotune picks other kernels for the same graph, and reduce-overhead's CUDA
graphs keep their memory pool, which is stated, not modelled (docs/limits.md).
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.fx.traceback as fx_traceback

from fxacct.errors import CompileError, ModelError, UsageError, called_by_torch, first_line
from fxacct.trace import torch_private as tp
from fxacct.trace.checkpointing import matched_modules
from fxacct.trace.dispatch_recorder import RECOMPUTE, Recorder
from fxacct.trace.fusion import FREE, GraphKernels, graph_kernels
from fxacct.trace.graph_passes import (
    IS_FORWARD,
    RNG_STATE_SHAPE,
    RUN_AND_SAVE_RNG,
    RUN_WITH_RNG,
    channels_last_inputs,
    rng_wrapper_meta,
)
from fxacct.trace.module_hooks import global_module_hooks
from fxacct.trace.records import NO_NUMBERS, DerivedFromRecord, iter_nested
from fxacct.trace.torch_private.compile import aot

_MODULE_KEY = "fxacct_module"  # node.meta["custom"] key AOTAutograd copies onto each traced node


@dataclass(frozen=True)
class CompileSpec:
    """What is compiled: the whole model (``blocks`` empty) or each outermost module whose name
    matches one of ``blocks`` (fnmatch globs, as --checkpoint), and torch.compile's mode."""

    blocks: tuple[str, ...] = ()
    mode: str = "default"


def regions(model: torch.nn.Module, spec: CompileSpec) -> list[str]:
    """The module names compiled: [""] for the whole model, else the outermost matches."""
    if not spec.blocks:
        return [""]
    try:
        return matched_modules(model, spec.blocks)
    except UsageError as e:
        raise UsageError(str(e).replace("--checkpoint", "--compile-blocks")) from None


def compile_in_place(model: torch.nn.Module, spec: CompileSpec) -> None:
    """A real run's model compiled as the capture accounts it (fxacct.runtime.run): each region
    compiled in place by ``nn.Module.compile`` (inductor, torch.compile's mode), the whole model
    for the region ""."""
    modules = dict(model.named_modules())
    for name in regions(model, spec):
        modules[name].compile(mode=None if spec.mode == "default" else spec.mode)


@dataclass
class _Region:
    """One compiled module while a capture runs: its AOTAutograd callable per input signature."""

    name: str
    module: torch.nn.Module
    forward: object  # the forward the region runs (an instance attribute already set, as --checkpoint's, or the class's)
    compiled: dict
    own: object = None  # the instance attribute ``forward`` before (None: none), restored on exit


class _Flat(torch.nn.Module):
    """The region as AOTAutograd's simplified entry takes it: flat tensor inputs, a tuple of tensors out."""

    def __init__(self, region: _Region, flat: list, spec, out_spec: list):
        super().__init__()
        self.inner = region.module  # its parameters and buffers are the graph's lifted inputs
        self.region, self.flat, self.spec, self.out_spec = region, flat, spec, out_spec

    def forward(self, *tensors):
        it = iter(tensors)
        args, kwargs = tp.tree_unflatten([next(it) if isinstance(x, torch.Tensor) else x for x in self.flat],
                                         self.spec)
        leaves, out_spec = tp.tree_flatten(self.region.forward(*args, **kwargs))
        for t in leaves:
            if not isinstance(t, (torch.Tensor, *_CONSTANTS)):
                raise UsageError(
                    f"--compile: module {self.region.name or '(root)'} returns an object of type {type(t).__name__}, which fxacct "
                    "cannot take apart into tensors (it compiles regions that return tensors, constants and "
                    "containers of them): compile its blocks instead (--compile-blocks PATTERN), or register the "
                    "type with torch.utils._pytree (register_dataclass)")
        # the constants (a count, a flag, None) as the traced call returned them, as torch.compile
        # specializes on them; None in a tensor's place
        self.out_spec.append((out_spec, [None if isinstance(t, torch.Tensor) else (t,) for t in leaves]))
        return tuple(t for t in leaves if isinstance(t, torch.Tensor))


_CONSTANTS = (type(None), bool, int, float, complex, str, torch.dtype, torch.device)


def _unflatten(tensors, out_spec):
    """A compiled region's output: its tensors put back among the constants it returned."""
    spec, constants = out_spec
    it = iter(tensors)
    return tp.tree_unflatten([next(it) if c is None else c[0] for c in constants], spec)


class _GraphRun(fx.Interpreter):
    """Runs one partitioned graph op by op under the capture's recorder, each node's ops carrying
    the node's module, backward link and scope. Values are freed after their last use."""

    def __init__(self, gm: fx.GraphModule, recorder: Recorder, region: str, seq_first: dict, backward: bool,
                 kernels: GraphKernels, kernel_of: dict, input_grad):
        super().__init__(gm, garbage_collect_values=True)
        self.recorder, self.region, self.seq_first, self.backward = recorder, region, seq_first, backward
        self.kernels, self.kernel_of, self.internal = kernels, kernel_of, kernels.internal
        # whether each forward value requires grad in the step the graph stands for (the joint
        # graph's view, which the recorder cannot see under autograd.Function's no_grad): a
        # backward op's cost counts only the gradients its forward op's arguments need
        # (boxed_run binds the placeholders without run_node): a forward input's from its
        # AOTAutograd descriptor
        self.needs_grad: dict[fx.Node, bool] = {
            n: input_grad is not None and input_grad(n.meta.get("desc")) for n in gm.graph.find_nodes(op="placeholder")}

    def _wanted(self, n: fx.Node) -> tuple:
        """requires_grad of each tensor argument of ``n``, in the order the recorder meets them."""
        return tuple(self.needs_grad.get(a, False) for a in iter_nested((n.args, tuple(n.kwargs.values())), fx.Node)
                     if any(isinstance(t, torch.Tensor) for t in _tensor_leaves(self.env.get(a))))

    def call_function(self, target, args, kwargs):
        """The RNG wrappers run their op as itself (recorded like any op); the saved state is a new
        tensor the size of the generator's state (``torch.get_rng_state()``: a copy), as the graph
        traced it."""
        if target is RUN_AND_SAVE_RNG:
            out = args[0](*args[1:], **kwargs)  # first: the op's record is the one its backward links to
            return torch.empty(RNG_STATE_SHAPE, dtype=torch.uint8), out
        if target is RUN_WITH_RNG:
            return args[1](*args[2:], **kwargs)
        return super().call_function(target, args, kwargs)

    def run_node(self, n: fx.Node):
        if n.op != "call_function":
            return super().run_node(n)
        rec = self.recorder
        module = (n.meta.get("custom") or {}).get(_MODULE_KEY, self.region)
        seq = n.meta.get("seq_nr")
        first = len(rec.records)
        if self.backward:
            owner = self.seq_first.get(seq, self.seq_first.get(None))
            link = DerivedFromRecord(owner) if owner is not None else None
            scope = RECOMPUTE if n.meta.get("partitioner_tag") == IS_FORWARD else None
            rec.override = (None, link, scope, n in self.internal, None)
        else:
            rec.override = (module, NO_NUMBERS, rec.scope, n in self.internal, self._wanted(n))
        try:
            out = super().run_node(n)
        finally:
            rec.override = None
        if not self.backward:
            self.needs_grad[n] = any(self.needs_grad.get(a, False) for a in n.all_input_nodes) and any(
                t.is_floating_point() for t in _tensor_leaves(out))
        kernel = FREE if n in self.kernels.views else self.kernels.kernel_of.get(n)
        if kernel is not None:  # the records of a fused (or view) node: its kernel, for the fused time
            for index in range(first, len(rec.records)):
                self.kernel_of[index] = (id(self.kernels), kernel)
        if not self.backward and len(rec.records) > first:
            self.seq_first.setdefault(seq, first)
            self.seq_first.setdefault(None, first)  # the region's first op: owner of unlinked backward ops
        return out


def _input_grad(module: torch.nn.Module, tensors: list, desc) -> bool:
    """Whether the forward graph's input with AOTAutograd's descriptor ``desc`` requires grad: a
    parameter (ParamAOTInput: its target in ``module``) or the region's input ``idx`` (PlainAOTInput)."""
    target, idx = getattr(desc, "target", None), getattr(desc, "idx", None)
    if isinstance(target, str):
        p = dict(module.named_parameters(remove_duplicate=False)).get(target)
        return p is not None and p.requires_grad
    return isinstance(idx, int) and idx < len(tensors) and tensors[idx].requires_grad


def _tensor_leaves(value) -> list:
    return [t for t in tp.tree_leaves(value) if isinstance(t, torch.Tensor)]


def _runner(gm: fx.GraphModule, recorder: Recorder, region: str, seq_first: dict, backward: bool, graphs: list,
            kernel_of: dict, kernel_bytes: dict, input_grad=None):
    if not backward:
        channels_last_inputs(gm)
    if backward:  # the forward was compiled first (force_non_lazy_backward_lowering): graphs[0]
        rng_wrapper_meta(graphs[0], gm)
    else:
        rng_wrapper_meta(gm)
    graphs.append(gm)
    kernels = graph_kernels(gm.graph)
    kernel_bytes.update({(id(kernels), k): b for k, b in kernels.bytes_of.items()})
    kernel_bytes[(id(kernels), FREE)] = 0

    def run(args: list):
        # boxed (AOTAutograd's convention, as inductor's code): the inputs' list is cleared, so a
        # saved tensor or input dies when the graph's last use of it has run
        return _GraphRun(gm, recorder, region, seq_first, backward, kernels, kernel_of, input_grad).boxed_run(args)

    run._boxed_call = True
    return run


class CompiledRegions:
    """Within the context, each region's forward runs as its compiled graphs (module docstring).
    ``graphs`` collects (region, forward GraphModule, backward GraphModule) as they are made."""

    def __init__(self, model: torch.nn.Module, spec: CompileSpec, recorder: Recorder):
        self.model, self.spec, self.recorder = model, spec, recorder
        self.graphs: list[tuple[str, fx.GraphModule, fx.GraphModule | None]] = []
        # record index -> (graph, kernel id) of the fused kernel its node runs in (FREE: a view);
        # (graph, kernel id) -> bytes the kernel moves
        self.kernel_of: dict[int, tuple] = {}
        self.kernel_bytes: dict[tuple, int] = {}
        self._regions: list[_Region] = []

    def __enter__(self):
        modules = dict(self.model.named_modules())
        for name in regions(self.model, self.spec):
            m = modules[name]
            region = _Region(name, m, m.forward, {}, m.__dict__.get("forward"))
            self._regions.append(region)
            m.forward = self._compiled_forward(region)  # an instance attribute shadows the class's forward
        return self

    def by_node(self, nodes: dict) -> dict:
        """Capture's kernel_of (node name -> kernel key) and kernel_bytes, from the graph builder's
        nodes by record index."""
        return {"kernel_of": {nodes[i].name: k for i, k in self.kernel_of.items() if i in nodes},
                "kernel_bytes": dict(self.kernel_bytes)}

    def __exit__(self, *exc):
        for region in self._regions:
            if region.own is None:
                del region.module.forward
            else:
                region.module.forward = region.own
        self._regions = []

    def _compiled_forward(self, region: _Region):
        def forward(*args, **kwargs):
            if not torch.is_grad_enabled():
                return region.forward(*args, **kwargs)
            flat, spec = tp.tree_flatten((args, kwargs))
            tensors = [x for x in flat if isinstance(x, torch.Tensor)]
            key = tuple((tuple(t.shape), t.dtype, t.requires_grad) if isinstance(t, torch.Tensor) else repr(t)
                        for t in flat)
            entry = region.compiled.get(key)
            if entry is None:
                entry = region.compiled[key] = self._compile(region, flat, spec, tensors)
            fn, out_spec = entry
            return _unflatten(fn(*tensors), out_spec[0])

        return forward

    def _compile(self, region: _Region, flat: list, spec, tensors: list):
        """AOTAutograd with inductor's decompositions and partitioner, on the capture's fake
        tensors, outside the recorder (its tracing is not the step's work)."""
        rec, seq_first, graphs, out_spec = self.recorder, {}, [], []
        name = region.name or "(root)"

        def fw(gm, example_inputs):
            return _runner(gm, rec, region.name, seq_first, False, graphs, self.kernel_of, self.kernel_bytes,
                           functools.partial(_input_grad, flat_module, tensors))

        def bw(gm, example_inputs):
            return _runner(gm, rec, region.name, seq_first, True, graphs, self.kernel_of, self.kernel_bytes)

        lib = aot()
        flat_module = _Flat(region, flat, spec, out_spec)
        try:
            with tp.disable_current_modes(), fx_traceback.preserve_node_meta(), _module_meta(rec), \
                    lib.functorch_patch(force_non_lazy_backward_lowering=True), \
                    lib.V.set_fake_mode(lib.detect_fake_mode(tensors)), lib.compile_session():
                fn = lib.aot_module_simplified(flat_module, tensors, fw_compiler=fw, bw_compiler=bw,
                                               decompositions=lib.decompositions(), partition_fn=lib.partition_fn,
                                               keep_inference_input_mutations=True)
        except (ModelError, UsageError):
            raise
        except Exception as e:  # torch.compile's own error on the user's model
            raise CompileError(f"--compile: module {name} does not compile: {type(e).__name__}: {first_line(e)}") from e
        finally:
            rec.last_seq = tp.next_autograd_number()  # the numbers AOTAutograd's tracing took are no step's
        self.graphs.append((region.name, graphs[0], graphs[1] if len(graphs) > 1 else None))
        return fn, out_spec


@contextlib.contextmanager
def _module_meta(recorder: Recorder):
    """While AOTAutograd traces, every node it makes carries the FQN of the module it ran in (the
    capture's module hooks keep the stack; ``custom`` is the meta field make_fx copies)."""

    def pre(module, args):
        fx_traceback.current_meta["custom"] = {_MODULE_KEY: recorder.module_stack[-1]}

    def post(module, args, output):
        fx_traceback.current_meta["custom"] = {_MODULE_KEY: recorder.module_stack[-1]}

    called_by_torch(pre)
    called_by_torch(post)
    fx_traceback.current_meta["custom"] = {_MODULE_KEY: recorder.module_stack[-1]}
    try:
        with global_module_hooks(pre, post):
            yield
    finally:
        fx_traceback.current_meta.pop("custom", None)


@contextlib.contextmanager
def compiled(model: torch.nn.Module, spec: CompileSpec | None, recorder: Recorder):
    """CompiledRegions when ``spec`` asks for a compile; nothing otherwise."""
    if spec is None:
        yield None
        return
    with CompiledRegions(model, spec, recorder) as regions_:
        yield regions_


@dataclass(frozen=True)
class CompileSide:
    """One account of the compile what-if, forward and backward of the step: activation bytes
    autograd saves, the training peak, the kernels and the bytes they move (fxacct.trace.fusion;
    eager: one kernel per op), the roofline's step time where a device model is known (compiled:
    with the fused kernels, fxacct.predict.fused_time), and activation bytes per module (FQN -> bytes)."""

    activation_bytes: int
    peak_train_bytes: int | None
    kernels: int
    bytes_moved: int
    predicted_step_ms: float | None
    modules: dict


@dataclass(frozen=True)
class CompileWhatIf:
    regions: tuple[str, ...]  # the modules compiled ("" the whole model)
    mode: str
    compiled: CompileSide
    eager: CompileSide  # the same step without compiling (a second capture)
