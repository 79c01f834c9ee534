"""Write YOLOv5-v7-format files with the look-alike ``models`` package beside this script.

Run as a script (``python tests/yolov5_lookalike/write_checkpoint.py MODELS_DIR OUT_DIR``) so that this
folder comes first on ``sys.path`` and ``models`` is the look-alike package. Writes into OUT_DIR:

- ``yolov5n_lookalike.pt``: a final checkpoint as YOLOv5's train.py leaves best.pt (pickled fp16
  DetectionModel, random weights, non-trivial BatchNorm statistics, 80 COCO names, epoch -1, no EMA);
- ``yolov5n_lookalike_last.pt``: a mid-training one (fp16 model and EMA, the EMA's first conv weight
  doubled, EMA updates, optimizer state, best_fitness a one-element numpy array);
- ``yolov5n_lookalike_io.pt``: plain tensors: ``input``, the look-alike's eval ``output`` for it
  (fp16 weights, float32 compute) and the fp16 ``state_dict``;
- ``state_dict_shapes.json``: state-dict keys and shapes, strides and parameter counts of yolov5n and
  yolov5s at nc=80, as the look-alike builds them.

``write_checkpoint.py MODELS_DIR OUT_DIR run CFG DATA EPOCHS EPOCH LAYOUT`` writes instead a YOLOv5 run folder
interrupted after epoch EPOCH of EPOCHS, as YOLOv5's train.py leaves it, at OUT_DIR/exp: ``weights/last.pt``
(fp16 model and EMA, EMA updates, the optimizer after two steps on random gradients, ``opt``), ``opt.yaml``,
``hyp.yaml`` and ``results.csv`` (YOLOv5's formatting; epoch 0 written twice, the first row stale, as after a
crash and a YOLOv5 resume). LAYOUT ``v7`` groups the optimizer as YOLOv5 v6.2+ does (smart_optimizer: biases,
decayed weights, normalisation weights) with v7's options; ``v6.0`` as v6.0/v6.1 did (BatchNorm2d weights,
weights, biases) with v6.0's ``adam`` and ``linear_lr`` in place of ``optimizer`` and ``cos_lr``. Also writes
OUT_DIR/momentum.pt: {parameter name: momentum buffer} in float32, for the tests to compare with.
"""
import copy
import json
import sys
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import nn

from models.yolo import DetectionModel

COCO_NAMES = [name.replace("_", " ") for name in (
    "person bicycle car motorcycle airplane bus train truck boat traffic_light fire_hydrant stop_sign "
    "parking_meter bench bird cat dog horse sheep cow elephant bear zebra giraffe backpack umbrella handbag tie "
    "suitcase frisbee skis snowboard sports_ball kite baseball_bat baseball_glove skateboard surfboard "
    "tennis_racket bottle wine_glass cup fork knife spoon bowl banana apple sandwich orange broccoli carrot "
    "hot_dog pizza donut cake chair couch potted_plant bed dining_table toilet tv laptop mouse remote keyboard "
    "cell_phone microwave oven toaster sink refrigerator book clock vase scissors teddy_bear hair_drier "
    "toothbrush").split()]
DATE = "2024-01-01T00:00:00"


