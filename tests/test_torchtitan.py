"""torchtitan:MODULE:CONFIG targets against torchtitan's own step.

The oracle runs torchtitan's own code the way its Trainer does (trainer.py::__init__ and
_forward_backward_body): the config function through ConfigManager, the model built on meta and
parallelized by the model spec's parallelize_fn on torchtitan's ParallelDims meshes under the fake
process group, materialized in a FakeTensorMode, then two steps of forward, torchtitan's loss,
backward and torchtitan's own optimizer's step (the second counted: a steady state), with torchtitan's flex attention run eagerly, while a dispatch
counter (below DTensor, as CommDebugMode counts) records every collective and the process group it
ran on. It shares with fxacct only the environment patches of fxacct.load.torchtitan.adapted
(the device type, eager flex attention, balanced MoE routing), none of fxacct's capture.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist
from click.testing import CliRunner
from helpers import assert_one_line_exit_2, invoke_profile
from torch.distributed.tensor import DTensor
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode

from fxacct_cli.main import cli

pytest.importorskip("torchtitan", reason="torchtitan is an optional extra: pip install 'fxacct[torchtitan]'")
pytestmark = pytest.mark.slow  # torchtitan's import alone takes several seconds

from fxacct.load.torchtitan import adapted  # noqa: E402

NAMES = {"_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
         "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
         "all_reduce": "all_reduce", "allreduce_": "all_reduce", "all_to_all_single": "all_to_all",
         "alltoall_base_": "all_to_all", "send": "send", "recv_": "recv"}


class GroupCounter(TorchDispatchMode):
    """(op, process-group name) of every collective dispatched below DTensor."""

    supports_higher_order_operators = True  # flex attention's op passes through

    def __init__(self):
        super().__init__()
        self.count: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        name = getattr(func, "overloadpacket", None)
        name = name.__name__ if name is not None else ""
        if getattr(func, "namespace", None) in ("c10d", "_c10d_functional") and name in NAMES:
            self.count[(NAMES[name], _group_name(args))] += 1
        if getattr(func, "namespace", None) == "cplib":  # context parallelism's k/v gather and its backward
            self.count[("reduce_scatter" if name.endswith("backward") else "all_gather", _group_name(args))] += 1
        return out


def _group_name(args) -> str:
    from torch.distributed.distributed_c10d import ProcessGroup

    for a in args:
        if isinstance(a, torch.ScriptObject):
            return ProcessGroup.unbox(a).group_name
    return [a for a in args if isinstance(a, str)][-1]  # functional ops: (tensor, [reduce_op,] ..., group_name)


def _dims_of_groups(pdims) -> dict:
    """group name -> the set of torchtitan's single-axis mesh names (size > 1) on it; the flattened
    batch and loss meshes only for a group that no other dimension runs on (docs/torchtitan.md)."""
    found: dict = {}
    for label, mesh in pdims._single_axis_meshes.items():
        g = mesh.get_group()
        if g.size() > 1:
            found.setdefault(g.group_name, set()).add("fsdp" if label == "dp_shard" else label)
    return {g: (names - {"batch", "loss"}) or names for g, names in found.items()}


def _meta_model(job):
    """(the job's model config, its model built on meta), as trainer.py::__init__ builds it."""
    mc = job.model_spec.model
    mc.update_from_config(config=job)
    with torch.device("meta"):
        return mc, mc.build()


def torchtitan_collectives(module: str, name: str, dims: dict, batch: int, seq: int) -> Counter:
    """Counter of (op, frozenset of mesh names) over one step of torchtitan's own code."""
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims

    with adapted(flex_as="eager"):
        job = ConfigManager().parse_args(["--module", module, "--config", name])
        p = job.parallelism
        p.data_parallel_shard_degree, p.tensor_parallel_degree = dims.get("fsdp", 1), dims.get("tp", 1)
        p.context_parallel_degree, p.expert_parallel_degree = dims.get("cp", 1), dims.get("ep", 1)
        p.data_parallel_replicate_degree = dims.get("dp", 1)
        p.spmd_backend = "partial_dtensor"
        job.training.local_batch_size, job.training.seq_len = batch, seq
        world = (p.data_parallel_replicate_degree * p.data_parallel_shard_degree * p.tensor_parallel_degree
                 * p.context_parallel_degree)
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        try:
            pdims = ParallelDims.from_config(p, world)
            mc, model = _meta_model(job)
            model = job.model_spec.parallelize_fn(
                model, parallel_dims=pdims, training=job.training, parallelism=p, compile_config=job.compile,
                ac_config=job.activation_checkpoint, dump_folder=job.dump_folder)
            loss_fn = job.loss.build(compile_config=job.compile)
            if isinstance(loss_fn, ChunkedLossWrapper):
                loss_fn.set_lm_head(model.lm_head)
                model._skip_lm_head = True
            positions = torch.arange(seq).repeat(batch, 1)
            masks = model.get_attention_masks(positions=positions)
            extra = {"positions": positions, "attention_masks": masks} if masks is not None else {}
            tokens = torch.zeros(batch, seq, dtype=torch.long)
            labels = tokens.clone()
            if pdims.cp_enabled:  # trainer.py::post_dataloading_process
                from torchtitan.distributed.context_parallel import prepare_context_parallel_input

                tokens, labels, extra = prepare_context_parallel_input(
                    tokens, labels, extra, pdims.get_mesh("cp"), torch.device("cpu"),
                    p.context_parallel_load_balancer, p.context_parallel_ptrr_mask_key)
            loss_kwargs = {"positions": extra["positions"]} if masks is not None else {}
            counter = GroupCounter()
            with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
                model.to_empty(device="cpu")
                optimizers = job.optimizer.build(model_parts=[model])
                for counted in (False, True):  # the second step: a steady state, as the account's
                    counter.count.clear()
                    with counter if counted else contextlib.nullcontext():
                        pred = model(tokens, **extra)
                        loss, _ = loss_fn(pred, labels, torch.tensor(batch * seq), **loss_kwargs)
                        loss.backward()
                        optimizers.step()
                        optimizers.zero_grad()
            groups = _dims_of_groups(pdims)
        finally:
            dist.destroy_process_group()
    return Counter({(op, frozenset(groups.get(g, {"world"}))): n for (op, g), n in counter.count.items()})


def torchtitan_pipeline_collectives(module: str, name: str, dims: dict, batch: int, seq: int, micro: int,
                                    rank: int = 0) -> Counter:
    """Counter of (op, frozenset of mesh names) over one step of torchtitan's own pipeline on ``rank``:
    trainer.py's pipelining_fn (pipeline_parallel.py::pipeline_llm: its stage split, parallelize_fn per
    part and schedule), then the schedule's step over the local batch in micro-batches of ``micro``.

    One patch: the schedule's first step votes over p2p whether the stages' shapes are given
    (schedules.py::_warmup_p2p reads the vote with ``.item()``, which a fake tensor has no value for);
    the oracle gives each stage its shapes by hand (a first stage takes [micro, seq] int64 tokens,
    the others the [micro, seq, dim] hidden states in the mixed-precision dtype, requiring grad) and
    sets STATIC mode, as a user passing input_args/output_args to PipelineStage does. The second
    step is counted (the first builds the schedule's buffers)."""
    from torch.distributed.pipelining import schedules
    from torch.distributed.pipelining._utils import InferenceMode, _StageMeta, extract_tensor_metas
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.config.manager import ConfigManager
    from torchtitan.distributed.parallel_dims import ParallelDims
    from torchtitan.trainer import TORCH_DTYPE_MAP

    def static(self, stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    warmup = schedules._PipelineSchedule._warmup_p2p
    with adapted(flex_as="eager"):
        job = ConfigManager().parse_args(["--module", module, "--config", name])
        p = job.parallelism
        p.pipeline_parallel_degree, p.data_parallel_shard_degree = dims["pp"], dims.get("fsdp", 1)
        p.data_parallel_replicate_degree = dims.get("dp", 1)
        p.spmd_backend = "partial_dtensor"
        p.pipeline_parallel_microbatch_size = micro
        job.training.local_batch_size, job.training.seq_len = batch, seq
        world = p.pipeline_parallel_degree * p.data_parallel_replicate_degree * p.data_parallel_shard_degree
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
        schedules._PipelineSchedule._warmup_p2p = static
        try:
            pdims = ParallelDims.from_config(p, world)
            mc, model = _meta_model(job)
            loss_fn = job.loss.build(compile_config=job.compile)
            schedule, parts, first, last = job.model_spec.pipelining_fn(
                model, parallel_dims=pdims, training=job.training, parallelism=p, compile_config=job.compile,
                ac_config=job.activation_checkpoint, dump_folder=job.dump_folder, device=torch.device("cpu"),
                model_config=mc, parallelize_fn=job.model_spec.parallelize_fn, loss_fn=loss_fn)
            if last and isinstance(loss_fn, ChunkedLossWrapper):  # trainer.py: the last stage's lm_head
                loss_fn.set_lm_head(parts[-1].lm_head)
                parts[-1]._skip_lm_head = True
            dtype = TORCH_DTYPE_MAP[job.training.mixed_precision_param]
            hidden = torch.empty(micro, seq, mc.dim, dtype=dtype, device="meta", requires_grad=True)
            tokens_meta = torch.empty(micro, seq, dtype=torch.long, device="meta")
            for stage in schedule._stages:
                stage._user_meta = _StageMeta(inputs=extract_tensor_metas((tokens_meta if stage.is_first else hidden,)),
                                              outputs=extract_tensor_metas((hidden,)))
            counter = GroupCounter()
            with torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True):
                for part in parts:
                    part.to_empty(device="cpu")
                tokens = torch.zeros(batch, seq, dtype=torch.long)
                positions = torch.arange(seq).repeat(batch, 1)
                extra = {"positions": positions, "attention_masks": parts[0].get_attention_masks(positions=positions)}
                for counted in (False, True):
                    counter.count.clear()
                    with counter if counted else contextlib.nullcontext():
                        schedule.step(*((tokens,) if first else ()), **extra, target=tokens.clone() if last else None,
                                      losses=[] if last else None, return_outputs=False,
                                      loss_kwargs={"global_valid_tokens": torch.tensor(batch * seq)})
            groups = _dims_of_groups(pdims)
        finally:
            schedules._PipelineSchedule._warmup_p2p = warmup
            dist.destroy_process_group()
    return Counter({(op, frozenset(groups.get(g, {"world"}))): n for (op, g), n in counter.count.items()})


def fxacct_collectives(target: str, mesh: str, batch: int, seq: int, *more: str) -> tuple[Counter, dict]:
    r = CliRunner().invoke(cli, ["profile", target, "--mesh", mesh, "--batch", str(batch), "--seq-len", str(seq),
                                 "--format", "json", *more], catch_exceptions=False)
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout[r.stdout.index("{"):])
    counts: Counter = Counter()
    for row in doc["collectives"]:
        counts[(row["op"], frozenset(row["mesh_dim"].split("/")))] += row["count"]
    return counts, doc


