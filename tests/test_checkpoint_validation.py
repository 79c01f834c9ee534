"""Checkpoints as untrusted data: one validation of a resumable checkpoint (utils.checkpoint.checks) and
bounded formatting of everything read from a file (utils.errors.shorten / one_line, class names, the
pickle budget of the legacy torch format). Each case is a small file or dict crafted here."""
from __future__ import annotations

import copy
import math
import time
from collections import OrderedDict
from pathlib import Path

import pytest
import torch
import yaml

import train as train_script
from models import build_model, load_model
from models.yolo import DetectionModel
from tests.conftest import TINY_MODEL_YAML, make_tiny_dataset
from utils import checkpoint as checkpoint_module
from utils import pickle_scan
from utils.checkpoint import (CheckpointError, class_names, load_checkpoint, load_resumable, model_state,
                              save_checkpoint, training_checkpoint, training_state)
from utils.checkpoint.checks import check_against_run
from utils.config import ConfigError, Hyp, TrainConfig
from utils.errors import one_line, shorten
from utils.trainer.ema import ModelEMA
from utils.trainer.optim import (EpochSchedule, build_optimizer, lr_lambda, restore_optimizer, restore_scaler,
                                 restore_schedule)
from utils.trainer.recorder import epoch_values
from utils.rng import capture_rng
from utils.trainer.state import RunState

EPOCHS = 4
SECONDS = 2.0  # every refusal here answers well within this on a busy 2-core machine


def bomb(depth: int = 60, leaf="x"):
    """A list whose expansion has 2**depth leaves, pickled in a few hundred bytes (shared references)."""
    value = [leaf]
    for _ in range(depth):
        value = [value, value]
    return value


def tiny_model(seed: int = 0) -> DetectionModel:
    torch.manual_seed(seed)
    model = DetectionModel(yaml.safe_load(TINY_MODEL_YAML))
    model.names = ["class0", "class1"]
    return model


def make_resumable(data: str = "data.yaml", optimizer_name: str = "SGD", **options) -> dict:
    """A resumable checkpoint as the trainer writes it, one epoch of 8 batches done: optimizer state from two
    real steps, a results row, the generator state of one process."""
    model = tiny_model()
    hyp = Hyp()
    config = TrainConfig(data=data, epochs=EPOCHS, batch_size=2, imgsz=64, optimizer=optimizer_name, **options)
    optimizer = build_optimizer(model, optimizer_name, hyp.lr0, hyp.momentum, 1e-5)
    scheduler = EpochSchedule(optimizer, lr_lambda(EPOCHS, hyp.lrf))
    ema = ModelEMA(model)
    for _ in range(2):
        outputs = model(torch.rand(1, 3, 64, 64))
        sum(output.float().mean() for output in outputs).backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
    scheduler.step()
    state = RunState(epoch=0)
    state.counters.global_step, state.counters.last_optimizer_step = 8, 7
    state.end_epoch(epoch_values([0.1, 0.2, 0.3], None, [0.01, 0.01, 0.01]), 0.0)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    return training_checkpoint(model, ema, optimizer, scaler, scheduler, state.to_dict(), [capture_rng()],
                               config.to_dict(), hyp.to_dict())


@pytest.fixture(scope="module")
def resumable():
    return make_resumable()


def refused(call, *fragments) -> str:
    """Run ``call``, expect a one-line CheckpointError/ConfigError holding every fragment, quickly."""
    start = time.perf_counter()
    with pytest.raises((CheckpointError, ConfigError)) as error:
        call()
    message = str(error.value)
    assert time.perf_counter() - start < SECONDS
    assert "\n" not in message and len(message) < 600, message
    for fragment in fragments:
        assert fragment in message, message
    return message


# ---------------------------------------------------------------- the project's own files pass

