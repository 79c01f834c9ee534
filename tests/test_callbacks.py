"""YOLOv5's callbacks (utils/callbacks.py): every hook called where and with what YOLOv5 v7.0 calls it, a run that
observes through them trains exactly as one without, and ``stop_training`` stops a run that resumes exactly."""
import csv
import sys
import threading

import pytest
import torch

import train as train_script
import val as val_script
from tests.conftest import make_tiny_run
from tests.test_resume import full_state, max_difference
from utils.callbacks import HOOKS, Callbacks
from utils.loggers import RESULTS_KEYS
from utils.trainer import stages

EPOCHS, BATCHES = 2, 4  # 8 training images in batches of 2


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("callbacks")
    return (root, *make_tiny_run(root))


def options(tiny, name: str) -> dict:
    root, data, cfg = tiny
    return dict(data=str(data), cfg=str(cfg), weights="", imgsz=64, batch_size=2, epochs=EPOCHS, device="cpu",
                workers=0, cache="off", project=str(root / "runs"), name=name, noautoanchor=True, noplots=True)


def plain_run(tiny):
    """last.pt of the run with ``options`` and no callbacks (trained once per module), its optimizer kept."""
    last = tiny[0] / "runs" / "plain" / "weights" / "last.pt"
    if not last.exists():
        assert train_script.run(**options(tiny, "plain")).last == last
    return last


def recording() -> tuple[Callbacks, list]:
    """Callbacks with an action on every hook that records (hook, args, kwargs)."""
    callbacks, calls = Callbacks(), []
    for hook in HOOKS:
        callbacks.register_action(hook, name="record",
                                  callback=lambda *args, _hook=hook, **kwargs: calls.append((_hook, args, kwargs)))
    return callbacks, calls


def test_registry_is_yolov5s():
    callbacks = Callbacks()
    with pytest.raises(ValueError, match="unknown callback hook 'on_train_epoch_done'"):
        callbacks.register_action("on_train_epoch_done", callback=print)
    with pytest.raises(ValueError, match="not callable"):
        callbacks.register_action("on_train_end", callback=None)
    seen, done = [], threading.Event()
    callbacks.register_action("on_train_end", name="a", callback=lambda *args: seen.append(("a", args)))
    callbacks.register_action("on_train_end", name="b", callback=lambda *args: (seen.append(("b", args)), done.set()))
    assert [a["name"] for a in callbacks.get_registered_actions("on_train_end")] == ["a", "b"]
    assert set(callbacks.get_registered_actions()) == set(HOOKS)
    callbacks.run("on_train_end", 1, 2)
    assert seen == [("a", (1, 2)), ("b", (1, 2))]
    callbacks.run("on_train_end", 3, thread=True)
    assert done.wait(10)
    for _ in range(100):  # "a"'s thread started first; both append once
        if len(seen) == 4:
            break
        threading.Event().wait(0.05)
    assert sorted(seen[2:]) == [("a", (3,)), ("b", (3,))]
    assert callbacks.stop_training is False


