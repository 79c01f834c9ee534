"""Training: ``train(config, hyp, device, resume)`` coordinates (trainer.py); loop.py runs epochs and steps."""
from utils.trainer.trainer import TrainingInterrupted, TrainResult, setup_process, train

__all__ = ["TrainResult", "TrainingInterrupted", "setup_process", "train"]
