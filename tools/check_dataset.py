"""Verify a dataset without training: per-split counts per reason and every problem file.

    python -m tools.check_dataset --data path/to/data.yaml [--splits train val test] [--no-cache]

Exit code: 0 when every image is usable; 1 when any file is corrupt (or a split has no usable
image or no label files) or the dataset YAML cannot be used; 2 on a bad flag. Errors are one line.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections import Counter

from utils.cli import ArgumentParser, int_in_range
from utils.data.dataset_yaml import SPLITS, load_data_config
from utils.data.verify import SplitLabels, display_sources, summary_line, verify_split
from utils.errors import run_main
from utils.limits import MAX_WORKERS


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = ArgumentParser(prog="python -m tools.check_dataset", description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="dataset YAML (path, or a name in data/)")
    parser.add_argument("--splits", nargs="+", choices=SPLITS, default=list(SPLITS), help="splits to check")
    parser.add_argument("--no-cache", action="store_true", help="verify every file again; read/write no cache")
    parser.add_argument("--cache-dir", default=None, help="fallback folder for label caches (read-only datasets)")
    parser.add_argument("--workers", type=int_in_range(1, MAX_WORKERS), default=None,
                        help="verification threads (default: usable CPUs)")
    return parser.parse_args(argv)


def report_split(name: str, sources: list[str], result: SplitLabels, root: str = "") -> list[str]:
    """Lines describing one split: summary, counts per reason, then each file with a problem."""
    stats = result.stats
    lines = [summary_line(result, f"{name}: ", display_sources(sources)),
             f"  usable images: {stats['images']} ({stats['found']} with labels, "
             f"{stats['missing']} without label file, {stats['empty']} empty label file)"]
    for action, title in (("skipped", "images skipped"), ("repaired", "repaired, image kept"), ("ignored", "ignored")):
        counts = Counter(p["category"] for p in result.problems if p["action"] == action)
        if counts:
            lines.append(f"  {title}:")
            lines += [f"    {count:4d}  {category}" for category, count in sorted(counts.items())]
    if result.problems:
        lines.append("  files:")
        prefix = root.rstrip("/") + "/" if root else ""
        lines += [f"    {m[len(prefix):] if prefix and m.startswith(prefix) else m}" for m in result.messages]
    if stats["label_files"] == 0:
        lines.append("  no label files found (rule: the last /images/ in an image path becomes /labels/, .txt)")
    return lines


def split_failed(result: SplitLabels) -> bool:
    stats = result.stats
    return stats["corrupt"] > 0 or stats["images"] == 0 or stats["label_files"] == 0


def check(args: argparse.Namespace) -> int:
    config = load_data_config(args.data)
    print(f"{config.yaml_file}: {config.nc} classes ({', '.join(config.names)}), root {config.path}")
    failed = False
    for name in args.splits:
        sources = config.split(name)
        if not sources:
            print(f"{name}: not defined in {config.yaml_file.name}, skipped")
            continue
        result = verify_split(sources, config.nc, prefix=f"{name}: ", cache_dir=args.cache_dir,
                              workers=args.workers, use_cache=not args.no_cache)
        print("\n".join(report_split(name, sources, result, str(config.path))))
        failed |= split_failed(result)
    print("result: " + ("problems found (see above)" if failed else "all images usable"))
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    return run_main("tools.check_dataset", _main, argv)


def _main(argv: list[str] | None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(message)s")  # the report below lists every warning
    return check(args)


if __name__ == "__main__":
    sys.exit(main())
