#!/bin/bash
# YOLOv5's v7.0 release weights (yolov5n/s/m/l/x and their P6 '6' variants) into the current folder, as YOLOv5's
# script of this name; python -m tools.download does it (checked, through YOLO_TRAINER_MIRROR when set).
# Example usage: bash data/scripts/download_weights.sh [--dir weights]
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec python -m tools.download --all-weights "$@"
