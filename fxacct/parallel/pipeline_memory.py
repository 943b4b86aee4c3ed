"""The training peak of one pipeline stage: its one-micro-batch step replayed, storage by
storage, in the order its schedule runs (fxacct.parallel.pipeline_schedule), as
torch.distributed.pipelining's PipelineStage holds memory (torch 2.13 stage.py, schedules.py):

- Resident through the step: parameters, buffers, optimizer state, and per micro-batch one copy
  of the stage's input: the first stage's whole batch (the micro-batches are views of it,
  ``tensor_split``), a later stage's receive buffer (``args_recv_info``, one per micro-batch,
  kept between steps); a stage before the last also keeps one buffer per micro-batch for the
  output gradient it receives (``grad_recv_info``).
- F(k) runs the stage's forward ops (and the loss ops on the last stage only: the other stages
  send their output instead). What the forward saves for backward lives until B(k) frees it at
  the op that frees it in the one-micro-batch step; the stage output is kept in ``fwd_cache``
  to the end of B(k), on the last stage in ``output_chunks`` to the end of the step; each loss
  is kept to the end of the step (``_internal_losses``).
- B(k) runs the backward ops. The first backward allocates the parameter gradients, alive to the
  end; later ones add into them (AccumulateGrad), so a parameter gradient a later backward
  computes is freed right after its op. The input gradient of a later stage is taken off its
  receive buffer (``stage_backward`` sets ``.grad = None``) and lives as long as the send that
  carries it back (fxacct.parallel.pipeline_schedule.releases), as does a stage output.
- When the schedule returns, the last stage merges its output chunks (``torch.cat``: one more
  copy of all M outputs, freed with them since ``step()``'s result is unused); then the optimizer.
"""

from __future__ import annotations

import operator

from fxacct.memory.peak import INPUTS, lifetimes
from fxacct.trace.dispatch_recorder import BACKWARD, FORWARD, LOSS, OPTIMIZER
from fxacct.trace.graph_builder import trace_of
from fxacct.trace.records import tensor_metas

END = -1  # never freed within the step


def _storages_born(capture):
    """[(storage, birth op, death op, bytes)] in op order; ops as fxacct.memory.peak counts them."""
    ops = [n for n in capture.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    seen = {t.storage for n in capture.graph.nodes if n.op == "placeholder" for t in tensor_metas(n.meta.get("val"))}
    seen |= {s.key for s in capture.optimizer_state} | {m[0] for m in capture.master_weights}
    deaths = capture.deaths or {}
    born = []
    for i, n in enumerate(ops):
        for t in tensor_metas(n.meta.get("val")):
            if t.storage not in seen:
                seen.add(t.storage)
                d = deaths.get(t.storage, END)
                born.append((t.storage, i, END if d == END else max(i, d), t.storage_nbytes))
    return ops, born


def _output_storage(ops):
    for n in ops:
        if trace_of(n).phase == LOSS and n.all_input_nodes:
            metas = tensor_metas(n.all_input_nodes[0].meta.get("val"))
            return metas[0].storage if metas else None
    return None


def _input_grad_storages(capture) -> set:
    """The gradients of the stage's inputs: the graph returns the parameters' gradients first."""
    out = next(n for n in capture.graph.nodes if n.op == "output")
    grads = [a for a in out.args[0]][:len(capture.grad_storages)]
    n_params = sum(p.got_grad for p in capture.params)
    return {t.storage for a in grads[n_params:] for t in tensor_metas(a.meta.get("val"))}


def stage_peak(capture, actions, microbatches: int, last: bool, grad_recv_bytes: int, releases) -> int:
    """The stage's peak live bytes over one step of ``actions`` (module docstring); ``releases``:
    (output, input gradient) of each micro-batch -> the action index after which it is freed."""
    life = lifetimes(capture)
    resident = sum(b * (microbatches if c == INPUTS else 1) for c, b in life.resident)
    resident += 0 if last else microbatches * grad_recv_bytes
    ops, born = _storages_born(capture)
    phases = [trace_of(n).phase for n in ops]
    out_sid, in_grads = _output_storage(ops), _input_grad_storages(capture)
    births: dict[int, list] = {}
    for entry in born:
        births.setdefault(entry[1], []).append(entry)
    walk = _Walk(resident)
    fwd = [i for i, p in enumerate(phases) if p == FORWARD or (p == LOSS and last)]
    bwd = [i for i, p in enumerate(phases) if p == BACKWARD]
    skipped = set() if last else {i for i, p in enumerate(phases) if p == LOSS}
    freed_after: dict[int, list] = {}
    for mb in range(microbatches):
        if not last:
            freed_after.setdefault(releases[0][mb], []).append((out_sid, mb))
        for sid in in_grads:
            freed_after.setdefault(releases[1][mb], []).append((sid, mb))
    ends = _node_ends(ops, bwd)
    param_grads = {sid: ends for sid in capture.grad_storages - in_grads}
    for a, (kind, mb) in enumerate(actions):
        if kind == "F":
            walk.run(fwd, births, mb, keep={out_sid}, skipped=skipped)
        else:  # the first backward allocates the parameters' gradients, later ones add into them
            walk.run(bwd, births, mb, keep=in_grads, transient=param_grads if a > _first_b(actions) else {})
        for key in freed_after.pop(a, ()):
            walk.free(*key)
    for key in freed_after.pop(len(actions), ()):
        walk.free(*key)
    if last and out_sid is not None:  # output_chunks merged by torch.cat when the schedule returns
        walk.note(sum(walk.held.get((out_sid, mb), 0) for mb in range(microbatches)))
        for mb in range(microbatches):
            walk.free(out_sid, mb)
    walk.run([i for i, p in enumerate(phases) if p == OPTIMIZER], births, 0)
    return walk.peak


def _node_ends(ops, bwd) -> dict[int, int]:
    """Backward op -> the last op of its autograd Node (consecutive ops derived from one forward
    op): AccumulateGrad adds a later micro-batch's gradient into ``.grad`` right after it."""
    ends, last = {}, None
    for i in reversed(bwd):
        src = trace_of(ops[i]).derived_from
        if last is None or src is None or src is not last[0] or last[1] != i + 1:
            last = (src, i, i)
        else:
            last = (src, i, last[2])
        ends[i] = last[2]
    return ends


def _first_b(actions) -> int:
    return next(i for i, (kind, _) in enumerate(actions) if kind == "B")


class _Walk:
    """Live bytes over the replayed ops: (storage, micro-batch) -> bytes, and the peak."""

    def __init__(self, resident: int):
        self.live = self.peak = resident
        self.held: dict[tuple, int] = {}
        self.dies: dict[tuple[int, int], list] = {}  # (op, micro-batch) -> keys freed after it

    def note(self, extra: int = 0) -> None:
        self.peak = max(self.peak, self.live + extra)

    def free(self, sid, mb) -> None:
        self.live -= self.held.pop((sid, mb), 0)

    def run(self, op_indices, births, mb, keep=frozenset(), skipped=frozenset(), transient=None):
        transient = transient or {}
        for i in op_indices:
            if i in skipped:
                continue
            for sid, birth, death, nbytes in births.get(i, ()):
                self.held[(sid, mb)] = nbytes
                self.live += nbytes
                if sid in transient:
                    death = transient[sid][birth]
                if sid not in keep and death != END:
                    self.dies.setdefault((death if death not in skipped else op_indices[-1], mb), []).append(sid)
            self.note()
            for sid in self.dies.pop((i, mb), ()):
                self.free(sid, mb)