def test_own_checkpoint_round_trips_through_the_validation(tmp_path, resumable):
    path = save_checkpoint(resumable, tmp_path / "last.pt")
    checkpoint, used = load_resumable(path)
    state = training_state(checkpoint, used)
    assert state.run["epoch"] == 1 and len(state.rng) == 1
    adam = save_checkpoint(make_resumable(optimizer_name="Adam"), tmp_path / "adam.pt")
    assert training_state(load_checkpoint(adam), adam).optimizer["state"]  # Adam's step / moments accepted


# ---------------------------------------------------------------- run state: one line naming file and field

def mutate(checkpoint: dict, change) -> dict:
    changed = copy.deepcopy(checkpoint)
    change(changed)
    return changed


def run_of(checkpoint):
    return checkpoint["training"]["run"]


BAD_FIELDS = {
    "imgsz": (lambda c: c["config"].update(imgsz=10 ** 6), "option 'imgsz'"),
    "batch_size 0": (lambda c: c["config"].update(batch_size=0), "option 'batch_size'"),
    "batch_size -1": (lambda c: c["config"].update(batch_size=-1), "config.batch_size"),
    "epochs 0": (lambda c: c["config"].update(epochs=0), "option 'epochs'"),
    "epochs text": (lambda c: c["config"].update(epochs="4"), "option 'epochs'"),
    "freeze bomb": (lambda c: c["config"].update(freeze=bomb()), "option 'freeze'"),
    "hyp lr0": (lambda c: c["hyp"].update(lr0=float("nan")), "'lr0'"),
    "negative epoch": (lambda c: run_of(c).update(epoch=-1), "training.run.epoch"),
    "epoch past epochs": (lambda c: run_of(c).update(epoch=EPOCHS + 1), "training.run.epoch"),
    "batch 10**15": (lambda c: run_of(c).update(batch=10 ** 15), "training.run.batch"),
    "batch bool": (lambda c: run_of(c).update(batch=True), "training.run.batch"),
    "missing counters": (lambda c: run_of(c).pop("counters"), "training.run.counters"),
    "counters not a dict": (lambda c: run_of(c).update(counters=[1, 2]), "training.run.counters"),
    "last_optimizer_step 10**18": (lambda c: run_of(c)["counters"].update(last_optimizer_step=10 ** 18),
                                   "training.run.counters.last_optimizer_step"),
    "global_step below epochs": (lambda c: run_of(c)["counters"].update(global_step=0, last_optimizer_step=-1),
                                 "training.run.counters.global_step"),
    "huge int": (lambda c: run_of(c)["counters"].update(global_step=10 ** 5000), "global_step"),
    "nonfinite_in_row": (lambda c: run_of(c)["counters"].update(nonfinite_in_row=3), "nonfinite_in_row"),
    "skipped_steps_in_row": (lambda c: run_of(c)["counters"].update(skipped_steps_in_row=3), "skipped_steps_in_row"),
    "skipped_steps_total": (lambda c: run_of(c)["counters"].update(skipped_steps_total=10 ** 9),
                            "training.run.counters.skipped_steps_total"),
    "loss_sums nan": (lambda c: run_of(c).update(loss_sums=[0.0, math.nan, 0.0]), "training.run.loss_sums[1]"),
    "best_fitness inf": (lambda c: run_of(c).update(best_fitness=math.inf), "training.run.best_fitness"),
    "world_size": (lambda c: run_of(c).update(world_size=0), "training.run.world_size"),
    "too many results": (lambda c: run_of(c)["results"].append(dict(run_of(c)["results"][0], epoch=1)),
                         "training.run.results", "2 rows for 1 finished epochs"),
    "result not finite": (lambda c: run_of(c)["results"][0].update({"x/lr0": math.inf}),
                          "training.run.results[0].x/lr0"),
    "result row bomb": (lambda c: run_of(c).update(results=[bomb()]), "training.run.results[0]"),
    "planned_epochs": (lambda c: run_of(c).update(planned_epochs=-3), "training.run.planned_epochs"),
    "train_seconds": (lambda c: run_of(c).update(train_seconds=math.inf), "training.run.train_seconds"),
    "maps nan": (lambda c: run_of(c).update(maps=[math.nan, 0.5]), "training.run.maps[0]"),
    "rng count": (lambda c: c["training"]["rng"].append(c["training"]["rng"][0]), "training.rng", "2 generator"),
    "rng torch shape": (lambda c: c["training"]["rng"][0].update(torch=torch.zeros(3, dtype=torch.uint8)),
                        "training.rng[0].torch"),
    "rng python": (lambda c: c["training"]["rng"][0].update(python=(3, (1,) * 10, None)), "training.rng[0].python"),
    "rng numpy key": (lambda c: c["training"]["rng"][0]["numpy"].update(key=[2 ** 40] * 624),
                      "training.rng[0].numpy.key"),
    "param indices": (lambda c: c["training"]["optimizer"]["param_groups"][1].update(params=bomb()),
                      "training.optimizer.param_groups[1].params"),
    "optimizer state key": (lambda c: c["training"]["optimizer"]["state"].update({10 ** 6: {}}),
                            "training.optimizer.state"),
    "ema_updates": (lambda c: c["training"].update(ema_updates=10 ** 9), "training.ema_updates"),
    "scaler": (lambda c: c["training"].update(scaler={"scale": math.nan, "_growth_tracker": 0}),
               "training.scaler.scale"),
}


