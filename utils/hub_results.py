"""``Detections``: what the torch.hub model (utils/hub.py) returns, YOLOv5's hub results for boxes and images.

    results = model(["a.jpg", pil_image, rgb_array])
    results.xyxy[0]    # (n, 6) tensor: x1, y1, x2, y2, confidence, class (also xywh, xyxyn, xywhn, pandas())
    results.print()    # "image 1/3: 480x640 2 persons, 1 tie" per image, then YOLOv5's "Speed: ... at shape" line
    results.save()     # labelled JPEGs in runs/detect/exp (exp2, ... : never an earlier run); returns the folder
    results.crop()     # crops/<class>/<image>.jpg per box; returns [{"box", "conf", "cls", "label", "im"}, ...]
    results.render()   # boxes drawn on copies of the images; results.ims then holds them (RGB) and is returned
    results.show()     # PIL's viewer (in a notebook, display()); where there is no display, one warning line
    results.tolist()   # one Detections per image

The attributes are YOLOv5's: ``pred``/``xyxy``/``xywh``/``xyxyn``/``xywhn`` (lists of (n, 6) tensors, boxes in
the original images' pixels, not rounded), ``names`` ({index: name}), ``files`` (each input's base name with a
``.jpg`` suffix, ``image0.jpg`` for an array), ``times`` (pre-process, inference and NMS of the whole call, each
with YOLOv5's ``.t`` in seconds), ``t`` (those in ms per image), ``s`` (the (B, 3, h, w) shape the batch ran at),
``n``; ``pandas()`` returns a copy whose box views are lists of DataFrames, as YOLOv5's.
``ims`` holds the images as loaded, RGB uint8 HxWx3 as YOLOv5 keeps them: an RGB numpy input is the caller's
own array (a reference, never written to), a file or PIL image the array decoded for the model. Drawing uses
detect.py's module (utils/drawing.py: same colours and "name 0.87" labels, YOLOv5's automatic line width) on
copies, always from the images as loaded, so calling render() before save() or show() draws nothing twice.
Saved names come from the inputs' base names only (``image0.jpg`` for arrays and unnamed PIL images, ``.jpg``
whatever the input's suffix, as YOLOv5), made one safe component and checked to stay inside the output folder;
files are written atomically. Crops are YOLOv5's: the box grown by 2% plus 10 px, clipped to the image, and
the returned ``im`` is BGR as YOLOv5's (ready for ``cv2.imwrite``).
"""
from __future__ import annotations

import copy
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch

from utils.boxes import xyxy2xywh
from utils.drawing import colors, draw_box_label, save_one_box
from utils.errors import UserError, writing
from utils.files import atomic_write
from utils.inference import Detection, as_detections, class_name, describe
from utils.paths import crop_folder, increment_path, inside, safe_component

LOGGER = logging.getLogger(__name__)


@dataclass
class Timing:
    """One stage's time over a whole call, as YOLOv5's Profile: ``t`` in seconds."""
    t: float = 0.0


