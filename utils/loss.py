"""YOLOv5 v7 training loss: anchor matching, CIoU box loss, objectness and class BCE.

Only the detection head's attributes are used (``model.model[-1]``: ``.nc``, ``.nl``, ``.na`` and the
``.anchors`` buffer of shape (nl, na, 2) in grid units), so any object with that shape works.

Two forms of the same loss (``DetectionLoss(fixed_shapes=...)``):
- compact (the default; the CPU): the matches are selected with boolean masks, so their number is read by the host;
- fixed shapes (CUDA with deferred step checks, utils/trainer/step_checks.py): every (cell offset, anchor, target)
  candidate stays in place with a mask, so no shape depends on the data and nothing waits for the device; and all
  levels are computed together (a level dimension on each operation, the objectness terms of all levels in one
  weighted sum), so a call is ~400 operations (forward and backward) whatever the number of levels, against ~1,000
  for the compact form of a 3-level head (benchmarks/loss_ops.py): on a GPU each is host time. Objectness targets
  are the same to the bit; the means sum the same terms in another order (float rounding differs, ~1e-7 relative).

Matching (``DetectionLoss.build_targets``), per level, fully vectorised over targets and images:
targets (n, 6) ``[image, class, cx, cy, w, h]`` (normalised) are scaled to the level's grid and
paired with every anchor; a pair is kept when ``max(r, 1/r) < anchor_t`` for both the width and
height ratios r of target to anchor. Each kept pair lands in the cell holding its centre and in
up to two neighbouring cells: left when the centre's fractional x is < 0.5 and x > 1, right when it
is > 0.5 and x < grid_w - 1 (likewise up/down in y). Predictions decode as
``xy = 2 * sigmoid - 0.5`` (cell offsets) and ``wh = (2 * sigmoid)^2 * anchor``.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import NamedTuple

import torch
from torch import nn

from utils.boxes import bbox_iou
from utils.config import Hyp

# Per-level objectness weights: YOLOv5's values for P3-P5 and for P3-P7 heads.
BALANCE_THREE_LEVELS = (4.0, 1.0, 0.4)
BALANCE_MANY_LEVELS = (4.0, 1.0, 0.25, 0.06, 0.02)
MAX_LEVEL_CONSTANTS = 64  # (grids, batch size) kept (--multi-scale makes ~20); more start the cache anew
NEIGHBOUR_OFFSET = 0.5  # a centre within 0.5 of a cell edge also claims the neighbouring cell
# Centre cell, then the cells left, up, right and down of it; multiplied by NEIGHBOUR_OFFSET.
CELL_OFFSETS = ((0, 0), (1, 0), (0, 1), (-1, 0), (0, -1))


def loss_gains(hyp: Hyp, num_levels: int, num_classes: int, imgsz: int) -> tuple[float, float, float]:
    """(box, obj, cls) gains as YOLOv5 v7 scales the hyp values for the model and image size."""
    level_scale = 3.0 / num_levels
    box = hyp.box * level_scale
    obj = hyp.obj * (imgsz / 640) ** 2 * level_scale
    cls = hyp.cls * num_classes / 80 * level_scale
    return box, obj, cls


def level_balance(num_levels: int) -> tuple[float, ...]:
    """Objectness weight per detection level."""
    return BALANCE_THREE_LEVELS if num_levels == 3 else BALANCE_MANY_LEVELS[:num_levels]


def smooth_bce_targets(eps: float = 0.0) -> tuple[float, float]:
    """Class targets (positive, negative) with label smoothing ``eps``."""
    return 1.0 - 0.5 * eps, 0.5 * eps


class FocalLoss(nn.Module):
    """Wraps a BCE-with-logits loss: each element is scaled by alpha_t * (1 - p_t)^gamma."""

    def __init__(self, bce: nn.BCEWithLogitsLoss, gamma: float = 1.5, alpha: float = 0.25):
        super().__init__()
        self.bce = bce
        self.gamma = gamma
        self.alpha = alpha
        self.reduction = bce.reduction
        bce.reduction = "none"  # the wrapper reduces after weighting each element

    def forward(self, pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
        loss = self.elementwise(pred, true)
        if self.reduction == "mean":
            return loss.mean()
        if self.reduction == "sum":
            return loss.sum()
        return loss

    def elementwise(self, pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
        loss = self.bce(pred, true)
        prob = pred.sigmoid()
        p_t = true * prob + (1 - true) * (1 - prob)
        alpha_t = true * self.alpha + (1 - true) * (1 - self.alpha)
        return loss * alpha_t * (1.0 - p_t) ** self.gamma


def elementwise_loss(loss: nn.Module, pred: torch.Tensor, true: torch.Tensor) -> torch.Tensor:
    """``loss`` (BCE with logits, or FocalLoss around it) per element, unreduced."""
    if isinstance(loss, FocalLoss):
        return loss.elementwise(pred, true)
    return nn.functional.binary_cross_entropy_with_logits(pred, true, pos_weight=loss.pos_weight, reduction="none")


def _unwrap(model: nn.Module) -> nn.Module:
    """The bare model inside DataParallel / DistributedDataParallel."""
    parallel = (nn.parallel.DataParallel, nn.parallel.DistributedDataParallel)
    return model.module if isinstance(model, parallel) else model


def objectness_target(shape, indices, iou: torch.Tensor) -> torch.Tensor:
    """Zeros of ``shape`` (bs, na, ny, nx) with ``iou`` written at ``indices`` (b, a, gj, gi).

    When several matches share a cell the last one wins, as YOLOv5's indexed write does on the
    CPU; resolving duplicates explicitly keeps it deterministic on CUDA as well.
    """
    target = torch.zeros(shape, dtype=iou.dtype, device=iou.device)
    if iou.numel() == 0:
        return target
    b, a, gj, gi = indices
    _, num_anchors, ny, nx = shape
    cell = ((b * num_anchors + a) * ny + gj) * nx + gi
    unique, inverse = torch.unique(cell, return_inverse=True)
    position = torch.arange(cell.numel(), device=cell.device)
    last = torch.zeros(unique.numel(), dtype=position.dtype, device=cell.device)
    last.scatter_reduce_(0, inverse, position, reduce="amax", include_self=False)
    keep = last[inverse] == position
    target.view(-1)[cell[keep]] = iou[keep]
    return target


def objectness_target_fixed(num_cells: int, cell: torch.Tensor, iou: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """``objectness_target`` for candidates with a ``valid`` mask, with no data-dependent shape: the same target
    (the last valid candidate of a cell wins), flattened to ``num_cells``. ``cell``: each candidate's flat cell index;
    invalid candidates go to one spare slot past the end, dropped."""
    cell = torch.where(valid, cell, num_cells)
    position = torch.arange(cell.numel(), device=cell.device)
    last = torch.full((num_cells + 1,), -1, dtype=position.dtype, device=cell.device)
    last.scatter_reduce_(0, cell, position, reduce="amax", include_self=True)
    winner = torch.where(last[cell] == position, cell, num_cells)  # each cell's last candidate writes once
    target = torch.zeros(num_cells + 1, dtype=iou.dtype, device=iou.device)
    target.scatter_(0, winner, iou)
    return target[:num_cells]


class LevelConstants(NamedTuple):
    """What the fixed-shape form needs of the levels' grid sizes and the batch size. Those of the grids are made once
    per (device, grids) from host values (a copy, which waits for the device on CUDA); those of the batch size once
    per (device, grids, batch size) by fills on the device, so that a CUDA graph's capture of a new batch size (an
    epoch's smaller last batch, utils/trainer/cuda_graphs.py) can make them: a capture refuses a copy from the host."""
    scale: torch.Tensor  # (nl, 1, 1, 7): a target row [image, class, cx, cy, w, h, anchor] to grid units
    grid: torch.Tensor  # (nl, 1, 1, 2): the grid's width and height
    last_cell: torch.Tensor  # (nl, 1, 2) long: the largest gi and gj
    grid_long: torch.Tensor  # (nl, 1, 2) long: nx, ny
    level: torch.Tensor  # (nl, 1) long: 0 .. nl - 1
    anchor_index: torch.Tensor  # (na, 1, 1) float: 0 .. na - 1
    offsets: torch.Tensor  # (5, 2): CELL_OFFSETS * NEIGHBOUR_OFFSET
    placeholder: torch.Tensor  # (4,): an invalid candidate's box
    # of the batch size too:
    first_cell: torch.Tensor  # (nl, 1) long: where each level's cells start in the levels' cells one after another
    obj_weight: torch.Tensor  # (cells,): each cell's objectness weight, its level's balance / its level's cells
    num_cells: int


