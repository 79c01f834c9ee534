"""Time and peak memory of the Objects365 conversion (utils/data/converters.py) on a generated stand-in, against
parsing the same JSON whole (json.load: what YOLOv5's pycocotools conversion needs before it starts).

    python benchmarks/bench_convert.py --images 100000 --boxes 1500000 [--keep DIR]

The stand-in: ``--images`` empty .jpg files under images/train/patch*/ (the converter moves them and never decodes
them) and a COCO-style zhiyuan_objv2_train.json with ``--boxes`` annotations (random boxes, 365 categories, 1% crowd),
a 10-image val split. Each measurement runs in its own process; peak memory is its VmHWM (resident high water).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def make_standin(folder: Path, images: int, boxes: int, seed: int = 0) -> None:
    import numpy as np

    rng = np.random.default_rng(seed)
    categories = [{"id": index + 1, "name": f"class {index}"} for index in range(365)]
    for split, count, total in (("train", images, boxes), ("val", 10, 30)):
        patch = folder / "images" / split
        entries = []
        for index in range(count):
            name = f"objects365_{split}_{index:08d}.jpg"
            (patch / f"patch{index // 10000}").mkdir(parents=True, exist_ok=True)
            (patch / f"patch{index // 10000}" / name).touch()
            entries.append({"id": index, "file_name": f"images/v1/patch{index // 10000}/{name}", "width": 1024,
                            "height": 768})
        image_id = rng.integers(0, count, total)
        xy = rng.uniform(0, 740, (total, 2)).round(2)
        wh = rng.uniform(2, 300, (total, 2)).round(2)
        category = rng.integers(1, 366, total)
        crowd = rng.random(total) < 0.01
        with open(folder / f"zhiyuan_objv2_{split}.json", "w") as out:
            out.write('{"images": ' + json.dumps(entries) + ', "annotations": [')
            out.write(",".join(
                f'{{"id": {i}, "image_id": {image_id[i]}, "category_id": {category[i]}, "bbox": [{xy[i, 0]}, '
                f'{xy[i, 1]}, {wh[i, 0]}, {wh[i, 1]}], "iscrowd": {int(crowd[i])}, "area": 1.0}}'
                for i in range(total)))
            out.write('], "categories": ' + json.dumps(categories) + "}")


def measure(code: str) -> tuple[float, float]:
    """(wall seconds, peak resident MB) of ``python -c code`` run from the repository, in a process of its own."""
    start = time.perf_counter()
    # VmHWM, not ru_maxrss: Linux carries a parent's maximum into a child across fork and exec
    done = subprocess.run([sys.executable, "-c", code + "\nprint('peak', next(line.split()[1] for line in "
                           "open('/proc/self/status') if line.startswith('VmHWM')))"],
                          cwd=ROOT, check=True, capture_output=True, text=True)
    wall = time.perf_counter() - start
    lines = done.stdout.splitlines()
    for line in lines[:-1]:
        print("  " + line)
    return wall, int(lines[-1].split()[1]) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=100_000)
    parser.add_argument("--boxes", type=int, default=1_500_000)
    parser.add_argument("--keep", default="", help="make the stand-in here and keep it (default: a temporary folder)")
    args = parser.parse_args()
    folder = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="objects365-"))
    make_standin(folder, args.images, args.boxes)
    size = (folder / "zhiyuan_objv2_train.json").stat().st_size / 1e6
    print(f"stand-in: {args.images} images, {args.boxes} boxes, train JSON {size:.0f} MB in {folder}")
    wall, peak = measure(f"import json; json.load(open({str(folder / 'zhiyuan_objv2_train.json')!r}))")
    print(f"json.load of the train JSON alone: {wall:.1f} s, peak {peak:.0f} MB")
    wall, peak = measure("import logging, sys; logging.basicConfig(level=logging.WARNING); "
                         "from utils.data.converters import objects365_to_yolo; "
                         f"print(objects365_to_yolo({str(folder)!r}).line())")
    print(f"objects365_to_yolo (streamed, labels written): {wall:.1f} s, peak {peak:.0f} MB")
    if not args.keep:
        import shutil

        shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    main()
