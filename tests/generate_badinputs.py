"""A small YOLO-layout dataset of broken and awkward files, made at test time (a few hundred KB).

Every image file of ``images/train`` is one case: what a well-behaved scan does with it is listed in
``tests/test_verify.py`` (TRAIN_CASES). The label rows are the smallest ones that show each defect;
the "format" images (gray, RGBA, 16-bit, BMP, WebP, TIFF, EXIF-rotated, ...) all hold the same upright
picture, so their labels are the same rows and the EXIF-rotated one can be compared with the BMP.
"""
from __future__ import annotations

import io
from pathlib import Path

import cv2
import numpy as np

NAMES = ["RBC", "WBC", "Platelets"]
SIZE = (80, 60)  # width, height of the ordinary images
NUM_GOOD = {"train": 12, "val": 6}
EXIF_ORIENTATION = 0x0112

# label text of the cases whose image is an ordinary picture (None: no label file)
LABEL_CASES = {
    "class_out_of_range": "0 0.5 0.5 0.2 0.2\n7 0.3 0.3 0.1 0.1\n",
    "negative_class": "-1 0.5 0.5 0.2 0.2\n",
    "pixel_coords": "0 40 30 12 9\n",
    "negative_coords": "0 -0.2 0.5 0.1 0.1\n",
    "nan_coords": "0 nan 0.5 0.1 0.1\n",
    "text_in_label": "RBC 0.5 0.5 0.1 0.1\n",
    "four_columns": "0 0.5 0.5 0.1\n",
    "duplicate_rows": "0 0.5 0.5 0.2 0.2\n0 0.5 0.5 0.2 0.2\n1 0.2 0.2 0.1 0.1\n",
    "empty_label": "",
    "whitespace_label": "\n   \n\t\n",
    "crlf_trailing_spaces": "0 0.5 0.5 0.2 0.2  \r\n1 0.25 0.25 0.1 0.1\r\n",
    "zero_size_box": "0 0.5 0.5 0.0 0.1\n1 0.3 0.3 0.1 0.1\n",
    "polygon_segment": "2 0.10 0.10 0.30 0.12 0.32 0.40 0.12 0.38\n",  # box: cx 0.21 cy 0.25 w 0.22 h 0.30
    "box_past_edge": "0 0.95 0.5 0.2 0.2\n",  # clipped: cx 0.925 w 0.15
    "no_label_file": None,
}


