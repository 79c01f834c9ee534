"""YOLOv5's ``utils.dataloaders.LoadImages``, ``IMG_FORMATS`` and ``VID_FORMATS``, for inference scripts written
against YOLOv5 (docs/yolov5-scripts.md). Files are found and read as detect.py reads them (utils/sources.py: a
file, folder, glob, .txt list, URL, or a list of them; images checked before they are decoded). Training data is
utils/data/. Live sources (webcams, streams, the screen) are detect.py's (``--source 0``), not here.
"""
from __future__ import annotations

import numpy as np

from utils.augmentations import letterbox
from utils.data.images import IMG_EXTENSIONS, VID_EXTENSIONS
from utils.sources import Sources

IMG_FORMATS = IMG_EXTENSIONS  # suffixes without the dot, as YOLOv5's
VID_FORMATS = VID_EXTENSIONS


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
        if self.transforms:
            im = self.transforms(item.image)
        else:
            im = letterbox(item.image, self.img_size, stride=self.stride, auto=self.auto)[0]
            im = np.ascontiguousarray(im.transpose((2, 0, 1))[::-1])  # HWC BGR -> CHW RGB
        return item.path, im, item.image, self.cap, s
