"""detect.py end to end on a tiny model, plus its sources (utils/sources.py) and drawing (utils/drawing.py)."""
import csv
import logging
import shutil
from dataclasses import replace
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import detect
from utils.detect_outputs import OutputError
from tests.conftest import ROOT, SHARED, save_random_checkpoint
from utils.checkpoint import is_finished, load_checkpoint, save_checkpoint
from utils.drawing import colors, draw_box_label, output_to_target, plot_images, save_one_box
from utils.inference import label_lines
from utils.sources import SourceError, Sources

NAMES = ["RBC", "WBC", "Platelets"]
IMGSZ = (96, 96)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """yolov5n at nc=3 with objectness and class biases raised so every image yields detections."""
    return save_random_checkpoint(tmp_path_factory.mktemp("weights") / "tiny.pt", NAMES,
                                  cfg=ROOT / "models" / "yolov5n.yaml", confident=True)


def make_images(folder: Path, count: int = 3) -> list[Path]:
    """A few BCCD test images when ../shared is present, else generated ones."""
    folder.mkdir(parents=True, exist_ok=True)
    bccd = SHARED / "datasets" / "bccd" / "images" / "test"
    originals = sorted(bccd.glob("*.jpg"))[:count] if bccd.is_dir() else []
    paths = []
    for i in range(count):
        target = folder / (originals[i].name if i < len(originals) else f"generated_{i}.jpg")
        if i < len(originals):
            shutil.copy(originals[i], target)
        else:
            image = np.full((120 + 10 * i, 160, 3), 200, np.uint8)
            cv2.circle(image, (60, 60), 25, (80, 40, 160), -1)
            cv2.imwrite(str(target), image)
        paths.append(target)
    return paths


def config(weights, source, tmp_path, **overrides):
    # fp32 (--amp off): the boxes these tests read must not depend on whether the CPU has AMX (bf16 under
    # --amp auto); bf16 inference is tested in test_amp.py
    base = detect.DetectConfig(weights=str(weights), source=str(source), imgsz=IMGSZ, conf_thres=0.25,
                               max_det=20, project=str(tmp_path / "runs" / "detect"), device="cpu", amp="off")
    return replace(base, **overrides)


def test_detect_folder_saves_drawn_images_and_logs(weights, tmp_path, caplog):
    images = make_images(tmp_path / "images")
    caplog.set_level(logging.INFO, logger="detect")
    save_dir = detect.run_config(config(weights, tmp_path / "images", tmp_path)).save_dir
    assert save_dir == tmp_path / "runs" / "detect" / "exp"
    for path in images:
        out = cv2.imread(str(save_dir / path.name))
        assert out is not None and out.shape == cv2.imread(str(path)).shape
        assert not np.array_equal(out, cv2.imread(str(path)))  # boxes were drawn
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith(f"image 1/3 {images[0]}: ") and "ms" in line for line in lines)
    assert any(line.startswith("Speed: ") and "per image at shape (1, 3, 96, 96)" in line for line in lines)
    assert any(line == f"Results saved to {save_dir}" for line in lines)
    second = detect.run_config(config(weights, images[0], tmp_path, nosave=True)).save_dir
    assert second == save_dir.with_name("exp2") and list(second.iterdir()) == []  # --nosave writes nothing


def test_unreadable_image_in_folder_warns_and_continues(weights, tmp_path, caplog):
    make_images(tmp_path / "images", 2)
    (tmp_path / "images" / "broken.jpg").write_bytes(b"not a jpeg")
    save_dir = detect.run_config(config(weights, tmp_path / "images", tmp_path)).save_dir
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("broken.jpg" in w for w in warnings)
    assert len(list(save_dir.glob("*.jpg"))) == 2


def test_save_txt_writes_normalised_yolo_labels_with_conf(weights, tmp_path):
    images = make_images(tmp_path / "images", 2)
    save_dir = detect.run_config(config(weights, tmp_path / "images", tmp_path, save_txt=True, save_conf=True,
                                        max_det=7)).save_dir
    for path in images:
        rows = np.loadtxt(save_dir / "labels" / f"{path.stem}.txt", ndmin=2)
        assert rows.shape[1] == 6 and 1 <= rows.shape[0] <= 7
        assert set(rows[:, 0]) <= {0, 1, 2} and np.all(rows[:, 0] == rows[:, 0].round())
        assert np.all((rows[:, 1:5] >= 0) & (rows[:, 1:5] <= 1))
        assert np.all((rows[:, 5] > 0.25) & (rows[:, 5] <= 1))
        assert np.all(np.diff(rows[:, 5]) >= 0)  # least confident first, as YOLOv5 (reversed(det))


