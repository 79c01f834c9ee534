"""Train a YOLOv5-style detector on a YOLO-format dataset.

Usage:
    python train.py                                            # embedded default dataset, yolov5n, CPU/GPU auto
    python train.py --data data.yaml --cfg models/yolov5s.yaml --weights '' --img 640 --device 0
    python train.py --data data.yaml --weights yolov5s.pt      # fine-tune from our or YOLOv5's weights
    python train.py --resume                                   # continue the newest run under runs/train
    torchrun --nproc_per_node 4 train.py --data data.yaml --device 0,1,2,3

From Python, ``train.run(data="data.yaml", epochs=10, imgsz=320)`` takes the same flags as keywords and returns
the run folder, best.pt / last.pt and the final metrics (``run``). YOLOv5's forms work too:
``opt = train.parse_opt(); opt.epochs = 10; train.main(opt, callbacks)`` (``callbacks``: utils.callbacks.Callbacks).
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


def build_parser() -> argparse.ArgumentParser:
    """train.py's flags, YOLOv5's names and defaults, in the order --help lists them. Every bound a ``type=`` checks
    is also applied to a resumed checkpoint's options (TrainConfig)."""
    from utils.cli import ArgumentParser

    parser = ArgumentParser(prog="train.py", description="Train a YOLOv5-style detector")
    for add in (_what_and_how_long, _outputs, _evolution, _data_pipeline, _device_and_speed, _training_options):
        add(parser)
    return parser


def _what_and_how_long(parser) -> None:
    """The weights, model, data and hyperparameters to train, for how long and in what batches."""
    from utils import cli
    from utils.cli import image_size, positive_int, train_batch_size
    from utils.config import TIME_HOURS

    parser.add_argument("--weights", type=str, default=None,
                        help="initial weights: a path, a URL or a YOLOv5 release name (default: yolov5s.pt when "
                             "--data is given, fetched if missing, as YOLOv5; '' trains from --cfg)")
    parser.add_argument("--cfg", type=str, default="", help="model YAML, e.g. models/yolov5n.yaml")
    parser.add_argument("--data", type=str, default="", help="dataset YAML ('' = the embedded default dataset)")
    parser.add_argument("--hyp", type=str, default="data/hyps/hyp.scratch-low.yaml", help="hyperparameters path")
    parser.add_argument("--epochs", type=positive_int, default=None,
                        help=f"total training epochs (default {DEFAULT_EPOCHS}; with --time, as many as fit, "
                             f"at most the --epochs given)")
    parser.add_argument("--time", type=TIME_HOURS, default=None, metavar="HOURS",
                        help="training time budget in hours, as ultralytics' time=: after the first epoch the epoch "
                             "count becomes what fits (at most --epochs when given; with --evolve: per generation)")
    parser.add_argument("--batch-size", type=train_batch_size, default=16,
                        help="total batch size over all processes, -1 for AutoBatch (CUDA)")
    parser.add_argument("--nbs", type=cli.nominal_batch, default=64,
                        help="nominal batch size: gradients are accumulated over about this many images per "
                             "optimizer step and weight decay is scaled to it (YOLOv5: always 64)")
    parser.add_argument("--imgsz", "--img", "--img-size", type=image_size, default=640, help="train, val image size (pixels)")
    parser.add_argument("--rect", action="store_true", help="rectangular training")
    parser.add_argument("--resume", nargs="?", const=True, default=False,
                        help="resume the newest run under --project, or the given last.pt / run folder")


def _outputs(parser) -> None:
    """What a run does and writes besides training: saving, validation, AutoAnchor, plots, TensorBoard, JSON lines,
    trackers."""
    from utils.cli import add_tracker_flags

    parser.add_argument("--nosave", action="store_true", help="only save final checkpoint")
    parser.add_argument("--noval", action="store_true", help="only validate final epoch")
    parser.add_argument("--noautoanchor", action="store_true", help="disable AutoAnchor")
    parser.add_argument("--noplots", action="store_true", help="save no plot files")
    parser.add_argument("--no-tensorboard", dest="tensorboard", action="store_false",
                        help="write no TensorBoard event files (on by default; YOLOv5 has no such switch)")
    parser.add_argument("--ndjson-console", action="store_true",
                        help="print each epoch's results.csv row as a JSON line on stdout (YOLOv5's flag)")
    parser.add_argument("--ndjson-file", action="store_true",
                        help="append each epoch's results.csv row as a JSON line to results.ndjson (YOLOv5's flag)")
    add_tracker_flags(parser)