def test_llama3_fsdp2_tp2_collectives_equal_torchtitans_own():
    """The issue's floor: per op and mesh dimension, fxacct's rank equals torchtitan's step (FSDP2
    all-gathers and reduce-scatters, TP/SP all-gathers, reduce-scatters and all-reduces with its
    selective activation checkpointing)."""
    ours, doc = fxacct_collectives("torchtitan:llama3:llama3_debugmodel", "fsdp=2,tp=2", 2, 64)
    theirs = torchtitan_collectives("llama3", "llama3_debugmodel", {"fsdp": 2, "tp": 2}, 2, 64)
    assert ours == theirs
    assert {dims for _, dims in theirs} == {frozenset({"fsdp"}), frozenset({"tp"})}  # both dims ran collectives
    assert doc["totals"]["peak_train_bytes"] > doc["totals"]["param_bytes"] > 0


def test_moe_fsdp4_ep4_all_to_all_equal_torchtitans_own():
    """Expert parallelism carved out of the fsdp ranks: token dispatch and combine by all-to-all."""
    ours, _ = fxacct_collectives("torchtitan:qwen3:qwen3_moe_debug", "fsdp=4,ep=4", 2, 64)
    theirs = torchtitan_collectives("qwen3", "qwen3_moe_debug", {"fsdp": 4, "ep": 4}, 2, 64)
    assert ours == theirs
    assert sum(n for (op, _), n in theirs.items() if op == "all_to_all") > 0


