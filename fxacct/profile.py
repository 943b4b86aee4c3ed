"""One call from a model (or a "PATH.py:Name" target) to its account: load → capture → annotate
→ account → memory. No formatting here (fxacct.report) and no flags (the CLI)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from fxacct.trace import torch_private as tp

from fxacct.load import model_spec as loading
from fxacct.errors import ModelError
from fxacct.heap import with_frozen_heap
from fxacct.load.hf import is_causal_lm, seq_len_note
from fxacct.trace.loss import MODEL, ignored_loss_warning
from fxacct.account.accounting import Accounting, account
from fxacct.account.annotate import annotate
from fxacct.costs.user import load_costs
from fxacct.trace.capture import Capture, CaptureOptions, capture
from fxacct.load.config import Config
from fxacct.predict.devices import get_device
from fxacct.memory import account as memory_account
from fxacct.memory import sharding
from fxacct.memory.peak import PARAMETERS, Peak, lifetimes, walk


@dataclass(frozen=True)
class Profile:
    config: Config
    accounting: Accounting
    memory: memory_account.MemoryAccount
    capture: Capture
    warnings: tuple[str, ...] = ()
    parallel: object = None  # fxacct.parallel.profile.ParallelAccount under --mesh
    checkpoint: object = None  # fxacct.trace.checkpointing.CheckpointWhatIf under --checkpoint
    model_class: str | None = None  # the class of the model built (hf: targets: the one transformers chose)

    @property
    def title(self) -> str:
        """The target, with the class built where the target does not name it (an hf: config, a
        factory function): 'hf:llama.json (LlamaForCausalLM)'."""
        target = self.config.target or "module"
        if self.model_class is None or target.rpartition(":")[2] == self.model_class:
            return target
        return f"{target} ({self.model_class})"


FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def precision_warnings(cap: Capture) -> tuple[str, ...]:
    """fp8 storage is real, fp8 matmuls through aten.mm are not: neither the CPU nor CUDA has an
    mm/bmm/addmm/convolution kernel for float8 (fp8 training calls aten._scaled_mm with scales,
    e.g. torchao.float8), so a model whose plain matmuls take fp8 tensors cannot run as traced."""
    ops = set()
    for node in cap.graph.nodes:
        cost = node.meta.get("fxacct")
        val = node.meta.get("val")
        if cost is None or cost.flops.matmul == 0 or node.op != "call_function":
            continue
        vals = val if isinstance(val, tuple) else (val,)
        if any(getattr(v, "dtype", None) in FP8 for v in vals):
            ops.add(str(node.target))
    notes = _low_precision_lstm(cap)
    if not ops:
        return notes
    return (f"{', '.join(sorted(ops))} take float8 tensors, which no CPU or CUDA kernel runs (fp8 "
            "training uses aten._scaled_mm with scales): weight, gradient and optimizer bytes are "
            "exact for fp8 storage; FLOPs, activations and peaks are those of a model that cannot run "
            "as traced",) + notes


_LSTM_BACKWARD = torch.ops.aten.mkldnn_rnn_layer_backward.default


def _low_precision_lstm(cap: Capture) -> tuple[str, ...]:
    """The CPU LSTM backward (oneDNN) computes float32 gradients for bfloat16/float16 inputs and
    casts them after; its fake kernel returns them in the input dtype, so the account holds less:
    a small LSTM's training peak measured 31% over the account in bf16, 15% under --amp bf16."""
    for node in cap.graph.nodes:
        if node.op == "call_function" and node.target is _LSTM_BACKWARD:
            dtype = getattr(node.args[0].meta.get("val"), "dtype", None) if node.args else None
            if dtype in (torch.bfloat16, torch.float16):
                return (f"a CPU LSTM backward runs in {str(dtype).removeprefix('torch.')}: oneDNN computes its "
                        "gradients in float32 and casts them, which the account does not hold (a small LSTM's "
                        "training peak measured up to 31% over it); the fp32 account is exact",)
    return ()


def tokens_per_example(args, kwargs, batch: int) -> int | None:
    """The per-example element count of the first integer input (T for long[B, T])."""
    for t in tp.tree_leaves((args, kwargs)):
        if isinstance(t, torch.Tensor) and not t.is_floating_point() and t.dtype != torch.bool and t.dim() > 0:
            if t.shape[0] == batch:
                return t.numel() // batch
    return None


