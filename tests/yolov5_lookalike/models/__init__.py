"""Look-alikes of ultralytics/yolov5 v7's ``models`` package, for writing YOLOv5-format checkpoints in tests.

Only ``tests/yolov5_lookalike/write_checkpoint.py`` imports this package, in a subprocess whose first
``sys.path`` entry is ``tests/yolov5_lookalike``, so ``models`` here shadows the project's package and
pickled objects carry YOLOv5's module paths (``models.yolo.DetectionModel``, ``models.common.Conv``, ...).
The classes are written from YOLOv5's documented architecture (module and attribute names, layer
arithmetic), not from its source.
"""
