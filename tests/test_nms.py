"""NMS on hand-made predictions (cx, cy, w, h, obj, class scores)."""
import pytest
import torch

from utils.nms import MAX_NMS, non_max_suppression


def make_pred(rows, nc=3):
    """rows: (cx, cy, w, h, obj, class_index, class_score) -> (1, n, 5 + nc) prediction."""
    pred = torch.zeros(1, len(rows), 5 + nc)
    for i, (cx, cy, w, h, obj, cls, score) in enumerate(rows):
        pred[0, i, :5] = torch.tensor([cx, cy, w, h, obj])
        pred[0, i, 5 + cls] = score
    return pred


def test_overlapping_same_class_suppressed_keeps_best():
    pred = make_pred([(50, 50, 20, 20, 0.9, 0, 1.0), (52, 50, 20, 20, 0.8, 0, 1.0), (150, 150, 20, 20, 0.7, 0, 1.0)])
    (det,) = non_max_suppression(pred)
    assert det.shape == (2, 6)
    expected = torch.tensor([[40, 40, 60, 60, 0.9, 0], [140, 140, 160, 160, 0.7, 0]])
    assert torch.allclose(det, expected)


def test_different_classes_kept_class_aware_suppressed_agnostic():
    pred = make_pred([(50, 50, 20, 20, 0.9, 0, 1.0), (51, 50, 20, 20, 0.8, 1, 1.0)])
    (aware,) = non_max_suppression(pred)
    assert aware[:, 5].tolist() == [0.0, 1.0]
    (agnostic,) = non_max_suppression(pred, agnostic=True)
    assert agnostic.shape[0] == 1 and agnostic[0, 5].item() == 0.0


def test_confidence_is_objectness_times_class_score_and_filtered():
    # 0.9 * 0.5 = 0.45 passes 0.25; 0.5 * 0.4 = 0.2 fails though obj passes; obj 0.2 fails first.
    pred = make_pred([(50, 50, 20, 20, 0.9, 0, 0.5), (150, 50, 20, 20, 0.5, 1, 0.4), (50, 150, 20, 20, 0.2, 2, 1.0)])
    (det,) = non_max_suppression(pred, conf_thres=0.25)
    assert det.shape[0] == 1
    assert det[0, 4].item() == pytest.approx(0.45)
    (low,) = non_max_suppression(pred, conf_thres=0.1)
    assert sorted(low[:, 5].tolist()) == [0.0, 1.0, 2.0]


def test_multi_label_keeps_every_class_above_threshold():
    pred = torch.zeros(1, 1, 8)
    pred[0, 0, :5] = torch.tensor([50, 50, 20, 20, 1.0])
    pred[0, 0, 5:] = torch.tensor([0.9, 0.6, 0.1])
    (single,) = non_max_suppression(pred, conf_thres=0.25)
    assert single[:, 5].tolist() == [0.0]
    (multi,) = non_max_suppression(pred, conf_thres=0.25, multi_label=True)
    assert multi[:, 5].tolist() == [0.0, 1.0]
    assert multi[:, 4].tolist() == pytest.approx([0.9, 0.6])
    assert torch.equal(multi[0, :4], multi[1, :4])


def test_max_det_keeps_highest_confidence():
    rows = [(20 + 30 * i, 50, 10, 10, 0.3 + 0.05 * i, 0, 1.0) for i in range(10)]
    (det,) = non_max_suppression(make_pred(rows), max_det=3)
    assert det.shape[0] == 3
    assert det[:, 4].tolist() == pytest.approx([0.75, 0.7, 0.65])


def test_classes_filter():
    pred = make_pred([(50, 50, 20, 20, 0.9, 0, 1.0), (150, 50, 20, 20, 0.8, 1, 1.0), (250, 50, 20, 20, 0.7, 2, 1.0)])
    (det,) = non_max_suppression(pred, classes=[1, 2])
    assert det[:, 5].tolist() == [1.0, 2.0]


def test_empty_input_and_nothing_above_threshold():
    out = non_max_suppression(torch.zeros(2, 0, 8))
    assert len(out) == 2 and all(d.shape == (0, 6) for d in out)
    out = non_max_suppression(torch.full((1, 5, 8), 0.1))
    assert out[0].shape == (0, 6)