class DetectionLoss:
    """``loss, items = compute_loss(preds, targets)``.

    ``preds``: list of nl raw head outputs (bs, na, ny, nx, 5 + nc); ``targets``: (n, 6)
    ``[image, class, cx, cy, w, h]`` normalised. ``loss`` is (box + obj + cls) * bs as a
    1-element tensor; ``items`` the detached (3,) [box, obj, cls]. Computed in float32, also
    under autocast. Objectness targets are the detached IoU clamped at 0 (YOLOv5's gr = 1.0).

    Data-parallel training (``reduce_counts`` sums a small tensor over the processes, ``world_size``
    processes): the box and class terms are divided by the matches of ALL processes and objectness by
    the global batch, and the loss is scaled so that DDP's gradient averaging gives the gradient of the
    single-process loss on the global batch (YOLOv5 keeps per-process means instead, so 2 x 4 images do not
    learn what 1 x 8 images learn). ``items`` are then this process's share times ``world_size``.

    ``fixed_shapes``: the form with no data-dependent shape (module docstring); its ``reduce_counts`` must sum in
    place on the device (utils.dist.all_reduce_sum_in_place), the compact form's returns a new tensor.
    """

    def __init__(self, model: nn.Module, hyp: Hyp, imgsz: int = 640, label_smoothing: float = 0.0,
                 world_size: int = 1, reduce_counts=None, fixed_shapes: bool = False):
        self.detect = _unwrap(model).model[-1]
        self.num_classes = int(self.detect.nc)
        self.num_levels = int(self.detect.nl)
        self.num_anchors = int(self.detect.na)
        self.anchor_t = hyp.anchor_t
        self.box_gain, self.obj_gain, self.cls_gain = loss_gains(hyp, self.num_levels, self.num_classes, imgsz)
        self.balance = level_balance(self.num_levels)
        self.autobalance, self.ssi = False, 0  # YOLOv5's ComputeLoss(autobalance=True) below
        self.cls_positive, self.cls_negative = smooth_bce_targets(label_smoothing)
        self.device = self.detect.anchors.device
        cls_loss = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([hyp.cls_pw]))
        obj_loss = nn.BCEWithLogitsLoss(pos_weight=torch.tensor([hyp.obj_pw]))
        if hyp.fl_gamma > 0:
            cls_loss, obj_loss = FocalLoss(cls_loss, hyp.fl_gamma), FocalLoss(obj_loss, hyp.fl_gamma)
        self.cls_loss = cls_loss.to(self.device)
        self.obj_loss = obj_loss.to(self.device)
        self.world_size, self.reduce_counts = world_size, reduce_counts
        self.fixed_shapes = fixed_shapes
        self._made: dict = {}  # _level_constants: by (device, grids, batch size)
        self._of_grids: dict = {}  # and the part of them made from host values, by (device, grids)

    def __call__(self, preds: list[torch.Tensor], targets: torch.Tensor):
        device = preds[0].device
        if device != self.device:
            self.cls_loss, self.obj_loss, self.device = self.cls_loss.to(device), self.obj_loss.to(device), device
        compute = self._compute_fixed if self.fixed_shapes else self._compute
        with torch.autocast(device.type, enabled=False):
            return compute([p.float() for p in preds], targets.to(device=device, dtype=torch.float32))

    def _compute(self, preds: list[torch.Tensor], targets: torch.Tensor):
        classes, boxes, indices, anchors = self.build_targets(preds, targets)
        match_share, batch_share, global_batch = self._shares(indices, preds[0].shape[0])
        box_loss = obj_loss = cls_loss = preds[0].new_zeros(1)
        for level, pred in enumerate(preds):
            b, a, gj, gi = indices[level]
            iou = pred.new_zeros(0)
            if b.numel():
                iou, cls_logits = self._matched(pred[b, a, gj, gi], anchors[level], boxes[level])
                box_loss = box_loss + (1.0 - iou).mean() * match_share[level]
                if self.num_classes > 1:
                    cls_targets = self.class_targets(cls_logits, classes[level])
                    cls_loss = cls_loss + self.cls_loss(cls_logits, cls_targets) * match_share[level]
            tobj = objectness_target(pred.shape[:4], indices[level], iou.detach().clamp(0))
            level_obj = self.obj_loss(pred[..., 4], tobj)
            obj_loss = obj_loss + level_obj * (self.balance[level] * batch_share)
            if self.autobalance:  # YOLOv5's: the weight follows the level's loss (a read of it)
                self.balance[level] = self.balance[level] * 0.9999 + 0.0001 / level_obj.detach().item()
        if self.autobalance:
            self.balance = [weight / self.balance[self.ssi] for weight in self.balance]
        return self._total(box_loss, obj_loss, cls_loss, global_batch)

    def _matched(self, rows: torch.Tensor, anchors: torch.Tensor, boxes: torch.Tensor):
        """(CIoU of each matched prediction row with its target box, the rows' class logits)."""
        xy, wh, _, cls_logits = rows.split((2, 2, 1, self.num_classes), -1)
        xy = xy.sigmoid() * 2 - 0.5
        wh = (wh.sigmoid() * 2) ** 2 * anchors
        return bbox_iou(torch.cat((xy, wh), -1), boxes, CIoU=True).squeeze(-1), cls_logits

    def _total(self, box_loss, obj_loss, cls_loss, global_batch):
        """(the loss to backpropagate, the detached [box, obj, cls] items) from the three sums, with their gains."""
        box_loss = box_loss * self.box_gain
        obj_loss = obj_loss * self.obj_gain
        cls_loss = cls_loss * self.cls_gain
        total = (box_loss + obj_loss + cls_loss) * (global_batch * self.world_size)
        return total, torch.cat((box_loss, obj_loss, cls_loss)).detach() * self.world_size

    def _compute_fixed(self, preds: list[torch.Tensor], targets: torch.Tensor):
        """``_compute`` over every candidate of every level at once, with masks (see the module docstring): the
        levels are one more dimension of each operation, so a step runs the same ~150 operations whatever the number
        of levels, instead of that many per level (each one host time on a GPU)."""
        const = self._level_constants(preds)
        classes, boxes, indices, anchors, valid = self.build_candidates(preds, targets, const)
        match_share, batch_share, global_batch = self._fixed_shares(valid, preds[0].shape[0])
        b, a, gj, gi = indices
        grid_x, grid_y = const.grid_long.unbind(-1)
        cell = ((b * self.num_anchors + a) * grid_y + gj) * grid_x + gi  # (nl, K): in each level's prediction rows
        rows = torch.stack([pred.reshape(-1, pred.shape[-1]).index_select(0, level_cell)
                            for pred, level_cell in zip(preds, cell)])
        iou, cls_logits = self._matched(rows, anchors, boxes)
        matches = valid.sum(-1).clamp(min=1)  # (nl,)
        box_loss = torch.where(valid, 1.0 - iou, 0.0).sum(-1) / matches
        cls_loss = None
        if self.num_classes > 1:
            terms = elementwise_loss(self.cls_loss, cls_logits, self.class_targets(cls_logits, classes))
            cls_loss = torch.where(valid[..., None], terms, 0.0).sum((1, 2)) / (matches * self.num_classes)
        if match_share is not None:
            box_loss = box_loss * match_share
            cls_loss = cls_loss * match_share if cls_loss is not None else None
        tobj = objectness_target_fixed(const.num_cells, (cell + const.first_cell).view(-1),
                                       iou.detach().clamp(0).view(-1), valid.view(-1))
        obj_logits = torch.cat([pred[..., 4].reshape(-1) for pred in preds])
        obj_loss = (elementwise_loss(self.obj_loss, obj_logits, tobj) * const.obj_weight).sum()
        if batch_share is not None:
            obj_loss = obj_loss * batch_share
        cls_loss = cls_loss.sum().view(1) if cls_loss is not None else preds[0].new_zeros(1)
        return self._total(box_loss.sum().view(1), obj_loss.view(1), cls_loss, global_batch)

    def _fixed_shares(self, valid: torch.Tensor, batch_size: int):
        """``_shares`` as tensors on the device (summed over the processes in place there): nothing is read. Single
        process: (None, None, batch_size), the shares being 1."""
        if self.reduce_counts is None:
            return None, None, batch_size
        batch = torch.full((1,), batch_size, dtype=torch.long, device=valid.device)  # a fill, not a copy
        local = torch.cat((valid.sum(-1), batch)).to(torch.float64)
        total = self.reduce_counts(local.clone())
        shares = torch.where(total[:-1] > 0, local[:-1] / total[:-1].clamp(min=1), 0.0).float()
        return shares, (local[-1] / total[-1]).float(), total[-1].float()

    def _shares(self, indices, batch_size: int) -> tuple[list[float], float, int]:
        """Per level: this process's matches / all processes' matches; its images / the global batch; the
        global batch. All 1 (and the local batch) in single-process training."""
        local = [float(level[0].numel()) for level in indices] + [float(batch_size)]
        if self.reduce_counts is None:
            return [1.0] * len(indices), 1.0, batch_size
        total = self.reduce_counts(torch.tensor(local, dtype=torch.float64)).tolist()
        shares = [mine / everyone if everyone else 0.0 for mine, everyone in zip(local[:-1], total[:-1])]
        return shares, local[-1] / total[-1], int(total[-1])

    def class_targets(self, logits: torch.Tensor, classes: torch.Tensor) -> torch.Tensor:
        """Smoothed one-hot targets (n, nc): cls_positive at each match's class, cls_negative elsewhere. Made by one
        comparison: an indexed write of a Python number (``target[rows, classes] = value``) copies the number to the
        device first, and on CUDA that copy waits for every queued kernel (3 waits a step, one per level, seen on an
        H100 with ``set_sync_debug_mode``)."""
        column = torch.arange(logits.shape[-1], device=logits.device)
        return torch.where(column == classes[..., None], self.cls_positive, self.cls_negative).to(logits.dtype)

    def build_targets(self, preds: list[torch.Tensor], targets: torch.Tensor):
        """Per level: classes (m,), boxes (m, 4) [x, y offset in cell, w, h in grid units],
        indices (b, a, gj, gi) and the matched anchors (m, 2). Matches are ordered by cell offset
        (centre, left, up, right, down), then anchor, then target, as YOLOv5 orders them."""
        device, num_targets = targets.device, targets.shape[0]
        anchor_index = torch.arange(self.num_anchors, device=device, dtype=torch.float32)
        anchor_index = anchor_index.view(-1, 1, 1).expand(self.num_anchors, num_targets, 1)
        paired = torch.cat((targets.expand(self.num_anchors, num_targets, 6), anchor_index), 2)  # (na, n, 7)
        offsets = torch.tensor(CELL_OFFSETS, device=device, dtype=torch.float32) * NEIGHBOUR_OFFSET
        classes, boxes, indices, anchors = [], [], [], []
        for level, pred in enumerate(preds):
            ny, nx = pred.shape[2], pred.shape[3]
            level_anchors = self.detect.anchors[level].to(device=device, dtype=torch.float32)
            scale = torch.tensor([1, 1, nx, ny, nx, ny, 1], device=device, dtype=torch.float32)
            matches, cell_offsets = self._match_level(paired * scale, level_anchors, scale[2:4], offsets)
            image_class, centre, size, anchor = matches.split((2, 2, 2, 1), 1)
            anchor = anchor.long().view(-1)
            image, cls = image_class.long().T
            cell = (centre - cell_offsets).long()
            gi, gj = cell.T
            indices.append((image, anchor, gj.clamp(0, ny - 1), gi.clamp(0, nx - 1)))
            boxes.append(torch.cat((centre - cell, size), 1))
            anchors.append(level_anchors[anchor])
            classes.append(cls)
        return classes, boxes, indices, anchors

    def build_candidates(self, preds: list[torch.Tensor], targets: torch.Tensor, const: LevelConstants | None = None):
        """``build_targets`` with fixed shapes, all levels at once: every (cell offset, anchor, target) candidate in
        build_targets' order (offset, anchor, target), flattened to K = 5 * na * n per level, with ``valid`` (the ones
        build_targets keeps): (classes (nl, K), boxes (nl, K, 4), indices (b, a, gj, gi) each (nl, K), anchors
        (nl, K, 2), valid (nl, K)). Invalid candidates hold harmless values (a box of one cell, in-grid indices), so
        their losses are finite before the mask drops them."""
        const = const or self._level_constants(preds)
        num_levels, num_targets = len(preds), targets.shape[0]
        shape = (num_levels, len(CELL_OFFSETS), self.num_anchors, num_targets)
        anchor_index = const.anchor_index.expand(self.num_anchors, num_targets, 1)
        paired = torch.cat((targets.expand(self.num_anchors, num_targets, 6), anchor_index), 2)  # (na, n, 7)
        scaled = paired * const.scale  # (nl, na, n, 7)
        anchors = self.detect.anchors[:num_levels].to(device=targets.device, dtype=torch.float32)  # (nl, na, 2)
        ratio = scaled[..., 4:6] / anchors[:, :, None]
        within = torch.max(ratio, 1 / ratio).max(-1).values < self.anchor_t  # (nl, na, n)
        centre = scaled[..., 2:4]
        from_far_edge = const.grid - centre
        left, up = ((centre % 1 < NEIGHBOUR_OFFSET) & (centre > 1)).unbind(-1)
        right, down = ((from_far_edge % 1 < NEIGHBOUR_OFFSET) & (from_far_edge > 1)).unbind(-1)
        valid = (torch.stack((torch.ones_like(left), left, up, right, down), 1) & within[:, None])
        valid = valid.reshape(num_levels, -1)
        rows = scaled[:, None].expand(*shape, 7).reshape(num_levels, -1, 7)
        cell_offsets = const.offsets[:, None, None].expand(*shape, 2).reshape(num_levels, -1, 2)
        image_class, centre, size, anchor = rows.split((2, 2, 2, 1), -1)
        anchor = anchor.long().squeeze(-1)
        image, cls = image_class.long().unbind(-1)
        cell = (centre - cell_offsets).long()
        box = torch.where(valid[..., None], torch.cat((centre - cell, size), -1), const.placeholder)
        gi, gj = cell.clamp(min=0).minimum(const.last_cell).unbind(-1)
        return cls, box, (image, anchor, gj, gi), anchors[const.level, anchor], valid

    def _level_constants(self, preds: list[torch.Tensor]) -> LevelConstants:
        """The LevelConstants of these predictions' grids and batch size, made on their first use (a few per run:
        the training size, the last batch's size, --multi-scale's sizes). Inside a CUDA graph's capture those of a
        new batch size are made and not kept: the graph's fills make them at each replay, and an eager call could
        otherwise read memory that only a replay writes."""
        batch_size, device = preds[0].shape[0], preds[0].device
        grids = tuple((int(p.shape[2]), int(p.shape[3])) for p in preds)
        key = (device, grids, batch_size)
        if key in self._made:
            return self._made[key]
        if len(self._made) >= MAX_LEVEL_CONSTANTS:
            self._made.clear()
        of_grids = self._of_grids.get((device, grids))
        if of_grids is None:
            if len(self._of_grids) >= MAX_LEVEL_CONSTANTS:
                self._of_grids.clear()
            made = dict(
                scale=torch.tensor([[1, 1, nx, ny, nx, ny, 1] for ny, nx in grids],
                                   dtype=torch.float32).view(-1, 1, 1, 7),
                grid=torch.tensor([[nx, ny] for ny, nx in grids], dtype=torch.float32).view(-1, 1, 1, 2),
                last_cell=torch.tensor([[nx - 1, ny - 1] for ny, nx in grids]).view(-1, 1, 2),
                grid_long=torch.tensor([[nx, ny] for ny, nx in grids]).view(-1, 1, 2),
                level=torch.arange(len(grids)).view(-1, 1),
                anchor_index=torch.arange(self.num_anchors, dtype=torch.float32).view(-1, 1, 1),
                offsets=torch.tensor(CELL_OFFSETS, dtype=torch.float32) * NEIGHBOUR_OFFSET,
                placeholder=torch.tensor([0.5, 0.5, 1.0, 1.0]))
            of_grids = self._of_grids[(device, grids)] = {name: t.to(device) for name, t in made.items()}
        sizes = [batch_size * self.num_anchors * ny * nx for ny, nx in grids]
        first_cell = torch.cat([torch.full((1, 1), sum(sizes[:level]), dtype=torch.long, device=device)
                                for level in range(len(sizes))])
        obj_weight = torch.cat([torch.full((n,), balance / n, device=device)
                                for n, balance in zip(sizes, self.balance)])
        made = LevelConstants(**of_grids, first_cell=first_cell, obj_weight=obj_weight, num_cells=sum(sizes))
        if not (device.type == "cuda" and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
            self._made[key] = made
        return made

    def _match_level(self, paired: torch.Tensor, anchors: torch.Tensor, grid_size: torch.Tensor,
                     offsets: torch.Tensor):
        """Keep (anchor, target) pairs within anchor_t, then add the neighbouring cells.

        Returns the matched rows (m, 7) and, per row, the offset subtracted from its centre
        to pick its cell (m, 2)."""
        if paired.shape[1] == 0:
            return paired[0], paired.new_zeros(0, 2)
        ratio = paired[..., 4:6] / anchors[:, None]
        within = torch.max(ratio, 1 / ratio).max(2).values < self.anchor_t
        kept = paired[within]  # (k, 7)
        centre = kept[:, 2:4]
        from_far_edge = grid_size - centre
        left, up = ((centre % 1 < NEIGHBOUR_OFFSET) & (centre > 1)).T
        right, down = ((from_far_edge % 1 < NEIGHBOUR_OFFSET) & (from_far_edge > 1)).T
        chosen = torch.stack((torch.ones_like(left), left, up, right, down))  # (5, k)
        matches = kept.expand(len(CELL_OFFSETS), *kept.shape)[chosen]
        cell_offsets = offsets[:, None].expand(len(CELL_OFFSETS), kept.shape[0], 2)[chosen]
        return matches, cell_offsets


# What YOLOv5's ComputeLoss reads of model.hyp (label_smoothing too, 0 when absent).
YOLOV5_LOSS_KEYS = ("box", "obj", "cls", "cls_pw", "obj_pw", "anchor_t", "fl_gamma")


class ComputeLoss(DetectionLoss):
    """YOLOv5's ``ComputeLoss(model, autobalance=False)``, for scripts written against YOLOv5 (docs/yolov5-scripts.md);
    the project trains with DetectionLoss. The hyperparameters are ``model.hyp`` (a dict, or a Hyp), set before as
    YOLOv5's train.py sets it; the box, obj and cls gains are used as they are there (YOLOv5's train.py scales them
    for the number of levels and classes and the image size first; DetectionLoss scales them itself from its
    ``imgsz``), with ``hyp["label_smoothing"]`` (0 when absent). ``autobalance``: YOLOv5's per-level objectness
    weights that follow each level's loss, relative to the stride-16 level's (each call then reads the levels'
    losses). Called as YOLOv5's: ``loss, items = compute_loss(preds, targets)``; ``build_targets`` returns YOLOv5's
    ``tcls, tbox, indices, anch``."""

    def __init__(self, model: nn.Module, autobalance: bool = False):
        hyp = getattr(_unwrap(model), "hyp", None)
        if hyp is None:
            raise ValueError("ComputeLoss(model): model.hyp is not set; set it to the hyperparameters first, as "
                             "YOLOv5's train.py does (model.hyp = hyp)")
        values = hyp if isinstance(hyp, dict) else asdict(hyp)
        missing = [key for key in YOLOV5_LOSS_KEYS if key not in values]
        if missing:
            raise ValueError(f"ComputeLoss(model): model.hyp has no {', '.join(missing)}")
        number = {key: float(values[key]) for key in YOLOV5_LOSS_KEYS}
        loss_hyp = Hyp(**{key: number[key] for key in ("cls_pw", "obj_pw", "anchor_t", "fl_gamma")})
        super().__init__(model, loss_hyp, label_smoothing=float(values.get("label_smoothing", 0.0)))
        self.box_gain, self.obj_gain, self.cls_gain = number["box"], number["obj"], number["cls"]
        self.hyp, self.autobalance = hyp, bool(autobalance)
        if self.autobalance:
            strides = [int(stride) for stride in self.detect.stride]
            if 16 not in strides:
                raise ValueError(f"ComputeLoss(autobalance=True) needs a stride-16 level; the model's are {strides}")
            self.balance, self.ssi = list(self.balance), strides.index(16)
        self.na, self.nc, self.nl = self.num_anchors, self.num_classes, self.num_levels
        self.anchors = self.detect.anchors
