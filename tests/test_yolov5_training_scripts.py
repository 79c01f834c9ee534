"""Training scripts written against YOLOv5's modules (docs/yolov5-scripts.md): ``create_dataloader``,
``LoadImagesAndLabels``, ``ComputeLoss``, ``ModelEMA``, ``smart_optimizer``, ``ap_per_class``'s tuple and the
helpers beside them, under YOLOv5's paths, signatures and return values, computing what the project's trainer
computes."""
from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.conftest import TINY_MODEL_YAML, make_tiny_dataset

IMGSZ = 64


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """(train images folder, names): 8 tiny images with 2 classes."""
    root = tmp_path_factory.mktemp("yolov5_training")
    make_tiny_dataset(root, num_train=8, num_val=2)
    return root / "images" / "train", ["class0", "class1"]


def yolov5_model(nc: int = 2):
    """The tiny model set up as YOLOv5's train.py sets it up: hyp scaled for the levels, classes and image size,
    then ``model.hyp``, ``model.nc`` and ``model.names``."""
    import yaml

    from models.yolo import Model
    from utils.general import yaml_load

    torch.manual_seed(0)
    model = Model(yaml.safe_load(TINY_MODEL_YAML), ch=3, nc=nc)
    hyp = yaml_load("data/hyps/hyp.scratch-low.yaml")
    nl = model.model[-1].nl
    hyp["box"] *= 3 / nl
    hyp["cls"] *= nc / 80 * 3 / nl
    hyp["obj"] *= (IMGSZ / 640) ** 2 * 3 / nl
    hyp["label_smoothing"] = 0.0
    model.nc, model.hyp, model.names = nc, hyp, {i: f"class{i}" for i in range(nc)}
    return model, hyp


def batches(loader) -> list:
    return [(images.clone(), targets.clone(), list(paths)) for images, targets, paths, _ in loader]


def test_a_yolov5_style_training_loop_computes_what_the_trainer_computes(data):
    """YOLOv5's train.py loop, written by a user: the loss equals the project's DetectionLoss for the same model and
    hyp, the EMA counts the steps, each iteration of the loader is the next epoch, and a second run repeats it."""
    from utils.config import Hyp
    from utils.dataloaders import create_dataloader
    from utils.general import colorstr, yaml_load
    from utils.loss import ComputeLoss, DetectionLoss
    from utils.torch_utils import ModelEMA, smart_optimizer

    source, _ = data

    def run():
        model, hyp = yolov5_model()
        loader, dataset = create_dataloader(str(source), IMGSZ, 4, 32, hyp=hyp, augment=True, workers=0,
                                            prefix=colorstr("train: "), shuffle=True, seed=0)
        compute_loss = ComputeLoss(model)
        own = DetectionLoss(model, Hyp.from_dict(yaml_load("data/hyps/hyp.scratch-low.yaml")), imgsz=IMGSZ)
        optimizer = smart_optimizer(model, "SGD", hyp["lr0"], hyp["momentum"], hyp["weight_decay"])
        ema = ModelEMA(model)
        seen, losses = [], []
        for _ in range(2):
            model.train()
            for images, targets, paths, _ in loader:
                pred = model(images.float() / 255)
                loss, items = compute_loss(pred, targets)
                expected, expected_items = own(pred, targets)
                torch.testing.assert_close(loss, expected)
                torch.testing.assert_close(items, expected_items)
                loss.backward()
                optimizer.step()
                optimizer.zero_grad()
                ema.update(model)
                seen.append((images.clone(), targets.clone()))
                losses.append(float(loss.detach()))
        return seen, losses, ema, len(loader), dataset

    seen, losses, ema, per_epoch, dataset = run()
    assert per_epoch == 2 and len(dataset) == 8 and ema.updates == 4
    assert not torch.equal(seen[0][0], seen[2][0])  # the second epoch draws anew
    again, losses_again, _, _, _ = run()
    assert losses == losses_again
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(seen, again))


