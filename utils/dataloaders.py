"""YOLOv5's ``utils.dataloaders.LoadImages``, ``LoadStreams``, ``LoadScreenshots``, ``IMG_FORMATS`` and ``VID_FORMATS``, for inference
scripts written against YOLOv5 (docs/yolov5-scripts.md). Files are found and read as detect.py reads them
(utils/sources.py: a file, folder, glob, .txt list, URL, or a list of them; images checked before they are decoded),
and live sources as detect.py opens them (utils/streams.py: webcams and stream URLs, each read by its own thread,
reconnected when a read fails; the screen with the optional mss package). YOLOv5's training data names,
``LoadImagesAndLabels``, ``create_dataloader``, ``seed_worker`` and ``img2label_paths``, are utils/yolov5_loaders.py's
(the project's own dataset and loader, utils/data/).
"""
from __future__ import annotations

import logging
import time

import numpy as np

from utils import streams as live
from utils.augmentations import letterbox
from utils.data.images import IMG_EXTENSIONS, VID_EXTENSIONS
from utils.data.loader import seed_worker  # noqa: F401  (YOLOv5's names, for training scripts)
from utils.data.verify import img2label_paths  # noqa: F401
from utils.sources import Sources
from utils.yolov5_loaders import LoadImagesAndLabels, create_dataloader  # noqa: F401

LOGGER = logging.getLogger("yolov5")

IMG_FORMATS = IMG_EXTENSIONS  # suffixes without the dot, as YOLOv5's
VID_FORMATS = VID_EXTENSIONS


def model_input(image: np.ndarray, img_size, stride: int, auto: bool, transforms=None) -> np.ndarray:
    """What the loaders give a script for BGR ``image``: ``transforms(image)`` when given, else the letterboxed image
    as a contiguous RGB (3, h, w) uint8 array."""
    if transforms:
        return transforms(image)
    boxed = letterbox(image, img_size, stride=stride, auto=auto)[0]
    return np.ascontiguousarray(boxed.transpose((2, 0, 1))[::-1])  # HWC BGR -> CHW RGB


class LoadImages:
    """Iterate ``(path, im, im0, cap, s)`` per image and per kept video frame, as YOLOv5's: ``im`` the letterboxed
    RGB (3, h, w) uint8 array (``transforms(im0)`` instead when given), ``im0`` the original BGR image, ``cap`` the
    video's open cv2.VideoCapture (None for an image), ``s`` the progress text (``image 1/3 path: ``). ``mode``
    ('image' or 'video'), ``frame`` and ``frames`` describe the current item; ``len()`` is the number of files."""

    def __init__(self, path, img_size=640, stride: int = 32, auto: bool = True, transforms=None, vid_stride: int = 1):
        self.sources = Sources(path, vid_stride)
        self.files = [str(file) for file in self.sources.files]
        self.nf = len(self.files)
        videos = {str(file) for file in self.sources.videos}
        self.video_flag = [file in videos for file in self.files]
        self.img_size, self.stride, self.auto, self.transforms, self.vid_stride = (img_size, stride, auto, transforms,
                                                                                    vid_stride)
        self.mode, self.cap, self.frame, self.frames, self.count = "image", None, 0, 0, 0
        self._items = None

    def __len__(self) -> int:
        return self.nf

    def __iter__(self):
        self._items = iter(self.sources)
        return self

    def __next__(self):
        if self._items is None:
            iter(self)
        item = next(self._items)
        self.count = item.index
        if item.is_video:
            self.mode, self.cap, self.frame, self.frames = "video", item.capture, item.frame, item.frames
            s = f"video {item.index}/{self.nf} ({item.frame}/{item.frames}) {item.path}: "
        else:
            self.mode, self.cap, self.frame, self.frames = "image", None, 0, 0
            s = f"image {item.index}/{self.nf} {item.path}: "
        im = model_input(item.image, self.img_size, self.stride, self.auto, self.transforms)
        return item.path, im, item.image, self.cap, s


