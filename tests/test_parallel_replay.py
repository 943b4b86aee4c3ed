"""Block replay under --mesh (fxacct.trace.replay and replay_train on one rank): the account, the
collectives and the peaks must be the same, node for node, as tracing every block (`dedup=False`),
and a run of identical FSDP-wrapped blocks must really replay, in the training step and in the
inference forward."""

from __future__ import annotations

import pytest
import torch
from helpers import assert_same_account, target

import fxacct
from fxacct.errors import ModelError, UsageError
from fxacct.memory.peak import lifetimes
from fxacct.parallel import rank_capture
from fxacct.trace import optim_step, replay_train
from fxacct.trace import replay as replay_module

LLAMA = "examples/llama.py:Llama"
LIST_LLAMA = "tests/models/llama_list.py:ListLlama"
GPT = "examples/gpt2.py:GPT"
GPT_KW = dict(n_layer=4, n_head=4, n_embd=64, vocab_size=1001, block_size=32)  # 4 blocks: a run of 4

# the last value: blocks replayed in the training step. FSDP2-wrapped blocks are probed inside
# their own calls (block 0 replays its own probe, 1 to 3 the second probe once the two agree); under sequence
# parallelism a block's input is saved only through a DTensor, so its training step is traced in full
CASES = [
    (LLAMA, dict(n_layers=4), "fsdp=2,tp=2", "examples/llama.py:parallelize", 4),
    (LLAMA, dict(n_layers=4), "tp=2", "examples/llama.py:parallelize_sp", 0),
    (LIST_LLAMA, dict(n_layers=4), "fsdp=2,tp=2", "tests/models/llama_list.py:parallelize", 4),
    (LIST_LLAMA, dict(n_layers=4), "tp=2", "tests/models/llama_list.py:parallelize_sp", 0),
    (LIST_LLAMA, dict(n_layers=4), "tp=2", "tests/models/llama_list.py:parallelize", 4),
    (LIST_LLAMA, dict(n_layers=4), "fsdp=2,tp=2", "tests/models/llama_list.py:parallelize_sp", 0),
    (LIST_LLAMA, dict(n_layers=4, hidden=96), "fsdp=4", "tests/models/llama_list.py:parallelize", 4),
    (GPT, GPT_KW, "fsdp=4", None, 4),
    (GPT, GPT_KW, "fsdp=2", None, 4),
]


def _profile(rel, kwargs, mesh, par, dedup):
    return fxacct.profile(fxacct.Config(target=target(rel), batch=2, kwargs=dict(kwargs), mesh=mesh, dedup=dedup,
                                        parallelize=target(par) if par else None))


@pytest.fixture
def replayed(monkeypatch) -> dict:
    """The number of blocks each capture replayed: {"train": [...], "inference": [...]}."""
    counts = {"train": [], "inference": []}
    for cls, key in ((replay_train.TrainReplay, "train"), (replay_module.BlockReplay, "inference")):
        original = cls.__exit__

        def counting(self, *exc, original=original, key=key):
            counts[key].append(self.replayed)
            return original(self, *exc)

        monkeypatch.setattr(cls, "__exit__", counting)
    return counts


@pytest.mark.slow  # 11 meshes traced twice; test_replayed_gathers_give_the_traced_account stays fast
@pytest.mark.parametrize("rel,kwargs,mesh,par,trained", CASES)
def test_mesh_same_account_both_ways(rel, kwargs, mesh, par, trained, replayed):
    a = _profile(rel, kwargs, mesh, par, True)
    b = _profile(rel, kwargs, mesh, par, False)
    assert_same_account(a, b)
    assert a.memory.rank_peak == b.memory.rank_peak
    assert a.parallel.rows == b.parallel.rows
    assert a.parallel.collectives == b.parallel.collectives
    # 4 identical blocks: the inference forward traces two and replays two
    assert replayed == {"train": [trained], "inference": [2]}


def test_fsdp_blocks_each_replay_their_own_probe_where_the_probes_disagree(replayed):
    """FSDP2-wrapped blocks are probed inside their own calls, so block 0 must answer before block
    1's probe can prove a template: it replays its own probe, a trace of that very call. Blocks
    whose forward alternates between two paths call by call (tests/models/alternating.py) tell the
    difference: the probes disagree, blocks 0 and 1 each replay their own and blocks 2 to 4 are
    traced. The account is the one tracing every block gives, call for call: when block 0 was
    traced again after its probe, that second call took the other path (a doubling where the
    step's first call takes relu: relu in blocks 2 and 4 only, 487 nodes against 488)."""
    def run(dedup):
        return fxacct.profile(fxacct.Config(target=target("tests/models/alternating.py:Stack"), batch=2,
                                            mesh="fsdp=2", dedup=dedup))

    a = run(True)
    assert replayed == {"train": [2], "inference": [0]}
    b = run(False)
    assert_same_account(a, b)
    relu = [n.module for n in a.accounting.nodes if n.op == "aten.relu.default"]
    assert relu == ["blocks.0", "blocks.2", "blocks.4"]  # the step's odd calls (forward nodes only)
    assert a.memory.rank_peak == b.memory.rank_peak
    assert a.parallel.rows == b.parallel.rows