def test_create_dataloader_gives_the_project_loaders_batches_epoch_by_epoch(data):
    """Epoch e of the YOLOv5-named loader (its e-th iteration, or ``sampler.set_epoch(e)``) is epoch e of the
    project's own loader with the same seed: the same images, targets and paths."""
    from utils.data.loader import create_dataloader as own_loader
    from utils.data.loader import set_loader_epoch
    from utils.dataloaders import create_dataloader

    source, names = data
    _, hyp = yolov5_model()
    loader, _ = create_dataloader(str(source), IMGSZ, 4, 32, hyp=hyp, augment=True, workers=0, shuffle=True, seed=5)
    own, _ = own_loader(str(source), IMGSZ, 4, 32, hyp=None, augment=True, workers=0, shuffle=True, seed=5,
                        names=names)
    mine = [batches(loader), batches(loader)]
    loader.sampler.set_epoch(7)
    mine.append(batches(loader))
    for epoch, got in zip((0, 1, 7), mine):
        set_loader_epoch(own, epoch)
        expected = batches(own)
        assert len(got) == len(expected) == 2
        for (images, targets, paths), (own_images, own_targets, own_paths) in zip(got, expected):
            assert torch.equal(images, own_images) and torch.equal(targets, own_targets) and paths == own_paths


def test_load_images_and_labels_items_and_attributes_as_yolov5s(data, tmp_path):
    from utils.dataloaders import LoadImagesAndLabels
    from utils.datasets import LoadImagesAndLabels as old_name

    source, _ = data
    assert old_name is LoadImagesAndLabels
    dataset = LoadImagesAndLabels(str(source), img_size=IMGSZ, batch_size=4, augment=False)
    image, labels_out, path, shapes = dataset[0]
    assert image.dtype == torch.uint8 and image.shape[0] == 3 and max(image.shape[1:]) == IMGSZ
    assert labels_out.shape[1] == 6 and (labels_out[:, 0] == 0).all() and len(labels_out) == len(dataset.labels[0])
    (h0, w0), ((ratio_h, ratio_w), pad) = shapes
    assert (h0, w0) == (96, 112) and ratio_w == pytest.approx(IMGSZ / 112) and len(pad) == 2
    assert path == dataset.im_files[0] and dataset.label_files[0].endswith("labels/train/im0.txt")
    assert dataset.n == len(dataset) == 8 and dataset.img_size == IMGSZ and list(dataset.indices) == list(range(8))
    assert dataset.shapes.shape == (8, 2) and dataset.labels[0].shape[1] == 5
    with pytest.raises(ValueError, match="8 image indices in \\[0, 8\\)"):
        dataset.indices = [0] * 7
    dataset.indices = [5] * 8
    assert dataset[2][2] == dataset.im_files[5]

    augmented = LoadImagesAndLabels(str(source), img_size=IMGSZ, batch_size=4, augment=True,
                                    hyp={"mosaic": 1.0, "label_smoothing": 0.1})
    random.seed(1)
    first = augmented[3][0]
    second = augmented[3][0]
    random.seed(1)
    assert not torch.equal(first, second) and torch.equal(augmented[3][0], first)  # a new draw each call, seeded

    few = LoadImagesAndLabels(str(source), img_size=IMGSZ, min_items=3)
    assert 0 < few.n < 8 and all(len(labels) >= 3 for labels in few.labels)

    folder = tmp_path / "wide"  # a class id no number of classes limits: YOLOv5's train.py checks it later
    make_tiny_dataset(folder, num_train=2, num_val=1)
    (folder / "labels" / "train" / "im0.txt").write_text("41 0.5 0.5 0.2 0.2\n")
    assert LoadImagesAndLabels(str(folder / "images" / "train"), img_size=IMGSZ).labels[0][0, 0] == 41


def test_dataset_indices_set_between_epochs_reach_the_loaders_workers(data, tmp_path):
    """YOLOv5's --image-weights draw, ``dataset.indices = random.choices(...)``: from the next epoch on each position
    is that image and the mosaics' partners are drawn from ``indices``, in the loader's persistent workers too."""
    from utils.dataloaders import create_dataloader

    make_tiny_dataset(tmp_path, num_train=8, num_val=1)
    for label in (tmp_path / "labels" / "train").glob("*.txt"):  # class 0 in im0 only, class 1 everywhere else
        rows = [line.split()[1:] for line in label.read_text().splitlines()]
        label.write_text("".join(f"{int(label.stem != 'im0')} {' '.join(row)}\n" for row in rows))
    _, hyp = yolov5_model()
    loader, dataset = create_dataloader(str(tmp_path / "images" / "train"), IMGSZ, 4, 32, hyp=hyp, augment=True,
                                        workers=2, shuffle=True, seed=3)
    first = batches(loader)
    assert {cls for _, targets, _ in first for cls in targets[:, 1].tolist()} == {0.0, 1.0}
    dataset.indices = [0] * 8
    second = batches(loader)
    assert all(Path(path).name == "im0.jpg" for _, _, paths in second for path in paths)
    assert {cls for _, targets, _ in second for cls in targets[:, 1].tolist()} == {0.0}  # partners: im0 alone