def test_llama3_fsdp2_cp2_collectives_equal_torchtitans_own():
    """Context parallelism: torch's custom op gathers each layer's k and v along the sequence
    (cplib.flex_cp_allgather, counted once per call) and its backward reduce-scatters their gradients;
    the sequence, 256, is a whole number of cp x 128-token blocks."""
    ours, _ = fxacct_collectives("torchtitan:llama3:llama3_debugmodel", "fsdp=2,cp=2", 2, 256)
    theirs = torchtitan_collectives("llama3", "llama3_debugmodel", {"fsdp": 2, "cp": 2}, 2, 256)
    assert ours == theirs
    assert theirs[("all_gather", frozenset({"cp"}))] > 0 and theirs[("reduce_scatter", frozenset({"cp"}))] > 0


@pytest.mark.parametrize("mesh", ["pp=2", "pp=2,fsdp=2", "pp=2,dp=2,fsdp=2"])
def test_llama3_pipeline_collectives_equal_torchtitans_own(mesh):
    """pp=2 with 4 micro-batches under the config's own schedule (llama3_debugmodel: Interleaved1F1B,
    two stages per rank): each rank's sends and receives, and the FSDP2 collectives of rank 0's
    stages as the schedule drives them, equal torchtitan's pipeline step on that rank."""
    dims = dict(d.split("=") for d in mesh.split(","))
    dims = {k: int(v) for k, v in dims.items()}
    ours, doc = fxacct_collectives("torchtitan:llama3:llama3_debugmodel", mesh, 4, 64, "--microbatches", "4")
    pipe = doc["pipeline"]
    assert (pipe["schedule"], pipe["stages_per_rank"], pipe["microbatches"]) == ("interleaved-1f1b", 2, 4)
    # --batch 4 is torchtitan's local batch: the report's batch is the micro-batch a stage traced
    assert (doc["config"]["batch"], doc["config"]["loss"]) == (1, "model")
    for rank, stage in enumerate(pipe["stages"]):
        rank_of_stage = rank * dims.get("dp", 1) * dims.get("fsdp", 1)  # pp is torchtitan's outermost mesh dim
        theirs = torchtitan_pipeline_collectives("llama3", "llama3_debugmodel", dims, 4, 64, 1, rank_of_stage)
        pp = frozenset({"pp"})
        assert (stage["sends"], stage["recvs"]) == (theirs.pop(("send", pp)), theirs.pop(("recv", pp)))
        if rank == 0:  # the collectives table is rank 0's
            assert ours == theirs
    # what a stage sends per micro-batch: the [1, 64, 256] bf16 hidden states (or their gradient)
    assert pipe["stages"][0]["send_bytes"] == 12 * 64 * 256 * 2


