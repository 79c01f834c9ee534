"""utils/autoanchor.py: fit metrics on hand-made boxes, k-means + genetic search, level assignment, model updates."""
from __future__ import annotations

import copy
import logging

import numpy as np
import pytest
import torch
import yaml

from models import build_model
from models.yolo import DetectionModel
from tests.conftest import TINY_MODEL_YAML
from utils.autoanchor import (AnchorError, anchor_fit, anchor_fitness, anchor_pixels, anchor_ratios, adapt_anchors,
                              format_anchors, evolve_anchors, label_wh, set_anchors, write_anchors_yaml)
from utils.checkpoint import model_state
from utils.errors import UserError

GENERATIONS = 200  # enough to see the search work, fast on a shared CPU


def tiny_config(anchors=None) -> dict:
    config = yaml.safe_load(TINY_MODEL_YAML)
    config["width_multiple"] = 0.0625
    if anchors is not None:
        config["anchors"] = anchors
    return config


@pytest.fixture(scope="module")
def built():
    return DetectionModel(tiny_config())


@pytest.fixture
def model(built):
    return copy.deepcopy(built)


def elongated_dataset(count: int = 300, seed: int = 0):
    """One 640x640 image whose boxes are 10:1 wide bars, 20-100 px long at imgsz 320."""
    rng = np.random.default_rng(seed)
    width = rng.uniform(40, 200, count) / 640
    boxes = np.c_[np.zeros(count), np.full(count, 0.5), np.full(count, 0.5), width, width / 10]
    return [boxes.astype(np.float32)], np.array([[640, 640]])


# ----------------------------------------------------------------------------- metrics, hand-computed
def test_anchor_fit_hand_computed():
    wh = np.array([[10, 10], [40, 10], [100, 100]], dtype=float)
    anchors = np.array([[10, 10], [20, 20]], dtype=float)
    # box 1: r = 1 and 0.5 (both > 1/4); box 2: 0.25 (not > 1/4) and 0.5; box 3: 0.1 and 0.2
    np.testing.assert_allclose(anchor_ratios(wh, anchors), [[1, 0.5], [0.25, 0.5], [0.1, 0.2]])
    bpr, per_target = anchor_fit(anchors, wh, thr=4.0)
    assert bpr == pytest.approx(2 / 3)
    assert per_target == pytest.approx((2 + 1 + 0) / 3)
    assert anchor_fitness(anchors, wh, thr=4.0) == pytest.approx((1 + 0.5 + 0) / 3)
    # a looser threshold (anchor_t 6) takes the third box's 0.2 in
    assert anchor_fit(anchors, wh, thr=6.0) == pytest.approx((1.0, (2 + 2 + 1) / 3))


def test_label_wh_scales_long_side_and_jitters_reproducibly():
    labels = [np.array([[0, 0.5, 0.5, 0.5, 0.25]]), np.zeros((0, 5)), np.array([[1, 0.2, 0.2, 0.1, 1.0]])]
    shapes = np.array([[800, 400], [100, 100], [300, 600]])  # (width, height)
    np.testing.assert_allclose(label_wh(labels, shapes, 320), [[160, 40], [16, 320]])
    jittered = label_wh(labels, shapes, 320, np.random.default_rng(3))
    ratio = jittered / [[160, 40], [16, 320]]
    assert np.all((ratio >= 0.9) & (ratio <= 1.1))
    assert ratio[0, 0] == pytest.approx(ratio[0, 1])  # one factor per image
    np.testing.assert_array_equal(jittered, label_wh(labels, shapes, 320, np.random.default_rng(3)))


# ----------------------------------------------------------------------------- k-means + genetic search
def test_search_improves_elongated_boxes_and_never_loses_fitness():
    labels, shapes = elongated_dataset()
    wh = label_wh(labels, shapes, 320)
    default = np.array(tiny_config()["anchors"], dtype=float).reshape(-1, 2)
    bpr_default, _ = anchor_fit(default, wh, 4.0)
    assert bpr_default < 0.9  # 10:1 bars do not fit the COCO anchors
    start = evolve_anchors(wh, 9, 320, 4.0, generations=0, seed=1, progress=False)
    refined = evolve_anchors(wh, 9, 320, 4.0, generations=GENERATIONS, seed=1, progress=False)
    assert refined.shape == (9, 2) and np.all(refined >= 2.0)
    assert np.all(np.diff(refined.prod(1)) >= 0)  # sorted by area
    assert anchor_fitness(refined, wh, 4.0) >= anchor_fitness(start, wh, 4.0)
    assert anchor_fit(refined, wh, 4.0)[0] >= 0.98


