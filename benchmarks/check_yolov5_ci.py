"""YOLOv5 v7's CI "Test detection" block, pasted verbatim, run in a fresh copy of this repository.

    python benchmarks/check_yolov5_ci.py              # a loopback server stands in for YOLOv5's release assets
    python benchmarks/check_yolov5_ci.py --offline    # no server: each command that needs a download says why

The copy (tracked-looking files only: no .git, runs, virtual environments) goes to a temporary folder with an empty
HOME; yolov5n.pt is absent at the start. With the server, YOLO_TRAINER_MIRROR points at it and it serves the
project's own YOLOv5-format yolov5n.pt (tests/generate_yolov5.py: YOLOv5's module names, our code) and a stand-in
coco128.zip made from the embedded dataset's generator; without it the mirror points at a closed port. The hub
snippet's data/images/bus.jpg is pointed at one of our sample images. Prints each command's exit code and its last
line of error output, as a markdown table.
"""
from __future__ import annotations

import argparse
import http.server
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

M, B = "yolov5n", "runs/train/exp/weights/best"
COMMANDS = [  # YOLOv5 v7's ci-testing.yml, "Test detection", with $m and $b expanded and the loops unrolled
    f"python train.py --imgsz 64 --batch 32 --weights {M}.pt --cfg {M}.yaml --epochs 1 --device cpu",
    f"python val.py --imgsz 64 --batch 32 --weights {M}.pt --device cpu",
    f"python detect.py --imgsz 64 --weights {M}.pt --device cpu",
    f"python val.py --imgsz 64 --batch 32 --weights {B}.pt --device cpu",
    f"python detect.py --imgsz 64 --weights {B}.pt --device cpu",
    f"python hubconf.py --model {M}",
    f"python models/yolo.py --cfg {M}.yaml",
    f"python export.py --weights {M}.pt --img 64 --include torchscript",
    "python - <<EOF\nimport torch\nim = torch.zeros([1, 3, 64, 64])\n"
    f"for path in '{M}', '{B}':\n"
    "    model = torch.hub.load('.', 'custom', path=path, source='local')\n"
    "    print(model('data/images/shapes1.jpg'))  # YOLOv5's: data/images/bus.jpg\n"
    "    model(im)  # warmup, build grids for trace\n    torch.jit.trace(model, [im])\nEOF",
]
SKIPPED = {".git", "runs", ".venv", "__pycache__", ".gpu", ".pytest_cache", ".benchmarks", ".whl", ".gl"}


def coco128_standin(folder: Path, count: int = 16) -> Path:
    """coco128.zip's layout (coco128/images/train2017, coco128/labels/train2017) with generated scenes."""
    import cv2
    import numpy as np

    from utils.data.synthetic import render_image

    archive = folder / "coco128.zip"
    with zipfile.ZipFile(archive, "w") as out:
        for index in range(count):
            image, labels = render_image(np.random.default_rng([128, index]))
            name = f"{index:012d}"
            out.writestr(f"coco128/images/train2017/{name}.jpg", cv2.imencode(".jpg", image)[1].tobytes())
            out.writestr(f"coco128/labels/train2017/{name}.txt",
                         "".join(f"{int(r[0])} {r[1]:.6f} {r[2]:.6f} {r[3]:.6f} {r[4]:.6f}\n" for r in labels))
    return archive


def serve(folder: Path) -> tuple[http.server.ThreadingHTTPServer, str]:
    handler = lambda *args: http.server.SimpleHTTPRequestHandler(*args, directory=str(folder))  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}/"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--offline", action="store_true", help="no server: the mirror is a closed port")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="yolov5-ci-"))
    repo, home, assets = work / "yolo-trainer", work / "home", work / "assets"
    shutil.copytree(ROOT, repo, ignore=lambda folder, names: [n for n in names if n in SKIPPED])
    home.mkdir()
    assets.mkdir()
    httpd = None
    if args.offline:
        mirror = "http://127.0.0.1:9/"  # the discard port: nothing listens
    else:
        from tests.generate_yolov5 import write_yolov5_lookalike

        (work / "lookalike").mkdir()
        shutil.copy(write_yolov5_lookalike(work / "lookalike").checkpoint, assets / f"{M}.pt")
        coco128_standin(assets)
        httpd, mirror = serve(assets)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("YOLO_TRAINER")}, "HOME": str(home),
           "YOLO_TRAINER_MIRROR": mirror, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    rows = []
    try:
        for command in COMMANDS:
            done = subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True,
                                  timeout=1200)
            errors = [line for line in done.stderr.splitlines() if "error" in line.lower()]
            last = (errors or done.stderr.strip().splitlines() or [""])[-1][:200]
            rows.append((command.splitlines()[0], done.returncode, last))
            print(f"{done.returncode:3d}  {command.splitlines()[0]}", flush=True)
    finally:
        if httpd is not None:
            httpd.shutdown()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'offline (no server)' if args.offline else 'loopback server as YOLO_TRAINER_MIRROR'}\n")
    print("| command | exit | last error line |\n|---|---|---|")
    for command, code, last in rows:
        print(f"| `{command}` | {code} | {last.replace('|', '/') if code else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
