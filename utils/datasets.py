"""YOLOv5 v6.1's and earlier name of utils/dataloaders.py (``from utils.datasets import LoadImages, letterbox``, also
``create_dataloader``), for scripts written against those versions (docs/yolov5-scripts.md)."""
from utils.augmentations import letterbox  # noqa: F401
from utils.dataloaders import (IMG_FORMATS, VID_FORMATS, LoadImages, LoadImagesAndLabels,  # noqa: F401
                               create_dataloader, img2label_paths)
