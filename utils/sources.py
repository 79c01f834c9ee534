"""Inputs for detect: an image, a folder, a glob pattern, a .txt list of paths, a video file, an image or video
URL (downloaded first, into the current folder as YOLOv5 does), or a live source (utils/streams.py: a webcam index,
a stream URL, a .streams list, ``screen``).

``Sources(source, vid_stride)`` resolves the files (or opens the live sources) up front, so a missing source is an
error before any model work, and iterates ``SourceItem``s: one per image, one per kept video or stream frame.
"""
from __future__ import annotations

import glob
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import cv2
import numpy as np

from utils.data.images import IMG_EXTENSIONS, VID_EXTENSIONS, ImageError, read_image
from utils.downloads import is_url
from utils.errors import SourceError
from utils.streams import (close_streams, is_index, is_stream_url, open_streams, parse_screen, read_screen, read_streams,
                           stream_urls)

LOGGER = logging.getLogger(__name__)


@dataclass
class SourceItem:
    path: str  # the file the image came from
    image: np.ndarray  # original BGR uint8 HxWx3
    index: int  # 1-based position of the file among the source's files
    count: int  # number of files in the source
    is_video: bool = False
    frame: int = 0  # 1-based number of this frame among the video's kept frames (videos only)
    frames: int = 0  # kept frames in the video (frame count / vid_stride; 0 when unknown)
    fps: float = 0.0  # video frame rate (videos only)
    name: str = ""  # the output file's stem (live sources: stream0, stream1, ..., screen); else the file's
    capture: object = None  # a video file's open cv2.VideoCapture while its frames are read


def _kind(path: Path) -> str | None:
    suffix = path.suffix[1:].lower()
    if suffix in IMG_EXTENSIONS:
        return "image"
    if suffix in VID_EXTENSIONS:
        return "video"
    return None


def _media_in_folder(folder: Path) -> list[Path]:
    return sorted(p for p in folder.iterdir() if p.is_file() and _kind(p))


def _resolve_entry(entry: str, base: Path | None = None) -> list[Path]:
    """One source string (file, folder or glob; relative to ``base`` when given) -> media files."""
    path = Path(entry).expanduser()
    if base is not None and not path.is_absolute() and (base / path).exists():
        path = base / path
    if any(ch in entry for ch in "*?["):
        pattern = entry if base is None or Path(entry).is_absolute() else str(base / entry)
        return sorted(p for p in map(Path, glob.glob(pattern, recursive=True)) if p.is_file() and _kind(p))
    if path.is_dir():
        return _media_in_folder(path)
    if path.is_file():
        if _kind(path) is None:
            supported = ", ".join(IMG_EXTENSIONS + VID_EXTENSIONS)
            raise SourceError(f"{path}: not an image or video file (supported extensions: {supported})")
        return [path]
    raise SourceError(f"source not found: {entry}")


def _read_list(txt: Path) -> list[Path]:
    """A .txt of paths, one per line; relative lines are relative to the .txt's folder."""
    files = []
    for line in txt.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        try:
            files += _resolve_entry(line, base=txt.parent)
        except SourceError as e:
            LOGGER.warning(f"{txt}: skipping entry: {e}")
    return files


def live_kind(text: str) -> str | None:
    """'screen', 'streams' (webcam indices, stream URLs, .streams files) or None (files, and media URLs)."""
    lowered = text.lower()
    if lowered == "screen" or lowered.startswith("screen "):
        return "screen"
    if is_url(text) and _media_url(text):
        return None
    if is_index(text) or is_stream_url(text) or lowered.endswith(".streams"):
        return "streams"
    return None


def _media_url(url: str) -> bool:
    from urllib.parse import urlsplit

    return _kind(Path(urlsplit(url).path)) is not None


def resolve_source(source) -> list[Path]:
    """``--source`` value (not a live one), or a list of them -> media files, the images before the videos, as
    YOLOv5 orders them (each group in the sources' sorted order); SourceError when missing, unsupported or empty.
    An image or video URL is downloaded first (utils/downloads.py) into the current folder, or reused from there."""
    if isinstance(source, (list, tuple)):
        files = [file for entry in source for file in _resolve_one(entry)]
    else:
        files = _resolve_one(source)
    if not files:
        raise SourceError(f"no images or videos found in {source} "
                          f"(supported extensions: {', '.join(IMG_EXTENSIONS + VID_EXTENSIONS)})")
    return [file for file in files if _kind(file) == "image"] + [file for file in files if _kind(file) == "video"]


