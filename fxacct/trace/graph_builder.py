"""From the records of a capture to one torch.fx graph: a node per record and per placeholder,
each argument resolved to the node that produced it, and one typed ``NodeTrace`` per node. A
capture read for its peak alone (the inference forward of a profile) keeps its ops as an
``OpList`` instead: the graph holds its placeholders, each op the name fx would have given it.

``node.meta`` holds exactly two keys written here: ``val`` (a TensorMeta per output, a tuple for
multi-output ops) and ``trace`` (NodeTrace). The annotation pass (fxacct.account.annotate) adds
``fxacct``; nothing else writes node.meta.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field, replace

import torch
import torch.fx as fx

from fxacct.trace import torch_private as tp
from fxacct.trace.frozen_init import fast_init
from fxacct.trace.records import (
    DerivedFromRecord,
    OpRecord,
    Ref,
    Slot,
    TensorMeta,
    TookSequenceNumbers,
    UnderAutogradNode,
    iter_nested,
    map_nested,
)

# what a node stands for
OP, INPUT, PARAMETER, BUFFER, CONSTANT = "op", "input", "parameter", "buffer", "constant"


@fast_init
@dataclass(frozen=True, slots=True)
class NodeTrace:
    """What the capture knows of one node (``node.meta["trace"]``)."""

    role: str  # OP, INPUT, PARAMETER, BUFFER or CONSTANT
    phase: str  # the recorder's phase: forward / loss / backward / optimizer
    module: str | None  # FQN it ran in; None for a backward op (its owner's module decides)
    derived_from: fx.Node | None = None  # backward op: the forward op its autograd Node belongs to
    args_requires_grad: tuple[bool, ...] = ()  # per tensor argument (fused backward kernels)
    scope: str | None = None  # "attention" (SDPA's math path) or "recompute" (re-run forward op)
    repeat: int = 1  # optimizer op standing for this many parameters of one shape
    saved: tuple[tuple[int, torch.dtype], ...] = ()  # (bytes, dtype) autograd saved of its storages
    name: str | None = None  # parameter / buffer FQN
    origin: object = field(default=None, compare=False)  # the template record a replayed op repeats


@dataclass(frozen=True)
class OpList:
    """A capture's ops, in order, without graph nodes (fxacct.trace.capture.CaptureOptions.nodes
    False): the records an op node would be made of, and what fxacct.memory.peak reads besides."""

    names: tuple[str, ...]  # the node name fx would have given each op
    records: list[OpRecord]  # renamed in place where node vals are (fxacct.parallel.collectives.alias_waits)
    constant_users: dict  # constant placeholder's name -> the targets of the ops that read it
    placeholder_vals: dict  # Slot -> its placeholder's val

    def val_of(self, ref: Ref):
        """The val of the op output or placeholder ``ref`` names."""
        val = self.records[ref.source].outputs if ref.is_record else self.placeholder_vals[ref.source]
        return val if ref.index is None else val[ref.index]


@functools.cache
def target_name(target) -> str:
    """str(target), made once per op: an OpOverload formats its schema's name on every str()."""
    return str(target)


def trace_of(node: fx.Node) -> NodeTrace | None:
    return node.meta.get("trace")


def _op_name(func) -> str:
    return getattr(func, "_opname", None) or getattr(func, "__name__", "op")


class GraphBuilder:
    """Turns the records into an fx.Graph, resolving each argument reference to its node."""

    def __init__(self):
        self.graph = fx.Graph()
        self.nodes: dict[int | Slot, fx.Node] = {}  # record index or placeholder slot -> node
        self.getitems: dict[Ref, fx.Node] = {}

    def placeholder(self, slot: Slot, name: str, val: TensorMeta, role: str, fqn: str | None = None) -> fx.Node:
        node = self.graph.placeholder(name)
        node.meta.update(val=val, trace=NodeTrace(role, "forward", "", name=fqn))
        self.nodes[slot] = node
        return node

    def lookup(self, ref: Ref) -> fx.Node:
        parent = self.nodes[ref.source]
        if ref.index is None:
            return parent
        node = self.getitems.get(ref)
        if node is None:
            node = self.graph.create_node("call_function", operator.getitem, (parent, ref.index))
            trace = parent.meta["trace"]  # what autograd saved of its outputs stays on the op's node alone
            node.meta.update(val=parent.meta["val"][ref.index], trace=replace(trace, saved=()) if trace.saved else trace)
            self.getitems[ref] = node
        return node

    def map_arg(self, a):
        return map_nested(a, self.lookup, Ref)

    def add(self, index: int, record: OpRecord, trace: NodeTrace) -> fx.Node:
        kwargs = record.kwargs
        node = tp.fx_append_node(self.graph, "call_function", record.op, self.map_arg(record.args),
                                 {k: self.map_arg(v) for k, v in kwargs.items()} if kwargs else {}, _op_name(record.op))
        node.meta.update(val=record.outputs, trace=trace)
        self.nodes[index] = node
        return node

    def add_records(self, records: list[OpRecord], constants, repeat_of, saved: dict) -> None:
        """Every record becomes a node; a backward node knows the forward node it derives from;
        each storage autograd saved (``saved``: storage id -> (bytes, dtype)) is put on the node
        that allocated it, its first producer in graph order (a placeholder's, or an op's)."""
        for slot, meta in constants:
            self.placeholder(slot, "constant", meta, CONSTANT)
        remaining = dict(saved)
        for node in self.graph.nodes:  # the placeholders alone, so far
            mine = _claim(node.meta["val"], remaining)
            if mine:
                node.meta["trace"] = replace(node.meta["trace"], saved=node.meta["trace"].saved + mine)
        seq_owner: dict[int, fx.Node] = {}
        for index, r in enumerate(records):
            link, derived_from, repeat = r.link, None, 1
            if type(link) is DerivedFromRecord:
                derived_from = self.nodes[link.index]
            elif type(link) is UnderAutogradNode:
                derived_from = seq_owner.get(link.sequence_nr)
            elif r.phase == "optimizer":
                repeat = repeat_of(index)
            mine = _claim(r.outputs, remaining) if remaining else ()
            node = self.add(index, r, NodeTrace(OP, r.phase, r.module, derived_from, r.args_requires_grad,
                                                r.scope, repeat, mine, origin=r.origin))
            if isinstance(r.link, TookSequenceNumbers):
                for s in r.link.numbers():
                    seq_owner[s] = node

    def op_list(self, records: list[OpRecord], constants) -> OpList:
        """The records as an OpList: the constants' placeholders made, each op named as
        add_records would name its node (a getitem node's name never meets an op's)."""
        for slot, meta in constants:
            self.placeholder(slot, "constant", meta, CONSTANT)
        readers: dict = {slot: [] for slot, _ in constants}
        if readers:
            for r in records:
                for ref in iter_nested((r.args, r.kwargs), Ref):
                    if ref.source in readers:
                        readers[ref.source].append(r.op)
        return OpList(tuple(tp.fx_node_name(self.graph, _op_name(r.op)) for r in records), records,
                      {self.nodes[slot].name: tuple(ops) for slot, ops in readers.items()},
                      {slot: node.meta["val"] for slot, node in self.nodes.items() if isinstance(slot, Slot)})


def _claim(val, remaining: dict) -> tuple:
    """The (bytes, dtype) of each saved storage among ``val``'s tensors still in ``remaining``,
    taken out of it (a storage is put on its first producer alone)."""
    return tuple(remaining.pop(v.storage) for v in (val if isinstance(val, tuple) else (val,))
                 if isinstance(v, TensorMeta) and v.storage in remaining)
