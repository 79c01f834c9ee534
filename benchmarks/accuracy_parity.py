"""Accuracy parity with YOLOv5 v7 over several seeds: the README's BCCD command (yolov5n from scratch, 320,
batch 16, 100 epochs, 2 workers, CPU) for each seed, ours and YOLOv5 v7 (its own environment, see
benchmarks/reference/README.md), one run at a time.

Each finished run appends a row to a CSV (side, seed, commit, CPU, best mAP50, best mAP50-95, the first epoch
whose mAP50 passes 0.5, wall seconds, date); runs already in the CSV for the same side, seed, commit and CPU are
skipped, so the script can be stopped and started again (across days) and only does what is missing. Then it
prints each side per seed and as mean +- standard deviation.

    python benchmarks/accuracy_parity.py --sides ours --seeds 0 1 2
    python benchmarks/accuracy_parity.py --sides yolov5 --yolov5-python ~/.cache/yolov5-ref-venv/bin/python \\
        --yolov5-data /tmp/bccd.yaml            # a copy of data.yaml with an absolute path: (YOLOv5 needs it)
    python benchmarks/accuracy_parity.py --sides ours --seeds 0 --amp off   # fp32 on a CPU with AMX too
    python benchmarks/accuracy_parity.py --report   # only print the table from the CSV
    python benchmarks/accuracy_parity.py --preset quickstart --seeds 0 1 2 3 4 5 --amp off   # README quick start
    python benchmarks/accuracy_parity.py --preset embedded25 --seeds 0 1 2 3 4 5 --amp bf16

Presets (ours only; each has its own CSV under benchmarks/results/ unless --csv is given):
  bccd        the README's BCCD command above (the default)
  quickstart  the README's quick start: the embedded dataset, 192, 16 epochs, --nbs 16, hyp.quickstart.yaml
              (rows before 2026-11-26 09:00 in its CSV: 256, 20 epochs, hyp.no-augmentation.yaml, nbs 64)
  embedded25  the embedded dataset, 256, 25 epochs, the default hyp.scratch-low.yaml

"best" is the epoch with the best fitness (0.1 mAP50 + 0.9 mAP50-95), read from each run's results.csv (both
programs write YOLOv5's columns), i.e. the epoch best.pt holds.
"""
from __future__ import annotations

import argparse
import csv
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CSV = ROOT / "benchmarks" / "results" / "accuracy_bccd.csv"
# preset -> (our train.py's arguments besides seed/project/name/amp, CSV)
PRESETS = {
    "quickstart": (["--imgsz", "192", "--epochs", "16", "--nbs", "16", "--hyp", "hyp.quickstart.yaml"],
                   "accuracy_quickstart.csv"),
    "embedded25": (["--imgsz", "256", "--epochs", "25"], "accuracy_embedded25.csv"),
}
COLUMNS = ("side", "seed", "commit", "cpu", "epochs", "best_epoch", "map50", "map50_95", "first_epoch_map50_over_0.5",
           "wall_s", "date")


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sides", nargs="+", default=["ours"], choices=("ours", "yolov5"))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--epochs", type=int, default=100)
    parser.add_argument("--data", default=str(ROOT.parent / "shared/datasets/bccd/data.yaml"))
    parser.add_argument("--yolov5-python", default=str(Path.home() / ".cache/yolov5-ref-venv/bin/python"))
    parser.add_argument("--yolov5-data", default="", help="data YAML for YOLOv5 (absolute 'path:')")
    parser.add_argument("--preset", default="bccd", choices=("bccd", *PRESETS),
                        help="which command: the BCCD parity run or a run on the embedded dataset (ours only)")
    parser.add_argument("--extra", nargs="*", action="extend", default=[],
                        help="more arguments for our train.py (label them: --commit); repeatable, and a value that "
                        "starts with - as --extra=--cache=off")
    parser.add_argument("--train-script", default="train.py",
                        help="our training script, relative to the repository (benchmarks/train_upsample_float32.py: "
                             "train.py with nearest upsampling in float32 under autocast; label it: --commit)")
    parser.add_argument("--csv", default="")
    parser.add_argument("--commit", default="", help="label for our code's version (e.g. a commit hash)")
    parser.add_argument("--amp", default="", choices=("", "auto", "bf16", "off"),
                        help="our train.py's --amp (default: its own default, auto: bf16 only on CPUs with AMX); "
                             "the CSV's commit label gets ' amp=VALUE' when given")
    parser.add_argument("--keep", default="", help="folder to copy each run's best.pt to (as SIDE-seedN-best.pt)")
    parser.add_argument("--report", action="store_true", help="only print the table from the CSV")
    return parser.parse_args()


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as info:
            fields = dict(line.split(":", 1) for line in info if ":" in line)
        flags = fields.get("flags\t\t", fields.get("flags", "")).split()
        extras = [f for f in ("avx512f", "avx512_bf16", "amx_tile") if f in flags]
        name = fields.get("model name\t", "").strip() or platform.processor()
        family, model = fields.get("cpu family\t", "?").strip(), fields.get("model\t\t", "?").strip()
        limits = [f"{var}={os.environ[var]}" for var in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if os.environ.get(var)]
        limited = f", limited to {' '.join(limits)}" if limits else ""  # an AVX2 CPU emulated on a newer one
        return f"{name} (family {family} model {model}; {' '.join(extras) or 'avx2'}{limited}), {os.cpu_count()} CPUs"
    except OSError:
        return platform.processor() or "unknown"