class Detections:
    """Per-image results (module doc): ``xyxy[i]`` (n, 6) tensors of x1, y1, x2, y2, confidence, class in the
    original image's pixels, the other box views, ``detections[i]`` as Detection tuples, ``ims``, ``files``,
    ``names``, ``times``, ``t``, ``s``."""

    def __init__(self, ims: list[np.ndarray], pred: list[torch.Tensor], files: list[str], times=None,
                 names=None, shape=None, shapes=None):
        self.loaded = list(ims)  # as loaded, never drawn on: what save, crop, show and render start from
        self.ims = list(ims)  # what render() last drew, or the images as loaded
        self.pred = self.xyxy = list(pred)
        self.files = list(files)
        self.times = tuple(times) if times is not None else (Timing(), Timing(), Timing())
        self.names = dict(names) if isinstance(names, dict) else dict(enumerate(names or ()))
        self.shapes = list(shapes) if shapes is not None else [image.shape[:2] for image in self.loaded]
        self.s = tuple(shape) if shape is not None else ()
        self.n = len(self.pred)
        self.xywh = [torch.cat((xyxy2xywh(det[:, :4]), det[:, 4:]), 1) for det in self.xyxy]
        gains = [self._gain(shape) for shape in self.shapes]
        self.xyxyn = [det / gain for det, gain in zip(self.xyxy, gains)]
        self.xywhn = [det / gain for det, gain in zip(self.xywh, gains)]

    def __len__(self) -> int:
        return self.n

    # ------------------------------------------------------------------ boxes

    @staticmethod
    def _gain(shape) -> torch.Tensor:
        height, width = shape[:2]
        return torch.tensor([width, height, width, height, 1.0, 1.0])

    @property
    def detections(self) -> list[list[Detection]]:
        return [as_detections(det, self.names) for det in self.xyxy]

    def pandas(self) -> "Detections":
        """A copy whose ``xyxy``/``xyxyn``/``xywh``/``xywhn`` are lists of DataFrames, YOLOv5's columns
        (xmin ymin xmax ymax or xcenter ycenter width height, then confidence, class, name)."""
        try:
            import pandas
        except ImportError:
            raise UserError("Detections.pandas() needs the package 'pandas' (in requirements.txt): "
                            "pip install pandas") from None
        new = copy.copy(self)
        corners = {"xyxy": ("xmin", "ymin", "xmax", "ymax"), "xywh": ("xcenter", "ycenter", "width", "height")}
        for kind in ("xyxy", "xyxyn", "xywh", "xywhn"):
            columns = [*corners[kind[:4]], "confidence", "class", "name"]
            rows = [[[*row[:5], int(row[5]), class_name(self.names, row[5])] for row in det.tolist()]
                    for det in getattr(self, kind)]
            setattr(new, kind, [pandas.DataFrame(table, columns=columns) for table in rows])
        return new

    def tolist(self) -> list["Detections"]:
        """One Detections per image (``for result in results.tolist()``), as YOLOv5's (each keeps the call's
        times and shape)."""
        single = []
        for i in range(self.n):
            one = Detections([self.loaded[i]], [self.pred[i]], [self.files[i]], self.times, self.names, self.s,
                             [self.shapes[i]])
            one.ims = [self.ims[i]]
            single.append(one)
        return single

    # ------------------------------------------------------------------ text

    @property
    def t(self) -> tuple[float, float, float]:
        """Milliseconds per image: pre-process (reading, letterbox), inference, NMS; YOLOv5's ``t``."""
        return tuple(timing.t * 1e3 / max(self.n, 1) for timing in self.times)

    def __str__(self) -> str:
        lines = []
        for index, (det, shape) in enumerate(zip(self.xyxy, self.shapes), 1):
            found = describe(det, self.names).rstrip(", ") if len(det) else "(no detections)"
            lines.append(f"image {index}/{self.n}: {shape[0]}x{shape[1]} {found}")
        lines.append("Speed: %.1fms pre-process, %.1fms inference, %.1fms NMS per image" % self.t +
                     f" at shape {self.s}")
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"YOLOv5 {self.__class__} instance\n{self}"

    def print(self, file=None) -> None:
        """Write the per-image lines and the speed line to ``file`` (default stdout), as YOLOv5's print()."""
        (file or sys.stdout).write(f"{self}\n")

    # ------------------------------------------------------------------ images

    def render(self, labels: bool = True) -> list[np.ndarray]:
        """Draw the boxes (and "name conf" labels) on copies of the images; ``ims`` becomes those RGB copies
        and is returned, as YOLOv5's. The images as loaded (the caller's arrays among them) are not drawn on."""
        self.ims = [cv2.cvtColor(self._annotated(i, labels), cv2.COLOR_BGR2RGB) for i in range(self.n)]
        return self.ims

    def save(self, labels: bool = True, save_dir="runs/detect/exp", exist_ok: bool = False) -> Path:
        """Write the labelled images as JPEGs into a new run folder (``save_dir``, else save_dir2, 3, ...; with
        ``exist_ok`` into ``save_dir`` itself) and return it."""
        folder = increment_path(save_dir, exist_ok, mkdir=True)
        used = set()
        for i in range(self.n):
            name = _unique(f"{self._stem(i)}.jpg", used)
            _write_jpeg(inside(folder, name), self._annotated(i, labels))
        LOGGER.info(f"Saved {self.n} image{'s' * (self.n != 1)} to {folder}")
        return folder

    def crop(self, save: bool = True, save_dir="runs/detect/exp", exist_ok: bool = False) -> list[dict]:
        """One dict per box (the image's boxes from the least to the most confident, as YOLOv5 draws them):
        ``box`` (x1, y1, x2, y2 tensors), ``conf``, ``cls``, ``label`` ("name 0.87") and ``im``, the BGR crop
        (the box grown by 2% plus 10 px, clipped). With ``save``, each is also written to
        <run folder>/crops/<class name>/<image stem>.jpg (stem2.jpg, ... for more), the run folder as in save()."""
        folder = increment_path(save_dir, exist_ok, mkdir=True) if save else None
        crops = []
        for i, (det, image) in enumerate(zip(self.xyxy, self.loaded)):
            bgr = image[:, :, ::-1]  # a view: the crop is copied out of the image as loaded
            for *box, conf, cls in reversed(det):
                label = f"{class_name(self.names, cls)} {float(conf):.2f}"
                piece = np.ascontiguousarray(save_one_box(torch.stack(box), bgr, None, save=False))
                if folder is not None:
                    self._save_crop(folder, i, int(cls), piece)
                crops.append({"box": box, "conf": conf, "cls": cls, "label": label, "im": piece})
        if folder is not None:
            LOGGER.info(f"Saved {len(crops)} crop{'s' * (len(crops) != 1)} to {folder / 'crops'}")
        return crops

    def show(self, labels: bool = True) -> None:
        """Show the labelled images: display() in a notebook, else PIL's image viewer. Where there is no
        display (no DISPLAY / WAYLAND_DISPLAY on Linux, not a notebook) or no viewer, one warning line instead."""
        notebook = _in_notebook()
        if not notebook and not _has_display():
            LOGGER.warning("Detections.show(): no display here (DISPLAY is not set and this is not a notebook); "
                           "use results.save() or results.render() instead")
            return
        from PIL import Image, ImageShow

        for i in range(self.n):
            image = Image.fromarray(cv2.cvtColor(self._annotated(i, labels), cv2.COLOR_BGR2RGB))
            if notebook:
                from IPython.display import display

                display(image)
            elif not ImageShow.show(image, title=self.files[i]):
                LOGGER.warning("Detections.show(): no image viewer found (PIL's ImageShow); use results.save()")
                return

    def _annotated(self, i: int, labels: bool) -> np.ndarray:
        """Image ``i`` as loaded, copied to BGR, with its boxes drawn the way detect.py draws them."""
        canvas = cv2.cvtColor(self.loaded[i], cv2.COLOR_RGB2BGR)
        for *box, conf, cls in reversed(self.xyxy[i].tolist()):  # the most confident box is drawn last, on top
            label = f"{class_name(self.names, cls)} {conf:.2f}" if labels else None
            draw_box_label(canvas, box, label, colors(int(cls), bgr=True))
        return canvas

    def _stem(self, i: int) -> str:
        return file_stem(self.files[i], i)

    def _save_crop(self, folder: Path, i: int, cls: int, piece: np.ndarray) -> None:
        if not piece.size:
            LOGGER.warning(f"{self.files[i]}: empty crop for a {class_name(self.names, cls)} box, not saved")
            return
        where = crop_folder(folder, self.names, cls)
        where.mkdir(parents=True, exist_ok=True)
        _write_jpeg(inside(where, increment_path(where / f"{self._stem(i)}.jpg").name), piece)


