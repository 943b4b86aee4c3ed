"""torch.compile's private parts fxacct runs on fake tensors (fxacct.trace.compiled): AOTAutograd's
entry point, and inductor's own decomposition table and partition function, so the forward /
backward split is the one ``torch.compile`` (inductor backend) makes in this torch release
(torch/_inductor/compile_fx.py, ``_compile_fx_main``: aot_autograd(decompositions=select_decomp_table(),
partition_fn=partition_fn, keep_inference_input_mutations=True)).

Imported when a compile is asked for, not before: torch._inductor takes seconds to import."""

import importlib
from types import SimpleNamespace

from fxacct.trace.torch_private.required import _require

_NAMES = (
    ("torch._functorch.aot_autograd", "aot_module_simplified", "aot_module_simplified"),
    # inductor's partition: its joint-graph passes, then min_cut_rematerialization_partition(compiler="inductor")
    ("torch._inductor.compile_fx", "partition_fn", "partition_fn"),
    ("torch._inductor.decomposition", "select_decomp_table", "decompositions"),
    ("torch._functorch.config", "patch", "functorch_patch"),
    # inductor's joint-graph passes read the fake mode from its virtualized globals (compile_fx sets it)
    ("torch._inductor.virtualized", "V", "V"),
    ("torch._guards", "detect_fake_mode", "detect_fake_mode"),
    # GraphLowering.decide_layout_opt: whether inductor runs a graph's convolutions channels-last
    ("torch._inductor.graph", "GraphLowering", "GraphLowering"),
    # torch.compiler.is_compiling() is true for a whole torch.compile session, the model's forward
    # traced included (torch/_dynamo/convert_frame.py, compile_inner): a model that takes another
    # branch when compiled (transformers' is_torchdynamo_compiling) takes it here too
    ("torch.compiler", "_compile_session_context", "compile_session"),
)
_loaded: SimpleNamespace | None = None


def aot() -> SimpleNamespace:
    """aot_module_simplified, partition_fn, decompositions (the table's function),
    functorch_patch (torch._functorch.config.patch), V (inductor's virtualized globals),
    detect_fake_mode, GraphLowering and compile_session, each looked up once."""
    global _loaded
    if _loaded is None:
        found = {}
        for module, name, key in _NAMES:
            found[key] = _require(importlib.import_module(module), name, module)
        _require(importlib.import_module("torch._functorch.config"), "force_non_lazy_backward_lowering",
                 "torch._functorch.config")
        _loaded = SimpleNamespace(**found)
    return _loaded