def test_fewer_distinct_boxes_than_anchors():
    wh = np.array([[30.0, 60.0]] * 50 + [[200.0, 20.0]] * 50)
    anchors = evolve_anchors(wh, 9, 320, 4.0, generations=50, seed=0, progress=False)
    assert anchors.shape == (9, 2) and np.all(np.isfinite(anchors)) and np.all(anchors >= 2.0)
    assert anchor_fit(anchors, wh, 4.0)[0] == 1.0
    single = evolve_anchors(np.array([[12.0, 7.0]]), 9, 320, 4.0, generations=10, seed=0, progress=False)
    assert single.shape == (9, 2) and anchor_fit(single, np.array([[12.0, 7.0]]), 4.0)[0] == 1.0


def test_kmeans_returning_fewer_centroids_or_failing_is_filled(monkeypatch):
    import scipy.cluster.vq

    wh = np.random.default_rng(0).uniform(5, 100, (200, 2))
    monkeypatch.setattr(scipy.cluster.vq, "kmeans", lambda obs, k, **kwargs: (obs[:4].copy(), 0.0))
    anchors = evolve_anchors(wh, 9, 320, 4.0, generations=0, seed=0, progress=False)
    assert anchors.shape == (9, 2) and len(np.unique(anchors, axis=0)) == 9  # copies are jittered apart

    def failing(obs, k, **kwargs):
        raise ValueError("k-means failed")

    monkeypatch.setattr(scipy.cluster.vq, "kmeans", failing)
    anchors = evolve_anchors(wh, 9, 320, 4.0, generations=0, seed=0, progress=False)
    assert anchors.shape == (9, 2) and np.all(anchors >= 2.0) and np.all(anchors <= 320)


def test_tiny_boxes_are_left_out_of_kmeans_and_reported(caplog):
    wh = np.array([[1.0, 1.5]] * 20 + [[50.0, 40.0]] * 20 + [[2.5, 30.0]] * 20)
    with caplog.at_level(logging.WARNING, logger="utils.autoanchor"):
        anchors = evolve_anchors(wh, 2, 320, 4.0, generations=0, seed=0, progress=False)
    assert "40 of 60 boxes are smaller than 3 pixels" in caplog.text
    assert np.all(anchors >= 2.0)  # the 1 x 1.5 boxes did not pull a centroid under the floor


def test_time_limit_stops_the_search(caplog):
    wh = np.random.default_rng(0).uniform(5, 100, (100, 2))
    with caplog.at_level(logging.WARNING, logger="utils.autoanchor"):
        evolve_anchors(wh, 9, 320, 4.0, generations=10 ** 6, seed=0, time_limit=0.0, progress=False)
    assert "stopped after 1 of 1000000 generations" in caplog.text


# ----------------------------------------------------------------------------- the model
def test_check_anchors_adopts_better_anchors_in_pixel_level_order(model):
    labels, shapes = elongated_dataset()
    report = adapt_anchors(model, labels, shapes, 320, generations=GENERATIONS, progress=False)
    assert report.adopted and report.boxes == 300
    assert report.bpr_before < 0.9 <= 0.98 <= report.bpr_after
    assert report.anchors_per_target_after > report.anchors_per_target_before
    detect = model.model[-1]
    pixels = anchor_pixels(model)
    areas = pixels.prod(-1)  # (levels, anchors)
    assert detect.stride.tolist() == [8, 16, 32]
    assert areas[0].max() <= areas[1].min() and areas[1].max() <= areas[2].min()
    np.testing.assert_allclose(pixels, np.array(report.anchors), atol=1e-4)
    expected_grid = torch.tensor(report.anchors, dtype=torch.float32) / detect.stride.view(-1, 1, 1)
    assert torch.equal(detect.anchors, expected_grid)
    assert model.yaml["anchors"] == [sum(level, []) for level in report.anchors]


