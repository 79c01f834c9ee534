"""YOLOv5 v7's README and tutorial detection commands, run one by one in a fresh copy of this repository.

    python benchmarks/check_yolov5_commands.py             # a loopback server stands in for YOLOv5's downloads
    python benchmarks/check_yolov5_commands.py --offline   # nothing listens: what needs a download says why
    python benchmarks/check_yolov5_commands.py --only detect hub   # rows whose group is named

Each row is a command as YOLOv5 documents it (README "Inference", "Training", "PyTorch Hub"; the tutorials "Train
Custom Data", "Multi-GPU Training", "Test-Time Augmentation", "Model Ensembling", "Transfer Learning with Frozen
Layers", "Hyperparameter Evolution", "TFLite, ONNX, CoreML, TensorRT Export") and the command run, which is the
same text where the CPU can run it at all; where it differs (COCO's 20 GB replaced by coco128, 300 epochs by 1,
300 evolution generations by 2) the row says so. The copy has an empty HOME and no weights; with the server,
YOLO_TRAINER_MIRROR points at it and it serves randomly initialised checkpoints of the project's own format named
yolov5s.pt, yolov5x.pt and yolov5l6.pt (80 classes: the release files are not reachable here; a real YOLOv5 file
is loaded by check_yolov5_ci.py and the tests), a coco128.zip stand-in, an image for the URL rows and an MJPEG
stream that ends after a few frames. Prints a markdown table: the command, its exit code, and the last error line
(for a command that is expected to fail here, that line is the answer the user gets).
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
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.check_yolov5_ci import SKIPPED, coco128_standin  # noqa: E402

HUB = """python - <<EOF
import torch
model = torch.hub.load('.', 'yolov5s', source='local')  # YOLOv5: torch.hub.load("ultralytics/yolov5", "yolov5s")
img = '{url}images/zidane.jpg'  # YOLOv5: https://ultralytics.com/images/zidane.jpg
results = model(img)
results.print()  # or .show(), .save(), .crop(), .pandas(), etc.
results.save()
print(len(results.crop()), 'crops')
EOF"""
HUB_TTA = """python - <<EOF
import torch
model = torch.hub.load('.', 'yolov5s', source='local')
results = model('data/images/shapes1.jpg', augment=True)  # YOLOv5's TTA tutorial: model(img, augment=True)
print(results)
EOF"""

# (group, as YOLOv5 documents it, what is run here: None = the same text, note)
ROWS = [
    ("detect", "python detect.py --weights yolov5s.pt --source 0", None, "webcam"),
    ("detect", "python detect.py --weights yolov5s.pt --source img.jpg", None, "image"),
    ("detect", "python detect.py --weights yolov5s.pt --source vid.mp4", None, "video (made by this script)"),
    ("detect", "python detect.py --weights yolov5s.pt --source screen", None, "screenshot"),
    ("detect", "python detect.py --weights yolov5s.pt --source path/", None, "directory"),
    ("detect", "python detect.py --weights yolov5s.pt --source list.txt", None, "list of images"),
    ("detect", "python detect.py --weights yolov5s.pt --source list.streams", None,
     "list of streams (a loopback MJPEG stream that ends)"),
    ("detect", "python detect.py --weights yolov5s.pt --source 'path/*.jpg'", None, "glob"),
    ("detect", "python detect.py --weights yolov5s.pt --source 'https://youtu.be/Zgi9g1ksQHc'", None, "YouTube"),
    ("detect", "python detect.py --weights yolov5s.pt --source 'rtsp://example.com/media.mp4'", None,
     "RTSP stream (example.com: not reachable here)"),
    ("train", "python train.py --data coco.yaml --epochs 300 --weights '' --cfg yolov5n.yaml  --batch-size 128",
     None, "COCO from scratch: its 20 GB download"),
    ("train", "python train.py --data coco.yaml --epochs 300 --weights '' --cfg yolov5n.yaml  --batch-size 128",
     "python train.py --data coco128.yaml --epochs 1 --weights '' --cfg yolov5n.yaml  --batch-size 128",
     "the same on coco128, 1 epoch"),
    ("hub", 'model = torch.hub.load("ultralytics/yolov5", "yolov5s"); results = model(img); results.print()',
     HUB, "the repository path for YOLOv5's GitHub name; the image from the loopback"),
    ("custom", "python train.py --img 640 --epochs 3 --data coco128.yaml --weights yolov5s.pt", None,
     "Train Custom Data"),
    ("custom", "python detect.py --weights runs/train/exp/weights/best.pt --source data/images", None, ""),
    ("custom", "python val.py --weights runs/train/exp/weights/best.pt --data coco128.yaml", None, ""),
    ("ddp", "python -m torch.distributed.run --nproc_per_node 2 train.py --batch 64 --data coco.yaml "
     "--weights yolov5s.pt --device 0,1", None, "Multi-GPU on a machine without GPUs"),
    ("ddp", "python -m torch.distributed.run --nproc_per_node 2 train.py --batch 64 --data coco.yaml "
     "--weights yolov5s.pt --device 0,1",
     "python -m torch.distributed.run --nproc_per_node 2 train.py --batch 64 --data coco128.yaml "
     "--weights yolov5s.pt --device cpu --epochs 1 --img 160", "the same on 2 CPU processes (gloo), coco128"),
    ("tta", "python val.py --weights yolov5x.pt --data coco.yaml --img 640 --half",
     "python val.py --weights yolov5x.pt --data coco128.yaml --img 640 --half", "coco128 for COCO"),
    ("tta", "python val.py --weights yolov5x.pt --data coco.yaml --img 832 --augment --half",
     "python val.py --weights yolov5x.pt --data coco128.yaml --img 832 --augment --half", "coco128 for COCO"),
    ("tta", "python detect.py --weights yolov5s.pt --img 832 --source data/images --augment", None, ""),
    ("tta", "model(img, augment=True)", HUB_TTA, "hub"),
    ("ensemble", "python val.py --weights yolov5x.pt yolov5l6.pt --data coco.yaml --img 640 --half",
     "python val.py --weights yolov5x.pt yolov5l6.pt --data coco128.yaml --img 640 --half", "coco128 for COCO"),
    ("ensemble", "python detect.py --weights yolov5x.pt yolov5l6.pt --img 640 --source data/images", None, ""),
    ("freeze", "python train.py --freeze 10", "python train.py --freeze 10 --epochs 1 --data coco128.yaml",
     "1 epoch for 100; YOLOv5's default --data (coco128) named: ours is the embedded dataset"),
    ("freeze", "python train.py --freeze 24", "python train.py --freeze 24 --epochs 1 --data coco128.yaml",
     "as above"),
    ("evolve", "python train.py --epochs 10 --data coco128.yaml --weights yolov5s.pt --cache --evolve",
     "python train.py --epochs 1 --data coco128.yaml --weights yolov5s.pt --cache --evolve 2",
     "2 generations of 1 epoch for 300 of 10"),
    ("resume", "python train.py --resume", None, "the latest last.pt under runs/ (finished runs say so)"),
    ("export", "python export.py --weights yolov5s.pt --include torchscript onnx", None, ""),
    ("export", "python export.py --weights yolov5s.pt --include openvino", None, ""),
    ("export", "python export.py --weights yolov5s.pt --include tflite", None, ""),
    ("export", "python export.py --weights yolov5s.pt --include coreml", None, ""),
    ("export", "python export.py --weights yolov5s.pt --include engine --device 0", None, "TensorRT"),
    ("export", "python detect.py --weights yolov5s.torchscript", None, ""),
    ("export", "python val.py --weights yolov5s.torchscript --data coco128.yaml", None, ""),
    ("export", "python detect.py --weights yolov5s.onnx", None, ""),
    ("export", "python detect.py --weights yolov5s_openvino_model", None, ""),
    ("benchmarks", "python benchmarks.py --weights yolov5s.pt --imgsz 640 --device 0",
     "python benchmarks.py --weights yolov5s.pt --imgsz 640 --device cpu", "CPU for GPU 0"),
]


class Stream(http.server.BaseHTTPRequestHandler):
    """A multipart MJPEG stream of a few frames that can be watched once, then is gone (404): detect.py ends after
    its retries. (A stream that comes back is watched again, as a camera that recovers should be.)"""

    frame = b""
    served = False

    def do_GET(self):  # noqa: N802 - the http.server name
        if Stream.served:
            self.send_error(404)
            return
        Stream.served = True
        self.send_response(200)
        self.send_header("Content-Type", "multipart/x-mixed-replace; boundary=frame")
        self.end_headers()
        for _ in range(5):
            self.wfile.write(b"--frame\r\nContent-Type: image/jpeg\r\nContent-Length: %d\r\n\r\n" % len(self.frame)
                             + self.frame + b"\r\n")
            time.sleep(0.05)

    def log_message(self, *args):
        pass


def serve(handler) -> tuple[http.server.ThreadingHTTPServer, str]:
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    return httpd, f"http://127.0.0.1:{httpd.server_address[1]}/"


def make_assets(assets: Path) -> None:
    """Random checkpoints of the project's format under YOLOv5's release names (80 COCO classes), coco128.zip."""
    import yaml

    from tests.conftest import save_random_checkpoint

    names = yaml.safe_load((ROOT / "data" / "coco128.yaml").read_text())["names"]
    names = [names[i] for i in sorted(names)] if isinstance(names, dict) else names
    for name in ("yolov5s", "yolov5x", "yolov5l6"):
        save_random_checkpoint(assets / f"{name}.pt", names, cfg=ROOT / "models" / f"{name}.yaml")
    coco128_standin(assets)
    (assets / "images").mkdir()
    shutil.copy(ROOT / "data" / "images" / "shapes1.jpg", assets / "images" / "zidane.jpg")


def make_sources(repo: Path, stream_url: str) -> None:
    """img.jpg, vid.mp4, path/, list.txt, list.streams in the copy, from the project's sample images."""
    import cv2

    images = sorted((repo / "data" / "images").glob("*.jpg"))
    shutil.copy(images[0], repo / "img.jpg")
    (repo / "path").mkdir()
    for image in images:
        shutil.copy(image, repo / "path" / image.name)
    (repo / "list.txt").write_text("".join(f"{image}\n" for image in images))
    (repo / "list.streams").write_text(f"{stream_url}\n")
    frame = cv2.imread(str(images[0]))
    video = cv2.VideoWriter(str(repo / "vid.mp4"), cv2.VideoWriter_fourcc(*"mp4v"), 10,
                            (frame.shape[1], frame.shape[0]))
    for index in range(8):
        video.write(cv2.flip(frame, 1) if index % 2 else frame)
    video.release()