def test_llama3_hsdp_collectives_equal_torchtitans_own():
    """dp=2,fsdp=2: torchtitan's HSDP, gradients all-reduced over the replicas after the reduce-scatter."""
    ours, _ = fxacct_collectives("torchtitan:llama3:llama3_debugmodel", "dp=2,fsdp=2", 2, 64)
    theirs = torchtitan_collectives("llama3", "llama3_debugmodel", {"dp": 2, "fsdp": 2}, 2, 64)
    assert ours == theirs
    assert theirs[("all_reduce", frozenset({"dp_replicate"}))] > 0


def test_gpu_target_runs_cudas_attention_kernel():
    """--gpu h100: flex attention's stand-in is CUDA's flash kernel (bf16 compute under torchtitan's
    mixed precision), in the forward and in selective checkpointing's recompute alike (the recompute
    once met the CPU kernel where the forward had saved CUDA's, and the step failed)."""
    r = _invoke("torchtitan:llama3:llama3_debugmodel", "--mesh", "fsdp=2", "--batch", "1", "--seq-len", "64",
                "--gpu", "h100", "--format", "json")
    assert r.exit_code == 0, r.stderr
    ops = {n["op"] for n in json.loads(r.stdout)["nodes"]}
    assert "aten._scaled_dot_product_flash_attention.default" in ops
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" not in ops