class LoadStreams:
    """Iterate ``(sources, im, im0, None, "")`` over live sources, as YOLOv5's: ``sources`` a ``.streams`` file (one
    URL or webcam index a line) or one source (``"0"``, ``"rtsp://..."``); ``im`` the newest frame of every stream,
    letterboxed and stacked, RGB (n, 3, h, w) uint8; ``im0`` those frames as read (BGR). Each ``next`` waits until
    some stream has a frame at least ``vid_stride`` newer than the last one given; the iteration ends once a stream
    has ended (its reader gave up reconnecting, module doc of utils/streams.py), and the readers stop then, or on
    ``close()``. The streams open when the object is made: a source that cannot be opened is one StreamError line."""

    def __init__(self, sources="file.streams", img_size=640, stride: int = 32, auto: bool = True, transforms=None,
                 vid_stride: int = 1):
        if vid_stride < 1:
            raise live.StreamError(f"vid_stride {vid_stride}: must be 1 or more")
        self.sources = live.stream_urls(str(sources).strip())
        self.streams = live.open_streams(self.sources)
        self.img_size, self.stride, self.transforms, self.vid_stride = img_size, stride, transforms, vid_stride
        self.fps = [stream.fps for stream in self.streams]
        self.frames = [float("inf")] * len(self.streams)
        for index, stream in enumerate(self.streams):
            height, width = stream.frame.shape[:2]
            LOGGER.info(f"{index + 1}/{len(self.streams)}: {stream.source}... Success ({width}x{height} at "
                        f"{stream.fps:.2f} FPS)")
        shapes = {letterbox(stream.frame, img_size, stride=stride, auto=auto)[0].shape for stream in self.streams}
        self.rect = len(shapes) == 1  # one shape: minimal padding; else every frame padded to img_size
        self.auto = auto and self.rect
        if not self.rect:
            LOGGER.warning("WARNING: Stream shapes differ. For optimal performance supply similarly-shaped streams.")
        self._given = [0] * len(self.streams)  # each stream's frame count when it was last given
        self.count = -1

    def __len__(self) -> int:
        return len(self.sources)

    def __iter__(self):
        self.count = -1
        return self

    def __next__(self):
        self.count += 1
        frames = self._wait()
        if frames is None:
            self.close()
            raise StopIteration
        im = np.stack([model_input(frame, self.img_size, self.stride, self.auto, self.transforms) for frame in frames])
        return self.sources, im, frames, None, ""

    def _wait(self) -> list | None:
        """Every stream's newest frame once one is new enough, or None once a stream has ended."""
        changed = self.streams[0].changed
        with changed:
            while True:
                now = time.monotonic()
                if any(stream.ended or now - stream.active > live.FRAME_TIMEOUT for stream in self.streams):
                    return None
                if any(stream.count >= given + self.vid_stride for stream, given in zip(self.streams, self._given)):
                    self._given = [stream.count for stream in self.streams]
                    return [stream.frame.copy() for stream in self.streams]
                changed.wait(min(stream.active for stream in self.streams) + live.FRAME_TIMEOUT - now)

    def close(self) -> None:
        """Stop every stream's reader and release its capture."""
        live.close_streams(self.streams)

    def __del__(self):
        streams = getattr(self, "streams", None)
        if streams:
            for stream in streams:
                stream.stop()


class LoadScreenshots:
    """Iterate ``(screen, im, im0, None, s)`` over screenshots, as YOLOv5's: ``source`` is ``"screen"``, ``"screen N"``
    or ``"screen N left top width height"`` (detect.py's --source screen forms); ``im`` letterboxed RGB (3, h, w), ``im0``
    the screenshot (BGR); endless, as a screen is. Needs the mss package; a malformed source is one line at once."""

    def __init__(self, source, img_size=640, stride: int = 32, auto: bool = True, transforms=None):
        self.source = str(source).strip()
        self.screen, self.region = live.parse_screen(self.source)
        self.img_size, self.stride, self.auto, self.transforms = img_size, stride, auto, transforms
        self.frame, self._shots = 0, None

    def __iter__(self):
        self._shots = live.read_screen(self.source)
        return self

    def __next__(self):
        if self._shots is None:
            iter(self)
        im0 = next(self._shots)
        self.frame += 1
        area = self.region or {"left": 0, "top": 0, "width": im0.shape[1], "height": im0.shape[0]}
        s = f"screen {self.screen} (LTWH): {area['left']},{area['top']},{area['width']},{area['height']}: "
        return str(self.screen), model_input(im0, self.img_size, self.stride, self.auto, self.transforms), im0, None, s