def command(side: str, seed: int, args, project: Path) -> list[str]:
    amp = ["--amp", args.amp] if args.amp else []
    if args.preset in PRESETS:
        return [sys.executable, str(ROOT / args.train_script), *PRESETS[args.preset][0], "--seed", str(seed),
                "--project", str(project), "--name", "exp", *amp, *args.extra]
    common = ["--imgsz", "320", "--batch-size", "16", "--epochs", str(args.epochs), "--workers", "2",
              "--device", "cpu", "--seed", str(seed), "--project", str(project), "--name", "exp"]
    if side == "ours":
        return [sys.executable, str(ROOT / args.train_script), "--data", args.data, "--cfg",
                str(ROOT / "models/yolov5n.yaml"),
                "--weights", "", *common, *amp, *args.extra]
    return [args.yolov5_python, "-m", "yolov5.train", "--data", args.yolov5_data or args.data, "--cfg", "yolov5n.yaml",
            "--weights", "", *common]


def summarise_run(results_csv: Path) -> dict:
    with open(results_csv, newline="") as file:
        rows = list(csv.reader(file))
    header = [h.strip() for h in rows[0]]
    table = [[float(v) for v in row] for row in rows[1:] if row]
    map50, map95 = header.index("metrics/mAP_0.5"), header.index("metrics/mAP_0.5:0.95")
    best = max(table, key=lambda row: 0.1 * row[map50] + 0.9 * row[map95])
    first = next((int(row[0]) + 1 for row in table if row[map50] > 0.5), "")
    return {"epochs": len(table), "best_epoch": int(best[0]) + 1, "map50": round(best[map50], 4),
            "map50_95": round(best[map95], 4), "first_epoch_map50_over_0.5": first}


def run(side: str, seed: int, args) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"parity-{side}-{seed}-") as folder:
        project = Path(folder) / "runs"
        env = {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1"} if side == "yolov5" else None
        start = time.monotonic()
        done = subprocess.run(command(side, seed, args, project), cwd=folder, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
        wall = time.monotonic() - start
        results = project / "exp" / "results.csv"
        if done.returncode != 0 or not results.exists():
            raise SystemExit(f"{side} seed {seed} failed ({done.returncode}): {done.stderr[-2000:]}")
        best = project / "exp" / "weights" / "best.pt"
        if args.keep and best.exists():
            Path(args.keep).mkdir(parents=True, exist_ok=True)
            shutil.copy(best, Path(args.keep) / f"{side}-seed{seed}-best.pt")
        return {"side": side, "seed": seed, "wall_s": round(wall, 1), **summarise_run(results)}


def read_rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    with open(path, newline="") as file:
        return list(csv.DictReader(file))


def append_row(path: Path, row: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    new = not path.exists()
    with open(path, "a", newline="") as file:
        writer = csv.DictWriter(file, fieldnames=COLUMNS)
        if new:
            writer.writeheader()
        writer.writerow({key: row.get(key, "") for key in COLUMNS})


def report(rows: list[dict]) -> None:
    print(f"{'side':8s} {'commit':18s} {'seed':>4s} {'mAP50':>7s} {'mAP50-95':>9s} {'>0.5 at':>8s} {'wall':>8s}  cpu")
    for row in rows:
        print(f"{row['side']:8s} {row['commit'][:18]:18s} {row['seed']:>4s} {float(row['map50']):7.3f} "
              f"{float(row['map50_95']):9.3f} {str(row['first_epoch_map50_over_0.5']):>8s} "
              f"{float(row['wall_s']):7.0f}s  {row['cpu']}")
    groups: dict = {}
    for row in rows:
        groups.setdefault((row["side"], row["commit"], row["cpu"]), []).append(row)
    for (side, commit, cpu), members in groups.items():
        if len(members) < 2:
            continue
        line = [f"{side} {commit} ({len(members)} seeds, {cpu}):"]  # whole label: it may carry ' amp=...' 
        for key, label in (("map50", "mAP50"), ("map50_95", "mAP50-95"), ("wall_s", "wall s")):
            values = [float(m[key]) for m in members]
            line.append(f"{label} {statistics.mean(values):.4g} +- {statistics.stdev(values):.2g}")
        firsts = [int(m["first_epoch_map50_over_0.5"]) for m in members if m["first_epoch_map50_over_0.5"]]
        if firsts:
            line.append(f"mAP50 > 0.5 from epoch {statistics.mean(firsts):.1f} +- {statistics.pstdev(firsts):.1f}")
        print("  ".join(line))


def main():
    args = parse_args()
    if args.preset in PRESETS and args.sides != ["ours"]:
        raise SystemExit(f"--preset {args.preset} runs our train.py only (--sides ours)")
    path = Path(args.csv or (ROOT / "benchmarks" / "results" / PRESETS[args.preset][1] if args.preset in PRESETS
                             else DEFAULT_CSV))
    if not args.report:
        commit, cpu = args.commit or "working-tree", cpu_name()
        for side in args.sides:
            label = (commit + (f" amp={args.amp}" if args.amp else "")) if side == "ours" else "yolov5-7.0.14"
            for seed in args.seeds:
                if any(r["side"] == side and r["seed"] == str(seed) and r["commit"] == label and r["cpu"] == cpu
                       for r in read_rows(path)):  # another machine's row is another measurement
                    continue
                row = run(side, seed, args)
                append_row(path, {**row, "commit": label, "cpu": cpu,
                                  "date": datetime.now().isoformat(timespec="seconds")})
                print(f"{side} seed {seed}: mAP50 {row['map50']}, mAP50-95 {row['map50_95']}, wall {row['wall_s']} s",
                      flush=True)
    report(read_rows(path))


if __name__ == "__main__":
    main()
