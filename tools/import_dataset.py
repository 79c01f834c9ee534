"""Import Pascal VOC, COCO JSON, VisDrone, SKU-110K, xView, Argoverse-HD or Objects365 annotations as YOLO labels.

    python -m tools.import_dataset voc VOC_ROOT_OR_XML_DIR OUT_DIR [--images DIR] [--names a b c]
                                       [--split NAME | --val-fraction 0.1] [--skip-difficult] [--mode copy]
    python -m tools.import_dataset coco ANNOTATIONS.json IMAGES_DIR OUT_DIR [--split val] [--mode copy]
    python -m tools.import_dataset visdrone VisDrone2019-DET-train    # annotations/ -> labels/ beside images/
    python -m tools.import_dataset sku110k SKU-110K    # annotations/*.csv -> labels/, train.txt, val.txt, test.txt
    python -m tools.import_dataset xview xView            # xView_train.geojson -> labels/train, autosplit lists
    python -m tools.import_dataset argoverse Argoverse    # Argoverse-HD/annotations -> Argoverse-1.1/labels
    python -m tools.import_dataset objects365 Objects365  # zhiyuan_objv2_*.json -> labels/{train,val}
    python -m tools.import_dataset autosplit images/train [--weights 0.9 0.1 0.0] [--annotated-only]

VOC splits come from ImageSets/Main/{train,val,test}.txt when present. For COCO run once per split
(JSON file) into the same OUT_DIR. A VisDrone DET folder gets its YOLO labels in place, as data/VisDrone.yaml
(YOLOv5's layout) reads them; run it once per split folder. SKU-110K's folder likewise (data/SKU-110K.yaml), and
xView's, Argoverse's and Objects365's as data/xView.yaml, Argoverse.yaml and Objects365.yaml convert them on first
use (utils/data/converters.py). autosplit writes autosplit_{train,val,test}.txt beside the folder, YOLOv5's draw.
Exit code 0 on success, 1 on a bad input file, 2 on a bad flag (one line, no traceback). Annotation entries
naming an image outside the images folder, and XML files with DOCTYPE/ENTITY declarations, are skipped with a
warning.
"""
from __future__ import annotations

import argparse
import logging
import sys

from utils.cli import ArgumentParser, float_in_range
from utils.data import converters
from utils.data.importers import (LINK_MODES, SPLITS, coco_to_yolo, sku110k_to_yolo, visdrone_to_yolo,
                                  voc_to_yolo)
from utils.errors import run_main
from utils.limits import Range


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m tools.import_dataset", description=__doc__.splitlines()[0])
    formats = parser.add_subparsers(dest="format", required=True)
    voc = formats.add_parser("voc", help="Pascal VOC XML (a VOC root, or a folder of .xml files)")
    voc.add_argument("source", help="VOC root (Annotations/, JPEGImages/, ImageSets/) or folder of XML files")
    voc.add_argument("out_dir", help="output folder (images/<split>, labels/<split>, data.yaml)")
    voc.add_argument("--images", default=None, help="images folder (default: JPEGImages/ or beside the XML)")
    voc.add_argument("--names", nargs="+", default=None, help="class names in order (default: sorted names found)")
    voc.add_argument("--split", default=None, choices=SPLITS,
                     help="put every image in this split (default: ImageSets lists)")
    voc.add_argument("--val-fraction", type=float_in_range(Range(0, 1, high_open=True)), default=0.0,
                     help="without split lists: share of images (stable by name) put in val")
    voc.add_argument("--skip-difficult", action="store_true", help="drop objects marked difficult")
    coco = formats.add_parser("coco", help="COCO JSON (one file per split)")
    coco.add_argument("json", help="COCO annotations JSON")
    coco.add_argument("images", help="folder the JSON's file_name entries are relative to")
    coco.add_argument("out_dir", help="output folder (images/<split>, labels/<split>, data.yaml)")
    coco.add_argument("--split", default="train", choices=SPLITS, help="split these images go to (default: train)")
    visdrone = formats.add_parser("visdrone", help="VisDrone DET text annotations (labels written in place)")
    visdrone.add_argument("folder", help="a VisDrone DET folder (annotations/, images/): labels/ written beside")
    sku = formats.add_parser("sku110k", help="SKU-110K CSV annotations (labels and split lists written in place)")
    sku.add_argument("folder", help="the SKU-110K folder (annotations/, images/)")
    for kind, text in (("xview", "xView as downloaded (train_images/, xView_train.geojson)"),
                       ("argoverse", "Argoverse-HD as downloaded (Argoverse-1.1/tracking/, Argoverse-HD/annotations/)"),
                       ("objects365", "Objects365 as unpacked (zhiyuan_objv2_*.json, images/{train,val}/)")):
        formats.add_parser(kind, help=f"{text}: converted in place").add_argument("folder", help="the dataset folder")
    split = formats.add_parser("autosplit", help="a folder of images -> autosplit_{train,val,test}.txt beside it")
    split.add_argument("folder", help="the images (at any depth below it)")
    split.add_argument("--weights", nargs=3, type=float_in_range(Range(0, 1)), default=[0.9, 0.1, 0.0],
                       metavar=("TRAIN", "VAL", "TEST"), help="share of each list (default: 0.9 0.1 0.0)")
    split.add_argument("--annotated-only", action="store_true", help="leave out images without a label file")
    for sub in (voc, coco):
        sub.add_argument("--mode", choices=LINK_MODES, default="hardlink",
                         help="how images are placed (hardlink falls back to copy across file systems)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace):
    if args.format == "voc":
        return voc_to_yolo(args.source, args.out_dir, images_dir=args.images, names=args.names, split=args.split,
                           val_fraction=args.val_fraction, keep_difficult=not args.skip_difficult, mode=args.mode)
    if args.format == "visdrone":
        return visdrone_to_yolo(args.folder)
    if args.format == "sku110k":
        return sku110k_to_yolo(args.folder)
    if args.format in ("xview", "argoverse"):
        return getattr(converters, f"{args.format}_to_yolo")(args.folder)
    if args.format == "objects365":
        return converters.objects365_to_yolo(args.folder)
    return coco_to_yolo(args.json, args.images, args.out_dir, split=args.split, mode=args.mode)


def main(argv: list[str] | None = None) -> int:
    return run_main("tools.import_dataset", _main, argv)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    if args.format == "autosplit":
        counts = converters.autosplit(args.folder, tuple(args.weights), args.annotated_only)
        print(f"autosplit {args.folder}: " + (", ".join(f"{name} {count}" for name, count in counts.items())
                                               or "no images"))
        return 0
    summary = run(args)
    print(f"imported {args.format}: {summary.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