def test_hugging_face_plan_blocks_compare_with_process_groups_in_their_ops(replayed):
    """transformers' tp plan issues c10d ops whose arguments hold the ProcessGroup and the ReduceOp,
    each boxed afresh per call as a ScriptObject (whose == raises): comparing the first two blocks
    crashed every HF model of 3+ layers under tp (exit 4), and later, with the ReduceOp compared by
    identity, the inference forward replayed no block. Now they compare by group name and
    reduction: of 6 blocks the training step replays all 6 (probed apart) and the inference forward
    4 (blocks 0 and 1 traced, as for any run), and the account is the one tracing every block gives."""
    def run(dedup):
        return fxacct.profile(fxacct.Config(target=target("tests/models/hf_llama_tp.py:make"), batch=2,
                                            kwargs=dict(layers=6), mesh="tp=2", dedup=dedup))

    a = run(True)
    assert replayed == {"train": [6], "inference": [4]}
    b = run(False)
    assert_same_account(a, b)
    assert a.memory.rank_peak == b.memory.rank_peak
    assert a.parallel.rows == b.parallel.rows


# FSDP2's gathers (fxacct.parallel.fsdp_replay): (model, kwargs, mesh, --parallelize, other
# settings, gathers replayed in the training step, in the inference forward). With B blocks the
# step gathers each block twice (forward, backward) and the inference forward once; the first
# two calls of a signature are traced, and the first forward copy-out of a block, which makes its
# storages, has a signature of its own: training replays 2B - 2 gathers, 2B - 4 copy-outs (B - 2
# first ones, B - 2 in the backward) and B - 2 reduce-scatters (none under HSDP, whose gradients
# are all-reduced too: traced), inference B - 2 gathers and copy-outs.
GATHER_CASES = [
    (LLAMA, dict(n_layers=5), "fsdp=2,tp=2", "examples/llama.py:parallelize", {}, 17, 6),
    (GPT, GPT_KW, "fsdp=4", None, {}, 12, 4),  # fxacct's own FSDP2 wrapping
    (LLAMA, dict(n_layers=4), "fsdp=2", "examples/llama.py:parallelize", {"amp": torch.bfloat16}, 12, 4),
    (LLAMA, dict(n_layers=4), "dp=2,fsdp=2", None, {}, 10, 4),  # HSDP: gathers on the fsdp dim
    ("tests/models/hf_llama_tp.py:make", dict(layers=4), "fsdp=2,tp=2", None, {}, 12, 4),  # transformers' plan
]


@pytest.mark.parametrize("rel,kwargs,mesh,par,settings,trained,inferred", GATHER_CASES)
def test_replayed_gathers_give_the_traced_account(rel, kwargs, mesh, par, settings, trained, inferred, monkeypatch):
    """The same account, collectives and peaks as tracing every gather (block replay on in both:
    only the gathers differ), and the gathers really replay."""
    made = []
    real = rank_capture.GatherReplay
    monkeypatch.setattr(rank_capture, "GatherReplay", lambda resizes: made.append(real(resizes)) or made[-1])

    def run():
        return fxacct.profile(fxacct.Config(target=target(rel), batch=2, kwargs=dict(kwargs), mesh=mesh,
                                            parallelize=target(par) if par else None, **settings))

    a = run()
    assert [g.replayed for g in made] == [trained, inferred]
    monkeypatch.setattr(rank_capture, "GatherReplay", lambda resizes: None)
    b = run()
    assert_same_account(a, b)
    assert a.memory.rank_peak == b.memory.rank_peak
    assert a.parallel.rows == b.parallel.rows
    # every storage born and dying at the same ops: a reduce-scatter's gradients die where FSDP2
    # drops them, its buffers where FSDP2 lets them go
    assert sorted(lifetimes(a.capture).born) == sorted(lifetimes(b.capture).born)


