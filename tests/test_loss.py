"""utils/loss.py against hand-computed cases on a fake detection head (no models/ dependency)."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from utils.boxes import bbox_iou
from utils.config import Hyp
from utils.loss import DetectionLoss, FocalLoss, loss_gains, objectness_target, smooth_bce_targets

LOG2 = math.log(2.0)


class FakeDetect(nn.Module):
    def __init__(self, anchors, strides, nc):
        super().__init__()
        self.register_buffer("anchors", torch.tensor(anchors, dtype=torch.float32))
        self.nl, self.na = self.anchors.shape[:2]
        self.nc, self.no = nc, nc + 5
        self.stride = torch.tensor(strides, dtype=torch.float32)


class FakeModel(nn.Module):
    def __init__(self, anchors, strides=(8,), nc=2):
        super().__init__()
        self.model = nn.Sequential(FakeDetect(anchors, strides, nc))


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def cells(indices) -> list[tuple[int, int, int, int]]:
    """(b, a, gj, gi) per match, in match order."""
    return [tuple(int(v) for v in row) for row in zip(*indices)]


def make_preds(batch, anchors_per_level, grids, nc):
    return [torch.zeros(batch, anchors_per_level, g, g, 5 + nc) for g in grids]


# Level 0: 8x8 grid (stride 8 on a 64 px image); level 1: 4x4 grid (stride 16).
ANCHORS = [[[1, 1], [2, 1], [8, 4]], [[1, 1], [4, 4], [0.5, 0.5]]]


def test_target_lands_in_centre_and_two_nearest_neighbours():
    loss = DetectionLoss(FakeModel(ANCHORS, (8, 16)), Hyp())
    # Level 0: centre (2.4, 4.4), size (2, 1) grid units. Level 1: centre (1.2, 2.2), size (1, 0.5).
    targets = torch.tensor([[0, 1, 0.3, 0.55, 0.25, 0.125]])
    classes, boxes, indices, anchors = loss.build_targets(make_preds(1, 3, (8, 4), 2), targets)
    # Anchor (8, 4): ratios 0.25 and 0.25 -> max(r, 1/r) = 4, not < anchor_t=4 -> rejected.
    # Fractions 0.4 < 0.5 and x, y > 1 -> left (gi 1) and up (gj 3) neighbours; order: offset, anchor.
    assert cells(indices[0]) == [(0, 0, 4, 2), (0, 1, 4, 2), (0, 0, 4, 1), (0, 1, 4, 1), (0, 0, 3, 2), (0, 1, 3, 2)]
    expected_boxes = torch.tensor([[0.4, 0.4, 2, 1]] * 2 + [[1.4, 0.4, 2, 1]] * 2 + [[0.4, 1.4, 2, 1]] * 2)
    assert torch.allclose(boxes[0], expected_boxes, atol=1e-5)
    assert torch.equal(anchors[0], torch.tensor([[1.0, 1], [2, 1]] * 3))
    assert classes[0].tolist() == [1] * 6
    # Level 1: anchor (4, 4) has h ratio 1/8 -> rejected; anchors 0 and 2 kept; fractions 0.2 -> left, up.
    assert sorted(cells(indices[1])) == sorted(
        [(0, a, gj, gi) for a in (0, 2) for gj, gi in ((2, 1), (2, 0), (1, 1))])


def test_right_down_neighbours_and_grid_edges():
    loss = DetectionLoss(FakeModel([[[1, 1]]]), Hyp())
    targets = torch.tensor([
        [1, 0, 5.7 / 8, 3.6 / 8, 0.125, 0.125],  # fractions 0.7, 0.6 -> right (gi 6) and down (gj 4)
        [0, 0, 0.4 / 8, 7.6 / 8, 0.125, 0.125],  # x=0.4: frac < 0.5 but x <= 1 -> no left; y=7.6 -> no down (edge)
        [0, 0, 1.5 / 8, 2.5 / 8, 0.125, 0.125],  # exactly mid-cell -> centre only
    ])
    _, _, indices, _ = loss.build_targets(make_preds(2, 1, (8,), 2), targets)
    assert sorted(cells(indices[0])) == sorted([(1, 0, 3, 5), (1, 0, 3, 6), (1, 0, 4, 5), (0, 0, 7, 0), (0, 0, 2, 1)])


def test_anchor_ratio_threshold_is_strict_and_configurable():
    anchors = [[[8, 4]]]
    targets = torch.tensor([[0, 0, 0.3, 0.55, 0.25, 0.125]])  # size (2, 1) on the 8x8 grid: ratio exactly 4
    preds = make_preds(1, 1, (8,), 2)
    _, _, indices, _ = DetectionLoss(FakeModel(anchors), Hyp()).build_targets(preds, targets)
    assert indices[0][0].numel() == 0
    _, _, indices, _ = DetectionLoss(FakeModel(anchors), Hyp(anchor_t=4.01)).build_targets(preds, targets)
    assert indices[0][0].numel() == 3  # centre, left, up


def single_cell_case(hyp=None, label_smoothing=0.0):
    """One 4x4 level, one anchor (1, 1), one target exactly mid-cell (1, 1): centre cell only."""
    loss = DetectionLoss(FakeModel([[[1, 1]]], nc=2), hyp or Hyp(), imgsz=32, label_smoothing=label_smoothing)
    targets = torch.tensor([[0, 0, 1.5 / 4, 1.5 / 4, 0.25, 0.25]])
    preds = make_preds(2, 1, (4,), 2)  # image 1 has no targets: loss still scales by batch size 2
    return loss, preds, targets


def test_perfect_box_gives_zero_box_loss_and_obj_target_one():
    loss, preds, targets = single_cell_case()
    # zero logits decode to xy = 0.5 (mid-cell), wh = (2 * 0.5)^2 * 1 = 1: exactly the target
    total, items = loss(preds, targets)
    assert items[0].item() == pytest.approx(0.0, abs=1e-6)
    _, _, indices, _ = loss.build_targets(preds, targets)
    assert cells(indices[0]) == [(0, 0, 1, 1)]


def test_hand_computed_ciou_objectness_and_class_losses():
    hyp = Hyp()
    loss, preds, targets = single_cell_case(hyp, label_smoothing=0.1)
    cell = preds[0][0, 0, 1, 1]
    cell[0] = math.log(3.0)  # sigmoid 0.75 -> x = 2 * 0.75 - 0.5 = 1.0 (target x 0.5)
    cell[4] = 2.0  # objectness logit at the matched cell; all other cells 0
    cell[5], cell[6] = 1.0, -1.0  # class logits, target class 0
    preds[0].requires_grad_(True)
    total, items = loss(preds, targets)

    # boxes (1.0, 0.5, 1, 1) vs (0.5, 0.5, 1, 1): iou 0.5/1.5, enclosing 1.5 x 1, centre distance 0.5
    ciou = 1 / 3 - 0.25 / (1.5 ** 2 + 1)
    box_gain, obj_gain, cls_gain = loss_gains(hyp, 1, 2, 32)
    assert (box_gain, obj_gain, cls_gain) == pytest.approx((0.15, 3 / 400, 0.0375))
    assert items[0].item() == pytest.approx((1 - ciou) * box_gain, rel=1e-5)
    # BCE(x, t) = softplus(x) - t * x; objectness target at the match = iou = ciou; 32 cells (2 images)
    obj_bce = (31 * LOG2 + softplus(2.0) - ciou * 2.0) / 32
    assert items[1].item() == pytest.approx(obj_bce * 4.0 * obj_gain, rel=1e-5)  # balance 4.0 for one level
    positive, negative = 0.95, 0.05  # label smoothing 0.1
    cls_bce = ((softplus(1.0) - positive * 1.0) + (softplus(-1.0) - negative * -1.0)) / 2
    assert items[2].item() == pytest.approx(cls_bce * cls_gain, rel=1e-5)
    assert total.shape == (1,)
    assert total.item() == pytest.approx(items.sum().item() * 2, rel=1e-6)
    total.backward()
    assert preds[0].grad[0, 0, 1, 1, [0, 2, 3, 4, 5, 6]].abs().min() > 0  # y is exact: zero gradient


def test_objectness_target_is_clamped_iou_and_last_duplicate_wins():
    indices = tuple(torch.tensor(v) for v in ([0, 0, 1], [0, 0, 0], [1, 1, 0], [2, 2, 3]))
    iou = torch.tensor([0.3, 0.8, 0.6])
    target = objectness_target((2, 1, 2, 4), indices, iou)
    assert target[0, 0, 1, 2].item() == pytest.approx(0.8)  # two matches share this cell: the later one
    assert target[1, 0, 0, 3].item() == pytest.approx(0.6)
    assert target.sum().item() == pytest.approx(1.4)
    # the loss passes the detached IoU clamped at 0: a negative CIoU gives target 0 not a negative value
    loss, preds, targets = single_cell_case()
    preds[0][0, 0, 1, 1, :4] = torch.tensor([8.0, 8.0, -8.0, -8.0])  # tiny box 1 cell away -> CIoU < 0
    preds[0][0, 0, 1, 1, 4] = 2.0
    xy = preds[0][0, 0, 1, 1, :2].sigmoid() * 2 - 0.5
    wh = (preds[0][0, 0, 1, 1, 2:4].sigmoid() * 2) ** 2
    assert bbox_iou(torch.cat((xy, wh)), torch.tensor([0.5, 0.5, 1, 1]), CIoU=True).item() < -0.1
    obj_bce = (31 * LOG2 + softplus(2.0)) / 32  # target 0 at the match: BCE(2, 0) = softplus(2)
    assert loss(preds, targets)[1][1].item() == pytest.approx(obj_bce * 4.0 * loss.obj_gain, rel=1e-5)


def test_single_class_has_no_class_loss_and_empty_targets_only_objectness():
    loss = DetectionLoss(FakeModel([[[1, 1]]], nc=1), Hyp(), imgsz=32)
    preds = [torch.randn(2, 1, 4, 4, 6)]
    _, items = loss(preds, torch.tensor([[0, 0, 0.4, 0.4, 0.25, 0.25]]))
    assert items[0] > 0 and items[2] == 0
    loss = DetectionLoss(FakeModel(ANCHORS, (8, 16), nc=3), Hyp(), imgsz=64)
    preds = [torch.randn(2, 3, 8, 8, 8), torch.randn(2, 3, 4, 4, 8)]
    total, items = loss(preds, torch.zeros(0, 6))
    assert items[0] == 0 and items[2] == 0 and items[1] > 0
    assert total.item() == pytest.approx(items[1].item() * 2, rel=1e-6)


def test_label_smoothing_targets():
    assert smooth_bce_targets(0.0) == (1.0, 0.0)
    assert smooth_bce_targets(0.1) == pytest.approx((0.95, 0.05))
    loss, preds, _ = single_cell_case(label_smoothing=0.2)
    target = loss.class_targets(torch.zeros(3, 2), torch.tensor([0, 1, 1]))
    assert torch.allclose(target, torch.tensor([[0.9, 0.1], [0.1, 0.9], [0.1, 0.9]]))


@pytest.mark.parametrize("smoothing", [0.0, 0.1, 0.3])
def test_class_targets_equal_the_indexed_write_to_the_bit(smoothing):
    """class_targets builds the smoothed one-hot targets by a comparison (an indexed write of a number waits for the
    device on CUDA); the values are those of the indexed write, for any classes, none included."""
    loss, _, _ = single_cell_case(label_smoothing=smoothing)
    generator = torch.Generator().manual_seed(3)
    for rows, classes in ((0, 2), (1, 1), (7, 5), (40, 80)):
        picked = torch.randint(0, classes, (rows,), generator=generator)
        logits = torch.randn(rows, classes, generator=generator)
        expected = torch.full_like(logits, loss.cls_negative)
        expected[torch.arange(rows), picked] = loss.cls_positive
        target = loss.class_targets(logits, picked)
        assert target.dtype == logits.dtype and target.shape == (rows, classes)
        assert torch.equal(target, expected)


def test_focal_loss_matches_formula_and_replaces_bce_when_gamma_positive():
    pred, true = torch.tensor([2.0, -1.0]), torch.tensor([1.0, 0.0])
    focal = FocalLoss(nn.BCEWithLogitsLoss(), gamma=2.0, alpha=0.25)
    p0, p1 = 1 / (1 + math.exp(-2.0)), 1 / (1 + math.exp(1.0))
    expected = (softplus(-2.0) * 0.25 * (1 - p0) ** 2 + softplus(-1.0) * 0.75 * p1 ** 2) / 2
    assert focal(pred, true).item() == pytest.approx(expected, rel=1e-5)

    plain, preds, targets = single_cell_case(Hyp())
    focused, _, _ = single_cell_case(Hyp(fl_gamma=2.0))
    assert isinstance(focused.obj_loss, FocalLoss) and not isinstance(plain.obj_loss, FocalLoss)
    # all-zero logits: p_t = 0.5, so each element is BCE(=log 2) * alpha_t * 0.25
    _, items = focused(preds, targets)
    obj_target = objectness_target((2, 1, 4, 4), tuple(torch.tensor([v]) for v in (0, 0, 1, 1)), torch.tensor([1.0]))
    alpha_t = obj_target * 0.25 + (1 - obj_target) * 0.75
    assert items[1].item() == pytest.approx((LOG2 * alpha_t * 0.25).mean().item() * 4.0 * focused.obj_gain, rel=1e-5)


def test_gains_for_three_and_four_levels():
    hyp = Hyp(box=0.05, obj=1.0, cls=0.5)
    assert loss_gains(hyp, 3, 80, 640) == pytest.approx((0.05, 1.0, 0.5))
    assert loss_gains(hyp, 4, 3, 320) == pytest.approx((0.0375, 0.1875, 0.5 * 3 / 80 * 0.75))
    loss = DetectionLoss(FakeModel([[[1, 1]]] * 4, (8, 16, 32, 64)), hyp)
    assert loss.balance == (4.0, 1.0, 0.25, 0.06)
    assert DetectionLoss(FakeModel(ANCHORS + [[[1, 1]] * 3], (8, 16, 32)), hyp).balance == (4.0, 1.0, 0.4)


def test_autocast_bf16_predictions_give_float32_loss():
    loss = DetectionLoss(FakeModel(ANCHORS, (8, 16), nc=3), Hyp(), imgsz=64)
    torch.manual_seed(0)
    preds = [torch.randn(2, 3, 8, 8, 8), torch.randn(2, 3, 4, 4, 8)]
    targets = torch.tensor([[0, 1, 0.3, 0.55, 0.25, 0.125], [1, 2, 0.7, 0.2, 0.1, 0.3]])
    reference, _ = loss([p.bfloat16().float() for p in preds], targets)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        total, items = loss([p.bfloat16() for p in preds], targets)
    assert total.dtype == torch.float32 and items.dtype == torch.float32
    assert total.item() == pytest.approx(reference.item(), rel=1e-6)


def reference_matches(targets, anchors, grid, anchor_t):
    """Plain-loop statement of the matching rule, for cross-checking the vectorised one."""
    found = []
    for offset, (dx, dy) in enumerate(((0, 0), (1, 0), (0, 1), (-1, 0), (0, -1))):
        for a, (aw, ah) in enumerate(anchors):
            for image, _, cx, cy, w, h in targets.tolist():
                x, y, w, h = cx * grid, cy * grid, w * grid, h * grid
                if max(w / aw, aw / w, h / ah, ah / h) >= anchor_t:
                    continue
                wanted = {(0, 0): True,
                          (1, 0): x % 1 < 0.5 and x > 1, (0, 1): y % 1 < 0.5 and y > 1,
                          (-1, 0): (grid - x) % 1 < 0.5 and grid - x > 1,
                          (0, -1): (grid - y) % 1 < 0.5 and grid - y > 1}[(dx, dy)]
                if wanted:
                    gi = min(max(int(x - dx * 0.5), 0), grid - 1)
                    gj = min(max(int(y - dy * 0.5), 0), grid - 1)
                    found.append((int(image), a, gj, gi))
    return found


def test_vectorised_matching_equals_plain_loop_on_random_targets():
    generator = torch.Generator().manual_seed(1)
    n = 40
    targets = torch.cat((torch.randint(0, 3, (n, 1), generator=generator).float(),
                         torch.randint(0, 2, (n, 1), generator=generator).float(),
                         torch.rand(n, 2, generator=generator),
                         torch.rand(n, 2, generator=generator) * 0.5 + 0.01), 1)
    loss = DetectionLoss(FakeModel(ANCHORS, (8, 16)), Hyp())
    _, _, indices, _ = loss.build_targets(make_preds(3, 3, (8, 4), 2), targets)
    for level, grid in enumerate((8, 4)):
        expected = reference_matches(targets, ANCHORS[level], grid, 4.0)
        assert cells(indices[level]) == expected
        assert len(expected) > n  # neighbours were added


# ---------------------------------------------------------------- the fixed-shape form (CUDA with deferred checks)
def random_case(seed: int, n: int, nc: int = 3, batch: int = 3, crowded: bool = False, grids=(8, 4)):
    generator = torch.Generator().manual_seed(seed)
    preds = [torch.randn(batch, 3, g, g, 5 + nc, generator=generator).requires_grad_() for g in grids]
    centres = torch.rand(n, 2, generator=generator)
    if crowded:  # many targets in one cell: the objectness target's last-wins rule decides
        centres = 0.30 + 0.01 * centres
    targets = torch.cat((torch.randint(0, batch, (n, 1), generator=generator).float(),
                         torch.randint(0, nc, (n, 1), generator=generator).float(), centres,
                         torch.rand(n, 2, generator=generator) * 0.6 + 0.01), 1)
    return preds, targets


def loss_and_grads(compute, preds, targets):
    for p in preds:
        p.grad = None
    total, items = compute(preds, targets)
    total.backward()
    return total.detach(), items, [p.grad.clone() for p in preds]


# Three levels as the real heads have (8x8, 4x4, 2x2 on a 64 px image), with YOLOv5's objectness balance for them.
ANCHORS_3 = ANCHORS + [[[2, 2], [1, 0.5], [0.6, 1.4]]]


@pytest.mark.parametrize("n, nc, crowded, hyp, smoothing, levels", [
    (40, 3, False, {}, 0.0, 2), (25, 3, True, {}, 0.1, 2), (0, 3, False, {}, 0.0, 2), (1, 1, False, {}, 0.0, 2),
    (30, 4, False, {"fl_gamma": 1.5}, 0.0, 2), (30, 2, False, {"anchor_t": 2.0}, 0.0, 2), (50, 3, False, {}, 0.0, 3),
    (20, 1, True, {}, 0.05, 3)])
def test_the_fixed_shape_loss_equals_the_compact_one(n, nc, crowded, hyp, smoothing, levels):
    anchors, strides, grids = (ANCHORS, (8, 16), (8, 4)) if levels == 2 else (ANCHORS_3, (8, 16, 32), (8, 4, 2))
    model = FakeModel(anchors, strides, nc=nc)
    compact = DetectionLoss(model, Hyp(**hyp), imgsz=64, label_smoothing=smoothing)
    fixed = DetectionLoss(model, Hyp(**hyp), imgsz=64, label_smoothing=smoothing, fixed_shapes=True)
    preds, targets = random_case(n, n, nc, crowded=crowded, grids=grids)
    a_total, a_items, a_grads = loss_and_grads(compact, preds, targets)
    b_total, b_items, b_grads = loss_and_grads(fixed, preds, targets)
    if n:
        assert a_items[0] > 0 and (nc == 1 or a_items[2] > 0)  # matches on every term: the comparison means something
    assert torch.allclose(a_total, b_total, rtol=1e-6, atol=0) and torch.allclose(a_items, b_items, rtol=1e-5, atol=0)
    for a, b in zip(a_grads, b_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-9)


def test_the_fixed_shape_candidates_keep_build_targets_matches_in_order():
    loss = DetectionLoss(FakeModel(ANCHORS, (8, 16)), Hyp())
    preds, targets = random_case(3, 40, nc=2)
    classes, boxes, indices, anchors = loss.build_targets(preds, targets)
    cls, box, index, anchor, valid = loss.build_candidates(preds, targets)
    assert valid.shape == (2, 5 * 3 * 40)  # (levels, candidates)
    for level in range(2):
        keep = valid[level]
        assert torch.equal(cls[level][keep], classes[level]) and torch.equal(box[level][keep], boxes[level])
        assert all(torch.equal(i[level][keep], j) for i, j in zip(index, indices[level]))
        assert torch.equal(anchor[level][keep], anchors[level])
    assert torch.isfinite(box).all()  # invalid candidates hold a harmless box


def test_the_fixed_shape_objectness_target_is_the_compact_one_to_the_bit():
    from utils.loss import objectness_target_fixed

    loss = DetectionLoss(FakeModel(ANCHORS, (8, 16)), Hyp())
    preds, targets = random_case(5, 30, nc=2, crowded=True)
    _, _, indices, _ = loss.build_targets(preds, targets)
    _, _, (b, a, gj, gi), _, valid = loss.build_candidates(preds, targets)
    for level, pred in enumerate(preds):
        shape = pred.shape[:4]
        cell = ((b[level] * shape[1] + a[level]) * shape[2] + gj[level]) * shape[3] + gi[level]
        iou = torch.rand(valid.shape[1], generator=torch.Generator().manual_seed(level))
        expected = objectness_target(shape, indices[level], iou[valid[level]])
        assert len(set(cells(indices[level]))) < valid[level].sum()  # duplicates: the last one must win
        target = objectness_target_fixed(math.prod(shape), cell, iou, valid[level])
        assert torch.equal(target.view(shape), expected)


def test_the_fixed_shape_loss_shares_counts_over_processes_on_the_device():
    """Two processes' halves of a batch, their counts summed by an in-place reducer standing for the all-reduce,
    give the compact form's shares (which sums through a returned tensor)."""
    model = FakeModel(ANCHORS, (8, 16), nc=3)
    preds, targets = random_case(7, 30, nc=3, batch=4)
    other = DetectionLoss(model, Hyp(), imgsz=64, fixed_shapes=True)
    other_counts = torch.cat((other.build_candidates(preds, targets)[-1].sum(-1), torch.tensor([4]))).double()

    def in_place(counts):
        counts += other_counts  # the other process had the same batch
        return counts

    def returned(counts):
        return counts + other_counts

    compact = DetectionLoss(model, Hyp(), imgsz=64, world_size=2, reduce_counts=returned)
    fixed = DetectionLoss(model, Hyp(), imgsz=64, world_size=2, reduce_counts=in_place, fixed_shapes=True)
    a_total, a_items, _ = loss_and_grads(compact, preds, targets)
    b_total, b_items, _ = loss_and_grads(fixed, preds, targets)
    assert torch.allclose(a_total, b_total, rtol=1e-6) and torch.allclose(a_items, b_items, rtol=1e-5)


