"""Issue 49's must-show check: one training run logged to all four trackers, each read back and compared with the
run's results.csv to the digits results.csv prints (needs requirements-trackers.txt).

    python benchmarks/check_trackers_readback.py --data ../shared/datasets/bccd/data.yaml [--imgsz 320] [--epochs 10]
        [--out report.json]

MLflow runs against a real ``mlflow server`` on 127.0.0.1 (SQLite store; the tests' loopback server) and is read back
through its API (``MlflowClient.get_metric_history``); W&B, Comet and ClearML run in their offline modes, their files
in the run folder, and are read back from those files with the tests' readers (tests/test_trackers_offline.py).
Besides every epoch's row it reports what each tracker got of --bbox_interval's val images and, for Comet, the
per-class metrics (COMET_LOG_PER_CLASS_METRICS=true here) and best.pt's confusion matrix. Prints one line per tracker
and, with --out, writes the whole comparison as JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.bench_memory import cpu_name  # noqa: E402
from benchmarks.bench_trackers import tracker_environment  # noqa: E402


def printed(value: float) -> str:
    """A value as results.csv prints it."""
    from utils.loggers import RESULTS_FORMAT

    return format(value, RESULTS_FORMAT)


def compare(rows: dict[int, dict], table: dict, names: dict[str, str]) -> list[str]:
    """Mismatches between a tracker's rows (step -> {its name: value}) and results.csv, at results.csv's digits."""
    wrong = []
    epochs = [int(e) for e in table["epoch"]]
    if sorted(rows) != epochs:
        wrong.append(f"steps {sorted(rows)} against epochs {epochs}")
    for index, epoch in enumerate(epochs):
        for key, name in names.items():
            got = rows.get(epoch, {}).get(name)
            if got is None or printed(float(got)) != printed(float(table[key][index])):
                wrong.append(f"epoch {epoch} {key}: {got} against {table[key][index]}")
    return wrong


def mlflow_rows(uri: str, folder: Path) -> dict[int, dict]:
    from mlflow.tracking import MlflowClient

    from utils.trackers import METRIC_NAMES

    client = MlflowClient(uri)
    (run,) = [run for experiment in client.search_experiments() for run in client.search_runs([experiment.experiment_id])
              if run.data.tags.get("yolo-trainer.run_folder") == str(folder)]
    rows: dict[int, dict] = {}
    for key, names in METRIC_NAMES.items():
        for metric in client.get_metric_history(run.info.run_id, names["mlflow"]):
            rows.setdefault(metric.step, {})[names["mlflow"]] = metric.value
    artifacts = [item.path for item in client.list_artifacts(run.info.run_id, "val_predictions")]
    return rows, {"run": run.info.run_id, "val_predictions": artifacts}


def wandb_rows(folder: Path):
    from tests.test_trackers_offline import history_rows, offline_logs
    from utils.trackers.wandb_tracker import read_records

    (log,) = offline_logs(folder)
    rows = history_rows(read_records(log))
    boxes = {step: row.get("Bounding Box Debugger/Images/count", 0) for step, row in rows.items()}
    return rows, {"log": str(log), "bounding_box_debugger_images": boxes}


def comet_rows(folder: Path):
    from tests.test_trackers_offline import metric_rows, payloads, read_archive

    (archive,) = sorted((folder / "comet").glob("*.zip"))
    _, messages, _ = read_archive(archive)
    rows = metric_rows(messages)
    uploads = payloads(messages, "file_upload")
    per_class = sorted({name for row in rows.values() for name in row if "_mAP@.5" in name})
    plots = ("train_batch", "val_batch", "labels", "results", "confusion_matrix", "P_curve", "R_curve", "PR_curve",
             "F1_curve")
    val_images = [p for p in uploads if p["upload_type"] == "visualization"
                  and not p["additional_params"]["figName"].startswith(plots)]
    steps = [p["additional_params"]["step"] for p in val_images]
    return rows, {"archive": str(archive),
                  "val_images_per_step": {step: steps.count(step) for step in sorted(set(steps))},
                  "val_images_with_boxes": sum("annotations" in p.get("metadata", {}) for p in val_images),
                  "confusion_matrices": [p["additional_params"]["fileName"] for p in uploads
                                         if p["upload_type"] == "confusion-matrix"],
                  "per_class_metrics": per_class}


def clearml_rows(folder: Path):
    from tests.test_trackers_offline import read_session, scalar_rows, sessions

    (session,) = sessions(folder)
    _, events, _ = read_session(session)
    samples = [event["iter"] for event in events
               if event["type"] == "training_debug_image" and event["metric"] == "Bounding Boxes"]
    return scalar_rows(events), {"session": str(session),
                                 "bounding_boxes_samples_per_iteration": {i: samples.count(i) for i in set(samples)}}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", required=True)
    parser.add_argument("--imgsz", type=int, default=320)
    parser.add_argument("--epochs", type=int, default=10)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    import train
    from tests.test_trackers import mlflow_server
    from utils.plots import read_results_csv
    from utils.trackers import METRIC_NAMES

    report = {"machine": cpu_name(), "data": args.data, "imgsz": args.imgsz, "epochs": args.epochs, "trackers": {}}
    with tempfile.TemporaryDirectory() as folder:
        folder = Path(folder)
        tracker_environment(folder, True)
        os.environ["COMET_LOG_PER_CLASS_METRICS"] = "true"
        with mlflow_server(folder / "mlflow") as (uri, _):
            os.environ["MLFLOW_TRACKING_URI"] = uri
            train.run(data=args.data, cfg="models/yolov5n.yaml", weights="", imgsz=args.imgsz, epochs=args.epochs,
                      batch_size=16, workers=2, device="cpu", project=str(folder / "runs"), name="bccd")
            run_folder = folder / "runs" / "bccd"
            table = read_results_csv(run_folder / "results.csv")
            readers = {"mlflow": lambda: mlflow_rows(uri, run_folder), "wandb": lambda: wandb_rows(run_folder),
                       "comet": lambda: comet_rows(run_folder), "clearml": lambda: clearml_rows(run_folder)}
            for tracker, read in readers.items():
                rows, extra = read()
                wrong = compare(rows, table, {key: names[tracker] for key, names in METRIC_NAMES.items()})
                report["trackers"][tracker] = {"epochs": len(rows), "values": len(rows) * len(METRIC_NAMES),
                                               "mismatches": wrong, **extra}
                print(f"{tracker}: {len(rows)} epochs x {len(METRIC_NAMES)} values read back, {len(wrong)} "
                      f"mismatch(es) against results.csv; {json.dumps(extra)[:400]}")
            first = {key: printed(float(table[key][0])) for key in ("train/box_loss", "metrics/mAP_0.5:0.95")}
            report["epoch0"] = first
            print(f"# {report['machine']}; epoch 0 in results.csv: {first}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
