"""A cheaper ``__init__`` for the frozen, slotted dataclasses made once per op or node.

A frozen dataclass's generated ``__init__`` sets each field through
``object.__setattr__(self, name, value)`` (dataclasses.py, _field_init with frozen=True), which
looks the name up on the type for every field: a ten-field record costs about 1 µs to build, and
a 70B profile builds about 200k of them (records, tensor metas, node traces and costs, FLOPs:
0.12 s of its 1 s). Each field of a slotted class is a member descriptor on the class, and its own
``__set__`` stores the value with no lookup: the same instance, still frozen (``__setattr__``
raises as before), in about half the time. ``fast_init`` replaces ``__init__`` with one that does
that, keeping the signature and defaults; a class it cannot serve that way (no slots, a
default_factory, keyword-only fields, __post_init__, InitVar) keeps its own."""

from __future__ import annotations

import dataclasses


def fast_init(cls):
    """Class decorator, applied over ``@dataclass(frozen=True, slots=True)``."""
    fields = dataclasses.fields(cls)
    if (not all(f.name in cls.__dict__ and hasattr(cls.__dict__[f.name], "__set__") for f in fields)
            or any(not f.init or f.kw_only or f.default_factory is not dataclasses.MISSING for f in fields)
            or hasattr(cls, "__post_init__") or len(fields) != len(cls.__dataclass_fields__)):
        return cls
    scope = {f"_set_{f.name}": cls.__dict__[f.name].__set__ for f in fields}
    params = []
    for f in fields:
        if f.default is dataclasses.MISSING:
            params.append(f.name)
        else:
            scope[f"_default_{f.name}"] = f.default
            params.append(f"{f.name}=_default_{f.name}")
    body = "".join(f"    _set_{f.name}(self, {f.name})\n" for f in fields) or "    pass\n"
    exec(f"def __init__(self, {', '.join(params)}):\n{body}", scope)  # noqa: S102  (source built from field names)
    init = scope["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    cls.__init__ = init
    return cls