def test_loss_ops_counts_both_forms_and_the_fixed_one_runs_fewer_operations():
    """benchmarks/loss_ops.py (gpu_check.py's loss_ops step) on a tiny yolov5n head: both forms' rows as gpu_check
    reads them, the same loss, and all levels at once in fewer operations than the compact form's per-level loop."""
    import subprocess
    import sys
    from pathlib import Path

    from benchmarks.gpu_check import LOSS_OPS_ROW

    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(root / "benchmarks" / "loss_ops.py"), "--cfg",
                           str(root / "models" / "yolov5n.yaml"), "--imgsz", "64", "--batch-size", "2", "--nc", "3",
                           "--rounds", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    (compact, *compact_ops, _, compact_loss), (fixed, *fixed_ops, _, fixed_loss) = LOSS_OPS_ROW.findall(done.stdout)
    assert (compact, fixed) == ("compact", "fixed shapes")
    assert float(fixed_loss) == pytest.approx(float(compact_loss), rel=1e-5)
    assert sum(map(int, fixed_ops)) < 0.6 * sum(map(int, compact_ops))  # 411 against 755 on this head


def host_copies_to_cuda(compute, batch_sizes, grids=(8, 4), nc=3, targets=20):
    """The copies from a host tensor to a CUDA one that the fixed-shape loss dispatches for each batch size in turn,
    run on fake CUDA tensors (FakeTensorMode: no GPU needed): what a CUDA graph's capture would refuse."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class HostCopies(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.copies = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if name in ("_to_copy", "copy_"):  # _to_copy(source), copy_(destination, source)
                source, result = (args[0], out) if name == "_to_copy" else (args[1], args[0])
                if source.device.type == "cpu" and result.device.type == "cuda":
                    self.copies.append(f"{name} {tuple(source.shape)}")
            return out

    copies = []
    with FakeTensorMode(allow_non_fake_inputs=True):
        compute.detect.anchors = torch.empty_like(compute.detect.anchors, device="cuda")
        compute.cls_loss, compute.obj_loss = compute.cls_loss.to("cuda"), compute.obj_loss.to("cuda")
        compute.device = torch.device("cuda")
        for batch in batch_sizes:
            preds = [torch.empty(batch, 3, g, g, 5 + nc, device="cuda") for g in grids]
            with HostCopies() as recorded:  # the forward only: autograd's engine needs a real device for CUDA
                compute(preds, torch.empty(targets, 6, device="cuda"))
            copies.append(recorded.copies)
    return copies


def test_a_new_batch_size_makes_the_fixed_shape_losss_constants_without_a_copy_from_the_host():
    """--cuda-graphs captures an epoch's smaller last batch with the loss as its first pass (no eager warm-up: its
    memory would sit beside the graphs' pool), and a capture refuses a copy from the host: the constants that depend
    on the batch size are fills on the device; those of the grids are copied once, at the run's first batch."""
    compute = DetectionLoss(FakeModel(ANCHORS, (8, 16), nc=3), Hyp(), imgsz=64, fixed_shapes=True)
    first, smaller, again = host_copies_to_cuda(compute, (4, 2, 4))
    assert first and not smaller and not again


def test_the_fixed_shape_losss_constants_of_another_batch_size_give_the_same_loss():
    """The batch-size constants made by fills for a second batch size equal those a new loss makes for it first."""
    model = FakeModel(ANCHORS, (8, 16), nc=3)
    preds, targets = random_case(11, 30, nc=3, batch=2)
    warmed = DetectionLoss(model, Hyp(), imgsz=64, fixed_shapes=True)
    loss_and_grads(warmed, *random_case(12, 30, nc=3, batch=4))
    a_total, a_items, a_grads = loss_and_grads(warmed, preds, targets)
    b_total, b_items, b_grads = loss_and_grads(DetectionLoss(model, Hyp(), imgsz=64, fixed_shapes=True), preds, targets)
    assert torch.equal(a_total, b_total) and torch.equal(a_items, b_items)
    assert all(torch.equal(a, b) for a, b in zip(a_grads, b_grads))
