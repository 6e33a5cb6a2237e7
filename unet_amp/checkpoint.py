"""Checkpoints: written atomically, loaded with weights_only, resumed exactly (epochs are seeded by number, so
the data order and augmentation of epoch N are the same whether the run stopped before it or not)."""
from __future__ import annotations

import datetime
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unet_amp.common import UserError, atomic_save_torch, say
from unet_amp.model import build_model, unwrap

VERSION = 3  # 3: images wider than 8 bits clipped to a robust intensity range (2 still loads, with OLD_RULE said)
OLD_RULE = ("written before the clipped intensity rule: images wider than 8 bits are now clipped to its "
            "intensity_range, a lone hot or dead pixel taking its 3x3 median (without a range, each image's own "
            "0.1-99.9th percentiles); 8-bit images are unchanged")
RUN_FILES = ("last.pt", "best.pt", "history.csv", "summary.json", "config.json", "tb")
# Keys a resumed run must keep: they change what the weights mean or which data they saw.
FIXED_ON_RESUME = ("data_dir", "image_size", "in_channels", "num_classes", "val_fraction", "max_train_images",
                   "intensity_range", "data_mode", "patch_scale", "arch", "encoder_name", "loss", "class_weights",
                   "batch_size", "accumulation_steps", "learning_rate", "weight_decay", "warmup_fraction", "seed")
DATA_FACTS = ("intensity_range", "class_weights", "num_classes", "in_channels", "image_size", "data_mode",
              "patch_scale", "tile_overlap", "tta", "arch", "encoder_name")


@dataclass
class Run:
    """What the epoch loop carries and a checkpoint holds."""
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: object
    scaler: object
    ema: object
    prec: object
    cfg: dict
    epoch: int = 0
    best_iou: float = -1.0
    best_epoch: int = 0
    streak: int = 0
    history: list = field(default_factory=list)
    fallbacks: list = field(default_factory=list)

    def state(self):
        """The checkpoint dict."""
        return {"version": VERSION, "model": unwrap(self.model).state_dict(), "ema": self.ema.state_dict(),
                "optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler is not None else None,
                "epoch": self.epoch, "best_iou": self.best_iou, "best_epoch": self.best_epoch, "streak": self.streak,
                "history": self.history, "fallbacks": self.fallbacks, "config": self.cfg,
                "precision": {"dtype": str(self.prec.dtype).replace("torch.", ""),
                              "channels_last": self.prec.channels_last},
                "data": {k: self.cfg[k] for k in DATA_FACTS}}

    def load(self, state):
        """Put a checkpoint's (or a rollback point's) state back, exactly."""
        unwrap(self.model).load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state["scaler"]:
            self.scaler.load_state_dict(state["scaler"])
        self.ema.load_state_dict(state["ema"])
        self.epoch, self.best_iou, self.best_epoch = state["epoch"], state["best_iou"], state["best_epoch"]
        self.history, self.fallbacks, self.streak = list(state["history"]), list(state["fallbacks"]), state["streak"]


def load_checkpoint(path):
    """A checkpoint dict, loaded with weights_only (no code runs from the file)."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{path}: no such checkpoint; train first, or give checkpoint= the .pt file")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated or foreign file: torch raises several kinds
        raise UserError(f"{path}: not a readable checkpoint ({type(exc).__name__}); use another .pt file") from None
    if not isinstance(state, dict) or state.get("version") not in (2, VERSION):
        raise UserError(f"{path}: not a unet-amp checkpoint of this version; train again to make one")
    if state["version"] < VERSION:
        say(f"note: {path}: {OLD_RULE}")
    return state


def model_from_checkpoint(state, device="cpu"):
    """The trained model in eval mode (predict, export and the notebooks use this)."""
    model = build_model({**state["config"], "encoder_weights": None})
    model.load_state_dict(state["model"])
    return model.to(device).eval()


def resume_state(cfg):
    """last.pt's state when resume=True, else None."""
    last = Path(cfg["checkpoint_dir"]) / "last.pt"
    if cfg["resume"] and not last.is_file():
        raise UserError(f"{last}: no checkpoint to resume; give checkpoint_dir= the run's folder, or train anew")
    return load_checkpoint(last) if cfg["resume"] else None


def resumed_config(cfg, typed, state):
    """The resumed run's config, with the keys typed now on top; a typed key that would change what the run
    trains on is refused (a new run is the way to change it)."""
    if state is None:
        return cfg
    saved = state["config"]
    for key in FIXED_ON_RESUME:
        if key in typed and cfg[key] != saved[key]:
            raise UserError(f"{key}={cfg[key]!r}: last.pt's run used {saved[key]!r}; resume with {key}="
                            f"{saved[key]!r}, or start a new run with resume=False")
    return {**saved, **{k: cfg[k] for k in typed}, "resume": True, "checkpoint_dir": cfg["checkpoint_dir"]}


def archive_previous_run(folder):
    """A new run in a folder that holds another run's files moves them to previous/<time>/: never overwritten."""
    folder = Path(folder)
    found = [folder / name for name in RUN_FILES if (folder / name).exists()]
    if not found:
        return None
    target = folder / "previous" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S-%f")
    target.mkdir(parents=True)
    for path in found:
        shutil.move(str(path), str(target / path.name))
    return target


def save_epoch(run, folder, is_best):
    """last.pt every epoch; best.pt (with the EMA's weights where EMA is on) when the val IoU improved."""
    atomic_save_torch(run.state(), Path(folder) / "last.pt")
    if is_best:
        with run.ema.swapped():
            atomic_save_torch(run.state(), Path(folder) / "best.pt")
