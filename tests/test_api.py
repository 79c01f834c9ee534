"""The Python API: train.run / val.run / detect.run take the flags as keywords, check them with the command line's
parser, raise its one-line errors, return the results, and leave the process as they found it."""
from __future__ import annotations

import logging
import random
import signal
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from tqdm._monitor import TMonitor  # tqdm's one progress-bar monitor thread per process, started on first use

import detect
import train as train_script
import val
from tests.conftest import ROOT, fresh_python, make_tiny_run, save_random_checkpoint
from utils.api import keyword_argv
from utils.errors import ArgumentError, UserError

NAMES = ["RBC", "WBC", "Platelets"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("api")
    return (root, *make_tiny_run(root))


@pytest.fixture(scope="module")
def tiny_checkpoint(tiny):
    """The tiny model (random weights, 2 classes) saved by the project's checkpoint code."""
    return save_random_checkpoint(tiny[0] / "tiny.pt", ["class0", "class1"])


def detecting_checkpoint(path: Path) -> Path:
    """yolov5n at nc=3 with objectness and class biases raised so every image yields detections."""
    return save_random_checkpoint(path, NAMES, cfg=ROOT / "models" / "yolov5n.yaml", confident=True)


def make_images(folder: Path, count: int = 2) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(count):
        image = np.full((120 + 10 * i, 160, 3), 200, np.uint8)
        cv2.circle(image, (60, 60), 25, (80, 40, 160), -1)
        cv2.rectangle(image, (100, 20), (150, 90), (30, 160, 40), -1)
        paths.append(folder / f"generated_{i}.jpg")
        cv2.imwrite(str(paths[-1]), image)
    return paths


def process_state() -> dict:
    """What an API call must leave as it found it."""
    root = logging.getLogger()
    return {"handlers": list(root.handlers), "level": root.level, "threads": torch.get_num_threads(),
            "python threads": sorted(t.name for t in threading.enumerate() if not isinstance(t, TMonitor)),
            "signals": (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)),
            "process group": torch.distributed.is_available() and torch.distributed.is_initialized(),
            "deterministic": torch.are_deterministic_algorithms_enabled(),
            "python rng": random.getstate(), "numpy rng": np.random.get_state()[1].tolist(),
            "torch rng": torch.get_rng_state().tolist()}


# --- keywords -> the command line ---------------------------------------------------------------------

def test_keywords_become_the_command_line_they_stand_for(tmp_path):
    parser = train_script.build_parser()
    argv = keyword_argv(parser, {"batch_size": 4, "img": 320, "rect": True, "exist_ok": False, "resume": "x/last.pt",
                                 "freeze": [0, 1], "cache": False, "label_smoothing": 0.1, "project": tmp_path,
                                 "evolve": None, "seed": 3})
    assert argv == ["--batch-size=4", "--imgsz=320", "--rect", "--resume=x/last.pt", "--freeze", "0", "1",
                    "--cache=off", "--label-smoothing=0.1", f"--project={tmp_path}", "--seed=3"]
    args = train_script.parse_args(argv)
    assert (args.batch_size, args.imgsz, args.rect, args.exist_ok, args.resume, args.freeze, args.cache) == \
        (4, 320, True, False, "x/last.pt", [0, 1], "off")
    assert keyword_argv(parser, {"resume": True, "evolve": True, "cache": True}) == ["--resume", "--evolve", "--cache"]
    assert keyword_argv(detect.build_parser(), {"imgsz": (320, 480), "classes": 0}) == \
        ["--imgsz", "320", "480", "--classes", "0"]
    assert keyword_argv(parser, {}) == [] and train_script.parse_args([]).epochs == 100  # the defaults are the CLI's


def test_a_switch_named_by_its_flag_or_by_its_option_means_the_same():
    parser = train_script.build_parser()
    assert keyword_argv(parser, {"no_tensorboard": True}) == ["--no-tensorboard"]  # the flag's own name
    assert keyword_argv(parser, {"tensorboard": False}) == ["--no-tensorboard"]  # the option it sets
    assert keyword_argv(parser, {"no_tensorboard": False}) == [] == keyword_argv(parser, {"tensorboard": True})
    assert train_script.parse_args(keyword_argv(parser, {"no_tensorboard": True})).tensorboard is False


