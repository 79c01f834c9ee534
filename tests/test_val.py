"""Validation: validate() on an oracle model with known answers, pycocotools agreement end to end, the val.py CLI."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from torch import nn

import val
from utils.validation import validate
from tests.conftest import TINY_MODEL_YAML, make_tiny_dataset


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("val")
    return root, make_tiny_dataset(root / "data", num_train=1, num_val=12)


@pytest.fixture(scope="module")
def loader(tiny):
    from utils.data.dataset_yaml import load_data_config
    from utils.data.loader import create_dataloader
    config = load_data_config(tiny[1])
    return create_dataloader(config.val, 64, 4, 32, rect=True, pad=0.5, workers=0, names=config.names)[0]


class OracleModel(nn.Module):
    """Predicts the loader's own labels (optionally jittered, plus false positives) in eval-mode output form.

    It replays the targets of ``loader`` batch by batch, so it only works for an unshuffled loader.
    """

    def __init__(self, loader, nc=2, jitter=0.0, false_positives=0, seed=0):
        super().__init__()
        self.targets = [targets.clone() for _, targets, _, _ in loader]
        self.nc, self.jitter, self.false_positives = nc, jitter, false_positives
        self.rng = np.random.default_rng(seed)
        self.weight = nn.Parameter(torch.zeros(1))
        self.batch = 0

    def forward(self, images):
        targets = self.targets[self.batch % len(self.targets)]
        self.batch += 1
        batch, _, height, width = images.shape
        rows = [self._image_rows(targets[targets[:, 0] == i, 1:], width, height) for i in range(batch)]
        size = max(len(r) for r in rows)
        pred = torch.zeros(batch, size, 5 + self.nc)
        for i, image_rows in enumerate(rows):
            pred[i, :len(image_rows)] = image_rows
        return pred, []

    def _image_rows(self, labels, width, height):
        boxes = labels[:, 1:5].numpy() * [width, height, width, height]
        boxes = boxes + self.rng.normal(0, self.jitter, boxes.shape) * boxes[:, [2, 3, 2, 3]]
        scores = 1.0 - self.rng.uniform(0, 0.9, len(boxes)) * (self.jitter > 0)
        classes = labels[:, 0].long().numpy()
        fakes = self.rng.uniform(8, [width - 8, height - 8, 30, 30], (self.false_positives, 4))
        boxes = np.concatenate([boxes, fakes])
        scores = np.concatenate([scores, self.rng.uniform(0.01, 0.9, self.false_positives)])
        classes = np.concatenate([classes, self.rng.integers(0, self.nc, self.false_positives)])
        rows = torch.zeros(len(boxes), 5 + self.nc)
        rows[:, :4] = torch.from_numpy(boxes)
        rows[:, 4] = torch.from_numpy(scores)
        rows[torch.arange(len(rows)), 5 + torch.from_numpy(classes)] = 1.0
        return rows


def test_perfect_oracle_gives_map_one_and_pycocotools_agrees(loader, tmp_path):
    pytest.importorskip("pycocotools")
    model = OracleModel(loader)
    result = validate(model, loader, ["class0", "class1"], "cpu", save_dir=tmp_path, plots=False,
                          save_json=True, save_txt=True, save_conf=True)
    assert result.map == pytest.approx(1.0) and result.map50 == pytest.approx(1.0)
    assert result.mp == pytest.approx(1.0, abs=1e-3) and result.mr == pytest.approx(1.0, abs=1e-3)
    assert result.maps.tolist() == pytest.approx([1.0, 1.0]) and result.fitness == pytest.approx(1.0)
    assert result.seen == 12 and result.instances == sum(len(t) for t in model.targets)
    assert result.coco == pytest.approx((1.0, 1.0))
    predictions = json.loads((tmp_path / "predictions.json").read_text())
    truth = json.loads((tmp_path / "annotations.json").read_text())
    assert len(predictions) == len(truth["annotations"]) == result.instances
    assert {image["id"] for image in truth["images"]} == {f"im{i}" for i in range(12)}
    label_file = (tmp_path / "labels" / "im0.txt").read_text().split("\n")[0].split()
    assert len(label_file) == 6 and float(label_file[-1]) == pytest.approx(1.0)  # class, xywhn, conf
    assert not model.training or isinstance(model, OracleModel)


def test_jittered_oracle_agrees_with_pycocotools(loader, tmp_path):
    pytest.importorskip("pycocotools")
    model = OracleModel(loader, jitter=0.08, false_positives=6, seed=1)
    result = validate(model, loader, ["class0", "class1"], "cpu", save_dir=tmp_path, plots=False, save_json=True)
    assert 0.05 < result.map < 0.95
    assert result.coco is not None
    assert abs(result.map - result.coco[0]) < 0.002
    assert abs(result.map50 - result.coco[1]) < 0.002


def test_coco_val2017_is_recognised_as_yolov5_recognises_it(tmp_path):
    from types import SimpleNamespace

    from utils.coco import COCO_CATEGORY_IDS, coco_val

    assert len(COCO_CATEGORY_IDS) == 80 and COCO_CATEGORY_IDS[:12] == (*range(1, 12), 13)
    assert COCO_CATEGORY_IDS[-1] == 90 and not {12, 26, 83} & set(COCO_CATEGORY_IDS)
    coco = SimpleNamespace(path=tmp_path / "coco", val=[str(tmp_path / "coco" / "val2017.txt")], names=["n"] * 80)
    assert coco_val(coco).annotations == tmp_path / "coco" / "annotations" / "instances_val2017.json"
    for other in ({"val": [str(tmp_path / "coco" / "images" / "val2017")]}, {"names": ["n"] * 2},
                  {"val": [str(tmp_path / "coco128" / "val2017.txt")]}):
        assert coco_val(SimpleNamespace(**{**vars(coco), **other})) is None


def test_coco_val2017_writes_coco_ids_and_is_scored_against_the_official_annotations(loader, tmp_path):
    """COCO's val2017 (``coco``): the predictions JSON takes COCO's category ids (class 0 -> 1, 1 -> 2) and
    pycocotools scores it against the official file, on this split's images only (here an extra image in the file
    is left out), so an annotation the file lacks makes a false positive that the labels alone would not."""
    pytest.importorskip("pycocotools")
    from utils.coco import CocoVal

    def official(truth, drop: int = 0) -> CocoVal:
        data = json.loads(json.dumps(truth))
        data["annotations"] = data["annotations"][drop:]
        data["images"].append({"id": "other", "file_name": "other.jpg", "width": 64, "height": 64})
        data["annotations"].append({"id": 10 ** 6, "image_id": "other", "category_id": 1, "bbox": [1, 1, 9, 9],
                                    "area": 81, "iscrowd": 0})
        path = tmp_path / f"instances_val2017_{drop}.json"
        path.write_text(json.dumps(data))
        return CocoVal(path)

    labels = validate(OracleModel(loader), loader, ["class0", "class1"], "cpu", save_dir=tmp_path / "labels",
                      plots=False, save_json=True, coco=CocoVal(tmp_path / "missing.json"))
    truth = json.loads((tmp_path / "labels" / "annotations.json").read_text())
    predicted = json.loads((tmp_path / "labels" / "predictions.json").read_text())
    assert {p["category_id"] for p in predicted} == {c["id"] for c in truth["categories"]} == {1, 2}
    assert labels.coco == pytest.approx((1.0, 1.0))  # no official file: the labels' ground truth
    whole = validate(OracleModel(loader), loader, ["class0", "class1"], "cpu", save_dir=tmp_path / "whole",
                     plots=False, save_json=True, coco=official(truth))
    assert whole.coco == pytest.approx((1.0, 1.0))  # the extra image's annotation is not counted
    short = validate(OracleModel(loader), loader, ["class0", "class1"], "cpu", save_dir=tmp_path / "short",
                     plots=False, save_json=True, coco=official(truth, drop=1))
    assert short.map == pytest.approx(1.0) and short.coco[0] < 0.999


def test_validate_losses_speed_and_mode(loader):
    model = OracleModel(loader).train()

    def compute_loss(raw, targets):
        return torch.ones(1), torch.tensor([1.0, 2.0, 3.0])

    result = validate(model, loader, {0: "class0", 1: "class1"}, torch.device("cpu"), compute_loss=compute_loss,
                          plots=False)
    assert result.losses.tolist() == pytest.approx([1.0, 2.0, 3.0])  # mean over batches
    assert len(result.speed) == 3 and all(s >= 0 for s in result.speed)
    assert model.training  # mode restored


def test_single_cls_merges_classes(loader):
    model = OracleModel(loader)
    for targets in model.targets:
        targets[:, 1] = 1 - targets[:, 1]  # every class wrong: only agnostic scoring finds them
    result = validate(model, loader, ["class0", "class1"], "cpu", plots=False)
    assert result.map == pytest.approx(0.0)
    model.batch = 0
    result = validate(model, loader, ["item"], "cpu", plots=False, single_cls=True)
    assert result.map == pytest.approx(1.0)  # predictions and labels all become class 0


@pytest.fixture(scope="module")
def checkpoint(tiny):
    import yaml

    from models.yolo import DetectionModel
    from utils.checkpoint import model_state, save_checkpoint
    torch.manual_seed(0)
    model = DetectionModel(yaml.safe_load(TINY_MODEL_YAML))
    path = tiny[0] / "tiny.pt"
    save_checkpoint({"format": "yolo-trainer/1", "model": model_state(model), "ema": None}, path)
    return path


@pytest.mark.slow
def test_cli_run_writes_outputs(tiny, checkpoint, capsys):
    root, data = tiny
    args = ["--data", str(data), "--weights", str(checkpoint), "--img", "64", "--batch-size", "4", "--workers", "0",
            "--device", "cpu", "--project", str(root / "runs"), "--save-json", "--save-txt"]
    assert val.main(args) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    table = [i for i, line in enumerate(lines) if line.split()[:1] == ["all"]]
    assert table, out
    assert lines[table[0] + 1].split()[0] == "class0"  # per-class rows follow (below 50 classes without --verbose)
    assert "Speed:" in out and "at shape (4, 3, 64, 64)" in out and "pycocotools" in out
    save_dir = root / "runs" / "exp"
    for name in ("confusion_matrix.png", "PR_curve.png", "F1_curve.png", "P_curve.png", "R_curve.png",
                 "tiny_predictions.json", "annotations.json"):
        assert (save_dir / name).exists(), name
    assert list((save_dir / "labels").glob("*.txt"))
    assert val.main(args[:-2] + ["--task", "speed"]) == 0  # timing only, a new run folder
    assert (root / "runs" / "exp2").is_dir() and not (root / "runs" / "exp2" / "PR_curve.png").exists()


def test_cli_errors_are_one_line(tiny, checkpoint, capsys, tmp_path):
    root, data = tiny
    base = ["--device", "cpu", "--project", str(tmp_path / "runs"), "--workers", "0"]
    assert val.main(["--data", str(tmp_path / "missing.yaml"), "--weights", str(checkpoint), *base]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("val.py: error:") and "missing.yaml" in err[0]
    assert val.main(["--data", str(data), "--weights", str(tmp_path / "nope.pt"), *base]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope.pt" in err[0]
    assert val.main(["--data", str(data), "--weights", str(checkpoint), "--task", "test", *base]) == 1
    assert "no 'test' split" in capsys.readouterr().err
    assert val.main(["--data", str(data), "--weights", str(checkpoint), *base, "--device", "99"]) == 2  # a bad flag
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("val.py: error: --device 99")
    blocker = tmp_path / "file.txt"
    blocker.write_text("a file where the run folder's parent should be")
    argv = ["--data", str(data), "--weights", str(checkpoint), "--device", "cpu", "--project", str(blocker / "runs")]
    assert val.main(argv) == 1  # an OSError while creating outputs: one line naming the path
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("val.py: error: ") and str(blocker) in err[0]


@pytest.mark.parametrize("name, folder, what", [("best.mlmodel", False, "a Core ML neural-network model"),
                                                 ("best.pb", False, "a TensorFlow GraphDef"),
                                                 ("best_saved_model", True, "a TensorFlow SavedModel"),
                                                 ("best_web_model", True, "a TensorFlow.js model"),
                                                 ("best_paddle_model", True, "a PaddlePaddle model")])
def test_yolov5_exports_not_run_here_are_named_in_one_line(tiny, tmp_path, capsys, name, folder, what):
    """YOLOv5's TensorFlow, PaddlePaddle and .mlmodel exports: said what they are, not read as a broken checkpoint
    or an OpenVINO folder."""
    root, data = tiny
    path = tmp_path / name
    if folder:
        path.mkdir()
        (path / "saved_model.pb").write_bytes(b"\x08\x01")
    else:
        path.write_bytes(b"\x08\x01")
    assert val.main(["--data", str(data), "--weights", str(path), "--device", "cpu", "--workers", "0",
                     "--project", str(tmp_path / "runs")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"val.py: error: {path}: {what} (YOLOv5's ") and \
        "a format this project does not run; give the .pt it was exported from" in err[0], err


@pytest.mark.parametrize("flag, value, expected", [
    ("--batch-size", "0", "expected an integer in [1, 4096], got '0'"),
    ("--batch-size", "-1", "expected an integer in [1, 4096], got '-1'"),
    ("--batch-size", "8.5", "expected an integer in [1, 4096], got '8.5'"),
    ("--conf-thres", "-1", "expected a number in [0, 1], got '-1'"),
    ("--conf-thres", "nan", "expected a number in [0, 1], got 'nan'"),
    ("--iou-thres", "2", "expected a number in [0, 1], got '2'"),
    ("--imgsz", "0", "expected an integer in [32, 16384], got '0'"),
    ("--imgsz", "-32", "expected an integer in [32, 16384], got '-32'"),
    ("--imgsz", "100000", "expected an integer in [32, 16384], got '100000'"),
    ("--max-det", "0", "expected an integer in [1, 100000], got '0'"),
    ("--workers", "-1", "expected an integer in [0, 1024], got '-1'"),
])
def test_bad_flag_values_are_one_line_usage_errors(capsys, tmp_path, flag, value, expected):
    argv = ["--weights", str(tmp_path / "unused.pt"), "--project", str(tmp_path / "runs"), f"{flag}={value}"]
    assert val.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    names = {"--imgsz": "--imgsz/--img/--img-size"}
    assert err == [f"val.py: error: argument {names.get(flag, flag)}: {expected} (see val.py --help)"]
    assert not (tmp_path / "runs").exists()  # refused before any work


# --- exported models (export.py, models/backends.py) -------------------------------------------------

def _formats() -> tuple:
    """TorchScript always; ONNX too when onnx and onnxruntime are installed (optional packages)."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError:
        return ("torchscript",)
    return ("torchscript", "onnx")


