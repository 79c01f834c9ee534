"""End-to-end: a two-epoch run of a tiny model on a tiny generated dataset writes every output file."""
import json
import math
from pathlib import Path

import pytest
import torch

import train as train_script
from tests.conftest import make_tiny_run

EXPECTED_FILES = [
    "weights/last.pt", "weights/best.pt", "results.csv", "results.png", "opt.yaml", "hyp.yaml", "labels.jpg",
    "labels_correlogram.jpg",    "train_batch0.jpg", "val_batch0_labels.jpg", "val_batch0_pred.jpg", "confusion_matrix.png",
    "PR_curve.png", "F1_curve.png", "P_curve.png", "R_curve.png",
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    return (root, *make_tiny_run(root))


def run_train(tiny, *extra, autoanchor: bool = False):
    root, data, cfg = tiny
    args = ["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "64", "--batch-size", "4", "--epochs", "2",
            "--workers", "0", "--device", "cpu", "--project", str(root / "runs"), *extra]
    return train_script.main(args if autoanchor else [*args, "--noautoanchor"])


def record_plot_requests(monkeypatch) -> list:
    """("epoch" | "final", plots) for each validation a run makes."""
    from utils.trainer import stages, trainer

    calls = []

    def recorder(kind, validate):
        def wrapped(*args, plots, **kwargs):
            calls.append((kind, plots))
            return validate(*args, plots=plots, **kwargs)
        return wrapped
    monkeypatch.setattr(trainer, "validate_epoch", recorder("epoch", stages.validate_epoch))
    monkeypatch.setattr(stages, "validate_epoch", recorder("final", stages.validate_epoch))
    return calls


@pytest.mark.slow
def test_two_epoch_run_writes_every_output(tiny, monkeypatch):
    root = tiny[0]
    plot_requests = record_plot_requests(monkeypatch)
    assert run_train(tiny) == 0
    # the plots are drawn once, by the final validation of best.pt (the last epoch's would be overwritten)
    assert plot_requests == [("epoch", False), ("epoch", False), ("final", True)]
    save_dir = root / "runs" / "exp"
    missing = [f for f in EXPECTED_FILES if not (save_dir / f).exists()]
    assert not missing, f"missing outputs: {missing}"
    lines = (save_dir / "results.csv").read_text().splitlines()
    header = [c.strip() for c in lines[0].split(",")]
    assert header[:4] == ["epoch", "train/box_loss", "train/obj_loss", "train/cls_loss"] and header[-1] == "x/lr2"
    assert len(lines) == 3  # header + 2 epochs
    checkpoint = torch.load(save_dir / "weights/last.pt", weights_only=True)  # plain data
    assert checkpoint["ema"] is None and "optimizer" not in checkpoint  # stripped at the end
    assert checkpoint["model"]["names"] == ["class0", "class1"]
    # a second run never overwrites the first
    assert run_train(tiny, "--epochs", "1", "--noplots", "--image-weights", "--multi-scale") == 0
    assert (root / "runs" / "exp2" / "weights" / "last.pt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("extra, epochs", [(("--nosave",), [("epoch", False), ("epoch", True)]),
                                           (("--epochs", "1"), [("epoch", True)])])
def test_last_epoch_draws_the_plots_when_best_pt_may_be_missing(tiny, monkeypatch, extra, epochs):
    """--nosave writes best.pt at the last epoch only if it improved; a 1-epoch run has no best.pt before its last
    epoch: that epoch's validation draws the plots, and the final validation runs (and draws) if best.pt exists."""
    plot_requests = record_plot_requests(monkeypatch)
    assert run_train(tiny, *extra, "--name", "plots") == 0
    save_dir = sorted((tiny[0] / "runs").glob("plots*"), key=lambda p: p.stat().st_mtime)[-1]
    final = [("final", True)] if (save_dir / "weights/best.pt").exists() else []
    assert plot_requests == epochs + final
    assert (save_dir / "PR_curve.png").exists() and (save_dir / "confusion_matrix.png").exists()


@pytest.mark.slow
def test_noval_never_stops_early_and_best_is_the_newest_epoch(tiny):
    """--noval leaves the epochs before the last unvalidated (fitness 0): as in YOLOv5 they tie with the best, so
    --patience does not stop the run at epoch patience + 1 with best.pt from epoch 0."""
    assert run_train(tiny, "--noval", "--patience", "1", "--epochs", "3", "--noplots", "--name", "noval") == 0
    save_dir = tiny[0] / "runs" / "noval"
    assert len((save_dir / "results.csv").read_text().splitlines()) == 4  # header + 3 epochs: not stopped early
    assert torch.load(save_dir / "weights/best.pt", weights_only=True)["epoch"] == 2  # the last finished epoch


