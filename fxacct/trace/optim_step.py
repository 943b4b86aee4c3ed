"""Optimizers by name (`--optimizer adamw`), their options (`--optim-arg momentum=0.9`), or a
custom class from `PATH.py:Name`. fxacct constructs the real class on fake parameters and steps
it once, so the state it allocates is exact for any optimizer and option, `step` scalars included.
"""

from __future__ import annotations

import torch

from fxacct.errors import UsageError, describe_exception, first_line
from fxacct.load.specs import NONE, OPTIMIZERS, OptimizerSpec, parse_optim_arg  # noqa: F401  (re-exported)
from fxacct.trace import torch_private as tp
from fxacct.trace.known_values import KnownValues
from fxacct.trace.torch_private.ddp import zero_local_optimizer

STEP_ALL_BELOW = 64  # parameters; above, one representative per shape is stepped

# The built-in optimizers whose single-tensor step is elementwise (torch/optim/*.py, their
# ``_single_tensor_*``: in-place pointwise ops, lerp, addcmul, addcdiv, maximum, 0-dim step
# scalars). On DTensor parameters DTensor runs each of those ops on the local shards as they lie
# (its pointwise strategies keep the placements), so stepping the shards records the same local ops
# without DTensor's sharding propagation of each op for each shape (on_shards;
# tests/test_parallel_replay.py holds the two steps equal, op for op, for each of these). Not Rprop:
# its masked assignment (``sign[sign.gt(0)] = etaplus``, an in-place index_put_) is one DTensor refuses.
ELEMENTWISE_STEPS = frozenset({"sgd", "adam", "adamw", "adagrad", "rmsprop", "adadelta", "adamax", "nadam", "radam",
                               "asgd"})


def step_once(optimizer, param_groups, fake_of, targets, grads, master_weights: bool, recorder):
    """Build the real optimizer over the trainable fake parameters (DESIGN.md: the usual recipe,
    requires_grad=True), give each the gradient the backward produced, step once. What it
    allocates is what the class allocates, whatever its options. With ``master_weights`` it steps
    fp32 copies (fed fp32 casts of the gradients) and copies them back, as mixed-precision
    recipes with fp32 master weights do.

    torch.optim's single-tensor implementations update each parameter on its own, so parameters
    of one shape and dtype allocate and compute the same: when ``optimizer.per_parameter``, one
    representative per (shape, dtype, has-grad; a DTensor's shard shape and placements) is stepped
    and stands for the others (its state and ops counted that many times). Foreach/fused
    implementations and custom classes step all, and so do models with few parameters, where
    stepping all is cheap and keeps one more effect exact: a loop's locals (`denom`) outlive their
    iteration into the next parameter's update.
    Returns ([(state tensor, count)], [(master copy, count)])."""
    with tp.no_torch_function():  # fxacct's own reads and writes of .grad
        params = [fake_of[pid] for pid in param_groups if fake_of[pid].requires_grad]
        is_param = {id(p) for p in params}
        for t, g in zip(targets, grads):
            if g is not None and id(t) in is_param:
                t.grad = g
        batches = _batches(optimizer, params)
    states: list[tuple[torch.Tensor, int]] = []
    masters: list[tuple[torch.Tensor, int]] = []
    for group, count in batches:
        start = len(recorder.records)
        stepped = batch = on_shards(group) if _shards_stepped(optimizer) else group
        if master_weights:
            stepped = [torch.empty(p.shape, dtype=torch.float32) for p in batch]
            for m, p in zip(stepped, batch):
                if p.grad is not None:
                    m.grad = p.grad.float()
            masters += [(m, count) for m in stepped]
        opt = optimizer.build(stepped)
        if opt is None:
            return [], masters
        try:
            with KnownValues(scalars_only=True):  # its bookkeeping scalars (ASGD's mu.item()) have eager's values
                opt.step()
        except Exception as e:
            usage = _usage_error(e, optimizer, opt, stepped)
            if usage is not None:
                raise usage from e
            raise
        if batch is not group:
            for shard in batch:  # the DTensor's own .grad keeps the gradient; the shard holds it no longer
                shard.grad = None
        if master_weights:
            with torch.no_grad():
                for p, m in zip(batch, stepped):
                    p.copy_(m)
        # ZeRO-1: the state of this rank's partition, kept by the optimizer it steps locally
        states += [(v, count) for st in zero_local_optimizer(opt).state.values() for v in st.values()
                   if isinstance(v, torch.Tensor)]
        recorder.repeats.append((start, len(recorder.records), count))
    return states, masters


