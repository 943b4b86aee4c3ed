"""Notes on a traced step that change how its figures read: kernels the account cannot follow
(fp8 matmuls, the mha fast path) and steps that do not train.
Each is one line for the report's warnings."""

from __future__ import annotations

import torch

from fxacct.trace.capture import Capture

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
    if not ops:
        return ()
    return (f"{', '.join(sorted(ops))} take float8 tensors, which no CPU or CUDA kernel runs (fp8 "
            "training uses aten._scaled_mm with scales): weight, gradient and optimizer bytes are "
            "exact for fp8 storage; FLOPs, activations and peaks are those of a model that cannot run "
            "as traced",)


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


def ignored_input_grad(requested: bool, cap: Capture) -> tuple[str, ...]:
    """--input-requires-grad asks for the inputs' gradients (dInput in the backward): autograd gives
    only floating-point tensors one, so where every input is an integer tensor (token ids) the flag
    changes nothing, which is said rather than left silent."""
    dtypes = [n.meta["val"].dtype for n in cap.input_nodes]
    if not requested or not dtypes or any(dt.is_floating_point or dt.is_complex for dt in dtypes):
        return ()
    names = ", ".join(sorted({str(dt).removeprefix("torch.") for dt in dtypes}))
    return (f"--input-requires-grad changes nothing: every input of the model is an integer tensor ({names}), "
            "which has no gradient; it adds dInput only for floating-point inputs",)


def idle_count_recompute(config, recompute_flops: int) -> tuple[str, ...]:
    """--count-recompute counts what activation checkpointing re-runs in the backward: where nothing
    is re-run (no --checkpoint, no checkpointing of the model's own) it changes nothing, said so. A
    pipeline stage's step is one of several (another stage may checkpoint), so it is said of a whole
    model's step alone."""
    pipelined = config.mesh is not None and config.mesh.size("pp") > 1
    if not config.count_recompute or config.checkpoint or pipelined or recompute_flops:
        return ()
    return ("--count-recompute changes nothing: no op of this step is recomputed (add --checkpoint PATTERN to "
            "checkpoint modules)",)


UNTRAINED = ("nothing trains: no parameter and no input requires grad, so the step has no backward and no "
             "optimizer step and there is no training peak (eager loss.backward() would raise); the forward "
             "and inference account stand")
# parameters require grad, the loss does not: the forward cut the autograd graph
DETACHED = ("nothing trains: parameters require grad but the loss does not (the forward cuts the graph: "
            "torch.no_grad, .detach(), or reentrant checkpointing with no input that requires grad; give "
            "--input-requires-grad or checkpoint with use_reentrant=False), so the step has no backward and no "
            "optimizer step and there is no training peak (eager loss.backward() would raise); the forward and "
            "inference account stand")


def untrained(capture) -> tuple[str, ...]:
    """Why a step has no backward, if it has none."""
    if capture.has_backward:
        return ()
    return (DETACHED,) if any(p.requires_grad for p in capture.params) else (UNTRAINED,)