def file_stem(name, index: int) -> str:
    """An input's base name without its suffix, as one safe file-name component (``image<index>`` if none):
    "../../x.jpg" -> "x", a Windows path's "C:\\a\\b.png" -> "b"."""
    base = Path(str(name).replace("\\", "/")).name
    return safe_component(Path(base).stem if base not in ("", ".", "..") else "", f"image{index}")


def _unique(name: str, used: set) -> str:
    """``name``, or name2, name3, ... when an earlier image of the same call took it (two inputs named a.jpg)."""
    stem, suffix = os.path.splitext(name)
    number, candidate = 1, name
    while candidate in used:
        number += 1
        candidate = f"{stem}{number}{suffix}"
    used.add(candidate)
    return candidate


def _write_jpeg(path: Path, image_bgr: np.ndarray) -> None:
    ok, data = cv2.imencode(".jpg", image_bgr)
    if not ok:
        raise UserError(f"{path}: OpenCV could not encode a {image_bgr.shape} image as JPEG")
    with writing(path):
        atomic_write(path, data.tobytes())


def _in_notebook() -> bool:
    """A Jupyter or Colab kernel (IPython is looked up only if the process imported it already)."""
    ipython = sys.modules.get("IPython")
    get_shell = getattr(ipython, "get_ipython", None)
    shell = get_shell() if callable(get_shell) else None
    return type(shell).__name__ in ("ZMQInteractiveShell", "Shell")  # Jupyter's kernel, Colab's


def _has_display() -> bool:
    """macOS and Windows open images in their default viewer; elsewhere an X11 or Wayland display is needed."""
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))
