"""--augment-device: plans (utils/data/plans.py) rendered with torch (utils/data/device_augment.py) against the
OpenCV path, with the same draws: the same boxes exactly, the images within interpolation tolerance.

Tolerance, per image:
- mean absolute difference over all values below 0.01;
- 99.9th percentile of the absolute difference at most 1;
- share of values that differ below 0.005.
Measured on these cases (CPU, torch 2.14.1, OpenCV 5.0.0), the worst image of each case: mean and share
0.00011-0.00098 (rect: 0.0012, on 96 x 64 images), 99.9th percentile 0 (rect: 1), largest difference 1-2 (a warped
value 1 off can move by more through OpenCV's HSV conversion); no augmentation: identical. With OpenCV 5.1.0 the
same, rect 0. Both versions pass (the pixels OpenCV's HSV -> RGB converts with its scalar code take its table).
"""
from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from tests.test_dataset import SIZES, make_split
from utils.config import Hyp
from utils.data import device_augment
from utils.data.dataset import LabelSet, YoloDataset, collate
from utils.data.device_augment import DeviceAugment, colour_step, render_plans
from utils.data.loader import create_dataloader, set_loader_epoch
from utils.data.plans import ImagePlan, PlanBatch, PlanDataset, collate_plans
from utils.data.transforms import augment_hsv, hsv_gains, hsv_lut, perspective_matrix, warp_image

SIZE = 96  # tiny images and canvas: a case runs in a fraction of a second
SCRATCH = Hyp.load("hyp.scratch-low.yaml")
CASES = {  # name: (hyp, rect)
    "mosaic": (SCRATCH, False),
    "mosaic, perspective, rotation, shear, up-down flips": (
        SCRATCH.replace(perspective=0.0005, degrees=10.0, shear=3.0, flipud=0.5), False),
    "mosaic, mixup": (SCRATCH.replace(mixup=0.5), False),
    "letterbox (mosaic 0)": (SCRATCH.replace(mosaic=0.0), False),
    "letterbox, perspective": (SCRATCH.replace(mosaic=0.0, perspective=0.0005, degrees=5.0), False),
    "rect (letterbox resizes)": (SCRATCH, True),
    "no augmentation": (Hyp.load("hyp.no-augmentation.yaml"), False),
}


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    return make_split(tmp_path_factory.mktemp("split"), suffix=".jpg")


@pytest.fixture(scope="module")
def segmented(split):
    """The split with a polygon per box (a diamond inside it), for copy-paste."""
    segments = []
    for rows in split.labels:
        polygons = []
        for _, cx, cy, w, h in rows.tolist():
            polygons.append(np.array([[cx, cy - h / 2], [cx + w / 2, cy], [cx, cy + h / 2], [cx - w / 2, cy]],
                                     np.float32))
        segments.append(polygons)
    return LabelSet(split.im_files, split.labels, split.shapes, segments)


def assert_close(rendered: torch.Tensor, expected: torch.Tensor) -> None:
    """The module's tolerance (docstring) for one image."""
    assert rendered.shape == expected.shape and rendered.dtype == expected.dtype == torch.uint8
    diff = (rendered.int() - expected.int()).abs().flatten().float()
    assert diff.mean() < 0.01, diff.mean()
    assert torch.quantile(diff, 0.999) <= 1
    assert (diff > 0).float().mean() < 0.005


def both_paths(split, hyp, rect, epoch, batch_size=3):
    """The OpenCV items and the plan items of one epoch, in batches of ``batch_size``."""
    opencv = YoloDataset(split, imgsz=SIZE, batch_size=batch_size, augment=True, hyp=hyp, rect=rect)
    planned = PlanDataset(split, imgsz=SIZE, batch_size=batch_size, augment=True, hyp=hyp, rect=rect)
    items = [(i, epoch) for i in range(len(opencv))]
    return [opencv[item] for item in items], [planned[item] for item in items]