def random_scene(rng: np.random.Generator, size=SIZE, smooth: bool = False) -> tuple[np.ndarray, str]:
    """(BGR image, label text): filled rectangles on a gradient (plus noise unless ``smooth``)."""
    width, height = size
    ramp = np.linspace(30, 120, width, dtype=np.float32)[None, :, None]
    image = np.broadcast_to(ramp, (height, width, 3)).copy()
    if not smooth:
        image += rng.normal(0, 8, image.shape)
    rows = []
    for _ in range(int(rng.integers(1, 4))):
        cls = int(rng.integers(0, len(NAMES)))
        w, h = int(rng.integers(width // 8, width // 3)), int(rng.integers(height // 8, height // 3))
        x1, y1 = int(rng.integers(0, width - w)), int(rng.integers(0, height - h))
        image[y1:y1 + h, x1:x1 + w] = (60 + 90 * cls, 200 - 60 * cls, 40 + 70 * cls)
        rows.append(f"{cls} {(x1 + w / 2) / width:.6f} {(y1 + h / 2) / height:.6f} {w / width:.6f} {h / height:.6f}")
    return np.clip(image, 0, 255).astype(np.uint8), "\n".join(rows) + "\n"


def encode(image: np.ndarray, suffix: str, *params: int) -> bytes:
    ok, data = cv2.imencode(suffix, image, list(params))
    assert ok, f"OpenCV cannot encode {suffix}"
    return data.tobytes()


def exif_rotated_jpeg(upright: np.ndarray) -> bytes:
    """A JPEG whose stored pixels are ``upright`` turned a quarter left, with EXIF orientation 6
    (display: turn a quarter right), so a reader that applies EXIF gets ``upright`` back."""
    from PIL import Image

    stored = cv2.rotate(upright, cv2.ROTATE_90_COUNTERCLOCKWISE)
    exif = Image.Exif()
    exif[EXIF_ORIENTATION] = 6
    buffer = io.BytesIO()
    Image.fromarray(cv2.cvtColor(stored, cv2.COLOR_BGR2RGB)).save(buffer, "JPEG", quality=95, exif=exif.tobytes())
    return buffer.getvalue()


def format_cases(upright: np.ndarray) -> dict[str, bytes]:
    """One picture in every container and pixel layout a scan must accept."""
    jpeg = encode(upright, ".jpg", cv2.IMWRITE_JPEG_QUALITY, 95)
    return {
        "gray.png": encode(cv2.cvtColor(upright, cv2.COLOR_BGR2GRAY), ".png"),
        "rgba.png": encode(cv2.cvtColor(upright, cv2.COLOR_BGR2BGRA), ".png"),
        "sixteen_bit.png": encode(upright.astype(np.uint16) * 257, ".png"),
        "UPPER_CASE.JPG": jpeg,
        "bitmap.bmp": encode(upright, ".bmp"),
        "webp_image.webp": encode(upright, ".webp", cv2.IMWRITE_WEBP_QUALITY, 95),
        "tiff_image.tif": encode(upright, ".tiff"),
        "name with spaces é.jpg": jpeg,
        "exif_rotated.jpg": exif_rotated_jpeg(upright),
    }


def broken_files(rng: np.random.Generator) -> dict[str, bytes]:
    """Files named like images that are not (usable) images."""
    jpeg = encode(random_scene(rng)[0], ".jpg")
    return {
        "zero_bytes.jpg": b"",
        "truncated.jpg": jpeg[: len(jpeg) * 2 // 5],  # header intact, scan data cut
        "not_an_image.jpg": b"hello, this is text\n" * 50,
        "html_named_png.png": b"<html><body>404</body></html>",
        "tiny_1x1.png": encode(np.zeros((1, 1, 3), np.uint8), ".png"),
    }


def write_split(root: Path, split: str, files: dict[str, bytes], labels: dict[str, str | None]) -> None:
    images, label_dir = root / "images" / split, root / "labels" / split
    images.mkdir(parents=True, exist_ok=True)
    label_dir.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (images / name).write_bytes(data)
        text = labels.get(name)
        if text is not None:
            (label_dir / (Path(name).stem + ".txt")).write_bytes(text.encode())


def make_badinputs(root: Path, seed: int = 0) -> Path:
    """Write the dataset under ``root``; returns its data.yaml (3 classes: RBC, WBC, Platelets)."""
    rng = np.random.default_rng(seed)
    for split, count in NUM_GOOD.items():
        files, labels = {}, {}
        for index in range(count):
            image, text = random_scene(rng)
            files[f"good_{index:02d}.jpg"], labels[f"good_{index:02d}.jpg"] = encode(image, ".jpg"), text
        if split == "train":
            for case, text in LABEL_CASES.items():
                files[f"{case}.jpg"], labels[f"{case}.jpg"] = encode(random_scene(rng)[0], ".jpg"), text
            upright, text = random_scene(rng, smooth=True)
            for name, data in format_cases(upright).items():
                files[name], labels[name] = data, text
            files["very_wide.jpg"] = encode(random_scene(rng, size=(400, 16))[0], ".jpg")
            labels["very_wide.jpg"] = "0 0.5 0.5 0.05 0.8\n"
            broken = broken_files(rng)
            files.update(broken)
            labels.update({name: "0 0.5 0.5 0.1 0.1\n" for name in broken})
            files["notes.txt"] = b"not an image, should be ignored\n"
            files[".hidden.jpg"] = b""
        write_split(root, split, files, labels)
    data = root / "data.yaml"
    data.write_text("path: .\ntrain: images/train\nval: images/val\nnames:\n"
                    + "".join(f"  {index}: {name}\n" for index, name in enumerate(NAMES)))
    return data


def set_folders_writable(root: Path, writable: bool) -> None:
    """Make every folder under ``root`` (and ``root``) read-only or writable again, like a shared,
    read-only copy of a dataset."""
    for folder in [root, *(p for p in root.rglob("*") if p.is_dir())]:
        folder.chmod(0o755 if writable else 0o555)