def test_levels_follow_stride_not_the_head_order():
    """A head listing P5, P4, P3 gets its largest anchors on its first level (stride 32)."""
    config = tiny_config()
    config["head"][-1][0] = [23, 20, 17]
    config["anchors"] = config["anchors"][::-1]
    model = DetectionModel(config)
    assert model.stride.tolist() == [32, 16, 8]
    anchors = [[w, w / 2] for w in (64, 8, 32, 4, 128, 16, 256, 2, 512)]
    set_anchors(model, anchors)
    pixels = anchor_pixels(model)
    np.testing.assert_allclose(pixels[2], [[2, 1], [4, 2], [8, 4]])  # stride 8
    np.testing.assert_allclose(pixels[0], [[128, 64], [256, 128], [512, 256]])  # stride 32
    np.testing.assert_allclose(model.model[-1].anchors[0].numpy(), [[4, 2], [8, 4], [16, 8]])  # grid: / 32
    rebuilt = DetectionModel(model.yaml)  # the stored YAML rebuilds the same buffer (no level flip)
    assert torch.equal(rebuilt.model[-1].anchors, model.model[-1].anchors)


def test_adopted_anchors_survive_a_checkpoint(model):
    labels, shapes = elongated_dataset()
    adapt_anchors(model, labels, shapes, 320, generations=50, progress=False)
    entry = model_state(model)
    rebuilt = build_model(entry)
    assert torch.equal(rebuilt.model[-1].anchors, model.model[-1].anchors)
    from_yaml_only = DetectionModel(entry["yaml"])
    assert torch.equal(from_yaml_only.model[-1].anchors, model.model[-1].anchors)


def test_placeholder_count_gets_real_anchors():
    model = DetectionModel(tiny_config(anchors=3))
    assert model.anchors_placeholder
    labels, shapes = elongated_dataset(count=100)
    report = adapt_anchors(model, labels, shapes, 320, generations=50, progress=False)
    assert report.adopted and report.bpr_before is None and report.bpr_after >= 0.98
    assert not model.anchors_placeholder
    assert [len(level) for level in model.yaml["anchors"]] == [6, 6, 6]
    rebuilt = DetectionModel(model.yaml)
    assert not rebuilt.anchors_placeholder
    assert torch.equal(rebuilt.model[-1].anchors, model.model[-1].anchors)


def test_worse_search_result_is_not_adopted(model, monkeypatch):
    import utils.autoanchor as autoanchor

    labels, shapes = elongated_dataset()
    before = model.model[-1].anchors.clone()
    monkeypatch.setattr(autoanchor, "evolve_anchors", lambda wh, n, *args, **kwargs: np.full((n, 2), 2.0))
    report = adapt_anchors(model, labels, shapes, 320, progress=False)
    assert not report.adopted and report.bpr_after == report.bpr_before
    assert torch.equal(model.model[-1].anchors, before)
    assert model.yaml["anchors"] == tiny_config()["anchors"]


def square_and_hopeless(square: int, hopeless: int):
    """Boxes of 10 x 10 px, which the test model's anchors cover, and 300 x 1 px ones that no anchor covers."""
    boxes = [[0, 0.5, 0.5, 10 / 320, 10 / 320]] * square + [[0, 0.5, 0.5, 300 / 320, 1 / 320]] * hopeless
    return [np.array(boxes)], [[320, 320]]


def test_anchors_of_the_same_recall_are_not_adopted_even_if_fitter(model, monkeypatch):
    """As YOLOv5's adapt_anchors: new anchors replace the model's only when their best possible recall is higher."""
    import utils.autoanchor as autoanchor

    labels, shapes = square_and_hopeless(90, 10)
    before = model.model[-1].anchors.clone()
    monkeypatch.setattr(autoanchor, "evolve_anchors", lambda wh, n, *args, **kwargs: np.full((n, 2), 10.0))
    wh = label_wh(labels, shapes, 320)
    assert anchor_fitness(np.full((9, 2), 10.0), wh, 4.0) > anchor_fitness(anchor_pixels(model).reshape(-1, 2), wh, 4.0)
    report = adapt_anchors(model, labels, shapes, 320, progress=False)
    assert report.bpr_before == pytest.approx(0.9) and not report.adopted
    assert torch.equal(model.model[-1].anchors, before)