@pytest.mark.parametrize("case", list(CASES))
def test_plans_give_the_same_boxes_and_render_the_same_images(split, case):
    hyp, rect = CASES[case]
    flips = mixed = 0
    for epoch in range(3):
        expected, planned = both_paths(split, hyp, rect, epoch)
        for (image, targets, path, shapes), (plan, plan_targets, plan_path, plan_shapes) in zip(expected, planned):
            assert torch.equal(plan_targets, targets) and plan_path == path and plan_shapes == shapes
            flips += sum(plan.flips)
            mixed += plan.mixup is not None
        for first in range(0, len(planned), 3):  # batches of one rect shape (the split is sorted by aspect)
            batch, targets, paths, shapes = collate_plans(planned[first:first + 3])
            images, expected_targets, expected_paths, _ = collate(expected[first:first + 3])
            assert torch.equal(targets, expected_targets) and paths == expected_paths
            rendered = render_plans(batch)
            assert rendered.shape == images.shape and rendered.is_contiguous(memory_format=torch.channels_last)
            for got, want in zip(rendered, images):
                assert_close(got, want)
    assert flips > 0 or not (hyp.fliplr or hyp.flipud)
    assert mixed > 0 or not hyp.mixup


@pytest.mark.parametrize("hyp", [SCRATCH.replace(copy_paste=1.0), SCRATCH.replace(copy_paste=0.5, mixup=0.5)])
def test_copy_paste_plans_give_the_same_boxes_and_images(segmented, hyp):
    pasted = 0
    for epoch in range(3):
        expected, planned = both_paths(segmented, hyp, False, epoch)
        for (_, targets, _, _), (plan, plan_targets, _, _) in zip(expected, planned):
            assert torch.equal(plan_targets, targets)
            pasted += plan.paste is not None
        rendered = render_plans(collate_plans(planned)[0])
        for got, want in zip(rendered, collate(expected)[0]):
            assert_close(got, want)
    assert pasted > 0


def test_no_augmentation_renders_exactly(split):
    expected, planned = both_paths(split, *CASES["no augmentation"], epoch=1)
    batch = collate_plans(planned)[0]
    assert torch.equal(render_plans(batch), collate(expected)[0])


def test_mixed_sizes_pad_like_collate(split):
    """A distributed rank's share of a --rect split can straddle two rect shapes: padded grey, labels rescaled."""
    expected, planned = both_paths(split, SCRATCH, True, epoch=0, batch_size=2)
    pick = [0, len(planned) - 1]  # the two ends of the aspect order: two shapes
    assert planned[pick[0]][0].out_size != planned[pick[1]][0].out_size
    batch, targets, _, _ = collate_plans([planned[k] for k in pick])
    images, expected_targets, _, _ = collate([expected[k] for k in pick])
    assert torch.equal(targets, expected_targets)
    for got, want in zip(render_plans(batch), images):
        assert_close(got, want)


def test_small_rendering_steps_give_the_same_images(split, monkeypatch):
    _, planned = both_paths(split, *CASES["mosaic, perspective, rotation, shear, up-down flips"], epoch=2)
    batch = collate_plans(planned)[0]
    whole = render_plans(batch)
    monkeypatch.setattr(device_augment, "CANVAS_BYTES", 1)  # one image per step
    assert torch.equal(render_plans(batch), whole)