def test_save_txt_without_conf_crops_and_classes_filter(weights, tmp_path):
    image = make_images(tmp_path / "images", 1)[0]
    save_dir = detect.run_config(config(weights, image, tmp_path, save_txt=True, save_crop=True, nosave=True,
                                        classes=[1], max_det=3)).save_dir
    rows = np.loadtxt(save_dir / "labels" / f"{image.stem}.txt", ndmin=2)
    assert rows.shape[1] == 5 and set(rows[:, 0]) == {1}
    crops = list((save_dir / "crops").rglob("*.jpg"))
    assert len(crops) == rows.shape[0] and all(c.parent.name == "WBC" for c in crops)
    assert not list(save_dir.glob("*.jpg"))  # --nosave: no drawn image


def test_video_source_writes_annotated_mp4_and_frame_labels(weights, tmp_path):
    video = tmp_path / "clip.mp4"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (128, 96))
    for i in range(5):
        frame = np.full((96, 128, 3), 40 * i, np.uint8)
        cv2.rectangle(frame, (20 + 5 * i, 20), (70 + 5 * i, 70), (0, 200, 255), -1)
        writer.write(frame)
    writer.release()
    save_dir = detect.run_config(config(weights, video, tmp_path, save_txt=True)).save_dir
    capture = cv2.VideoCapture(str(save_dir / "clip.mp4"))
    frames = 0
    while capture.read()[0]:
        frames += 1
    capture.release()
    assert frames == 5
    assert sorted(p.name for p in (save_dir / "labels").glob("*.txt")) == [f"clip_{i}.txt" for i in range(1, 6)]
    strided = detect.run_config(config(weights, video, tmp_path, save_txt=True, nosave=True, vid_stride=2)).save_dir
    assert sorted(p.name for p in (strided / "labels").glob("*.txt")) == ["clip_1.txt", "clip_2.txt"]


