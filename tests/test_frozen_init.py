"""fxacct.trace.frozen_init.fast_init: the same frozen dataclass instances as the generated
``__init__`` makes (fields, defaults, equality, hashing, replace, pickling, frozenness), for the
classes fxacct builds per op and per node, and no change to a class it cannot serve."""

from __future__ import annotations

import dataclasses
import pickle

import pytest
import torch

from fxacct.account.accounting import NodeRow
from fxacct.account.annotate import NodeCost
from fxacct.costs.registry import Flops
from fxacct.trace.frozen_init import fast_init
from fxacct.trace.graph_builder import NodeTrace
from fxacct.trace.records import DerivedFromRecord, OpRecord, Ref, Slot, TensorMeta


def plain_twin(cls):
    """The same fields as a dataclass with the generated __init__."""
    fields = [(f.name, f.type, dataclasses.field(default=f.default, compare=f.compare)
               if f.default is not dataclasses.MISSING else dataclasses.field(compare=f.compare))
              for f in dataclasses.fields(cls)]
    return dataclasses.make_dataclass("Twin" + cls.__name__, fields, frozen=True, slots=True)


ARGS = {
    TensorMeta: ((2, 3), (3, 1), torch.float32, 7, 24),
    Ref: (Slot("param", 1),),
    DerivedFromRecord: (4,),
    OpRecord: (torch.ops.aten.mm.default, (Ref(0), Ref(1, 0)), {}, None, "forward", "blocks.0", None, (True,), None),
    NodeTrace: ("op", "backward", None),
    Flops: (2, 0, 3),
    NodeCost: (Flops(4), "compute", 16, 8, ((torch.float32, 8),), False),
    NodeRow: ("mm", "aten.mm.default", "lin", (2, 3), "torch.float32", "compute", Flops(1), Flops(2), 0, 24, False),
}


@pytest.mark.parametrize("cls", list(ARGS), ids=lambda c: c.__name__)
def test_fast_init_builds_what_the_generated_init_builds(cls):
    assert cls.__init__.__code__.co_filename == "<string>" and "_set_" in "".join(cls.__init__.__code__.co_names)
    args = ARGS[cls]
    twin = plain_twin(cls)
    made, reference = cls(*args), twin(*args)
    names = [f.name for f in dataclasses.fields(cls)]
    assert [getattr(made, n) for n in names] == [getattr(reference, n) for n in names]  # defaults too
    assert made == cls(**dict(zip(names, args)))  # by keyword
    try:
        hashed = hash(reference) is not None
    except TypeError:  # a dict field (a record's kwargs): unhashable, as the generated class is
        hashed = False
    if hashed:
        assert hash(made) == hash(reference)  # the hash of the same field values
    else:
        with pytest.raises(TypeError):
            hash(made)
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(made, names[0], args[0])
    assert dataclasses.replace(made, **{names[0]: args[0]}) == made
    if cls is not OpRecord:  # a record holds its OpOverload, which no pickle takes
        assert pickle.loads(pickle.dumps(made)) == made
    if any(f.default is dataclasses.MISSING for f in dataclasses.fields(cls)):
        with pytest.raises(TypeError):  # a missing argument is refused as before
            cls()


def test_a_class_it_cannot_serve_keeps_its_own_init():
    @dataclasses.dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclasses.dataclass(frozen=True, slots=True)
    class Factory:
        a: list = dataclasses.field(default_factory=list)

    @dataclasses.dataclass(frozen=True, slots=True)
    class Post:
        a: int

        def __post_init__(self):
            object.__setattr__(self, "a", self.a + 1)

    @dataclasses.dataclass(frozen=True, slots=True)
    class KeywordOnly:
        a: int
        b: int = dataclasses.field(default=0, kw_only=True)

    @dataclasses.dataclass(frozen=True, slots=True)
    class NotInInit:
        a: int
        b: int = dataclasses.field(default=5, init=False)

    @dataclasses.dataclass(frozen=True, slots=True)
    class WithInitVar:
        a: int
        scale: dataclasses.InitVar[int] = 1

    for cls in (NoSlots, Factory, Post, KeywordOnly, NotInInit, WithInitVar):
        init = cls.__init__
        assert fast_init(cls).__init__ is init
    assert Post(1).a == 2 and Factory().a == [] and KeywordOnly(1, b=2).b == 2 and NotInInit(1).b == 5
    assert WithInitVar(3, scale=2).a == 3
