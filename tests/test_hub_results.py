"""The torch.hub results' YOLOv5 methods (utils/hub_results.py): print, render, save, crop, show, tolist, and the
images kept as loaded, on the tiny model with raised biases so every image has detections."""
from __future__ import annotations

import logging
import re
import sys
import types
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

from tests.conftest import ROOT, save_random_checkpoint
from utils.drawing import colors, default_line_width, draw_box_label
from utils.hub import Detections, HubModel
from utils.paths import OutsideFolderError

NAMES = ["cat", "dog"]
SIZE = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    weights = save_random_checkpoint(tmp_path_factory.mktemp("hub_results") / "best.pt", NAMES, confident=True)
    loaded = torch.hub.load(str(ROOT), "custom", path=str(weights), source="local", device="cpu")
    loaded.amp, loaded.max_det = "off", 4
    return loaded


def picture(height: int, width: int, seed: int) -> np.ndarray:
    """A non-uniform RGB picture (so that drawn boxes change pixels)."""
    rng = np.random.default_rng(seed)
    image = np.full((height, width, 3), (40, 120, 200), np.uint8)
    cv2.circle(image, (width // 3, height // 2), min(height, width) // 4, (220, 30, 60), -1)
    return np.ascontiguousarray(image + rng.integers(0, 20, image.shape, dtype=np.uint8))


@pytest.fixture
def inputs(tmp_path):
    """A file (written BGR, as cv2 does), an RGB array and a PIL image without a file name, of different sizes."""
    from PIL import Image

    path = tmp_path / "inputs" / "street.png"
    path.parent.mkdir()
    on_disk = picture(70, 90, 0)
    cv2.imwrite(str(path), on_disk[:, :, ::-1])
    return [str(path), picture(80, 100, 1), Image.fromarray(picture(60, 110, 2))], [on_disk, None, None]


def expected_drawing(rgb: np.ndarray, det: torch.Tensor, labels: bool = True) -> np.ndarray:
    """What detect.py's drawing calls produce on a copy of ``rgb``, the most confident box drawn last (RGB)."""
    canvas = np.ascontiguousarray(rgb[:, :, ::-1])
    for *box, conf, cls in reversed(det.tolist()):
        draw_box_label(canvas, box, f"{NAMES[int(cls)]} {conf:.2f}" if labels else None, colors(int(cls), bgr=True))
    return canvas[:, :, ::-1]


def test_images_are_kept_as_loaded_in_rgb_and_by_reference(model, inputs):
    from PIL import Image

    items, (on_disk, _, _) = inputs
    results = model(items, size=SIZE)
    assert isinstance(model, HubModel) and isinstance(results, Detections) and len(results) == 3
    assert results.ims[1] is items[1]  # the caller's RGB array: referenced, not copied
    assert np.array_equal(results.ims[0], on_disk) and np.array_equal(results.ims[2], np.asarray(items[2]))
    assert all(im.dtype == np.uint8 and im.shape[2] == 3 for im in results.ims)
    assert [im.shape[:2] for im in results.ims] == [(70, 90), (80, 100), (60, 110)] == list(results.shapes)
    assert all(len(det) for det in results.xyxy)
    from_bgr = model(np.ascontiguousarray(items[1][:, :, ::-1]), size=SIZE, bgr=True)
    assert np.array_equal(from_bgr.ims[0], items[1]) and torch.equal(from_bgr.xyxy[0], results.xyxy[1])
    assert Image.fromarray(results.ims[0]).size == (90, 70)


def test_print_names_the_classes_and_gives_yolov5s_speed_line(model, inputs, capsys):
    items, _ = inputs
    results = model(items, size=SIZE)
    results.print()
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 4 and lines == str(results).splitlines()
    assert lines[0].startswith("image 1/3: 70x90 ") and lines[1].startswith("image 2/3: 80x100 ")  # YOLOv5's
    for line, det in zip(lines, results.xyxy):
        for cls in det[:, 5].unique().tolist():
            count = int((det[:, 5] == cls).sum())
            assert f"{count} {NAMES[int(cls)]}{'s' * (count > 1)}" in line
    assert lines[3].startswith("Speed: ") and "ms pre-process, " in lines[3] and "ms NMS per image at shape" in lines[3]
    assert lines[3].endswith(" at shape (3, 3, 64, 64)")  # the batch's shape: one for all three, as YOLOv5's
    assert len(results.t) == 3 and all(ms >= 0 for ms in results.t)


def test_render_draws_on_copies_with_detect_py_drawing(model, inputs):
    items, _ = inputs
    before = items[1].copy()
    results = model(items, size=SIZE)
    rendered = results.render()
    assert rendered is results.ims and np.array_equal(items[1], before)  # the caller's array is not drawn on
    assert results.loaded[1] is items[1]
    for image, original, det in zip(rendered, results.loaded, results.xyxy):
        assert image.shape == original.shape and image.flags.c_contiguous
        assert np.array_equal(image, expected_drawing(original, det))
        changed = (image != original).any(2)
        for x1, y1, x2, y2 in det[:, :4].long().tolist():  # each box's outline is drawn
            assert changed[y1:y2 + 1, x1].any() and changed[y1, x1:x2 + 1].any()
    plain = model(items[1], size=SIZE)
    image = plain.render(labels=False)[0]
    width = default_line_width(image.shape) + 1
    outside = np.ones(image.shape[:2], bool)
    for x1, y1, x2, y2 in plain.xyxy[0][:, :4].long().tolist():
        outside[max(y1 - width, 0):y2 + width + 1, max(x1 - width, 0):x2 + width + 1] = False
    assert not (image != items[1]).any(2)[outside].any()  # no labels: nothing drawn away from the boxes
    assert np.array_equal(plain.render(labels=False)[0], image)  # rendering again starts from the loaded image


def test_save_writes_labelled_images_into_a_new_run_folder_each_time(model, inputs, tmp_path, monkeypatch, caplog):
    items, _ = inputs
    monkeypatch.chdir(tmp_path)
    results = model(items, size=SIZE)
    with caplog.at_level(logging.INFO, logger="utils.hub_results"):
        first = results.save()
    assert first == Path("runs/detect/exp") and "Saved 3 images to runs/detect/exp" in caplog.text
    assert sorted(p.name for p in first.iterdir()) == ["image1.jpg", "image2.jpg", "street.jpg"]
    for name, original, det in zip(["street.jpg", "image1.jpg", "image2.jpg"], results.loaded, results.xyxy):
        written = cv2.imread(str(first / name))
        assert written is not None and written.shape == original.shape
        written, drawn = written.astype(int), expected_drawing(original, det)[:, :, ::-1].astype(int)
        assert np.abs(written - drawn).mean() < np.abs(written - original[:, :, ::-1].astype(int)).mean()
    assert results.save() == Path("runs/detect/exp2") and results.save(labels=False) == Path("runs/detect/exp3")
    assert results.save(exist_ok=True) == Path("runs/detect/exp")
    assert sorted(p.name for p in first.iterdir()) == ["image1.jpg", "image2.jpg", "street.jpg"]  # no temp files
    twice = model([items[1], items[1]], size=SIZE)
    twice.files = ["same.png", "same.png"]
    assert sorted(p.name for p in twice.save(save_dir=tmp_path / "out").iterdir()) == ["same.jpg", "same2.jpg"]


def test_crop_returns_yolov5s_dicts_and_writes_class_folders(model, inputs, tmp_path):
    items, _ = inputs
    results = model(items, size=SIZE)
    crops = results.crop(save_dir=tmp_path / "exp")
    assert len(crops) == sum(len(det) for det in results.xyxy)
    assert all(set(crop) == {"box", "conf", "cls", "label", "im"} for crop in crops)
    rows = [row for det in results.xyxy for row in reversed(det)]  # YOLOv5's order: each image's boxes reversed
    for crop, row, image in zip(crops, rows, [im for im, det in zip(results.loaded, results.xyxy) for _ in det]):
        assert torch.equal(torch.stack(crop["box"]), row[:4]) and crop["conf"] == row[4] and crop["cls"] == row[5]
        assert crop["label"] == f"{NAMES[int(row[5])]} {float(row[4]):.2f}"
        x1, y1, x2, y2 = row[:4].tolist()
        height, width = image.shape[:2]
        grown_w, grown_h = (x2 - x1) * 1.02 + 10, (y2 - y1) * 1.02 + 10  # YOLOv5's gain and pad
        left, top = max((x1 + x2 - grown_w) / 2, 0), max((y1 + y2 - grown_h) / 2, 0)
        right, bottom = min((x1 + x2 + grown_w) / 2, width), min((y1 + y2 + grown_h) / 2, height)
        assert abs(crop["im"].shape[1] - (right - left)) <= 1 and abs(crop["im"].shape[0] - (bottom - top)) <= 1
        rows_, cols_ = crop["im"].shape[:2]
        near = [(y, x) for y in range(max(int(top) - 1, 0), int(top) + 2) for x in range(max(int(left) - 1, 0),
                                                                                           int(left) + 2)]
        assert any(np.array_equal(crop["im"], image[y:y + rows_, x:x + cols_, ::-1]) for y, x in near)  # BGR
    written = sorted((tmp_path / "exp" / "crops").rglob("*.jpg"))
    assert len(written) == len(crops) and {p.parent.name for p in written} <= set(NAMES)
    assert all(re.fullmatch(r"(street|image1|image2)([2-9]|\d\d+)?", p.stem) for p in written)  # stem, stem2, ...
    for name in NAMES:
        count = sum(int(crop["cls"]) == NAMES.index(name) for crop in crops)
        assert len(list((tmp_path / "exp" / "crops" / name).glob("*.jpg"))) == count
    sizes = sorted(cv2.imread(str(p)).shape for p in written)
    assert sizes == sorted(crop["im"].shape for crop in crops)
    assert results.crop(save_dir=tmp_path / "exp")[0]["im"].shape == crops[0]["im"].shape
    assert (tmp_path / "exp2" / "crops").is_dir()  # a second run goes to exp2, as save()
    assert len(results.crop(save=False, save_dir=tmp_path / "none")) == len(crops)
    assert not (tmp_path / "none").exists()


def test_hostile_file_and_class_names_stay_inside_the_run_folder(model, tmp_path, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    cv2.imwrite(str(tmp_path / "x.jpg"), picture(50, 60, 3))
    monkeypatch.chdir(work)
    results = model(["../../x.jpg", *[picture(40, 40, 4)] * 4], size=SIZE)
    assert results.files[0] == "x.jpg"  # YOLOv5's: the base name, with .jpg
    results.files[1:] = ["/abs/evil.png", "..", "C:\\a\\b.png", "...."]
    results.names = ["../../evil", "dog"]
    folder = results.save(save_dir="out/exp")
    assert sorted(p.name for p in folder.iterdir()) == ["b.jpg", "evil.jpg", "image2.jpg", "image4.jpg", "x.jpg"]
    results.crop(save_dir="out/exp", exist_ok=True)
    everything = {p.relative_to(tmp_path).as_posix() for p in tmp_path.rglob("*") if p.is_file()}
    assert all(p.startswith("a/b/out/exp/") for p in everything - {"x.jpg"})
    assert {p.split("/")[5] for p in everything if "/crops/" in p} <= {"_.._evil", "dog"}
    planted = next((folder / "crops").iterdir())  # a class folder replaced by a link that leads elsewhere
    planted.rename(folder / "crops" / "moved")
    planted.symlink_to(tmp_path)
    with pytest.raises(OutsideFolderError, match="resolves outside"):
        results.crop(save_dir="out/exp", exist_ok=True)
    assert not (tmp_path / "x2.jpg").exists()


def test_show_uses_pils_viewer_or_says_there_is_no_display(model, inputs, monkeypatch, caplog):
    from PIL import ImageShow

    items, _ = inputs
    results = model(items, size=SIZE)
    shown = []
    monkeypatch.setattr(ImageShow, "show", lambda image, title=None: shown.append((image.size, title)) or True)
    if sys.platform not in ("darwin", "win32"):
        monkeypatch.delenv("DISPLAY", raising=False)
        monkeypatch.delenv("WAYLAND_DISPLAY", raising=False)
        caplog.clear()  # the inference above may log (precision) when it is the process's first
        with caplog.at_level(logging.WARNING):
            results.show()
        records = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert not shown and len(records) == 1 and "no display here" in records[0].getMessage()
    monkeypatch.setenv("DISPLAY", ":99")
    results.show()
    assert shown == [((90, 70), "street.jpg"), ((100, 80), "image1.jpg"), ((110, 60), "image2.jpg")]
    caplog.clear()
    monkeypatch.setattr(ImageShow, "show", lambda image, title=None: False)
    with caplog.at_level(logging.WARNING):
        results.show()
    assert len(caplog.records) == 1 and "no image viewer found" in caplog.records[0].getMessage()
    displayed = []  # in a notebook kernel: IPython's display(), with or without DISPLAY
    shell = type("ZMQInteractiveShell", (), {})()
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    monkeypatch.setitem(sys.modules, "IPython.display", types.SimpleNamespace(display=displayed.append))
    monkeypatch.delenv("DISPLAY")
    results.show(labels=False)
    assert [image.size for image in displayed] == [(90, 70), (100, 80), (110, 60)]
    assert np.array_equal(np.asarray(displayed[1]), expected_drawing(items[1], results.xyxy[1], labels=False))


def test_tolist_gives_one_detections_per_image(model, inputs):
    items, _ = inputs
    results = model(items, size=SIZE)
    results.render()
    single = results.tolist()
    assert len(single) == 3 and all(isinstance(one, Detections) and len(one) == 1 for one in single)
    for i, one in enumerate(single):
        assert torch.equal(one.xyxy[0], results.xyxy[i]) and one.files == [results.files[i]]
        assert one.ims[0] is results.ims[i] and one.loaded[0] is results.loaded[i]
        assert str(one).startswith(f"image 1/1: {one.shapes[0][0]}x") and len(one.xywhn) == 1
        assert one.s == results.s and one.times == results.times
    assert model([], size=SIZE).tolist() == [] and "Speed: " in str(model([], size=SIZE))


def test_an_image_url_is_read_like_the_file_and_leaves_nothing_behind(model, tmp_path, monkeypatch):
    """YOLOv5's README: ``model("https://.../zidane.jpg")``. The image comes through utils/downloads.py (a private
    temporary folder, removed), gives the file's detections, and a missing one is one line (DownloadError)."""
    import http.server
    import threading

    from utils.downloads import DownloadError

    served = tmp_path / "served"
    served.mkdir()
    on_disk = served / "zidane.jpg"
    cv2.imwrite(str(on_disk), picture(72, 96, 5)[:, :, ::-1])
    handler = lambda *args: http.server.SimpleHTTPRequestHandler(*args, directory=str(served))  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}/zidane.jpg"
        from_url, from_file = model(url), model(str(on_disk))
        assert from_url.files == ["zidane.jpg"] and from_url.ims[0].shape == (72, 96, 3)
        assert torch.equal(from_url.xyxy[0], from_file.xyxy[0]) and len(from_url.xyxy[0])
        assert list(work.iterdir()) == []
        with pytest.raises(DownloadError, match="missing.jpg: HTTP 404"):
            model(url.replace("zidane", "missing"))
    finally:
        httpd.shutdown()
        httpd.server_close()