@pytest.mark.slow
def test_an_early_stop_under_nosave_keeps_the_stopping_epochs_weights(tiny, monkeypatch):
    """--patience ends the run after an epoch that may be its last: under --nosave that epoch is saved as the final
    one is (YOLOv5's possible_stop), instead of leaving weights/ empty."""
    from utils.trainer import trainer

    falling = iter([0.5, 0.4, 0.3, 0.2, 0.1, 0.0])
    monkeypatch.setattr(trainer, "fitness_of", lambda values: next(falling))
    assert run_train(tiny, "--nosave", "--patience", "2", "--epochs", "6", "--noplots", "--name", "stopped") == 0
    save_dir = tiny[0] / "runs" / "stopped"
    assert len((save_dir / "results.csv").read_text().splitlines()) == 4  # epochs 0-2: stopped after epoch 2
    assert torch.load(save_dir / "weights/last.pt", weights_only=True)["epoch"] == 2
    assert not (save_dir / "weights/best.pt").exists()  # epoch 0, the best, was not saved (--nosave; it could not end)


@pytest.mark.slow
@pytest.mark.parametrize("extra", [(), ("--nosave",)])
def test_a_signal_during_an_epochs_validation_stops_the_run_at_that_epochs_end(tiny, monkeypatch, extra):
    """SIGTERM while epoch 0 validates: the run stops at the end of epoch 0, its checkpoint written (under --nosave
    too), instead of after epoch 1's first optimizer steps; --resume trains epochs 1 and 2."""
    import signal

    from utils.trainer import TrainingInterrupted, trainer

    validate, calls = trainer.validate_epoch, []

    def signalled(*args, **options):
        calls.append(1)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGTERM)
        return validate(*args, **options)

    monkeypatch.setattr(trainer, "validate_epoch", signalled)
    root, data, cfg = tiny
    name = "signalled" + "-".join(extra)
    with pytest.raises(TrainingInterrupted) as stopped:
        train_script.run(data=data, cfg=cfg, weights="", imgsz=64, batch_size=4, epochs=3, workers=0, device="cpu",
                         project=root / "runs", name=name, noautoanchor=True, noplots=True,
                         nosave=bool(extra))
    assert stopped.value.exit_status == 143 and "stopped by SIGTERM at epoch 2/3, batch 0/" in str(stopped.value)
    last = root / "runs" / name / "weights" / "last.pt"
    run = torch.load(last, weights_only=True)["training"]["run"]
    assert (run["epoch"], run["batch"], len(run["results"])) == (1, 0, 1)
    monkeypatch.setattr(trainer, "validate_epoch", validate)
    assert train_script.run(resume=last).epochs_run == 3


@pytest.mark.slow
def test_a_run_on_coco_val2017_ends_with_yolov5s_coco_validation(tmp_path, monkeypatch):
    """Val split coco/val2017.txt with 80 classes: the final validation of best.pt runs NMS at IoU 0.65 and writes
    best_predictions.json in COCO's category ids for pycocotools, as YOLOv5's train.py does."""
    from tests.conftest import TINY_MODEL_YAML, make_tiny_dataset
    from utils.trainer import stages

    root = tmp_path / "coco"
    data = make_tiny_dataset(root, num_train=4, num_val=2, nc=80)
    (root / "val2017.txt").write_text("".join(f"./images/val/im{i}.jpg\n" for i in range(2)))
    data.write_text(data.read_text().replace("val: images/val", "val: val2017.txt"))
    (tmp_path / "tiny.yaml").write_text(TINY_MODEL_YAML)
    thresholds = []
    validate = stages.validate_epoch
    monkeypatch.setattr(stages, "validate_epoch",
                        lambda *args, **options: thresholds.append(options.get("iou_thres")) or validate(*args, **options))
    assert train_script.main(["--data", str(data), "--cfg", str(tmp_path / "tiny.yaml"), "--weights", "", "--imgsz",
                              "64", "--batch-size", "2", "--epochs", "1", "--workers", "0", "--device", "cpu",
                              "--noplots", "--noautoanchor", "--project", str(tmp_path / "runs")]) == 0
    from utils.coco import COCO_CATEGORY_IDS

    assert thresholds == [0.65]
    save_dir = tmp_path / "runs" / "exp"
    assert isinstance(json.loads((save_dir / "best_predictions.json").read_text()), list)  # a random model: maybe []
    truth = json.loads((save_dir / "annotations.json").read_text())  # the labels' ground truth in COCO's ids
    assert [c["id"] for c in truth["categories"]] == list(COCO_CATEGORY_IDS)
    labels = [int(line.split()[0]) for i in range(2) for line in (root / f"labels/val/im{i}.txt").read_text().splitlines()]
    assert sorted(a["category_id"] for a in truth["annotations"]) == sorted(COCO_CATEGORY_IDS[c] for c in labels)


