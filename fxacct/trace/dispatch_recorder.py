"""The dispatch-level recorder of a capture, and what runs beside it: module names (global
module hooks) and the few kernels whose fake version allocates other dtypes than the real one
(what autograd saves: fxacct.trace.saved_tensors)."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.overrides import TorchFunctionMode

from fxacct.errors import ModelError, passes_through
from fxacct.trace import torch_private as tp
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
    itemsize,
    map_nested,
)

FORWARD, LOSS, BACKWARD, OPTIMIZER = "forward", "loss", "backward", "optimizer"
RECOMPUTE = "recompute"  # scope of a backward-phase record that re-runs a forward op
_PRIM_DEVICE = torch.ops.prim.device.default
_DETACH = torch.ops.aten.detach.default
# metadata queries (prim.device, ...): no tensor work (profiler markers, record_function, return
# earlier in __torch_dispatch__, without the fake mode)
_NOT_RECORDED = frozenset({"prim"})


def _batch_norm_stats(storages: Storages, args, out) -> None:
    """Batch norm's saved mean and inverse std take the dtype of its weight / running stats when
    those differ from the input's (a bf16 input with fp32 parameters under autocast): the CPU and
    CUDA kernels compute them in the parameter type (aten/src/ATen/native/Normalization.cpp,
    `mixed_type`), the fake kernel in the input's."""
    x = args[0]
    params = [a for a in args[1:5] if isinstance(a, torch.Tensor)]
    if not params or params[0].dtype == x.dtype:
        return
    dtype = params[0].dtype
    for t in out[1:3]:
        if isinstance(t, torch.Tensor) and t.dtype != dtype:
            storages.real[storages.id_of(t)] = (dtype, t.numel() * itemsize(dtype))


def _unreduced_loss(storages: Storages, args, out) -> None:
    """mse_loss and smooth_l1_loss with a reduction return their 0-dim loss in the storage of the
    unreduced loss they computed first, which so lives as long as the loss (measured on CPU, torch
    2.13: F.mse_loss of two float32[64, 2048] gives a scalar whose storage is 524,288 B; the fake
    kernel allocates 4 B). The reduction is shared ATen code (Loss.cpp), not a CPU kernel."""
    if isinstance(out, torch.Tensor) and out.dim() == 0 and len(args) >= 2:
        numel = torch.Size(torch.broadcast_shapes(args[0].shape, args[1].shape)).numel()
        storages.real[storages.id_of(out)] = (out.dtype, numel * itemsize(out.dtype))


