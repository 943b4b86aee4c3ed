"""The order a pipeline schedule runs on each rank, and what follows from it: the micro-batches a
stage holds at once and the idle slots (the bubble).

The order is torch.distributed.pipelining's own: each schedule class builds a per-rank action
list (F = forward, B = full backward of one stage and micro-batch): GPipe's and 1F1B's
``pipeline_order`` as the schedule builds it (interleaved 1F1B: stage r, r + P,
... on rank r). The single-stage lists drop their idle slots, and 1F1B's numbers the last rank's
micro-batches from 1, so only their sequence of F and B is taken; both schedules run each kind in
micro-batch order, so the k-th F (B) is micro-batch k. The bubble comes from running the order
with its dependencies (stage s forwards micro-batch k after stage s − 1 did; it runs its
backward after stage s + 1 did), one unit of time per forward and ``backward_units`` per backward.
"""

from __future__ import annotations

from dataclasses import dataclass

from fxacct.errors import UsageError
from fxacct.trace import torch_private as tp

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


@dataclass(frozen=True)
class RankOrder:
    actions: tuple[tuple[str, int, int], ...]  # ("F" | "B", stage, micro-batch) in the rank's order
    in_flight: int  # most (stage, micro-batch) forwards not yet backwarded, at any point
    busy: int  # time units computing
    span: int  # time units from the first rank's first forward to the last rank's last backward


def schedule_class(schedule: str):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved-1f1b": ScheduleInterleaved1F1B}[schedule]


def per_rank(schedule: str, stages_per_rank: int | None) -> int:
    """Stages each rank runs: V for interleaved 1F1B (default 2), else 1."""
    return (stages_per_rank or 2) if schedule == "interleaved-1f1b" else 1


def check_microbatches(schedule: str, stages: int, microbatches: int) -> None:
    if microbatches < 1:
        raise UsageError(f"--microbatches {microbatches}: use a positive count")
    if schedule == "1f1b" and microbatches < stages:
        raise UsageError(f"--microbatches {microbatches} is fewer than the {stages} pipeline stages, which "
                         f"--pp-schedule 1f1b needs (torch's Schedule1F1B): use --microbatches >= {stages}")
    rounds = max(1, microbatches // stages)
    if schedule == "interleaved-1f1b" and microbatches % rounds:
        raise UsageError(f"--microbatches {microbatches} is not a multiple of its {rounds} rounds of "
                         f"pp={stages}, which --pp-schedule interleaved-1f1b needs: use a multiple of {stages}")


def rank_actions(schedule: str, stages: int, microbatches: int, v: int = 1) -> dict[int, list]:
    """rank -> [("F" | "B", stage, micro-batch)] from the schedule class's own order (module
    docstring); the single-stage schedules' micro-batches numbered in order per kind."""
    order = tp.pipeline_order(schedule_class(schedule), stages, microbatches, v)
    out = {}
    for rank, actions in order.items():
        acts = [a for a in actions if a is not None and a[0] in ("F", "B")]
        if v == 1:
            seen = {"F": 0, "B": 0}
            for i, (kind, _, _) in enumerate(acts):
                acts[i] = (kind, rank, seen[kind])
                seen[kind] += 1
        out[rank] = acts
    return out


def simulate(schedule: str, stages: int, microbatches: int, v: int = 1, backward_units: int = 2) -> tuple[RankOrder, ...]:
    """Each rank's order, in-flight count and busy/idle time (module docstring), one unit of time
    per forward and ``backward_units`` per backward."""
    actions = rank_actions(schedule, stages, microbatches, v)
    clock = _run(schedule, actions, stages, microbatches, v, lambda kind, st: 1 if kind == "F" else backward_units)
    span = max(clock)
    return tuple(RankOrder(tuple(actions[r]), _in_flight(actions[r]), v * microbatches * (1 + backward_units), span)
                 for r in range(stages))


def step_seconds(schedule: str, stages: int, microbatches: int, v: int, forward_s: list[float],
                 backward_s: list[float]) -> float:
    """The schedule's span when stage st's forward of one micro-batch takes forward_s[st] and its
    backward backward_s[st]: the same dependency walk as simulate, with these durations."""
    actions = rank_actions(schedule, stages, microbatches, v)
    return max(_run(schedule, actions, stages, microbatches, v,
                    lambda kind, st: forward_s[st] if kind == "F" else backward_s[st]))


def _run(schedule: str, actions: dict, stages: int, microbatches: int, v: int, duration) -> list:
    """Each rank's finish time: stage st runs on rank st mod P, stage st's forward of micro-batch k
    waits for stage st − 1's, its backward for stage st + 1's (the last stage's for its own forward)."""
    last = stages * v - 1
    done: dict[tuple[str, int, int], float] = {}  # (kind, stage, micro-batch) -> finish time
    clock, nxt = [0] * stages, [0] * stages
    while any(nxt[r] < len(actions[r]) for r in range(stages)):
        progressed = False
        for r in range(stages):
            while nxt[r] < len(actions[r]):
                kind, st, mb = actions[r][nxt[r]]
                dep = (("F", st - 1, mb) if st > 0 else None) if kind == "F" else \
                    (("B", st + 1, mb) if st < last else ("F", st, mb))
                if dep is not None and dep not in done:
                    break
                clock[r] = done[(kind, st, mb)] = max(clock[r], done.get(dep, 0)) + duration(kind, st)
                nxt[r] += 1
                progressed = True
        if not progressed:
            raise UsageError(f"--pp-schedule {schedule} deadlocks at pp={stages}, M={microbatches}")
    return clock


def _in_flight(actions) -> int:
    held = most = 0
    for kind, _, _ in actions:
        held += 1 if kind == "F" else -1
        most = max(most, held)
    return most


def releases(schedule: str, actions, stages: int, rank: int, microbatches: int) -> tuple[dict, dict]:
    """When the schedule drops its last reference to a micro-batch's sent tensors, keyed by
    (stage, micro-batch), as the index of the action after which they are freed (len(actions):
    when the schedule returns): (stage output: kept for backward in ``fwd_cache`` and by the
    send's work; input gradient: kept by the send's P2POp / work). torch 2.13 schedules.py:

    - GPipe keeps every send's work in ``fwd_sends_to_wait`` / ``bwd_sends_to_wait`` until it
      returns; interleaved 1F1B (``_PipelineScheduleRuntime``) keeps them in ``send_ops``.
    - 1F1B frees output k after B(k), except the last-but-one warm-up forward's send work, which
      ``send_work`` holds to the end of the steady loop (the B of micro-batch M − W, W = min(M, P − s)
      warm-up forwards); input gradient k leaves ``bwd_sends`` when B(k + 1) replaces it.
    """
    end = len(actions)
    keys = [(st, mb) for kind, st, mb in actions if kind == "B"]
    if schedule != "1f1b":
        return {k: end for k in keys}, {k: end for k in keys}
    backward_at = {mb: i for i, (kind, _, mb) in enumerate(actions) if kind == "B"}
    w = min(microbatches, stages - rank)
    outputs = {(rank, k): backward_at[k] for k in range(microbatches)}
    if w >= 2:
        outputs[(rank, w - 2)] = max(outputs[(rank, w - 2)], backward_at[microbatches - w])
    grads = {(rank, k): backward_at[k + 1] if k + 1 < microbatches else end for k in range(microbatches)}
    return outputs, grads
