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
    main(Path(sys.argv[1]), Path(sys.argv[2]))
