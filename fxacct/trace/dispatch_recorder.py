"""The dispatch-level recorder of a capture, and what runs beside it: module names (global
module hooks), and where a fake kernel allocates or returns other than the real one, the real
kernel's storages and outputs (fxacct.trace.kernel_facts)."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.overrides import TorchFunctionMode

from fxacct.errors import ModelError, passes_through
from fxacct.load.inputs import BOUND
from fxacct.trace import torch_private as tp
from fxacct.trace.fake_mode import alias
from fxacct.trace.kernel_facts import KERNEL_OUTPUTS, KERNEL_STORAGES
from fxacct.trace.module_hooks import global_module_hooks
from fxacct.trace.records import (
    NO_NUMBERS,
    TAG,
    OpRecord,
    Ref,
    Slot,
    Storages,
    TensorMeta,
    TookSequenceNumbers,
    UnderAutogradNode,
    map_nested,
)

FORWARD, LOSS, BACKWARD, OPTIMIZER = "forward", "loss", "backward", "optimizer"
RECOMPUTE = "recompute"  # scope of a backward-phase record that re-runs a forward op
_PRIM_DEVICE = torch.ops.prim.device.default
_DETACH = torch.ops.aten.detach.default
# metadata queries (prim.device, ...): no tensor work (profiler markers, record_function, return
# earlier in __torch_dispatch__, without the fake mode)
_NOT_RECORDED = frozenset({"prim"})


_aten = torch.ops.aten
# Inside F.multi_head_attention_forward the projections are linear (mm/addmm) and the only batched
# products are QKᵀ and PV: its own math path (need_weights=True: baddbmm/bmm) or SDPA's math path
# (bmm, via matmul), whichever it takes.
_MHA_PRODUCTS = frozenset({_aten.bmm, _aten.baddbmm})


def _one_dtype(func, args, phase: str) -> None:
    """Eager's matrix products refuse operands of different dtypes (at::native's addmm/mm/bmm
    checks: "expected mat1 and mat2 to have the same dtype"); their meta kernels do not check,
    so a model feeding an int64 input to nn.Linear traced as if it ran."""
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor)]
    if len(set(dtypes)) > 1:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ModelError(f"the model's {phase} runs {func} on tensors of {names}, which eager PyTorch refuses (a "
                         "matrix product takes one dtype): cast them to one (an integer --input to a float one?)")


def _rows(func, args, phase: str) -> None:
    """Eager's embedding kernels refuse an index past the table ("IndexError: index out of range
    in self"); the meta kernels have no values to check. An input whose values are bounded (its
    --input's <N, an example's largest id) and index a smaller table would raise there."""
    weight, indices = args[0], args[1]
    bound = getattr(indices, BOUND, None)
    if bound is not None and weight.dim() and bound > weight.shape[0]:
        raise ModelError(f"the model's {phase} looks up ids up to {bound - 1} in an embedding of {weight.shape[0]} rows "
                         "(aten.embedding), which eager refuses (IndexError: index out of range in self): give ids "
                         f"below {weight.shape[0]} (--input ...<{weight.shape[0]}) or build a larger table")


# what eager checks before an op that its fake (meta) kernel does not: raised as eager raises it
_EAGER_CHECKS = {op: _one_dtype for op in (_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
                                           _aten.baddbmm.default)}
_EAGER_CHECKS.update({op: _rows for op in (_aten.embedding.default, _aten._embedding_bag.default,
                                            _aten._embedding_bag_forward_only.default)})


class Recorder(tp.TorchDispatchMode):
    """Records every aten op with its phase, module, autograd sequence link, argument references
    and output metadata. Per op it does only that; the graph is built once afterwards."""

    def __init__(self, storages: Storages, defer: tuple = ()):
        super().__init__()
        # tensor subclasses that run first and come back as plain ops (DTensor: its local shards
        # and the collectives it issues), as torch.distributed.tensor.debug.CommDebugMode does
        self.defer = frozenset(defer)
        self.group: TookSequenceNumbers | None = None  # the numbers the running subclass op took
        self.recomputing = False  # the running subclass op is a recompute in the backward (_deferred)
        self.records: list[OpRecord] = []
        self.constants: list[tuple[Slot, TensorMeta]] = []  # tensors no traced op produced
        self.phase = FORWARD
        self.module_stack: list[str] = [""]
        self.last_seq = tp.next_autograd_number()
        self.storages = storages
        self.repeats: list[tuple[int, int, int]] = []  # (first record, end, parameters it stands for)
        self.recording = True
        self.scope: str | None = None  # "attention" inside scaled_dot_product_attention
        self.in_mha = 0  # depth of F.multi_head_attention_forward calls (its bmm products are attention)
        # (module, link, scope, fused, requires_grad) for the ops of one node of a compiled graph
        # (fxacct.trace.compiled): the graph's node knows them, the running Python (a forward under
        # no_grad inside autograd.Function) does not; None: the recorder decides. ``fused``: the
        # node's result stays inside its fused kernel; ``requires_grad``: per tensor argument, or None
        self.override: tuple | None = None
        # while a replay's probe runs (fxacct.trace.replay_train): the saved-tensor pack hook in force at
        # each of its ops (a checkpointed region inside the block has its own)
        self.packs_seen: set | None = None
        # every tensor tagged here, weakly: a capture clears its tags when it ends (untag), so a
        # tensor that outlives it (FSDP2's gathered parameters, a module's constant) is untagged
        # when the next capture of the same model meets it
        self.tagged: list[weakref.ref] = []
        # what the saved-tensor hook's unpack just handed autograd (SavedTracker.unpack), until the
        # next op: the engine detaches it (below), or does not and it is forgotten
        self.unpacked: torch.Tensor | None = None

    @contextlib.contextmanager
    def suppressed(self):
        """Ops run but are not recorded (fxacct.trace.replay makes a replayed block's outputs)."""
        self.recording = False
        try:
            yield
        finally:
            self.recording = True

    def _deferred(self):
        """A subclass-level op (DTensor) runs first; the sequence numbers it took go to its local ops."""
        hi = tp.next_autograd_number()
        if self.phase == BACKWARD and not torch.is_grad_enabled():
            return NotImplemented  # a no-grad op (checkpointing packing what it saves) consumes no number
        self.group = TookSequenceNumbers(self.last_seq, hi) if hi != self.last_seq and self.phase != BACKWARD else None
        # in the backward, a subclass op that made a grad_fn under torch.utils.checkpoint's recompute
        # is a recompute: so are its local ops
        self.recomputing = self.phase == BACKWARD and hi != self.last_seq and tp.in_checkpoint_recompute()
        self.last_seq = hi
        return NotImplemented

    def repeat_of(self, index: int) -> int:
        for start, end, count in self.repeats:
            if start <= index < end:
                return count
        return 1

    def meta(self, t: torch.Tensor) -> TensorMeta:
        if t.layout is not torch.strided:  # a sparse tensor has no storage to account
            source = (" (nn.Embedding or nn.EmbeddingBag with sparse=True make sparse gradients: build them with "
                      "sparse=False, -k sparse=False where the constructor takes it, for the dense equivalent)"
                      if self.phase == BACKWARD else ": fxacct accounts strided tensors only")
            raise ModelError(f"the model's {self.phase} makes a {str(t.layout).removeprefix('torch.')} tensor, "
                             f"which fxacct does not account{source}")
        sid = self.storages.id_of(t)
        dtype, nbytes = self.storages.real.get(sid, (t.dtype, t.untyped_storage().nbytes()))
        return TensorMeta(tuple(t.shape), tuple(t.stride()), dtype, sid, nbytes, t.requires_grad)

    def ref(self, t: torch.Tensor) -> Ref:
        ref = getattr(t, TAG, None)
        if ref is None:  # made outside the traced ops: a constant held by the module or the code
            ref = Ref(Slot("constant", len(self.constants)))
            self.constants.append((ref.source, self.meta(t)))
            self.tag(t, ref)
        return ref

    def tag(self, t: torch.Tensor, ref: Ref) -> None:
        setattr(t, TAG, ref)
        self.tagged.append(weakref.ref(t))

    def untag(self) -> None:
        """Clear the tag of every tensor tagged during the capture that is still alive."""
        for w in self.tagged:
            t = w()
            if t is not None and TAG in t.__dict__:
                delattr(t, TAG)
        self.tagged = []

    def _fused_away(self, out) -> None:
        """The storages of a result that lives inside a fused kernel hold no bytes: inductor never
        allocates them (fxacct.trace.fusion.kernel_internal)."""
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.storages.real[self.storages.id_of(t)] = (t.dtype, 0)

    def refs(self, a, rg: list):
        """``a`` with each tensor replaced by its Ref; whether each required grad goes to ``rg``."""
        def one(t: torch.Tensor) -> Ref:
            rg.append(t.requires_grad)
            return self.ref(t)

        return map_nested(a, one, torch.Tensor)

    def _outputs(self, out, index: int):
        """The op's output as TensorMeta (a tuple of them, None where an output is no tensor), each
        output tensor tagged with record ``index``."""
        if isinstance(out, torch.Tensor):
            self.tag(out, Ref(index))
            return self.meta(out)
        if not isinstance(out, (tuple, list)):
            return None
        val = []
        for i, o in enumerate(out):
            if isinstance(o, torch.Tensor):
                self.tag(o, Ref(index, i))
                val.append(self.meta(o))
            else:
                val.append(None)
        return tuple(val)

    @passes_through
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and isinstance(args[0], tp.FakeTensor):
            # the backward engine asks every gradient for its device; answer as FakeTensor
            # would (its fake_device) without a trip through the fake mode's dispatch
            return args[0].fake_device
        if self.defer and not self.defer.isdisjoint(types):
            return self._deferred()
        unpacked, self.unpacked = self.unpacked, None
        if func is _DETACH and (unpacked is not None and args[0] is tp.local(unpacked)
                                or self.phase == BACKWARD and tp.in_accumulate_grad()):
            return self._engine_detach(args[0])
        kwargs = kwargs or {}
        check = _EAGER_CHECKS.get(func)
        if check is not None:
            check(func, args, self.phase)
        if func.namespace == "profiler":
            # record_function markers (FSDP2 puts several around every block) hold no tensor:
            # their kernel runs as it is, without a trip through the fake mode below
            with tp.no_python_dispatch():
                return func(*args, **kwargs)
        out = func(*args, **kwargs)
        if func in KERNEL_OUTPUTS:
            out = KERNEL_OUTPUTS[func](out)
        if func.namespace in _NOT_RECORDED or not self.recording:
            return out
        if self.override is not None and self.override[3]:
            self._fused_away(out)
        fix = KERNEL_STORAGES.get(func)
        if fix is not None:
            fix(self.storages, args, out)
        rg: list[bool] = []
        ref_args = self.refs(args, rg)
        ref_kwargs = {k: self.refs(v, rg) for k, v in kwargs.items()}
        self.append(func, ref_args, ref_kwargs, self._outputs(out, len(self.records)), tuple(rg))
        return out

    def _engine_detach(self, saved: torch.Tensor) -> torch.Tensor:
        """The detach autograd's engine runs on a saved input that fxacct's saved-tensor hook
        unpacked (SavedVariable::unpack makes a hook's tensor a new Variable by
        shallow_copy_and_detach, a dispatched aten.detach, where the tensor is still referenced,
        as the hook's is): run, not recorded. Without the hook autograd hands a saved input back as
        it was saved, with no op at all (a saved output it does detach: SavedTracker.pack tells them
        apart, and that detach is recorded as eager runs it). The ones left out are fxacct's own, a
        view per saved input per backward op: an eighth of a transformer's step. Its output is an
        alias of the saved tensor: the ops that read it read the saved tensor's node.

        AccumulateGrad's detach of the gradient it stores in .grad (loss.backward()) is left out
        alike: a view, no bytes and no FLOPs, that the engine runs for a replayed block's
        gradients only after the whole block (fxacct.trace.replay_node), for a traced block's
        inside it; left in, the two would differ in the order of their nodes alone."""
        out = _engine_alias(saved)
        if self.recording:
            self.tag(out, self.ref(saved))
        return out

    def append(self, func, ref_args, ref_kwargs, val, rg: tuple, origin=None) -> None:
        """Record ``func`` as run here and now: its phase, module, autograd link and scope are the
        recorder's present ones (fxacct.parallel.fsdp_replay appends the ops of a replayed FSDP2
        gather through this too, each with ``origin``: the template record it repeats)."""
        index = len(self.records)
        hi = tp.next_autograd_number()
        if self.phase == BACKWARD:
            # an op that records a grad_fn during the backward, under torch.utils.checkpoint's
            # recompute, is a forward op run again: activation checkpointing recomputing what it did
            # not save (model FLOPs leave it out). A custom autograd.Function's backward that re-runs
            # forward ops under enable_grad is that Function's backward work, not a recompute.
            # checkpointing's recompute packs what it saves with detach ops under no_grad, after
            # the op that took the number and before it runs: they neither take nor consume it
            grad_on = torch.is_grad_enabled()
            scope = (RECOMPUTE if grad_on and (self.recomputing or (hi != self.last_seq and tp.in_checkpoint_recompute()))
                     else None)
            if not grad_on:
                hi = self.last_seq
            seq = tp.current_autograd_number()
            link = UnderAutogradNode(seq) if seq is not None else None
            module = None
        else:
            scope = self.scope
            if scope is None and self.in_mha and func.overloadpacket in _MHA_PRODUCTS:
                scope = "attention"
            if hi != self.last_seq:
                link, self.group = TookSequenceNumbers(self.last_seq, hi), None
            else:  # a subclass op's local ops all carry its numbers: the last (its output) owns them
                link = self.group or NO_NUMBERS
            module = self.module_stack[-1]
        self.last_seq = hi
        if self.override is not None:
            module, link, scope, _, wanted = self.override
            rg = wanted if wanted is not None and len(wanted) == len(rg) else rg
        self.records.append(OpRecord(func, ref_args, ref_kwargs, val, self.phase, module, link, rg, scope, origin))
        self.storages.clock = index
        if self.packs_seen is not None:
            self.packs_seen.add(tp.top_saved_tensors_pack())


def _engine_alias(t: torch.Tensor) -> torch.Tensor:
    """``aten.detach(t)`` for the engine, from inside the recorder: where the fake mode alone is
    below it and would take its short path (fxacct.trace.fake_mode), the same view made at once
    (fake_mode.alias); a loss.backward() of a 70B step runs about 800 of them."""
    out = alias(t) if tp.dispatch_modes_below() == 1 and tp.fake_mode_in_force() is getattr(t, "fake_mode", None) \
        else None
    return _DETACH(t) if out is None else out


def module_tracking(recorder: Recorder, names: dict[int, str]):
    """Global forward pre/post hooks that keep the FQN of the running module on a stack."""

    def pre(module, args):
        name = names.get(id(module))
        recorder.module_stack.append(recorder.module_stack[-1] if name is None else name)

    def post(module, args, output):
        recorder.module_stack.pop()

    return global_module_hooks(pre, post)


class AttentionScope(TorchFunctionMode):
    """Marks the ops PyTorch runs inside F.scaled_dot_product_attention. Where it takes its math
    path (on the CPU with dropout or some masks) those are plain bmm and softmax ops; marked,
    their matmul FLOPs count as attention like every fused kernel's (DESIGN.md's classes).

    F.multi_head_attention_forward (nn.MultiheadAttention, nn.Transformer*Layer) is watched too:
    a mode is off while it handles a call, so the SDPA call nested in it is never seen here, and
    with need_weights=True it computes QKᵀ and PV itself. Its bmm/baddbmm products are marked
    in the recorder (``in_mha``) instead, whichever path it takes."""

    def __init__(self, recorder: Recorder):
        super().__init__()
        self.recorder = recorder

    @passes_through
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is torch.nn.functional.multi_head_attention_forward:
            self.recorder.in_mha += 1
            try:
                return func(*args, **(kwargs or {}))
            finally:
                self.recorder.in_mha -= 1
        if func is not torch.nn.functional.scaled_dot_product_attention:
            return func(*args, **(kwargs or {}))
        outer, self.recorder.scope = self.recorder.scope, "attention"
        try:
            return func(*args, **(kwargs or {}))
        finally:
            self.recorder.scope = outer