def randomise_batchnorm(model: nn.Module, generator: torch.Generator) -> None:
    """Statistics and affine parameters away from their defaults (1, 0), so that a mapping that
    drops or swaps them changes the outputs; eps and momentum as YOLOv5 sets them."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.BatchNorm2d):
                module.eps, module.momentum = 1e-3, 0.03
                size = module.num_features
                module.running_mean.copy_(torch.randn(size, generator=generator) * 0.2)
                module.running_var.copy_(torch.rand(size, generator=generator) + 0.5)
                module.weight.copy_(torch.rand(size, generator=generator) + 0.5)
                module.bias.copy_(torch.randn(size, generator=generator) * 0.1)
                module.num_batches_tracked.fill_(int(torch.randint(1, 1000, (1,), generator=generator)))


def build(models_dir: Path, size: str, seed: int = 0) -> DetectionModel:
    torch.manual_seed(seed)
    model = DetectionModel(yaml.safe_load((models_dir / f"yolov5{size}.yaml").read_text()))
    model.yaml_file = f"yolov5{size}.yaml"
    return model


def final_checkpoint(model: DetectionModel) -> dict:
    return {"epoch": -1, "best_fitness": None, "model": model, "ema": None, "updates": None, "optimizer": None,
            "opt": {"imgsz": 640, "cfg": "models/yolov5n.yaml"}, "git": None, "date": DATE}


def training_checkpoint(model: DetectionModel, ema: DetectionModel) -> dict:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.937, nesterov=True)
    best_fitness = np.array([[0.0, 0.0, 0.5, 0.2]]) @ np.array([0.0, 0.0, 0.1, 0.9])  # a (1,) array, as YOLOv5's
    return {"epoch": 4, "best_fitness": best_fitness, "model": model, "ema": ema, "updates": 1000,
            "optimizer": optimizer.state_dict(), "opt": {"imgsz": 640}, "git": None, "date": DATE}


def optimizer_groups(model: nn.Module, layout: str) -> list[list[nn.Parameter]]:
    """YOLOv5's parameter groups, in its optimizer's order, for ``layout`` (see the module docstring)."""
    if layout == "v7":
        norm_types = tuple(value for key, value in vars(nn).items() if "Norm" in key and isinstance(value, type))
        biases, weights, norms = [], [], []
        for module in model.modules():
            for name, parameter in module.named_parameters(recurse=False):
                if name == "bias":
                    biases.append(parameter)
                elif name == "weight" and isinstance(module, norm_types):
                    norms.append(parameter)
                else:
                    weights.append(parameter)
        return [biases, weights, norms]
    batchnorm, weights, biases = [], [], []
    for module in model.modules():
        if isinstance(getattr(module, "bias", None), nn.Parameter):
            biases.append(module.bias)
        if isinstance(module, nn.BatchNorm2d):
            batchnorm.append(module.weight)
        elif isinstance(getattr(module, "weight", None), nn.Parameter):
            weights.append(module.weight)
    return [batchnorm, weights, biases]


def yolov5_options(cfg: str, data: str, hyp: dict, epochs: int, save_dir: Path, layout: str) -> dict:
    """``vars(opt)`` of YOLOv5 v7's train.py for this run (v6.0's flags for layout v6.0)."""
    opt = {"weights": "", "cfg": cfg, "data": data, "hyp": hyp, "epochs": epochs, "batch_size": 2, "imgsz": 64,
           "rect": False, "resume": False, "nosave": False, "noval": False, "noautoanchor": True, "noplots": True,
           "evolve": None, "bucket": "", "cache": None, "image_weights": False, "device": "cpu", "multi_scale": False,
           "single_cls": False, "optimizer": "SGD", "sync_bn": False, "workers": 0, "project": str(save_dir.parent),
           "name": "exp", "exist_ok": False, "quad": False, "cos_lr": False, "label_smoothing": 0.0, "patience": 100,
           "freeze": [0], "save_period": -1, "seed": 0, "local_rank": -1, "entity": None, "upload_dataset": False,
           "bbox_interval": -1, "artifact_alias": "latest", "save_dir": str(save_dir)}
    if layout == "v6.0":
        del opt["optimizer"], opt["cos_lr"], opt["seed"], opt["noplots"]
        opt.update({"adam": False, "linear_lr": True, "freeze": 0})
    return opt


RESULTS_COLUMNS = ("epoch", "train/box_loss", "train/obj_loss", "train/cls_loss", "metrics/precision",
                   "metrics/recall", "metrics/mAP_0.5", "metrics/mAP_0.5:0.95", "val/box_loss", "val/obj_loss",
                   "val/cls_loss", "x/lr0", "x/lr1", "x/lr2")


def results_row(epoch: int, map50: float, map50_95: float) -> str:
    values = (epoch, 0.1, 0.05, 0.02, 0.4, 0.3, map50, map50_95, 0.09, 0.04, 0.01, 0.001, 0.002, 0.003)
    return ("%20.5g," * len(values) % values).rstrip(",") + "\n"


def write_run(models_dir: Path, out: Path, cfg: Path, data: Path, epochs: int, epoch: int, layout: str) -> None:
    names = list(yaml.safe_load(data.read_text())["names"].values())
    torch.manual_seed(3)
    model = DetectionModel(yaml.safe_load(cfg.read_text()), nc=len(names))
    model.names, model.nc = names, len(names)
    groups = optimizer_groups(model, layout)
    optimizer = torch.optim.SGD(groups[0], lr=0.01, momentum=0.937, nesterov=True)
    optimizer.add_param_group({"params": groups[1], "weight_decay": 0.0005})
    optimizer.add_param_group({"params": groups[2], "weight_decay": 0.0})
    generator = torch.Generator().manual_seed(4)
    for _ in range(2):
        for parameter in model.parameters():
            parameter.grad = torch.randn(parameter.shape, generator=generator)
        optimizer.step()
    ema = copy.deepcopy(model)
    with torch.no_grad():
        for parameter in ema.parameters():
            parameter.mul_(0.5)  # the EMA differs from the model: a resume must keep them apart
    save_dir = out / "exp"
    (save_dir / "weights").mkdir(parents=True)
    hyp = yaml.safe_load((models_dir.parent / "data" / "hyps" / "hyp.scratch-low.yaml").read_text())
    opt = yolov5_options(str(cfg), str(data), hyp, epochs, save_dir, layout)
    best_fitness = np.array([[0.0, 0.0, 0.5, 0.2]]) @ np.array([0.0, 0.0, 0.1, 0.9])
    torch.save({"epoch": epoch, "best_fitness": best_fitness, "model": copy.deepcopy(model).half(),
                "ema": copy.deepcopy(ema).half(), "updates": 7, "optimizer": optimizer.state_dict(), "opt": opt,
                "git": {"remote": None, "branch": None, "commit": None}, "date": DATE},
               save_dir / "weights" / "last.pt")
    (save_dir / "opt.yaml").write_text(yaml.safe_dump(opt, sort_keys=False))
    (save_dir / "hyp.yaml").write_text(yaml.safe_dump(hyp, sort_keys=False))
    header = ("%20s," * len(RESULTS_COLUMNS) % RESULTS_COLUMNS).rstrip(",") + "\n"
    rows = [results_row(0, 0.9, 0.9)] + [results_row(e, 0.5 if e == 0 else 0.1 * e, 0.2 if e == 0 else 0.05 * e)
                                         for e in range(epoch + 1)]
    (save_dir / "results.csv").write_text(header + "".join(rows))
    named = {id(parameter): name for name, parameter in model.named_parameters()}
    momentum = {named[id(parameter)]: optimizer.state[parameter]["momentum_buffer"].clone()
                for group in optimizer.param_groups for parameter in group["params"]}
    torch.save(momentum, out / "momentum.pt")


def shapes(model: DetectionModel) -> dict:
    return {"state_dict": {name: list(t.shape) for name, t in model.state_dict().items()},
            "stride": model.stride.tolist(), "parameters": sum(p.numel() for p in model.parameters())}


def main(models_dir: Path, out: Path) -> None:
    model = build(models_dir, "n")
    model.names = COCO_NAMES
    model.hyp = {"box": 0.05, "cls": 0.5, "obj": 1.0, "anchor_t": 4.0}
    randomise_batchnorm(model, torch.Generator().manual_seed(1))
    model.eval()
    reference = copy.deepcopy(model).half().float()  # fp16 weights, float32 compute
    image = torch.rand(2, 3, 96, 128, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        output = reference(image)[0]  # also caches the head's grids, which YOLOv5 files carry
    half = copy.deepcopy(reference).half()  # what YOLOv5 saves: fp16 weights, buffers, head stride and grids
    torch.save(final_checkpoint(half), out / "yolov5n_lookalike.pt")
    ema = copy.deepcopy(half)
    with torch.no_grad():
        ema.model[0].conv.weight.mul_(2)  # the EMA differs from the model (exactly, in fp16): keep them apart
    torch.save(training_checkpoint(copy.deepcopy(half).train(), ema), out / "yolov5n_lookalike_last.pt")
    state = {name: tensor.clone() for name, tensor in half.state_dict().items()}
    torch.save({"input": image, "output": output, "state_dict": state}, out / "yolov5n_lookalike_io.pt")
    table = {"models/yolov5n.yaml": shapes(model), "models/yolov5s.yaml": shapes(build(models_dir, "s"))}
    (out / "state_dict_shapes.json").write_text(json.dumps(table))


if __name__ == "__main__":
    if sys.argv[3:4] == ["run"]:
        write_run(Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[4]), Path(sys.argv[5]), int(sys.argv[6]),
                  int(sys.argv[7]), sys.argv[8])
    else:
        main(Path(sys.argv[1]), Path(sys.argv[2]))
