"""``--cuda-graphs``' capture: a module's forward and backward as two CUDA graphs, every capture of a run on one side
stream into one memory pool, so that graphs of several batch shapes share one step's activation memory.

Why not ``torch.cuda.make_graphed_callables``: it captures each call on a new stream, and the caching allocator
reuses a freed block only on the stream that freed it. A second shape (an epoch's smaller last batch) then needs a
pool of its own, or runs eagerly beside the graphs' pool. Measured on an H200 (2026-11-28,
benchmarks/results/gpu_check_2026-11-28_h200.md, ``graph_memory``: yolov5s, 640 px, batches of 64 then 40), peak
reserved memory against eager training's 11.46 GiB:

- make_graphed_callables, the last batch eager: 18.74 GiB (1.63x);
- the last batch by a second make_graphed_callables into the same pool: 18.94 GiB (1.65x);
- both shapes captured on one stream into one pool, as here: 11.96 GiB (1.04x), the last batch's replayed gradients
  equal to an eager pass's.

What a graphed callable does is make_graphed_callables' contract: called with tensors of the captured shapes, it
copies them into the graph's static inputs, replays the forward graph and returns its static outputs (detached, as
outputs of an autograd Function of the inputs and the module's parameters); its backward copies the incoming
gradients into the static gradient outputs, replays the backward graph and returns the static gradients of the
parameters, which autograd accumulates into ``.grad`` (a parameter without one takes the static tensor as it is:
utils/trainer/cuda_graphs.py's ``own_gradients``). A replay overwrites the static outputs and gradients of that
shape's previous replay.

Sharing the pool is safe for how a training step uses the graphs: a shape's forward and backward replay in that order
on one stream before the next step's forward, so a capture may reuse memory that an earlier capture's graphs use only
while they run; the static inputs, outputs and gradients stay referenced (by the callable), so no capture takes them.
"""
from __future__ import annotations

import torch


class _Graphs:
    """One capture: the two graphs and their static tensors."""

    def __init__(self, module, sample_args: tuple, stream, pool, warmup: int):
        self.parameters = tuple(p for p in module.parameters() if p.requires_grad)
        self.static_inputs = tuple(sample_args)
        torch.cuda.synchronize()  # the sample was written on the caller's stream
        with torch.cuda.stream(stream):
            for _ in range(warmup):  # lazy initialisations (cuBLAS handles, cuDNN plans) happen outside a capture
                outputs = [o for o in _as_tuple(module(*sample_args)) if o.requires_grad]
                torch.autograd.grad(outputs, self.parameters, [torch.ones_like(o) for o in outputs], allow_unused=True)
                del outputs
        torch.cuda.synchronize()
        self.forward, self.backward = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.forward, pool=pool, stream=stream):
            self.static_outputs = _as_tuple(module(*sample_args))
        self.differentiable = tuple(o.requires_grad for o in self.static_outputs)
        with torch.cuda.graph(self.backward, pool=pool, stream=stream):
            self.static_grad_outputs = tuple(torch.empty_like(o) for o, d in zip(self.static_outputs, self.differentiable)
                                             if d)
            self.static_grads = torch.autograd.grad([o for o, d in zip(self.static_outputs, self.differentiable) if d],
                                                    self.parameters, self.static_grad_outputs, allow_unused=True)
        self.static_outputs = tuple(o.detach() for o in self.static_outputs)  # frees the capture's autograd graph

    def __call__(self, *inputs: torch.Tensor):
        return _Replay.apply(self, len(inputs), *inputs, *self.parameters)


class _Replay(torch.autograd.Function):
    @staticmethod
    def forward(ctx, graphs: _Graphs, count: int, *inputs_and_parameters):
        ctx.graphs, ctx.count = graphs, count
        for static, given in zip(graphs.static_inputs, inputs_and_parameters[:count]):
            if static.data_ptr() != given.data_ptr():
                static.copy_(given)
        graphs.forward.replay()
        outputs = tuple(o.detach() for o in graphs.static_outputs)  # new tensors each call: autograd marks them
        ctx.mark_non_differentiable(*(o for o, d in zip(outputs, graphs.differentiable) if not d))
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        graphs = ctx.graphs
        for static, grad in zip(graphs.static_grad_outputs, (g for g, d in zip(grads, graphs.differentiable) if d)):
            if grad is None:
                static.zero_()
            elif static.data_ptr() != grad.data_ptr():
                static.copy_(grad)
        graphs.backward.replay()
        return (None, None, *[None] * ctx.count,
                *(g.detach() if g is not None else None for g in graphs.static_grads))


def _as_tuple(outputs) -> tuple:
    return tuple(outputs) if isinstance(outputs, (tuple, list)) else (outputs,)


class SharedPoolCapture:
    """``capture(module, sample_args, num_warmup_iters=3, allow_unused_input=False)`` as make_graphed_callables is
    called, returning a graphed callable; every capture of one instance on one side stream into one pool (made at the
    first capture, on the current CUDA device). ``num_warmup_iters`` eager passes on that stream precede a capture:
    the run's first capture needs them, a later shape's capture can be its first pass (nothing then runs outside the
    pool). Unused parameters get no gradient (``allow_unused_input`` is accepted for the signature's sake)."""

    def __init__(self):
        self.stream = self.pool = None

    def __call__(self, module, sample_args, num_warmup_iters: int = 3, allow_unused_input: bool = False) -> _Graphs:
        if self.stream is None:
            self.stream, self.pool = torch.cuda.Stream(), torch.cuda.graph_pool_handle()
        return _Graphs(module, tuple(sample_args), self.stream, self.pool, num_warmup_iters)