def test_missing_source_and_weights_are_one_line_errors(weights, tmp_path, capsys):
    code = detect.main(["--weights", str(weights), "--source", str(tmp_path / "nope"), "--project", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1] == f"detect.py: error: source not found: {tmp_path / 'nope'}"
    make_images(tmp_path / "images", 1)
    code = detect.main(["--weights", str(tmp_path / "missing.pt"), "--source", str(tmp_path / "images"),
                        "--project", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("detect.py: error: weights not found:") and "--weights" in err[-1]
    not_weights = tmp_path / "fake.pt"
    not_weights.write_text("hello")
    code = detect.main(["--weights", str(not_weights), "--source", str(tmp_path / "images"), "--project", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and err[-1].startswith("detect.py: error: ") and "fake.pt" in err[-1]


@pytest.mark.parametrize("flags, expected", [
    (["--imgsz", "0"], "argument --imgsz/--img/--img-size: expected an integer in [32, 16384], got '0'"),
    (["--imgsz", "100000"], "argument --imgsz/--img/--img-size: expected an integer in [32, 16384], got '100000'"),
    (["--imgsz", "64", "64", "64"], "argument --imgsz: expected one size or two (h w), got 3"),
    (["--conf-thres", "-1"], "argument --conf-thres: expected a number in [0, 1], got '-1'"),
    (["--conf-thres", "nan"], "argument --conf-thres: expected a number in [0, 1], got 'nan'"),
    (["--iou-thres", "2"], "argument --iou-thres: expected a number in [0, 1], got '2'"),
    (["--max-det", "0"], "argument --max-det: expected an integer in [1, 100000], got '0'"),
    (["--line-thickness", "0"], "argument --line-thickness: expected an integer in [1, 100], got '0'"),
    (["--vid-stride", "0"], "argument --vid-stride: expected an integer in [1, 2147483647], got '0'"),
    (["--classes", "-1"], "argument --classes: expected an integer in [0, 99999], got '-1'"),
    (["--classes", "99999999999999999999"],
     "argument --classes: expected an integer in [0, 99999], got '99999999999999999999'"),
    (["--save-format", "2"], "argument --save-format: expected an integer in [0, 1], got '2'"),
    (["--save-format", "voc"], "argument --save-format: expected an integer in [0, 1], got 'voc'"),
])
def test_bad_flag_values_are_one_line_usage_errors(tmp_path, capsys, flags, expected):
    argv = ["--weights", str(tmp_path / "unused.pt"), "--project", str(tmp_path / "runs"), *flags]
    assert detect.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"detect.py: error: {expected} (see detect.py --help)"]
    assert not (tmp_path / "runs").exists()  # refused before any work


def test_flags_and_defaults_match_yolov5():
    cfg = detect.config_from_args(detect.parse_args([]))
    assert (cfg.weights, cfg.source, cfg.imgsz, cfg.conf_thres, cfg.iou_thres, cfg.max_det) == \
        ("yolov5s.pt", str(detect.SAMPLE_IMAGES), (640, 640), 0.25, 0.45, 1000)
    assert (cfg.project, cfg.name, cfg.line_thickness, cfg.vid_stride) == ("runs/detect", "exp", 3, 1)
    cfg = detect.config_from_args(detect.parse_args(["--img", "320", "480", "--classes", "0", "2", "--half"]))
    assert cfg.imgsz == (320, 480) and cfg.classes == [0, 2] and cfg.half
    assert (cfg.save_csv, cfg.save_format, cfg.update) == (False, 0, False)
    cfg = detect.config_from_args(detect.parse_args(["--save-csv", "--save-format", "1", "--update"]))
    assert (cfg.save_csv, cfg.save_format, cfg.update) == (True, 1, True)


# --- --save-csv, --save-format, --update ---------------------------------------------------------------

def _read_csv(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as file:
        return list(csv.reader(file))


def _label_lines(save_dir: Path, name: str) -> list[list[float]]:
    return [[float(v) for v in line.split()] for line in (save_dir / "labels" / name).read_text().splitlines()]


def test_save_csv_rows_follow_the_label_lines(weights, tmp_path):
    images = make_images(tmp_path / "images", 2)
    options = {"save_txt": True, "save_conf": True, "save_csv": True, "nosave": True, "max_det": 7}
    result = detect.run_config(config(weights, tmp_path / "images", tmp_path, **options), collect=True)
    rows = _read_csv(result.save_dir / "predictions.csv")
    assert rows[0] == ["Image Name", "Prediction", "Confidence"]
    expected = []
    for path in images:  # images in source order, each image's rows in its label lines' order
        lines = _label_lines(result.save_dir, f"{path.stem}.txt")
        scores = [detection.score for detection in result.detections[str(path)]][::-1]
        assert len(lines) == len(scores) >= 2
        # the files least confident first, as YOLOv5's reversed(det); the API's detections most confident first
        assert [line[5] for line in lines] == pytest.approx(scores, abs=1e-6) and scores == sorted(scores)
        expected += [[path.name, NAMES[int(line[0])], f"{score:.2f}"] for line, score in zip(lines, scores)]
    assert rows[1:] == expected
    assert all(len(row[2]) == 4 and row[2][1] == "." for row in rows[1:])  # "0.87": two decimals
    again = detect.run_config(config(weights, images[0], tmp_path, exist_ok=True, **options)).save_dir
    assert again == result.save_dir  # --exist-ok: the same file, appended to, its header kept once
    appended = _read_csv(again / "predictions.csv")
    assert appended[:len(rows)] == rows and appended.count(rows[0]) == 1
    assert appended[len(rows):] == [row for row in rows[1:] if row[0] == images[0].name]


def test_save_csv_puts_video_frames_under_the_video_name(weights, tmp_path):
    video = tmp_path / "clip.mp4"
    writer = cv2.VideoWriter(str(video), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (128, 96))
    for i in range(3):
        writer.write(np.full((96, 128, 3), 60 * i, np.uint8))
    writer.release()
    save_dir = detect.run_config(config(weights, video, tmp_path, save_txt=True, save_csv=True, nosave=True,
                                        max_det=3)).save_dir
    rows = _read_csv(save_dir / "predictions.csv")[1:]
    lines = sum((_label_lines(save_dir, f"clip_{frame}.txt") for frame in (1, 2, 3)), [])
    assert len(rows) == len(lines) >= 3 and {row[0] for row in rows} == {"clip.mp4"}
    assert [row[1] for row in rows] == [NAMES[int(line[0])] for line in lines]


def test_save_csv_refuses_a_link_in_place_of_the_file(weights, tmp_path, outside):
    folder, target = outside
    image = make_images(tmp_path / "images", 1)[0]
    (folder / "predictions.csv").symlink_to(target)
    with pytest.raises(OutputError, match="predictions.csv: it is a symbolic link"):
        detect.run_config(config(weights, image, tmp_path, project=str(folder.parent), name=folder.name,
                                 exist_ok=True, save_csv=True, nosave=True))
    assert target.read_text() == "precious\n"


def test_label_lines_yolo_and_pascal_voc_hand_computed():
    det = torch.tensor([[10.0, 20.0, 50.0, 60.0, 0.875, 2.0], [0.0, 0.0, 200.0, 100.0, 0.5, 0.0]])
    shape = (100, 200, 3)  # h, w: x divided by 200, y by 100
    assert label_lines(det, shape) == ["2 0.15 0.4 0.2 0.4\n", "0 0.5 0.5 1 1\n"]
    assert label_lines(det, shape, save_format=1) == ["2 0.05 0.2 0.25 0.6\n", "0 0 0 1 1\n"]
    assert label_lines(det, shape, save_conf=True, save_format=1) == ["2 0.05 0.2 0.25 0.6 0.875\n",
                                                                       "0 0 0 1 1 0.5\n"]
    with pytest.raises(ValueError, match="save_format 2"):
        label_lines(det, shape, save_format=2)


def test_save_format_1_writes_the_corners_of_the_format_0_boxes(weights, tmp_path):
    images = make_images(tmp_path / "images", 2)
    options = {"save_txt": True, "save_conf": True, "nosave": True, "max_det": 7}
    yolo = detect.run_config(config(weights, tmp_path / "images", tmp_path, **options)).save_dir
    voc = detect.run_config(config(weights, tmp_path / "images", tmp_path, save_format=1, **options)).save_dir
    for path in images:
        centres, corners = (np.array(_label_lines(folder, f"{path.stem}.txt")) for folder in (yolo, voc))
        assert centres.shape == corners.shape and centres.shape[1] == 6
        assert np.array_equal(centres[:, [0, 5]], corners[:, [0, 5]])  # class, confidence
        cx, cy, w, h = centres[:, 1:5].T
        converted = np.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], 1)
        assert np.abs(corners[:, 1:5] - converted).max() <= 1e-5  # %g keeps 6 significant digits
        assert np.all((corners[:, 1:5] >= 0) & (corners[:, 1:5] <= 1))  # normalised, not pixels
        assert np.all(corners[:, 3] >= corners[:, 1]) and np.all(corners[:, 4] >= corners[:, 2])


def test_bad_save_format_in_a_config_is_refused_before_any_work(weights, tmp_path):
    image = make_images(tmp_path / "images", 1)[0]
    with pytest.raises(detect.DetectError, match=r"--save-format 2: must be 0 \(YOLO\) or 1 \(Pascal-VOC\)"):
        detect.run_config(config(weights, image, tmp_path, save_format=2))
    assert not (tmp_path / "runs").exists()


def _training_copy(weights: Path, path: Path) -> Path:
    """``weights`` as a mid-training file: an EMA entry and optimizer state, as last.pt holds while a run goes on."""
    ckpt = load_checkpoint(weights)
    ckpt["ema"] = ckpt["model"]
    ckpt["training"] = {"version": 1, "optimizer": {"state": {0: {"momentum_buffer": torch.ones(3)}},
                                                    "param_groups": [{"lr": 0.01, "params": [0]}]}}
    save_checkpoint(ckpt, path)
    return path


def test_update_strips_our_checkpoint_and_detects_the_same_after(weights, tmp_path, caplog):
    image = make_images(tmp_path / "images", 1)[0]
    own = _training_copy(weights, tmp_path / "best.pt")  # a running training's best.pt
    before = torch.load(own, map_location="cpu", weights_only=True)
    assert "training" in before and before["model"]["state_dict"]["model.0.conv.weight"].dtype == torch.float32
    options = {"save_txt": True, "save_conf": True, "nosave": True}
    with caplog.at_level(logging.INFO):
        first = detect.run_config(config(own, image, tmp_path, update=True, **options)).save_dir
    assert f"Optimizer stripped from {own}" in caplog.text
    stripped = torch.load(own, map_location="cpu", weights_only=True)  # plain data still
    assert "training" not in stripped and stripped["ema"] is None and is_finished(stripped)
    state = stripped["model"]["state_dict"]
    assert state["model.0.conv.weight"].dtype == torch.float16
    assert all(v.dtype == torch.float32 for k, v in state.items() if k.endswith(".anchors"))
    assert load_checkpoint(own)["model"]["names"] == NAMES  # the loader still takes it
    assert not list(tmp_path.glob(".best.pt.*"))  # no temp file left beside it
    second = detect.run_config(config(own, image, tmp_path, **options)).save_dir
    before_rows, after_rows = (np.array(_label_lines(folder, f"{image.stem}.txt")) for folder in (first, second))
    assert before_rows.shape == after_rows.shape
    assert np.array_equal(before_rows[:, 0], after_rows[:, 0])
    height, width = cv2.imread(str(image)).shape[:2]
    assert np.abs(before_rows[:, 1:5] - after_rows[:, 1:5]).max() <= 1.0 / min(height, width) + 1e-6  # a pixel
    assert np.abs(before_rows[:, 5] - after_rows[:, 5]).max() <= 1e-3


def test_update_leaves_yolov5_files_links_and_a_resumable_last_untouched(tmp_path, yolov5_lookalike, weights, caplog):
    image = make_images(tmp_path / "images", 1)[0]
    yolov5 = Path(shutil.copy(yolov5_lookalike.training_checkpoint, tmp_path / "yolov5_last.pt"))
    own = _training_copy(weights, tmp_path / "own.pt")
    link = tmp_path / "link.pt"
    link.symlink_to(own)
    (tmp_path / "run").mkdir()
    last = _training_copy(weights, tmp_path / "run" / "last.pt")  # YOLOv5 would strip it: the run could not resume
    saved = {path: path.read_bytes() for path in (yolov5, own, last)}
    with caplog.at_level(logging.INFO, logger="detect"):
        for path in (yolov5, link, last):
            detect.run_config(config(path, image, tmp_path, update=True, nosave=True))
    assert {path: path.read_bytes() for path in saved} == saved and link.is_symlink()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("--update: ")]
    assert lines == [f"--update: {yolov5} left as it is (a YOLOv5 checkpoint: this project never rewrites YOLOv5's "
                     "pickled files)",
                     f"--update: {link} left as it is (a symbolic link: pass the file it points to)",
                     f"--update: {last} left as it is (the checkpoint --resume continues its unfinished run from: "
                     "strip a copy of it instead)"]


# --- sources -------------------------------------------------------------------------------------

def test_sources_txt_list_relative_to_its_folder_and_glob(tmp_path):
    images = make_images(tmp_path / "data" / "images", 3)
    listing = tmp_path / "data" / "list.txt"
    listing.write_text(f"images/{images[1].name}\n\n{images[0]}\n")
    assert Sources(str(listing)).files == [images[1], images[0]]
    found = Sources(str(tmp_path / "data" / "images" / "*.jpg"))
    assert found.files == sorted(images)
    items = list(found)
    assert [(i.index, i.count, i.is_video) for i in items] == [(1, 3, False), (2, 3, False), (3, 3, False)]
    assert items[0].image.dtype == np.uint8 and items[0].image.ndim == 3


def test_sources_errors(tmp_path):
    with pytest.raises(SourceError, match="source not found"):
        Sources(str(tmp_path / "missing.jpg"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SourceError, match="no images or videos found"):
        Sources(str(tmp_path / "empty"))
    (tmp_path / "notes.csv").write_text("x")
    with pytest.raises(SourceError, match="not an image or video"):
        Sources(str(tmp_path / "notes.csv"))
    with pytest.raises(SourceError, match=r"--source 99: cannot open webcam 99 \(is a camera attached\?\)"):
        Sources("99")  # a webcam index this machine does not have (tests/test_streams.py: streams)
    (tmp_path / "bad.jpg").write_bytes(b"junk")
    with pytest.raises(SourceError, match="bad.jpg"):
        list(Sources(str(tmp_path / "bad.jpg")))


# --- drawing -------------------------------------------------------------------------------------

def test_colors_fixed_and_bgr_reversed():
    assert colors(0) == colors(20) and colors(0) != colors(1)
    assert colors(3, bgr=True) == colors(3)[::-1]


def test_draw_box_label_draws_box_and_filled_label():
    image = np.zeros((100, 100, 3), np.uint8)
    draw_box_label(image, [20, 40, 80, 90], "cell 0.9", (255, 255, 255), line_width=2)
    assert image[40, 50].tolist() == [255, 255, 255]  # top edge
    assert image[65, 50].tolist() == [0, 0, 0]  # inside untouched
    label_area = image[25:39, 20:40]
    assert (label_area == 255).mean() > 0.3 and (label_area < 128).any()  # filled background, dark text


def test_plot_images_labels_and_predictions(tmp_path):
    images = torch.zeros(3, 3, 64, 80)
    images[:, 0] = 1.0  # red in RGB
    labels = torch.tensor([[0, 0, 0.5, 0.5, 0.5, 0.5], [2, 1, 0.25, 0.25, 0.2, 0.2]])
    mosaic = plot_images(images, labels, paths=["a.jpg", "b.jpg", "c.jpg"], fname=tmp_path / "labels.jpg",
                         names=NAMES)
    assert mosaic.shape == (128, 160, 3) and (tmp_path / "labels.jpg").is_file()
    assert mosaic[30, 120].tolist() == [0, 0, 255]  # tile 1 interior is red (BGR)
    assert (mosaic[64:, 80:] == 255).all()  # the unused 4th tile stays white
    output = [torch.tensor([[10.0, 10.0, 50.0, 40.0, 0.9, 2.0]]), torch.zeros(0, 6), torch.zeros(0, 6)]
    rows = output_to_target(output)
    assert rows.tolist() == [[0, 2, 10, 10, 50, 40, pytest.approx(0.9)]]
    predicted = plot_images(images, rows, fname=tmp_path / "pred.jpg", names=NAMES)
    assert not np.array_equal(predicted[:64, :80], mosaic[:64, :80])


def test_save_one_box_crops_and_never_overwrites(tmp_path):
    image = np.arange(100 * 100 * 3, dtype=np.uint8).reshape(100, 100, 3)
    crop = save_one_box([20, 30, 60, 50], image, tmp_path / "crops" / "x.jpg", gain=1.0, pad=0)
    assert crop.shape == (20, 40, 3) and np.array_equal(crop, image[30:50, 20:60])
    save_one_box([20, 30, 60, 50], image, tmp_path / "crops" / "x.jpg")
    assert sorted(p.name for p in (tmp_path / "crops").iterdir()) == ["x.jpg", "x2.jpg"]


# --- exported models ---------------------------------------------------------------------------------

def _label_rows(save_dir: Path) -> dict:
    return {path.name: sorted(tuple(float(v) for v in line.split()) for line in path.read_text().splitlines())
            for path in sorted((save_dir / "labels").glob("*.txt"))}


def _formats() -> tuple:
    """TorchScript always; ONNX too when onnx and onnxruntime are installed (optional packages)."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return ("torchscript",)
    return ("torchscript", "onnx")


def test_detect_writes_the_same_boxes_from_pt_onnx_and_torchscript(weights, tmp_path, caplog):
    """One image through the checkpoint, --dynamic TorchScript (and ONNX) exports and a static 96x96 one."""
    import export
    images = make_images(tmp_path / "images", 1)
    exported = {}
    formats = _formats()
    for name, options in (("dynamic", {"dynamic": True, "include": formats}), ("static", {"include": formats[-1:]})):
        folder = tmp_path / name
        folder.mkdir()
        copy = Path(shutil.copy(weights, folder / "best.pt"))
        export.run(export.ExportConfig(weights=str(copy), imgsz=IMGSZ, **options))
        exported[name] = copy
    runs = [(weights, {})] + [(exported["dynamic"].with_suffix(f".{fmt}"), {}) for fmt in formats] + \
        [(exported["static"].with_suffix(f".{formats[-1]}"), {"imgsz": (64, 64)})]  # static: its own 96x96 wins
    with caplog.at_level(logging.INFO):
        rows = [_label_rows(detect.run_config(config(path, images[0], tmp_path, save_txt=True, save_conf=True,
                                                     **extra)).save_dir)
                for path, extra in runs]
    assert "exported for 96x96 inputs; using that instead of --imgsz 64 64" in caplog.text
    reference = rows[0]
    assert reference and all(len(lines) for lines in reference.values())
    height, width = cv2.imread(str(images[0])).shape[:2]
    pixel = 1.0 / min(height, width)  # detect.py rounds boxes to whole pixels: allow one
    for other in rows[1:]:
        assert other.keys() == reference.keys()
        for name, expected in reference.items():
            got = np.array(other[name])
            assert got.shape == np.array(expected).shape
            assert np.array_equal(got[:, 0], np.array(expected)[:, 0])
            assert np.abs(got[:, 1:5] - np.array(expected)[:, 1:5]).max() <= pixel + 1e-6
            assert np.abs(got[:, 5] - np.array(expected)[:, 5]).max() <= 1e-3


def test_detect_corrupt_export_is_one_line(weights, tmp_path, capsys):
    make_images(tmp_path / "images", 1)
    for suffix in (".onnx", ".torchscript"):
        bad = tmp_path / f"broken{suffix}"
        bad.write_bytes(b"\x08\x07" + b"\x00" * 300)
        code = detect.main(["--weights", str(bad), "--source", str(tmp_path / "images"), "--project", str(tmp_path)])
        err = capsys.readouterr().err.strip().splitlines()
        if suffix == ".onnx" and code == 1 and "optional package 'onnxruntime'" in err[-1]:
            continue  # onnxruntime absent: that one-line message is the answer
        assert code == 1 and err[-1].startswith(f"detect.py: error: {bad}: not a readable"), err
        assert not any("Traceback" in line for line in err)


def test_a_log_line_and_its_newline_go_out_in_one_write(monkeypatch):
    """A Ctrl-C lands between two writes as easily as anywhere: a line written apart from its newline was left open
    when detect.py was interrupted, and "detect.py: interrupted" was printed at its end."""
    writes = []

    class Recorder:
        def write(self, text):
            writes.append(text)

        def flush(self):
            pass

    monkeypatch.setattr(detect.sys, "stderr", Recorder())
    handler = detect._TqdmHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    handler.emit(logging.LogRecord("detect", logging.INFO, __file__, 1, "stream 1/1 (frame 6) screen: 64x64", None, None))
    assert [text for text in writes if text] == ["stream 1/1 (frame 6) screen: 64x64\n"]


# --- --visualize ---------------------------------------------------------------------------------------------

def test_visualize_saves_each_layers_maps_per_image(tmp_path, caplog):
    """A folder per image with stage{i}_{Type}_features.png and .npy for every layer but Detect (the tiny model's 24
    layers, yolov5n's shape at an eighth of its width: drawn faster), each .npy the layer's output for that image;
    the detections are those of a plain run."""
    from models.backends import PyTorchBackend

    weights = save_random_checkpoint(tmp_path / "tiny.pt", ["a", "b"], confident=True)
    images = make_images(tmp_path / "images", 2)
    with caplog.at_level(logging.INFO, logger="detect"):
        result = detect.run_config(config(weights, tmp_path / "images", tmp_path, visualize=True, nosave=True),
                                   collect=True)
    plain = detect.run_config(config(weights, tmp_path / "images", tmp_path, nosave=True), collect=True)
    assert len(result.detections) == 2 and any(result.detections.values())
    assert result.detections == plain.detections  # the hooks only read
    backend = PyTorchBackend(weights)
    layers = [type(layer).__name__ for layer in backend.model.model][:-1]
    expected = {f"stage{i}_{name}_features" for i, name in enumerate(layers)}
    for image in images:
        folder = result.save_dir / image.stem
        assert {path.stem for path in folder.glob("*.png")} == expected == {path.stem for path in folder.glob("*.npy")}
        first = np.load(folder / f"stage0_{layers[0]}_features.npy")
        assert first.dtype == np.float32 and first.shape == (8, IMGSZ[0] // 2, IMGSZ[1] // 2)  # the stem conv
    assert sum("Saving " in r.getMessage() and "features.png" in r.getMessage() for r in caplog.records) == 2 * 24


def test_visualize_an_exported_model_is_said_once_and_detection_goes_on(weights, tmp_path, caplog):
    import export

    images = make_images(tmp_path / "images", 1)
    [exported] = export.run(export.ExportConfig(weights=str(weights), imgsz=IMGSZ, include=("torchscript",)))
    with caplog.at_level(logging.WARNING, logger="detect"):
        result = detect.run_config(config(exported.path, images[0], tmp_path, visualize=True), collect=True)
    assert len(result.detections) == 1 and not (result.save_dir / images[0].stem).exists()
    said = [r.getMessage() for r in caplog.records if "--visualize" in r.getMessage()]
    assert len(said) == 1 and "exported model" in said[0]