@pytest.mark.slow
def test_cpu_bf16_autocast_run_trains_and_saves_float_weights(tiny):
    root = tiny[0]
    assert run_train(tiny, "--epochs", "1", "--noplots", "--amp", "bf16", "--name", "bf16") == 0
    save_dir = root / "runs" / "bf16"
    rows = (save_dir / "results.csv").read_text().splitlines()
    losses = [float(v) for v in rows[1].split(",")[1:4]]
    assert len(rows) == 2 and all(math.isfinite(v) and v > 0 for v in losses)
    checkpoint = torch.load(save_dir / "weights/last.pt", weights_only=True)
    dtypes = {v.dtype for v in checkpoint["model"]["state_dict"].values() if v.is_floating_point()}
    assert torch.bfloat16 not in dtypes


@pytest.mark.slow
def test_evolve_runs_generations_and_continues_counting(tiny):
    root = tiny[0]
    folder = root / "runs" / "evolve"
    for generations in ("2", "1"):
        assert run_train(tiny, "--evolve", generations, "--epochs", "1", "--name", "evolve", autoanchor=True) == 0
    lines = (folder / "evolve.csv").read_text().splitlines()
    assert len(lines) == 4 and "metrics/mAP_0.5" in lines[0] and "lr0" in lines[0]  # header + generations 1-3
    rows = [dict(zip([c.strip() for c in lines[0].split(",")], map(float, line.split(",")))) for line in lines[1:]]
    assert rows[0]["anchors"] == 3.0  # YOLOv5's start: 3 anchors per level, fitted by AutoAnchor, then evolved
    assert all(2.0 <= row["anchors"] <= 10.0 for row in rows)
    assert len({row["fliplr"] for row in rows}) == 1  # gain 0: never mutated
    assert (folder / "hyp_evolve.yaml").read_text().startswith("#")
    assert (folder / "evolve.png").stat().st_size > 1000
    assert not list(folder.glob(".generation-*"))  # each generation's training folder is removed
    assert not (root / "runs" / "evolve2").exists()  # never a new folder


@pytest.mark.parametrize("flag, value", [("--batch-size", "0"), ("--batch-size", "-2"), ("--epochs", "0"),
                                         ("--imgsz", "100000"), ("--workers", "-2"), ("--label-smoothing", "1.5"),
                                         ("--save-every-min", "nan"), ("--nbs", "0")])
