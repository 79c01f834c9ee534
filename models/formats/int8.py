"""Post-training int8 quantisation for the formats that take ``--int8`` (LiteRT, ExecuTorch): one split of the
model, one set of calibration images, one parity tolerance.

The model up to its Detect layer (``Body``) is quantised with PT2E static quantisation (the format's own
quantizer: int8 per-channel weights, int8 per-tensor activations); the Detect convolutions and the decode stay
float, so boxes in pixels and scores in [0, 1] never share one int8 scale (which rounds every score to zero, the
failure YOLOv5's int8 TFLite users report). The activation ranges are observed on up to CALIBRATION_IMAGES train
images of ``--data``, letterboxed exactly as detect.py letterboxes for a fixed-size export (no stride padding), so
calibration sees what inference will.
"""
from __future__ import annotations

import copy
import logging

import torch
from torch import nn

from models.backends import first_line
from utils.errors import ArgumentError, UserError

LOGGER = logging.getLogger(__name__)
CALIBRATION_IMAGES = 100  # YOLOv5 calibrates its int8 TFLite on 100 train images
# Largest |int8 - PyTorch| (as export.TOLERANCE: a fraction of the input's longest side for the boxes, absolute
# for the scores), checked on calibration images. int8 activations keep 8 bits per tensor through ~20 layers,
# so single outputs move by a tenth or more while their mean moves by ~0.01 (a mAP change is the real measure):
# on a BCCD-trained yolov5n the largest score change was 0.11-0.14 (LiteRT, ExecuTorch) and 0.11 (NCNN) at the
# 320 it was trained at, and up to 0.34 for NCNN at 640 (mean 0.009; its mAP50-95 fell by 0.006 there). The
# faults this catches move outputs by far more: collapsed scores (~1 to 0), boxes left normalised (the whole
# side), NHWC/NCHW mixed up (noise).
INT8_TOLERANCE = 0.4


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


def parity_inputs(config, shape) -> torch.Tensor | None:
    """What export.py's parity check feeds an int8 file: its first calibration images (int8 activation ranges
    hold for images like those it was calibrated on; uniform noise falls outside them); None: the usual noise."""
    if not config.int8:
        return None
    return next(calibration_batches(config.data, tuple(shape[2:]), shape[0]))