def test_collate_functions_and_quad_batches(data):
    from utils.dataloaders import LoadImagesAndLabels, create_dataloader

    source, _ = data
    dataset = LoadImagesAndLabels(str(source), img_size=IMGSZ, batch_size=8, augment=True)
    items = [dataset[(i, 0)] for i in range(8)]
    images, targets, paths, shapes = LoadImagesAndLabels.collate_fn(items)
    assert images.shape == (8, 3, IMGSZ, IMGSZ) and targets.shape[1] == 6 and len(paths) == 8
    assert sorted(set(targets[:, 0].long().tolist())) == [i for i in range(8) if len(items[i][1])]
    quad_images, quad_targets, quad_paths, quad_shapes = LoadImagesAndLabels.collate_fn4(items)
    assert quad_images.shape == (2, 3, 2 * IMGSZ, 2 * IMGSZ) and quad_paths == paths[:2] and len(quad_shapes) == 2
    assert set(quad_targets[:, 0].long().tolist()) <= {0, 1} and (quad_targets[:, 2:] <= 1).all()

    loader, _ = create_dataloader(str(source), IMGSZ, 8, 32, augment=True, workers=0, quad=True, seed=2)
    (images, targets, paths, shapes), = list(loader)
    assert images.shape == (2, 3, 2 * IMGSZ, 2 * IMGSZ) and len(paths) == len(shapes) == 2


def test_compute_loss_reads_model_hyp_and_autobalances_as_yolov5s():
    from utils.loss import ComputeLoss

    model, hyp = yolov5_model()
    del model.hyp
    with pytest.raises(ValueError, match="model.hyp is not set"):
        ComputeLoss(model)
    model.hyp = {key: value for key, value in hyp.items() if key != "obj_pw"}
    with pytest.raises(ValueError, match="model.hyp has no obj_pw"):
        ComputeLoss(model)
    model.hyp = hyp
    loss = ComputeLoss(model, autobalance=True)
    assert (loss.nl, loss.na, loss.nc, loss.ssi) == (3, 3, 2, 1) and loss.hyp is hyp
    torch.manual_seed(0)
    preds = model.train()(torch.rand(2, 3, IMGSZ, IMGSZ))
    targets = torch.tensor([[0, 0, 0.5, 0.5, 0.3, 0.3], [1, 1, 0.3, 0.6, 0.2, 0.4]])
    before = list(loss.balance)
    total, items = loss(preds, targets)
    assert total.shape == (1,) and items.shape == (3,) and loss.balance[1] == 1.0 and loss.balance != before
    tcls, tbox, indices, anch = loss.build_targets(preds, targets)
    assert len(tcls) == len(tbox) == len(indices) == len(anch) == 3 and len(indices[0]) == 4


def test_ap_per_class_unpacks_as_yolov5s_tuple_and_plots(tmp_path):
    from utils.metrics import ConfusionMatrix, ap_per_class

    rng = np.random.default_rng(0)
    tp = rng.random((40, 10)) < 0.6
    conf, pred_cls, target_cls = rng.random(40), rng.integers(0, 3, 40), rng.integers(0, 3, 30)
    result = ap_per_class(tp, conf, pred_cls, target_cls, plot=True, save_dir=tmp_path, names={0: "a", 1: "b", 2: "c"},
                          prefix="val_")
    tp_, fp, p, r, f1, ap, ap_class = result
    assert all(x is y for x, y in zip((tp_, fp, p, r, f1, ap, ap_class), (result.tp, result.fp, result.p, result.r,
                                                                           result.f1, result.ap, result.classes)))
    assert ap.shape == (3, 10) and list(ap_class) == [0, 1, 2]
    assert sorted(f.name for f in tmp_path.iterdir()) == ["val_F1_curve.png", "val_PR_curve.png", "val_P_curve.png",
                                                          "val_R_curve.png"]

    confusion = ConfusionMatrix(nc=3)
    confusion.process_batch(torch.tensor([[10.0, 10, 50, 50, 0.9, 1]]), torch.tensor([[1.0, 12, 11, 50, 52]]))
    confusion.plot(save_dir=tmp_path, names=["a", "b", "c"])
    assert confusion.matrix[1, 1] == 1 and (tmp_path / "confusion_matrix.png").stat().st_size > 0


