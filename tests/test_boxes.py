import math

import numpy as np
import torch

from utils.boxes import bbox_iou, box_iou, scale_boxes, xywh2xyxy, xywhn2xyxy, xyxy2xywh, xyxy2xywhn
from utils.data.transforms import letterbox


def test_conversions_round_trip():
    xyxy = torch.tensor([[10.0, 20.0, 50.0, 80.0]])
    assert torch.equal(xyxy2xywh(xyxy), torch.tensor([[30.0, 50.0, 40.0, 60.0]]))
    assert torch.equal(xywh2xyxy(xyxy2xywh(xyxy)), xyxy)
    n = xyxy2xywhn(xyxy.numpy(), w=100, h=200)
    np.testing.assert_allclose(n, [[0.3, 0.25, 0.4, 0.3]])
    np.testing.assert_allclose(xywhn2xyxy(n, w=100, h=200, padw=5, padh=7), [[15, 27, 55, 87]])


def test_box_iou_hand_computed():
    a = torch.tensor([[0.0, 0.0, 10.0, 10.0]])
    b = torch.tensor([[5.0, 0.0, 15.0, 10.0], [20.0, 20.0, 30.0, 30.0]])
    iou = box_iou(a, b)
    assert torch.allclose(iou, torch.tensor([[50 / 150, 0.0]]), atol=1e-6)


def test_ciou_hand_computed():
    # same size boxes (square), centres 5 px apart horizontally: IoU = 50/150, v = 0
    box1 = torch.tensor([5.0, 5.0, 10.0, 10.0])
    box2 = torch.tensor([10.0, 5.0, 10.0, 10.0])
    ciou = bbox_iou(box1, box2, CIoU=True)
    enclose_diag_sq = 15 ** 2 + 10 ** 2
    expected = 50 / 150 - 25 / enclose_diag_sq
    assert math.isclose(float(ciou), expected, rel_tol=1e-5)
    assert math.isclose(float(bbox_iou(box1, box1, CIoU=True)), 1.0, rel_tol=1e-5)


def test_letterbox_and_scale_boxes_invert():
    img = np.zeros((480, 640, 3), np.uint8)
    out, ratio, pad = letterbox(img, 320, auto=False)
    assert out.shape == (320, 320, 3) and ratio == (0.5, 0.5) and pad == (0.0, 40.0)
    boxes = torch.tensor([[10.0, 50.0, 110.0, 150.0]])  # in letterboxed pixels
    back = scale_boxes(out.shape[:2], boxes.clone(), img.shape[:2])
    assert torch.allclose(back, torch.tensor([[20.0, 20.0, 220.0, 220.0]]))