def test_a_recall_of_exactly_098_searches_and_k_means_fits_the_exact_sizes(model, monkeypatch):
    """YOLOv5 searches unless the recall is above 0.98; k-means gets the box sizes without the check's jitter."""
    import utils.autoanchor as autoanchor

    labels, shapes = square_and_hopeless(49, 1)
    fitted = []

    def record(wh, n, *args, **kwargs):
        fitted.append(np.array(wh))
        return anchor_pixels(model).reshape(-1, 2)

    monkeypatch.setattr(autoanchor, "evolve_anchors", record)
    report = adapt_anchors(model, labels, shapes, 320, progress=False)
    assert report.bpr_before == pytest.approx(0.98) and len(fitted) == 1
    np.testing.assert_array_equal(fitted[0], label_wh(labels, shapes, 320))


def test_good_anchors_are_kept_without_search(model, monkeypatch):
    import utils.autoanchor as autoanchor

    def must_not_run(*args, **kwargs):
        raise AssertionError("k-means ran although the anchors fit")

    monkeypatch.setattr(autoanchor, "evolve_anchors", must_not_run)
    boxes = np.array([[0, 0.5, 0.5, 30 / 320, 60 / 320], [0, 0.5, 0.5, 100 / 320, 80 / 320]])
    report = adapt_anchors(model, [boxes], [[640, 640]], 320, progress=False)
    assert not report.adopted and report.bpr_before == report.bpr_after == 1.0
    assert "good fit" in report.message


def test_seeded_runs_are_reproducible(built):
    labels, shapes = elongated_dataset()
    first, second = copy.deepcopy(built), copy.deepcopy(built)
    one = adapt_anchors(first, labels, shapes, 320, seed=5, generations=100, progress=False)
    two = adapt_anchors(second, labels, shapes, 320, seed=5, generations=100, progress=False)
    assert one.anchors == two.anchors and torch.equal(first.model[-1].anchors, second.model[-1].anchors)


def test_no_boxes(model):
    labels, shapes = [np.zeros((0, 5)), np.zeros((0, 5))], [[640, 480], [320, 320]]
    before = model.model[-1].anchors.clone()
    report = adapt_anchors(model, labels, shapes, 320, progress=False)
    assert report.boxes == 0 and not report.adopted and "no boxes" in report.message
    assert torch.equal(model.model[-1].anchors, before)
    placeholder = DetectionModel(tiny_config(anchors=3))
    with pytest.raises(AnchorError) as error:
        adapt_anchors(placeholder, labels, shapes, 320, progress=False)
    assert isinstance(error.value, UserError) and "\n" not in str(error.value)


def test_format_and_write_anchors(model, tmp_path):
    text = format_anchors(model)
    assert text.splitlines()[1].split() == ["P3/8:", "10x13,", "16x30,", "33x23"]
    set_anchors(model, np.array(tiny_config()["anchors"]).reshape(-1, 2) * 1.5)
    path = write_anchors_yaml(model, tmp_path / "run" / "anchors.yaml")
    content = yaml.safe_load(path.read_text())
    assert content["strides"] == [8, 16, 32]
    assert content["anchors"] == model.yaml["anchors"]
    assert content["anchors"] == [[15, 19.5, 24, 45, 49.5, 34.5], [45, 91.5, 93, 67.5, 88.5, 178.5],
                                  [174, 135, 234, 297, 559.5, 489]]
    assert "P5/32: 174x135, 234x297, 559.5x489" in format_anchors(model)


def test_bccd_default_anchors_fit(shared):
    """BCCD's blood cells at 320: the COCO anchors already fit (no search needed)."""
    from utils.data.dataset_yaml import load_data_config
    from utils.data.verify import scan_split

    config = load_data_config(shared("datasets", "bccd", "data.yaml", why="a fact about a real dataset (BCCD)"))
    split = scan_split(config.train, config.nc, workers=1, use_cache=False)
    wh = label_wh(split.labels, split.shapes, 320, np.random.default_rng(0))
    bpr, _ = anchor_fit(np.array(tiny_config()["anchors"]).reshape(-1, 2), wh, 4.0)
    assert len(wh) > 1000 and bpr > 0.98