def test_torch_utils_training_helpers(caplog):
    from utils.torch_utils import (EarlyStopping, ModelEMA, copy_attr, de_parallel, is_parallel, smart_optimizer,
                                   torch_distributed_zero_first)

    model, _ = yolov5_model()
    for name, kind in (("SGD", torch.optim.SGD), ("Adam", torch.optim.Adam), ("AdamW", torch.optim.AdamW),
                       ("RMSProp", torch.optim.RMSprop)):
        optimizer = smart_optimizer(model, name, 0.01, 0.9, 5e-4)
        assert isinstance(optimizer, kind) and [g["weight_decay"] for g in optimizer.param_groups] == [0.0, 5e-4, 0.0]
        assert sum(len(g["params"]) for g in optimizer.param_groups) == len(list(model.parameters()))
        torch.optim.lr_scheduler.LambdaLR(optimizer, lambda epoch: 1.0)  # YOLOv5's scheduler takes it
    with pytest.raises(NotImplementedError, match="Lion"):
        smart_optimizer(model, "Lion")
    assert not is_parallel(model) and de_parallel(model) is model
    ema = ModelEMA(model, decay=0.9, tau=1, updates=3)
    assert ema.updates == 3 and ema.decay(3) == pytest.approx(0.9 * (1 - np.exp(-3)))
    target = type("Holder", (), {})()
    copy_attr(target, model, include=("nc", "names", "_private"))
    assert target.nc == 2 and target.names == model.names and not hasattr(target, "_private")

    stopper = EarlyStopping(patience=2)
    assert [stopper(epoch, fitness) for epoch, fitness in enumerate((0.1, 0.3, 0.2, 0.25, 0.2))] == [
        False, False, False, True, True]
    assert stopper.best_epoch == 1 and stopper.possible_stop
    assert not any(EarlyStopping(patience=0)(epoch, 0.0 - epoch) for epoch in range(50))
    ran = []
    with torch_distributed_zero_first(-1):
        ran.append(True)
    assert ran == [True]


def test_label_weights_as_yolov5s():
    from utils.general import labels_to_class_weights, labels_to_image_weights

    labels = [np.array([[0, 0.5, 0.5, 0.1, 0.1], [0, 0.2, 0.2, 0.1, 0.1]]), np.array([[2, 0.5, 0.5, 0.1, 0.1]])]
    weights = labels_to_class_weights(labels, nc=3)
    assert weights.dtype == torch.float32
    torch.testing.assert_close(weights, torch.tensor([0.5, 1.0, 1.0]) / 2.5)
    np.testing.assert_allclose(labels_to_image_weights(labels, nc=3, class_weights=weights.numpy()), [0.4, 0.4])
    np.testing.assert_allclose(labels_to_image_weights(labels, nc=3), [2, 1])


