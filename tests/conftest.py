"""Shared fixtures: a small copy of the embedded data set, and the settings of a run that takes seconds."""
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("UNET_PROBE_CACHE", str(ROOT / ".pytest_cache" / "cpu_probe.json"))

# A run that takes seconds on 2 cores: 16 training images of 64 px, one epoch, in the main process.
TINY = {"image_size": 64, "batch_size": 4, "epochs": 1, "max_train_images": 16, "num_workers": 0,
        "progress": False, "cpu_probe": False, "logger": "csv", "early_stopping_patience": None}


@pytest.fixture(scope="session")
def shapes(tmp_path_factory):
    """40 pairs of the embedded shapes data set at 64 px (the generator the default data set uses)."""
    from unet_amp.data import ensure_shapes_dataset

    root = tmp_path_factory.mktemp("data") / "shapes"
    ensure_shapes_dataset(root, count=40, size=64)
    return root


@pytest.fixture
def tiny(shapes, tmp_path):
    """The TINY settings on the shapes copy, checkpoints in this test's folder."""
    return {**TINY, "data_dir": str(shapes), "checkpoint_dir": str(tmp_path / "ckpt")}


def cli(*args, cwd=ROOT, env=None, timeout=300):
    """Run `python train_unet.py args...`; the CompletedProcess (text)."""
    import subprocess

    return subprocess.run([sys.executable, str(ROOT / "train_unet.py"), *map(str, args)], cwd=cwd, text=True,
                          capture_output=True, timeout=timeout, env={**os.environ, **(env or {})})


def as_args(cfg):
    return [f"{k}={v}" for k, v in cfg.items()]



def make_checkpoint(path, num_classes=1, data_mode="fit", tta="none"):
    """A checkpoint in train's layout around a random-weight Unet/resnet18 at 64 px (predict and export tests)."""
    import torch

    from unet_amp.checkpoint import DATA_FACTS, VERSION
    from unet_amp.model import build_model

    cfg = {"arch": "Unet", "encoder_name": "resnet18", "encoder_weights": None, "in_channels": 3,
           "num_classes": num_classes, "image_size": 64, "data_mode": data_mode, "patch_scale": 1.0,
           "tile_overlap": 0.25, "tta": tta, "intensity_range": None, "class_weights": None}
    torch.manual_seed(0)
    model = build_model(cfg).eval()
    state = {"version": VERSION, "model": model.state_dict(), "ema": None, "optimizer": {}, "scheduler": {},
             "scaler": None, "epoch": 1, "best_iou": 0.0, "best_epoch": 1, "history": [], "fallbacks": [],
             "config": cfg, "precision": {"dtype": "float32", "channels_last": False},
             "data": {k: cfg[k] for k in DATA_FACTS}}
    torch.save(state, path)
    return path