def _usage_error(e: Exception, optimizer, opt, stepped) -> UsageError | None:
    """The step's failure as the user's choice of optimizer or options (exit 2), or None: the
    error of the code that raised it (a class of the user's is theirs)."""
    name = type(opt).__name__
    if optimizer.args.get("foreach") and _mixes_dtensor(stepped):
        return UsageError(f"{name}'s foreach step (PyTorch's default on CUDA) cannot take parameters that mix "
                          "DTensor and plain tensors, as on a GPU: make every parameter a DTensor in your parallelize "
                          "(e.g. Replicate the unsharded ones) or give --optim-arg foreach=False")
    if optimizer.name.lower() in OPTIMIZERS and _has_dtensor(stepped):
        # torch's own step on DTensors failed: DTensor refused one of its ops, as on the GPUs
        return UsageError(f"--optimizer {optimizer.name}: {name}.step() cannot run on the DTensor parameters this "
                          f"mesh shards ({type(e).__name__}: {first_line(e).rstrip('.')}); choose another optimizer, "
                          "e.g. adamw")
    if optimizer.args:  # a value its constructor accepted but its step cannot use
        return UsageError(f"{name}.step() failed with options {optimizer.args}: {describe_exception(e)}; "
                          "check --optim-arg")
    return None


def _batches(optimizer, params: list) -> list[tuple[list, int]]:
    """(parameters stepped together, how many parameters each stands for): one representative per
    (shape, dtype, has-grad) where the optimizer steps each parameter on its own and there are
    many (step_once's docstring), else all of them at once."""
    if not (optimizer.per_parameter and len(params) > STEP_ALL_BELOW):
        return [(params, 1)]
    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        # a DTensor by its shard: what the step allocates and computes (on_shards), placements apart
        groups.setdefault((tuple(tp.local(p).shape), p.dtype, p.grad is not None, getattr(p, "placements", None)),
                          []).append(p)
    return [([ps[0]], len(ps)) for ps in groups.values()]


def on_shards(params: list) -> list:
    """A foreach step (or an elementwise single-tensor one: ELEMENTWISE_STEPS) over DTensor
    parameters as the same step over their local shards (stand-ins
    whose ``.grad`` is the gradient's shard), where DTensor would do nothing else: every parameter
    a DTensor and every gradient a DTensor of the parameter's mesh and placements (DTensor's
    pointwise foreach strategies then keep each shard where it is, with no redistribution, and run
    the one foreach op over the local lists: torch/distributed/tensor/_ops/_pointwise_ops.py,
    ``foreach_list_pointwise_strategy``). The recorded ops are those local ops either way (the
    recorder sits below the DTensor layer); what this saves is DTensor's sharding propagation of
    each foreach op, quadratic in the list's length in torch 2.13 (each tensor's strategy walks
    the whole argument list): 70 s of a 40-block Llama-70B stage's 120 s profile under
    ``--gpu`` (foreach, CUDA's default). tests/test_parallel_replay.py holds both steps equal.
    Anything else (plain tensors, mixed, a gradient of other placements) is stepped as it is."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return params
    if not params or not all(isinstance(p, DTensor) for p in params):
        return params
    out = []
    for p in params:
        g = p.grad
        if g is not None and not (isinstance(g, DTensor) and g.device_mesh == p.device_mesh
                                  and g.placements == p.placements and g.shape == p.shape):
            return params
        shard = tp.local(p)
        if not shard.is_leaf:  # a shard made by an op: .grad cannot be set on it
            return params
        shard.grad = tp.local(g)
        out.append(shard)
    return out


def _shards_stepped(optimizer) -> bool:
    """Whether the step may take the DTensor parameters' local shards (on_shards): a built-in
    optimizer whose step is elementwise (ELEMENTWISE_STEPS), foreach or single-tensor. Rprop's
    foreach step makes the same masked assignment per tensor; a class of the user's may make any op."""
    return optimizer.name.lower() in ELEMENTWISE_STEPS and (bool(optimizer.args.get("foreach"))
                                                             or optimizer.per_parameter)


def _has_dtensor(params) -> bool:
    return True in _dtensor_kinds(params)


def _mixes_dtensor(params) -> bool:
    """Some parameters are DTensors (tensor parallel) and some plain tensors: torch's foreach kernels
    group by device and dtype only, and a DTensor op refuses plain tensors."""
    return _dtensor_kinds(params) == {True, False}


def _dtensor_kinds(params) -> set:
    """Whether each parameter is a DTensor, as a set: {True}, {False}, both, or empty."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch without distributed
        return {False} if params else set()
    return {isinstance(p, DTensor) for p in params}
