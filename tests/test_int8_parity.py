"""The parity check of --int8 exports (models/formats/int8.py: compare_detections, chosen by export.compare_output
from the export's int8 flag): detections paired with their twins. On synthetic outputs built like a trained model's
(a few confident boxes, each found by several neighbouring anchors, over a background of low scores): a small
realistic int8 perturbation passes; every box moved 200 px, every score cut by 40%, collapsed scores, boxes left
normalised and outputs of another image are refused, each naming its figures; a model with no confident detection
is compared by its top outputs. Needs no optional package."""
from __future__ import annotations

import math
import re

import pytest
import torch

import export
from models.backends import ExportInfo
from models.formats import int8

SHAPE = (8, 3, 320, 320)
ROWS, NC = 6300, 3  # the outputs of a 320x320 input (3 anchors at strides 8, 16, 32), 3 classes


def synthetic_output(seed: int = 0, objects: int = 6, confident: bool = True) -> torch.Tensor:
    """(8, ROWS, 5 + NC) decoded outputs in pixels: background rows of low objectness everywhere, and per image
    ``objects`` boxes of 40-70 px on a grid, each predicted by 3 neighbouring rows (NMS keeps the best) with
    objectness 0.55-0.95 and one class at 0.95."""
    generator = torch.Generator().manual_seed(seed)
    batch, _, height, width = SHAPE
    output = torch.empty(batch, ROWS, 5 + NC)
    output[..., 0] = torch.rand(batch, ROWS, generator=generator) * width
    output[..., 1] = torch.rand(batch, ROWS, generator=generator) * height
    output[..., 2:4] = 8 + torch.rand(batch, ROWS, 2, generator=generator) * 60
    output[..., 4] = torch.rand(batch, ROWS, generator=generator) * 0.05
    output[..., 5:] = torch.rand(batch, ROWS, NC, generator=generator)
    if not confident:
        return output
    for image in range(batch):
        for number in range(objects):
            centre = torch.tensor([50.0 + 100 * (number % 3), 70.0 + 140 * (number // 3)])
            size = torch.tensor([40.0 + 6 * number, 70.0 - 5 * number])
            score = 0.55 + 0.4 * torch.rand((), generator=generator)
            for duplicate in range(3):
                row = 1000 * number + 37 * image + duplicate
                output[image, row, :2] = centre + torch.randn(2, generator=generator)
                output[image, row, 2:4] = size * (1 + 0.02 * torch.randn(2, generator=generator))
                output[image, row, 4] = score - 0.05 * duplicate
                output[image, row, 5:] = 0.05
                output[image, row, 5 + number % NC] = 0.95
    return output


def int8_like(reference: torch.Tensor, seed: int = 1, box_noise: float = 1.0,
              score_noise: float = 0.02) -> torch.Tensor:
    """``reference`` with noise like a correct int8 export's (models/formats/int8.py's measurements: half its pairs
    overlap by 0.95 or more, 90% change their score by 0.036 or less): a pixel on the boxes, 0.02 on the scores."""
    generator = torch.Generator().manual_seed(seed)
    exported = reference.clone()
    exported[..., :4] += torch.randn(reference[..., :4].shape, generator=generator) * box_noise
    exported[..., 4:] = (exported[..., 4:] + torch.randn(reference[..., 4:].shape, generator=generator)
                         * score_noise).clamp(0, 1)
    return exported


def info(**flags) -> ExportInfo:
    return ExportInfo(names=("a", "b", "c"), stride=32, imgsz=SHAPE[2:], batch=SHAPE[0], **flags)


@pytest.fixture(scope="module")
def reference():
    return synthetic_output()


def test_a_correct_int8_output_passes_with_every_detection_paired(reference):
    figure = int8.compare_detections(reference, int8_like(reference), SHAPE)
    assert figure.ok and not figure.fallback, figure.describe()
    assert figure.detections == 8 * 6 and figure.matched == 1.0 and figure.matched_back == 1.0
    assert figure.iou > 0.8 and figure.score_change < 0.15
    assert figure.describe().startswith("48 detections (conf > 0.25) at 8x3x320x320: 100% with an int8 twin")


@pytest.mark.parametrize("change, message", [
    (lambda output: output[..., 0].add_(200), r"0% with an int8 twin \(int8's with a float twin: 0%\)"),  # 200 px
    (lambda output: output[..., 4:].mul_(0.6), r"score change <= 0\.[3-9]"),  # every score cut by 40%
    (lambda output: output[..., 4].mul_(0.6), r"score change <= 0\.[2-9]"),  # every confidence cut by 40%
    (lambda output: output[..., 4:].zero_(), r"0% with an int8 twin"),  # collapsed scores
    (lambda output: output[..., :4].div_(320), r"0% with an int8 twin"),  # boxes left normalised
])
def test_shifted_boxes_cut_scores_collapsed_scores_and_normalised_boxes_are_refused(reference, change, message):
    exported = int8_like(reference)
    change(exported)
    figure = export.compare_output(reference, exported, SHAPE, info(int8=True))
    assert not figure.ok
    assert " at 8x3x320x320: " in figure.describe()
    assert figure.describe().endswith(f"; bounds {int8.MIN_MATCHED:.0%}, {int8.MIN_IOU}, {int8.MAX_SCORE_CHANGE}")
    assert re.search(message, figure.describe()), figure.describe()


def test_the_output_of_other_images_a_wrong_shape_and_non_finite_values_are_refused(reference):
    other = int8_like(synthetic_output(seed=5))
    for image in range(SHAPE[0]):  # the same objects in another order: what a mixed-up layout gives
        other[image] = int8_like(reference)[(image + 1) % SHAPE[0]]
    other[..., 0] = SHAPE[3] - other[..., 0]  # mirrored
    assert not int8.compare_detections(reference, other, SHAPE).ok
    figure = int8.compare_detections(reference, reference[:, :100], SHAPE)
    assert not figure.ok and figure.describe() == "output of shape [8, 100, 8], not [8, 6300, 8] at 8x3x320x320"
    nan = reference.clone()
    nan[0, 0, 0] = math.nan
    assert int8.compare_detections(reference, nan, SHAPE).describe() == "non-finite values in the output at 8x3x320x320"


def test_twins_just_below_the_threshold_still_count(reference):
    """Detections at 0.27 whose int8 twins score 0.24 moved by 0.03: they were not lost (twins are looked for down
    to TWIN_CONF)."""
    near = reference.clone()
    confident = near[..., 4] > 0.4
    near[..., 4] = torch.where(confident, 0.28 + 0.02 * (near[..., 4] - 0.45), near[..., 4])  # confidence 0.27
    exported = near.clone()
    exported[..., 4] -= 0.03 * confident
    figure = int8.compare_detections(near, exported, SHAPE)
    assert figure.ok and figure.detections == 48 and figure.matched == 1.0, figure.describe()
    assert figure.score_change == pytest.approx(0.0285, abs=1e-4)


def test_a_few_lost_detections_are_within_the_share(reference):
    exported = int8_like(reference)
    exported[0, [0, 1, 2], 4] = 0.0  # image 0's first object (its 3 rows) is gone: 1 of 48
    figure = int8.compare_detections(reference, exported, SHAPE)
    assert figure.ok and figure.matched == pytest.approx(47 / 48) and figure.matched_back == 1.0


def test_without_confident_detections_the_top_outputs_are_compared_row_by_row():
    """An untrained model (no score above the threshold): its TOP_ROWS highest-scored outputs per image against
    the same rows, relative to the top score: a small change passes, collapsed or cut scores and moved boxes not."""
    reference = synthetic_output(confident=False)
    figure = int8.compare_detections(reference, int8_like(reference, box_noise=0.5, score_noise=0.001), SHAPE)
    assert figure.ok and figure.fallback and figure.rows == 8 * int8.TOP_ROWS, figure.describe()
    assert figure.describe().startswith("0 detections (conf > 0.25), fewer than 10: the 160 top-scored outputs at "
                                        "8x3x320x320 row by row: 100% with IoU >= 0.45")
    for change in (lambda output: output[..., 4:].mul_(0.6), lambda output: output[..., 4:].zero_(),
                   lambda output: output[..., 0].add_(200), lambda output: output[..., :4].div_(320)):
        exported = reference.clone()
        change(exported)
        figure = int8.compare_detections(reference, exported, SHAPE)
        assert figure.fallback and not figure.ok, figure.describe()


def test_compare_output_picks_the_check_from_the_int8_flag(reference):
    """int8: detections (a correct int8 output passes though single outputs moved by far more than 1e-3 of the
    scale); fp32 and fp16 files: every output within TOLERANCE, as before."""
    exported = int8_like(reference)
    float_figure = export.compare_output(reference, exported, SHAPE, info())
    assert isinstance(float_figure, export.Parity) and not float_figure.ok
    assert float_figure.score_limit == export.TOLERANCE[torch.float32]
    half = export.compare_output(reference, reference, SHAPE, info(half=True))
    assert half.ok and half.score_limit == export.TOLERANCE[torch.float16]
    figure = export.compare_output(reference, exported, SHAPE, info(int8=True))
    assert isinstance(figure, int8.DetectionParity) and figure.ok