@pytest.mark.slow
def test_every_hook_as_yolov5_calls_it(tiny, monkeypatch):
    root, data, _ = tiny
    monkeypatch.setattr(stages, "strip_checkpoint", lambda path: None)  # full checkpoints, to compare below
    callbacks, calls = recording()
    monkeypatch.setattr(sys, "argv", ["train.py"])
    opt = train_script.parse_opt(True)  # YOLOv5's script form
    for key, value in options(tiny, "observed").items():
        setattr(opt, key, value)
    result = train_script.main(opt, callbacks)
    names = [hook for hook, *_ in calls]
    assert names[:3] == ["on_pretrain_routine_start", "on_pretrain_routine_end", "on_train_start"]
    assert names[-2:] == ["on_train_end", "teardown"]
    counts = {hook: names.count(hook) for hook in HOOKS}
    steps = EPOCHS * BATCHES  # batches; the optimizer steps are fewer while warmup accumulates
    assert counts["on_train_epoch_start"] == counts["on_train_epoch_end"] == EPOCHS
    assert counts["on_train_batch_start"] == counts["on_train_batch_end"] == steps
    assert 0 < counts["optimizer_step"] == counts["on_before_zero_grad"] <= steps
    assert counts["on_fit_epoch_end"] == counts["on_model_save"] == counts["on_epoch_stats"] == EPOCHS
    assert counts["on_val_start"] == counts["on_val_end"] == EPOCHS + 1  # each epoch and best.pt's final one
    assert counts["on_val_image_end"] == 4 * (EPOCHS + 1) and counts["on_params_update"] == 0

    labels, class_names = next(args for hook, args, _ in calls if hook == "on_pretrain_routine_end")
    assert labels.shape[1] == 5 and class_names == {0: "class0", 1: "class1"}
    batch_ends = [args for hook, args, _ in calls if hook == "on_train_batch_end"]
    assert [ni for _, ni, *_ in batch_ends] == list(range(steps))
    model, _, imgs, targets, paths, vals = batch_ends[-1]
    assert isinstance(model, torch.nn.Module) and imgs.shape[:2] == (2, 3) and float(imgs.max()) <= 1.0
    assert targets.shape[1] == 6 and len(paths) == 2 and len(vals) == 3
    rows = list(csv.DictReader((result.save_dir / "results.csv").read_text().replace(" ", "").splitlines()))
    assert [float(v) for v in vals] == pytest.approx([float(rows[-1][k]) for k in RESULTS_KEYS[:3]], rel=1e-4)
    assert [kwargs for hook, _, kwargs in calls if hook == "on_train_epoch_end"] == [{"epoch": 0}, {"epoch": 1}]
    for epoch, (log_vals, at, best_fitness, fi) in enumerate(args for h, args, _ in calls if h == "on_fit_epoch_end"):
        assert at == epoch and best_fitness >= fi and len(log_vals) == 13
        assert log_vals == pytest.approx([float(rows[epoch][k]) for k in RESULTS_KEYS], rel=1e-4, abs=1e-7)
    saves = [args for hook, args, _ in calls if hook == "on_model_save"]
    assert [(last.name, epoch, final) for last, epoch, final, *_ in saves] == [("last.pt", 0, False), ("last.pt", 1, True)]
    last, best, epoch, results = next(args for hook, args, _ in calls if hook == "on_train_end")
    assert (last, best, epoch) == (result.last, result.best, EPOCHS - 1)
    metrics = result.final_metrics
    assert results[:4] == pytest.approx([metrics[k] for k in RESULTS_KEYS[3:7]]) and len(results) == 7

    nt, tp, fp, p, r, f1, ap, ap50, ap_class, confusion = [args for h, args, _ in calls if h == "on_val_end"][-1]
    val_labels = sum(len(f.read_text().splitlines()) for f in (data.parent / "labels" / "val").glob("*.txt"))
    assert nt.sum() == val_labels and len(p) == len(r) == len(ap) == len(ap50) == len(ap_class)
    assert confusion.matrix.shape == (3, 3)
    pred, predn, path, image_names, im = [args for h, args, _ in calls if h == "on_val_image_end"][-1]
    assert pred.shape[1] == predn.shape[1] == 6 and path.suffix == ".jpg" and im.shape[0] == 3
    assert image_names == {0: "class0", 1: "class1"}

    # the observed run trained exactly as one without callbacks
    assert max_difference(full_state(plain_run(tiny))[0], full_state(result.last)[0]) == 0.0

    # val.run(callbacks=...) on weights: the hooks of one validation
    seen, val_calls = recording()
    val_script.run(data=str(data), weights=str(result.best), imgsz=64, batch_size=2, device="cpu", plots=False,
                   project=str(root / "val"), callbacks=seen)
    val_names = [hook for hook, *_ in val_calls]
    assert val_names[0] == "on_val_start" and val_names[-1] == "on_val_end"
    assert val_names.count("on_val_batch_start") == val_names.count("on_val_batch_end") == 2


@pytest.mark.slow
def test_stop_training_stops_resumably(tiny, monkeypatch):
    """``callbacks.stop_training`` set at a batch's end: the run stops at the next optimizer step with last.pt there and
    returns without final metrics; --resume then ends as the uninterrupted run."""
    monkeypatch.setattr(stages, "strip_checkpoint", lambda path: None)
    callbacks = Callbacks()

    def stop_after_second(model, ni, *_):
        if ni == 1:
            callbacks.stop_training = True
    callbacks.register_action("on_train_batch_end", callback=stop_after_second)
    ended = []
    callbacks.register_action("on_train_end", callback=lambda *args: ended.append(args))
    result = train_script.run(callbacks=callbacks, **options(tiny, "stopped"))
    assert result.final_metrics == {} and not ended and result.last.exists()
    position = torch.load(result.last, weights_only=True)["training"]["run"]
    assert 2 <= position["epoch"] * BATCHES + position["batch"] < EPOCHS * BATCHES  # the next optimizer step
    resumed = train_script.run(resume=str(result.last))
    assert max_difference(full_state(plain_run(tiny))[0], full_state(resumed.last)[0]) == 0.0
    assert resumed.final_metrics


def test_callbacks_refused_where_they_would_not_run(tiny):
    from utils.errors import ArgumentError

    with pytest.raises(ArgumentError, match="not evolve"):
        train_script.run(callbacks=Callbacks(), evolve=2, **options(tiny, "evolve"))
    with pytest.raises(ArgumentError, match="main\\(opt, callbacks\\)"):
        train_script.main(["--epochs", "1"], Callbacks())
