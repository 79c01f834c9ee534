"""Checkpoints: the one save/load pair, the only place that knows their key layout, and their validation.

Our files are plain data (torch.load(weights_only=True)):

    {"format": "yolo-trainer/1",
     "model": {"yaml": dict, "state_dict": {name: tensor}, "names": [str], "stride": [float]},
     "ema": same shape as "model", or None,
     "epoch": last finished epoch, "best_fitness": float, "config": dict, "hyp": dict, "date": str,
     "training": {"version": 1, "optimizer", "scaler", "scheduler": state dicts, "ema_updates": int,
                  "run": RunState dict (utils.trainer.state), "rng": [generator states per process]}
                 -- only while a run is in progress (last.pt, best.pt, epoch*.pt),
     "finished": True -- a finished run's stripped last.pt / best.pt (EMA weights in fp16, no "training")}

- store.py: save (atomic, through utils.files; last.pt keeps the previous file as last.prev.pt), load (any
  supported file: ours, or YOLOv5's converted by utils.yolov5_import, after the pickle checks of
  utils.pickle_scan), load_resumable (falls back to last.prev.pt), strip, the layout's accessors.
- checks.py: the one validation of a resumable checkpoint (``training_state`` runs ``check_training`` on the file
  before anything is built; the trainer runs ``check_against_run`` once the model and optimizer exist).
"""
from utils.checkpoint.store import (FORMAT, TRAINING_VERSION, CheckpointError, TrainingState, class_names,
                                    copy_checkpoint, is_finished, load_checkpoint, load_resumable, model_entry,
                                    model_state, pickle_globals, previous_path, save_checkpoint, strip_checkpoint,
                                    training_checkpoint, training_state)

__all__ = ["FORMAT", "TRAINING_VERSION", "CheckpointError", "TrainingState", "class_names", "copy_checkpoint",
           "is_finished", "load_checkpoint", "load_resumable", "model_entry", "model_state", "pickle_globals",
           "previous_path", "save_checkpoint", "strip_checkpoint", "training_checkpoint", "training_state"]