@pytest.mark.parametrize("script, keywords, expected", [
    (train_script, {"batchsize": 4}, "unknown keyword argument 'batchsize' (did you mean batch_size?) "
                                     "(see train.py --help)"),
    (val, {"weight": "x.pt"}, "unknown keyword argument 'weight' (did you mean weights?) (see val.py --help)"),
    (detect, {"conf": 0.3}, "unknown keyword argument 'conf'"),
    (train_script, {"rect": "yes"}, "argument --rect: rect takes True or False, got 'yes'"),
    (train_script, {"imgsz": 320, "img_size": 640}, "keyword arguments imgsz and img_size set the same option"),
    (val, {"imgsz": [320, 640]}, "argument --imgsz/--img/--img-size: imgsz takes one value, got [320, 640]"),
    (val, {"plots": "no"}, "plots takes True or False, got 'no'"),
])
def test_unknown_or_misshapen_keywords_are_one_line_argument_errors(script, keywords, expected, tmp_path):
    with pytest.raises(ArgumentError) as raised:
        script.run(project=str(tmp_path / "runs"), **keywords)
    assert str(raised.value).startswith(expected) and "\n" not in str(raised.value)
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("script, flag, keyword, value", [
    (train_script, "--batch-size", "batch_size", 0), (train_script, "--epochs", "epochs", 0),
    (train_script, "--label-smoothing", "label_smoothing", 1.5), (train_script, "--optimizer", "optimizer", "Lion"),
    (val, "--conf-thres", "conf_thres", -1), (val, "--imgsz", "imgsz", 100000),
    (detect, "--max-det", "max_det", 0), (detect, "--imgsz", "imgsz", [64, 64, 64]),
])
def test_bad_values_raise_the_command_lines_message(script, flag, keyword, value, tmp_path, capsys):
    """Same parser, same one-line message: the exception's text is what the command line prints after 'error: '."""
    with pytest.raises(ArgumentError) as raised:
        script.run(project=str(tmp_path / "runs"), **{keyword: value})
    values = [str(v) for v in value] if isinstance(value, list) else [str(value)]
    prog = Path(script.__file__).name
    assert script.main(["--project", str(tmp_path / "runs"), flag, *values]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [f"{prog}: error: {raised.value}"]
    assert not (tmp_path / "runs").exists()


def test_api_call_restores_logging_threads_rng_and_switches():
    """What the calls may change on the way (training seeds the generators, sets threads and switches)."""
    from utils.api import api_call

    before = process_state()
    with api_call():
        torch.set_num_threads(1)
        torch.manual_seed(123), np.random.seed(1), random.seed(2)
        torch.use_deterministic_algorithms(True, warn_only=True)
        logging.getLogger().handlers[:] = []
        logging.getLogger().setLevel(logging.DEBUG)
    assert process_state() == before


def test_an_api_call_imports_no_compiler():
    """An API call that changed none of torch's deterministic switches leaves them alone on its way out: torch's
    setter imports torch._inductor and torch._dynamo (~3 s on a 2-core Zen 3, on the first val.run of a process)."""
    code = ("import sys, torch\n"
            "from utils.api import api_call\n"
            "with api_call():\n"
            "    torch.backends.cudnn.deterministic = True\n"
            "print(torch.backends.cudnn.deterministic, 'torch._inductor' in sys.modules, 'torch._dynamo' in sys.modules)\n")
    assert fresh_python(code) == ["False False False"]


@pytest.fixture
def callers_pyplot():
    """A caller's pyplot: its own backend (a notebook's stands here as pdf) and an open figure."""
    import matplotlib
    import matplotlib.pyplot as plt

    previous = matplotlib.get_backend()
    plt.switch_backend("pdf")
    figure = plt.figure()
    state = lambda: (matplotlib.get_backend(), plt.get_fignums(), plt.gcf() is figure)  # noqa: E731
    try:
        yield state
    finally:
        plt.close(figure)
        plt.switch_backend(previous)


def test_val_run_plots_leave_the_callers_pyplot_alone(tiny, tiny_checkpoint, callers_pyplot):
    root, data, _ = tiny
    before = callers_pyplot()
    result = val.run(data=data, weights=tiny_checkpoint, imgsz=64, batch_size=4, workers=0, device="cpu", amp="off",
                     project=root / "val-plots", plots=True, conf_thres=0.0001)
    assert callers_pyplot() == before == ("pdf", before[1], True) and len(before[1]) == 1
    for name in ("PR_curve.png", "F1_curve.png", "confusion_matrix.png"):
        assert cv2.imread(str(result.save_dir / name)) is not None, name  # drawn all the same


def test_plot_functions_draw_without_pyplot(tmp_path, callers_pyplot):
    from utils.plots import plot_confusion_matrix, plot_results

    before = callers_pyplot()
    (tmp_path / "results.csv").write_text("epoch,train/box_loss,train/obj_loss\n0,0.5,0.1\n1,0.4,0.2\n")
    paths = [plot_results(tmp_path / "results.csv"), plot_confusion_matrix(np.eye(3), tmp_path / "cm.png", ["a", "b"])]
    assert callers_pyplot() == before
    assert all(cv2.imread(str(path)) is not None for path in paths)


@pytest.fixture
def callers_process_group(tmp_path):
    """A one-process gloo group the caller made before calling the API (its own launcher, its own store)."""
    import torch.distributed as torch_dist

    store = torch_dist.FileStore(str(tmp_path / "store"), 1)
    torch_dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield torch_dist.group.WORLD
    finally:
        if torch_dist.is_initialized():
            torch_dist.destroy_process_group()


@pytest.mark.slow
def test_train_run_leaves_the_callers_process_group_and_pyplot(tiny, callers_process_group, callers_pyplot):
    """train.run (plots on) in a process that has its own process group: the run uses it and leaves it joined."""
    import torch.distributed as torch_dist

    root, data, cfg = tiny
    pyplot = callers_pyplot()
    result = train_script.run(data=data, cfg=cfg, weights="", imgsz=64, batch_size=4, epochs=1, workers=0, device="cpu",
                              project=root / "in-group", noautoanchor=True, no_tensorboard=True)
    assert torch_dist.is_initialized() and torch_dist.group.WORLD is callers_process_group
    assert callers_pyplot() == pyplot
    assert result.best.is_file() and (result.save_dir / "results.png").is_file()
    torch_dist.barrier()  # still usable


def test_cleanup_destroys_only_the_group_it_created(callers_process_group):
    from utils import dist

    dist.cleanup()
    assert torch.distributed.is_initialized() and torch.distributed.group.WORLD is callers_process_group


def test_multi_gpu_without_torchrun_is_refused_like_the_command_line():
    with pytest.raises(ArgumentError, match="one process per GPU is started by torchrun"):
        train_script.run(device="0,1", epochs=1)


# --- the calls, each twice in one process -----------------------------------------------------------

@pytest.mark.slow
def test_train_run_twice_returns_the_runs_and_leaves_the_process_as_it_was(tiny):
    root, data, cfg = tiny
    options = dict(data=data, cfg=cfg, weights="", imgsz=64, batch_size=4, epochs=1, workers=0, device="cpu",
                   project=root / "train", noautoanchor=True, noplots=True)
    before = process_state()
    first = train_script.run(**options)
    second = train_script.run(**options)
    assert process_state() == before
    assert (first.save_dir, second.save_dir) == (root / "train" / "exp", root / "train" / "exp2")
    for result in (first, second):
        assert result.best == result.save_dir / "weights" / "best.pt" and result.best.is_file()
        assert result.last == result.save_dir / "weights" / "last.pt" and result.last.is_file()
        assert set(result.final_metrics) == {"metrics/precision", "metrics/recall", "metrics/mAP_0.5",
                                             "metrics/mAP_0.5:0.95"}
        assert all(0 <= value <= 1 for value in result.final_metrics.values())
        header, row = [line.split(",") for line in (result.save_dir / "results.csv").read_text().splitlines()]
        written = {key.strip(): float(value) for key, value in zip(header, row)}
        assert written["epoch"] == 0 and result.epochs_run == 1
        assert {key: pytest.approx(written[key], rel=1e-4, abs=1e-5) for key in result.last_row if key != "epoch"} \
            == {key: value for key, value in result.last_row.items() if key != "epoch"}
    assert first.last_row == second.last_row  # the same seed, the same run


@pytest.mark.slow
def test_ctrl_c_in_train_run_saves_like_the_command_line_and_resume_finishes_it(tiny, monkeypatch):
    import os

    from utils.trainer import TrainingInterrupted
    from utils.trainer.interrupt import SaveControl

    root, data, cfg = tiny
    install = SaveControl.install

    def install_then_ctrl_c(control):
        installed = install(control)
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C once the trainer listens: stop at the next optimizer step
        return installed

    before = process_state()
    monkeypatch.setattr(SaveControl, "install", install_then_ctrl_c)
    with pytest.raises(TrainingInterrupted) as stopped:
        train_script.run(data=data, cfg=cfg, weights="", imgsz=64, batch_size=4, epochs=2, workers=0, device="cpu",
                         project=root / "interrupted", noautoanchor=True, noplots=True)
    monkeypatch.setattr(SaveControl, "install", install)
    assert process_state() == before  # the trainer's SIGINT handler is gone again
    last = root / "interrupted" / "exp" / "weights" / "last.pt"
    assert stopped.value.exit_status == 130 and "stopped by SIGINT at epoch 1/2" in str(stopped.value)
    assert f"--resume {last}" in str(stopped.value) and last.is_file()
    resumed = train_script.run(resume=last)
    assert resumed.save_dir == last.parents[1] and resumed.epochs_run == 2 and resumed.best.is_file()


def test_train_run_raises_a_bad_data_file_as_an_exception(tiny, tmp_path):
    _, _, cfg = tiny
    with pytest.raises(UserError, match="nope.yaml"):
        train_script.run(data=tmp_path / "nope.yaml", cfg=cfg, weights="", epochs=1, device="cpu", project=tmp_path / "runs")
    assert not (torch.distributed.is_available() and torch.distributed.is_initialized())


@pytest.mark.slow
def test_val_run_twice_returns_overall_and_per_class_metrics(tiny, tiny_checkpoint):
    root, data, _ = tiny
    options = dict(data=data, weights=tiny_checkpoint, imgsz=64, batch_size=4, workers=0, device="cpu", amp="off",
                   project=root / "val", plots=False, conf_thres=0.0001)
    before = process_state()
    first, second = val.run(**options), val.run(**options)
    assert process_state() == before
    assert (first.save_dir, second.save_dir) == (root / "val" / "exp", root / "val" / "exp2")
    assert (first.mp, first.mr, first.map50, first.map) == (second.mp, second.mr, second.map50, second.map)
    assert first.seen == 4 and [c["name"] for c in first.per_class] == ["class0", "class1"]
    assert sum(c["instances"] for c in first.per_class) == first.instances > 0
    assert np.mean([c["mAP50-95"] for c in first.per_class]) == pytest.approx(first.map)
    assert np.mean([c["mAP50"] for c in first.per_class]) == pytest.approx(first.map50)
    assert np.mean([c["precision"] for c in first.per_class]) == pytest.approx(first.mp)
    both = val.run(**{**options, "weights": [tiny_checkpoint, tiny_checkpoint]})  # several: their ensemble
    assert both.map == pytest.approx(first.map, abs=1e-6)  # a model twice: its duplicate boxes fall to NMS
    with pytest.raises(UserError, match="missing.pt"):
        val.run(**{**options, "weights": root / "missing.pt"})
    # YOLOv5's call and return value: data and weights by position, (mp, mr, map50, map, *losses), maps, t
    rest = {k: v for k, v in options.items() if k not in ("data", "weights")}
    (mp, mr, map50, map_, *losses), maps, t = val.run(data, tiny_checkpoint, **rest)
    assert (mp, mr, map50, map_) == (first.mp, first.mr, first.map50, first.map) and len(losses) == 3
    assert np.array_equal(maps, first.maps) and len(t) == 3
    with pytest.raises(ArgumentError, match="got weights both by position and as a keyword"):
        val.run(data, tiny_checkpoint, weights=tiny_checkpoint)


def test_detect_run_twice_returns_each_images_detections(tmp_path):
    weights = detecting_checkpoint(tmp_path / "weights.pt")
    images = make_images(tmp_path / "images")
    options = dict(weights=weights, source=tmp_path / "images", imgsz=96, device="cpu", amp="off", max_det=20,
                   project=tmp_path / "detect", save_txt=True, save_conf=True)
    before = process_state()
    first, second = detect.run(**options), detect.run(**options)
    assert process_state() == before
    assert (first.save_dir, second.save_dir) == (tmp_path / "detect" / "exp", tmp_path / "detect" / "exp2")
    assert first.detections == second.detections
    assert list(first.detections) == [str(path) for path in images]
    for path in images:
        found = first.detections[str(path)]
        assert 1 <= len(found) <= 20 and all(d.name == NAMES[d.class_id] and d.score > 0.25 for d in found)
        height, width = cv2.imread(str(path)).shape[:2]
        expected = sorted(tuple(float(v) for v in line.split())
                          for line in (first.save_dir / "labels" / f"{path.stem}.txt").read_text().splitlines())
        rows = sorted((d.class_id, (d.xyxy[0] + d.xyxy[2]) / 2 / width, (d.xyxy[1] + d.xyxy[3]) / 2 / height,
                       (d.xyxy[2] - d.xyxy[0]) / width, (d.xyxy[3] - d.xyxy[1]) / height, d.score) for d in found)
        assert np.allclose(rows, expected, atol=1e-5)  # the label files hold the same boxes
    with pytest.raises(UserError, match="source not found"):
        detect.run(**{**options, "source": tmp_path / "nothing"})
    # YOLOv5's order by position: weights, source (it was taken for stream=True and yolov5s.pt loaded)
    rest = {k: v for k, v in options.items() if k not in ("weights", "source")}
    third = detect.run(weights, tmp_path / "images", **rest)
    assert third.detections == first.detections and third.save_dir == tmp_path / "detect" / "exp3"
    with pytest.raises(ArgumentError, match="takes at most 27 positional arguments"):
        detect.run(*range(28))


# --- detect.run(stream=True) ----------------------------------------------------------------------------

def make_video(path: Path, frames: int) -> Path:
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 10.0, (128, 96))
    for i in range(frames):
        frame = np.full((96, 128, 3), 30 * i, np.uint8)
        cv2.rectangle(frame, (20 + 5 * i, 20), (70 + 5 * i, 70), (0, 200, 255), -1)
        writer.write(frame)
    writer.release()
    return path


