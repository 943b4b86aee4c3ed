"""PyTorch's own engine, in-process: a fake process group of the mesh's world size, the device
mesh, and the model parallelized on it (the user's ``parallelize(model, mesh)``, else the
tensor-parallel plan the model carries plus FSDP2 per repeated block and at the root).

DESIGN.md: build the mesh and parallelize outside FakeTensorMode (inside it the mesh fails on
aten.nonzero); the parameters are materialized afterwards, inside the capture's FakeTensorMode.
"""

from __future__ import annotations

import contextlib

import torch

from fxacct.errors import UsageError, classify
from fxacct.load.mesh import MeshSpec
from fxacct.load.model_spec import call_user, check_call, resolve_function
from fxacct.parallel.ddp import apply_ddp, is_ddp
from fxacct.parallel.plans import apply_model_plan
from fxacct.trace import torch_private as tp

HEAD_ATTRIBUTES = ("n_head", "n_heads", "num_attention_heads", "n_kv_heads", "num_key_value_heads")


@contextlib.contextmanager
def fake_group(world_size: int):
    """The "fake" process group on rank 0 of ``world_size``: collectives return at once."""
    import torch.distributed as dist

    if dist.is_initialized():
        raise UsageError("a torch.distributed process group is already initialized in this process; "
                         "fxacct --mesh runs its own fake one: call it outside your process group")
    dist.init_process_group("fake", store=tp.fake_store(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


def device_mesh(spec: MeshSpec):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", tuple(s for _, s in spec.dims), mesh_dim_names=spec.names)


def check_heads(model: torch.nn.Module, spec: MeshSpec) -> None:
    """Tensor parallelism splits attention heads: tp must divide every head count the model (or
    its Hugging Face config) declares."""
    tp_size = spec.size("tp")
    if tp_size == 1:
        return
    for owner in (model, getattr(model, "config", None)):
        for attr in HEAD_ATTRIBUTES:
            heads = getattr(owner, attr, None)
            if isinstance(heads, int) and heads % tp_size:
                raise UsageError(f"--mesh tp={tp_size} does not divide the model's {attr}={heads}: "
                                 "tensor parallelism splits heads; use a tp that divides it")


def parallelize(model: torch.nn.Module, spec: MeshSpec, mesh, options) -> torch.nn.Module:
    """``options``: the Config (parallelize, reshard_after_forward, amp)."""
    check_heads(model, spec)
    if options.parallelize:
        return _user_parallelize(model, mesh, options.parallelize)
    if is_ddp(spec) and spec.size("tp") > 1:
        raise UsageError(f"--mesh {spec}: DDP (dp without fsdp) over tensor-parallel shards is not built in; "
                         "use dp=R,fsdp=S,tp=T (HSDP), or your own --parallelize")
    if spec.size("tp") > 1:
        apply_model_plan(model, mesh["tp"])
    if is_ddp(spec):
        apply_ddp(model, mesh)
    elif spec.size("fsdp") > 1 or spec.size("dp") > 1:
        _fully_shard(model, spec, mesh, options)
    return model


def _user_parallelize(model, mesh, target: str):
    fn = resolve_function(target, "--parallelize", "fn(model, mesh)")
    check_call(fn, "--parallelize", target, "fn(model, mesh)", model, mesh)
    try:
        out = call_user(fn, model, mesh)
    except UsageError:
        raise
    except Exception as e:  # the user's function raised: a model error (exit 3)
        raise classify(e, f"--parallelize {target}") from e
    return out if isinstance(out, torch.nn.Module) else model


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The children of ModuleList / ModuleDict / Sequential containers whose class repeats: the
    units FSDP2 shards one at a time (torchtitan wraps each transformer block). A container of
    another class whose children are all numbered (``layers.2``, ``layers.3``: the stage module
    torch.distributed.pipelining's pipeline() cuts keeps the model's names, in modules of its own
    class) holds blocks too. Only the outermost count: a block's own repeated parts (two
    Linears in each of a Sequential's blocks) are inside a unit already, and FSDP2 cannot wrap a
    child after its parent."""
    return [m for _, items in block_containers(model) for _, m in items]


def block_containers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, list[tuple[str, torch.nn.Module]]]]:
    """(container, [(key, block), ...]) for each outermost container of repeated blocks, in
    module order: the walk behind repeated_blocks, and the planner's truncation (fxacct.tools.plan_screen)."""
    found, inside = [], set()
    for container in model.modules():
        if id(container) in inside:
            continue
        named = list(container.named_children())
        if not isinstance(container, (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)) and not (
                len(named) > 1 and all(n.isdigit() for n, _ in named)):
            named = []
        classes = [type(m) for _, m in named]
        items = [(n, m) for n, m in named if classes.count(type(m)) > 1]
        if items:
            found.append((container, items))
        inside.update(id(d) for _, m in items for d in m.modules())
    return found


def _one_dtype_per_unit(model, blocks, spec: MeshSpec) -> None:
    """FSDP2 gathers a unit's parameters as one flat buffer of one dtype (it asserts "uniform
    original parameter dtype"): each block, and the root with what no block holds."""
    inside = {id(p) for b in blocks for p in b.parameters()}
    names = {id(m): n for n, m in model.named_modules()}
    units = [(names[id(b)], {p.dtype for p in b.parameters()}) for b in blocks]
    units.append(("the root", {p.dtype for p in model.parameters() if id(p) not in inside}))
    for name, dtypes in units:
        if len(dtypes) > 1:
            listed = ", ".join(sorted(str(d).replace("torch.", "") for d in dtypes))
            raise UsageError(f"--mesh {spec}: FSDP2 gathers each unit's parameters as one buffer of one dtype, and "
                             f"{name} holds {listed}: give --dtype to cast the model to one, or --parallelize "
                             "with your own fully_shard units")


def _fully_shard(model, spec: MeshSpec, mesh, options) -> None:
    """FSDP2 per repeated block and at the root, also for a Hugging Face model (whose tp plan is
    transformers' own, fxacct.parallel.plans): what Trainer / Accelerate's FSDP2 users get
    (fsdp2_prepare_model: each decoder layer of ``_no_split_modules``, then the root) and what
    torchtitan does, and it honours --reshard-after-forward and --amp. transformers' own
    DistributedConfig(fsdp_size) path (fsdp_plan) differs only in wrapping the input embedding
    alone and the final norm with lm_head as one unit kept gathered after forward."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dims = tuple(d for d in ("dp", "fsdp") if spec.size(d) > 1 or d == "fsdp")
    fsdp_mesh = mesh[dims] if len(dims) > 1 else mesh[dims[0]]
    mp = MixedPrecisionPolicy()
    if options.amp is not None:  # the usual FSDP2 recipe: compute in the autocast dtype, reduce in fp32
        mp = MixedPrecisionPolicy(param_dtype=options.amp, reduce_dtype=torch.float32)
    blocks = repeated_blocks(model)
    _one_dtype_per_unit(model, blocks, spec)
    for block in blocks:
        fully_shard(block, mesh=fsdp_mesh, reshard_after_forward=options.reshard_after_forward, mp_policy=mp)
    fully_shard(model, mesh=fsdp_mesh, reshard_after_forward=False, mp_policy=mp)  # the root: as torchtitan