@pytest.fixture
def own_console():
    """val.main() binds the root log handler to the sys.stdout of the test that called it, closed once that test
    ends: a later test that logs before calling main() would write to it. Start without that handler."""
    import logging
    logging.getLogger().handlers[:] = [logging.NullHandler()]


def _export(checkpoint, folder, **options):
    """Copy ``checkpoint`` into ``folder`` and export it there; returns the copied .pt path."""
    import shutil

    import export
    folder.mkdir(parents=True, exist_ok=True)
    weights = folder / checkpoint.name
    shutil.copy(checkpoint, weights)
    export.run(export.ExportConfig(weights=str(weights), **options))
    return weights


@pytest.fixture(scope="module")
def dynamic_exports(tiny, checkpoint):
    weights = _export(checkpoint, tiny[0] / "dynamic", imgsz=(64, 64), include=_formats(), dynamic=True)
    return [weights] + [weights.with_suffix(f".{fmt}") for fmt in _formats()]


def _label_rows(save_dir):
    """{file name: sorted rows of class, cx, cy, w, h, conf} from a --save-txt --save-conf run."""
    return {path.name: sorted(tuple(float(v) for v in line.split()) for line in path.read_text().splitlines())
            for path in sorted((save_dir / "labels").glob("*.txt"))}


