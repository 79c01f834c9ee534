"""Post-training int8 quantisation for the formats that take ``--int8`` (NCNN, ExecuTorch, LiteRT): one split of
the model, one set of calibration images, one parity check.

The model up to its Detect layer (``Body``) is quantised with PT2E static quantisation (the format's own
quantizer: int8 per-channel weights, int8 per-tensor activations); the Detect convolutions and the decode stay
float, so boxes in pixels and scores in [0, 1] never share one int8 scale (which rounds every score to zero, the
failure YOLOv5's int8 TFLite users report). The activation ranges are observed on up to CALIBRATION_IMAGES train
images of ``--data``, letterboxed exactly as detect.py letterboxes for a fixed-size export (no stride padding), so
calibration sees what inference will. (NCNN quantises its own graph, models/formats/ncnn_int8.py, on the same
images.)

The parity check of every int8 file (export.py picks it from the export's int8 flag): ``compare_detections``
runs the same post-processing as inference (utils/nms.py at detect.py's thresholds) on the PyTorch model's and the
int8 file's outputs for PARITY_IMAGES calibration images, and pairs each detection with its twin in the other
output (same class, greatest IoU, one to one): nearly all must have a twin, in both directions, and nearly all
pairs must overlap closely and keep their score. An int8 model's single outputs move by a tenth or more (8 bits
per tensor through ~20 layers; where NMS keeps a neighbouring anchor instead, a pair differs by as much), so no
bound on every output, nor on every pair, tells a correct file from a broken one; the detections as a whole,
what a user sees, do. A model with (almost) no confident detection is compared by its top-scored outputs.
"""
from __future__ import annotations

import copy
import itertools
import logging
import math
from dataclasses import dataclass

import torch
from torch import nn

from models.backends import first_line
from utils.errors import ArgumentError, UserError

LOGGER = logging.getLogger(__name__)
CALIBRATION_IMAGES = 100  # YOLOv5 calibrates its int8 TFLite on 100 train images
# The int8 parity check (compare_detections). Measured on correct int8 exports (NCNN / ExecuTorch / LiteRT) of a
# yolov5n trained 30 epochs on BCCD at 320 (mAP50 0.50), on the check's 8 images and on the 87 val images, on an
# AMD EPYC (Zen 4, family 25 model 17):
#   320: 167 detections (val 1,794): 98-100% with a twin both ways; 90% of the pairs IoU >= 0.85-0.93 and score
#        change <= 0.018-0.028; the worst single pair IoU 0.46, change 0.43 (NMS kept a neighbouring anchor)
#   640: 443 detections (val 3,843): 98-99% with a twin; 90% of the pairs IoU >= 0.81-0.87, score change <=
#        0.026-0.036; the worst single pair IoU 0.45, change 0.61
# Faults, made from its NCNN output: every box moved 200 px: 0-11% with a twin; every score cut by 40%: 90% of the
# pairs changed by up to 0.36-0.50 (objectness alone: 0.24-0.28); scores collapsed to 0: no twin. The bounds below
# leave ~0.1 of IoU and 3x of score change beyond the worst correct export. The tiny model of the tests (conftest's
# int8_trained, top confidence 0.007) takes the fallback: 100% of its 160 rows with IoU >= 0.99 and score change
# <= 0.004 of the top score; cut scores there change by 0.38-0.61 of it.
PARITY_IMAGES = 8  # calibration images the check runs (in batches of the export's batch size)
CONF_THRES, IOU_THRES, MAX_DET = 0.25, 0.45, 300  # detect.py's defaults: the detections a user sees
TWIN_IOU = 0.45  # a twin overlaps its detection at least this much (NMS's own "the same object")
TWIN_CONF = 0.1  # and scores above this: a detection at 0.3 whose twin has 0.2 moved by 0.1, it was not lost
MIN_MATCHED = 0.9  # share of the float detections with an int8 twin, and of the int8 detections with a float one
PAIR_SHARE = 0.9  # the pairs the next two bounds hold for (the rest: where NMS kept a neighbouring anchor)
MIN_IOU = 0.7  # IoU of a pair
MAX_SCORE_CHANGE = 0.1  # |confidence change| of a pair
MIN_DETECTIONS = 10  # fewer float detections than this over the images (an untrained model): the top rows instead
TOP_ROWS = 20  # per image, the outputs of highest float confidence, compared row by row (the same anchor)