def test_bad_flag_values_are_refused_before_any_work(tmp_path, capsys, flag, value):
    assert train_script.main(["--project", str(tmp_path / "runs"), f"{flag}={value}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("train.py: error: argument ") and flag in err[0]
    assert not (tmp_path / "runs").exists()


def test_evolve_is_refused_under_torchrun(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")  # torchrun's mark: without it RANK/WORLD_SIZE mean one process
    monkeypatch.setenv("WORLD_SIZE", "2")
    problem = train_script.launch_problem(train_script.parse_args(["--evolve", "3"]))
    assert "--evolve" in problem and "per GPU" in problem


def test_bad_data_yaml_is_one_line_error(tiny, capsys, tmp_path):
    root, _, cfg = tiny
    code = train_script.main(["--data", str(tmp_path / "nope.yaml"), "--cfg", str(cfg), "--weights", "", "--epochs", "1",
                              "--device", "cpu", "--project", str(tmp_path / "runs")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 1 and len(err) == 1 and "nope.yaml" in err[0]  # a bad input file: exit 1


@pytest.mark.slow
def test_loader_workers_train_exactly_like_the_main_process(tiny):
    """Worker processes (and their reused shared-memory batch buffers) feed the trainer the same batches
    (uncached: RAM-cached images would load in line on this CPU device)."""
    root = tiny[0]
    for workers in ("0", "2"):
        assert run_train(tiny, "--noplots", "--workers", workers, "--cache", "off", "--name", f"workers{workers}") == 0
    rows = [(root / "runs" / f"workers{w}" / "results.csv").read_text() for w in ("0", "2")]
    assert rows[0] == rows[1]


@pytest.mark.slow
def test_cudas_data_path_on_the_cpu_trains_exactly_the_same(tmp_path, monkeypatch):
    """CUDA's data path, forced on the CPU: one loader iterator across the run's epochs (the workers build the next
    epoch's first batches while an epoch ends and is validated) and each batch's copy issued before the one before
    it trains (utils/trainer/feed.py) train 3 epochs of 10 images (batches of 4: each epoch ends with 2) with 2
    workers to the same results.csv and last.pt as the CPU's way: one iterator per epoch, one batch at a time."""
    from utils.checkpoint import load_checkpoint
    from utils.data.loader import EpochStream
    from utils.trainer import loop, trainer

    root = tmp_path
    tiny = (root, *make_tiny_run(root, num_train=10))
    starts = []
    restart = EpochStream.restart

    def counted(self):
        starts.append(self)
        restart(self)

    monkeypatch.setattr(EpochStream, "restart", counted)
    for name, ahead in (("cpu", False), ("cuda", True)):
        monkeypatch.setattr(trainer, "loader_runs_ahead", lambda device, image_weights, ahead=ahead: ahead)
        monkeypatch.setattr(loop, "copies_run_ahead", lambda device, ahead=ahead: ahead)
        assert run_train(tiny, "--noplots", "--workers", "2", "--cache", "off", "--epochs", "3", "--name", name) == 0
    assert len(starts) == 3 + 1  # a new iterator each epoch, then one for the whole run
    folders = [root / "runs" / name for name in ("cpu", "cuda")]
    assert folders[0].joinpath("results.csv").read_text() == folders[1].joinpath("results.csv").read_text()
    weights = [load_checkpoint(folder / "weights" / "last.pt")["model"]["state_dict"] for folder in folders]
    assert all(torch.equal(weights[0][key], weights[1][key]) for key in weights[0])


@pytest.mark.slow
def test_autoanchor_fits_a_count_yaml_and_the_anchors_travel_with_the_weights(tiny, capsys):
    """A model YAML with 'anchors: 3' gets anchors from AutoAnchor; they are printed, written to anchors.yaml,
    stored in the checkpoint's YAML and printed again by val.py from the checkpoint."""
    import val
    import yaml
    from models import load_model

    root, data, cfg = tiny
    counted = root / "counted.yaml"
    text = cfg.read_text()
    start, end = text.index("anchors:"), text.index("backbone:")
    counted.write_text(text[:start] + "anchors: 3\n" + text[end:])
    args = ["--data", str(data), "--cfg", str(counted), "--weights", "", "--imgsz", "64", "--batch-size", "4", "--epochs", "1",
            "--workers", "0", "--device", "cpu", "--project", str(root / "runs"), "--name", "anchors", "--noplots"]
    assert train_script.main(args) == 0
    out = capsys.readouterr().out
    assert "AutoAnchor" in out and "Anchors (pixels, width x height) per level" in out
    written = yaml.safe_load((root / "runs" / "anchors" / "anchors.yaml").read_text())["anchors"]
    best = root / "runs" / "anchors" / "weights" / "best.pt"
    model = load_model(best)
    assert model.yaml["anchors"] == written
    pixels = (model.model[-1].anchors * model.model[-1].stride.view(-1, 1, 1)).view(3, -1)
    assert torch.allclose(pixels, torch.tensor(written, dtype=torch.float32), atol=1e-4)
    areas = pixels.view(3, 3, 2).prod(-1).mean(-1)
    assert bool((areas[1:] >= areas[:-1]).all())  # area grows with stride
    assert val.main(["--data", str(data), "--weights", str(best), "--imgsz", "64", "--device", "cpu",
                     "--project", str(root / "val")]) == 0
    assert "Anchors (pixels, width x height) per level" in capsys.readouterr().out
    assert train_script.main([*args, "--name", "anchors-off", "--noautoanchor"]) == 1  # a count needs AutoAnchor


def test_project_that_is_a_file_and_multi_gpu_without_torchrun_are_one_line(tmp_path, capsys):
    blocker = tmp_path / "file.txt"
    blocker.write_text("not a folder")
    assert train_script.main(["--project", str(blocker / "runs"), "--device", "cpu"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(blocker) in err[0]
    problem = train_script.launch_problem(train_script.parse_args(["--device", "0,1", "--epochs", "3"]), ["--epochs", "3"])
    assert problem.endswith("torchrun --nproc_per_node 2 train.py --epochs 3")


def test_a_batch_the_processes_cannot_split_is_refused_with_the_nearest_sizes(monkeypatch):
    from utils import dist

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "test")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(dist.SharedError, match="--batch-size 18 is not divisible by the 4 processes.*use 16 or 20") as error:
        dist.check_launch(18, torch.device("cpu"))
    assert error.value.exit_code == 2
    dist.check_launch(16, torch.device("cpu"))