def test_val_on_exported_models_equals_the_checkpoint(tiny, dynamic_exports, own_console):
    root, data = tiny
    # fp32 (--amp off): under bf16 autocast (--amp auto on CPUs with AMX or AVX512-BF16) the traced graph rounds differently
    results = [val.run(data=data, weights=str(path), imgsz=64, batch_size=4, workers=0, plots=False, save_txt=True,
                       save_conf=True, project=root / "runs-exported", device="cpu", amp="off")
               for path in dynamic_exports]
    reference = results[0]
    assert reference.seen == 12 and reference.map50 > 0  # the random tiny model does find something
    reference_rows = _label_rows(reference.save_dir)
    assert reference_rows
    for result in results[1:]:
        for metric in ("mp", "mr", "map50", "map"):
            assert getattr(result, metric) == pytest.approx(getattr(reference, metric), abs=0.001), metric
        rows = _label_rows(result.save_dir)
        assert rows.keys() == reference_rows.keys()
        for name, expected in reference_rows.items():
            assert np.allclose(rows[name], expected, atol=1e-3), name


def test_val_static_export_runs_square_batches_of_its_own_size(tiny, checkpoint, caplog, own_console):
    from models.backends import load_backend
    from utils.data.dataset_yaml import load_data_config
    from utils.data.loader import create_dataloader
    root, data = tiny
    fmt = _formats()[-1]
    weights = _export(checkpoint, root / "static", imgsz=(64, 64), include=(fmt,), batch_size=2)
    with caplog.at_level("INFO"):
        result = val.run(data=data, weights=str(weights.with_suffix(f".{fmt}")), imgsz=96, batch_size=4, workers=0,
                         plots=False, project=root / "runs-static", device="cpu")
    assert "exported for 64x64 inputs; validating at 64 instead of --imgsz 96" in caplog.text
    config = load_data_config(data)
    square = create_dataloader(config.val, 64, 4, 32, rect=False, pad=0.0, workers=0, names=config.names)[0]
    expected = validate(load_backend(weights), square, config.names, "cpu", plots=False)
    assert (result.map50, result.map, result.mp, result.mr) == \
        pytest.approx((expected.map50, expected.map, expected.mp, expected.mr), abs=0.001)