@pytest.fixture(scope="module")
def streaming(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    return root, detecting_checkpoint(root / "weights.pt"), make_video(root / "clip.mp4", 6)


def test_detect_stream_yields_each_frame_as_it_is_processed_and_keeps_none(streaming, monkeypatch):
    import gc
    import weakref

    root, weights, video = streaming
    options = dict(weights=weights, source=video, imgsz=96, device="cpu", amp="off", max_det=20, save_txt=True)
    collected = detect.run(project=root / "collected", **options)

    class Tracked(list):  # the detections of one frame, with weak references allowed
        pass

    as_detections = detect.as_detections
    monkeypatch.setattr(detect, "as_detections", lambda det, names: Tracked(as_detections(det, names)))
    stream = detect.run(stream=True, project=root / "streamed", **options)
    labels = stream.save_dir / "labels"
    assert isinstance(stream, detect.DetectStream) and stream.save_dir == root / "streamed" / "exp"
    received, alive = {}, []
    for found in stream:
        assert sorted(p.name for p in labels.iterdir()) == [f"clip_{i}.txt" for i in range(1, found.frame + 1)]
        received[found.key] = list(found.detections)  # one frame at a time: the next one is not read yet
        alive.append(weakref.ref(found.detections))
        assert (found.path, found.key) == (str(video), f"{video}:{found.frame}")
    del found
    gc.collect()
    assert [ref() for ref in alive] == [None] * 6  # the stream kept no frame's detections
    assert received == collected.detections and len(received) == 6


def test_detect_stream_steps_leave_the_caller_alone_between_items(streaming, monkeypatch):
    """Between two items the caller's own logging and random generators are in force: the call's guard covers
    only its steps (one around the whole iteration would log through its console handler in the caller's code and
    undo the caller's draws at its end)."""
    root, weights, video = streaming
    monkeypatch.setattr(logging.getLogger(), "handlers", [])  # a caller without logging: the call adds a console
    random.seed(5)
    expected = [random.random() for _ in range(7)]
    random.seed(5)
    draws = []
    for _ in detect.run(stream=True, weights=weights, source=video, imgsz=96, device="cpu", amp="off",
                        project=root / "between", nosave=True):
        assert logging.getLogger().handlers == []
        draws.append(random.random())
    draws.append(random.random())
    assert draws == expected


def test_detect_stream_closed_early_finishes_its_video_and_bad_input_raises_at_once(streaming):
    root, weights, video = streaming
    with detect.run(stream=True, weights=weights, source=video, imgsz=96, device="cpu", amp="off",
                    project=root / "early") as stream:
        first = next(stream)
    assert first.frame == 1
    capture = cv2.VideoCapture(str(stream.save_dir / "clip.mp4"))
    assert capture.read()[0] and not capture.read()[0]  # a playable file holding the one frame drawn
    capture.release()
    with pytest.raises(UserError, match="source not found"):
        detect.run(stream=True, weights=weights, source=root / "nothing", project=root / "bad")
    assert not (root / "bad").exists()