def test_a_checkpoint_from_before_skipped_steps_were_counted_resumes(resumable):
    older = mutate(resumable, lambda c: [run_of(c)["counters"].pop(key)
                                         for key in ("skipped_steps_in_row", "skipped_steps_total")])
    state = training_state(older, Path("last.pt"))
    assert state.run["counters"]["global_step"] == run_of(resumable)["counters"]["global_step"]


@pytest.mark.parametrize("case", BAD_FIELDS)
def test_bad_run_state_fields_are_one_line_naming_file_and_field(resumable, case):
    change, *fragments = BAD_FIELDS[case]
    path = Path("runs/train/exp/weights/last.pt")
    refused(lambda: training_state(mutate(resumable, change), path), str(path), *fragments)


def test_version_and_format_bombs_are_one_line(tmp_path, resumable):
    version = mutate(resumable, lambda c: c["training"].update(version=bomb()))
    refused(lambda: training_state(version, tmp_path / "v.pt"), "training state version")
    path = save_checkpoint({"format": bomb(), "model": {"yaml": {}, "state_dict": {}}}, tmp_path / "format.pt")
    path_bytes = path.stat().st_size
    assert path_bytes < 20_000  # the whole bomb is a few KB on disk
    refused(lambda: load_checkpoint(path), str(path), "unsupported checkpoint format")


def test_shared_rows_in_results_are_refused_without_walking_them(resumable):
    shared = run_of(resumable)["results"][0]
    huge = mutate(resumable, lambda c: run_of(c).update(epoch=EPOCHS))
    run_of(huge)["results"] = [shared] * 3_000_000  # one row object, three million times
    refused(lambda: training_state(huge, Path("last.pt")), "training.run.results", "3000000 rows")
    repeated = mutate(resumable, lambda c: run_of(c).update(epoch=EPOCHS, batch=0))
    run_of(repeated)["counters"].update(global_step=40, last_optimizer_step=39)
    run_of(repeated)["results"] = [shared] * EPOCHS  # as many rows as epochs, but one object: epochs repeat
    refused(lambda: training_state(repeated, Path("last.pt")), "training.run.results[1].epoch")


