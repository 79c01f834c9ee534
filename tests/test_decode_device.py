"""--decode-device: the JPEG images of --augment-device's mosaics decoded on the training device (utils/data/plans.py
``PlanDataset.encoded``, ``encoded_sources``; utils/data/device_augment.py ``decoded_sources``).

On the CPU the device decode is torchvision's libjpeg-turbo, which decodes as OpenCV does to the bit, so the
rendered images must equal those of the worker-decoded plans exactly; on CUDA (nvJPEG) the closeness is measured by
benchmarks/gpu_check.py. Images the worker must decode itself (resized, PNG, progressive, EXIF-rotated, cached, not as
scanned) travel as pixels, as without the flag."""
from __future__ import annotations

import logging

import cv2
import numpy as np
import pytest
import torch

from tests.test_dataset import make_split
from utils.config import Hyp
from utils.data import device_augment
from utils.data.dataset import LabelSet
from utils.data.device_augment import render_plans
from utils.data.images import ImageError
from utils.data.loader import create_dataloader, set_loader_epoch
from utils.data.plans import EncodedImage, PlanBatch, PlanDataset, SourceCrop, collate_plans

SIZE = 160  # im0 (160x120) and im1 (120x160) train at their own size; the split's other images are resized
SCRATCH = Hyp.load("hyp.scratch-low.yaml")
HYPS = {"mosaic, mixup": SCRATCH.replace(mixup=0.5),
        "mosaic, perspective, rotation, up-down flips": SCRATCH.replace(perspective=0.0005, degrees=10.0, flipud=0.5)}


def save_jpeg(path, pixels: np.ndarray, progressive: bool = False, orientation: int | None = None) -> None:
    if orientation is None:
        cv2.imwrite(str(path), pixels, [cv2.IMWRITE_JPEG_PROGRESSIVE, int(progressive)])
        return
    from PIL import Image

    image = Image.fromarray(pixels[..., ::-1])
    exif = image.getexif()
    exif[0x0112] = orientation
    image.save(path, exif=exif, quality=95)


@pytest.fixture(scope="module")
def split(tmp_path_factory):
    """make_split's JPEGs, plus at the training size: a PNG, a progressive JPEG and an EXIF-rotated one (the worker
    decodes those three)."""
    folder = tmp_path_factory.mktemp("decode")
    made = make_split(folder, suffix=".jpg")
    rng = np.random.default_rng(0)
    extra = {"png": folder / "flat.png", "progressive": folder / "progressive.jpg", "rotated": folder / "rotated.jpg"}
    pixels = np.kron(rng.integers(0, 255, (8, 10, 3)), np.ones((16, 16, 1))).astype(np.uint8)  # 160 x 128
    cv2.imwrite(str(extra["png"]), pixels)
    save_jpeg(extra["progressive"], pixels, progressive=True)
    save_jpeg(extra["rotated"], pixels, orientation=3)  # upside down: the same size upright
    labels = [np.array([[0, 0.5, 0.5, 0.4, 0.4]], np.float32)] * 3
    return LabelSet(made.im_files + [str(p) for p in extra.values()], made.labels + labels,
                    np.concatenate((made.shapes, [[160, 128]] * 3)))


def plans(split, hyp, decode_device: bool, epoch: int = 0):
    dataset = PlanDataset(split, imgsz=SIZE, batch_size=4, augment=True, hyp=hyp, decode_device=decode_device)
    return [dataset[(i, epoch)] for i in range(len(dataset))]


def named(split, name: str) -> int:
    return next(i for i, path in enumerate(split.im_files) if path.endswith(name))


@pytest.mark.parametrize("hyp", list(HYPS))
def test_the_device_decodes_the_same_images_to_the_bit(split, hyp):
    """Decoded on the device (the CPU's torchvision), the batches render the images the worker-decoded plans render,
    to the bit; the targets are the same objects' values."""
    for epoch in (0, 1):
        worker, device = plans(split, HYPS[hyp], False, epoch), plans(split, HYPS[hyp], True, epoch)
        decoded = 0
        for first in range(0, len(worker), 4):
            plain, targets, _, _ = collate_plans(worker[first:first + 4])
            batch, device_targets, _, _ = collate_plans(device[first:first + 4])
            assert len(plain.source_table) == 0 and torch.equal(targets, device_targets)
            decoded += len(batch.source_table)
            assert torch.equal(render_plans(batch), render_plans(plain))
        assert decoded > 0


