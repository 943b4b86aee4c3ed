"""fxacct.report.plot: the memory timeline data and the PNG.

The timeline is held against a real eager step under the storage tracker (fxacct.runtime.storage_tracker),
phase by phase, and its per-rank form against closed forms: never against the walk that draws it."""

import sys

import pytest
import torch
from helpers import SMALL_EXAMPLES, config, real_model

import fxacct
from fxacct.memory.peak import CATEGORIES
from fxacct.report.plot import memory_timeline, plot_memory
from fxacct.runtime.storage_tracker import StorageTracker, _gc_paused
from fxacct.trace.loss import training_loss


@pytest.fixture(scope="module")
def mlp_profile():
    return fxacct.profile(config("MLP", batch=2))  # d_model 32, d_hidden 64, 2 blocks; AdamW


class PhaseTracker(StorageTracker):
    """The storage tracker, keeping the largest live bytes seen in each phase of the step."""

    def __init__(self):
        super().__init__()
        self.phase = None
        self.max_by_phase: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = super().__torch_dispatch__(func, types, args, kwargs)
        self.max_by_phase[self.phase] = max(self.max_by_phase.get(self.phase, 0), self.live_bytes)
        return out


def eager_phase_maxima(name: str, batch: int) -> dict:
    """{phase: largest live bytes} of a real eager AdamW step, measured
    as fxacct.runtime.storage_tracker.measure_training_step measures (a warm-up step first, so the
    optimizer state exists; gradients set to None)."""
    rel, kwargs = SMALL_EXAMPLES[name]
    model, args, kw = real_model(rel, kwargs, batch)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def step(tracker=None):
        def phase(p):
            if tracker is not None:
                tracker.phase = p
        phase("forward")
        out = model(*args, **kw)
        phase("loss")
        loss = training_loss(out)
        del out
        phase("backward")
        loss.backward()
        phase("optimizer")
        opt.step()
        return loss

    step()
    opt.zero_grad(set_to_none=True)
    with _gc_paused(), PhaseTracker() as tracker:
        tracker.track(model, opt, args, kw)
        loss = step(tracker)
    assert tracker.adopted_bytes == 0 and loss is not None
    return tracker.max_by_phase


def test_timeline_follows_a_real_step_phase_by_phase(mlp_profile):
    timeline = memory_timeline(mlp_profile)
    assert all(set(live) == set(CATEGORIES) for _, _, live in timeline)
    ours: dict[str, int] = {}
    for _, phase, live in timeline:
        ours[phase] = max(ours.get(phase, 0), sum(live.values()))
    assert ours == eager_phase_maxima("MLP", 2)  # forward, loss, backward, optimizer: each phase's tallest stack
    # after the last op every parameter has its fp32 gradient, and AdamW holds exp_avg and
    # exp_avg_sq (8 B per parameter) and a 4-byte step per tensor
    rel, kwargs = SMALL_EXAMPLES["MLP"]
    numels = [t.numel() for t in real_model(rel, kwargs, 2)[0].parameters()]
    last = timeline[-1][2]
    assert (last["parameters"], last["gradients"]) == (4 * sum(numels), 4 * sum(numels))
    assert last["optimizer_state"] == 8 * sum(numels) + 4 * len(numels)