class Pass(nn.Module):
    """Stands in for the Detect layer in ``Body``: its input feature maps, unchanged (``f``, ``i`` as Detect's)."""

    def __init__(self, detect: nn.Module):
        super().__init__()
        self.f, self.i = detect.f, detect.i

    def forward(self, features):
        return features


class Body(nn.Module):
    """Images -> the feature maps the Detect layer takes (a channels-first copy of the model without it).
    ``nhwc``: the images come channels-last as (batch, height, width, 3) (TFLite's layout)."""

    def __init__(self, model: nn.Module, nhwc: bool = False):
        super().__init__()
        self.model = copy.deepcopy(model).float().to(memory_format=torch.contiguous_format)
        self.model.model[-1] = Pass(model.model[-1])
        self.nhwc = nhwc

    def forward(self, images):
        return self.model(images.permute(0, 3, 1, 2) if self.nhwc else images)


def quantised_body(body: Body, example: torch.Tensor, data: str, quantizer, error: type[UserError], title: str,
                   fold_quantize: bool) -> nn.Module:
    """``body`` with int8 weights and activations (PT2E with ``quantizer``), its activation ranges observed on the
    calibration images of ``data`` at ``example``'s batch and size. ``fold_quantize``: store the weights as int8
    constants (XNNPACK's lowering takes them so) rather than float weights and their quantise op (litert-torch
    takes those). A failure raises ``error`` in one line."""
    from torchao.quantization.pt2e.quantize_pt2e import convert_pt2e, prepare_pt2e

    imgsz = tuple(example.shape[1:3] if body.nhwc else example.shape[2:])
    try:
        with torch.no_grad():
            prepared = prepare_pt2e(torch.export.export(body, (example,), strict=False).module(), quantizer)
            count = 0
            for batch in calibration_batches(data, imgsz, example.shape[0]):
                prepared(batch.permute(0, 2, 3, 1).contiguous() if body.nhwc else batch)
                count += batch.shape[0]
            LOGGER.info("%s --int8: calibrated on %d images of %s", title, count, data)
            return convert_pt2e(prepared, fold_quantize=fold_quantize)
    except UserError:
        raise
    except Exception as failure:  # torch.export and PT2E raise many types
        raise error(f"{title} int8 quantisation failed ({first_line(failure)})") from None


def calibration_files(data: str) -> list[str]:
    """Up to CALIBRATION_IMAGES train images of the dataset YAML ``data`` (in name order, as YOLOv5 takes them)."""
    from utils.data.dataset_yaml import load_data_config
    from utils.data.verify import list_image_files

    config = load_data_config(data)
    files = list_image_files(config.split("train"))[:CALIBRATION_IMAGES]
    if not files:
        raise ArgumentError(f"--data {data}: no train images to calibrate --int8 with")
    return files


def calibration_batches(data: str, imgsz: tuple, batch_size: int):
    """(batch_size, 3, h, w) batches of letterboxed calibration images, as detect.py prepares images for a fixed-
    size export (utils.inference.prepare_image, auto=False); the last batch is filled with the first images."""
    from utils.data.images import read_image
    from utils.inference import prepare_image

    files = calibration_files(data)
    files += files[:(-len(files)) % batch_size]
    for start in range(0, len(files), batch_size):
        images = [prepare_image(read_image(file), imgsz, 1, "cpu", False, auto=False)  # auto=False: no stride
                  for file in files[start:start + batch_size]]
        yield torch.cat(images)


