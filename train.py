"""Train a YOLOv5-style detector on a YOLO-format dataset.

Usage:
    python train.py                                            # embedded default dataset, yolov5n, CPU/GPU auto
    python train.py --data data.yaml --cfg models/yolov5s.yaml --weights '' --img 640 --device 0
    python train.py --data data.yaml --weights yolov5s.pt      # fine-tune from our or YOLOv5's weights
    torchrun --nproc_per_node 4 train.py --data data.yaml --device 0,1,2,3
"""
from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

LOGGER = logging.getLogger("train")

NOT_AVAILABLE_YET = {
    "resume": "--resume is not available yet (exact resume from last.pt comes with the resume work)",
    "evolve": "--evolve is not available yet (hyperparameter evolution comes with the evolution work)",
    "sync_bn": "--sync-bn is not available yet (it comes with multi-GPU DDP training)",
}


def parse_args(argv=None) -> argparse.Namespace:
    from utils.cli import add_device_flag, add_run_folder_flags

    parser = argparse.ArgumentParser(description="Train a YOLOv5-style detector")
    parser.add_argument("--weights", type=str, default="", help="initial weights path ('' to train from --cfg)")
    parser.add_argument("--cfg", type=str, default="", help="model YAML, e.g. models/yolov5n.yaml")
    parser.add_argument("--data", type=str, default="", help="dataset YAML ('' = the embedded default dataset)")
    parser.add_argument("--hyp", type=str, default="data/hyps/hyp.scratch-low.yaml", help="hyperparameters path")
    parser.add_argument("--epochs", type=int, default=100, help="total training epochs")
    parser.add_argument("--batch-size", type=int, default=16, help="total batch size over all processes")
    parser.add_argument("--imgsz", "--img", "--img-size", type=int, default=640, help="train, val image size (pixels)")
    parser.add_argument("--rect", action="store_true", help="rectangular training")
    parser.add_argument("--resume", nargs="?", const=True, default=False, help="resume most recent training")
    parser.add_argument("--nosave", action="store_true", help="only save final checkpoint")
    parser.add_argument("--noval", action="store_true", help="only validate final epoch")
    parser.add_argument("--noautoanchor", action="store_true", help="disable AutoAnchor")
    parser.add_argument("--noplots", action="store_true", help="save no plot files")
    parser.add_argument("--evolve", type=int, nargs="?", const=300, help="evolve hyperparameters for x generations")
    parser.add_argument("--cache", type=str, nargs="?", const="ram", default="auto",
                        choices=("ram", "disk", "auto", "off"),
                        help="cache images in 'ram' (the flag alone) or 'disk'; default 'auto': RAM for small datasets")
    parser.add_argument("--image-weights", action="store_true", help="use weighted image selection for training")
    add_device_flag(parser)
    parser.add_argument("--multi-scale", action="store_true", help="vary img-size +/- 50%%")
    parser.add_argument("--single-cls", action="store_true", help="train multi-class data as single-class")
    parser.add_argument("--optimizer", type=str, choices=["SGD", "Adam", "AdamW"], default="SGD", help="optimizer")
    parser.add_argument("--sync-bn", action="store_true", help="use SyncBatchNorm, only available in DDP mode")
    parser.add_argument("--workers", type=int, default=8, help="max dataloader workers (per process in DDP mode)")
    add_run_folder_flags(parser, "runs/train")
    parser.add_argument("--quad", action="store_true", help="quad dataloader (accepted; not used)")
    parser.add_argument("--cos-lr", action="store_true", help="cosine LR scheduler")
    parser.add_argument("--label-smoothing", type=float, default=0.0, help="label smoothing epsilon")
    parser.add_argument("--patience", type=int, default=100, help="EarlyStopping patience (epochs without improvement)")
    parser.add_argument("--freeze", nargs="+", type=int, default=[0], help="freeze layers: backbone=10, first3=0 1 2")
    parser.add_argument("--save-period", type=int, default=-1, help="save checkpoint every x epochs (disabled if < 1)")
    parser.add_argument("--seed", type=int, default=0, help="global training seed")
    parser.add_argument("--local_rank", "--local-rank", type=int, default=-1, help="ignored: torchrun sets LOCAL_RANK")
    parser.add_argument("--deterministic", action="store_true", help="deterministic algorithms (slower)")
    parser.add_argument("--amp", default="auto", choices=("auto", "fp16", "bf16", "off"),
                        help="mixed precision: auto = fp16 on CUDA (after a self-check), fp32 on CPU; bf16 on request")
    parser.add_argument("--channels-last", default="auto", choices=("auto", "on", "off"),
                        help="channels_last memory format for conv weights and inputs")
    return parser.parse_args(argv)


def config_from_args(args: argparse.Namespace):
    from utils.config import TrainConfig

    values = vars(args).copy()
    return TrainConfig.from_dict(values)


def main(argv=None) -> int:
    args = parse_args(argv)
    from utils.loggers import setup_logging
    from utils.memory import keep_freed_memory

    setup_logging()
    keep_freed_memory()  # whole-process choice: see utils/memory.py
    for flag, message in NOT_AVAILABLE_YET.items():
        if getattr(args, flag):
            print(f"train.py: error: {message}", file=sys.stderr)
            return 2
    try:
        return run(config_from_args(args))
    except KeyboardInterrupt:
        print("train.py: interrupted", file=sys.stderr)
        return 130


def run(config) -> int:
    from utils import dist
    from utils.checkpoint import CheckpointError
    from utils.config import ConfigError, Hyp
    from utils.data.dataset_yaml import DataConfigError
    from utils.data.verify import DatasetError
    from utils.device import DeviceError, select_device
    from utils.paths import increment_path
    from utils.trainer import train

    user_errors = (ConfigError, CheckpointError, DataConfigError, DatasetError, DeviceError, FileNotFoundError)
    try:
        if not config.cfg and not config.weights:
            config.cfg = "models/yolov5n.yaml" if (ROOT / "models/yolov5n.yaml").exists() else ""
        if config.cfg and not Path(config.cfg).exists() and (ROOT / config.cfg).exists():
            config.cfg = str(ROOT / config.cfg)
        hyp = Hyp.load(config.hyp)
        device = select_device(config.device, dist.dist_info().local_rank)
        dist.init_distributed(device)
        save_dir = None
        if dist.is_main_process():
            save_dir = str(increment_path(Path(config.project) / config.name, exist_ok=config.exist_ok, mkdir=True))
        config.save_dir = dist.broadcast_object(save_dir)
        train(config, hyp)
    except user_errors as e:
        print(f"train.py: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