def test_only_uncached_baseline_jpegs_at_their_training_size_travel_encoded(split, tmp_path):
    dataset = PlanDataset(split, imgsz=SIZE, batch_size=4, augment=True, hyp=SCRATCH, decode_device=True)
    encoded = dataset.encoded(named(split, "im0.jpg"))
    assert isinstance(encoded, EncodedImage) and encoded.size == (160, 120)
    assert encoded.data.tobytes() == open(split.im_files[named(split, "im0.jpg")], "rb").read()
    for name in ("im2.jpg", "flat.png", "progressive.jpg", "rotated.jpg"):  # resized; not a JPEG; progressive; EXIF
        assert dataset.encoded(named(split, name)) is None, name
    shapes = split.shapes.copy()
    shapes[named(split, "im0.jpg")] = (160, 118)  # the scan read another size than the file holds now
    changed = PlanDataset(LabelSet(split.im_files, split.labels, shapes), imgsz=SIZE, batch_size=4, augment=True,
                          hyp=SCRATCH, decode_device=True)
    assert changed.encoded(named(split, "im0.jpg")) is None
    dataset.cache_images("ram")
    assert dataset.encoded(named(split, "im0.jpg")) is None  # cached images are decoded already


def test_collate_places_each_source_once_and_points_the_tiles_at_their_crops(split):
    """A batch whose two mosaics read the same image carries its bytes once; each crop's tile row points at its
    first pixel in the decoded image (row stride: the image's width), after the worker's own pixels."""
    dataset = PlanDataset(split, imgsz=SIZE, batch_size=4, augment=True, hyp=SCRATCH, decode_device=True)
    items = (dataset[(i, 0)] for i in range(len(dataset)))
    first = next(item for item in items if any(isinstance(tile, SourceCrop) for tile, _ in item[0].tiles))
    crops = [(tile, place) for tile, place in first[0].tiles if isinstance(tile, SourceCrop)]
    batch = collate_plans([first, first])[0]
    sizes = {crop.image.index: crop.image.size for crop, _ in crops}
    assert len(batch.source_table) == len(sizes) and len(batch.source_paths) == len(sizes)
    assert batch.sources.numel() == sum(crop.image.data.size for crop, _ in {c.image.index: (c, p) for c, p in
                                                                              crops}.values())
    base = batch.pixels.numel() // 3
    table = batch.source_table.tolist()
    for crop, (x, y) in crops:
        row = next(r for r in batch.tiles.tolist() if r[0] == 0 and (r[1], r[2]) == (x, y))
        k = [split.im_files.index(path) for path in batch.source_paths].index(crop.image.index)
        start = base + sum(w * h for _, _, w, h in table[:k])
        cx, cy, cw, ch = crop.box
        assert row[3:] == [cw, ch, (start + cy * crop.image.size[0] + cx) * 3, crop.image.size[0]]


def test_a_source_that_does_not_decode_as_scanned_names_its_file(split):
    dataset = PlanDataset(split, imgsz=SIZE, batch_size=4, augment=True, hyp=SCRATCH, decode_device=True)
    batch = collate_plans([dataset[(i, 0)] for i in range(4)])[0]
    assert len(batch.source_table)
    start, count, w, h = batch.source_table[0].tolist()
    broken = batch.sources.clone()
    broken[start + count // 2:start + count] = 0  # the scan data gone
    broken[start + 2:start + 20] = 7  # and the markers
    with pytest.raises(ImageError, match=batch.source_paths[0].replace(".", r"\.")):
        render_plans(PlanBatch(**{**vars(batch), "sources": broken}))
    other = cv2.imencode(".jpg", np.zeros((h + 8, w, 3), np.uint8))[1]  # decodes, to another size
    replaced = torch.cat((batch.sources[:start], torch.from_numpy(other), batch.sources[start + count:]))
    table = batch.source_table.clone()
    table[0, 1] = other.size
    table[1:, 0] += other.size - count
    with pytest.raises(ImageError, match=f"decodes to {w}x{h + 8} on cpu, not the {w}x{h} its scan read"):
        render_plans(PlanBatch(**{**vars(batch), "sources": replaced, "source_table": table}))


def test_the_loader_with_workers_sends_the_sources_and_gives_the_same_images(split, caplog):
    common = {"hyp": SCRATCH.replace(mixup=0.5), "augment": True, "workers": 2, "shuffle": True, "seed": 3,
              "labels": split, "augment_device": True}
    plain, _ = create_dataloader(None, SIZE, 4, 32, **common)
    decoding, dataset = create_dataloader(None, SIZE, 4, 32, decode_device=True, **common)
    assert dataset.decode_device
    decoded = 0
    for loader in (plain, decoding):
        set_loader_epoch(loader, 1)
    for (batch, targets, paths, _), (device_batch, device_targets, device_paths, _) in zip(plain, decoding):
        assert torch.equal(targets, device_targets) and paths == device_paths
        decoded += len(device_batch.source_table)
        assert torch.equal(render_plans(device_batch), render_plans(batch))
    assert decoded > 0
    with caplog.at_level(logging.WARNING):
        create_dataloader(None, SIZE, 4, 32, decode_device=True, cache="ram", **{**common, "workers": 0})
    assert "--decode-device has nothing to decode: the images are cached decoded (--cache ram)" in caplog.text


def test_the_flag_needs_augment_device(tmp_path, capsys):
    import train

    assert train.main(["--data", str(tmp_path / "data.yaml"), "--decode-device"]) == 2
    assert ("--decode-device decodes the images for --augment-device's rendering on the device: add "
            "--augment-device") in capsys.readouterr().err


@pytest.mark.slow
def test_training_with_the_device_decoding_equals_training_without(tmp_path, monkeypatch):
    """Two tiny runs with --augment-device --cache off (images at their training size), one with --decode-device:
    on the CPU the same weights and results.csv, to the bit; the flag is saved with the run's options."""
    import yaml

    import train
    from tests.conftest import TINY_MODEL_YAML, make_tiny_dataset

    data = make_tiny_dataset(tmp_path / "data", num_train=8, num_val=2, size=112)  # 128 x 112: trained at 128
    cfg = tmp_path / "tiny.yaml"
    cfg.write_text(TINY_MODEL_YAML)
    decoded_images = []
    decode = device_augment.decoded_sources
    monkeypatch.setattr(device_augment, "decoded_sources",
                        lambda batch, device: decoded_images.append(len(batch.source_table)) or decode(batch, device))
    runs = {}
    for name, extra in (("plain", []), ("decoded", ["--decode-device"])):
        assert train.main(["--data", str(data), "--cfg", str(cfg), "--weights", "", "--imgsz", "128", "--batch-size",
                           "4", "--epochs", "1", "--workers", "0", "--device", "cpu", "--cache", "off",
                           "--project", str(tmp_path / "runs"), "--name", name, "--noautoanchor", "--noplots",
                           "--augment-device", *extra]) == 0
        runs[name] = tmp_path / "runs" / name
    assert decoded_images and sum(decoded_images) >= 8  # the second run's batches decoded their images here
    assert yaml.safe_load((runs["decoded"] / "opt.yaml").read_text())["decode_device"] is True
    assert (runs["plain"] / "results.csv").read_text() == (runs["decoded"] / "results.csv").read_text()
    plain, decoded = (torch.load(run / "weights" / "last.pt", weights_only=True)["model"]["state_dict"]
                      for run in runs.values())
    assert plain.keys() == decoded.keys() and all(torch.equal(plain[key], decoded[key]) for key in plain)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.py runs the cuda tests)")
