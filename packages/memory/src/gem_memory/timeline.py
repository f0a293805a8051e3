"""The timeline of one training step: where each region's forward and backward begin and end.

Module hooks mark each region's forward edges; tensor hooks mark its backward edges (the output's
gradient arriving begins it; the last gradient of its own inputs ends it). At each mark the meter
gives the bytes alive and the peak since the previous mark, so ``gem_memory.profile`` can tell
the memory of the parts of the step outside every region from the regions' own.
"""

from dataclasses import dataclass, field

import torch
from torch.utils._pytree import tree_flatten, tree_leaves

from .meter import make_meter
from .policies import set_policy

__all__ = ["Timeline", "record_timeline"]


@dataclass
class Timeline:
    """What ``record_timeline`` saw: the meter's marks at each region's forward and backward
    edges, which inputs need grad, the outputs' shapes, and the policy every region ran under."""

    events: list = field(default_factory=list)  # (kind, region index, Mark)
    requires_grad: dict = field(default_factory=dict)  # name -> flags per flat input leaf
    outputs: dict = field(default_factory=dict)  # name -> [(shape, dtype, device)] needing grads
    without_exit: set = field(default_factory=set)  # regions whose backward end is not observable
    policy: str = "keep"  # the policy every region ran under


def record_timeline(
    model, inputs, named, order, shared, loss_fn, device, compile, policy, quantized
) -> Timeline:
    """One step under the meter (every region under ``policy``), with a mark at each region's
    forward and backward edges."""
    index = {name: i for i, name in enumerate(order)}
    tl = Timeline(policy=policy)
    meter = make_meter(device)

    def mark(kind, i):
        tl.events.append((kind, i, meter.mark()))

    def pre_hook(name):
        i = index[name]

        def hook(module, args, kwargs):
            mark("fwd_enter", i)
            flat, _ = tree_flatten((args, kwargs))
            tl.requires_grad[name] = [isinstance(t, torch.Tensor) and t.requires_grad for t in flat]
            watched = [
                t
                for t, rg, sh in zip(flat, tl.requires_grad[name], shared[name], strict=True)
                if rg and not sh
            ]
            if not watched:
                tl.without_exit.add(i)
            pending = [len(watched)]

            def input_grad_ready(grad):
                pending[0] -= 1
                if pending[0] == 0:
                    mark("bwd_exit", i)

            for t in watched:
                t.register_hook(input_grad_ready)

        return hook

    def post_hook(name):
        i = index[name]

        def hook(module, args, kwargs, output):
            mark("fwd_exit", i)
            outs = [
                t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad
            ]
            tl.outputs[name] = [(t.shape, t.dtype, t.device) for t in outs]
            fired = [False]

            def output_grad_ready(grad):
                if not fired[0]:
                    fired[0] = True
                    mark("bwd_enter", i)

            for t in outs:
                t.register_hook(output_grad_ready)

        return hook

    handles = [m.register_forward_pre_hook(pre_hook(n), with_kwargs=True) for n, m in named.items()]
    handles += [m.register_forward_hook(post_hook(n), with_kwargs=True) for n, m in named.items()]
    for m in named.values():
        set_policy(m, policy, quantized, compile=compile)
    try:
        with meter:
            meter.mark()
            loss = loss_fn(model(*inputs))
            loss.backward()
            del loss
            mark("end", -1)
    finally:
        for h in handles:
            h.remove()
        for m in named.values():
            set_policy(m, "keep")
        for p in model.parameters():
            p.grad = None
    _exits_first(tl.events)
    return tl


def _exits_first(events) -> None:
    """A region's backward ends and the previous one's begins on the same gradient: both hooks
    fire back to back with nothing allocated between. Order such pairs end-then-begin."""
    for k in range(len(events) - 1):
        (kind_a, _, a), (kind_b, _, b) = events[k], events[k + 1]
        if kind_a == "bwd_enter" and kind_b == "bwd_exit" and b.live == a.live and b.peak == b.live:
            events[k], events[k + 1] = (kind_b, events[k + 1][1], a), (kind_a, events[k][1], b)
