#!/bin/bash
# COCO 2017 (box labels; train, val and test images) into ../datasets beside this repository, as YOLOv5's script of this
# name: python -m tools.download follows data/coco.yaml's download: (archives checked and unpacked safely; a
# restart goes on where it stopped; YOLO_TRAINER_MIRROR takes them from elsewhere).
# Example usage: bash data/scripts/get_coco.sh
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}" exec python -m tools.download coco.yaml "$@"