def test_batch_images_are_independent_and_tuple_input_accepted():
    a = make_pred([(50, 50, 20, 20, 0.9, 0, 1.0)])
    b = make_pred([(50, 50, 20, 20, 0.1, 0, 1.0)])
    out = non_max_suppression((torch.cat((a, b)), None))
    assert [d.shape[0] for d in out] == [1, 0]


def test_candidates_capped_before_nms():
    n = MAX_NMS + 100
    pred = torch.zeros(1, n, 6)
    pred[0, :, 0] = torch.arange(n, dtype=torch.float32) * 2  # disjoint 1-px boxes
    pred[0, :, 1] = 10
    pred[0, :, 2:4] = 1
    pred[0, :, 4] = torch.linspace(0.3, 0.9, n)
    pred[0, :, 5] = 1
    (det,) = non_max_suppression(pred, max_det=n)
    assert det.shape[0] == MAX_NMS
    assert det[:, 4].min() >= pred[0, 100, 4]


@pytest.mark.parametrize("kwargs", [{"conf_thres": 1.5}, {"iou_thres": -0.1}])
def test_invalid_thresholds_raise(kwargs):
    with pytest.raises(ValueError, match="in \\[0, 1\\]"):
        non_max_suppression(torch.zeros(1, 1, 6), **kwargs)


def test_half_input_gives_float_output():
    pred = make_pred([(50, 50, 20, 20, 0.9, 0, 1.0)]).half()
    (det,) = non_max_suppression(pred)
    assert det.dtype == torch.float32 and det.shape[0] == 1


@pytest.mark.parametrize("iou_thres,max_det", [(0.6, 300), (0.45, 1000), (0.7, 50)])
def test_chunked_greedy_nms_equals_one_torchvision_pass(iou_thres, max_det):
    import torchvision

    from utils.nms import NMS_CHUNK, _greedy_nms

    g = torch.Generator().manual_seed(0)
    n = NMS_CHUNK * 8 + 37  # many chunks, dense clusters (many suppressions) and loners
    centres = torch.rand(40, 2, generator=g) * 300
    xy = centres[torch.randint(0, 40, (n,), generator=g)] + torch.randn(n, 2, generator=g) * 6
    wh = 10 + torch.rand(n, 2, generator=g) * 30
    boxes = torch.cat((xy - wh / 2, xy + wh / 2), 1)
    scores = torch.rand(n, generator=g)
    expected = torchvision.ops.nms(boxes, scores, iou_thres)[:max_det]
    assert torch.equal(_greedy_nms(boxes, scores, iou_thres, max_det), expected)


@pytest.mark.parametrize("iou_thres,max_det", [(0.6, 300), (0.45, 1000)])
def test_class_aware_chunked_nms_equals_one_offset_pass(iou_thres, max_det):
    """Class by class (torchvision's batched_nms) in chunks = one greedy pass in which each class's boxes
    are moved to their own region (boxes of different classes can then never overlap)."""
    import torchvision

    from utils.nms import NMS_CHUNK, _greedy_nms

    g = torch.Generator().manual_seed(1)
    n = NMS_CHUNK * 4 + 11
    centres = torch.rand(30, 2, generator=g) * 300
    xy = centres[torch.randint(0, 30, (n,), generator=g)] + torch.randn(n, 2, generator=g) * 6
    wh = 10 + torch.rand(n, 2, generator=g) * 30
    boxes = torch.cat((xy - wh / 2, xy + wh / 2), 1)
    scores = torch.rand(n, generator=g)
    classes = torch.randint(0, 3, (n,), generator=g)
    expected = torchvision.ops.nms(boxes + classes[:, None] * 10_000.0, scores, iou_thres)[:max_det]
    actual = _greedy_nms(boxes, scores, iou_thres, max_det, classes)
    assert torch.equal(actual, expected)
    assert not torch.equal(_greedy_nms(boxes, scores, iou_thres, max_det), expected)  # agnostic differs


