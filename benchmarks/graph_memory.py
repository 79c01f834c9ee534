"""Peak GPU memory of a training step replayed as CUDA graphs when an epoch's last batch is smaller: what
``--cuda-graphs`` costs against eager training, and what its capture of the last batch's shape into the same pool saves.

    python benchmarks/graph_memory.py [--cfg models/yolov5s.yaml] [--imgsz 640] [--batch-size 64] [--last 40]
        [--device cuda:0] [--json]

Why: the graphs keep a memory pool of their own (a step's activations), and a batch of another shape runs the model
eagerly beside it, in the ordinary allocator: BCCD x8 (1,640 images) at batch 64 ends each epoch with 40 images,
which may cost ~1.6x the eager run's peak (issue 48 allows 1.1x). Capturing that shape into the same pool would
reuse the pool's memory, but only on the stream the pool's blocks were freed on (the caching allocator reuses a
freed block on its own stream), and ``torch.cuda.make_graphed_callables`` captures each call on a new stream.
This measured the reason for a capture of the project's own (STYLE.md: a second implementation needs one) and keeps
measuring it, four ways on the GPU:

- ``eager``: 3 steps of the full batch, then one of the last (a run without ``--cuda-graphs``);
- ``graphs, last batch eager``: ``make_graphed_callables`` at the full batch (3 warm-up passes), 3 replays, then
  the last batch eagerly (``--cuda-graphs`` until 2026-11-28);
- ``graphs, last batch by a second make_graphed_callables``: the last shape graphed by a second call into the first
  call's pool (with its own warm-up passes and its own stream);
- ``one stream and pool``: both shapes captured on one side stream into one pool, the full batch after 3 warm-up
  passes and the last batch with none (its capture is its first pass, so nothing runs outside the pool). Since the
  2026-11-28 H200 lease measured this way at 1.04x eager's peak (a sketch of it here then), it is ``--cuda-graphs``'
  own capture, utils/trainer/graph_capture.py, which this case now runs. It also checks that the last batch's
  replayed gradients equal an eager pass's.

Each case runs in a process of its own, so the allocator's peak starts from nothing. The step is the model's forward
and backward under fp16 autocast (its weight cache off, as graphs need), channels_last, BatchNorm in training mode,
on random images; the loss is the mean of the outputs (the optimizer and the real loss add the same to every case).
After the step's peak is read, each case runs a validation pass (eval mode, no gradients, fp16, twice the batch as
YOLOv5 validates during training): the graphs' pool stays reserved meanwhile, which eager training's cache would have
lent to it. A case prints ``RESULT {json}``; the parent prints a row each (``--json``: one JSON object with all).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 3  # make_graphed_callables' default, and the first capture's here
GIB = 1024 ** 3
CASES = ("eager", "graphs, last batch eager", "graphs, last batch by a second make_graphed_callables",
         "one stream and pool")


class Bench:
    """One case's model, step and batches (see the module docstring)."""

    def __init__(self, args):
        sys.path.insert(0, str(ROOT))
        from models.yolo import DetectionModel

        self.args, self.device = args, torch.device(args.device)
        self.model = model = DetectionModel(args.cfg, nc=80).to(self.device).to(memory_format=torch.channels_last)
        model.train()

        class Step(nn.Module):  # the model's forward under autocast, reduced to a scalar to differentiate
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, images):
                with torch.autocast("cuda", dtype=torch.float16, cache_enabled=False):
                    return sum(p.float().mean() for p in self.model(images))

        self.Step = Step
        self.plain = Step()  # the eager step (make_graphed_callables replaces the forward of the wrapper it is given)
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.generator = torch.Generator(device=self.device).manual_seed(0)
        self.full, self.last = self.images(args.batch_size), self.images(args.last)

    def images(self, batch: int):
        return torch.rand(batch, 3, self.args.imgsz, self.args.imgsz, device=self.device,
                          generator=self.generator).contiguous(memory_format=torch.channels_last)

    def backward_and_clear(self, output) -> None:
        output.backward()
        for p in self.params:
            p.grad = None

    def eager(self, result: dict) -> None:
        for _ in range(3):
            self.backward_and_clear(self.plain(self.full))
        result["before last"] = peak_reserved()
        self.backward_and_clear(self.plain(self.last))

    def graphed(self, result: dict, second_call: bool) -> None:
        """make_graphed_callables at the full batch; the last batch eagerly, or graphed by a second call (one pool)."""
        pool = torch.cuda.graph_pool_handle()
        graphed = torch.cuda.make_graphed_callables(self.Step(), (self.full.clone(),), num_warmup_iters=WARMUP,
                                                    pool=pool)
        for _ in range(3):
            self.backward_and_clear(graphed(self.full))
        result["before last"] = peak_reserved()
        if not second_call:
            self.backward_and_clear(self.plain(self.last))  # as GraphedModel runs a batch of another shape
            return
        second = torch.cuda.make_graphed_callables(self.Step(), (self.last.clone(),), num_warmup_iters=WARMUP,
                                                   pool=pool)
        self.backward_and_clear(second(self.last))

    def one_pool(self, result: dict) -> list:
        """Both shapes captured by ``--cuda-graphs``' own capture (utils/trainer/graph_capture.py: one stream, one pool),
        the last batch without warm-up passes; its replayed gradients (the static buffers, as a parameter takes them)."""
        from utils.trainer.graph_capture import SharedPoolCapture

        capture = SharedPoolCapture()
        graphed = capture(self.Step(), (self.full.clone(),), num_warmup_iters=WARMUP)
        for _ in range(3):
            self.backward_and_clear(graphed(self.full)[0])
        result["before last"] = peak_reserved()
        last = capture(self.Step(), (self.last.clone(),), num_warmup_iters=0)
        last(self.last)[0].backward()
        grads = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        return grads

    def validation_pass(self) -> None:
        """After the epoch (YOLOv5 validates at twice the batch): eval mode, fp16, no gradients."""
        self.model.eval()
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16):
            self.model(self.images(self.args.val_batch or 2 * self.args.batch_size).half())
        self.model.train()

    def gradient_difference(self, grads: list) -> float:
        """The largest relative difference between ``grads`` (replayed) and an eager pass's on the last batch."""
        replayed = [g.detach().clone() for g in grads]
        expected = torch.autograd.grad(self.plain(self.last), self.params)
        return max(float((a - b).norm() / b.norm().clamp(min=1e-12)) for a, b in zip(replayed, expected))


