"""A stand-in for ``--cuda-graphs``' capture on the CPU (tests/test_cuda_graphs.py, benchmarks/step_ops.py): called as
utils/trainer/graph_capture.py's SharedPoolCapture and ``torch.cuda.make_graphed_callables`` are.

It does to the model what the real capture does (warm-up iterations in training mode, which move BatchNorm's
statistics, and gradients taken with autograd.grad, not accumulated) and returns what the graphs do: the module's
outputs, and from the backward the gradients written into static buffers that it hands to autograd detached (which
a parameter without a gradient takes as it is). Inputs of another shape than the capture's are refused, as a graph
cannot take them."""
from __future__ import annotations

import contextlib

import torch

from utils.cuda_capture import CUDA_CAPTURE_LOCK


class _Replay(torch.autograd.Function):
    """One "replay": the forward computed by the module, the backward's gradients copied into the graph's static
    buffers and returned detached, as torch.cuda.make_graphed_callables' backward returns them. What it runs is the
    graph's work: ``graph.replaying`` says so meanwhile (an operation counter leaves it out)."""

    @staticmethod
    def forward(ctx, graph, count, *inputs_and_parameters):
        ctx.graph, ctx.count = graph, count
        with torch.enable_grad(), graph.replay():
            ctx.outputs = graph.module(*inputs_and_parameters[:count])
        return tuple(output.detach() for output in ctx.outputs)

    @staticmethod
    def backward(ctx, *grads):
        graph = ctx.graph
        differentiable = [(output, grad) for output, grad in zip(ctx.outputs, grads) if output.requires_grad]
        with graph.replay():
            found = torch.autograd.grad([o for o, _ in differentiable], graph.parameters,
                                        [g for _, g in differentiable], allow_unused=True)
            for static, gradient in zip(graph.static, found):
                static.copy_(gradient if gradient is not None else torch.zeros_like(static))
        return (None, None, *[None] * ctx.count, *(static.detach() for static in graph.static))


class StandInGraph:
    def __init__(self, module, sample_args):
        self.module = module
        self.shapes = [tuple(arg.shape) for arg in sample_args]  # a replay takes inputs of the captured shapes only
        self.parameters = [p for p in module.parameters() if p.requires_grad]
        self.static = [torch.zeros_like(p) for p in self.parameters]  # rewritten by every backward replay
        self.replaying = False

    @contextlib.contextmanager
    def replay(self):
        self.replaying = True
        try:
            yield
        finally:
            self.replaying = False

    def __call__(self, *inputs):
        assert [tuple(arg.shape) for arg in inputs] == self.shapes
        return _Replay.apply(self, len(inputs), *inputs, *self.parameters)


class StandInCapture:
    """make_graphed_callables' effects on the model, without a GPU: ``num_warmup_iters`` forward and backward passes
    of the sample (BatchNorm in training mode), autocast's cache state and the capture lock's seen, a StandInGraph
    returned."""

    def __init__(self):
        self.calls, self.cache_enabled, self.graphs = 0, [], []
        self.warmups = []  # num_warmup_iters of each capture
        self.locked = []  # whether the capture lock (utils/cuda_capture.py) was held at each capture

    def __call__(self, module, sample_args, num_warmup_iters=3, allow_unused_input=False):
        self.calls += 1
        self.cache_enabled.append(torch.is_autocast_cache_enabled())
        self.locked.append(CUDA_CAPTURE_LOCK.locked())
        self.warmups.append(num_warmup_iters)
        parameters = [p for p in module.parameters() if p.requires_grad]
        for _ in range(num_warmup_iters):
            outputs = module(*sample_args)
            torch.autograd.grad(sum(o.float().sum() for o in outputs if o.requires_grad), parameters,
                                allow_unused=True)
        self.graphs.append(StandInGraph(module, sample_args))
        return self.graphs[-1]