def test_val_refuses_non_square_static_exports_and_corrupt_files(tiny, checkpoint, capsys, tmp_path,
                                                                 own_console):
    root, data = tiny
    base = ["--data", str(data), "--device", "cpu", "--workers", "0", "--project", str(tmp_path / "runs")]
    weights = _export(checkpoint, tmp_path / "oblong", imgsz=(64, 96), include=_formats())
    for fmt in _formats():
        exported = weights.with_suffix(f".{fmt}")
        assert val.main(["--weights", str(exported), *base]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "exported for 64x96 inputs; val.py needs a square or a --dynamic export" in err[0]
        truncated = tmp_path / f"truncated.{fmt}"
        truncated.write_bytes(exported.read_bytes()[:20000])
        assert val.main(["--weights", str(truncated), *base]) == 1
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"val.py: error: {truncated}: not a readable"), err


# --- --task train, speed and study (YOLOv5's) -------------------------------------------------------------------

def test_task_train_validates_the_train_split(tiny, checkpoint):
    root, data = tiny
    options = dict(data=str(data), weights=str(checkpoint), imgsz=64, batch_size=4, workers=0, device="cpu",
                   project=str(root / "runs_train_task"), plots=False)
    assert val.run(task="train", **options).seen == 1 and val.run(task="val", **options).seen == 12