def _evolution(parser) -> None:
    """--evolve, and YOLOv5's later evolution flags that are refused."""
    from utils.cli import positive_int

    parser.add_argument("--evolve", type=positive_int, nargs="?", const=300, help="evolve hyperparameters for x generations")
    parser.add_argument("--evolve-space", type=str, default="data/hyps/evolve-space.yaml",
                        help="--evolve search space: which hyperparameters evolve, with their bounds")
    parser.add_argument("--evolve_population", "--evolve-population", default=None, metavar="FOLDER",
                        help="refused: the starting population of the genetic --evolve YOLOv5 adopted after v7.0 "
                             "(here --evolve evolves as v7.0 does, from evolve.csv)")
    parser.add_argument("--resume_evolve", "--resume-evolve", default=None, metavar="YAML",
                        help="refused: YOLOv5's genetic --evolve after v7.0 resumes from a generation's YAML; here "
                             "running --evolve again in the same folder goes on from its evolve.csv")
    parser.add_argument("--bucket", type=str, default="",
                        help="refused unless '': YOLOv5 syncs evolve.csv with this Google Cloud Storage bucket through "
                             "gsutil; this project runs no external commands")


def _data_pipeline(parser) -> None:
    """Caching, sampling and where the augmentation's pixel work runs."""
    from utils import cli

    parser.add_argument("--cache", type=str, nargs="?", const="ram", default="auto",
                        choices=cli.CACHE_MODES,
                        help="cache images in 'ram' (the flag alone) or 'disk'; default 'auto': RAM when memory is to spare")
    parser.add_argument("--image-weights", action="store_true", help="use weighted image selection for training")
    parser.add_argument("--mosaic-partners", default="dataset", choices=cli.MOSAIC_PARTNERS,
                        help="where a mosaic's other 3 images come from: the whole dataset (default, YOLOv5's way: "
                             "~3.6 decodes per image) or 'batch': 3 other images of the same batch, each decoded once "
                             "per batch (for uncached, decode-bound data; saves nothing with --cache ram). 'batch' "
                             "changes the augmentation: small batches reuse the same few images in every mosaic, "
                             "and under torchrun the batch is each process's share (16 x 4 is not 1 x 64)")
    parser.add_argument("--augment-device", action="store_true",
                        help="augment on the training device: the loader workers draw and place (the same draws), "
                             "the pixel work (mosaic canvas, warp, HSV, flips) runs batched with torch on --device "
                             "(docs/device-augmentation.md)")
    parser.add_argument("--decode-device", action="store_true",
                        help="with --augment-device: the training device also decodes the JPEG images that are not "
                             "cached (torchvision's nvJPEG on CUDA, one batched call a batch), the workers only read "
                             "the files (docs/device-augmentation.md)")


def _device_and_speed(parser) -> None:
    """--device and the opt-in ways to a faster CUDA step."""
    from utils.cli import add_device_flag

    add_device_flag(parser)
    parser.add_argument("--cuda-graphs", action="store_true",
                        help="CUDA: replay the model's forward and backward as CUDA graphs, captured for the first "
                             "full batch's shape (other shapes run eagerly; not under DDP); for GPUs that wait for "
                             "the host's kernel launches (utils/trainer/cuda_graphs.py)")
    parser.add_argument("--compile", action="store_true",
                        help="CUDA: compile the model's forward and backward with torch.compile (fused kernels; the "
                             "first step compiles, a minute or more; not with --sync-bn; utils/trainer/compiled.py)")


