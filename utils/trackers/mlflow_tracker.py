"""MLflow: on when the ``mlflow`` package is installed and MLFLOW_TRACKING_URI is set (ultralytics also logs to a local
./mlruns store when it is unset; this project never logs anywhere the user did not name). Talks to the server through
``MlflowClient`` only: no fluent-API globals, no autologging, and none of the fluent API's source, git or environment
tags. The package is imported when a run starts, in the trackers' worker thread."""
from __future__ import annotations

import os
import time
from pathlib import Path

from utils.trackers.core import METRIC_NAMES, REDACTED, URL_USERINFO, RunStart, Tracker

PARAMS_PER_CALL = 100        # MLflow's limit of params in one log_batch
PARAM_VALUE_LIMIT = 6000     # MLflow's longest param value (MAX_PARAM_VAL_LENGTH)
EPOCH_METRIC = METRIC_NAMES["train/box_loss"]["mlflow"]  # logged every epoch: its last step is the last epoch logged


def shown_uri(uri: str) -> str:
    """A tracking URI as it may be printed (a URL's user and password hidden)."""
    return URL_USERINFO.sub(lambda match: f"{match['scheme']}{REDACTED}@", uri)


class MlflowTracker(Tracker):
    name, label, package = "mlflow", "MLflow", "mlflow"

    @classmethod
    def decide(cls) -> tuple[bool, str]:
        uri = os.environ.get("MLFLOW_TRACKING_URI", "")
        if not uri:
            return False, "MLFLOW_TRACKING_URI is not set: this project logs to no MLflow store unasked"
        return True, f"MLFLOW_TRACKING_URI={shown_uri(uri)}"

    def __init__(self):
        super().__init__()
        self.client = None
        self.experiment_id = ""
        self.resumed_from = ""  # a resumed checkpoint's run id this server lacks (tagged on the new run)

    def start(self, run: RunStart) -> None:
        from mlflow.tracking import MlflowClient

        uri = os.environ["MLFLOW_TRACKING_URI"]
        self.client = MlflowClient(tracking_uri=uri)
        if not (run.resume_id and self._continue(run.resume_id)):
            self._create(run)
        for row in run.rows:
            self.log_epoch(int(row["epoch"]), {key: value for key, value in row.items() if key != "epoch"})
        if uri.startswith(("http://", "https://")):
            self.url = f"{shown_uri(uri).rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"
        else:
            self.url = f"run {self.run_id} in {shown_uri(uri)}"

    def _continue(self, run_id: str) -> bool:
        """Continue the run a resumed checkpoint names; False (one line said) when this server does not have it."""
        from mlflow.exceptions import MlflowException

        try:
            found = self.client.get_run(run_id)
        except MlflowException as error:
            if error.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            found = None
        if found is None or found.info.lifecycle_stage == "deleted":
            self.note = f"run {run_id} of the resumed checkpoint is not on this server, a new run: "
            self.resumed_from = run_id
            return False
        self.run_id, self.experiment_id = run_id, found.info.experiment_id
        self.client.update_run(run_id, status="RUNNING")
        steps = [metric.step for metric in self.client.get_metric_history(run_id, EPOCH_METRIC)]
        self.logged_through = max(steps, default=-1)
        self.note = "continuing its run: "
        return True

    def _create(self, run: RunStart) -> None:
        from mlflow.entities import Param

        name = os.environ.get("MLFLOW_EXPERIMENT_NAME") or run.experiment
        experiment = self.client.get_experiment_by_name(name)
        self.experiment_id = experiment.experiment_id if experiment else self._create_experiment(name)
        tags = {"yolo-trainer.run_folder": str(run.save_dir)}
        if self.resumed_from:
            tags["yolo-trainer.resumed_from"] = self.resumed_from
        if run.group:  # --evolve: each generation a child of the evolution's parent run
            tags.update({"yolo-trainer.evolution": run.group, "mlflow.parentRunId": self._parent(run.group)})
        created = self.client.create_run(self.experiment_id, run_name=run.run_name, tags=tags)
        self.run_id = created.info.run_id
        params = [Param(key, _param_text(value)) for key, value in run.params.items()]
        for first in range(0, len(params), PARAMS_PER_CALL):
            self.client.log_batch(self.run_id, params=params[first:first + PARAMS_PER_CALL], synchronous=True)

    def _parent(self, group: str) -> str:
        """The id of the evolution ``group``'s parent run in this experiment, made by its first generation."""
        quoted = group.replace("\\", "\\\\").replace("'", "\\'")
        found = self.client.search_runs([self.experiment_id], f"tags.`yolo-trainer.evolution_parent` = '{quoted}'",
                                        max_results=1)
        if found:
            return found[0].info.run_id
        parent = self.client.create_run(self.experiment_id, run_name=group,
                                        tags={"yolo-trainer.evolution_parent": group})
        self.client.set_terminated(parent.info.run_id, "FINISHED")
        return parent.info.run_id

    def _create_experiment(self, name: str) -> str:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.create_experiment(name)
        except MlflowException as error:  # created meanwhile by another process
            if error.error_code != "RESOURCE_ALREADY_EXISTS":
                raise
            return self.client.get_experiment_by_name(name).experiment_id

    def log_epoch(self, epoch: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        if epoch <= self.logged_through:
            return
        stamp = int(time.time() * 1000)
        metrics = [Metric(METRIC_NAMES[key]["mlflow"], float(value), stamp, epoch)
                   for key, value in values.items() if key in METRIC_NAMES]
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)
        self.logged_through = epoch

    def log_files(self, paths: list[Path], folder: str) -> None:
        for path in paths:
            if path.is_file():
                self.client.log_artifact(self.run_id, str(path), artifact_path=folder or None)

    def finish(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "KILLED")


def _param_text(value) -> str:
    text = str(value)
    return text if len(text) <= PARAM_VALUE_LIMIT else text[:PARAM_VALUE_LIMIT - 3] + "..."

