"""val.py's mAP50-95 equals pycocotools' COCOeval on the same predictions (BCCD, after a short training)."""
import pytest

import train as train_script
import val as val_script
from tests.conftest import shared_path

pytest.importorskip("pycocotools")


@pytest.mark.slow
def test_val_agrees_with_pycocotools_on_bccd(tmp_path):
    data = shared_path("datasets", "bccd", "data.yaml", why="a real-data check (BCCD); tests/test_val.py checks "
                       "the agreement on generated data")
    code = train_script.main(["--data", str(data), "--cfg", "models/yolov5n.yaml", "--weights", "", "--imgsz", "160",
                              "--batch-size", "32", "--epochs", "3", "--workers", "2", "--device", "cpu",
                              "--noplots", "--noautoanchor", "--project", str(tmp_path / "train")])
    assert code == 0
    best = tmp_path / "train" / "exp" / "weights" / "best.pt"
    result = val_script.run(data=str(data), weights=str(best), imgsz=160, batch_size=32, device="cpu", workers=2,
                            save_json=True, plots=False, project=tmp_path / "val")
    assert result.coco is not None, "pycocotools did not score the run"
    coco_map, coco_map50 = result.coco
    assert result.seen == 87
    assert abs(result.map - coco_map) <= 0.002, (result.map, coco_map)
    assert abs(result.map50 - coco_map50) <= 0.002, (result.map50, coco_map50)