def test_create_dataloader_deals_each_torchrun_process_its_share(data, monkeypatch):
    """Under torchrun (rank given, a process group started) each process gets the batches the project's loader
    gives that rank: here rank 1 of 2, the process group stood in for."""
    from utils import dist
    from utils.data.loader import create_dataloader as own_loader
    from utils.data.loader import set_loader_epoch
    from utils.dataloaders import create_dataloader

    source, names = data
    monkeypatch.setattr(dist, "in_process_group", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    loader, _ = create_dataloader(str(source), IMGSZ, 2, 32, augment=True, workers=0, rank=1, shuffle=True, seed=4)
    loader.sampler.set_epoch(3)
    own, _ = own_loader(str(source), IMGSZ, 2, 32, augment=True, workers=0, shuffle=True, seed=4, rank=1,
                        world_size=2, names=names)
    set_loader_epoch(own, 3)
    got, expected = batches(loader), batches(own)
    assert len(got) == len(expected) == 2  # 4 of the 8 images
    assert all(a[2] == b[2] and torch.equal(a[0], b[0]) for a, b in zip(got, expected))
    other, _ = own_loader(str(source), IMGSZ, 2, 32, augment=True, workers=0, shuffle=True, seed=4, rank=0,
                          world_size=2, names=names)
    set_loader_epoch(other, 3)
    assert {p for batch in batches(other) for p in batch[2]}.isdisjoint({p for batch in got for p in batch[2]})


def test_val_run_validates_a_model_in_memory_as_yolov5s_train_py_calls_it(int8_trained, tmp_path):
    """``val.run(data_dict, model=ema.ema, dataloader=..., compute_loss=...)``: the metrics the same model scores
    from its checkpoint file, the val losses, the model's mode kept; the keywords that need weights refused."""
    import val
    from models.experimental import attempt_load
    from utils.dataloaders import create_dataloader
    from utils.errors import UserError
    from utils.general import check_dataset
    from utils.loss import ComputeLoss

    weights, data_yaml = int8_trained  # the tiny model trained for 30 epochs: it finds some boxes
    model = attempt_load(str(weights), device="cpu")
    model.hyp = yolov5_model()[1]
    data_dict = check_dataset(str(data_yaml))
    loader, _ = create_dataloader(data_dict["val"], IMGSZ, 2, 32, rect=True, pad=0.5, workers=0)
    model.train()
    in_memory = val.run(data_dict, batch_size=2, imgsz=IMGSZ, model=model, dataloader=loader,
                        compute_loss=ComputeLoss(model), plots=False, amp="off")
    assert model.training  # as it was
    (mp, mr, map50, map50_95, *losses), maps, speed = in_memory
    assert len(losses) == 3 and all(loss > 0 for loss in losses) and len(maps) == 2 and len(speed) == 3
    built = val.run(data=str(data_yaml), batch_size=2, imgsz=IMGSZ, model=model, plots=False, amp="off")
    from_file = val.run(data=str(data_yaml), weights=str(weights), batch_size=2, imgsz=IMGSZ, plots=False,
                        amp="off", project=str(tmp_path / "runs"))
    assert (built.mp, built.mr, built.map50, built.map) == (mp, mr, map50, map50_95)
    assert from_file.seen == in_memory.seen == 4 and from_file.map50 > 0
    assert (in_memory.mp, in_memory.mr, in_memory.map50, in_memory.map) == pytest.approx(
        (from_file.mp, from_file.mr, from_file.map50, from_file.map), rel=1e-3)
    with pytest.raises(UserError, match="augment validate weights files"):
        val.run(data_dict, model=model, dataloader=loader, augment=True, plots=False)
    with pytest.raises(UserError, match="go with model="):
        val.run(data_dict["yaml_file"], dataloader=loader)


def test_autoanchor_under_yolov5s_names(data):
    """``check_anchors(dataset, model, thr, imgsz)`` adopts what the trainer's adapt_anchors adopts for the same
    boxes; ``kmean_anchors`` takes a data YAML or a dataset and gives n pixel anchors by area."""
    import copy

    from utils.autoanchor import adapt_anchors, anchor_pixels, check_anchors, kmean_anchors
    from utils.dataloaders import LoadImagesAndLabels

    source, _ = data
    dataset = LoadImagesAndLabels(str(source), img_size=IMGSZ)
    model, _ = yolov5_model()
    with torch.no_grad():
        model.model[-1].anchors *= 40  # far too large for these boxes: new ones are searched for
    twin = copy.deepcopy(model)
    report = check_anchors(dataset, model=model, thr=4.0, imgsz=IMGSZ)
    expected = adapt_anchors(twin, dataset.labels, dataset.shapes, IMGSZ, thr=4.0)
    assert report.adopted and expected.adopted and report.bpr_after > report.bpr_before
    np.testing.assert_array_equal(anchor_pixels(model), anchor_pixels(twin))

    from_yaml = kmean_anchors(str(source.parents[1] / "data.yaml"), n=6, img_size=IMGSZ, gen=30, verbose=False)
    from_dataset = kmean_anchors(dataset, n=6, img_size=IMGSZ, gen=30, verbose=False)
    areas = from_yaml.prod(1)
    assert from_yaml.shape == (6, 2) and (np.diff(areas) >= 0).all()
    np.testing.assert_array_equal(from_yaml, from_dataset)


def test_training_plots_under_yolov5s_names(data, tmp_path):
    """train_batch*.jpg, val predictions and labels.jpg as a YOLOv5 training script draws them."""
    import cv2

    from utils.dataloaders import LoadImagesAndLabels
    from utils.plots import output_to_target, plot_images, plot_labels

    source, names = data
    dataset = LoadImagesAndLabels(str(source), img_size=IMGSZ, augment=True)
    images, targets, paths, _ = LoadImagesAndLabels.collate_fn([dataset[(i, 0)] for i in range(4)])
    mosaic = plot_images(images, targets, paths, tmp_path / "train_batch0.jpg", names)
    assert mosaic.shape == (2 * IMGSZ, 2 * IMGSZ, 3) and cv2.imread(str(tmp_path / "train_batch0.jpg")) is not None
    predictions = [torch.tensor([[4.0, 4, 40, 40, 0.9, 1]]), torch.zeros((0, 6))]
    rows = output_to_target(predictions)
    assert rows.shape == (1, 7) and list(rows[0]) == [0, 1, 4, 4, 40, 40, pytest.approx(0.9)]
    plot_images(images[:2], rows, paths[:2], tmp_path / "val_batch0_pred.jpg", names)
    labels = plot_labels(np.concatenate(dataset.labels, 0), names, tmp_path)
    assert labels.name == "labels.jpg" and labels.stat().st_size > 0
