"""Import Pascal VOC XML or COCO JSON annotations into a YOLO dataset folder with a data.yaml.

    python -m tools.import_dataset voc VOC_ROOT_OR_XML_DIR OUT_DIR [--images DIR] [--names a b c]
                                       [--split NAME | --val-fraction 0.1] [--skip-difficult] [--mode copy]
    python -m tools.import_dataset coco ANNOTATIONS.json IMAGES_DIR OUT_DIR [--split val] [--mode copy]

VOC splits come from ImageSets/Main/{train,val,test}.txt when present. For COCO run once per split
(JSON file) into the same OUT_DIR. Exit code 0 on success, 2 on a bad input (one line, no traceback).
"""
from __future__ import annotations

import argparse
import logging
import sys

from utils.data.importers import LINK_MODES, AnnotationError, coco_to_yolo, voc_to_yolo


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m tools.import_dataset", description=__doc__.splitlines()[0])
    formats = parser.add_subparsers(dest="format", required=True)
    voc = formats.add_parser("voc", help="Pascal VOC XML (a VOC root, or a folder of .xml files)")
    voc.add_argument("source", help="VOC root (Annotations/, JPEGImages/, ImageSets/) or folder of XML files")
    voc.add_argument("out_dir", help="output folder (images/<split>, labels/<split>, data.yaml)")
    voc.add_argument("--images", default=None, help="images folder (default: JPEGImages/ or beside the XML)")
    voc.add_argument("--names", nargs="+", default=None, help="class names in order (default: sorted names found)")
    voc.add_argument("--split", default=None, help="put every image in this split (default: ImageSets lists)")
    voc.add_argument("--val-fraction", type=float, default=0.0,
                     help="without split lists: share of images (stable by name) put in val")
    voc.add_argument("--skip-difficult", action="store_true", help="drop objects marked difficult")
    coco = formats.add_parser("coco", help="COCO JSON (one file per split)")
    coco.add_argument("json", help="COCO annotations JSON")
    coco.add_argument("images", help="folder the JSON's file_name entries are relative to")
    coco.add_argument("out_dir", help="output folder (images/<split>, labels/<split>, data.yaml)")
    coco.add_argument("--split", default="train", help="split these images go to (default: train)")
    for sub in (voc, coco):
        sub.add_argument("--mode", choices=LINK_MODES, default="hardlink",
                         help="how images are placed (hardlink falls back to copy across file systems)")
    return parser.parse_args(argv)


def run(args: argparse.Namespace):
    if args.format == "voc":
        if not 0.0 <= args.val_fraction < 1.0:
            raise AnnotationError(f"--val-fraction must be in [0, 1), got {args.val_fraction}")
        return voc_to_yolo(args.source, args.out_dir, images_dir=args.images, names=args.names, split=args.split,
                           val_fraction=args.val_fraction, keep_difficult=not args.skip_difficult, mode=args.mode)
    return coco_to_yolo(args.json, args.images, args.out_dir, split=args.split, mode=args.mode)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s: %(message)s")
    try:
        summary = run(args)
    except AnnotationError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(f"imported {args.format}: {summary.line()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