@pytest.mark.parametrize("case", ["mosaic, mixup", "letterbox (mosaic 0)", "rect (letterbox resizes)"])
def test_the_tiles_of_a_canvas_step_are_pasted_in_one_call(split, segmented, monkeypatch, case):
    """paste_tiles writes a canvas step's tiles with one ``torch._foreach_copy_`` of views (nothing computed per pixel,
    no operation per tile but its two views), and the images are the same to the bit in steps of any size (every image
    in one step, or one image a step), with copy-paste and mixup."""
    hyp, rect = (SCRATCH.replace(copy_paste=0.5, mixup=0.5), False) if case == "mosaic, mixup" else CASES[case]
    data = segmented if case == "mosaic, mixup" else split
    _, planned = both_paths(data, hyp, rect, epoch=1)
    batches = [collate_plans(planned[first:first + 3])[0] for first in range(0, len(planned), 3)]
    expected = [render_plans(batch) for batch in batches]
    tiles = sum(len(batch.tiles) for batch in batches)
    calls, foreach_copy = [], torch._foreach_copy_

    def counted(destinations, sources):
        calls.append(len(destinations))
        return foreach_copy(destinations, sources)

    monkeypatch.setattr(torch, "_foreach_copy_", counted)
    for canvas_bytes in (256 << 20, 1):
        monkeypatch.setattr(device_augment, "CANVAS_BYTES", canvas_bytes)
        calls.clear()
        for batch, want in zip(batches, expected):
            assert torch.equal(render_plans(batch), want)
        steps = sum(len(list(device_augment.canvas_steps(batch.canvases, canvas_bytes))) for batch in batches)
        assert len(calls) == steps and sum(calls) == tiles


@pytest.mark.parametrize("projective", [False, True])
def test_warp_matches_opencv(projective):
    """The warp alone (no HSV): bilinear, grey border, affine and projective, against cv2 on a textured image."""
    rng = np.random.default_rng(3)
    img = cv2.GaussianBlur(rng.integers(0, 256, (150, 130, 3), dtype=np.uint8), (5, 5), 0)
    for _ in range(4):
        matrix, _ = perspective_matrix(img.shape, (128, 112), 20.0, 0.2, 0.5, 5.0, 0.001 if projective else 0.0, rng)
        flips = (bool(rng.random() < 0.5), False)
        plan = ImagePlan((128, 112), (130, 150), [(img, (0, 0))], matrix, projective, flips=flips)
        expected = warp_image(img, matrix, (128, 112), projective)[:, :, ::-1]
        expected = np.flipud(expected) if plan.flips[0] else expected
        batch = collate_plans([(plan, torch.zeros(0, 6), "a", None)])[0]
        assert_close(render_plans(batch)[0], torch.from_numpy(expected.copy()).permute(2, 0, 1))


@pytest.mark.parametrize("width", [64, 75, 96, 100])
def test_hsv_tables_give_opencvs_hsv(width):
    """Exact at every width: where OpenCV converts a row's last pixels with its scalar code (past its blocks of
    vector code: 32 pixels with OpenCV 5.0, 64 with 5.1), those pixels take the scalar code's table."""
    rng = np.random.default_rng(0)
    img = rng.integers(0, 256, (24, width, 3), dtype=np.uint8)
    img[:12] = cv2.GaussianBlur(img[:12], (5, 5), 0)
    gains = hsv_gains(0.015, 0.7, 0.4, np.random.default_rng(4))
    expected = augment_hsv(img.copy(), 0.015, 0.7, 0.4, np.random.default_rng(4), rgb=True)
    got = colour_step(torch.from_numpy(img)[None], torch.from_numpy(hsv_lut(gains)[:, 0])[None], torch.tensor([True]),
                      torch.device("cpu"))[0].numpy()
    assert np.array_equal(got, expected)


def test_scalar_positions_are_where_opencvs_codes_differ():
    """The probe finds exactly the pixels whose conversion is the scalar code's: a row's tail past OpenCV's blocks,
    the same columns on every row; none where the blocks divide the width."""
    inputs, vector, scalar = device_augment.probe_inputs()
    assert len(inputs) == 4 and (vector != scalar).any(axis=1).all()
    assert len(device_augment.scalar_positions(24, 256)) == 0
    flat = device_augment.scalar_positions(24, 100)
    rows, cols = np.divmod(flat, 100)
    tail = sorted(set(cols.tolist()))
    assert tail and tail == list(range(tail[0], 100)) and tail[0] % 32 == 0  # a tail past whole blocks
    assert np.array_equal(np.bincount(rows, minlength=24), np.full(24, len(tail)))
    img = np.broadcast_to(inputs[0], (24, 100, 3)).copy()
    out = cv2.cvtColor(img, cv2.COLOR_HSV2RGB).reshape(-1, 3)
    assert (out[flat] == scalar[0]).all()
    assert (np.delete(out, flat, axis=0) == vector[0]).all()