def test_sharded_timeline_is_per_rank(mlp_profile):
    p = fxacct.profile(config("MLP", batch=2, world_size=4, shard="zero3"))
    sharded, whole = memory_timeline(p), memory_timeline(mlp_profile)
    assert [(op, phase) for op, phase, _ in sharded] == [(op, phase) for op, phase, _ in whole]
    # ZeRO-3 partitions parameters, gradients and optimizer state, never activations or temporaries
    for (_, _, rank), (_, _, full) in zip(sharded, whole):
        assert (rank["activations"], rank["temporaries"]) == (full["activations"], full["temporaries"])
    # AdamW state per rank: exp_avg and exp_avg_sq of each fp32 parameter tensor over 4 ranks,
    # rounded up, and its 4-byte step count (⌈4/4⌉ = 1 B)
    rel, kwargs = SMALL_EXAMPLES["MLP"]
    numels = [t.numel() for t in real_model(rel, kwargs, 2)[0].parameters()]
    state = sum(2 * -(-4 * n // 4) + 1 for n in numels)
    assert {live["optimizer_state"] for _, _, live in sharded} == {state}
    assert {live["optimizer_state"] for _, _, live in whole} == {sum(8 * n + 4 for n in numels)}


def test_png_written(mlp_profile, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "memory.png"
    plot_memory(mlp_profile, str(out))
    data = out.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    assert [f.name for f in tmp_path.iterdir()] == ["memory.png"]  # no temporary file left behind


def test_the_title_says_which_step_it_shows(mlp_profile):
    """A model of which nothing trains has no training step (no backward, no training peak): its
    plot is of the forward and says so (it was titled "one training step")."""
    from dataclasses import replace

    from fxacct.report.plot import _title

    assert _title(mlp_profile).endswith("memory over one training step")
    frozen = torch.nn.Linear(8, 4).requires_grad_(False)
    with torch.device("meta"):
        x = torch.empty(2, 8)
    prof = fxacct.profile_module(frozen, (x,), {}, fxacct.Config(batch=2))
    assert not prof.capture.has_backward and prof.memory.peak_train is None
    assert _title(replace(prof, config=replace(prof.config, target="m.py:M"))).endswith(
        "memory over its forward (nothing trains: no training step)")


def test_a_pipelines_plot_says_it_shows_stage_0s_micro_batch():
    """Under --mesh pp=P the plotted trace is stage 0's, one micro-batch: it was titled "one
    training step", its peak marked as if the rank's (2,639,956 B against the schedule's 3,957,836)."""
    from helpers import target

    from fxacct.report.plot import _title
    from fxacct.units import format_bytes

    prof = fxacct.profile(fxacct.Config(target=target("examples/llama.py:Llama"), batch=2, kwargs={"n_layers": 4},
                                        mesh="pp=2", pp_split=target("examples/llama.py:pipeline_stage")))
    pipe = prof.parallel.pipeline
    assert pipe.peak_bytes > prof.memory.peak_train.bytes
    title = _title(prof)
    assert "stage 0's memory over one micro-batch's step" in title
    assert f"the schedule of {pipe.microbatches} micro-batches peaks at {format_bytes(pipe.peak_bytes)}" in title


def test_missing_matplotlib_is_a_usage_error(mlp_profile, tmp_path, monkeypatch):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    with pytest.raises(fxacct.UsageError, match=r"pip install 'fxacct\[plot\]'") as e:
        plot_memory(mlp_profile, str(tmp_path / "memory.png"))
    assert e.value.exit_code == 2
    assert not any(tmp_path.iterdir())


def test_a_one_op_spike_at_a_phase_boundary_is_drawn_over_the_boundary():
    # Five ops, the peak a single op (index 2) right after the forward→backward boundary at x = 1.5:
    # the stack is drawn in steps one op wide (so the spike is a column from x 1.5 to 2.5 at full
    # height), the boundary line lies behind the stack, and the peak marker above everything.
    pytest.importorskip("matplotlib")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from fxacct.report.plot import draw_timeline
    from fxacct.units import GiB

    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    phases = ["forward", "forward", "backward", "backward", "backward"]
    stacks = [[0] * 5 for _ in CATEGORIES]
    stacks[0] = [GiB, GiB, GiB, GiB, GiB]  # 1 GiB resident throughout
    stacks[-1] = [0, 0, 3 * GiB, 0, 0]  # + 3 GiB for one op: a 4 GiB peak at op 2
    artists = draw_timeline(ax, [f"op{i}" for i in range(5)], phases, stacks)
    assert artists["peak_index"] == 2
    [boundary] = artists["boundaries"]
    assert boundary.get_xdata()[0] == 1.5
    top = artists["stack"][-1]
    assert boundary.get_zorder() < top.get_zorder() < min(a.get_zorder() for a in artists["peak"])
    at_peak = [x for path in top.get_paths() for x, y in path.vertices if y == pytest.approx(4.0)]
    assert min(at_peak) <= 1.5 and max(at_peak) >= 2.5, at_peak  # one full op wide
    stem, marker = artists["peak"]
    [[(x0, y0), (x1, y1)]] = stem.get_segments()
    assert (x0, x1, y0, y1) == (2, 2, 0, 4.0)
    assert list(marker.get_xdata()) == [2] and list(marker.get_ydata()) == [4.0]