def _training_options(parser) -> None:
    """The rest of YOLOv5's training flags: schedule, optimizer, run folder, freezing, saving, seeds, precision."""
    from utils import cli
    from utils.cli import add_run_folder_flags, non_negative_int, workers

    parser.add_argument("--multi-scale", action="store_true", help="vary img-size +/- 50%%")
    parser.add_argument("--single-cls", action="store_true", help="train multi-class data as single-class")
    parser.add_argument("--optimizer", type=str, choices=cli.OPTIMIZER_NAMES, default="SGD", help="optimizer")
    parser.add_argument("--sync-bn", action="store_true", help="use SyncBatchNorm, only available in DDP mode")
    parser.add_argument("--workers", type=workers, default=8, help="max dataloader workers (per process in DDP mode)")
    add_run_folder_flags(parser, "runs/train")
    parser.add_argument("--quad", action="store_true",
                        help="quad dataloader: each 4 images train as one of twice the side (YOLOv5's collate_fn4)")
    parser.add_argument("--cos-lr", action="store_true", help="cosine LR scheduler")
    parser.add_argument("--label-smoothing", type=cli.label_smoothing, default=0.0, help="label smoothing epsilon")
    parser.add_argument("--patience", type=non_negative_int, default=100, help="EarlyStopping patience (epochs without improvement)")
    parser.add_argument("--freeze", nargs="+", type=cli.freeze_layer, default=[0], help="freeze layers: backbone=10, first3=0 1 2")
    parser.add_argument("--save-period", type=cli.save_period, default=-1, help="save checkpoint every x epochs (disabled if < 1)")
    parser.add_argument("--save-every-min", type=cli.save_every_min, default=10.0,
                        help="also save last.pt inside long epochs every x minutes of training (0: only at epoch ends)")
    parser.add_argument("--seed", type=non_negative_int, default=0, help="global training seed")
    parser.add_argument("--local_rank", "--local-rank", type=cli.local_rank, default=-1, help="ignored: torchrun sets LOCAL_RANK")
    parser.add_argument("--deterministic", action="store_true", help="deterministic algorithms (slower)")
    parser.add_argument("--amp", default="auto", choices=cli.TRAIN_AMP_MODES,
                        help="mixed precision: auto = fp16 on CUDA (after a self-check), bf16 on CPUs with AMX or AVX512-BF16, else fp32")
    parser.add_argument("--channels-last", default="auto", choices=cli.CHANNELS_LAST_MODES,
                        help="channels_last memory format for conv weights and inputs")

DEFAULT_EPOCHS = 100
DEFAULT_WEIGHTS = "yolov5s.pt"  # --data without --weights fine-tunes it (fetched from YOLOv5's v7.0 release if missing)
TIME_MAX_EPOCHS = 100_000  # --time without --epochs: the budget alone decides (ultralytics' time= overrides epochs)


