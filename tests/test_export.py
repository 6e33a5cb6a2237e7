"""export: model.onnx + model.json, checked; onnxruntime's masks (predict and tools/onnx_predict.py) equal torch's."""
import json
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import onnx
import pytest
import tifffile
import torch

from conftest import make_checkpoint
from unet_amp.common import UserError
from unet_amp.export import EXPORT_CONFIG, OnnxModel, export, main
from unet_amp.predict import PREDICT_CONFIG, predict

ROOT = Path(__file__).resolve().parents[1]
SIZES = [(50, 70), (64, 64), (33, 90), (130, 75)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("export")
    ckpt = make_checkpoint(root / "best.pt")
    assert main([f"checkpoint={ckpt}", f"output={root / 'deploy'}"]) == 0
    images = root / "images"
    images.mkdir()
    for i, (h, w) in enumerate(SIZES):
        image = np.random.default_rng(i).integers(0, 255, (h, w, 3), dtype=np.uint8)
        cv2.imwrite(str(images / f"img{i}.png"), cv2.GaussianBlur(image, (9, 9), 3))
    wide = cv2.GaussianBlur(np.random.default_rng(9).integers(0, 4095, (60, 50, 3)).astype(np.uint16), (9, 9), 3)
    wide[7, 7] = 65535  # a hot pixel: the model has no learnt range, so each wide image's own percentiles apply
    cv2.imwrite(str(images / "wide16.png"), wide)
    tifffile.imwrite(images / "wide32.tif", wide[..., ::-1].astype(np.float32) / 7, photometric="rgb")
    return ckpt, root / "deploy", images


def masks(folder):
    return {p.name: cv2.imread(str(p), cv2.IMREAD_UNCHANGED) for p in sorted(Path(folder).glob("*.png"))}


def agreement(a, b):
    assert a.keys() == b.keys() and a
    return sum(int((a[k] == b[k]).sum()) for k in a) / sum(a[k].size for k in a)


def predicted(ckpt, images, out, **over):
    return predict({**PREDICT_CONFIG, "checkpoint": str(ckpt), "input": str(images), "output": str(out),
                    "device": "cpu", "progress": False, "amp": "fp32", **over})


def test_export_writes_a_checked_onnx_and_its_sidecar(exported):
    _, deploy, _ = exported
    assert sorted(p.name for p in deploy.iterdir()) == ["model.json", "model.onnx"]  # no temporary file left
    onnx.checker.check_model(str(deploy / "model.onnx"))
    meta = json.loads((deploy / "model.json").read_text())
    assert {"in_channels": 3, "num_classes": 1, "image_size": 64, "data_mode": "fit", "intensity_range": None,
            "patch_scale": 1.0, "tile_overlap": 0.25}.items() <= meta.items()
    assert np.allclose(meta["mean"], [0.485, 0.456, 0.406]) and np.allclose(meta["std"], [0.229, 0.224, 0.225])
    assert meta["check"]["max_abs_logit_difference"] <= meta["check"]["tolerance"]


def test_onnx_model_takes_any_batch_and_size(exported):
    ckpt, deploy, _ = exported
    from unet_amp.checkpoint import load_checkpoint, model_from_checkpoint

    model, session = model_from_checkpoint(load_checkpoint(ckpt)), OnnxModel(deploy / "model.onnx")
    x = torch.randn(3, 3, 96, 160)
    with torch.no_grad():
        assert (session(x) - model(x)).abs().max() < 1e-3


def test_onnxruntime_predict_equals_torch(exported, tmp_path):
    ckpt, deploy, images = exported
    predicted(ckpt, images, tmp_path / "torch")
    predicted(deploy, images, tmp_path / "ort", backend="onnxruntime")
    predicted(deploy / "model.onnx", images / "img0.png", tmp_path / "one", backend="onnxruntime")
    assert agreement(masks(tmp_path / "torch"), masks(tmp_path / "ort")) >= 0.999
    assert set(np.unique(masks(tmp_path / "ort")["img3.png"])) == {0, 255}  # the masks are not trivial


def test_an_export_from_before_the_clipped_rule_still_predicts_and_says_so(exported, tmp_path, capsys):
    _, deploy, images = exported
    old = tmp_path / "old"
    old.mkdir()
    (old / "model.onnx").write_bytes((deploy / "model.onnx").read_bytes())
    meta = json.loads((deploy / "model.json").read_text())
    meta.pop("own_range_percentiles")
    (old / "model.json").write_text(json.dumps({**meta, "version": 1}))
    capsys.readouterr()
    assert predicted(old, images / "img0.png", tmp_path / "out", backend="onnxruntime")["failed"] == []
    assert str(old / "model.json") in capsys.readouterr().out
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "onnx_predict.py"), str(old / "model.json"),
                           str(images / "wide16.png"), str(tmp_path / "tool")], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr


def test_standalone_tool_equals_torch_without_torch(exported, tmp_path):
    ckpt, deploy, images = exported
    predicted(ckpt, images, tmp_path / "torch")
    no_torch = ("import runpy, sys; sys.modules['torch'] = None; sys.argv = sys.argv[1:]; "
                "runpy.run_path(sys.argv[0], run_name='__main__')")  # `import torch` would raise
    done = subprocess.run([sys.executable, "-c", no_torch, str(ROOT / "tools" / "onnx_predict.py"),
                           str(deploy / "model.json"), str(images), str(tmp_path / "tool")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert agreement(masks(tmp_path / "torch"), masks(tmp_path / "tool")) >= 0.999


def test_standalone_tool_never_writes_over_ground_truth(exported, tmp_path):
    _, deploy, images = exported
    data = tmp_path / "set"
    (data / "images").mkdir(parents=True)
    (data / "masks").mkdir()
    for image in images.iterdir():
        (data / "images" / image.name).write_bytes(image.read_bytes())
    truth = data / "masks" / "truth.png"
    truth.write_bytes(b"ground truth")
    for out in (data / "masks", tmp_path / "other"):
        out.mkdir(exist_ok=True)
        (out / "truth.png").write_bytes(b"ground truth")
        done = subprocess.run([sys.executable, str(ROOT / "tools" / "onnx_predict.py"), str(deploy / "model.json"),
                               str(data / "images"), str(out)], capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and "Traceback" not in done.stderr
        assert sorted(p.name for p in out.iterdir()) == ["truth.png"]
        assert (out / "truth.png").read_bytes() == b"ground truth"


def test_patch_mode_export_through_both_runtimes(tmp_path, exported):
    images = exported[2]
    ckpt = make_checkpoint(tmp_path / "patch.pt", data_mode="patch", num_classes=3)
    path = export({**EXPORT_CONFIG, "checkpoint": str(ckpt), "output": str(tmp_path / "p.onnx")})
    assert path == tmp_path / "p.onnx" and (tmp_path / "p.json").is_file()
    predicted(ckpt, images, tmp_path / "torch")
    predicted(path, images, tmp_path / "ort", backend="onnxruntime")
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "onnx_predict.py"), str(tmp_path / "p.json"),
                           str(images), str(tmp_path / "tool")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert agreement(masks(tmp_path / "torch"), masks(tmp_path / "ort")) >= 0.999
    assert agreement(masks(tmp_path / "torch"), masks(tmp_path / "tool")) >= 0.999


def test_predict_refuses_a_torch_checkpoint_for_onnx_and_back(exported, tmp_path):
    ckpt, deploy, images = exported
    with pytest.raises(UserError):
        predicted(ckpt, images, tmp_path / "a", backend="onnxruntime")
    with pytest.raises(UserError):
        predicted(deploy / "model.onnx", images, tmp_path / "b")
    with pytest.raises(UserError):
        export({**EXPORT_CONFIG, "checkpoint": str(tmp_path / "missing.pt"), "output": str(tmp_path / "x")})
    assert not (tmp_path / "x").exists()