_invoke = invoke_profile


@pytest.mark.parametrize("args, needle", [
    (["torchtitan:llama3:llama3_nosuch"], "has no config 'llama3_nosuch'"),
    (["torchtitan:llama4:llama4_debugmodel"], "torchtitan has no model module 'llama4'"),
    # a helper of the registry module (enable_fused_swiglu(config)), not a config ConfigManager can call
    (["torchtitan:deepseek_v3:enable_fused_swiglu"], "has no config 'enable_fused_swiglu'"),
    # 2 x cp = 4 does not divide 66 (context parallelism cuts the sequence into 2 x cp chunks)
    (["torchtitan:llama3:llama3_debugmodel", "--mesh", "fsdp=2,cp=2", "--seq-len", "66"], "does not divide the sequence"),
    # 4 divides 64, but torch shards the block mask in cp x 128-token blocks
    (["torchtitan:llama3:llama3_debugmodel", "--mesh", "fsdp=2,cp=2", "--seq-len", "64"], "does not divide the sequence"),
    (["torchtitan:qwen3:qwen3_moe_debug", "--mesh", "fsdp=3,ep=3"], "does not divide the model's"),
    (["torchtitan:llama3:llama3_debugmodel", "--mesh", "fsdp=2,ep=2"], "has none (a dense model)"),
    (["torchtitan:llama3:llama3_debugmodel", "--", "--training.no_such_key", "3"], "did not take the overrides"),
    # the schedule is torchtitan's to say; one torch has but fxacct does not replay
    (["torchtitan:llama3:llama3_debugmodel", "--mesh", "pp=2", "--batch", "4", "--pp-schedule", "gpipe"],
     "--pp-schedule with a torchtitan target"),
    (["torchtitan:llama3:llama3_debugmodel", "--mesh", "pp=2", "--batch", "4", "--",
      "--parallelism.pipeline_parallel_schedule", "ZBVZeroBubble"], "is not one fxacct replays"),
    (["torchtitan:llama3:llama3_debugmodel", "--mesh", "pp=2,tp=2", "--batch", "4"], "tp inside torchtitan's pipeline"),
    (["torchtitan:llama3:llama3_debugmodel", "--mesh", "pp=2", "--batch", "3"], "does not divide --batch 3"),
    # --expert-load: a file that is not there, not JSON, of the wrong length or shape, and where there is no ep
    (["torchtitan:qwen3:qwen3_moe_debug", "--mesh", "fsdp=4,ep=4", "--expert-load", "/nonexistent/load.json"],
     "cannot read it"),
    (["torchtitan:qwen3:qwen3_moe_debug", "--mesh", "fsdp=4,ep=4", "--expert-load", "pyproject.toml"], "not JSON"),
    (["torchtitan:qwen3:qwen3_moe_debug", "--mesh", "fsdp=4,ep=4", "--expert-load", "tests/data/expert_load_63.json"],
     "63 counts, but the model has 64 experts"),
    (["torchtitan:qwen3:qwen3_moe_debug", "--mesh", "fsdp=4,ep=4", "--expert-load", "tests/data/expert_load_3_layers.json"],
     "3 histograms, but the model has 8 MoE layers"),
    (["torchtitan:qwen3:qwen3_moe_debug", "--mesh", "fsdp=4", "--expert-load", "tests/data/expert_load_63.json"],
     "--mesh has no ep dimension"),
    # the real run is of a mesh's ranks on gloo, without a pipeline
    (["torchtitan:llama3:llama3_debugmodel", "--runtime"], "runs its ranks for real on gloo"),
    (["torchtitan:llama3:llama3_debugmodel", "--mesh", "pp=2", "--batch", "4", "--runtime"],
     "runs its ranks for real on gloo"),
])
def test_usage_errors_are_one_line(args, needle):
    assert_one_line_exit_2(_invoke(*args), needle)