def _clustered_boxes(n, clusters, spread, seed):
    g = torch.Generator().manual_seed(seed)
    centres = torch.rand(clusters, 2, generator=g) * 600
    xy = centres[torch.randint(0, clusters, (n,), generator=g)] + torch.randn(n, 2, generator=g) * spread
    wh = 10 + torch.rand(n, 2, generator=g) * 30
    return torch.cat((xy - wh / 2, xy + wh / 2), 1), torch.rand(n, generator=g), g


@pytest.mark.parametrize("clusters,spread", [(2000, 2.0), (400, 8.0), (20, 6.0)],
                         ids=["most-survive", "half-survive", "few-survive"])
@pytest.mark.parametrize("aware", [False, True])
@pytest.mark.parametrize("ties", [False, True])
def test_chunked_nms_equals_one_pass_at_any_survival_rate(clusters, spread, aware, ties):
    """Chunk sizes follow the survival rate (small chunks when most boxes survive, growing ones when few
    do); the kept boxes and their order equal one greedy pass over all candidates whatever the rate, also
    when many scores are equal (as bf16 outputs are): equal scores go in candidate order."""
    import torchvision

    from utils.nms import _greedy_nms

    boxes, scores, g = _clustered_boxes(3000, clusters, spread, seed=clusters)
    if ties:
        scores = (scores * 16).floor() / 16
    classes = torch.randint(0, 3, (3000,), generator=g) if aware else None
    offset = classes[:, None] * 10_000.0 if aware else 0.0
    for max_det in (300, 1000):
        expected = torchvision.ops.nms(boxes + offset, scores, 0.6)[:max_det]
        assert torch.equal(_greedy_nms(boxes, scores, 0.6, max_det, classes), expected)


def test_chunked_nms_suppresses_at_the_threshold_as_torchvision_does():
    """A candidate in a later chunk whose IoU with a box kept from an earlier chunk is 0.6 in float32
    (0.6000000238...) is suppressed at iou_thres=0.6, as in one torchvision pass (which compares in double)."""
    import torchvision

    from utils.nms import _greedy_nms

    grid = torch.arange(10.0) * 50
    x, y = torch.meshgrid(grid, grid, indexing="ij")
    separate = torch.stack((x.flatten(), y.flatten(), x.flatten() + 10, y.flatten() + 10), 1)  # 100, apart
    twin = torch.tensor([[0.0, 0.0, 10.0, 6.0]])  # IoU 60 / 100 with the first box
    boxes = torch.cat((separate.repeat(4, 1), twin))  # 4 copies: the first chunk keeps 100 of its 300
    scores = torch.cat((torch.linspace(1.0, 0.5, 400), torch.tensor([0.1])))
    expected = torchvision.ops.nms(boxes, scores, 0.6)
    assert expected.shape[0] == 100  # torchvision drops the twin
    assert torch.equal(_greedy_nms(boxes, scores, 0.6, 300), expected)


