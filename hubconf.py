"""torch.hub entry points: models from checkpoints (ours or YOLOv5's) and export.py files.

    import torch
    model = torch.hub.load("path/to/this/repo", "custom", path="runs/train/exp/weights/best.pt", source="local")
    results = model("image.jpg")   # or PIL images, numpy arrays (RGB; bgr=True for cv2.imread), lists, tensors
    results.xyxy[0]                # (n, 6): x1, y1, x2, y2, confidence, class, in the image's pixels
    model.conf = 0.4               # NMS settings are attributes: conf, iou, classes, agnostic, max_det

``yolov5n`` ... ``yolov5x6`` load ``yolov5n.pt`` ... from the current folder (or ``path=``): YOLOv5's release
weights or ours, wherever they came from; a missing release file is downloaded from YOLOv5's v7.0 release (or
``$YOLO_TRAINER_MIRROR``, utils/downloads.py) and loaded through the same checks as any file from elsewhere.
As in YOLOv5, ``pretrained=False``, ``classes=N`` (not 80) or ``channels=C`` (not 3) build a DetectionModel from
models/*.yaml in training mode, with the weights' tensors that fit when pretrained (fine-tuning). The model for
images is described in utils/hub.py.

    python hubconf.py --model yolov5n     # as YOLOv5's: load the model and print what it finds in data/images
"""

dependencies = ["torch", "numpy", "cv2", "yaml"]


def custom(path="path/to/model.pt", autoshape=True, _verbose=True, device=None):
    """A checkpoint (ours or YOLOv5's) or a .torchscript / .onnx file from export.py."""
    from utils.hub import load_hub_model

    return load_hub_model(path, autoshape=autoshape, device=device)


def _named(name, pretrained, channels, classes, autoshape, device, path):
    """YOLOv5's rule: pretrained with 3 channels and 80 classes loads the weights (wrapped in HubModel unless
    ``autoshape=False``); anything else builds models/<name>.yaml with ``channels`` and ``classes`` as a bare
    DetectionModel in training mode (YOLOv5's hub recipe for fine-tuning), given the weights' tensors whose names
    and shapes fit when ``pretrained`` (the anchors left out), and their class names when the count matches."""
    from pathlib import Path

    from utils.errors import UserError
    from utils.hub import load_hub_model

    weights = None
    if pretrained:
        from utils.downloads import weights_file

        weights = weights_file(path if path else f"{name}.pt")  # YOLOv5's release file is fetched when missing
        if not weights.is_file():
            raise UserError(f"{weights}: not found: put {name}.pt (YOLOv5's release file or one trained here) in "
                            f"{Path.cwd()}, or pass path='path/to/{name}.pt'")
        if channels == 3 and classes == 80:
            return load_hub_model(weights, autoshape=autoshape, device=device)
    from utils.hub import training_hub_model

    return training_hub_model(Path(__file__).resolve().parent / "models" / f"{name}.yaml", channels, classes,
                              weights, device)


def _entry(name: str):
    def load(pretrained=True, channels=3, classes=80, autoshape=True, _verbose=True, device=None, path=None):
        return _named(name, pretrained, channels, classes, autoshape, device, path)
    load.__name__ = load.__qualname__ = name
    load.__doc__ = (f"{name}.pt from the current folder or path= (YOLOv5's release file, fetched when missing, or "
                    f"one trained here); pretrained=False, classes or channels: a DetectionModel from "
                    f"models/{name}.yaml")
    return load


MODEL_NAMES = tuple(f"yolov5{size}{p6}" for p6 in ("", "6") for size in "nsmlx")
for _name in MODEL_NAMES:  # torch.hub's entry points: yolov5n ... yolov5x6
    globals()[_name] = _entry(_name)


def _main(argv=None) -> int:
    """``python hubconf.py --model yolov5n``: load a named model and run it on the sample images in data/images."""
    import argparse
    from pathlib import Path

    from utils.errors import run_main

    def main(argv):
        parser = argparse.ArgumentParser(prog="hubconf.py", description=_main.__doc__)
        parser.add_argument("--model", default="yolov5s", help="a model name (yolov5n ... yolov5x6)")
        parser.add_argument("--source", default=str(Path(__file__).resolve().parent / "data" / "images"))
        args = parser.parse_args(argv)
        if args.model not in MODEL_NAMES:
            parser.error(f"--model {args.model}: not a model name ({', '.join(MODEL_NAMES)})")
        model = globals()[args.model]()
        images = sorted(p for p in Path(args.source).iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
        results = model([str(p) for p in images])
        results.print()  # as YOLOv5's hubconf.py: the summary, then the labelled images in runs/detect/expN
        print(f"Saved {len(results)} images to {results.save()}")
    return run_main("hubconf.py", main, argv)


if __name__ == "__main__":
    import sys

    sys.exit(_main())