def test_images_of_their_own_size_take_their_own_scalar_pixels():
    """An image smaller than its colour step's frame (a distributed rank's two rect shapes) is converted as OpenCV
    converts an image of its own size; an image without HSV takes none."""
    rng = np.random.default_rng(3)
    frame = rng.integers(0, 256, (2, 20, 100, 3), dtype=np.uint8)
    gains = hsv_gains(0.015, 0.7, 0.4, np.random.default_rng(4))
    tables = torch.from_numpy(np.stack([hsv_lut(gains)[:, 0]] * 2))
    sizes = torch.tensor([[100, 20], [75, 12]])
    got = colour_step(torch.from_numpy(frame), tables, torch.tensor([True, True]), torch.device("cpu"), sizes).numpy()
    for image, (w, h) in enumerate(sizes.tolist()):
        own = frame[image, :h, :w].copy()
        expected = augment_hsv(own, 0.015, 0.7, 0.4, np.random.default_rng(4), rgb=True)
        assert np.array_equal(got[image, :h, :w], expected)
    positions = device_augment.scalar_step_positions((2, 20, 100), torch.tensor([False, True]), sizes)
    own = device_augment.scalar_positions(12, 75)
    assert positions is None or (len(positions) == len(own) and positions.min() >= 20 * 100)


def test_device_augment_is_a_batch_transform(split):
    _, planned = both_paths(split, SCRATCH, False, epoch=0)
    batch, targets, paths, _ = collate_plans(planned[:2])
    images, same_targets, same_paths = DeviceAugment(torch.device("cpu"))(0, 0, batch, targets, paths)
    assert isinstance(batch, PlanBatch) and batch.shape == tuple(images.shape)
    assert same_targets is targets and same_paths == paths and images.dtype == torch.uint8


def test_a_worker_builds_the_plans_pixels_in_shared_memory(split, monkeypatch):
    """In a loader worker the batch's pixels are written straight into shared memory (sending a batch from ordinary
    memory copies it there first); in the training process they stay in ordinary memory. The same bytes either way."""
    import utils.data.plans as plans

    _, planned = both_paths(split, SCRATCH, False, epoch=0)
    here = collate_plans(planned[:3])[0]
    monkeypatch.setattr(plans, "get_worker_info", lambda: object())
    in_worker = collate_plans(planned[:3])[0]
    assert in_worker.pixels.is_shared() and not here.pixels.is_shared()
    assert torch.equal(in_worker.pixels, here.pixels) and here.pixels.numel() > 0


@pytest.mark.parametrize("workers, partners", [(0, "dataset"), (2, "dataset"), (0, "batch")])
def test_loader_hands_over_plans_and_keeps_the_opencv_loader_as_it_was(split, workers, partners):
    common = {"hyp": SCRATCH.replace(mixup=0.5), "augment": True, "workers": workers, "shuffle": True, "seed": 3,
              "labels": split, "mosaic_partners": partners}  # batches of 4: "batch" draws partners from the batch
    plain, _ = create_dataloader(None, SIZE, 4, 32, **common)
    planned, dataset = create_dataloader(None, SIZE, 4, 32, augment_device=True, **common)
    assert isinstance(dataset, PlanDataset)
    for loader in (plain, planned):
        set_loader_epoch(loader, 1)
    for (images, targets, paths, _), (batch, plan_targets, plan_paths, _) in zip(plain, planned):
        assert isinstance(images, torch.Tensor) and isinstance(batch, PlanBatch)
        assert torch.equal(plan_targets, targets) and plan_paths == paths
        for got, want in zip(render_plans(batch), images):
            assert_close(got, want)