def _capture(model, args, kwargs, config: Config, inference: bool = False) -> Capture:
    return capture(model, tuple(args), kwargs, CaptureOptions(
        dtype=config.dtype, input_requires_grad=config.input_requires_grad, loss_output=config.loss_output,
        optimizer=None if inference else config.optimizer_spec(), inference=inference, amp=config.amp,
        master_weights=config.master_weights, cuda=config.gpu is not None, dedup=config.dedup,
        loss=config.loss, causal_lm=is_causal_lm(model), checkpoint=config.checkpoint,
        checkpoint_policy=config.checkpoint_policy))


def rank_peak(cap: Capture, model, config: Config) -> tuple[Peak, Peak | None, tuple[str, int] | None]:
    """(single-rank training peak, per-rank peak under --shard or None, gathered unit or None)."""
    life = lifetimes(cap)
    peak = walk(life)
    if config.shard == "none":
        return peak, None, None
    extra, unit = {}, None
    if config.shard in ("zero3", "fsdp"):
        unit = sharding.largest_unit_bytes(model, config.dtype)
        extra = {PARAMETERS: unit[1]}
    return peak, walk(life, sharding.partitioned(config.shard, config.world_size), extra), unit


@with_frozen_heap
def profile_module(model: torch.nn.Module, args=(), kwargs=None, config: Config | None = None,
                   inputs_for: Callable[[int], tuple] | None = None) -> Profile:
    """Account one training step of ``model(*args, **kwargs)``: forward, loss, backward and the
    optimizer step, and a forward for inference.

    ``args``/``kwargs`` may be meta tensors (only shapes and dtypes are read); nothing of the
    model's own tensors is allocated or changed. ``inputs_for(batch) -> (args, kwargs)`` lets a
    --gpu profile search the largest batch that fits."""
    config = config or Config()
    kwargs = kwargs or {}
    for path in config.costs:
        load_costs(path)
    loading.check_signature(model, tuple(args), kwargs)
    cap = _capture(model, args, kwargs, config)
    annotate(cap.graph, config.causal_attention)
    tokens = config.tokens_per_example or tokens_per_example(args, kwargs, config.batch)
    acct = account(cap, config.batch, tokens, config.count_recompute)
    inference = _capture(model, args, kwargs, config, inference=True)
    peak_train, per_rank, unit = rank_peak(cap, model, config)
    memory = memory_account.assemble(cap, acct, model, config.dtype, peak_train, walk(lifetimes(inference)),
                                     per_rank, unit)
    if config.gpu is not None:
        memory = _with_fit(memory, model, config, inputs_for)
    loss_note = (ignored_loss_warning(config.loss),) if cap.returned_loss and config.loss != MODEL else ()
    whatif = _checkpoint_whatif(model, args, kwargs, config, acct, memory, inputs_for) if config.checkpoint else None
    untrained = () if cap.has_backward else (
        "nothing trains: no parameter and no input requires grad, so the step has no backward and no "
        "optimizer step and there is no training peak (eager loss.backward() would raise); the forward "
        "and inference account stand",)
    notes = precision_warnings(cap) + loss_note + fastpath_warnings(model) + untrained
    return Profile(config, acct, memory, cap, notes, checkpoint=whatif, model_class=type(model).__name__)


# modules whose forward, in eval under no_grad, can run one fused kernel in place of their ops
# (torch/nn/modules/transformer.py and activation.py: the "fast path", torch.backends.mha)
_FASTPATH = ("TransformerEncoderLayer", "MultiheadAttention")


def fastpath_warnings(model: torch.nn.Module) -> tuple[str, ...]:
    """Eager inference of nn.TransformerEncoderLayer / nn.MultiheadAttention takes a fused kernel
    (aten._transformer_encoder_layer_fwd, _native_multi_head_attention) when its conditions hold;
    under fxacct's capture they never do (a torch function mode is active), so the inference
    forward is accounted as the unfused ops: FLOPs alike, fewer temporaries in the fused kernel's
    op-level view (its intermediates are made inside it, where no dispatch tracker sees them)."""
    if not torch.backends.mha.get_fastpath_enabled():
        return ()
    found = sorted({type(m).__name__ for m in model.modules()
                    if type(m).__name__ in _FASTPATH and type(m).__module__.startswith("torch.nn")})
    if not found:
        return ()
    return (f"nn.{' and nn.'.join(found)} may run PyTorch's fused inference kernel in eval under no_grad "
            "(the mha fast path); the inference account is that of the unfused ops it replaces "
            "(torch.backends.mha.set_fastpath_enabled(False) runs them in eager too)",)