def test_task_speed_times_each_of_several_weights_alone(tiny, checkpoint, tmp_path, caplog):
    import logging
    import shutil

    root, data = tiny
    other = shutil.copy(checkpoint, tmp_path / "other.pt")
    with caplog.at_level(logging.INFO):
        results = val.run(task="speed", data=str(data), weights=[str(checkpoint), str(other)], imgsz=64,
                          batch_size=4, workers=0, device="cpu", project=str(tmp_path / "runs"))
    assert isinstance(results, list) and len(results) == 2 and all(r.speed[1] > 0 for r in results)
    speed_lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Speed:")]
    assert len(speed_lines) == 2  # a line per model, not one for their ensemble


def test_task_study_writes_a_row_per_size_for_each_model_and_the_plot(tiny, checkpoint, tmp_path, monkeypatch,
                                                                      capsys):
    import shutil

    root, data = tiny
    other = shutil.copy(checkpoint, tmp_path / "other.pt")
    monkeypatch.setattr(val, "STUDY_SIZES", (64, 96))
    args = ["--data", str(data), "--weights", str(checkpoint), str(other), "--batch-size", "4", "--workers", "0",
            "--device", "cpu", "--project", str(tmp_path / "runs"), "--task", "study"]
    assert val.main(args) == 0
    save_dir = tmp_path / "runs" / "exp"
    assert sorted(path.name for path in (tmp_path / "runs").iterdir()) == ["exp"]  # one folder for the whole study
    assert sorted(path.name for path in save_dir.iterdir()) == ["study.png", f"study_{data.stem}_other.txt",
                                                                f"study_{data.stem}_tiny.txt"]
    rows = np.loadtxt(save_dir / f"study_{data.stem}_tiny.txt", ndmin=2)
    assert rows.shape == (2, 10) and np.all(rows[:, 4:7] == 0) and np.all(rows[:, 8] > 0)
    for size, row in zip((64, 96), rows):  # each row is that size's validation, as val.py gives it alone
        alone = val.run(data=str(data), weights=str(checkpoint), imgsz=size, batch_size=4, workers=0, device="cpu",
                        project=str(tmp_path / "alone"), plots=False)
        assert np.allclose(row[:4], [alone.mp, alone.mr, alone.map50, alone.map], rtol=1e-3, atol=1e-6)
    assert "Study saved to" in capsys.readouterr().out
    from PIL import Image
    assert Image.open(save_dir / "study.png").size[0] > 100