def peak_reserved() -> float:
    torch.cuda.synchronize()
    return torch.cuda.max_memory_reserved() / GIB


def run_case(case: str, args) -> dict:
    bench = Bench(args)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    result, grads = {"case": case}, None
    if case == "eager":
        bench.eager(result)
    elif case == "one stream and pool":
        grads = bench.one_pool(result)
    else:
        bench.graphed(result, second_call=case != "graphs, last batch eager")
    result.update({"peak reserved": peak_reserved(), "peak allocated": torch.cuda.max_memory_allocated() / GIB,
                   "reserved at the end": torch.cuda.memory_reserved() / GIB, "seconds": time.perf_counter() - start})
    bench.validation_pass()
    result["peak with validation"] = peak_reserved()
    if grads is not None:  # after the peaks are read: an eager pass of the last batch to compare the replay with
        result["last batch gradients, largest relative difference"] = bench.gradient_difference(grads)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cfg", default=str(ROOT / "models" / "yolov5s.yaml"))
    parser.add_argument("--imgsz", type=int, default=640)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--last", type=int, default=40, help="the last batch's images (BCCD x8 at 64: 40)")
    parser.add_argument("--val-batch", type=int, default=0, help="the validation pass's images (0: twice the batch)")
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--case", choices=CASES, help=argparse.SUPPRESS)  # one case, in this process
    parser.add_argument("--json", action="store_true", help="print one JSON object with every case")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_memory.py: error: needs a CUDA device (CUDA graphs); torch.cuda.is_available() is False",
              file=sys.stderr)
        return 2
    if args.case:
        print("RESULT " + json.dumps(run_case(args.case, args)), flush=True)
        return 0
    results = []
    for case in CASES:
        command = [sys.executable, __file__, "--case", case, "--cfg", args.cfg, "--imgsz", str(args.imgsz),
                   "--batch-size", str(args.batch_size), "--last", str(args.last), "--val-batch", str(args.val_batch),
                   "--device", args.device]
        done = subprocess.run(command, capture_output=True, text=True)
        found = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        if done.returncode or not found:
            tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
            results.append({"case": case, "error": f"exit status {done.returncode}: {tail[:300]}"})
        else:
            results.append(json.loads(found[-1][len("RESULT "):]))
    eager = next((r for r in results if r["case"] == "eager" and "peak reserved" in r), None)
    for result in results:
        if eager and "peak reserved" in result:
            result["x eager"] = result["peak reserved"] / eager["peak reserved"]
            result["x eager with validation"] = result["peak with validation"] / eager["peak with validation"]
    if args.json:
        print(json.dumps({"device": torch.cuda.get_device_name(), "batch": args.batch_size, "last": args.last,
                          "imgsz": args.imgsz, "cfg": Path(args.cfg).name, "cases": results}))
        return 0
    print(f"{torch.cuda.get_device_name()}, {Path(args.cfg).name}, {args.imgsz} px, batch {args.batch_size}, "
          f"last batch {args.last}; GiB")
    for result in results:
        if "error" in result:
            print(f"{result['case']}: {result['error']}")
            continue
        extra = result.get("last batch gradients, largest relative difference")
        print(f"{result['case']}: peak reserved {result['peak reserved']:.2f} ({result.get('x eager', 0):.2f}x eager), "
              f"before the last batch {result['before last']:.2f}, allocated peak {result['peak allocated']:.2f}, "
              f"with a validation pass {result['peak with validation']:.2f} "
              f"({result.get('x eager with validation', 0):.2f}x eager's)"
              + (f"; last batch's gradients within {extra:.1e} of eager" if extra is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
