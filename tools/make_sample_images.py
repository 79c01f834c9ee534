"""Write the sample images in data/images (detect.py's and hubconf.py's default source, as YOLOv5's
data/images): two scenes of the embedded dataset's generator (utils/data/synthetic.py), made by our own code,
deterministic (the same bytes on every run with the same OpenCV JPEG encoder).

    python -m tools.make_sample_images
"""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from utils.data.synthetic import render_image

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = {"shapes1.jpg": 1, "shapes2.jpg": 2}  # file name -> generator seed


def main() -> None:
    folder = ROOT / "data" / "images"
    folder.mkdir(parents=True, exist_ok=True)
    for name, seed in SAMPLES.items():
        image, labels = render_image(np.random.default_rng([2026, 11, 26, seed]))
        ok, encoded = cv2.imencode(".jpg", image, [cv2.IMWRITE_JPEG_QUALITY, 90])
        if not ok:
            raise SystemExit(f"{name}: JPEG encoding failed")
        (folder / name).write_bytes(encoded.tobytes())
        print(f"{folder / name}: {image.shape[1]}x{image.shape[0]}, {len(labels)} objects")


if __name__ == "__main__":
    main()