@pytest.mark.parametrize("n", [40, 2500], ids=["offset-pass", "class-by-class"])
def test_batched_nms_keeps_what_torchvision_batched_nms_keeps(n):
    """Below 4,000 coordinates torchvision moves each class apart and runs one NMS, above it runs one NMS per
    class; _batched_nms makes the same choice, so the kept set is torchvision's to the index."""
    import torchvision

    from utils.nms import _batched_nms, _torchvision_nms

    boxes, scores, g = _clustered_boxes(n, max(n // 10, 2), 6.0, seed=n)
    classes = torch.randint(0, 4, (n,), generator=g)
    for iou_thres in (0.45, 0.7):
        expected = torchvision.ops.batched_nms(boxes, scores, classes, iou_thres).sort().values
        actual = _batched_nms(_torchvision_nms(), boxes, scores, classes, iou_thres).sort().values
        assert torch.equal(actual, expected)
    assert _batched_nms(_torchvision_nms(), boxes[:0], scores[:0], classes[:0], 0.5).shape == (0,)


def test_nms_runs_without_importing_the_torchvision_package():
    """torchvision's operator library is loaded directly: importing the package costs ~1.3-1.8 s (torch._dynamo)."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from utils.nms import non_max_suppression\n"
            "pred = torch.tensor([[[50., 50., 20., 20., 0.9, 1.0], [52., 50., 20., 20., 0.8, 1.0]]])\n"
            "(det,) = non_max_suppression(pred)\n"
            "assert det.shape[0] == 1, det\n"
            "print(sorted(m for m in ('torchvision', 'torch._dynamo') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=str(__import__("pathlib").Path(__file__).resolve().parents[1]))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_nms_falls_back_to_the_torchvision_package(monkeypatch):
    import importlib.util

    import torchvision

    import utils.nms as nms

    nms._torchvision_nms.cache_clear()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)
    try:
        assert nms._torchvision_nms() is torchvision.ops.nms
        pred = make_pred([(50, 50, 20, 20, 0.9, 0, 1.0), (52, 50, 20, 20, 0.8, 0, 1.0)])
        (det,) = non_max_suppression(pred)
        assert det.shape[0] == 1
    finally:
        monkeypatch.undo()
        nms._torchvision_nms.cache_clear()


def installed_metadata(monkeypatch, torch_version, torchvision_version):
    """importlib.metadata reports these versions (None: no metadata) for torch and torchvision."""
    import importlib.metadata

    real_version = importlib.metadata.version
    versions = {"torch": torch_version, "torchvision": torchvision_version}

    def version(name):
        if name not in versions:
            return real_version(name)
        if versions[name] is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return versions[name]

    monkeypatch.setattr(importlib.metadata, "version", version)


def nms_path(monkeypatch):
    """('library', path) or ('package', None): how _torchvision_nms got the operator, and its result."""
    import utils.nms as nms

    loaded = []
    real_load = torch.ops.load_library
    monkeypatch.setattr(torch.ops, "load_library", lambda path: (loaded.append(path), real_load(path)))
    nms._torchvision_nms.cache_clear()
    try:
        operator = nms._torchvision_nms()
        torch.manual_seed(0)
        pred = torch.rand(2, 500, 8) * torch.tensor([100.0, 100.0, 30.0, 30.0, 1.0, 1.0, 1.0, 1.0])
        return loaded, operator, non_max_suppression(pred, conf_thres=0.1, iou_thres=0.5)
    finally:
        nms._torchvision_nms.cache_clear()


@pytest.mark.parametrize("torch_version, torchvision_version, name", [
    ("2.14.1+cu130", "0.29.1+cu130", "_C_stable"), ("2.14.0", "0.29.0+cpu", "_C_stable"),
    ("2.11.0+cpu", "0.26.0", "_C"), ("2.0.1", "0.15.2", "_C")])
def test_known_version_pairs_name_the_library(monkeypatch, torch_version, torchvision_version, name):
    from utils.nms import _library_name

    installed_metadata(monkeypatch, torch_version, torchvision_version)
    assert _library_name() == name


@pytest.mark.parametrize("torch_version, torchvision_version", [
    ("2.15.0", "0.30.0"), ("2.14.1", "0.28.0"), ("2.14.1", "0.30.0"), ("3.0.0", "0.30.0"), ("1.13.1", "0.14.1"),
    ("2.14.1", None), (None, "0.29.1"), ("unknown", "0.29.1")])
def test_unknown_version_pairs_or_no_metadata_name_no_library(monkeypatch, torch_version, torchvision_version):
    from utils.nms import _library_name, _torchvision_library

    installed_metadata(monkeypatch, torch_version, torchvision_version)
    assert _library_name() is None
    assert _torchvision_library() is None


def test_known_pair_loads_the_library_unknown_pair_imports_the_package_same_detections(monkeypatch):
    """The pinned pair (with a local suffix) loads torchvision's operator library from the installed package;
    torch 2.15 with it is unknown, so torchvision is imported; both give the same detections."""
    from pathlib import Path

    import torchvision

    installed_metadata(monkeypatch, "2.14.1+cu130", "0.29.1+cu130")
    loaded, operator, library_detections = nms_path(monkeypatch)
    assert len(loaded) == 1 and operator is torch.ops.torchvision.nms
    assert Path(loaded[0]).parent == Path(torchvision.__file__).parent
    installed_metadata(monkeypatch, "2.15.0", "0.29.1+cu130")
    loaded, operator, package_detections = nms_path(monkeypatch)
    assert loaded == [] and operator is torchvision.ops.nms
    assert sum(det.shape[0] for det in library_detections) > 10
    assert all(torch.equal(a, b) for a, b in zip(library_detections, package_detections))