@pytest.mark.slow  # a pipeline traced twice
def test_replayed_gathers_in_a_pipeline(monkeypatch):
    """pp=2 with FSDP2 in each stage: every stage's gathers replay (4 blocks a stage: 12 in its
    training step, 4 in its inference forward, as in GATHER_CASES), and each stage's account and
    the pipeline's step peak are the ones tracing every block gives."""
    made = []
    real = rank_capture.GatherReplay
    monkeypatch.setattr(rank_capture, "GatherReplay", lambda resizes: made.append(real(resizes)) or made[-1])

    def run(dedup):
        return fxacct.profile(fxacct.Config(target=target(LLAMA), batch=2, kwargs=dict(n_layers=8), mesh="pp=2,fsdp=2",
                                            microbatches=4, dedup=dedup))

    a = run(True)
    assert [g.replayed for g in made] == [12, 4, 12, 4]
    b = run(False)
    assert_same_account(a, b)
    assert a.parallel.pipeline.peak_bytes == b.parallel.pipeline.peak_bytes
    for x, y in zip(a.parallel.pipeline.stages, b.parallel.pipeline.stages):
        assert x.collectives == y.collectives
        assert_same_account(x.profile, y.profile)


def test_autocast_probe_leaves_no_cached_casts_for_the_traced_block(replayed):
    """Under --amp, autocast caches a leaf parameter's bf16 copy until the forward ends. An
    FSDP2-wrapped block is probed inside its own call and then traced: a probe casting the
    block's own parameters left the copies the traced forward then found, so block 0 had no
    casts (7 nodes fewer than tracing every block) and its products read tensors of the discarded
    probe. The probe now casts stand-ins: the account is the one tracing every block gives. (Block
    0 now replays its own probe: its casts are the probe's, made again for its own parameters.)"""
    def run(dedup):
        return fxacct.profile(fxacct.Config(target=target(LLAMA), batch=2, kwargs=dict(n_layers=4), mesh="fsdp=2",
                                            parallelize=target("examples/llama.py:parallelize"), amp=torch.bfloat16,
                                            dedup=dedup))

    a, b = run(True), run(False)
    assert replayed["train"] == [4]  # block 0 from its own probe, blocks 1 to 3 from the second
    weight_casts = [n for n in a.accounting.nodes if n.op == "aten._to_copy.default"
                    and n.module.startswith("layers.0.") and len(n.shape) == 2]  # activations are [B, T, ...]
    assert len(weight_casts) == 7  # wq, wk, wv, wo, w1, w2, w3: each cast once in block 0's forward
    assert_same_account(a, b)
    assert a.parallel.rows == b.parallel.rows


def _both_steps(monkeypatch, run):
    """``run()`` with the optimizer stepping the shards (on_shards spied: whether each call took
    them) and again with it stepping the DTensors (the oracle): (calls, the two profiles, the
    optimizer's ops), the two accounts and their optimizer ops equal."""
    used = []
    real = optim_step.on_shards

    def spy(params):
        out = real(params)
        used.append(out is not params)
        return out

    monkeypatch.setattr(optim_step, "on_shards", spy)
    shards = run()
    monkeypatch.setattr(optim_step, "on_shards", lambda params: params)
    dtensors = run()
    assert_same_account(shards, dtensors)
    ops = [[str(n.target) for n in p.capture.graph.nodes if n.meta.get("trace") and
            n.meta["trace"].phase == "optimizer"] for p in (shards, dtensors)]
    assert ops[0] == ops[1]
    return used, shards, dtensors, ops[0]


@pytest.mark.parametrize("rel,kwargs,mesh,par", [
    (LLAMA, dict(n_layers=3), "fsdp=2,tp=2", "examples/llama.py:parallelize"),
    (LIST_LLAMA, dict(n_layers=3, hidden=96), "fsdp=4", "tests/models/llama_list.py:parallelize"),
    (GPT, GPT_KW, "fsdp=2", None),
])
def test_foreach_step_on_shards_equals_the_dtensor_step(monkeypatch, rel, kwargs, mesh, par):
    """With --gpu (foreach, CUDA's default) the optimizer steps the DTensor parameters' local shards
    (fxacct.trace.optim_step.on_shards) instead of the DTensors: the oracle is the DTensor step
    itself (on_shards switched off), whose recorded local ops must be the same, op for op, with the
    same account and peaks."""
    def run():
        return fxacct.profile(fxacct.Config(target=target(rel), batch=2, kwargs=dict(kwargs), mesh=mesh, gpu="h100",
                                            parallelize=target(par) if par else None, find_max_batch=False))

    used, shards, dtensors, ops = _both_steps(monkeypatch, run)
    assert used == [True]  # the shards were stepped
    assert any("_foreach_" in op for op in ops)
    assert shards.memory.optimizer_bytes == dtensors.memory.optimizer_bytes > 0
    assert shards.parallel.time.optimizer_s == dtensors.parallel.time.optimizer_s > 0


