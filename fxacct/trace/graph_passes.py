"""What inductor does to AOTAutograd's partitioned graphs that fxacct's compiled run
(fxacct.trace.compiled) does too, on fake tensors: its convolutions' channels-last layout, and the
meta the partitioner's RNG wrappers lack."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from fxacct.trace.torch_private.compile import aot

IS_FORWARD = "is_forward"  # the partitioner's tag of a forward node (torch/_functorch/partitioners.py)
_CONVOLUTION = torch.ops.aten.convolution.default
# The partitioner's wrappers of a random op it recomputes in the backward (torch/_functorch/
# partitioners.py, functionalize_rng_ops; torch/_prims/rng_prims.py): the forward runs the op and
# returns the generator's state beside its result, the backward runs the op again from that state.
RUN_AND_SAVE_RNG = torch.ops.higher_order.run_and_save_rng_state
RUN_WITH_RNG = torch.ops.higher_order.run_with_rng_state
# what torch.get_rng_state() returns on this CPU, the state the CPU wrapper copies (its
# CPUGeneratorImpl's mt19937 state: 5,056 B); a CUDA generator's is its Philox seed and offset
RNG_STATE_SHAPE = tuple(torch.get_rng_state().shape)


def channels_last_inputs(gm: fx.GraphModule) -> int:
    """Inductor's layout optimization, done to the forward graph as inductor's lowering does it:
    where ``GraphLowering.decide_layout_opt`` (inductor's own heuristic) turns it on, every
    convolution runs channels-last, so a graph input (a parameter, the model's input) that a
    convolution reads is first copied to channels-last (torch/_inductor/lowering.py,
    ``convolution``: ``require_channels_last``), and that copy is what the convolution reads and
    what the forward saves for the backward. Measured here: a real compiled CNN saves copies of
    its three conv weights (93,888 B) that eager does not. Returns the inputs copied."""
    if not aot().GraphLowering.decide_layout_opt(gm, is_inference=False):
        return 0
    copied = 0
    first = next(n for n in gm.graph.nodes if n.op != "placeholder")
    for node in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        val = node.meta.get("val")
        if not any(u.target is _CONVOLUTION and node in u.args[:2] for u in node.users) or val is None or \
                val.dim() != 4 or val.is_contiguous(memory_format=torch.channels_last):
            continue
        # the copy's bytes are what matter here: made contiguous, it runs eagerly on fake tensors
        # without turning the convolution's output channels-last (whose views eager would refuse)
        with gm.graph.inserting_before(first):
            copy = gm.graph.call_function(torch.ops.aten.clone.default, (node,))
        copy.meta.update({k: v for k, v in node.meta.items() if k != "val"})
        with val.fake_mode:
            copy.meta["val"] = val.clone()
        node.replace_all_uses_with(copy, delete_user_cb=lambda user: user.target is _CONVOLUTION or user.op == "output")
        copied += 1
    if copied:
        gm.recompile()
    return copied


def rng_wrapper_meta(forward: fx.GraphModule, backward: fx.GraphModule | None = None) -> None:
    """Give the partitioner's RNG wrappers the meta of the op each wraps (seq_nr, module, the
    forward tag), which ``functionalize_rng_ops`` (torch/_functorch/partitioners.py) does not copy
    onto them: the forward's wrapper takes it from its result (``getitem(wrapper, 1)``, which
    carries the op's meta), the backward's from the forward's wrapper whose state it reads. The
    partitioner makes both in one loop, so the k-th state the forward returns is the k-th
    ``rng_state_output_*`` input of the backward."""
    saves = list(forward.graph.find_nodes(op="call_function", target=RUN_AND_SAVE_RNG))
    for n in saves:
        result = next((u for u in n.users if u.target is operator.getitem and u.args[1] == 1), None)
        if result is not None:
            n.meta = {**result.meta, **n.meta}
    if backward is None:
        return
    returned = [a.args[0] for a in forward.graph.output_node().args[0]
                if isinstance(a, fx.Node) and a.target is operator.getitem and a.args[0] in saves]
    states = [p for p in backward.graph.find_nodes(op="placeholder") if p.name.startswith("rng_state_output")]
    for wrapper, state in zip(returned, states):
        for user in state.users:
            user.meta = {**{k: v for k, v in wrapper.meta.items() if k in ("seq_nr", "custom")},
                         "partitioner_tag": IS_FORWARD, **user.meta}


__all__ = ["IS_FORWARD", "RUN_AND_SAVE_RNG", "RUN_WITH_RNG", "RNG_STATE_SHAPE", "channels_last_inputs", "rng_wrapper_meta"]
