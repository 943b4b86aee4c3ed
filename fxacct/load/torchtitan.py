"""``torchtitan:MODULE:CONFIG`` targets: a torchtitan job as it is written (a config function of
``torchtitan.models.MODULE.config_registry``, with torchtitan's own command-line overrides), its
parallelism degrees, local batch and sequence length taken from fxacct's ``--mesh``, ``--batch`` and
``--seq-len``; and the adapter that lets torchtitan's code run on this machine, in one process, under
the fake process group on fake tensors (docs/torchtitan.md).

Each workaround is a patch undone on leaving ``adapted()``; each names the torchtitan 0.3.0 or
torch 2.13 line that makes it necessary. torchtitan is optional (``pip install 'fxacct[torchtitan]'``):
it is imported only when such a target is loaded.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib
import inspect
import io
import logging

from fxacct.errors import UsageError
from fxacct.load import expert_load
from fxacct.load.expert_load import Routing
from fxacct.load.flags import TORCHTITAN_PREFIX

PREFIX = TORCHTITAN_PREFIX
INSTALL = "pip install 'fxacct[torchtitan]'"
# fxacct's mesh dimension -> torchtitan's ParallelismConfig field (torchtitan/config/configs.py)
DEGREES = {"pp": "pipeline_parallel_degree", "dp": "data_parallel_replicate_degree",
           "fsdp": "data_parallel_shard_degree", "cp": "context_parallel_degree",
           "tp": "tensor_parallel_degree", "ep": "expert_parallel_degree"}


def is_torchtitan(target: str | None) -> bool:
    return isinstance(target, str) and target.startswith(PREFIX)


def parse_target(target: str) -> tuple[str, str]:
    """'torchtitan:llama3:llama3_8b' -> ('llama3', 'llama3_8b')."""
    module, sep, name = target[len(PREFIX):].partition(":")
    if not sep or not module or not name.isidentifier():
        raise UsageError(f"{target}: a torchtitan target is torchtitan:MODULE:CONFIG, e.g. torchtitan:llama3:llama3_8b "
                         "(MODULE of torchtitan.models, CONFIG a function of its config_registry)")
    return module, name


def require_torchtitan():
    try:
        return importlib.import_module("torchtitan")
    except ModuleNotFoundError as e:
        raise UsageError(f"torchtitan targets need torchtitan, which is not installed ({e.name} is missing): "
                         f"{INSTALL}") from None


@contextlib.contextmanager
def quiet():
    """torchtitan logs at INFO from its config and model code; an account is not a training run."""
    logger = logging.getLogger("torchtitan")  # torchtitan/tools/logging.py: logger = logging.getLogger()
    root = logging.getLogger()
    # DTensor's advice on torchtitan's own layouts ("2 sequential all_gather operations will be
    # performed. This is suboptimal"): the account counts those collectives; the advice is torchtitan's
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    levels = (logger.level, root.level, redistribute.level)
    logger.setLevel(logging.WARNING)
    root.setLevel(logging.WARNING)
    redistribute.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(levels[0])
        root.setLevel(levels[1])
        redistribute.setLevel(levels[2])


def _registry(module: str):
    from torchtitan.models import _supported_models

    if module not in _supported_models:
        close = difflib.get_close_matches(module, sorted(_supported_models), 3)
        hint = f"did you mean {', '.join(close)}? " if close else ""
        raise UsageError(f"torchtitan has no model module {module!r}: {hint}the modules are "
                         f"{', '.join(sorted(_supported_models))}")
    return importlib.import_module(f"torchtitan.models.{module}.config_registry")


def config_names(registry) -> list[str]:
    """The config functions of a config_registry (torchtitan/config/manager.py::_load_config's list):
    the module's own functions that ConfigManager can call with no argument (a registry may also
    define helpers, as deepseek_v3's ``enable_fused_swiglu(config)``)."""
    return [n for n in dir(registry) if not n.startswith("_") and n[0].islower() and callable(getattr(registry, n))
            and getattr(getattr(registry, n), "__module__", None) == registry.__name__
            and _takes_no_argument(getattr(registry, n))]


def _takes_no_argument(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return not any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
                   for p in params)


# Config fields torchtitan's job decides, with the flag and torchtitan's own override for each
OWNED = (("kwargs", "-k/--kwargs", "--model... (the model spec's flavor: another CONFIG)"),
         ("inputs", "--input", "--training.seq_len (tokens are [batch, seq_len])"),
         ("dtype", "--dtype", "--training.dtype / --training.mixed_precision_param"),
         ("amp", "--amp", "--training.mixed_precision_param"),
         ("master_weights", "--master-weights", "--training.mixed_precision_param"),
         ("loss", "--loss", "--loss... (torchtitan's loss is traced)"),
         ("loss_output", "--loss-output", "--loss..."),
         ("optimizer", "--optimizer", "--optimizer..."),
         ("optim_args", "--optim-arg", "--optimizer..."),
         ("checkpoint", "--checkpoint", "activation-checkpoint:full|selective|none"),
         ("checkpoint_policy", "--checkpoint-policy", "activation-checkpoint:full|selective|none"),
         ("hf_class", "--hf-class", "another CONFIG"),
         ("pp_split", "--pp-split", "--parallelism.module_fqns_per_model_part"),
         ("pp_schedule", "--pp-schedule", "--parallelism.pipeline_parallel_schedule"),
         ("pp_stages_per_rank", "--pp-stages-per-rank", "--parallelism.pipeline_parallel_layers_per_stage"))


def check_flags(config) -> None:
    """A flag whose part of the job torchtitan's config decides is a usage error, not ignored."""
    default = type(config)()
    for field, flag, theirs in OWNED:
        if getattr(config, field) != getattr(default, field):
            raise UsageError(f"{flag} with a torchtitan target: torchtitan's config decides it; give torchtitan's "
                             f"override after -- instead ({theirs})")


def job_config(config):
    """torchtitan's Trainer.Config for ``config.target``, as torchtitan's ConfigManager builds it from
    ``--module MODULE --config CONFIG`` and the overrides (``config.torchtitan_args``), then the
    mesh's degrees, ``--batch`` as the local batch and ``--seq-len`` applied, and checked."""
    module, name = parse_target(config.target)
    check_flags(config)
    require_torchtitan()
    with quiet():
        registry = _registry(module)
        if name not in config_names(registry):
            close = difflib.get_close_matches(name, config_names(registry), 3)
            hint = f"did you mean {', '.join(close)}? " if close else ""
            raise UsageError(f"torchtitan.models.{module}.config_registry has no config {name!r}: {hint}"
                             f"its configs are {', '.join(config_names(registry))}")
        from torchtitan.config.manager import ConfigManager

        args = ["--module", module, "--config", name, *config.torchtitan_args]
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(err):
                job = ConfigManager().parse_args(args)
        except SystemExit:  # tyro prints its error and exits 2
            lines = [ln.strip("│ ").strip() for ln in err.getvalue().splitlines() if ln.strip("│╭╰─ ")]
            detail = next((ln for ln in lines if "rror" in ln or "nrecognized" in ln), lines[-1] if lines else "")
            raise UsageError(f"torchtitan did not take the overrides {' '.join(config.torchtitan_args)!r}: "
                             f"{detail} (give them after -- as torchtitan's --section.key VALUE)") from None
    apply_request(job, config)
    check_job(job, config)
    return job


def apply_request(job, config) -> None:
    """fxacct's flags over the config function's values: every mesh degree (a dimension --mesh does
    not name is 1), the local batch, the sequence length, and DTensor's partial backend."""
    par = job.parallelism
    spec = config.mesh
    for dim, field in DEGREES.items():
        setattr(par, field, spec.size(dim) if spec is not None else 1)
    # torchtitan/distributed/spmd_types.py: the default "spmd_types" backend fails in torch 2.13's
    # fully_shard ("all parameters must be DTensors on the full SPMD mesh"); the DTensor one runs
    par.spmd_backend = "partial_dtensor"
    job.training.local_batch_size = config.batch
    job.training.global_batch_size = -1  # one gradient-accumulation step (trainer.py: global = local x batch degree)
    if config.seq_len is not None:
        job.training.seq_len = config.seq_len
    if spec is not None and spec.size("pp") > 1:
        micro = config.microbatches or spec.size("pp")
        if config.batch % micro:
            raise UsageError(f"--microbatches {micro} does not divide --batch {config.batch}: torchtitan splits the "
                             "local batch into micro-batches of pipeline_parallel_microbatch_size; give a batch that "
                             "they divide")
        par.pipeline_parallel_microbatch_size = config.batch // micro


def num_experts(model_config) -> int | None:
    """The routed experts of a MoE model config (its first MoE layer's), or None for a dense one."""
    seen, todo = set(), [model_config]
    while todo:
        obj = todo.pop(0)
        if id(obj) in seen or obj is None:
            continue
        seen.add(id(obj))
        n = getattr(obj, "num_experts", None)
        if isinstance(n, int):
            return n
        if isinstance(obj, (list, tuple)):
            todo.extend(obj)
        elif hasattr(obj, "__dataclass_fields__"):
            todo.extend(getattr(obj, f) for f in obj.__dataclass_fields__)
    return None


def check_job(job, config) -> None:
    """What torchtitan would assert later, as one-line usage errors: cp and tp divide the sequence
    (trainer.py: seq_len % (tp if sequence parallel) x 2cp), ep divides the experts."""
    par, seq = job.parallelism, job.training.seq_len
    cp, tp = par.context_parallel_degree, par.tensor_parallel_degree
    divisor = (tp if par.enable_sequence_parallel else 1) * (2 * cp if cp > 1 else 1)
    if seq % divisor:
        what = f"2 x cp={cp}" + (f" x tp={tp}" if tp > 1 and par.enable_sequence_parallel else "")
        raise UsageError(f"--mesh {config.mesh}: {what} = {divisor} does not divide the sequence length {seq} "
                         "(context parallelism splits the sequence into 2 x cp chunks, sequence parallelism into tp); "
                         "give a --seq-len they divide")
    # torch/distributed/tensor/experimental/_context_parallel/_attention.py (_context_parallel_shard of a
    # BlockMask): "Q_LEN ... is not divisible by CP mesh world size * BLOCK_SIZE" (flex attention's 128)
    if cp > 1 and seq % (cp * 128):
        raise UsageError(f"--mesh {config.mesh}: cp={cp} x 128 (flex attention's block) = {cp * 128} does not divide "
                         f"the sequence length {seq} (torch shards the block mask in whole blocks); give a --seq-len "
                         "they divide")
    ep = par.expert_parallel_degree
    if ep > 1:
        experts = num_experts(job.model_spec.model)
        if experts is None:
            raise UsageError(f"--mesh {config.mesh}: ep shards experts but {config.target} has none (a dense model); "
                             "drop ep")
        if experts % ep:
            raise UsageError(f"--mesh {config.mesh}: ep={ep} does not divide the model's {experts} experts; "
                             "use an ep that divides them")
        carved = par.data_parallel_shard_degree * cp * tp
        if carved % ep:
            raise UsageError(f"--mesh {config.mesh}: ep={ep} must divide fsdp x cp x tp = {carved}: torchtitan "
                             "carves the expert-parallel ranks out of them")


def routing_of(job, config) -> Routing:
    """The expert routing of the job: balanced, or --expert-load's histogram, checked against the
    model's experts (its MoE layers are checked once the model is built: check_moe_layers)."""
    if config.expert_load is None:
        return Routing()
    load = expert_load.read(config.expert_load)
    expert_load.check(load, num_experts(job.model_spec.model))
    return Routing(load)


def check_moe_layers(routing: Routing, model) -> None:
    """Per-layer histograms: one per MoE layer of the built model (a module holding a token dispatcher)."""
    if routing.load is not None:
        layers = sum(1 for m in model.modules() if hasattr(m, "token_dispatcher"))
        expert_load.check(routing.load, len(routing.load.of_layer(0)), layers)


@contextlib.contextmanager
def patched(obj, name: str, value):
    """``obj.name`` set to ``value`` inside the block, restored after it."""
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def causal_sdpa(sdpa=None):
    """FlexAttention.compiled_flex_attn's contract (out, aux) for the causal mask, by ``sdpa``
    (default F.scaled_dot_product_attention; a CUDA target's kernel choice, called in the forward and
    again in activation checkpointing's recompute, where a torch-function mode may not be active)."""
    import torch.nn.functional as F

    kernel = sdpa or F.scaled_dot_product_attention

    def attend(q, k, v, *, score_mod, block_mask, scale, enable_gqa, return_aux, kernel_options):
        if score_mod is not None or getattr(return_aux, "lse", False):
            raise UsageError("this torchtitan model's flex attention uses a score_mod or its log-sum-exp, which "
                             "fxacct does not trace; choose a config with the plain causal mask")
        return kernel(q, k, v, is_causal=True, scale=scale, enable_gqa=enable_gqa), None

    return attend


def _counting_rows(dispatch):
    """AllToAllTokenDispatcher.dispatch, noting the rows this rank routes (tokens x top-k)."""
    def wrapped(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E):
        self._fxacct_routed_rows = topk_expert_ids_TK.numel()
        return dispatch(self, x_TD, topk_scores_TK, topk_expert_ids_TK, num_local_tokens_per_expert_E)

    return wrapped


def _routed_splits(routing):
    """_sync_token_count_exchange with the routing fake tensors do not carry (``routing``, an
    fxacct.load.expert_load.Routing: balanced, or a measured histogram). The counts tensor is torchtitan's."""
    def sync(self, num_local_tokens_per_expert_E, num_global_tokens_per_local_expert_EP_e, ep_size):
        import torch

        counts = torch.ops._c10d_functional.wait_tensor(num_global_tokens_per_local_expert_EP_e).reshape(-1)
        send, recv = routing.splits(self, self._fxacct_routed_rows, ep_size)
        return counts, send, recv

    return sync


@contextlib.contextmanager
def adapted(flex_as: str = "sdpa", sdpa=None, routing=None, real: bool = False):
    """torchtitan's code made runnable here, then restored. Enter it outside any FakeTensorMode.
    ``flex_as``: "sdpa" (the account: flex attention's causal mask by the SDPA kernel) or "eager"
    (torchtitan's flex_attention itself, eager: the test oracle); ``sdpa``: the kernel of causal_sdpa;
    ``routing``: the expert routing (an fxacct.load.expert_load.Routing; default balanced); ``real``:
    a run on real tensors (fxacct.runtime.titan_run), whose router's counts are real: not replaced."""
    import torch
    import torch.nn.attention.flex_attention as flex
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.attention as attention
    import torchtitan.models.common.token_dispatcher as token_dispatcher
    import torchtitan.tools.utils as titan_utils

    with contextlib.ExitStack() as stack, quiet():
        # torchtitan/tools/utils.py::get_device_info: `_get_available_device_type() or "cuda"` on a
        # machine without an accelerator; the name is bound again by `from ... import device_type` in
        # these modules, and fully_shard then fails "Torch not compiled with CUDA enabled"
        for module in (titan_utils, parallel_dims, dist_utils, token_dispatcher):
            stack.enter_context(patched(module, "device_type", "cpu"))
            if hasattr(module, "device_module"):
                stack.enter_context(patched(module, "device_module", torch.cpu))
        # torchtitan/models/common/attention.py: `_compiled_create_block_mask = torch.compile(create_block_mask)`
        # segfaults on fake data here: eager
        stack.enter_context(patched(attention, "_compiled_create_block_mask", flex.create_block_mask))
        # and torch's own for context parallelism (_context_parallel/_attention.py: `_compiled_create_block_mask
        # = torch.compile(create_block_mask, ...)` when still None): eager too
        from torch.distributed.tensor.experimental._context_parallel import _attention as cp_attention

        stack.enter_context(patched(cp_attention, "_compiled_create_block_mask", flex.create_block_mask))
        if flex_as == "sdpa":
            # FlexAttention.compiled_flex_attn runs torch.compile(flex_attention), a higher-order op that
            # fxacct's recorder does not take apart; the mask torchtitan builds
            # (decoder.py::_create_flex_attention_mask_for_document: causal and packed-document) is the
            # causal mask for the one-document sequences fxacct feeds, which the causal SDPA kernel computes
            stack.enter_context(patched(attention.FlexAttention, "compiled_flex_attn", staticmethod(causal_sdpa(sdpa))))
        else:
            # the eager flex_attention, as the test oracle runs it: FlexAttention._compiled_flex_attn =
            # torch.compile(flex_attention) made eager; flex_attention.py::_validate_device refuses backward
            # on CPU ("FlexAttention does not support backward on CPU"); eager flex_attention still wraps
            # the higher-order op in torch.compile(fullgraph=True), which finds no frame under a dispatch
            # mode, so its debug switch calls the op directly
            stack.enter_context(patched(attention.FlexAttention, "_compiled_flex_attn",
                                         staticmethod(flex.flex_attention)))
            stack.enter_context(patched(flex, "_validate_device", lambda *a: None))
            stack.enter_context(patched(flex, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", True))
        # token_dispatcher.py::AllToAllTokenDispatcher._sync_token_count_exchange: `input_splits.tolist()`,
        # the routing's counts, which fake tensors do not have: balanced routing, or a measured histogram
        dispatcher = token_dispatcher.AllToAllTokenDispatcher
        if not real:
            stack.enter_context(patched(dispatcher, "dispatch", _counting_rows(dispatcher.dispatch)))
            stack.enter_context(patched(dispatcher, "_sync_token_count_exchange", _routed_splits(routing or Routing())))
        # torchtitan/distributed/utils.py::set_spmd_backend keeps the backend in a module global
        # (`_spmd_backend = "spmd_types"`): the account sets "partial_dtensor" (apply_request), restored after
        stack.enter_context(patched(dist_utils, "_spmd_backend", dist_utils._spmd_backend))
        dist_utils.set_spmd_backend("partial_dtensor")
        yield


__all__ = ["PREFIX", "is_torchtitan", "parse_target", "job_config", "adapted", "num_experts", "DEGREES",
           "routing_of", "check_moe_layers", "patched"]