def parse_args(argv=None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    if args.epochs is None:
        args.epochs = TIME_MAX_EPOCHS if args.time else DEFAULT_EPOCHS
    return args


def parse_opt(known: bool = False) -> argparse.Namespace:
    """YOLOv5's: the options from the command line (``known``: unknown arguments ignored), to change and pass to
    ``main(opt, callbacks)``."""
    if not known:
        return parse_args()
    args = build_parser().parse_known_args()[0]
    if args.epochs is None:
        args.epochs = TIME_MAX_EPOCHS if args.time else DEFAULT_EPOCHS
    return args


def explicit_options(argv=None) -> dict:
    """The options given on the command line (dest -> value), defaults left out: --resume compares them with
    the resumed run's options."""
    parser = build_parser()
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return vars(parser.parse_args(argv))


def config_from_args(args: argparse.Namespace):
    from utils.config import TrainConfig

    values = vars(args).copy()
    if values.get("weights") is None:  # YOLOv5's default: fine-tune yolov5s.pt; the embedded quick start: scratch
        values["weights"] = DEFAULT_WEIGHTS if values.get("data") else ""
    return TrainConfig.from_dict(values)


def main(argv=None, callbacks=None):
    """The command line's entry (``argv``: its arguments, None for sys.argv's): returns the exit code. YOLOv5's
    ``main(opt, callbacks)``, ``opt`` a Namespace from ``parse_opt``: trains as ``run`` does with the options that
    differ from the defaults, and returns run's TrainResult (its errors raised, as run's)."""
    if isinstance(argv, argparse.Namespace):
        defaults = vars(parse_args([]))
        options = {key: value for key, value in vars(argv).items() if key not in defaults or value != defaults[key]}
        return run(**options, callbacks=callbacks)
    if callbacks is not None:
        from utils.errors import ArgumentError

        raise ArgumentError("train.main(argv, callbacks): callbacks go with main(opt, callbacks) or train.run")
    from utils.errors import run_main

    return run_main("train.py", _main, argv)


def _main(argv) -> int:
    args = parse_args(argv)
    from utils.loggers import setup_logging
    from utils.memory import keep_freed_memory

    setup_logging(stream=sys.stderr if args.ndjson_console else None)  # stdout: the JSON lines alone
    keep_freed_memory()  # whole-process choice: see utils/memory.py
    problem = launch_problem(args, argv)
    if problem:
        from utils.errors import ArgumentError

        raise ArgumentError(problem)
    if args.evolve:
        return run_evolution(config_from_args(args), args.evolve_space)
    return _train_cli(config_from_args(args), explicit_options(argv))


def launch_problem(args: argparse.Namespace, argv=None) -> str | None:
    """Flags that need torchrun, or that torchrun cannot take, or that need another flag: the one-line reason, else
    None."""
    from utils import dist

    distributed = dist.dist_info().distributed
    gpus = [d for d in str(args.device).replace("cuda:", "").split(",") if d.strip()]
    if len(gpus) > 1 and not distributed:
        given = " ".join(sys.argv[1:] if argv is None else argv)
        return (f"--device {args.device} names {len(gpus)} GPUs: one process per GPU is started by torchrun: "
                f"torchrun --nproc_per_node {len(gpus)} train.py {given}")
    if args.evolve and distributed:
        return "--evolve trains one model at a time per process: run one 'python train.py --evolve --device i' per GPU"
    if args.decode_device and not args.augment_device and not args.resume:
        return "--decode-device decodes the images for --augment-device's rendering on the device: add --augment-device"
    if args.compile and args.cuda_graphs:
        return "--compile and --cuda-graphs are not combined (each runs the model's forward its own way): choose one"
    return refused_yolov5_option(args)


def refused_yolov5_option(args: argparse.Namespace) -> str | None:
    """YOLOv5's flags for what this project does another way: the one-line reason and what to do instead."""
    if args.bucket:
        return (f"--bucket {args.bucket}: YOLOv5 copies evolve.csv from and to a Google Cloud Storage bucket with gsutil; "
                f"this project runs no external commands: copy the bucket's evolve.csv into the evolution folder "
                f"(runs/evolve/exp/evolve.csv, or --project/--name) and run --evolve there")
    if args.evolve_population is not None or args.resume_evolve is not None:
        flag = "--evolve_population" if args.evolve_population is not None else "--resume_evolve"
        return (f"{flag} belongs to the genetic --evolve YOLOv5 adopted after v7.0; --evolve here evolves as v7.0 does, "
                f"mutating the best rows of evolve.csv: to go on with an evolution, run --evolve again with the "
                f"same --project/--name")
    return None


def run(callbacks=None, **options):
    """Python API: ``train.run(data="data.yaml", weights="yolov5s.pt", epochs=10, batch_size=16, imgsz=320)``.

    Keywords are train.py's flags with underscores for dashes, with the same defaults and checks (a bad value or
    an unknown keyword raises ArgumentError with the command line's one-line message; a bad file a UserError).
    Returns the ``TrainResult``: save_dir, best and last (paths), final_metrics (best.pt's metrics/precision,
    metrics/recall, metrics/mAP_0.5, metrics/mAP_0.5:0.95), last_row (the final results.csv row), epochs_run.
    With ``evolve``, its save_dir is the evolution folder. A signal (Ctrl-C) saves last.pt as on the command line,
    then raises TrainingInterrupted; resuming a finished run raises RunFinished, whose message says so.
    ``callbacks``: YOLOv5's hooks (utils.callbacks.Callbacks) for this run; its ``stop_training`` ends the run at
    an optimizer step, resumable, and run then returns without final_metrics.
    """
    from utils.api import api_call, keyword_argv
    from utils.errors import ArgumentError

    argv = keyword_argv(build_parser(), options)
    args = parse_args(argv)
    problem = launch_problem(args, argv)
    if problem:
        raise ArgumentError(problem)
    if callbacks is not None and args.evolve:
        raise ArgumentError("callbacks go with one training run, not evolve (YOLOv5's evolution does not call them)")
    with api_call(trains=True):  # freed memory kept while it trains, not after (utils/memory.py)
        if args.evolve:
            return _evolve_result(config_from_args(args), args.evolve_space)
        return _train(config_from_args(args), explicit_options(argv), callbacks)


def _evolve_result(config, space_path: str):
    """train.run(evolve=N): run_evolution, its stop by a signal raised, its folder returned as a TrainResult."""
    from utils.trainer import TrainingInterrupted, TrainResult

    code = run_evolution(config, space_path)
    if code:
        raise TrainingInterrupted("evolution stopped by a signal; call train.run again to continue it", code)
    project = Path("runs/evolve") if config.project == "runs/train" else Path(config.project)  # as run_evolution
    return TrainResult(save_dir=project / config.name, best=None, last=None)


def _train_cli(config, explicit: dict) -> int:
    """The command line's training: ``_train`` with its errors and stops said in one line, as exit codes."""
    from utils import dist
    from utils.errors import UserError, one_line
    from utils.trainer import TrainingInterrupted
    from utils.trainer.resume import RunFinished

    try:
        _train(config, explicit)
    except UserError as error:
        if dist.is_main_process() or not isinstance(error, dist.SharedError):  # said once, not once per process
            rank = "" if dist.is_main_process() else f"[rank {dist.dist_info().rank}] "
            print(f"{rank}train.py: error: {one_line(error)}", file=sys.stderr)
        return error.exit_code
    except RunFinished as finished:
        LOGGER.info("%s", finished)
        return 0
    except TrainingInterrupted as interrupted:
        print(f"train.py: {interrupted}", file=sys.stderr)
        return interrupted.exit_status
    return 0


def _train(config, explicit: dict, callbacks=None):
    """Set up this process, decide what to train (a new run or a resumed one; decided by the main process
    and shared), train, and tear the process group down on every way out. Returns the TrainResult; raises
    UserError, RunFinished and TrainingInterrupted."""
    from utils import dist
    from utils.autobatch import check_request
    from utils.trainer import setup_process, train
    from utils.trainer.resume import resolve_run

    try:
        if not config.cfg and not config.weights and not config.resume:
            config.cfg = "models/yolov5n.yaml" if (ROOT / "models/yolov5n.yaml").exists() else ""
        if config.cfg and not Path(config.cfg).exists() and (ROOT / config.cfg).exists():
            config.cfg = str(ROOT / config.cfg)
        device = setup_process(config.device)
        config, hyp, resume = _shared(lambda: resolve_run(config, explicit))
        listed = [d for d in str(config.device).replace("cuda:", "").split(",") if d.strip().isdigit()]
        check_request(config.batch_size, device)  # --batch-size -1 needs CUDA
        dist.check_launch(config.batch_size, device, len(listed) or None)
        return train(config, hyp, device, resume, callbacks)
    finally:
        dist.cleanup()


def run_evolution(config, space_path: str) -> int:
    """--evolve N: N generations, each a training run (only its final epoch validated and saved) of hyperparameters
    mutated from the best rows of <project>/<name>/evolve.csv (default runs/evolve/exp, never incremented: several
    processes given the same folder cooperate, and running the command again continues the evolution)."""
    import dataclasses

    from utils.config import Hyp, resolve_hyp_path
    from utils.evolve import METRIC_COLUMNS, SearchSpace, evolve
    from utils.evolve_folder import make_scratch_folder, remove_scratch_folder
    from utils.trackers.dispatch import evolution_generation
    from utils.trainer import TrainingInterrupted, setup_process, train

    project = Path("runs/evolve") if config.project == "runs/train" else Path(config.project)
    folder = project / config.name
    try:
        space = SearchSpace.load(space_path if Path(space_path).exists() else ROOT / space_path)
        base = evolution_base(Hyp.load(config.hyp), config.noautoanchor)
        if not config.cfg and not config.weights:
            config.cfg = str(ROOT / "models/yolov5n.yaml")
        device = setup_process(config.device)
        config = check_evolution_command(config, base, device)  # a mistake in the command: before any generation

        def run_generation(hyp, number: int) -> dict:
            scratch = make_scratch_folder(folder, number)  # this generation's own folder (a random name)
            try:
                generation = dataclasses.replace(config, save_dir=str(scratch), noval=True, nosave=True,
                                                 noplots=True, tensorboard=False, ndjson_file=False,
                                                 hyp=str(resolve_hyp_path(config.hyp)))
                with evolution_generation(folder, number):  # its tracker runs grouped, their files in the folder
                    result = train(generation, hyp, device)
            finally:
                remove_scratch_folder(scratch)
            return {key: result.last_row[key] for key in METRIC_COLUMNS}

        best = evolve(run_generation, config.evolve, folder, space, base, seed=config.seed)
    except TrainingInterrupted as interrupted:
        print(f"train.py: evolution {interrupted}; run the same command again to continue it", file=sys.stderr)
        return interrupted.exit_status
    if best is not None:
        LOGGER.info("Evolution results in %s (evolve.csv, hyp_evolve.yaml, evolve.png). Train with the best: "
                    "python train.py --hyp %s", folder, folder / "hyp_evolve.yaml")
    return 0


def evolution_base(hyp, noautoanchor: bool):
    """The hyp an evolution starts from, as YOLOv5 v7 evolves: 3 anchors per level when the hyp gives no count (so
    every generation fits its anchors with AutoAnchor, and their count is evolved), none with --noautoanchor (the
    model's anchors are kept and the count is not evolved)."""
    if noautoanchor:
        return hyp.replace(anchors=None)
    return hyp if hyp.anchors is not None else hyp.replace(anchors=3.0)


def check_evolution_command(config, base_hyp, device):
    """What every generation of an evolution shares, checked once before the first: the dataset YAML (--data),
    the model (--cfg / --weights) and the batch (--batch-size -1: AutoBatch measured once, in the precision the
    runs train in, for the whole evolution). A mistake is one UserError line and no evolve.csv row; returns
    ``config`` with the batch resolved."""
    import dataclasses

    from utils.autobatch import auto_batch_size, check_request
    from utils.trainer.amp import choose_precision
    from utils.trainer.setup import build_training_model
    from utils.trainer.stages import load_data

    check_request(config.batch_size, device)
    data_cfg, names = load_data(config)
    model = build_training_model(config.cfg, config.weights, len(names), names, anchors=base_hyp.anchors)
    if config.batch_size == -1:
        precision = choose_precision(config.amp, device, model)
        config = dataclasses.replace(config, batch_size=auto_batch_size(config, model, device, data_cfg,
                                                                        precision.dtype))
        LOGGER.info("Evolve: every generation trains with batch %d (AutoBatch)", config.batch_size)
    return config


def _shared(decide):
    """Run ``decide()`` on the main process and give its result (or its user error) to every process."""
    from utils import dist
    from utils.errors import UserError
    from utils.trainer.resume import RunFinished

    outcome = None
    if dist.is_main_process():
        try:
            outcome = ("ok", decide())
        except (UserError, RunFinished) as error:
            outcome = ("error", error)
    kind, value = dist.broadcast_object(outcome, phase="decide what to train (new run or resume)")
    if kind == "error":
        if isinstance(value, UserError) and not dist.is_main_process():
            raise dist.SharedError(str(value), value.exit_code)
        raise value
    return value


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record  # torchrun reports a failed rank's traceback

    from utils.errors import exit_process

    exit_process(record(main)())