def _resolve_one(source) -> list[Path]:
    from utils.downloads import MAX_MEDIA_BYTES, download_here, is_url, verify_media

    text = str(source).strip()
    if is_url(text):  # kept only if it decodes (an error page saved as bus.jpg would be reused by every run)
        suffixes = tuple(f".{suffix}" for suffix in IMG_EXTENSIONS + VID_EXTENSIONS)
        return [download_here(text, suffixes, "image or video", verify_media, MAX_MEDIA_BYTES)]
    path = Path(text).expanduser()
    return _read_list(path) if path.suffix.lower() == ".txt" and path.is_file() else _resolve_entry(text)


class Sources:
    """Iterate the images and (every ``vid_stride``-th) video frames of a source."""

    def __init__(self, source: str, vid_stride: int = 1):
        if vid_stride < 1:
            raise SourceError(f"--vid-stride {vid_stride}: must be 1 or more")
        several = isinstance(source, (list, tuple))  # files (as YOLOv5's LoadImages takes them), never live
        self.source = ", ".join(map(str, source)) if several else str(source).strip()
        self.vid_stride = vid_stride
        self.live = None if several else live_kind(self.source)
        self.streams = []
        if self.live == "streams":
            self.streams = open_streams(stream_urls(self.source))
        elif self.live == "screen":
            parse_screen(self.source)  # a malformed region: one line now
        self.files = [] if self.live else resolve_source(source if several else self.source)
        self.videos = [p for p in self.files if _kind(p) == "video"]
        self.single = len(self.files) == 1

    @property
    def num_images(self) -> int:
        return len(self.files) - len(self.videos)

    def total_items(self) -> int:
        """Images plus kept video frames (frame counts read from the video headers)."""
        frames = 0
        for video in self.videos:
            capture = cv2.VideoCapture(str(video))
            frames += int(capture.get(cv2.CAP_PROP_FRAME_COUNT) or 0) // self.vid_stride
            capture.release()
        return self.num_images + frames

    def __len__(self) -> int:
        return len(self.files) or len(self.streams)

    def close(self) -> None:
        """Stop the live streams' threads (iterating to the end, or stopping early, does it too)."""
        close_streams(self.streams)  # all told to stop first: their readers wind down together

    def __iter__(self) -> Iterator[SourceItem]:
        if self.live == "streams":
            count = len(self.streams)
            for index, frame, image in read_streams(self.streams, self.vid_stride):
                yield SourceItem(self.streams[index].source, image, index + 1, count, True, frame, 0,
                                 self.streams[index].fps, name=f"stream{index}")
            return
        if self.live == "screen":
            for frame, image in enumerate(read_screen(self.source), 1):
                yield SourceItem(self.source, image, 1, 1, True, frame, 0, 30.0, name="screen")
            return
        for index, path in enumerate(self.files, 1):
            if _kind(path) == "video":
                yield from self._video_frames(path, index)
                continue
            try:
                image = read_image(path)
            except ImageError as e:
                if self.single:
                    raise SourceError(str(e)) from None
                LOGGER.warning(f"skipping unreadable image {e}")
                continue
            yield SourceItem(str(path), image, index, len(self.files))

    def _video_frames(self, path: Path, index: int) -> Iterator[SourceItem]:
        capture = cv2.VideoCapture(str(path))
        if not capture.isOpened():
            capture.release()
            if self.single:
                raise SourceError(f"{path}: cannot open video")
            LOGGER.warning(f"skipping unreadable video {path}")
            return
        fps = capture.get(cv2.CAP_PROP_FPS) or 0.0
        frames = int(capture.get(cv2.CAP_PROP_FRAME_COUNT) or 0) // self.vid_stride
        frame = 0
        try:
            while True:
                for _ in range(self.vid_stride - 1):
                    capture.grab()
                ok, image = capture.read()
                if not ok or image is None:
                    break
                frame += 1
                yield SourceItem(str(path), image, index, len(self.files), True, frame, max(frames, frame), fps,
                                 capture=capture)
        finally:
            capture.release()
        if frame == 0:
            LOGGER.warning(f"{path}: no frames could be decoded")