def last_error(stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or "traceback" in line.lower()]
    return (errors or lines or [""])[-1].strip()[:220]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--offline", action="store_true", help="no server: the mirror is a closed port")
    parser.add_argument("--only", nargs="+", help="run only these groups: " + " ".join(dict.fromkeys(
        row[0] for row in ROWS)))
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="yolov5-commands-"))
    repo, home, assets = work / "yolo-trainer", work / "home", work / "assets"
    shutil.copytree(ROOT, repo, ignore=lambda folder, names: [n for n in names if n in SKIPPED])
    home.mkdir()
    assets.mkdir()
    servers = []
    if args.offline:
        mirror = stream_url = "http://127.0.0.1:9/"  # the discard port: nothing listens
    else:
        make_assets(assets)
        import cv2

        Stream.frame = cv2.imencode(".jpg", cv2.imread(str(ROOT / "data" / "images" / "shapes2.jpg")))[1].tobytes()
        (httpd, mirror), (stream, stream_url) = serve(
            lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(assets))), serve(Stream)
        servers = [httpd, stream]
    make_sources(repo, stream_url + "live.mjpg")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("YOLO_TRAINER")}, "HOME": str(home),
           "YOLO_TRAINER_MIRROR": mirror, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
           "DISPLAY": ""}
    rows = []
    try:
        for group, documented, command, note in ROWS:
            if args.only and group not in args.only:
                continue
            command = (command or documented).replace("{url}", mirror)
            start = time.time()
            try:
                done = subprocess.run(["bash", "-c", command], cwd=repo, env=env, capture_output=True, text=True,
                                      timeout=1800)
                code, last = done.returncode, last_error(done.stderr)
            except subprocess.TimeoutExpired:
                code, last = "timeout", "did not end in 30 minutes"
            seconds = time.time() - start
            run = "" if command == documented else command.splitlines()[0] if "<<EOF" not in command else "(script)"
            rows.append((group, documented, run, note, code, last, seconds))
            print(f"{code!s:>7}  {seconds:6.1f} s  {documented}", flush=True)
    finally:
        for server in servers:
            server.shutdown()
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(f"\n{'offline (no server)' if args.offline else 'loopback server as YOLO_TRAINER_MIRROR'}\n")
    print("| group | YOLOv5's command | run here instead | note | exit | last error line |\n|---|---|---|---|---|---|")
    for group, documented, run, note, code, last, _ in rows:
        cell = lambda text: text.replace("|", "/")  # noqa: E731
        print(f"| {group} | `{cell(documented)}` | {f'`{cell(run)}`' if run else ''} | {note} | {code} | "
              f"{cell(last) if code else ''} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