@pytest.mark.parametrize("name", sorted(optim_step.ELEMENTWISE_STEPS))
def test_single_tensor_step_on_shards_equals_the_dtensor_step(monkeypatch, name):
    """Without foreach (CPU's default) a built-in optimizer with an elementwise single-tensor step
    steps the DTensor parameters' shards too (one representative per shard shape: 8 blocks make
    75 parameters, over STEP_ALL_BELOW). Oracle: the DTensor step itself (on_shards switched off),
    op for op, with the same account and optimizer bytes."""
    def run():
        return fxacct.profile(fxacct.Config(target=target(LLAMA), batch=2, kwargs=dict(n_layers=8), mesh="fsdp=2,tp=2",
                                            parallelize=target("examples/llama.py:parallelize"), optimizer=name,
                                            optim_args={"momentum": 0.9} if name == "sgd" else {}))

    used, shards, dtensors, ops = _both_steps(monkeypatch, run)
    assert used and all(used)  # every representative's shard was stepped
    assert 1 < len(used) < 75 and ops  # representatives, not every parameter
    assert shards.memory.optimizer_bytes == dtensors.memory.optimizer_bytes > 0


@pytest.mark.parametrize("foreach", [False, True])
def test_an_optimizer_dtensor_refuses_is_a_usage_error(foreach):
    """Rprop's masked assignment (an in-place index_put_, per tensor in its foreach step too) is an
    op DTensor refuses on a sharded parameter, as it would on the GPUs: the user's choice of
    optimizer, named (exit 2), not fxacct's error (it was exit 4). Its foreach step is not taken
    on the shards, where it would run (DTensor of torch 2.13 refuses it even sooner, at its
    ``_foreach_copy_``, which has no sharding strategy)."""
    assert "rprop" not in optim_step.ELEMENTWISE_STEPS
    with pytest.raises(UsageError, match=r"^--optimizer rprop: Rprop.step\(\) cannot run on the DTensor parameters.*"
                                         r"(index_put_|_foreach_copy_).*choose another optimizer"):
        fxacct.profile(fxacct.Config(target=target(LLAMA), batch=2, kwargs=dict(n_layers=2), mesh="fsdp=2",
                                     parallelize=target("examples/llama.py:parallelize"), optimizer="rprop",
                                     optim_args={"foreach": foreach}))
    plain = fxacct.profile(fxacct.Config(target=target(LLAMA), batch=2, kwargs=dict(n_layers=2), optimizer="rprop",
                                         optim_args={"foreach": foreach}))
    assert plain.memory.optimizer_bytes > 0  # on one device it steps


BROKEN_OPTIMIZER = """
import torch

class Broken(torch.optim.Optimizer):
    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    def step(self, closure=None):
        raise RuntimeError("boom in the user's optimizer")
"""


@pytest.mark.parametrize("mesh", [None, "fsdp=2"])
def test_a_failing_optimizer_of_the_users_is_theirs_on_one_device_and_under_a_mesh(tmp_path, mesh):
    """A step of the user's own optimizer class that raises is their code's error (exit 3) under a
    mesh as on one device, never blamed on DTensor (the usage error above is torch's own steps')."""
    path = tmp_path / "myopt.py"
    path.write_text(BROKEN_OPTIMIZER)
    with pytest.raises(ModelError, match="boom in the user's optimizer"):
        fxacct.profile(fxacct.Config(target=target(LLAMA), batch=2, kwargs=dict(n_layers=2), mesh=mesh,
                                     parallelize=target("examples/llama.py:parallelize") if mesh else None,
                                     optimizer=f"{path}:Broken"))


def test_representatives_are_grouped_by_shard_shape():
    """Two DTensor parameters of one global shape but different shards (a [10, 10] weight split by
    rows and by columns over 4 ranks: rank 0 holds [3, 10] and [10, 3]) allocate different state:
    each shard shape gets its own representative, each standing for its own count."""
    from torch.distributed.tensor import DTensor, Shard

    from fxacct.load.specs import OptimizerSpec
    from fxacct.parallel.engine import fake_group

    with fake_group(4):
        mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (4,))
        rows = [DTensor.from_local(torch.empty(3, 10), mesh, [Shard(0)], run_check=False, shape=(10, 10),
                                   stride=(10, 1)) for _ in range(40)]
        cols = [DTensor.from_local(torch.empty(10, 3), mesh, [Shard(1)], run_check=False, shape=(10, 10),
                                   stride=(10, 1)) for _ in range(30)]
        batches = optim_step._batches(OptimizerSpec("adamw"), rows + cols)
        assert [(tuple(b[0].to_local().shape), count) for b, count in batches] == [((3, 10), 40), ((10, 3), 30)]