def _good_ld(dim: int, itemsize: int = 4) -> int:
    # oneDNN rnn_utils::get_good_ld: leading dimensions 64-byte aligned, and not a multiple of 256
    # elements (4K aliasing)
    ld = -(-dim // (64 // itemsize)) * (64 // itemsize)
    return ld + 64 // itemsize if ld % 256 == 0 else ld


def _pages(n: int) -> int:
    return -(-n // 4096) * 4096  # oneDNN rnn_utils::set_offsets page-aligns every workspace part


def _onednn_lstm_workspace(storages: Storages, args, out) -> None:
    """The uint8 workspace CPU LSTM training keeps for its backward (mkldnn_rnn_layer's 4th
    output, saved by autograd): the fake kernel makes it empty. Its size is oneDNN's RNN training
    workspace, as its source computes it (src/cpu/rnn/rnn_utils.hpp, set_workspace_sizes and the
    leading dimensions of init_conf; rnn_utils.cpp, set_offsets: each part starts on a 4096-byte
    page; get_good_ld), for the one layer and direction torch runs per call (T steps, batch B,
    input I, hidden H; e the element size of the layer's dtype, the diff states in float32, the
    GEMM accumulator):
        gates   pages(T·B·ld(4H, e)·e)          ht          pages(T·B·ld(H, e)·e)
        states  pages(2(T+1)·B·ld(max(I, H), e)·e)        c   pages(2(T+1)·B·H·e)
        diff states and diff iter  2·pages(2(T+1)·B·ld(max(I, H), 4)·4)   diff c  pages(2(T+1)·B·H·4)
    Equal to the byte to torch 2.13's kernel on 157 random shapes (T, B to 40, I to 300, H 1 to
    400) in float32 and in bfloat16, the dtypes torch's CPU LSTM runs through oneDNN; others keep
    the fake size (an empty workspace). Inference (train=False) keeps no workspace."""
    x, w_hh = args[0], args[2]
    train = args[15] if len(args) > 15 else True
    ws = out[3] if isinstance(out, (tuple, list)) and len(out) > 3 else None
    if not train or ws is None or x.dtype not in _ONEDNN_RNN_DTYPES or ws.untyped_storage().nbytes() != 0:
        return
    t, b, i = x.shape
    h, e, acc = w_hh.shape[1], itemsize(x.dtype), 4
    states, cells = 2 * (t + 1) * b, 2 * (t + 1) * b * h
    nbytes = (_pages(t * b * _good_ld(4 * h, e) * e) + _pages(t * b * _good_ld(h, e) * e)
              + _pages(states * _good_ld(max(i, h), e) * e) + _pages(cells * e)
              + 2 * _pages(states * _good_ld(max(i, h), acc) * acc) + _pages(cells * acc))
    storages.real[storages.id_of(ws)] = (torch.uint8, nbytes)


_ONEDNN_RNN_DTYPES = (torch.float32, torch.bfloat16)


_aten = torch.ops.aten
_KERNEL_DTYPES = {
    op: _batch_norm_stats for op in (
        _aten.native_batch_norm.default, _aten._native_batch_norm_legit.default,
        _aten._native_batch_norm_legit.no_stats, _aten._native_batch_norm_legit_no_training.default,
        _aten._native_batch_norm_legit_functional.default,
    )
}
# Inside F.multi_head_attention_forward the projections are linear (mm/addmm) and the only batched
# products are QKᵀ and PV: its own math path (need_weights=True: baddbmm/bmm) or SDPA's math path
# (bmm, via matmul), whichever it takes.
_MHA_PRODUCTS = frozenset({_aten.bmm, _aten.baddbmm})
_KERNEL_DTYPES.update({op: _unreduced_loss for op in (_aten.mse_loss.default, _aten.smooth_l1_loss.default)})
_KERNEL_DTYPES[_aten.mkldnn_rnn_layer.default] = _onednn_lstm_workspace


def _two_bias_gradients(out):
    """mkldnn_rnn_layer_backward's meta kernel returns one tensor as both bias gradients
    (torch/_meta_registrations.py: ``diff_b, diff_b``); the CPU kernel returns two (seven distinct
    storages, measured on torch 2.13), which autograd accumulates apart: the second gets its own."""
    if out[4] is out[3]:
        return (*out[:4], out[4].clone(), *out[5:])
    return out


# what the fake kernel returns made what the real one returns (called below the recorder, unrecorded)
_KERNEL_OUTPUTS = {_aten.mkldnn_rnn_layer_backward.default: _two_bias_gradients}


def _one_dtype(func, args, phase: str) -> None:
    """Eager's matrix products refuse operands of different dtypes (at::native's addmm/mm/bmm
    checks: "expected mat1 and mat2 to have the same dtype"); their meta kernels do not check,
    so a model feeding an int64 input to nn.Linear traced as if it ran."""
    dtypes = [a.dtype for a in args if isinstance(a, torch.Tensor)]
    if len(set(dtypes)) > 1:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise ModelError(f"the model's {phase} runs {func} on tensors of {names}, which eager PyTorch refuses (a "
                         "matrix product takes one dtype): cast them to one (an integer --input to a float one?)")


# what eager checks before an op that its fake (meta) kernel does not: raised as eager raises it
_EAGER_CHECKS = {op: _one_dtype for op in (_aten.mm.default, _aten.addmm.default, _aten.bmm.default,
                                           _aten.baddbmm.default)}


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
            raise ModelError(
                f"the model's {self.phase} makes a {str(t.layout).removeprefix('torch.')} tensor (nn.Embedding or "
                "nn.EmbeddingBag with sparse=True makes sparse gradients), which fxacct does not account: "
                "build the model with sparse=False (-k sparse=False where its constructor takes it) for the "
                "dense equivalent")
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
        if func is _DETACH and unpacked is not None and args[0] is tp.local(unpacked):
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
        if func in _KERNEL_OUTPUTS:
            out = _KERNEL_OUTPUTS[func](out)
        if func.namespace in _NOT_RECORDED or not self.recording:
            return out
        if self.override is not None and self.override[3]:
            self._fused_away(out)
        fix = _KERNEL_DTYPES.get(func)
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
        alias of the saved tensor: the ops that read it read the saved tensor's node."""
        out = _DETACH(saved)
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