def test_quad_takes_the_rendered_batch(tmp_path):
    """--quad after --augment-device (the trainer chains them in this order): quad groups the rendered images."""
    from utils.data.quad import QuadBatches
    from utils.trainer.trainer import chained

    split = make_split(tmp_path, sizes=SIZES * 2, suffix=".jpg")  # 12 images: quad groups 4
    _, planned = both_paths(split, SCRATCH, False, epoch=0)
    batch, targets, paths, _ = collate_plans(planned[:8])
    transform = chained([DeviceAugment(torch.device("cpu")), None, QuadBatches(seed=0, rank=-1)])
    images, quad_targets, quad_paths = transform(0, 0, batch, targets, paths)
    assert images.shape == (2, 3, 2 * SIZE, 2 * SIZE) and images.dtype == torch.uint8 and len(quad_paths) == 2
    assert chained([None, None]) is None


def test_mixup_plans_blend_as_opencv_blends():
    from utils.data.device_augment import blend_step

    rng = np.random.default_rng(5)
    first, second = (rng.integers(0, 256, (2, 24, 40, 3), dtype=np.uint8) for _ in range(2))
    ratios = np.array([rng.beta(32.0, 32.0) for _ in range(2)])
    expected = [cv2.addWeighted(first[k], ratios[k], second[k], 1.0 - ratios[k], 0.0) for k in range(2)]
    layers = torch.from_numpy(np.concatenate((first, second)))
    blend_step(layers, torch.tensor([[0, 2], [1, 3]]), torch.from_numpy(ratios), torch.device("cpu"))
    assert np.array_equal(layers[:2].numpy(), np.stack(expected))


@pytest.mark.slow
def test_training_renders_on_the_device_plots_the_rendered_batches_and_resumes_exactly(tmp_path, monkeypatch):
    """A tiny run with --augment-device: the model and train_batch0.jpg get the rendered uint8 images, and 2 epochs
    straight equal 1 epoch + --resume (the renderer is deterministic, the draws are a function of (seed, epoch,
    index))."""
    import train as train_script
    from tests.conftest import make_tiny_run
    from tests.test_resume import StopAfterEpoch, full_state, max_difference
    from utils import drawing
    from utils.trainer import stages, trainer

    data, cfg = make_tiny_run(tmp_path, num_train=8)
    plotted = []
    original_plot = drawing.plot_images

    def plot_spy(images, *args, **kwargs):
        plotted.append(images)
        return original_plot(images, *args, **kwargs)
    monkeypatch.setattr(drawing, "plot_images", plot_spy)
    monkeypatch.setattr(stages, "strip_checkpoint", lambda path: None)

    def args(name):
        return ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "4",
                "--epochs", "2", "--workers", "0", "--device", "cpu", "--project", str(tmp_path / "runs"), "--name",
                name, "--noautoanchor", "--augment-device", "--noval"]
    assert train_script.main(args("straight")) == 0
    first = plotted[0]  # train_batch0.jpg (validation draws its own plots later)
    assert isinstance(first, torch.Tensor) and first.dtype == torch.uint8 and tuple(first.shape) == (4, 3, 64, 64)
    assert (tmp_path / "runs" / "straight" / "train_batch0.jpg").exists()
    callbacks = trainer.Callbacks
    monkeypatch.setattr(trainer, "Callbacks", lambda: StopAfterEpoch(0, "crash"))
    assert train_script.main(args("resumed")) == 130
    monkeypatch.setattr(trainer, "Callbacks", callbacks)
    last = tmp_path / "runs" / "resumed" / "weights" / "last.pt"
    assert train_script.main(["--resume", str(last)]) == 0
    straight, _ = full_state(tmp_path / "runs" / "straight" / "weights" / "last.pt")
    assert max_difference(straight, full_state(last)[0]) == 0.0