def _checkpoint_whatif(model, args, kwargs, config: Config, acct, memory, inputs_for):
    """--checkpoint: the same step without the wrapping (a second capture, blocks replayed as
    usual), beside the checkpointed one."""
    from dataclasses import replace
    from fxacct.trace.checkpointing import CheckpointSide, CheckpointWhatIf, matched_modules

    def side(totals, mem):
        return CheckpointSide(totals.activation_bytes, mem.rank_peak.bytes if mem.rank_peak else None,
                              totals.recompute_flops, mem.fit.max_batch if mem.fit is not None else None)

    plain = replace(config, checkpoint=(), checkpoint_policy=None)
    cap = _capture(model, args, kwargs, plain)
    annotate(cap.graph, config.causal_attention)
    totals = account(cap, config.batch, acct.totals.tokens_per_example, config.count_recompute).totals
    peak, per_rank, _ = rank_peak(cap, model, plain)
    mem = replace(memory, peak_train=peak, per_rank=per_rank, fit=None)
    if config.gpu is not None:
        mem = _with_fit(mem, model, plain, inputs_for)
    return CheckpointWhatIf(config.checkpoint, tuple(matched_modules(model, config.checkpoint)),
                            config.checkpoint_policy, side(acct.totals, memory), side(totals, mem))


def _with_fit(memory, model, config: Config, inputs_for) -> memory_account.MemoryAccount:
    """Headroom on the GPU, and the largest batch that fits. The per-rank peak is close to affine
    in the batch (a·B + c: weights, state and fixed buffers do not scale), so a second trace at 2B
    gives a first guess; the answer is then bracketed by traces (a batch that fits, the next one
    that does not) and settled by bisection, so it is exact, not extrapolated."""
    from dataclasses import replace

    device = get_device(config.gpu)
    capacity = device.capacity_reported
    peak = memory.rank_peak.bytes
    max_batch, verified = None, False
    if config.find_max_batch and inputs_for is not None:
        cache = {config.batch: peak}

        def fits(batch: int) -> bool:
            if batch not in cache:
                a, kw = inputs_for(batch)
                cap = _capture(model, a, kw, replace(config, batch=batch))
                train, per_rank, _ = rank_peak(cap, model, config)
                cache[batch] = (per_rank or train).bytes
            return cache[batch] <= capacity

        b1 = config.batch
        fits(2 * b1)
        slope = (cache[2 * b1] - peak) / b1
        if slope > 0:
            guess = max(1, int((capacity - (peak - slope * b1)) // slope))
            lo, hi = (guess, None) if fits(guess) else (0, guess)
            step = 1
            while hi is None and len(cache) < MAX_FIT_TRACES:  # grow until a batch does not fit
                if fits(lo + step):
                    lo, step = lo + step, step * 2
                else:
                    hi = lo + step
            while lo > 0 and not fits(lo) and len(cache) < MAX_FIT_TRACES:
                lo //= 2
            if hi is None:
                hi = lo + 1
            while hi - lo > 1 and len(cache) < MAX_FIT_TRACES:  # bisect: lo fits, hi does not
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            max_batch = lo
            verified = hi - lo == 1 and (lo == 0 or fits(lo)) and not fits(hi)
    fit = memory_account.Fit.on(device, peak, max_batch, verified)
    return replace(memory, fit=fit)


MAX_FIT_TRACES = 24  # traces spent on the largest-batch search at most


def load_model(config: Config):
    """(model on meta, args, kwargs, inputs_for) for config.target (fxacct.load.source)."""
    from fxacct.load import source as sources

    src = sources.open_source(config)
    model = src.build()

    def inputs_for(batch: int):
        return sources.inputs(src, model, config, batch)

    args, kwargs = inputs_for(config.batch)
    return model, args, kwargs, inputs_for


@with_frozen_heap
def profile(config: Config) -> Profile:
    """Load config.target and profile it."""
    from fxacct.parallel.mesh import check_pipeline_flags

    check_pipeline_flags(config)
    if config.mesh is not None:  # one rank of the model parallelized by PyTorch's own engine
        from fxacct.parallel.profile import profile_mesh

        return profile_mesh(config)
    model, args, kwargs, inputs_for = load_model(config)
    try:
        return profile_module(model, args, kwargs, config, inputs_for)
    except ModelError as e:
        from fxacct.load.source import guessed_input_note

        note = seq_len_note(model, config.seq_len) or guessed_input_note(config, model)
        if note is None:
            raise
        raise ModelError(f"{note}: {e}") from e


__all__ = ["Profile", "profile", "profile_module", "load_model"]