def parity_inputs(config, shape) -> torch.Tensor:
    """What export.py's parity check feeds an int8 file: its first calibration images (int8 activation ranges hold
    for images like those it was calibrated on; uniform noise falls outside them), PARITY_IMAGES of them rounded up
    to whole batches of ``shape``'s batch size, letterboxed to its size."""
    batches = calibration_batches(config.data, tuple(shape[2:]), shape[0])
    return torch.cat(list(itertools.islice(batches, math.ceil(PARITY_IMAGES / shape[0]))))


@dataclass
class DetectionParity:
    """The int8 parity figures (compare_detections); ``ok`` within the bounds above. ``iou`` and ``score_change``
    hold for PAIR_SHARE of the pairs (the worst pair's in ``worst_iou``, ``worst_change``). ``fallback``: the float
    model had fewer than MIN_DETECTIONS detections, so its TOP_ROWS outputs per image were compared with the same
    rows of the int8 output (the score change then relative to the image's top float confidence)."""

    shape: tuple
    detections: int  # float detections (conf > CONF_THRES after NMS)
    matched: float  # share of them with an int8 twin (fallback: of the rows, with IoU >= TWIN_IOU)
    matched_back: float  # share of the int8 detections with a float twin
    iou: float  # the IoU PAIR_SHARE of the pairs reach
    score_change: float  # the |confidence change| PAIR_SHARE of the pairs stay within
    worst_iou: float = 0.0
    worst_change: float = math.inf
    fallback: bool = False
    rows: int = 0  # fallback: the outputs compared row by row
    fault: str = ""  # what was refused before any pairing (another shape, non-finite values)

    @property
    def ok(self) -> bool:
        return (not self.fault and self.matched >= MIN_MATCHED and self.matched_back >= MIN_MATCHED
                and self.iou >= MIN_IOU and self.score_change <= MAX_SCORE_CHANGE)

    def describe(self) -> str:
        shape = "x".join(str(side) for side in self.shape)
        if self.fault:
            return f"{self.fault} at {shape}"
        pairs = (f"{PAIR_SHARE:.0%} of the pairs: IoU >= {self.iou:.2f}, score change <= {self.score_change:.3f}"
                 f"{' of the top score' if self.fallback else ''} (worst {self.worst_iou:.2f}, "
                 f"{self.worst_change:.3f}); bounds {MIN_MATCHED:.0%}, {MIN_IOU}, {MAX_SCORE_CHANGE}")
        if self.fallback:
            return (f"{self.detections} detections (conf > {CONF_THRES}), fewer than {MIN_DETECTIONS}: the "
                    f"{self.rows} top-scored outputs at {shape} row by row: {self.matched:.0%} with IoU >= "
                    f"{TWIN_IOU}; {pairs}")
        return (f"{self.detections} detections (conf > {CONF_THRES}) at {shape}: {self.matched:.0%} with an int8 "
                f"twin (int8's with a float twin: {self.matched_back:.0%}); {pairs}")


def compare_detections(reference: torch.Tensor, exported: torch.Tensor, shape) -> DetectionParity:
    """An int8 file's output ``exported`` against the PyTorch model's ``reference`` (both ``(batch, N, 5 + nc)``,
    boxes in pixels) as detections: see the module docstring and DetectionParity."""
    from utils.nms import non_max_suppression

    shape = tuple(shape)
    if exported.shape != reference.shape:
        return DetectionParity(shape, 0, 0.0, 0.0, 0.0, math.inf,
                               fault=f"output of shape {list(exported.shape)}, not {list(reference.shape)}")
    if not torch.isfinite(exported).all():
        return DetectionParity(shape, 0, 0.0, 0.0, 0.0, math.inf, fault="non-finite values in the output")
    reference, exported = reference.detach().float().cpu(), exported.detach().float().cpu()

    def detections(output: torch.Tensor, conf_thres: float) -> list[torch.Tensor]:
        return non_max_suppression(output, conf_thres, IOU_THRES, max_det=MAX_DET)

    floats = detections(reference, CONF_THRES)
    count = sum(len(image) for image in floats)
    if count < MIN_DETECTIONS:
        return compare_top_rows(reference, exported, shape, count)
    forward = pair(floats, detections(exported, TWIN_CONF))
    backward = pair(detections(exported, CONF_THRES), detections(reference, TWIN_CONF))
    return figures(shape, count, share(forward), share(backward), forward[2] + backward[2], forward[3] + backward[3])