def test_overrides_after_dashes_and_one_device_equal_fsdp1():
    """torchtitan's own override (--training.seq_len after --) is the same request as --seq-len, and a
    torchtitan target without --mesh is the same rank as --mesh fsdp=1 (tests/test_flag_parity.py)."""
    def totals(*args):
        r = _invoke("torchtitan:llama3:llama3_debugmodel", "--batch", "1", "--format", "json", *args)
        assert r.exit_code == 0, r.stderr
        return json.loads(r.stdout)["totals"]

    one = totals("--", "--training.seq_len", "32")
    assert one == totals("--mesh", "fsdp=1", "--seq-len", "32")
    assert one != totals("--seq-len", "64")  # the override did change the job


def test_pipeline_stages_hold_the_whole_models_parameters_and_model_flops(monkeypatch):
    """torchtitan's cut of llama3_debugmodel into 4 stages (pp=2, interleaved, two per rank) loses and
    repeats nothing: the stages' parameters sum to the whole model's, and their matmul and attention
    FLOPs over 4 micro-batches of 1 equal the one-device step's at local batch 4 (both linear in the
    batch), forward and backward."""
    import fxacct.parallel.torchtitan_pipeline as titan_pipeline
    from fxacct.load.config import Config
    from fxacct.parallel.torchtitan import profile_torchtitan

    stages = []
    assemble = titan_pipeline.assemble
    monkeypatch.setattr(titan_pipeline, "assemble", lambda config, profs, *rest: stages.extend(profs) or
                        assemble(config, profs, *rest))
    target = "torchtitan:llama3:llama3_debugmodel"
    titan_pipeline.profile_torchtitan_pipeline(Config(target=target, mesh="pp=2", batch=4, microbatches=4, seq_len=64))
    whole = profile_torchtitan(Config(target=target, mesh="fsdp=1", batch=4, seq_len=64)).accounting.totals
    parts = [p.accounting.totals for p in stages]
    assert len(parts) == 4
    assert sum(t.params for t in parts) == whole.params
    assert sum(t.model_flops for t in parts) * 4 == whole.model_flops


def _moe_account(tmp_path, load=None, *more):
    args = ["torchtitan:qwen3:qwen3_moe_debug", "--mesh", "fsdp=4,ep=4", "--batch", "2", "--seq-len", "64",
            "--format", "json", *more]
    if load is not None:
        path = tmp_path / f"load{len(list(tmp_path.iterdir()))}.json"
        path.write_text(json.dumps(load))
        args += ["--expert-load", str(path)]
    r = _invoke(*args)
    assert r.exit_code == 0, r.stderr
    return json.loads(r.stdout)


def _all_to_all(doc) -> dict:
    """(phase, module) -> all-to-all bytes."""
    return {(c["phase"], c["module"]): c["bytes"] for c in doc["collectives"] if c["op"] == "all_to_all"}


def test_expert_load_routes_the_busiest_rank_by_a_measured_histogram(tmp_path):
    """qwen3_moe_debug (64 experts, 16 per rank at ep=4, 8 MoE layers). A uniform histogram is the
    balanced account, figure for figure. A skewed one: experts 32-47 (rank 2's) get 5 tokens for
    every 1 the others get, so rank 2's experts receive 80/(80+48) of the routed rows... here 8 of
    them weigh 5 (experts 40-47), so rank 2 receives (8·5 + 8)/(8·5 + 56) = 1/2. Each rank routes
    its R rows alike, so rank 2 receives 4 · R/2 = 2R where balanced routing gives R: in every
    MoE layer's forward, the dispatch all-to-all's output doubles and the combine's stays R rows
    (3/2 of the pair), and the count exchange (a [4, 16] int64 table, 512 B) is unchanged; the
    backward's two all-to-alls likewise. The same histogram rotated onto rank 0 gives the same account."""
    balanced = _moe_account(tmp_path)
    uniform = _moe_account(tmp_path, {"experts": [3] * 64})
    assert uniform["totals"] == balanced["totals"] and _all_to_all(uniform) == _all_to_all(balanced)
    assert any("routing assumed balanced" in w for w in balanced["warnings"])

    skew = [1] * 64
    skew[40:48] = [5] * 8
    loaded = _moe_account(tmp_path, {"experts": skew})
    before, after = _all_to_all(balanced), _all_to_all(loaded)
    assert before.keys() == after.keys() and len(before) == 16  # 8 layers, forward and backward
    for (phase, module), b in before.items():
        exchange = 512 if phase == "forward" else 0
        assert after[(phase, module)] - exchange == (b - exchange) * 3 // 2, (phase, module)
    assert any("busiest expert-parallel rank (2, whose experts receive 50.0%" in w for w in loaded["warnings"])
    on_rank0 = _moe_account(tmp_path, {"experts": skew[32:] + skew[:32]})
    assert on_rank0["totals"] == loaded["totals"]