def test_pinning_a_plan_batch_pins_its_pixels_only(split, monkeypatch):
    _, planned = both_paths(split, SCRATCH, False, epoch=0)
    batch = collate_plans(planned[:2])[0]
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self.clone())  # no CUDA here
    pinned = batch.pin_memory()
    assert pinned.pixels is not batch.pixels and torch.equal(pinned.pixels, batch.pixels)
    assert pinned.tiles is batch.tiles and pinned.size == batch.size


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.py runs the cuda tests)")
def test_rendering_on_cuda_matches_the_opencv_path_and_never_waits_for_the_gpu(split, segmented):
    """The same tolerance on CUDA, and no host-device synchronisation inside render_plans (the plan's decisions
    are all read from its host tensors; copies to the device do not wait)."""
    device = torch.device("cuda")
    cases = [(split, *CASES[name]) for name in ("mosaic, mixup", "mosaic, perspective, rotation, shear, up-down flips",
                                               "letterbox (mosaic 0)")]
    for data, hyp, rect in [*cases, (segmented, SCRATCH.replace(copy_paste=1.0, mixup=0.5), False)]:
        expected, planned = both_paths(data, hyp, rect, epoch=1)
        batch = collate_plans(planned)[0].pin_memory()
        render_plans(batch, device)  # the HSV tables are made and copied once per device, before the check
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            rendered = render_plans(batch, device)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        for got, want in zip(rendered.cpu(), collate(expected)[0]):
            assert_close(got, want)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.py runs the cuda tests)")
def test_the_scalar_codes_pixels_on_cuda_equal_the_cpus_and_never_wait_for_the_gpu():
    """At width 100 (a tail past OpenCV 5.0's and 5.1's blocks) with a left-right flip: CUDA's colour step equals
    the CPU's to the bit, and taking the scalar code's pixels does not wait for the device."""
    rng = np.random.default_rng(5)
    frame = torch.from_numpy(rng.integers(0, 256, (2, 20, 100, 3), dtype=np.uint8))
    gains = hsv_gains(0.015, 0.7, 0.4, np.random.default_rng(4))
    tables = torch.from_numpy(np.stack([hsv_lut(gains)[:, 0]] * 2))
    args = (tables, torch.tensor([True, True]), torch.tensor([[100, 20], [100, 20]]), torch.tensor([[0, 0], [0, 1]],
            dtype=torch.bool))
    assert device_augment.scalar_step_positions(frame.shape[:3], *args[1:]) is not None
    expected = colour_step(frame, args[0], args[1], torch.device("cpu"), *args[2:])
    device = torch.device("cuda")
    colour_step(frame.to(device), args[0], args[1], device, *args[2:])  # the tables, made and copied once
    on_device = frame.to(device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = colour_step(on_device, args[0], args[1], device, *args[2:])
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(got.cpu(), expected)


def test_render_ops_counts_operations_and_the_bytes_they_move(split):
    """benchmarks/render_ops.py's counter: every operation, and per kind of non-view operation its tensors' bytes in and
    out (an add of two 1,000-float tensors moves 12,000 bytes); a rendering's canvas warp is there, and the whole
    rendering moves more than its images."""
    from benchmarks.dispatch_count import OperationCount

    with OperationCount() as count:
        torch.ones(1000).add(torch.ones(1000)).view(10, 100)
    assert count.bytes_by_kind["add"] == [1, 12000] and "view" not in count.bytes_by_kind
    assert count.operations == 4  # two ones, the add, the view
    _, planned = both_paths(split, *CASES["mosaic"], epoch=0)
    with OperationCount() as count:
        rendered = render_plans(collate_plans(planned)[0])
    assert count.bytes_by_kind["grid_sampler_2d"][0] >= 1
    assert count.total_bytes() > 10 * rendered.numel()