def figures(shape: tuple, count: int, matched: float, matched_back: float, ious: list, changes: list,
            **fields) -> DetectionParity:
    """A DetectionParity from the pairs' IoUs and |confidence changes| (none: nothing to vouch for the file)."""
    if not ious:
        return DetectionParity(shape, count, matched, matched_back, 0.0, math.inf, **fields)
    ious, changes = torch.tensor(ious), torch.tensor(changes)
    return DetectionParity(shape, count, matched, matched_back, float(ious.quantile(1 - PAIR_SHARE)),
                           float(changes.quantile(PAIR_SHARE)), float(ious.min()), float(changes.max()), **fields)


def pair(first: list[torch.Tensor], second: list[torch.Tensor]) -> tuple[int, int, list[float], list[float]]:
    """Twins, image by image: each detection of ``first`` (``(n, 6)`` rows of x1, y1, x2, y2, conf, class, best
    first) takes the detection of ``second`` of its class, not taken yet, that overlaps it most, if at least
    TWIN_IOU. Returns (detections in ``first``, twins found, their IoUs, their |confidence changes|)."""
    from utils.boxes import box_iou

    total, ious, changes = 0, [], []
    for mine, theirs in zip(first, second):
        total += mine.shape[0]
        if not mine.shape[0] or not theirs.shape[0]:
            continue
        overlap = box_iou(mine[:, :4], theirs[:, :4])
        overlap[mine[:, 5:6] != theirs[:, 5].unsqueeze(0)] = 0.0
        taken = torch.zeros(theirs.shape[0], dtype=torch.bool)
        for index in range(mine.shape[0]):
            candidates = overlap[index].masked_fill(taken, -1.0)
            best = int(candidates.argmax())
            if candidates[best] >= TWIN_IOU:
                taken[best] = True
                ious.append(float(candidates[best]))
                changes.append(abs(float(mine[index, 4] - theirs[best, 4])))
    return total, len(ious), ious, changes


def share(paired: tuple) -> float:
    total, found = paired[:2]
    return found / total if total else 1.0


def compare_top_rows(reference: torch.Tensor, exported: torch.Tensor, shape: tuple, count: int) -> DetectionParity:
    """The fallback for a model with fewer than MIN_DETECTIONS detections (an untrained one's scores are all small):
    each image's TOP_ROWS outputs of highest float confidence against the same rows of the int8 output (the same
    anchor at the same cell), by the IoU of their boxes and the change of the float top class's confidence relative
    to the image's top float confidence. Collapsed scores, boxes left normalised or mixed-up layouts still show."""
    from utils.boxes import box_iou, xywh2xyxy

    confidence = reference[..., 4] * reference[..., 5:].max(-1).values
    rows = confidence.topk(min(TOP_ROWS, confidence.shape[1]), dim=1).indices
    ious, changes = [], []
    for image in range(reference.shape[0]):
        mine, theirs = reference[image, rows[image]], exported[image, rows[image]]
        classes = 5 + mine[:, 5:].argmax(1, keepdim=True)
        scores = [output[:, 4] * output.gather(1, classes)[:, 0] for output in (mine, theirs)]
        top = max(float(scores[0].max()), 1e-12)
        overlap = box_iou(xywh2xyxy(mine[:, :4]), xywh2xyxy(theirs[:, :4])).diagonal()
        twins = overlap >= TWIN_IOU
        ious += overlap[twins].tolist()
        changes += ((scores[1] - scores[0]).abs()[twins] / top).tolist()
    found = len(ious) / max(rows.numel(), 1)
    return figures(shape, count, found, found, ious, changes, fallback=True, rows=rows.numel())