def test_expert_load_per_layer_histograms(tmp_path):
    """One histogram per MoE layer: only the skewed layer's all-to-alls change; the busiest rank is
    the one with the most rows over all layers (rank 1 here: its experts get half of layer 3's)."""
    layers = [[1] * 64 for _ in range(8)]
    layers[3][16:24] = [5] * 8
    balanced, loaded = _all_to_all(_moe_account(tmp_path)), _all_to_all(_moe_account(tmp_path, {"layers": layers}))
    changed = {module for (phase, module), b in balanced.items() if loaded[(phase, module)] != b}
    assert changed == {"model.layers.3._checkpoint_wrapped_module.moe.routed_experts"}


def test_plan_searches_a_torchtitan_jobs_degrees_and_each_trace_is_its_profile():
    """fxacct plan on a torchtitan job (4 GPUs, global batch 8; its schedule overridden to 1F1B so
    pipelines are tried): fsdp, tp and pp layouts, each a full trace of torchtitan's own job with its
    own checkpointing ("job"); a traced layout's peak and step equal a plain profile of that layout
    (a pipeline's peak that of its largest rank over the whole step), and a pp layout with tp inside
    is rejected with the reason."""
    from click.testing import CliRunner

    from fxacct_cli.main import cli

    over = ["--", "--parallelism.pipeline_parallel_schedule", "1F1B"]
    r = CliRunner().invoke(cli, ["plan", "torchtitan:llama3:llama3_debugmodel", "--gpus", "4", "--gpu", "h100",
                                 "--global-batch", "8", "--seq-len", "64", "--no-cache", "--format", "json", *over],
                           catch_exceptions=False)
    assert r.exit_code == 0, r.output
    layouts = json.loads(r.stdout[r.stdout.index("{"):])["layouts"]
    fits = [lay for lay in layouts if lay["rank"] is not None]  # ranked: fits and not dominated
    assert {lay["checkpoint"] for lay in layouts} == {"job"}
    assert {"fsdp=4", "fsdp=2,tp=2", "tp=4", "pp=2,fsdp=2", "pp=4"} <= {lay["mesh"] for lay in fits}
    assert all(lay["source"] == "traced" for lay in fits)
    assert any("tp inside torchtitan's pipeline" in (lay["rejected"] or "") for lay in layouts if lay["mesh"] == "pp=2,tp=2")

    def profile(mesh, batch, *more):
        res = _invoke("torchtitan:llama3:llama3_debugmodel", "--mesh", mesh, "--batch", str(batch), "--seq-len", "64",
                      "--gpu", "h100", "--format", "json", *more)
        assert res.exit_code == 0, res.stderr
        return json.loads(res.stdout)

    flat = next(lay for lay in fits if lay["pp"] == 1 and lay["micro_batches_per_step"] == 1)
    doc = profile(flat["mesh"], flat["micro_batch"])
    assert flat["peak_bytes"] == doc["totals"]["peak_train_bytes"]
    assert flat["step_ms"] == pytest.approx(doc["mesh"]["time"]["step_ms"], rel=1e-9)
    assert flat["mfu"] == pytest.approx(doc["mesh"]["time"]["mfu"], rel=1e-9)  # against bf16's peak, not fp32's
    piped = next(lay for lay in fits if lay["pp"] > 1)
    doc = profile(piped["mesh"], piped["micro_batch"] * piped["micro_batches_per_step"], "--microbatches",
                  str(piped["micro_batches_per_step"]), *over)
    assert piped["peak_bytes"] == max(s["peak_bytes"] for s in doc["pipeline"]["stages"])