def test_the_gpu_decodes_close_to_the_workers(split):
    """On CUDA (nvJPEG: another IDCT and chroma upsampling than OpenCV's libjpeg-turbo) the images rendered from
    GPU-decoded sources stay close to those of the worker-decoded plans rendered on the same GPU: a tile read from
    the wrong place, a channel order swapped or a stride off by one differs by tens on average."""
    device = torch.device("cuda")
    worker, decoded = plans(split, HYPS["mosaic, mixup"], False), plans(split, HYPS["mosaic, mixup"], True)
    sources = 0
    for first in range(0, len(worker), 4):
        plain = collate_plans(worker[first:first + 4])[0].pin_memory()
        batch = collate_plans(decoded[first:first + 4])[0].pin_memory()
        sources += len(batch.source_table)
        difference = (render_plans(batch, device).int() - render_plans(plain, device).int()).abs().float()
        assert difference.mean() < 1.0, difference.mean()
    assert sources > 0


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (benchmarks/gpu_check.py runs the cuda tests)")
def test_the_gpu_decode_never_writes_memory_that_queued_kernels_still_read(split):
    """Blocks freed on the training stream while kernels queued there still read them are what the allocator hands
    out next on that stream; torchvision's CUDA decoder wrote its images into them before those kernels ran
    (pytorch/vision#9606). decoded_sources runs the decode from a side stream (decode_on): sums queued behind a
    long kernel over freed tensors of the decoded images' size come out as they went in."""
    from utils.data.device_augment import decoded_sources

    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip("torch.cuda._sleep is not in this torch")
    device = torch.device("cuda")
    decoded = plans(split, HYPS["mosaic, mixup"], True)
    batch = next(b for b in (collate_plans(decoded[first:first + 4])[0] for first in range(0, len(decoded), 4))
                 if len(b.source_table)).pin_memory()
    _, _, width, height = batch.source_table[0].tolist()
    size, value = 3 * width * height, 7
    wrong = 0
    for _ in range(50):
        victims = [torch.full((size,), value, dtype=torch.uint8, device=device) for _ in range(4)]
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # the training stream stays busy ...
        sums = [victim.sum(dtype=torch.int64) for victim in victims]  # ... with these reads queued behind it
        del victims  # freed while their reads wait
        decoded_sources(batch, device)
        torch.cuda.synchronize()
        wrong += sum(int(total) != size * value for total in sums)
    assert wrong == 0, f"{wrong} of 200 sums read memory the decode wrote"
