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
  the op that frees it in the one-micro-batch step; the stage outputs are kept in ``fwd_cache``
  to the end of B(k), on the last stage in ``output_chunks`` to the end of the step; each loss
  is kept to the end of the step (``_internal_losses``).
- B(k) runs the backward ops. The first backward allocates the parameter gradients, alive to the
  end; later ones add into them (AccumulateGrad), so a parameter gradient a later backward
  computes is freed at the end of its autograd node (when AccumulateGrad has added it in). The
  input gradient of a later stage is taken off its receive buffer (``stage_backward`` sets
  ``.grad = None``) and lives as long as the send that carries it back
  (fxacct.parallel.pipeline_schedule.releases), as does a stage output.
- When the schedule returns, the last stage merges its output chunks (``torch.cat``: one more
  copy of all M outputs, freed with them since ``step()``'s result is unused); then the optimizer.
- With FSDP2 inside the stage, its unsharded parameters, its gathers, its unsharded gradients and
  its reductions follow fxacct.parallel.pipeline_fsdp (the reductions run after the last action,
  before the outputs merge).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

from fxacct.memory.allocator_rules import DEFAULT_STREAM, Free, Malloc
from fxacct.memory.fixed import CUBLAS_THREADS
from fxacct.memory.peak import INPUTS, lifetimes
from fxacct.memory.reserved import cublas_threads
from fxacct.parallel.pipeline_fsdp import Gathered, fsdp_stage
from fxacct.trace.capture import Capture
from fxacct.trace.dispatch_recorder import BACKWARD, FORWARD, LOSS, OPTIMIZER
from fxacct.trace.graph_builder import trace_of
from fxacct.trace.records import tensor_metas

END = -1  # never freed within the step


def _storages_born(capture, life):
    """(ops, [(storage, birth op, death op or END, bytes)]) in op order, from the step's lifetimes
    (fxacct.memory.peak.lifetimes: the single-device peak's own rule of what is born when)."""
    ops = [n for n in capture.graph.nodes if n.op == "call_function" and n.target is not operator.getitem]
    end = len(ops)
    return ops, [(sid, birth, END if death >= end else death, nbytes)
                 for sid, (birth, death, _, nbytes) in zip(life.born_storages, life.born)]


def _input_grad_storages(capture) -> set:
    """The gradients of the stage's inputs: the graph returns the parameters' gradients first."""
    out = next(n for n in capture.graph.nodes if n.op == "output")
    grads = [a for a in out.args[0]][:len(capture.grad_storages)]
    n_params = sum(p.got_grad for p in capture.params)
    return {t.storage for a in grads[n_params:] for t in tensor_metas(a.meta.get("val"))}


@dataclass(frozen=True)
class LocalStage:
    capture: Capture  # the stage's one-micro-batch step
    last: bool  # the pipeline's last stage: computes the loss, keeps its outputs
    grad_recv_bytes: int  # the output gradients it receives per micro-batch (0 on the last stage)
    resizes: tuple = ()  # FSDP2's storage resizes in the trace (fxacct.parallel.fsdp_storage), if any


class _Prepared:
    """One local stage's ops by phase and the storages each op makes."""

    def __init__(self, st: LocalStage, microbatches: int):
        life = lifetimes(st.capture)
        # one block each: a stage's input is one buffer of all M micro-batches (the first stage's
        # batch, its micro-batches views of it) or one receive buffer per micro-batch (a later stage's)
        self.resident_blocks = [b * (microbatches if c == INPUTS else 1) for c, b in life.resident]
        self.resident_blocks += [st.grad_recv_bytes] * microbatches if st.grad_recv_bytes else []
        # the blocks a run's first step makes (its optimizer state: fxacct.memory.reserved), by index
        made = life.resident_births or (None,) * len(life.resident)
        self.first_step_made = frozenset(i for i, op in enumerate(made) if op is not None)
        self.cublas_threads = cublas_threads(life)
        self.resident = sum(self.resident_blocks)
        self.ops, born = _storages_born(st.capture, life)
        phases = [trace_of(n).phase for n in self.ops]
        self.out_sids, self.in_grads = st.capture.output_storages, _input_grad_storages(st.capture)
        self.births: dict[int, list] = {}
        for entry in born:
            self.births.setdefault(entry[1], []).append(entry)
        self.fwd = [i for i, p in enumerate(phases) if p == FORWARD or (p == LOSS and st.last)]
        self.bwd = [i for i, p in enumerate(phases) if p == BACKWARD]
        self.opt = [i for i, p in enumerate(phases) if p == OPTIMIZER]
        self.skipped = set() if st.last else {i for i, p in enumerate(phases) if p == LOSS}
        ends = _node_ends(self.ops, self.bwd)
        self.param_grads = {sid: ends for sid in st.capture.grad_storages - self.in_grads}
        self.fsdp = fsdp_stage(self.ops, self.births, st.resizes)
        self.unsharded_grads = self.cast_grads = frozenset()
        if self.fsdp is not None:  # gradients kept unsharded between micro-batches, reduced at the end
            self.unsharded_grads, self.cast_grads = self.fsdp.grads, frozenset(self.fsdp.cast_grads)
            self.param_grads.update((sid, ends) for sid in self.unsharded_grads - self.cast_grads)
            self.skipped |= self.fsdp.region_ops


def prepared_stages(stages: dict, microbatches: int) -> dict:
    """What stage_peak reads of each local stage (stage index -> LocalStage), made once for walks
    that repeat (a run's steps: fxacct.parallel.pipeline)."""
    return {k: _Prepared(st, microbatches) for k, st in stages.items()}


def stage_threads(prep: dict) -> tuple[str, ...]:
    """The threads that run matmuls on any of the prepared stages (fxacct.memory.fixed.CUBLAS_THREADS)."""
    return tuple(t for t in CUBLAS_THREADS if any(t in p.cublas_threads for p in prep.values()))


def stage_peak(stages: dict, actions, microbatches: int, releases, allocator=None, prep: dict | None = None) -> int:
    """A rank's peak live bytes over one step of ``actions`` ((kind, stage, micro-batch)) on its
    ``stages`` (stage index -> LocalStage; module docstring); ``releases``: (output, input
    gradient) of each (stage, micro-batch) -> the action index after which it is freed.
    ``allocator`` (an AllocatorMirror): sent every allocation and free, in the same order;
    ``prep``: prepared_stages of ``stages``, if made already."""
    prep = prep or prepared_stages(stages, microbatches)
    walk = _Walk(sum(p.resident for p in prep.values()), allocator)
    made_at_optimizer: dict = {}  # stage -> its resident blocks a run's first step makes, by global index
    if allocator is not None:
        blocks, first = [], 0
        for k, p in prep.items():
            made_at_optimizer[k] = [(first + i, p.resident_blocks[i]) for i in sorted(p.first_step_made)]
            blocks += p.resident_blocks
            first += len(p.resident_blocks)
        allocator.resident(blocks, {i for made in made_at_optimizer.values() for i, _ in made})
    freed_after: dict[int, list] = {}
    for (st, mb), a in releases[0].items():
        if not stages[st].last:
            freed_after.setdefault(a, []).extend((sid, (st, mb)) for sid in prep[st].out_sids)
    for (st, mb), a in releases[1].items():
        freed_after.setdefault(a, []).extend((sid, (st, mb)) for sid in prep[st].in_grads)
    gathered = {st: Gathered(p.fsdp, st) for st, p in prep.items() if p.fsdp is not None}
    first_backward = {}
    for a, (kind, st, mb) in enumerate(actions):
        p = prep[st]
        if kind == "F":
            walk.run(p.fwd, p.births, (st, mb), keep=p.out_sids, skipped=p.skipped, fsdp=gathered.get(st))
        else:  # the first backward allocates the parameters' gradients, later ones add into them
            later = st in first_backward
            if st in gathered:
                gathered[st].first = not later
            kept = p.cast_grads if later else p.unsharded_grads  # (pipeline_fsdp: until the unit's post_backward)
            walk.run(p.bwd, p.births, (st, mb), keep=p.in_grads | kept, skipped=p.skipped,
                     transient=p.param_grads if later else {}, fsdp=gathered.get(st), forward=False)
            first_backward.setdefault(st, (st, mb))
        for key in freed_after.pop(a, ()):
            walk.free(*key)
    for key in freed_after.pop(len(actions), ()):
        walk.free(*key)
    for st, g in gathered.items():  # perform_reduce_grad, when the schedule's actions are done
        g.reduce(walk, prep[st].births, first_backward.get(st))
    for st, p in prep.items():
        if stages[st].last and p.out_sids:  # output_chunks merged by torch.cat when the schedule returns
            walk.note(sum(walk.held.get((sid, (st, mb)), 0) for sid in p.out_sids for mb in range(microbatches)))
            for mb in range(microbatches):
                for sid in p.out_sids:
                    walk.free(sid, (st, mb))
    for st, p in prep.items():
        if allocator is not None:  # torch.optim makes its state before its first step's math
            allocator.made(made_at_optimizer[st])
        walk.run(p.opt, p.births, (st, 0))
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


class AllocatorMirror:
    """The walk's allocations and frees sent to a CUDA caching allocator replay
    (fxacct.memory.allocator.CachingAllocator, its ``apply``), each on the stream its stage's
    trace puts it on (fxacct.memory.reserved.fsdp_streams, per stage). Walked again for each step
    of a run (``end_step`` between): the resident blocks are made once, those a run's first step
    makes (the optimizer state) at its first optimizer phase, and what a step still holds at its
    end is dropped there, as fxacct.memory.reserved replays one device's run."""

    def __init__(self, allocator, streams: dict[int, dict[int, str]], workspace: int = 0, threads: tuple = ()):
        self.allocator, self.streams = allocator, streams
        self.step = 0
        self.held: set = set()  # this step's blocks
        for thread in threads if workspace else ():  # each thread's cuBLAS workspace (fxacct.memory.fixed)
            allocator.apply(Malloc(("cublas", thread), workspace))

    def resident(self, blocks: list[int], first_step_made=frozenset()) -> None:
        if self.step == 0:
            for i, nbytes in enumerate(blocks):
                if nbytes and i not in first_step_made:
                    self.allocator.apply(Malloc(("resident", i), nbytes))

    def made(self, blocks: list[tuple[int, int]]) -> None:
        """Resident blocks (index, bytes) a run's first step makes here."""
        for i, nbytes in blocks if self.step == 0 else ():
            if nbytes:
                self.allocator.apply(Malloc(("resident", i), nbytes))

    def malloc(self, key, nbytes: int) -> None:
        if nbytes:  # key: (storage, (stage, micro-batch or a tag)); the stage picks the trace's streams
            stream = self.streams.get(key[1][0], {}).get(key[0], DEFAULT_STREAM)
            self.held.add(key)
            self.allocator.apply(Malloc((self.step, key), nbytes, stream))

    def free(self, key, nbytes: int) -> None:
        if nbytes:
            self.held.discard(key)
            self.allocator.apply(Free((self.step, key)))

    def end_step(self) -> None:
        """What the step still holds (gradients, losses, the outputs kept to its end) dropped."""
        for key in self.held:
            self.allocator.apply(Free((self.step, key)))
        self.held = set()
        self.step += 1


class _Walk:
    """Live bytes over the replayed ops: (storage, micro-batch) -> bytes, and the peak; an
    AllocatorMirror, if given, sees each allocation and free."""

    def __init__(self, resident: int, allocator: AllocatorMirror | None = None):
        self.live = self.peak = resident
        self.held: dict[tuple, int] = {}
        self.dies: dict[tuple[int, int], list] = {}  # (op, micro-batch) -> keys freed after it
        self.allocator = allocator

    def note(self, extra: int = 0) -> None:
        self.peak = max(self.peak, self.live + extra)
        if extra and self.allocator is not None:  # a transient beside what is live (the outputs' torch.cat)
            merged = ("merged outputs", (None, "transient"))  # of no stage's trace: the default stream
            self.allocator.malloc(merged, extra)
            self.allocator.free(merged, extra)

    def free(self, sid, mb) -> None:
        nbytes = self.held.pop((sid, mb), 0)
        self.live -= nbytes
        if self.allocator is not None:
            self.allocator.free((sid, mb), nbytes)

    def hold(self, key, nbytes: int) -> None:
        if key in self.held:  # held again: the block it had is given back first
            self.free(*key)
        self.held[key] = nbytes
        self.live += nbytes
        if self.allocator is not None:
            self.allocator.malloc(key, nbytes)

    def run(self, op_indices, births, mb, keep=frozenset(), skipped=frozenset(), transient=None, fsdp=None,
            forward=True):
        """Replay ``op_indices`` for micro-batch ``mb``; ``fsdp`` (pipeline_fsdp.Gathered) decides
        the memory of FSDP2's unsharded storages and gathers."""
        transient = transient or {}
        for i in op_indices:
            if fsdp is not None:
                fsdp.before(i, self, forward, mb)
            if i not in skipped:
                self._op(i, births, mb, keep, skipped, transient, fsdp, op_indices[-1])
            if fsdp is not None:
                fsdp.after(i, self, forward)

    def _op(self, i, births, mb, keep, skipped, transient, fsdp, last) -> None:
        for sid, birth, death, nbytes in births.get(i, ()):
            if fsdp is not None and fsdp.skip_birth(sid):
                continue
            self.hold((sid, mb), nbytes)
            if sid in transient:
                death = transient[sid][birth]
            if sid not in keep and death != END:
                self.dies.setdefault((death if death not in skipped else last, mb), []).append(sid)
        self.note()
        for sid in self.dies.pop((i, mb), ()):
            self.free(sid, mb)