def test_a_confidence_threshold_above_0_001_is_warned_about_outside_timing(tiny, checkpoint, tmp_path, caplog):
    import logging

    root, data = tiny
    options = dict(data=str(data), weights=str(checkpoint), imgsz=64, batch_size=4, workers=0, device="cpu",
                   project=str(tmp_path / "runs"), plots=False, conf_thres=0.25)
    with caplog.at_level(logging.WARNING):
        val.run(**options)
        val.run(task="speed", **options)  # speed sets its own thresholds
    said = [r.getMessage() for r in caplog.records if "--conf-thres" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith("WARNING: --conf-thres 0.25 > 0.001")


def test_save_hybrid_puts_the_ground_truth_among_the_predictions(loader, tmp_path):
    """--save-hybrid (YOLOv5's autolabelling): each image's labels join its candidates with confidence 1 before NMS,
    so a poor model scores near 1 and its label files hold every ground-truth box (plus what NMS kept besides)."""
    plain = validate(OracleModel(loader, jitter=0.3, false_positives=5), loader, ["class0", "class1"], "cpu",
                     plots=False)
    hybrid = validate(OracleModel(loader, jitter=0.3, false_positives=5), loader, ["class0", "class1"], "cpu",
                      save_dir=tmp_path, plots=False, save_txt=True, save_conf=True, save_hybrid=True)
    assert plain.map < 0.9 and hybrid.map50 == pytest.approx(1.0) and hybrid.map > plain.map
    targets = torch.cat([t for _, t, _, _ in loader])
    lines = [line.split() for path in sorted((tmp_path / "labels").glob("*.txt")) for line in path.read_text().splitlines()]
    certain = [line for line in lines if float(line[-1]) == 1.0]
    assert len(certain) >= len(targets) == hybrid.instances  # every ground-truth box, with confidence 1


def test_nms_takes_ground_truth_rows_as_candidates_of_confidence_one():
    from utils.nms import non_max_suppression

    pred = torch.zeros(1, 2, 7)
    pred[0, 0] = torch.tensor([50, 50, 20, 20, 0.9, 0.8, 0.1])  # class 0, conf 0.72
    pred[0, 1] = torch.tensor([10, 10, 8, 8, 0.9, 0.1, 0.7])  # class 1, conf 0.63
    truth = [torch.tensor([[0, 51, 50, 20, 20], [1, 80, 80, 10, 10]], dtype=torch.float32)]
    [det] = non_max_suppression(pred, 0.25, 0.45, labels=truth)
    assert det[:, 4].tolist() == pytest.approx([1.0, 1.0, 0.63])  # the truth first; it suppressed the overlapping box
    assert det[:, :4].tolist()[:2] == [[41.0, 40.0, 61.0, 60.0], [75.0, 75.0, 85.0, 85.0]]
    [only] = non_max_suppression(pred, 0.25, 0.45, classes=[1], labels=truth)  # the class filter takes truth too
    assert only[:, 5].tolist() == [1.0, 1.0] and only[0, 4] == 1.0
    [none] = non_max_suppression(pred, 0.25, 0.45, labels=[torch.zeros(0, 5)])
    assert none[:, 4].tolist() == pytest.approx([0.72, 0.63])