def test_resume_of_a_crafted_file_is_one_line_before_anything_is_built(tmp_path, resumable, capsys):
    path = save_checkpoint(mutate(resumable, lambda c: run_of(c)["counters"].update(last_optimizer_step=10 ** 18)),
                           tmp_path / "run" / "weights" / "last.pt")
    capsys.readouterr()  # (an earlier train.py run's log handler may have written here)
    start = time.perf_counter()
    assert train_script.main(["--resume", str(path), "--device", "cpu"]) == 1
    assert time.perf_counter() - start < 30
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "last_optimizer_step" in err[0], err
    assert not any((tmp_path / "run" / name).exists() for name in ("results.csv", "opt.yaml", "hyp.yaml"))


# ---------------------------------------------------------------- against the built model and optimizer

@pytest.mark.slow
def test_resume_past_the_end_of_an_epoch_is_one_line(tmp_path, capsys):
    """run.batch = 10**14 with counters that agree passes the file's own checks; the loader's length refuses it
    before any state is restored or any batch is trained."""
    data = make_tiny_dataset(tmp_path / "data", num_train=16)
    checkpoint = make_resumable(data=str(data), workers=0, cache="off", noplots=True, noautoanchor=True,
                                device="cpu")
    run_of(checkpoint).update(batch=10 ** 14)
    run_of(checkpoint)["counters"].update(global_step=10 ** 14 + 8, last_optimizer_step=10 ** 14 + 7)
    path = save_checkpoint(checkpoint, tmp_path / "run" / "weights" / "last.pt")
    capsys.readouterr()  # (an earlier train.py run's log handler may have written here)
    assert train_script.main(["--resume", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and str(path) in err[0] and "training.run.batch" in err[0] and "8 batches" in err[0], err
    assert not (tmp_path / "run" / "results.csv").exists()


def test_optimizer_state_is_checked_against_the_model(tmp_path, resumable):
    path = tmp_path / "last.pt"
    model = tiny_model(seed=1)
    optimizer = build_optimizer(model, "SGD", 0.01, 0.937, 1e-5)

    def check(checkpoint, batches_per_epoch=8):
        check_against_run(training_state(checkpoint, path), optimizer, ModelEMA(model).ema, batches_per_epoch, 2)

    check(resumable)  # the model it was written for
    first = min(resumable["training"]["optimizer"]["state"])
    wrong_shape = mutate(resumable, lambda c: c["training"]["optimizer"]["state"][first].update(
        momentum_buffer=torch.zeros(7)))
    refused(lambda: check(wrong_shape), f"training.optimizer.state[{first}].momentum_buffer", "shape")
    wrong_key = mutate(resumable, lambda c: c["training"]["optimizer"]["state"][first].update(exp_avg=torch.zeros(1)))
    refused(lambda: check(wrong_key), f"training.optimizer.state[{first}]", "momentum_buffer")

    def move_one(c):
        groups = c["training"]["optimizer"]["param_groups"]
        groups[0]["params"], groups[1]["params"] = groups[0]["params"][:-1], groups[0]["params"][-1:] + groups[1]["params"]
    refused(lambda: check(mutate(resumable, move_one)), "training.optimizer.param_groups[0].params")
    def drop_last_group(c):
        optimizer_state = c["training"]["optimizer"]
        dropped = optimizer_state["param_groups"].pop()["params"]
        for index in dropped:
            optimizer_state["state"].pop(index, None)
    two_groups = mutate(resumable, drop_last_group)
    refused(lambda: check(two_groups), "training.optimizer.param_groups", "2 groups")
    ema = mutate(resumable, lambda c: c["ema"]["state_dict"].update({"model.0.conv.weight": torch.zeros(1)}))
    refused(lambda: check(ema), "ema.state_dict.model.0.conv.weight")
    # run.batch = 10**15 with counters that agree: only the loader knows an epoch's length
    far = mutate(resumable, lambda c: run_of(c).update(batch=10 ** 14))
    run_of(far)["counters"].update(global_step=10 ** 14 + 8, last_optimizer_step=10 ** 14 + 7)
    refused(lambda: check(far), "training.run.batch", "8 batches")


def test_settings_come_from_the_hyp_and_position_not_the_file(resumable):
    hyp = Hyp()
    saved = mutate(resumable, lambda c: [group.update(lr=123.0, momentum=0.1, maximize=True, weight_decay=0.5,
                                                      nesterov=False, initial_lr=7.0)
                                         for group in c["training"]["optimizer"]["param_groups"]])
    saved["training"]["scheduler"].update(base_lrs=[99.0] * 3, last_epoch=77, epoch=77)
    model = tiny_model()
    optimizer = build_optimizer(model, "SGD", hyp.lr0, hyp.momentum, 1e-5)
    scheduler = EpochSchedule(optimizer, lr_lambda(EPOCHS, hyp.lrf))
    state = training_state(saved, Path("last.pt"))
    restore_optimizer(optimizer, state.optimizer)
    restore_schedule(scheduler, state.run["epoch"])
    factor = lr_lambda(EPOCHS, hyp.lrf)(1)
    for group in optimizer.param_groups:
        assert group["lr"] == hyp.lr0 * factor and group["initial_lr"] == hyp.lr0
        assert group["momentum"] == hyp.momentum and group["maximize"] is False and group["nesterov"] is True
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 1e-5, 0.0]
    assert scheduler.epoch == 1 and scheduler.rates() == [hyp.lr0 * factor] * 3
    for index, entry in resumable["training"]["optimizer"]["state"].items():  # the state itself is loaded
        parameter = [p for g in optimizer.param_groups for p in g["params"]][index]
        assert torch.equal(optimizer.state[parameter]["momentum_buffer"], entry["momentum_buffer"])
    scheduler.step()  # and steps on from there as an uninterrupted run does
    assert optimizer.param_groups[0]["lr"] == hyp.lr0 * lr_lambda(EPOCHS, hyp.lrf)(2)


def test_loss_scale_is_restored_but_not_its_settings():
    scaler = torch.amp.GradScaler("cpu", enabled=True, growth_factor=2.0)
    restore_scaler(scaler, {"scale": 1024.0, "_growth_tracker": 5, "growth_factor": 1e9, "backoff_factor": 7.0})
    state = scaler.state_dict()
    assert state["scale"] == 1024.0 and state["_growth_tracker"] == 5
    assert state["growth_factor"] == 2.0 and state["backoff_factor"] == 0.5


# ---------------------------------------------------------------- class names and bounded formatting

@pytest.mark.parametrize("names, fragment", [
    (bomb(), "names[0]"), ({0: bomb()}, "names[0]"), ("class0", "expected a list"), (["a" * 10_000, "b"], "names[0]"),
    ({0: "a", "1": "b"}, "integer keys"), ([bomb(), "b"], "names[0]")])
def test_class_names_are_flat_short_strings(tmp_path, names, fragment):
    model = tiny_model()
    entry = {**model_state(model), "names": names}
    path = save_checkpoint({"model": entry, "ema": None}, tmp_path / "names.pt")
    refused(lambda: load_model(path), str(path), fragment)
    refused(lambda: build_model(entry, source="entry"), fragment)


def test_class_names_accepted_forms_and_count():
    assert class_names(["a", "b"], "x") == ["a", "b"]
    assert class_names({1: "b", 0: "a"}, "x") == ["a", "b"]
    entry = {**model_state(tiny_model()), "names": ["a", "b", "c"]}
    refused(lambda: build_model(entry, source="three.pt"), "three.pt", "3 class names for a model of 2 classes")


def test_legacy_torch_format_has_the_pickle_budget(tmp_path, monkeypatch):
    model = tiny_model()
    legacy = tmp_path / "legacy.pt"
    torch.save({"format": checkpoint_module.FORMAT, "model": model_state(model), "ema": None}, legacy,
               _use_new_zipfile_serialization=False)
    assert legacy.read_bytes()[:1] == b"\x80"
    assert load_model(legacy).names == ["class0", "class1"]  # within the budget: loads as before
    padded = tmp_path / "padded.pt"
    torch.save({"format": checkpoint_module.FORMAT, "model": model_state(model), "ema": None,
                "padding": "p" * 300_000}, padded, _use_new_zipfile_serialization=False)
    monkeypatch.setattr(pickle_scan, "MAX_PICKLE_BYTES", 200_000)
    refused(lambda: load_checkpoint(padded), str(padded), "legacy torch file", "0 MB")
    assert load_model(legacy).names == ["class0", "class1"]
    declared = tmp_path / "declared.pt"  # a string that claims 4 GB: refused without reading or allocating it
    declared.write_bytes(b"\x80\x02\x8a\x0a\x6c\xfc\x9c\x46\xf9\x20\x6a\xa8\x50\x19.\x80\x02X\xff\xff\xff\xff" + bytes(64))
    refused(lambda: load_checkpoint(declared), str(declared))


def test_shorten_and_one_line_are_bounded_for_shared_and_subclassed_containers():
    many = {f"k{i}": i for i in range(1_000_000)}
    ordered = OrderedDict(a=bomb(80), b=2)
    values = [bomb(80), ordered, many, set(range(1_000_000)), bytearray(10 ** 7), b"\0" * 10 ** 7,
              torch.zeros(1000, 1000), (bomb(80),), {bomb(5)[0][0][0][0][0][0]: bomb(80)}]
    start = time.perf_counter()
    texts = [shorten(value) for value in values]
    lines = [one_line(KeyError(bomb(80))), one_line(ValueError("a\nb" * 10 ** 6)), one_line(ordered)]
    assert time.perf_counter() - start < SECONDS
    assert all(len(text) <= 80 for text in texts) and all(len(line) <= 2000 for line in lines)
    assert texts[2].startswith("{'k0': 0, 'k1': 1") and texts[6].startswith("<Tensor shape=(1000, 1000)")
    assert lines[0].startswith("KeyError: [[[") and lines[1].startswith("a b")
    assert shorten((1,)) == "(1,)" and shorten(OrderedDict(a=1)) == "{'a': 1}" and shorten(torch.tensor(2)) == "tensor(2)"


def tuple_bomb_pickle(depth: int = 60) -> bytes:
    """Protocol-2 pickle of {t: 1} where t = (t', t') nested ``depth`` times over ('x',): 2**depth items to hash
    as a dict key, in 4 bytes per level (memo references), with only opcodes torch's weights_only loader runs."""
    body = b"\x80\x02}(" + b"X\x01\x00\x00\x00x\x85q\x00"
    for level in range(depth):
        body += b"h" + bytes([level]) + b"\x86q" + bytes([level + 1])  # (t, t) from t on the stack and the memo
    return body + b"K\x01u."


def torch_zip(path: Path, pickle_bytes: bytes) -> Path:
    import zipfile

    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle_bytes)
        archive.writestr("archive/byteorder", "little")
        archive.writestr("archive/version", "3\n")
    return path


def test_tuples_that_expand_when_hashed_are_refused_before_loading(tmp_path):
    nested = ("x",)
    for _ in range(3):
        nested = (nested, nested)
    small = torch_zip(tmp_path / "small.pt", tuple_bomb_pickle(depth=3))
    assert torch.load(small, weights_only=True) == {nested: 1}  # torch's loader runs this pickle (and hashes the key)
    scan = pickle_scan.scan_pickle(tuple_bomb_pickle(depth=3))
    sizes = [3 * 2 ** level - 1 for level in range(4)]  # ('x',), then (t, t): 2, 5, 11, 23 items expanded
    assert scan.balanced and scan.tuple_work == sizes[0] + sum(sizes[level - 1] + sizes[level] for level in range(1, 4))
    path = torch_zip(tmp_path / "tuples.pt", tuple_bomb_pickle())  # 2**60 items to hash: torch.load never returns
    assert path.stat().st_size < 1_000
    refused(lambda: load_checkpoint(path), str(path), "expand")
