"""torch.hub entry points: models from checkpoints on disk (nothing is ever downloaded).

    import torch
    model = torch.hub.load("path/to/this/repo", "custom", path="runs/train/exp/weights/best.pt", source="local")
    results = model("image.jpg")   # or PIL images, numpy arrays (RGB; bgr=True for cv2.imread), lists, tensors
    results.xyxy[0]                # (n, 6): x1, y1, x2, y2, confidence, class, in the image's pixels
    model.conf = 0.4               # NMS settings are attributes: conf, iou, classes, agnostic, max_det

``yolov5n`` ... ``yolov5x`` load ``yolov5n.pt`` ... from the current folder (or ``path=``): YOLOv5's release
weights or ours, wherever they came from; ``pretrained=False`` builds an untrained model from models/*.yaml.
The returned model is described in utils/hub.py.
"""

dependencies = ["torch", "numpy", "cv2", "yaml"]


def custom(path="path/to/model.pt", autoshape=True, _verbose=True, device=None):
    """A checkpoint (ours or YOLOv5's) or a .torchscript / .onnx file from export.py."""
    from utils.hub import load_hub_model

    return load_hub_model(path, autoshape=autoshape, device=device)


def _named(name, pretrained, channels, classes, autoshape, device, path):
    from pathlib import Path

    from utils.errors import UserError
    from utils.hub import load_hub_model, untrained_hub_model

    if channels != 3:
        raise UserError(f"{name}: channels={channels}: only 3-channel (RGB) models are supported")
    if not pretrained:
        return untrained_hub_model(Path(__file__).resolve().parent / "models" / f"{name}.yaml", classes,
                                   autoshape=autoshape, device=device)
    weights = Path(path) if path else Path.cwd() / f"{name}.pt"
    if not weights.is_file():
        raise UserError(f"{weights}: not found; nothing is downloaded: put {name}.pt (YOLOv5's release file or one "
                        f"trained here) in {Path.cwd()}, or pass path='path/to/{name}.pt'")
    model = load_hub_model(weights, autoshape=autoshape, device=device)
    found = len(model.names)
    if classes not in (80, found):
        import logging

        logging.getLogger(__name__).warning("WARNING: classes=%d ignored: %s has %d classes", classes, weights, found)
    return model


def yolov5n(pretrained=True, channels=3, classes=80, autoshape=True, _verbose=True, device=None, path=None):
    return _named("yolov5n", pretrained, channels, classes, autoshape, device, path)


def yolov5s(pretrained=True, channels=3, classes=80, autoshape=True, _verbose=True, device=None, path=None):
    return _named("yolov5s", pretrained, channels, classes, autoshape, device, path)


def yolov5m(pretrained=True, channels=3, classes=80, autoshape=True, _verbose=True, device=None, path=None):
    return _named("yolov5m", pretrained, channels, classes, autoshape, device, path)


def yolov5l(pretrained=True, channels=3, classes=80, autoshape=True, _verbose=True, device=None, path=None):
    return _named("yolov5l", pretrained, channels, classes, autoshape, device, path)


def yolov5x(pretrained=True, channels=3, classes=80, autoshape=True, _verbose=True, device=None, path=None):
    return _named("yolov5x", pretrained, channels, classes, autoshape, device, path)
