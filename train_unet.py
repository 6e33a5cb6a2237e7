"""
unet-amp: train a U-Net segmentation model with mixed precision done right.

    python train_unet.py                              # train with CONFIG below
    python train_unet.py batch_size=2 epochs=3        # override any CONFIG key
    python train_unet.py resume=True epochs=20        # continue checkpoints/last.pt exactly
    python train_unet.py predict checkpoint=checkpoints/best.pt input=photos/ output=masks/
    python train_unet.py benchmark                    # FP32 vs BF16 (and more), one process each
    torchrun --nproc_per_node=8 train_unet.py         # several GPUs

Sections, in order: config, distributed, command line, precision, data, model, metrics,
train/eval step, checkpoints, predict, benchmark, main. The script imports cleanly as a module;
tests and the notebook use its functions.
"""
from __future__ import annotations

import contextlib
import copy
import csv
import difflib
import json
import math
import os
import platform
import random
import re
import shutil
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import cv2
import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

# The LR schedule counts attempted optimizer steps, including those GradScaler skips; PyTorch warns
# about that ordering on a skipped first step, which is expected here.
warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")

# ----------------------------------------------------------------------------------------------------
# Config: the defaults. Edit here, or override any key on the command line: key=value.
# ----------------------------------------------------------------------------------------------------
CONFIG = {
    # preset: a named set of overrides (PRESETS below); None = none. Command-line keys win over it.
    "preset": None,                # None | "fast" | "stable" | "low_memory" | "debug"
    # data
    "data_dir": "data/shapes",     # <data_dir>/images + <data_dir>/masks (or train/ and val/ inside)
    "image_size": 128,             # training side length; a multiple of 32 (the U-Net downsamples 5x)
    "in_channels": 3,              # 3 = RGB (grayscale images are repeated), 1 = grayscale
    "num_classes": 1,              # 1 = binary (masks 0/1 or 0/255); N > 1 = masks hold class indices
    "val_fraction": 0.2,           # used when <data_dir> has no train/ and val/ folders
    "max_train_images": None,      # None = all; a number = a quick run on the first N (benchmarks)
    "num_workers": None,           # None = auto: 0 on CPU (workers would steal the compute cores)
    # model
    "arch": "Unet",                # any segmentation_models_pytorch architecture
    "encoder_name": "resnet18",
    "encoder_weights": None,       # None = random init, fully offline; "imagenet" downloads weights
    "loss": "dice+ce",             # "dice+ce", "ce" (BCE when binary) or "dice"
    # optimisation
    "epochs": 10,
    "batch_size": 8,               # or "auto" (CUDA): the largest batch that fits, minus headroom
    "accumulation_steps": 1,       # effective batch = batch_size * accumulation_steps
    "learning_rate": 2e-3,
    "weight_decay": 1e-4,
    "warmup_fraction": 0.05,       # linear warm-up, then cosine decay, stepped per optimizer step
    "grad_clip_norm": 1.0,         # None = no clipping (the norm is still measured)
    "early_stopping_patience": 5,  # epochs without a better val IoU; None = off
    "seed": 42,
    # precision and speed
    "device": "auto",              # "auto", "cpu", "cuda", "cuda:1", "mps"
    "use_amp": True,               # False = plain fp32
    "amp_dtype": "auto",           # "auto" | "bfloat16" | "float16"
    "force_amp_dtype": False,      # True = use amp_dtype even where it has no fast kernels (slow; tests)
    "eval_amp": False,             # False = validate in fp32, so fp32 and bf16 runs are judged alike
    "channels_last": False,        # NHWC memory layout: faster convolutions under bf16/fp16
    "compile_model": False,        # torch.compile: pays off on GPUs; 30-70 s compile, slower on CPU
    "sync_batchnorm": False,       # under torchrun: BatchNorm statistics over all GPUs (CUDA only)
    "tf32_matmul_precision": None, # None | "highest" | "high" | "medium" (fp32 matmuls on Ampere+)
    # GradScaler (used only with float16)
    "init_scale": 2.0**16,
    "growth_factor": 2.0,
    "backoff_factor": 0.5,
    "growth_interval": 2000,
    # numerical safety
    "nan_guard": True,             # skip non-finite steps; after nan_patience in a row fall back
                                   # fp16 -> bf16 -> fp32 with a rollback; in fp32 stop with a diagnosis
    "nan_patience": 3,             # consecutive non-finite optimizer steps before falling back
    "detect_anomaly": False,       # torch.autograd anomaly detection: names the op whose backward
                                   # made NaN/inf (debugging; slows training down a lot)
    # output
    "checkpoint_dir": "checkpoints",
    "resume": False,               # continue from <checkpoint_dir>/last.pt
    "progress": True,              # tqdm bars
    "logger": "auto",              # "auto" (TensorBoard when installed) | "tensorboard" | "csv" | "none"
}

# Allowed values for keys with a fixed set of choices.
CHOICES = {
    "amp_dtype": ("auto", "bfloat16", "float16"),
    "tf32_matmul_precision": (None, "highest", "high", "medium"),
    "loss": ("dice+ce", "ce", "dice"),
    "in_channels": (1, 3),
    "preset": (None, "", "fast", "stable", "low_memory", "debug"),
    "logger": ("auto", "tensorboard", "csv", "none"),
}
# Types for keys whose default is None.
NONE_DEFAULT_TYPES = {
    "num_workers": int, "max_train_images": int, "encoder_weights": str, "grad_clip_norm": float,
    "early_stopping_patience": int, "tf32_matmul_precision": str, "preset": str,
}
# Keys that define the model's shape: a resumed run or a checkpoint must agree on them.
MODEL_KEYS = ("arch", "encoder_name", "in_channels", "num_classes")
# ... and those that define the data and the optimisation: a resume continues exactly only if they
# are unchanged (epochs may grow; precision, speed and output settings may change).
RESUME_KEYS = MODEL_KEYS + ("data_dir", "image_size", "val_fraction", "max_train_images", "loss", "batch_size",
                            "accumulation_steps", "learning_rate", "weight_decay", "warmup_fraction", "seed")
# Keys that also take the value "auto" (resolved at start-up; the resolved value is recorded).
AUTO_KEYS = ("batch_size",)

# Presets: named sets of CONFIG overrides for the common use cases (README table: preset_table()).
# Layering: CONFIG (your edits are the base) < preset < key=value on the command line (always wins).
PRESETS = {
    # Daily experiments: bf16 (or fp16 + GradScaler) where native, NHWC layout, torch.compile.
    "fast": {"use_amp": True, "amp_dtype": "auto", "channels_last": True, "compile_model": True},
    # Final training: plain fp32, no compile, clipping and the non-finite guard on.
    "stable": {"use_amp": False, "compile_model": False, "grad_clip_norm": 1.0, "nan_guard": True},
    # Small GPUs: AMP halves activation memory; batch 4 x 2 accumulation keeps the default batch of 8.
    "low_memory": {"use_amp": True, "amp_dtype": "auto", "batch_size": 4, "accumulation_steps": 2,
                   "compile_model": False},
    # Find a bug fast: tiny fp32 run in the main process, bars on, anomaly detection, stop at the
    # first non-finite step (nan_patience=1: in fp32 that stops with a diagnosis).
    "debug": {"batch_size": 2, "accumulation_steps": 1, "use_amp": False, "compile_model": False,
              "channels_last": False, "max_train_images": 8, "epochs": 2, "num_workers": 0,
              "progress": True, "detect_anomaly": True, "nan_patience": 1, "early_stopping_patience": None},
}
PRESET_USES = {
    "fast": "daily experiments on a GPU (compile takes 30-70 s up front and does not pay off on a CPU)",
    "stable": "the final model, or after NaN trouble: fp32, no compile, clipping and the guard",
    "low_memory": "small GPUs (~4 GB): AMP and half the batch, accumulated to the same effective batch",
    "debug": "finding a bug in seconds on a laptop CPU: tiny fp32 run, anomaly detection, first NaN stops",
}


class UserError(Exception):
    """A problem the user can fix (bad config, bad data). Printed as one line, no traceback."""


# ----------------------------------------------------------------------------------------------------
# Distributed: torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; one process per device. Module-level like
# nanoGPT's ddp variables: every function reads the same facts, nothing is threaded through.
# ----------------------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def enabled(self):
        return self.world > 1

    @property
    def is_main(self):
        return self.rank == 0


DIST = Dist()


def setup_distributed(device="auto"):
    """Join torchrun's process group (nccl on CUDA, gloo on CPU); a no-op in a plain run."""
    global DIST
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.distributed.is_initialized():
        return DIST
    DIST = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    cuda = torch.cuda.is_available() and not device.startswith(("cpu", "mps"))
    if cuda:
        torch.cuda.set_device(DIST.local_rank)
    torch.distributed.init_process_group("nccl" if cuda else "gloo")
    return DIST


def cleanup_distributed():
    global DIST
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    DIST = Dist()


def barrier():
    if DIST.enabled:
        torch.distributed.barrier()


def all_reduce_(tensor, op="sum"):
    """In-place sum/min over ranks (no-op in a single process); returns the tensor."""
    if DIST.enabled:
        reduce_op = torch.distributed.ReduceOp.MIN if op == "min" else torch.distributed.ReduceOp.SUM
        torch.distributed.all_reduce(tensor, reduce_op)
    return tensor


# ----------------------------------------------------------------------------------------------------
# Command line: key=value overrides, parsed to the default's type, then validated.
# ----------------------------------------------------------------------------------------------------
def parse_value(key, text, default):
    kind = NONE_DEFAULT_TYPES.get(key, type(default))
    low = text.strip().lower()
    if low in ("none", "null") and (default is None or key in NONE_DEFAULT_TYPES):
        return None
    if low == "auto" and key in AUTO_KEYS:
        return "auto"
    try:
        if kind is bool:
            if low in ("true", "1", "yes", "on"):
                return True
            if low in ("false", "0", "no", "off"):
                return False
            raise ValueError
        if kind is int:
            return int(text)
        if kind is float:
            return float(text)
        return text
    except ValueError:
        raise UserError(f"{key}={text!r} is not a {kind.__name__} (default {default!r})") from None


def parse_overrides(args, base=None, defaults=None):
    """['batch_size=2', 'amp_dtype=float16'] -> a copy of the config with those values.

    Training configs are validated here; other commands pass their own `defaults` and validate.
    """
    defaults = CONFIG if defaults is None else defaults
    cfg, seen = copy.deepcopy(defaults if base is None else base), set()
    for arg in args:
        key, sep, text = arg.partition("=")
        if not sep:
            raise UserError(f"argument {arg!r} is not key=value, e.g. batch_size=2")
        key = normalize_key(key)
        check_known_key(key, defaults)
        if key in seen:
            raise UserError(f"{key} is given twice on the command line: keep one")
        seen.add(key)
        cfg[key] = parse_value(key, text, defaults[key])
    return validate_config(cfg) if defaults is CONFIG else cfg


def normalize_key(key):
    """'--batch-size' -> 'batch_size'."""
    return key.strip().lstrip("-").replace("-", "_")


def check_known_key(key, defaults=CONFIG):
    if key not in defaults:
        near = difflib.get_close_matches(key, defaults, n=1)
        hint = f"did you mean {near[0]!r}? " if near else ""
        raise UserError(f"unknown key {key!r}: {hint}known keys: {', '.join(defaults)}")


def check_types(cfg, defaults):
    """Every value has its default's type (None only where the default allows it)."""
    names = {bool: "true or false", int: "whole number", float: "number", str: "string"}
    for key, value in cfg.items():
        kind = NONE_DEFAULT_TYPES.get(key, type(defaults[key]))
        if value is None and (defaults[key] is None or key in NONE_DEFAULT_TYPES):
            continue
        if value == "auto" and key in AUTO_KEYS and defaults is CONFIG:
            continue
        ok = (isinstance(value, bool) if kind is bool else
              isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              if kind is float else isinstance(value, kind) and not isinstance(value, bool))
        if not ok:
            none = " or None" if key in NONE_DEFAULT_TYPES or defaults[key] is None else ""
            raise UserError(f"{key}={value!r} must be a {names.get(kind, kind.__name__)}{none}")


def validate_config(cfg):
    """Stop early, with a one-line message, on values that cannot be right."""
    for key in cfg:
        check_known_key(key)
    cfg = {**CONFIG, **cfg}
    check_types(cfg, CONFIG)
    for key, allowed in CHOICES.items():
        if cfg[key] not in allowed:
            raise UserError(f"{key}={cfg[key]!r} is not allowed: use one of "
                            + ", ".join(repr(a) if a is None else str(a) for a in allowed))
    positive_ints = ("epochs", "batch_size", "accumulation_steps", "num_classes", "growth_interval",
                     "nan_patience")
    if cfg["num_classes"] >= IGNORE_INDEX:
        raise UserError(f"num_classes={cfg['num_classes']} must be below {IGNORE_INDEX} (mask value "
                        f"{IGNORE_INDEX} marks padding)")
    for key in positive_ints:
        if key in AUTO_KEYS and cfg[key] == "auto":
            continue
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise UserError(f"{key}={cfg[key]!r} must be a whole number >= 1")
    size = cfg["image_size"]
    if not isinstance(size, int) or size < 32 or size % 32:
        ok = max(32, round(size / 32) * 32) if isinstance(size, (int, float)) else 128
        raise UserError(f"image_size={size!r} must be a multiple of 32 (the U-Net halves it 5 times): "
                        f"try image_size={ok}")
    checks = [
        ("learning_rate", 0 < cfg["learning_rate"] < math.inf, "must be a finite number > 0"),
        ("seed", 0 <= cfg["seed"] < 2**32, "must be a whole number in [0, 2**32)"),
        ("weight_decay", cfg["weight_decay"] >= 0, "must be >= 0"),
        ("val_fraction", 0 < cfg["val_fraction"] < 1, "must be between 0 and 1, e.g. 0.2"),
        ("warmup_fraction", 0 <= cfg["warmup_fraction"] < 1, "must be in [0, 1)"),
        ("grad_clip_norm", cfg["grad_clip_norm"] is None or cfg["grad_clip_norm"] > 0,
         "must be > 0, or None for no clipping"),
        ("early_stopping_patience", cfg["early_stopping_patience"] is None
         or cfg["early_stopping_patience"] >= 1, "must be >= 1, or None to train every epoch"),
        ("num_workers", cfg["num_workers"] is None or cfg["num_workers"] >= 0, "must be >= 0 or None"),
        ("max_train_images", cfg["max_train_images"] is None or cfg["max_train_images"] >= 1,
         "must be >= 1, or None for all"),
        ("init_scale", cfg["init_scale"] > 0, "must be > 0"),
        ("growth_factor", cfg["growth_factor"] > 1, "must be > 1"),
        ("backoff_factor", 0 < cfg["backoff_factor"] < 1, "must be between 0 and 1"),
        ("device", valid_device(cfg["device"]), "must be auto, cpu, cuda, cuda:N or mps"),
        ("batch_size", cfg["batch_size"] == "auto" or cfg["batch_size"] * (cfg["image_size"] // 32) ** 2 > 1,
         f"with image_size={cfg['image_size']} leaves BatchNorm one value per channel at the U-Net's "
         f"bottleneck: use batch_size >= 2 or image_size >= 64"),
    ]
    for key, ok, rule in checks:
        if not ok:
            raise UserError(f"{key}={cfg[key]!r} {rule}")
    check_model_names(cfg)
    return cfg


def valid_device(device):
    return re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", str(device)) is not None


def check_model_names(cfg):
    import segmentation_models_pytorch as smp

    archs = [n for n in ("Unet", "UnetPlusPlus", "FPN", "PSPNet", "DeepLabV3", "DeepLabV3Plus",
                         "Linknet", "MAnet", "PAN", "UPerNet", "Segformer") if hasattr(smp, n)]
    if cfg["arch"] not in archs:
        raise UserError(f"arch={cfg['arch']!r} is not allowed: use one of {', '.join(archs)}")
    names = smp.encoders.get_encoder_names()
    if cfg["encoder_name"] not in names:
        near = difflib.get_close_matches(cfg["encoder_name"], names, n=3)
        raise UserError(f"encoder_name={cfg['encoder_name']!r} is unknown: did you mean "
                        f"{', '.join(near) or 'resnet34'}? (smp.encoders.get_encoder_names() lists all)")


# ----------------------------------------------------------------------------------------------------
# Presets: CONFIG < preset < command line. "Explicit" keys (given on the command line, or passed to
# train() with a value that differs from CONFIG) keep their value; the preset sets the others.
# ----------------------------------------------------------------------------------------------------
def explicit_keys(args):
    """The keys named in a key=value list: what the user typed wins over a preset."""
    return {normalize_key(a.partition("=")[0]) for a in args}


def apply_preset(cfg, explicit=()):
    """Return (cfg with the preset applied, a one-line description for the banner or None)."""
    name = cfg.get("preset")
    if not name:
        return cfg, None
    explicit = set(explicit) | {k for k in cfg if k in CONFIG and cfg[k] != CONFIG[k] and k != "preset"}
    values = PRESETS[name]
    applied = {k: v for k, v in values.items() if k not in explicit}
    kept = [k for k in values if k in explicit]
    out = validate_config({**cfg, **applied})
    line = f"{name}: " + (", ".join(f"{k}={v}" for k, v in applied.items()) or "nothing")
    if kept:
        line += "; kept yours: " + ", ".join(f"{k}={out[k]}" for k in kept)
    return out, line


def preset_table():
    """The README's presets table, generated from PRESETS (a test checks the README holds it)."""
    rows = ["| preset | for | sets |", "|---|---|---|"]
    for name, values in PRESETS.items():
        rows.append(f"| `{name}` | {PRESET_USES[name]} | " + ", ".join(f"`{k}={v}`" for k, v in values.items())
                    + " |")
    return "\n".join(rows)


def first_line(exc, limit=160):
    return (str(exc).splitlines() or [""])[0][:limit]


def format_config(cfg):
    width = max(map(len, cfg))
    return "\n".join(f"  {k:<{width}} = {v!r}" for k, v in cfg.items())


# ----------------------------------------------------------------------------------------------------
# Precision: what the hardware really supports, and the one decision made from it.
# ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Hardware:
    device: str                   # "cpu", "cuda:0", "mps"
    kind: str                     # "cpu" | "cuda" | "mps"
    name: str
    capability: tuple | None      # CUDA compute capability, e.g. (8, 0)
    bf16: bool                    # native (fast) bf16 kernels
    fp16: bool                    # native (fast) fp16 kernels


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # short names


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype            # autocast dtype; float32 means autocast off
    use_scaler: bool              # GradScaler: only for float16
    reason: str                   # why this precision
    warning: str | None = None    # set when the request could not be honoured

    @property
    def amp(self):
        return self.dtype != torch.float32

    @property
    def name(self):
        return next(name for name, dtype in DTYPES.items() if dtype == self.dtype)


def cpu_name():
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "CPU"


def detect_hardware(device="auto"):
    if DIST.enabled and (device == "auto" or device.startswith("cuda")) and torch.cuda.is_available():
        device = f"cuda:{DIST.local_rank}"  # one GPU per process: LOCAL_RANK decides which
    if device == "auto":
        mps = getattr(torch.backends, "mps", None)
        device = "cuda" if torch.cuda.is_available() else "mps" if mps and mps.is_available() else "cpu"
    kind = torch.device(device).type
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device={device!r} but PyTorch sees no CUDA GPU: use device=auto or device=cpu")
        index = torch.device(device).index or 0
        if index >= torch.cuda.device_count():
            raise UserError(f"device={device!r} but only {torch.cuda.device_count()} GPU(s) are visible")
        cap = tuple(torch.cuda.get_device_capability(index))
        # Capability, not torch.cuda.is_bf16_supported(): that one says True on a T4 (7.5), where
        # bf16 is emulated and slow.
        return Hardware(f"cuda:{index}", "cuda", torch.cuda.get_device_name(index), cap,
                        bf16=cap >= (8, 0), fp16=cap >= (7, 0))
    if kind == "mps":
        if not torch.backends.mps.is_available():
            raise UserError("device='mps' but MPS is not available: use device=auto or device=cpu")
        bf16 = bool(getattr(torch.backends.mps, "is_macos_or_newer", lambda *a: False)(14, 0))
        return Hardware("mps", "mps", "Apple MPS", None, bf16=bf16, fp16=True)
    if kind != "cpu":
        raise UserError(f"device={device!r} is not supported: use auto, cpu, cuda, cuda:N or mps")
    # CPU fp16 autocast is never treated as native: measured ~70x slower than fp32 here, on a CPU
    # that even advertises avx512_fp16, because PyTorch's CPU convolutions have no fast fp16 path.
    return Hardware("cpu", "cpu", cpu_name(), None,
                    bf16=bool(torch.ops.mkldnn._is_mkldnn_bf16_supported()), fp16=False)


def describe(hw):
    cap = f", compute capability {hw.capability[0]}.{hw.capability[1]}" if hw.capability else ""
    return f"{hw.device} ({hw.name}{cap})"


def decide_precision(hw, use_amp=True, amp_dtype="auto", force=False):
    """The one place that chooses bf16 / fp16 / fp32, and says why."""
    if not use_amp:
        return Precision(torch.float32, False, "use_amp=False: plain fp32")
    if amp_dtype == "auto":
        if hw.bf16:
            return Precision(torch.bfloat16, False, "auto: native bf16 (fp32's range, no loss scaling)")
        if hw.fp16:
            return Precision(torch.float16, True, "auto: no native bf16, native fp16 -> fp16 + GradScaler")
        return Precision(torch.float32, False, "auto: no native bf16 or fp16 kernels -> fp32")
    assert amp_dtype in CHOICES["amp_dtype"], amp_dtype  # validated before; a bug otherwise
    dtype = torch.bfloat16 if amp_dtype == "bfloat16" else torch.float16
    native = hw.bf16 if dtype == torch.bfloat16 else hw.fp16
    if native or force:
        note = "" if native else " (force_amp_dtype=True: no native kernels, slow)"
        return Precision(dtype, dtype == torch.float16, f"{amp_dtype} as requested{note}")
    # Not native here: the automatic choice is the fallback (it can never be the requested dtype).
    auto = decide_precision(hw)
    return Precision(auto.dtype, auto.use_scaler, f"fallback from {amp_dtype}",
                     f"amp_dtype={amp_dtype} {missing_support(hw, amp_dtype)}: using {_dtype_label(auto)} "
                     f"instead (force_amp_dtype=True insists)")


def missing_support(hw, amp_dtype):
    if hw.kind == "cuda":
        need = "8.0" if amp_dtype == "bfloat16" else "7.0"
        return f"needs compute capability >= {need}, {hw.device} has {hw.capability[0]}.{hw.capability[1]}"
    if hw.kind == "cpu" and amp_dtype == "float16":
        return "has no fast CPU kernels (fp16 autocast runs 10-100x slower than fp32 there)"
    return f"is not native on {hw.device}"


def _dtype_label(p):
    return {"bf16": "bfloat16", "fp16": "float16 + GradScaler", "fp32": "float32"}[p.name]


def apply_tf32(setting, prec):
    """Apply tf32_matmul_precision; return a warning when it cannot matter for autocast ops."""
    if setting is None:
        return None
    torch.set_float32_matmul_precision(setting)
    torch.backends.cudnn.allow_tf32 = setting != "highest"
    if prec.amp:
        return (f"tf32_matmul_precision={setting} has no effect on autocast ops (they run in "
                f"{prec.name}); it only changes fp32 matmuls/convolutions, e.g. fp32 validation")
    return None


def banner(hw, prec, cfg, notes=()):
    lines = [
        f"device       {describe(hw)}  native bf16: {'yes' if hw.bf16 else 'no'}, "
        f"native fp16: {'yes' if hw.fp16 else 'no'}",
        f"precision    {prec.name} ({prec.reason}); GradScaler {'on' if prec.use_scaler else 'off'}",
        f"validation   {prec.name if cfg['eval_amp'] and prec.amp else 'fp32'}",
        f"tf32         {cfg['tf32_matmul_precision'] or 'not set (PyTorch default)'}",
        f"layout       {'channels_last' if cfg['channels_last'] else 'contiguous (NCHW)'}; "
        f"compile {'on' if cfg['compile_model'] else 'off'}",
    ] + [f"{n[0]:<12} {n[1]}" if isinstance(n, tuple) else f"note         {n}" for n in notes if n]
    rule = "=" * 78
    return "\n".join([rule, "unet-amp", *lines, rule])


# ----------------------------------------------------------------------------------------------------
# Data: the embedded shapes data set, the folder layout, checks with clear errors, loaders.
# ----------------------------------------------------------------------------------------------------
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
# Mask value of pixels that are not part of the image (padding, areas rotated in by augmentation):
# ignored by the loss and the metrics, so IoU is measured on real pixels only.
IGNORE_INDEX = 255
EMBEDDED_DATA_DIR = "data/shapes"


def generate_shapes_dataset(root, count=300, size=128, num_classes=1, seed=0):
    """Deterministic synthetic data: noisy textured backgrounds with circles, boxes and triangles.

    Binary masks are written as 0/255; multi-class masks as class indices (circle 1, box 2, ...).
    """
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        image, mask = draw_shapes(rng, size, num_classes)
        cv2.imwrite(str(root / "images" / f"shape_{i:04d}.png"), image)
        cv2.imwrite(str(root / "masks" / f"shape_{i:04d}.png"), mask)
    return root


def draw_shapes(rng, size, num_classes):
    yy, xx = np.mgrid[0:size, 0:size] / size
    base = rng.uniform(20, 110, 3)  # darker background with a colour gradient ...
    tilt = rng.uniform(-25, 25, (2, 3))
    image = base + xx[..., None] * tilt[0] + yy[..., None] * tilt[1]
    mask = np.zeros((size, size), np.uint8)
    for _ in range(rng.integers(1, 4)):
        shape = int(rng.integers(0, 3))
        layer = np.zeros((size, size), np.uint8)
        cx, cy = rng.integers(size // 6, size - size // 6, 2)
        r = int(rng.integers(size // 10, size // 4))
        if shape == 0:
            cv2.circle(layer, (int(cx), int(cy)), r, 1, -1)
        elif shape == 1:
            box = ((float(cx), float(cy)), (2.0 * r, 1.3 * r), float(rng.uniform(0, 180)))
            cv2.fillPoly(layer, [cv2.boxPoints(box).astype(np.int32)], 1)
        else:
            pts = np.array([[cx, cy - r], [cx - r, cy + r], [cx + r, cy + r]], np.int32)
            cv2.fillPoly(layer, [pts], 1)
        image[layer == 1] = rng.uniform(120, 255, 3)  # ... brighter shapes of any hue
        mask[layer == 1] = 255 if num_classes == 1 else min(shape + 1, num_classes - 1)
    # Grainy background, smooth shapes: texture and brightness both tell them apart.
    grain = np.where(mask[..., None] > 0, 5.0, 20.0)
    image = image + rng.normal(0, 1, image.shape) * grain
    return image.clip(0, 255).astype(np.uint8), mask


def has_files(folder):
    return Path(folder).exists() and any(p.is_file() for p in Path(folder).rglob("*"))


def write_embedded_dataset(root):
    """Write into a temporary folder, then rename: an interrupted first run leaves no half data set.

    Only ever called for a missing or empty folder: a user's files are never mixed or deleted.
    """
    root = Path(root)
    tmp = root.with_name(f".{root.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    generate_shapes_dataset(tmp)
    shutil.rmtree(root, ignore_errors=True)  # empty folders only (has_files checked by the caller)
    os.replace(tmp, root)
    return root


def find_pairs(folder):
    """Match <folder>/images/* with <folder>/masks/* by file stem."""
    folder = Path(folder)
    for sub in ("images", "masks"):
        if not (folder / sub).is_dir():
            raise UserError(f"{folder / sub} not found: put images in {folder}/images and masks with "
                            f"the same file names in {folder}/masks")
    images, masks = (index_by_stem(folder / sub) for sub in ("images", "masks"))
    if not images:
        raise UserError(f"no images ({', '.join(IMAGE_EXTS)}) in {folder / 'images'}")
    for missing, have, there, fix in ((set(images) - set(masks), images, folder / "masks", "add masks"),
                                      (set(masks) - set(images), masks, folder / "images", "add images")):
        if missing:
            names = ", ".join(have[s].name for s in sorted(missing)[:3])
            raise UserError(f"{len(missing)} file(s) have no partner in {there} (e.g. {names}): {fix} "
                            f"with the same file stem, or remove them")
    return [(images[s], masks[s]) for s in sorted(images)]


def index_by_stem(folder):
    found = {}
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() not in IMAGE_EXTS or path.name.startswith("."):
            continue
        if path.stem in found:
            raise UserError(f"{found[path.stem].name} and {path.name} in {folder} share the stem "
                            f"{path.stem!r}: keep one file per name")
        found[path.stem] = path
    return found


def read_image(path, channels):
    flag = cv2.IMREAD_COLOR if channels == 3 else cv2.IMREAD_GRAYSCALE
    image = cv2.imread(str(path), flag)
    if image is None:
        raise UserError(f"cannot read image {path} (corrupt or not an image): fix or remove it")
    return cv2.cvtColor(image, cv2.COLOR_BGR2RGB) if channels == 3 else image


def read_mask(path, num_classes):
    """A mask as class indices (uint8): 0/255 and 0/1 binary masks both become 0/1."""
    mask = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    if mask is None:
        raise UserError(f"cannot read mask {path} (corrupt or not an image): fix or remove it")
    if mask.ndim == 3:
        mask = mask[..., :3]  # ignore an alpha channel
        if not (mask == mask[..., :1]).all():
            raise UserError(f"mask {path} is a colour image: save masks as one channel of class indices")
        mask = mask[..., 0]
    values = set(np.unique(mask).tolist())
    if num_classes == 1:
        if values <= {0, 1} or values <= {0, 255}:
            return (mask > 0).astype(np.uint8)
        raise UserError(f"mask {path} holds values {sorted(values)[:8]}: with num_classes=1 masks must be "
                        f"0/1 or 0/255; {mask_hint(path, mask, values)}")
    if max(values) >= num_classes:
        hint = ("0/255 masks are binary: use num_classes=1" if values == {0, 255} else
                f"set num_classes={max(values) + 1} or fix the mask")
        raise UserError(f"mask {path} holds class {max(values)} but num_classes={num_classes}: {hint}")
    return mask.astype(np.uint8)


def mask_hint(path, mask, values):
    if mask.dtype != np.uint8:
        return f"this {mask.dtype} mask needs saving as 8-bit 0/255 or 0/1"
    if Path(path).suffix.lower() in (".jpg", ".jpeg"):
        return "JPEG blurs the edges: save masks as PNG"
    if len(values) <= 16 and max(values) < 16:
        return f"class indices? set num_classes={max(values) + 1}"
    return "anti-aliased edges? save masks with exact values only"


def check_pairs(pairs, cfg):
    """Read every image and mask once before training, so a bad file stops the run at minute 0."""
    def check(pair):
        image = read_image(pair[0], cfg["in_channels"])
        mask = read_mask(pair[1], cfg["num_classes"])
        if image.shape[:2] != mask.shape[:2]:
            raise UserError(f"image {pair[0]} is {image.shape[1]}x{image.shape[0]} but its mask is "
                            f"{mask.shape[1]}x{mask.shape[0]}: they must have the same size")
    with ThreadPoolExecutor(max_workers=4) as pool:  # cv2 releases the GIL while decoding
        list(pool.map(check, pairs))


def prepare_data(cfg):
    """Return (train_pairs, val_pairs); generate the embedded data set on first use."""
    root = Path(cfg["data_dir"])
    if DIST.is_main and root == Path(EMBEDDED_DATA_DIR) and not has_files(root):
        print(f"no data in {root}: writing the embedded shapes data set there (300 PNG pairs)")
        write_embedded_dataset(root)
    barrier()  # the other ranks wait until rank 0 has written it
    if not root.is_dir():
        raise UserError(f"data_dir {root} not found: create {root}/images and {root}/masks, or use "
                        f"data_dir={EMBEDDED_DATA_DIR} for the embedded data set")
    split = [(root / name).is_dir() for name in ("train", "val")]
    if split == [True, False] or split == [False, True]:
        have, missing = ("train", "val") if split[0] else ("val", "train")
        raise UserError(f"{root} has {have}/ but no {missing}/: add {root}/{missing}/images and masks, or "
                        f"put all pairs in {root}/images and {root}/masks for a split by val_fraction")
    if all(split):
        train, val = find_pairs(root / "train"), find_pairs(root / "val")
    else:
        pairs = find_pairs(root)
        order = np.random.default_rng(cfg["seed"]).permutation(len(pairs))
        n_val = max(1, round(len(pairs) * cfg["val_fraction"]))
        if len(pairs) - n_val < 1:
            raise UserError(f"{root} has only {len(pairs)} image(s): need at least 2 to split train/val")
        val = [pairs[i] for i in sorted(order[:n_val])]
        train = [pairs[i] for i in sorted(order[n_val:])]
    train = train[:cfg["max_train_images"]]
    check_pairs(train + val, cfg)
    if len(train) // DIST.world < cfg["batch_size"]:
        per = f" ({len(train) // DIST.world} per process)" if DIST.enabled else ""
        raise UserError(f"the training set has {len(train)} image(s){per}, fewer than batch_size="
                        f"{cfg['batch_size']}: lower batch_size or add images")
    return train, val


def build_transforms(cfg, train):
    import albumentations as A

    size = cfg["image_size"]
    # Keep the aspect ratio and pad at the bottom/right, so predictions crop back exactly.
    fit = [A.LongestMaxSize(max_size=size),
           A.PadIfNeeded(size, size, position="top_left", border_mode=cv2.BORDER_CONSTANT, fill=0,
                         fill_mask=IGNORE_INDEX)]
    augment = [A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5),
               A.Affine(scale=(0.9, 1.1), translate_percent=(-0.05, 0.05), rotate=(-15, 15),
                        fill_mask=IGNORE_INDEX, p=0.5),
               A.RandomBrightnessContrast(0.2, 0.2, p=0.5)] if train else []
    mean, std = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) if cfg["in_channels"] == 3 else \
        ((0.5,), (0.25,))
    return A.Compose(fit + augment + [A.Normalize(mean=mean, std=std)])


class SegDataset(Dataset):
    """(image, mask) pairs -> (float tensor CxHxW, long tensor HxW of class indices).

    Augmentation is seeded from (seed, epoch, index): the same on every worker count and after resume.
    """

    def __init__(self, pairs, cfg, train):
        self.pairs, self.cfg, self.train = pairs, cfg, train
        self.transform = build_transforms(cfg, train)
        self.epoch = 0

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        image_path, mask_path = self.pairs[index]
        image = read_image(image_path, self.cfg["in_channels"])
        mask = read_mask(mask_path, self.cfg["num_classes"])
        self.transform.set_random_seed(hash((self.cfg["seed"], self.epoch, index)) % 2**31)
        out = self.transform(image=image, mask=mask)
        image = out["image"][..., None] if out["image"].ndim == 2 else out["image"]
        return torch.from_numpy(image.transpose(2, 0, 1).copy()), torch.from_numpy(out["mask"]).long()


def worker_count(cfg, hw):
    if cfg["num_workers"] is not None:
        return cfg["num_workers"]
    return 0 if hw.kind == "cpu" else min(8, max(1, (os.cpu_count() or 2) // 2))


def build_loaders(train_pairs, val_pairs, cfg, hw):
    workers = worker_count(cfg, hw)
    common = dict(num_workers=workers, pin_memory=hw.kind == "cuda")
    train_set, val_set = SegDataset(train_pairs, cfg, True), SegDataset(val_pairs, cfg, False)
    # drop_last: every micro-batch has batch_size images, so accumulation weights are exact and
    # BatchNorm never sees a batch of one.
    if DIST.enabled:
        sampler = torch.utils.data.DistributedSampler(train_set, DIST.world, DIST.rank, shuffle=True,
                                                      seed=cfg["seed"], drop_last=True)
        train_loader = DataLoader(train_set, cfg["batch_size"], sampler=sampler, drop_last=True, **common)
    else:
        train_loader = DataLoader(train_set, cfg["batch_size"], shuffle=True, drop_last=True,
                                  generator=torch.Generator().manual_seed(cfg["seed"]), **common)
    # Validation shards the set without padding (rank r takes r, r+world, ...): with the counts
    # all-reduced, every image is counted exactly once, so the IoU equals a single process's.
    val_order = list(range(DIST.rank, len(val_set), DIST.world))
    val_loader = DataLoader(val_set, cfg["batch_size"], sampler=val_order, **common)
    return train_loader, val_loader


def start_epoch_data(loader, epoch, seed):
    """Same shuffle and augmentation for a given epoch, whether or not the run was resumed."""
    loader.dataset.epoch = epoch
    if isinstance(loader.sampler, torch.utils.data.DistributedSampler):
        loader.sampler.set_epoch(epoch)
    elif loader.generator is not None:
        loader.generator.manual_seed(seed * 1000 + epoch)


# ----------------------------------------------------------------------------------------------------
# Model, loss, optimizer, schedule
# ----------------------------------------------------------------------------------------------------
def build_model(cfg):
    import segmentation_models_pytorch as smp

    try:
        return getattr(smp, cfg["arch"])(encoder_name=cfg["encoder_name"],
                                         encoder_weights=cfg["encoder_weights"],
                                         in_channels=cfg["in_channels"], classes=cfg["num_classes"])
    except (OSError, ConnectionError, RuntimeError) as exc:
        if cfg["encoder_weights"] is None:
            raise
        raise UserError(f"could not get encoder_weights={cfg['encoder_weights']!r} for "
                        f"{cfg['encoder_name']} ({type(exc).__name__}: {str(exc)[:120]}): to run "
                        f"offline use encoder_weights=None, or place the weights in the torch/HF "
                        f"cache first") from None
    except (KeyError, ValueError) as exc:
        raise UserError(f"cannot build {cfg['arch']}({cfg['encoder_name']}, encoder_weights="
                        f"{cfg['encoder_weights']!r}): {str(exc)[:200]}") from None


class SegLoss(nn.Module):
    """Cross-entropy (BCE for binary) + Dice from smp, always evaluated in fp32; padding ignored."""

    def __init__(self, num_classes, kind="dice+ce"):
        super().__init__()
        import segmentation_models_pytorch as smp

        self.binary = num_classes == 1
        mode = "binary" if self.binary else "multiclass"
        self.dice = smp.losses.DiceLoss(mode, from_logits=True, ignore_index=IGNORE_INDEX) \
            if "dice" in kind else None
        self.ce = "ce" in kind
        self.multi_ce = nn.CrossEntropyLoss(ignore_index=IGNORE_INDEX)

    def forward(self, logits, target):
        logits = logits.float()
        loss = logits.new_zeros(())
        if self.ce and self.binary:  # BCE averaged over the real (not ignored) pixels
            valid = (target != IGNORE_INDEX).unsqueeze(1).float()
            bce = nn.functional.binary_cross_entropy_with_logits(
                logits, (target.unsqueeze(1) == 1).float(), reduction="none")
            loss = loss + (bce * valid).sum() / valid.sum().clamp(min=1)
        elif self.ce:
            loss = loss + self.multi_ce(logits, target)
        if self.dice is not None:
            loss = loss + self.dice(logits, target.unsqueeze(1) if self.binary else target)
        return loss


def build_optimizer(model, cfg):
    # No weight decay on biases and norm parameters (1-D tensors): decaying them only hurts.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=cfg["learning_rate"])


def build_scheduler(optimizer, cfg, steps_per_epoch):
    """Linear warm-up, then cosine to 1% of the peak LR; stepped once per optimizer step."""
    total = max(1, cfg["epochs"] * steps_per_epoch)
    warmup = int(total * cfg["warmup_fraction"])

    def factor(step):
        if step < warmup:
            return (step + 1) / (warmup + 1)
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return 0.01 + 0.99 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def build_scaler(prec, hw, cfg):
    """GradScaler only for float16: bf16 and fp32 have fp32's range and need no loss scaling."""
    if not prec.use_scaler:
        return None
    return torch.amp.GradScaler(hw.kind, init_scale=cfg["init_scale"], growth_factor=cfg["growth_factor"],
                                backoff_factor=cfg["backoff_factor"], growth_interval=cfg["growth_interval"])


def optimizer_steps_per_epoch(n_batches, accumulation_steps):
    return math.ceil(n_batches / accumulation_steps)


def unwrap(model):
    """The plain nn.Module under torch.compile / DDP wrappers (state_dict keys without prefixes)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod"):
            model = model._orig_mod
        else:
            return model


# ----------------------------------------------------------------------------------------------------
# Metrics: dataset-level IoU / Dice from a confusion matrix kept on the device.
# ----------------------------------------------------------------------------------------------------
class SegMetric:
    """Accumulates a class confusion matrix (int64, on the device: no host sync per batch).

    Binary (num_classes=1): IoU and Dice are those of the foreground class. Target pixels equal to
    IGNORE_INDEX (padding) are not counted.
    Multi-class: per-class IoU/Dice; the mean is over classes present in the target or the
    prediction. A class absent from both over the whole set (TP+FP+FN = 0) has no IoU (NaN) and is
    left out of the mean; if every class is absent, the mean is 1.0 (nothing to find, nothing found).
    """

    def __init__(self, num_classes, device="cpu"):
        self.binary = num_classes == 1
        self.n = 2 if self.binary else num_classes
        self.matrix = torch.zeros(self.n, self.n, dtype=torch.int64, device=device)

    @torch.no_grad()
    def update(self, logits, target):
        pred = (logits[:, 0] > 0).long() if self.binary else logits.argmax(1)
        target = target.reshape(-1).long()
        # Ignored pixels go to an extra bin that is dropped: no boolean indexing, so no host sync.
        index = torch.where(target == IGNORE_INDEX, self.n * self.n, target * self.n + pred.reshape(-1))
        counts = torch.bincount(index, minlength=self.n * self.n + 1)[:self.n * self.n]
        self.matrix += counts.reshape(self.n, self.n)

    def all_reduce(self):
        """Sum the counts over ranks (exact: integers), so every rank sees the whole set's IoU."""
        all_reduce_(self.matrix)
        return self

    def counts(self):
        """Per-class (TP, FP, FN) as int64 tensors; rows of the matrix are targets, columns predictions."""
        tp = self.matrix.diag()
        return tp, self.matrix.sum(0) - tp, self.matrix.sum(1) - tp

    def compute(self):
        tp, fp, fn = (c.double() for c in self.counts())
        union = tp + fp + fn
        iou = torch.where(union > 0, tp / union.clamp(min=1), torch.nan)
        dice = torch.where(union > 0, 2 * tp / (2 * tp + fp + fn).clamp(min=1), torch.nan)
        if self.binary:
            iou, dice = iou[1:], dice[1:]
        present = ~torch.isnan(iou)
        mean_iou = iou[present].mean().item() if present.any() else 1.0
        mean_dice = dice[present].mean().item() if present.any() else 1.0
        return {"iou": mean_iou, "dice": mean_dice, "per_class_iou": iou.tolist(),
                "per_class_dice": dice.tolist()}


# ----------------------------------------------------------------------------------------------------
# Per-class metrics: names from <data_dir>/class_names.txt, history columns, the end-of-run table.
# ----------------------------------------------------------------------------------------------------
def load_class_names(cfg):
    """Class names, one per line, class 0 first (VOC/labelme convention); indices when there is no file.

    Binary runs have one class, the foreground: the file may list it alone or after the background.
    """
    n = cfg["num_classes"]
    path = Path(cfg["data_dir"]) / "class_names.txt"
    if not path.is_file():
        return ["foreground"] if n == 1 else [str(i) for i in range(n)]
    try:
        names = [line.strip() for line in path.read_text(encoding="utf-8").rstrip("\n").splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path} ({type(exc).__name__}): save it as UTF-8 text, one class "
                        f"name per line") from None
    allowed = (1, 2) if n == 1 else (n,)
    if len(names) not in allowed:
        want = "1 (the foreground) or 2 (background, foreground)" if n == 1 else str(n)
        raise UserError(f"{path} has {len(names)} line(s) but num_classes={n} needs {want}: one class "
                        f"name per line, class 0 first (e.g. background)")
    slugs = [class_slug(name) for name in names]
    if not all(slugs) or len(set(slugs)) < len(slugs):
        raise UserError(f"{path}: every line needs a distinct, non-empty name (letters, digits, _), "
                        f"got {names}")
    return names[-1:] if n == 1 else names


def class_slug(name):
    """A class name as it appears in column names and TensorBoard tags: 'road sign' -> 'road_sign'."""
    return re.sub(r"\W+", "_", name).strip("_")


def per_class_columns(result, names, prefix="val"):
    """{'val_iou_<name>': ..., 'val_dice_<name>': ...} for multi-class runs; binary runs have none
    (their one class, the foreground, is val_iou itself)."""
    if len(names) < 2:
        return {}
    cols = {f"{prefix}_iou_{class_slug(n)}": v for n, v in zip(names, result["per_class_iou"])}
    cols.update({f"{prefix}_dice_{class_slug(n)}": v for n, v in zip(names, result["per_class_dice"])})
    return cols


def per_class_table(row, names):
    """The end-of-run table: IoU and Dice per class of one history row (multi-class runs)."""
    if len(names) < 2:
        return None
    width = max(len("class"), *map(len, names))
    lines = [f"  {'class':<{width}}    IoU    Dice"]
    for name in names:
        iou, dice = row[f"val_iou_{class_slug(name)}"], row[f"val_dice_{class_slug(name)}"]
        cells = "absent from the val set" if math.isnan(iou) else f"{iou:.4f}  {dice:.4f}"
        lines.append(f"  {name:<{width}}  {cells}")
    lines.append(f"  {'mean':<{width}}  {row['val_iou']:.4f}  {row['val_dice']:.4f}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Train / eval step
# ----------------------------------------------------------------------------------------------------
@dataclass
class StepStats:
    """What one epoch of training saw: the history's gradient-health columns."""
    optimizer_steps: int = 0
    skipped_steps: int = 0        # not applied: non-finite loss/gradients (fp16: the scaler skipped)
    grad_norm_sum: float = 0.0    # pre-clip gradient norm over the applied steps
    grad_norm_max: float = 0.0
    zero_grad_elems: int = 0      # gradient entries exactly 0 (fp16 underflow shows up here)
    grad_elems: int = 0
    bad_streak: int = 0           # consecutive bad steps, for the fallback decision

    @property
    def grad_norm(self):
        return self.grad_norm_sum / max(1, self.optimizer_steps - self.skipped_steps)

    @property
    def zero_grad_pct(self):
        return 100.0 * self.zero_grad_elems / max(1, self.grad_elems)


class NonFiniteStreak(Exception):
    """Internal: nan_patience bad steps in a row. train() falls back to a safer precision."""

    def __init__(self, step, batch):
        super().__init__(f"non-finite loss or gradients for several steps up to step {step}")
        self.step, self.batch = step, batch


def synchronize(hw):
    if hw.kind == "cuda":
        torch.cuda.synchronize(hw.device)


def to_device(x, y, hw, channels_last):
    x = x.to(hw.device, non_blocking=True)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y.to(hw.device, non_blocking=True)


def optimizer_step(model, optimizer, scaler, cfg, loss_ok):
    """Unscale once, measure (and clip) the gradient norm, step unless something is non-finite.

    `loss_ok` is a device bool: every loss of this accumulation group was finite. Returns
    (pre-clip norm, zero-gradient entries, gradient entries, applied, bad). With nan_guard on this
    costs one host sync per optimizer step (never per micro-batch); under fp16 the scaler already
    makes that sync. A step is `bad` when it is skipped for non-finite values; under fp16 a skip
    with a finite loss is the scaler's normal business, unless its scale has fallen below 1.
    """
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if cfg["grad_clip_norm"] is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip_norm"])
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    zeros = sum((g == 0).sum() for g in grads) if grads else torch.zeros((), dtype=torch.int64)
    elems = sum(g.numel() for g in grads)
    if scaler is not None:
        scale_before = scaler.get_scale()
        scaler.step(optimizer)  # skips the step itself when it finds inf/NaN gradients
        scaler.update()
        applied = scaler.get_scale() >= scale_before  # the scale backs off exactly when it skipped
        # Bad: a non-finite loss (a forward overflow no scale can fix), or gradients that overflow
        # even with the loss scaled *down* (scale < 1): fp16 cannot hold them.
        bad = cfg["nan_guard"] and (not bool(loss_ok) or (not applied and scaler.get_scale() < 1.0))
    elif cfg["nan_guard"]:
        applied = bool(torch.isfinite(norm) & loss_ok)
        if applied:
            optimizer.step()
        bad = not applied
    else:  # plain PyTorch behaviour: no check, no sync
        optimizer.step()
        applied, bad = True, False
    optimizer.zero_grad(set_to_none=True)
    return norm.detach(), zeros, elems, applied, bad


def record_step(stats, norm, zeros, elems, applied, bad):
    stats.optimizer_steps += 1
    stats.skipped_steps += not applied
    stats.bad_streak = stats.bad_streak + 1 if bad else 0
    if applied:
        value = float(norm)
        stats.grad_norm_sum += value
        stats.grad_norm_max = max(stats.grad_norm_max, value)
        stats.zero_grad_elems += int(zeros)
        stats.grad_elems += elems


def show_progress(bar, loss, metric, seen, start):
    """Loss, IoU so far and images/s on a tqdm bar; returns the time of this refresh."""
    now = time.perf_counter()
    bar.set_postfix(loss=f"{loss:.4f}", iou=f"{metric.compute()['iou']:.3f}", img_s=f"{seen / (now - start):.1f}")
    return now


def forward_backward(model, x, y, loss_fn, scaler, prec, hw, group_len, boundary):
    """Forward under autocast, fp32 loss outside it, backward of loss / group size (scaled for fp16)."""
    # Under DDP, all-reduce gradients only on the micro-batch that ends a group.
    sync = model.no_sync() if hasattr(model, "no_sync") and not boundary else contextlib.nullcontext()
    with sync:
        with torch.autocast(hw.kind, dtype=prec.dtype, enabled=prec.amp):
            logits = model(x)
        loss = loss_fn(logits, y)
        scaled = loss / group_len
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
    return logits, loss


def train_one_epoch(model, loader, loss_fn, optimizer, scheduler, scaler, prec, hw, cfg, desc="train",
                    streak=0, logger=None):
    """One pass over `loader`; `streak` carries consecutive bad steps over from the last epoch."""
    model.train()
    n, k = len(loader), cfg["accumulation_steps"]
    metric = SegMetric(cfg["num_classes"], hw.device)
    loss_sum = torch.zeros((), device=hw.device, dtype=torch.float64)
    finite_losses = torch.zeros((), device=hw.device, dtype=torch.int64)
    group_ok = torch.ones((), device=hw.device, dtype=torch.bool)
    stats, seen, start, last_refresh = StepStats(bad_streak=streak), 0, time.perf_counter(), 0.0
    # A NaN batch would poison BatchNorm's running statistics even though its step is skipped: keep
    # the buffers as they were at the start of each accumulation group (a device copy, no sync).
    buffers = list(model.buffers()) if cfg["nan_guard"] else []
    saved = [b.detach().clone() for b in buffers]
    bar = tqdm(loader, desc=desc, leave=False, disable=not cfg["progress"], dynamic_ncols=True)
    optimizer.zero_grad(set_to_none=True)
    for i, (x, y) in enumerate(bar):
        x, y = to_device(x, y, hw, cfg["channels_last"])
        group_start = i - i % k
        group_len = min(k, n - group_start)  # the last group of an epoch may be short
        if i == group_start:
            for b, keep in zip(buffers, saved):
                keep.copy_(b)
        boundary = i - group_start + 1 == group_len
        logits, loss = forward_backward(model, x, y, loss_fn, scaler, prec, hw, group_len, boundary)
        finite = torch.isfinite(loss.detach())  # stays on the device: no sync per micro-batch
        group_ok &= finite
        loss_sum += torch.where(finite, loss.detach(), 0.0)
        finite_losses += finite
        metric.update(logits.detach(), y)
        seen += x.shape[0]
        if boundary:
            if DIST.enabled:  # every rank must take the same decision: bad if any rank's loss was
                group_ok = all_reduce_(group_ok.to(torch.int32), "min").bool()
            for b, keep in zip(buffers, saved):
                b.copy_(torch.where(group_ok, b, keep))
            step = optimizer_step(model, optimizer, scaler, cfg, group_ok)
            record_step(stats, *step)
            if logger is not None:  # buffers device tensors: no host sync
                logger.log_step(scheduler, loss_sum, finite_losses, step[0], scaler)
            scheduler.step()
            group_ok = torch.ones((), device=hw.device, dtype=torch.bool)
            if stats.bad_streak >= cfg["nan_patience"]:
                raise NonFiniteStreak(scheduler.last_epoch, (x, y))
        if cfg["progress"] and time.perf_counter() - last_refresh > 0.5:  # a sync at most 2x/second
            last_refresh = show_progress(bar, loss_sum.item() / max(1, finite_losses.item()), metric, seen, start)
    bar.close()
    synchronize(hw)  # CUDA runs asynchronously: wait for the last kernel before reading the clock
    elapsed = time.perf_counter() - start
    result = metric.all_reduce().compute()
    all_reduce_(loss_sum), all_reduce_(finite_losses)
    seen *= DIST.world
    return {"loss": loss_sum.item() / max(1, finite_losses.item()), "iou": result["iou"],
            "dice": result["dice"], "time": elapsed, "images_per_s": seen / elapsed if elapsed else 0.0,
            "stats": stats}


@torch.no_grad()
def evaluate(model, loader, loss_fn, prec, hw, cfg, desc="val"):
    """Loss and dataset-level IoU/Dice; in fp32 unless eval_amp=True."""
    model.eval()
    use_amp = prec.amp and cfg["eval_amp"]
    metric = SegMetric(cfg["num_classes"], hw.device)
    totals = torch.zeros(2, device=hw.device, dtype=torch.float64)  # loss * images, images
    bar = tqdm(loader, desc=desc, leave=False, disable=not cfg["progress"], dynamic_ncols=True)
    start, last_refresh = time.perf_counter(), 0.0
    for x, y in bar:
        x, y = to_device(x, y, hw, cfg["channels_last"])
        with torch.autocast(hw.kind, dtype=prec.dtype, enabled=use_amp):
            logits = model(x)
        totals[0] += loss_fn(logits, y).detach() * x.shape[0]
        totals[1] += x.shape[0]
        metric.update(logits, y)
        if cfg["progress"] and time.perf_counter() - last_refresh > 0.5:  # a sync at most 2x/second
            loss_now, seen = totals.tolist()
            last_refresh = show_progress(bar, loss_now / seen, metric, seen, start)
    bar.close()
    loss_sum, count = all_reduce_(totals).tolist()
    return {"loss": loss_sum / max(1, count), **metric.all_reduce().compute()}


# ----------------------------------------------------------------------------------------------------
# Checkpoints and history: atomic writes, weights_only loads, exact resume.
# ----------------------------------------------------------------------------------------------------
def atomic_write(path, write):
    """write(tmp_path), then rename over path: a crash never leaves a half-written file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def save_checkpoint(path, state):
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_checkpoint(path, map_location="cpu"):
    path = Path(path)
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found")
    try:
        state = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # pickle, zip and weights_only errors all mean "not our checkpoint"
        raise UserError(f"{path} is not a readable checkpoint of this trainer "
                        f"({type(exc).__name__}: {first_line(exc)})") from None
    if not isinstance(state, dict) or not {"model", "config"} <= set(state):
        raise UserError(f"{path} is not a checkpoint of this trainer (no 'model'/'config' inside)")
    return state


def rng_state():
    """RNG states as tensors and plain Python values, so weights_only=True can load them."""
    np_state = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else []}


def set_rng_state(state):
    torch.set_rng_state(state["torch"])
    random.setstate(tuple(tuple(s) if isinstance(s, list) else s for s in state["python"]))
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


HISTORY_FIELDS = ("epoch", "train_loss", "val_loss", "train_iou", "train_dice", "val_iou", "val_dice", "lr",
                  "epoch_time_s", "val_time_s", "images_per_s", "peak_mem_mb", "peak_mem_kind", "precision",
                  "grad_norm", "grad_norm_max", "zero_grad_pct", "scaler_scale", "optimizer_steps",
                  "skipped_steps", "fallback")


def write_history(path, history):
    # The fixed columns, then the per-class ones (val_iou_<class>, ...): they follow num_classes.
    fields = list(HISTORY_FIELDS) + [k for k in (history[0] if history else {}) if k not in HISTORY_FIELDS]

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
            writer.writeheader()
            writer.writerows(history)
    atomic_write(path, write)


def write_json(path, data):
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2, default=str) + "\n"))


def archive_previous_run(ckpt_dir, names=("last.pt", "best.pt", "history.csv", "config.json", "tensorboard")):
    """A fresh run never overwrites an earlier one: its files move to <ckpt_dir>/previous/<time>/."""
    ckpt_dir = Path(ckpt_dir)
    old = [ckpt_dir / n for n in names if (ckpt_dir / n).exists()]
    if not old:
        return None
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    dest = ckpt_dir / "previous" / stamp
    while dest.exists():  # two runs in one second must not share (and overwrite) a folder
        n += 1
        dest = ckpt_dir / "previous" / f"{stamp}-{n}"
    dest.mkdir(parents=True)
    for path in old:
        shutil.move(str(path), dest / path.name)
    return dest


def peak_memory_mb(hw):
    """CUDA: peak allocated by tensors this run. CPU: peak resident memory of this process."""
    if hw.kind == "cuda":
        return torch.cuda.max_memory_allocated(hw.device) / 2**20, "cuda_max_allocated"
    try:
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / (2**20 if sys.platform == "darwin" else 2**10), "process_peak_rss"
    except ImportError:
        return float("nan"), "unavailable"


# ----------------------------------------------------------------------------------------------------
# Logging: TensorBoard events in <checkpoint_dir>/tensorboard/, written by rank 0. Per-step values stay
# on the device until the epoch ends and then cross to the host in one transfer: no extra host sync
# per step. history.csv is written either way.
# ----------------------------------------------------------------------------------------------------
TENSORBOARD_DIR = "tensorboard"


def tensorboard_installed():
    import importlib.util
    return importlib.util.find_spec("tensorboard") is not None


class RunLogger:
    """log_step() per optimizer step, log_epoch(row) per epoch, close() at the end. A no-op when off."""

    def __init__(self, log_dir=None, cfg=None):
        self.writer, self.steps = None, []   # steps: (global step, lr, [device scalars])
        if log_dir is not None:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(str(log_dir))
            self.writer.add_text("config", "```\n" + json.dumps(cfg, indent=2, default=str) + "\n```")

    @classmethod
    def create(cls, cfg):
        """The run's logger for `logger=auto|tensorboard|csv|none`; only rank 0 writes."""
        kind = cfg["logger"]
        if kind == "tensorboard" and not tensorboard_installed():
            raise UserError("logger=tensorboard but the tensorboard package is not installed: "
                            "pip install tensorboard (it is in requirements.txt), or use logger=csv")
        on = kind == "tensorboard" or (kind == "auto" and tensorboard_installed())
        return cls(Path(cfg["checkpoint_dir"]) / TENSORBOARD_DIR, cfg) if on and DIST.is_main else cls()

    def log_step(self, scheduler, loss_sum, loss_count, grad_norm, scaler):
        """Buffer one optimizer step: the loss over its micro-batches (from the epoch's running sums),
        the learning rate it used, its pre-clip gradient norm and the loss scale (fp16)."""
        if self.writer is None:
            return
        values = [loss_sum.detach().clone(), loss_count.detach().clone(), grad_norm.detach()]
        scale = scaler._get_scale_async() if scaler is not None else None  # the tensor: no sync
        if scale is not None:
            values.append(scale.detach().clone())
        self.steps.append((scheduler.last_epoch + 1, scheduler.get_last_lr()[0], values))

    def flush_steps(self, group="step"):
        """Write the buffered steps: one device-to-host transfer for the whole epoch. Steps undone by a
        precision fallback go to group "rolled_back", so the re-run's steps do not overlap them."""
        if self.writer is None or not self.steps:
            return
        rows = torch.stack([torch.stack([v.double() for v in values])
                            for _, _, values in self.steps]).tolist()
        prev_sum = prev_count = 0.0  # the buffer holds one epoch: its running sums start at 0
        for (step, lr, _), row in zip(self.steps, rows):
            loss_sum, count, norm = row[:3]
            n = count - prev_count
            self.writer.add_scalar(f"{group}/loss", (loss_sum - prev_sum) / n if n else math.nan, step)
            self.writer.add_scalar(f"{group}/lr", lr, step)
            self.writer.add_scalar(f"{group}/grad_norm", norm, step)
            if len(row) > 3:
                self.writer.add_scalar(f"{group}/loss_scale", row[3], step)
            prev_sum, prev_count = loss_sum, count
        self.steps = []
        self.writer.flush()

    def log_epoch(self, row):
        """The epoch's history row: losses, IoU/Dice (per class too), speed, memory, gradient health."""
        if self.writer is None:
            return
        self.flush_steps()
        epoch = row["epoch"]
        for key, value in row.items():
            if key == "epoch" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            group = "class" if key.startswith(("val_iou_", "val_dice_")) else "epoch"
            self.writer.add_scalar(f"{group}/{key}", value, epoch)
        self.writer.add_text("precision", f"epoch {epoch}: {row['precision']}", epoch)
        if row.get("fallback"):
            self.writer.add_text("fallback", row["fallback"], epoch)
        self.writer.flush()

    def close(self):
        if self.writer is not None:
            self.flush_steps()
            self.writer.close()
            self.writer = None


# ----------------------------------------------------------------------------------------------------
# Predict: masks for new images from a checkpoint, at each image's original size.
# ----------------------------------------------------------------------------------------------------
PREDICT_CONFIG = {
    "checkpoint": "checkpoints/best.pt",
    "input": "data/shapes/images",  # an image file or a folder of images
    "output": "predictions",        # one <stem>.png mask per image (0/255 binary, class indices else)
    "overlay": False,               # also write <stem>_overlay.png: the mask blended on the image
    "batch_size": 8,
    "device": "auto",
    "use_amp": True,                # same capability check as training; False = fp32
    "amp_dtype": "auto",
    "force_amp_dtype": False,
    "progress": True,
}


def load_model(checkpoint, hw):
    """Rebuild the model from the config stored in a checkpoint; returns (model in eval mode, cfg)."""
    state = load_checkpoint(checkpoint)
    cfg = validate_config({**CONFIG, **{k: v for k, v in state["config"].items() if k in CONFIG}})
    model = build_model({**cfg, "encoder_weights": None})  # the weights come from the checkpoint
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as exc:
        raise UserError(f"{checkpoint} does not match the model its config describes: "
                        f"{first_line(exc)}") from None
    return model.to(hw.device).eval(), cfg


def list_images(path):
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise UserError(f"input {path} not found: give an image file or a folder of images")
    images = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_EXTS and not p.name.startswith("."))
    if not images:
        raise UserError(f"no images ({', '.join(IMAGE_EXTS)}) in {path}")
    return images


def check_writable(folder, key="output"):
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{key} {folder} is a file, not a folder: choose another {key}=...")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_test_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"{key} folder {folder} is not writable ({exc.strerror}): choose another "
                        f"{key}=...") from None


def valid_region(transform, height, width):
    """Where the image lands inside the padded square: transform an all-ones mask and look."""
    ones = np.ones((height, width), np.uint8)
    placed = transform(image=np.zeros((height, width, 3), np.uint8), mask=ones)["mask"]
    rows, cols = np.nonzero(placed == 1)
    return rows.max() + 1, cols.max() + 1  # padding is at the bottom/right (position="top_left")


@torch.no_grad()
def predict_batch(model, images, cfg, prec, hw):
    """Images (HxW or HxWxC uint8, any sizes) -> masks of class indices (uint8) at the same sizes.

    Same preprocessing as validation; logits are cropped to the image's area and resized back.
    """
    transform = build_transforms(cfg, train=False)
    tensors = []
    for image in images:
        out = transform(image=image)["image"]
        out = out[..., None] if out.ndim == 2 else out
        tensors.append(torch.from_numpy(out.transpose(2, 0, 1).copy()))
    x = torch.stack(tensors).to(hw.device)
    if cfg["channels_last"]:
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.inference_mode(), torch.autocast(hw.kind, dtype=prec.dtype, enabled=prec.amp):
        logits = model(x)
    masks = []
    for image, logit in zip(images, logits.float()):
        h, w = image.shape[:2]
        vh, vw = valid_region(transform, h, w)
        logit = logit[:, :vh, :vw]
        if (vh, vw) != (h, w):
            logit = torch.nn.functional.interpolate(logit[None], size=(h, w), mode="bilinear",
                                                    align_corners=False)[0]
        mask = (logit[0] > 0) if cfg["num_classes"] == 1 else logit.argmax(0)
        masks.append(mask.to(torch.uint8).cpu().numpy())
    return masks


def mask_to_png(mask, num_classes):
    return mask * 255 if num_classes == 1 else mask


def overlay_image(image, mask, alpha=0.45):
    """RGB/gray image with each class > 0 tinted by a fixed palette (returned as BGR for cv2)."""
    rgb = np.repeat(image[..., None], 3, axis=2) if image.ndim == 2 else image
    palette = np.array([[0, 0, 0], [255, 60, 60], [60, 200, 60], [60, 90, 255], [240, 200, 40],
                        [200, 60, 220], [40, 210, 220]], np.float32)
    colour = palette[1:][(mask.astype(np.int64) - 1) % (len(palette) - 1)]
    blended = np.where(mask[..., None] > 0, (1 - alpha) * rgb + alpha * colour, rgb)
    return cv2.cvtColor(blended.astype(np.uint8), cv2.COLOR_RGB2BGR)


def validate_predict(opts):
    check_types(opts, PREDICT_CONFIG)
    if opts["batch_size"] < 1:
        raise UserError(f"batch_size={opts['batch_size']} must be a whole number >= 1")
    if not valid_device(opts["device"]):
        raise UserError(f"device={opts['device']!r} must be auto, cpu, cuda, cuda:N or mps")
    if opts["amp_dtype"] not in CHOICES["amp_dtype"]:
        raise UserError(f"amp_dtype={opts['amp_dtype']!r} is not allowed: use one of auto, bfloat16, float16")
    return opts


def output_paths(paths, out_dir):
    """<out_dir>/<stem>.png per input; refuses to overwrite an input or to write one name twice."""
    outputs = [out_dir / f"{p.stem}.png" for p in paths]
    inputs = {p.resolve() for p in paths}
    clash = next((o for o in outputs if o.resolve() in inputs), None)
    if clash is not None:
        raise UserError(f"predicting would overwrite the input {clash}: choose another output=... folder")
    stems = [p.stem for p in paths]
    twice = next((p for p in paths if stems.count(p.stem) > 1), None)
    if twice is not None:
        raise UserError(f"two inputs share the name {twice.stem!r} (e.g. {twice.name}): their masks would "
                        f"overwrite each other; rename one")
    return outputs


def predict(opts):
    """The `predict` command: returns {'predicted', 'failed': [(path, reason)], 'seconds', ...}."""
    opts = validate_predict({**PREDICT_CONFIG, **opts})
    hw = detect_hardware(opts["device"])
    prec = decide_precision(hw, opts["use_amp"], opts["amp_dtype"], opts["force_amp_dtype"])
    model, cfg = load_model(opts["checkpoint"], hw)
    paths = list_images(opts["input"])
    out_dir = Path(opts["output"])
    outputs = dict(zip(paths, output_paths(paths, out_dir)))
    check_writable(out_dir)
    print(f"predict: {len(paths)} image(s) with {opts['checkpoint']} on {describe(hw)} in {prec.name}"
          + (f" ({prec.warning})" if prec.warning else ""))
    failed, done, start = [], 0, time.perf_counter()
    bar = tqdm(total=len(paths), desc="predict", disable=not opts["progress"], dynamic_ncols=True)
    for i in range(0, len(paths), opts["batch_size"]):
        batch = []
        for path in paths[i:i + opts["batch_size"]]:
            try:
                batch.append((path, read_image(path, cfg["in_channels"])))
            except UserError as exc:
                failed.append((str(path), str(exc)))
        masks = predict_batch(model, [img for _, img in batch], cfg, prec, hw) if batch else []
        for (path, image), mask in zip(batch, masks):
            cv2.imwrite(str(outputs[path]), mask_to_png(mask, cfg["num_classes"]))
            if opts["overlay"]:
                cv2.imwrite(str(out_dir / f"{path.stem}_overlay.png"), overlay_image(image, mask))
            done += 1
        bar.update(len(paths[i:i + opts["batch_size"]]))
    bar.close()
    seconds = time.perf_counter() - start
    print(f"predicted {done} image(s) in {seconds:.1f}s ({done / max(seconds, 1e-9):.1f} img/s) "
          f"-> {out_dir}/" + (f"; {len(failed)} failed:" if failed else ""))
    for path, reason in failed:
        print(f"  failed: {reason}")
    return {"predicted": done, "failed": failed, "seconds": seconds, "precision": prec.name,
            "output": str(out_dir)}


# ----------------------------------------------------------------------------------------------------
# Benchmark: the same data, seed and model under several precision settings, one process each.
# ----------------------------------------------------------------------------------------------------
BENCHMARK_CONFIG = {
    "configs": "fp32,fp32_cl,bf16,bf16_cl,bf16_compile,bf16_2x,fp16",  # names from BENCHMARK_SETTINGS
    "output": "checkpoints/benchmark",
    "bare_steps": 6,        # timed steps of the bare reference loop (0 = skip it)
}
# Each benchmark configuration: CONFIG overrides. "2x" doubles batch_size.
BENCHMARK_SETTINGS = {
    "fp32": {"use_amp": False},
    "fp32_cl": {"use_amp": False, "channels_last": True},
    "bf16": {"amp_dtype": "bfloat16"},
    "bf16_cl": {"amp_dtype": "bfloat16", "channels_last": True},
    "bf16_compile": {"amp_dtype": "bfloat16", "compile_model": True},
    "bf16_2x": {"amp_dtype": "bfloat16", "batch_size": "2x"},
    "fp16": {"amp_dtype": "float16"},
}
# Training keys every benchmark run sets itself.
BENCHMARK_FIXED = ("checkpoint_dir", "resume", "progress", "early_stopping_patience")
BENCHMARK_FIELDS = ("config", "device", "precision", "batch", "channels_last", "compile",
                    "time_per_epoch_s", "first_epoch_s", "images_per_s", "speedup_vs_fp32",
                    "peak_mem_mb", "peak_mem_kind", "final_val_iou", "final_val_dice",
                    "nonfinite_steps", "scaler_skipped_steps", "epochs", "status")


def parse_benchmark_args(args):
    """Benchmark keys (BENCHMARK_CONFIG) and training keys (CONFIG) in one key=value list."""
    bench_args = [a for a in args if normalize_key(a.partition("=")[0]) in BENCHMARK_CONFIG]
    opts = parse_overrides(bench_args, defaults=BENCHMARK_CONFIG)
    train_args = [a for a in args if a not in bench_args]
    base = parse_overrides(train_args)
    for key in BENCHMARK_FIXED:
        if any(normalize_key(a.partition("=")[0]) == key for a in train_args):
            raise UserError(f"{key} is set by the benchmark itself (results go to output=...): leave it out")
    names = [n.strip() for n in opts["configs"].split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARK_SETTINGS]
    if unknown or not names:
        raise UserError(f"configs={opts['configs']!r}: unknown {', '.join(unknown) or '(empty)'}; use a "
                        f"comma-separated list of {', '.join(BENCHMARK_SETTINGS)}")
    return opts, base, train_args, names


def benchmark_overrides(name, base):
    """CONFIG overrides (as key=value strings) for one named benchmark configuration."""
    out = []
    for key, value in BENCHMARK_SETTINGS[name].items():
        value = base["batch_size"] * 2 if value == "2x" else value
        out.append(f"{key}={value}")
    return out


def skip_reason(name, base, hw):
    """Why a configuration cannot run as named on this hardware (None = it can)."""
    cfg = parse_overrides(benchmark_overrides(name, base), base=base)
    prec = decide_precision(hw, cfg["use_amp"], cfg["amp_dtype"], cfg["force_amp_dtype"])
    return prec.warning and f"amp_dtype={cfg['amp_dtype']} {missing_support(hw, cfg['amp_dtype'])}"


def summarize_history(name, history, info):
    """One benchmark row from a run's per-epoch history (first epoch reported apart)."""
    times = [float(r["epoch_time_s"]) for r in history]
    rates = [float(r["images_per_s"]) for r in history]
    steady = slice(1, None) if len(history) > 1 else slice(0, None)
    skipped = sum(int(r["skipped_steps"]) for r in history)
    fp16 = history[-1]["precision"] == "fp16"
    return {"config": name, "device": info["device"], "precision": history[-1]["precision"],
            "batch": info["config"]["batch_size"], "channels_last": info["config"]["channels_last"],
            "compile": info["config"]["compile_model"],
            "time_per_epoch_s": float(np.median(times[steady])), "first_epoch_s": times[0],
            "images_per_s": float(np.median(rates[steady])), "speedup_vs_fp32": None,
            "peak_mem_mb": max(float(r["peak_mem_mb"]) for r in history),
            "peak_mem_kind": history[-1]["peak_mem_kind"],
            "final_val_iou": float(history[-1]["val_iou"]), "final_val_dice": float(history[-1]["val_dice"]),
            "nonfinite_steps": 0 if fp16 else skipped, "scaler_skipped_steps": skipped if fp16 else 0,
            "epochs": len(history), "status": "ok"}


def merge_args(*lists):
    """key=value lists merged left to right, one entry per key (a later list wins)."""
    merged = {}
    for arg in (a for lst in lists for a in lst):
        key, _, value = arg.partition("=")
        merged[normalize_key(key)] = value
    return [f"{k}={v}" for k, v in merged.items()]


def run_benchmark_config(name, base, train_args, out_dir):
    """Train one configuration in a fresh process; returns (row, per-epoch history)."""
    import subprocess

    run_dir = out_dir / name
    fixed = ["progress=False", "early_stopping_patience=None", "resume=False", f"checkpoint_dir={run_dir}"]
    cmd = [sys.executable, str(Path(__file__).resolve()),
           *merge_args(train_args, benchmark_overrides(name, base), fixed)]
    print(f"[benchmark] {name}: {' '.join(cmd[2:])}", flush=True)
    log_path = out_dir / f"{name}.log"
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT)
    history_path = run_dir / "history.csv"
    if proc.returncode != 0 or not history_path.is_file():
        tail = log_path.read_text().strip().splitlines()[-1:] or ["no output"]
        return {"config": name, "status": f"failed (exit {proc.returncode}): {tail[0][:160]}"}, []
    with open(history_path) as f:
        history = list(csv.DictReader(f))
    info = json.loads((run_dir / "config.json").read_text())
    return summarize_history(name, history, info), history


def bare_loop_speedups(base, hw, steps):
    """Reference: a bare forward/backward/step loop on random data, no loader, metrics or bars.

    Returns {"fp32": s/step, "bf16": ..., "bf16_cl": ...} (medians after a warm-up step).
    """
    if steps < 1 or not hw.bf16:
        return {}
    results = {}
    for label, dtype, channels_last in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False),
                                        ("bf16_cl", torch.bfloat16, True)):
        torch.manual_seed(0)
        model = build_model(base).to(hw.device)
        x = torch.randn(base["batch_size"], base["in_channels"], base["image_size"], base["image_size"],
                        device=hw.device)
        y = (torch.rand(base["batch_size"], base["image_size"], base["image_size"], device=hw.device)
             * max(2, base["num_classes"])).long().clamp(max=max(1, base["num_classes"] - 1))
        if channels_last:
            model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
        opt, loss_fn, times = torch.optim.AdamW(model.parameters(), 1e-4), SegLoss(base["num_classes"]), []
        for _ in range(steps + 1):
            synchronize(hw)
            t0 = time.perf_counter()
            with torch.autocast(hw.kind, dtype=dtype, enabled=dtype != torch.float32):
                logits = model(x)
            loss_fn(logits, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            synchronize(hw)
            times.append(time.perf_counter() - t0)
        results[label] = float(np.median(times[1:]))
        del model, opt
    return results


def format_benchmark_table(rows):
    header = ("Config", "Batch", "Precision", "Time/Epoch", "Speedup vs FP32", "Peak memory", "Final IoU",
              "Note")
    lines = [header]
    for r in rows:
        if r.get("status") != "ok":
            lines.append((r["config"], "-", "-", "-", "-", "-", "-", r.get("status", "")))
            continue
        speed = f"{r['speedup_vs_fp32']:.2f}x" if r["speedup_vs_fp32"] else "-"
        lines.append((r["config"], str(r["batch"]), r["precision"], f"{r['time_per_epoch_s']:.1f}s",
                      speed, f"{r['peak_mem_mb']:.0f} MB", f"{r['final_val_iou']:.4f}",
                      f"compiled: epoch 1 took {r['first_epoch_s']:.0f}s" if r["compile"] else ""))
    widths = [max(len(line[i]) for line in lines) for i in range(len(header))]
    fmt = lambda line: "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([fmt(lines[0]), rule] + [fmt(line) for line in lines[1:]])


def add_speedups(rows):
    """Speed-up = training images/s over fp32's (same images per epoch, so batch size is fair)."""
    ref = next((r for r in rows if r["config"] == "fp32" and r.get("status") == "ok"), None)
    for r in rows:
        if ref and r.get("status") == "ok":
            r["speedup_vs_fp32"] = r["images_per_s"] / ref["images_per_s"]
    return rows


def run_benchmark(args=()):
    """The `benchmark` command: returns {'rows', 'histories', 'bare_loop', ...} and writes CSV/JSON."""
    opts, base, train_args, names = parse_benchmark_args(list(args))
    hw = detect_hardware(base["device"])
    out_dir = Path(opts["output"])
    check_writable(out_dir)
    moved = archive_previous_run(out_dir, [p.name for p in sorted(out_dir.iterdir()) if p.name != "previous"])
    if moved:
        print(f"[benchmark] earlier results in {out_dir} were moved to {moved}")
    prepare_data(base)  # write the embedded data set once, before the runs start
    print(f"[benchmark] {describe(hw)}; {base['arch']}({base['encoder_name']}) at {base['image_size']}px, "
          f"batch {base['batch_size']}, {base['epochs']} epochs; results in {out_dir}/", flush=True)
    bare = bare_loop_speedups(base, hw, opts["bare_steps"])
    rows, histories = [], {}
    for name in names:
        reason = skip_reason(name, base, hw)
        if reason:
            rows.append({"config": name, "status": f"skipped: {reason}"})
            print(f"[benchmark] {name}: skipped: {reason}", flush=True)
            continue
        row, histories[name] = run_benchmark_config(name, base, train_args, out_dir)
        rows.append(row)
    add_speedups(rows)
    result = {"device": describe(hw), "settings": {k: base[k] for k in ("arch", "encoder_name", "image_size",
              "batch_size", "epochs", "data_dir", "max_train_images", "seed")},
              "rows": rows, "histories": histories, "bare_loop_s_per_step": bare}
    write_json(out_dir / "benchmark.json", result)
    atomic_write(out_dir / "benchmark.csv", lambda tmp: write_rows_csv(tmp, rows))
    print(format_benchmark_table(rows))
    if bare:
        print(f"bare loop (s/step, median): fp32 {bare['fp32']:.3f}, bf16 {bare['bf16']:.3f} "
              f"({bare['fp32'] / bare['bf16']:.2f}x), bf16+channels_last {bare['bf16_cl']:.3f} "
              f"({bare['fp32'] / bare['bf16_cl']:.2f}x)")
    print("Time/Epoch: median training pass over epochs 2..N (epoch 1, with any compile time, is "
          "first_epoch_s in the CSV); Speedup: images/s vs fp32; Final IoU: last epoch, evaluated in fp32.")
    return result


def write_rows_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=BENCHMARK_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


# ----------------------------------------------------------------------------------------------------
# batch_size=auto: the largest batch that fits on the GPU (real training steps, OOM caught), minus
# headroom. The search itself (search_batch_size) is plain Python, tested with faked OOMs.
# ----------------------------------------------------------------------------------------------------
AUTO_BATCH_FALLBACK = 8      # batch_size=auto where no search is possible (CPU, MPS): CONFIG's default
AUTO_BATCH_HEADROOM = 0.15   # room for fragmentation, validation and other processes on the GPU
AUTO_BATCH_CAP = 1024


def search_batch_size(fits, start=2, cap=AUTO_BATCH_CAP):
    """Largest n in [start, cap] with fits(n): double until a batch fails, then bisect between the
    last that fit and the first that did not. Returns 0 when even `start` does not fit."""
    if not fits(start):
        return 0
    good, bad = start, None
    while bad is None and good < cap:
        n = min(good * 2, cap)
        good, bad = (n, None) if fits(n) else (good, n)
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good


def batch_trial(model, optimizer, loss_fn, scaler, prec, hw, cfg, n):
    """One real training step at batch n on random data, in the run's precision and layout."""
    size = cfg["image_size"]
    x = torch.randn(n, cfg["in_channels"], size, size, device=hw.device)
    y = torch.randint(0, max(2, cfg["num_classes"]), (n, size, size), device=hw.device)
    if cfg["channels_last"]:
        x = x.contiguous(memory_format=torch.channels_last)
    forward_backward(model, x, y, loss_fn, scaler, prec, hw, 1, True)
    optimizer_step(model, optimizer, scaler, cfg, torch.ones((), dtype=torch.bool, device=hw.device))
    synchronize(hw)


def find_batch_size(cfg, hw, prec, cap):
    """Search on a throw-away model; returns (largest batch that fit, batch to use)."""
    model = prepare_model({**cfg, "encoder_weights": None}, hw).train()
    optimizer, scaler = build_optimizer(model, cfg), build_scaler(prec, hw, cfg)
    loss_fn = SegLoss(cfg["num_classes"], cfg["loss"])

    def fits(n):
        try:
            batch_trial(model, optimizer, loss_fn, scaler, prec, hw, cfg, n)
            ok = True
        except torch.cuda.OutOfMemoryError:
            ok = False
        optimizer.zero_grad(set_to_none=True)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # outside the except block: the traceback no longer pins tensors
        return ok

    largest = search_batch_size(fits, start=min(2, cap), cap=cap)
    del model, optimizer
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    use = largest if largest == cap else max(min(2, cap), int(largest * (1 - AUTO_BATCH_HEADROOM)))
    return largest, use


def resolve_batch_size(cfg, hw, prec, state, n_train, notes):
    """Replace batch_size='auto' by a number; returns (cfg, what to record in config.json or None)."""
    if cfg["batch_size"] != "auto":
        return cfg, None
    cap = max(1, min(AUTO_BATCH_CAP, n_train // DIST.world))
    if state is not None:
        use, info = state["config"]["batch_size"], "kept the resumed run's batch size"
    elif hw.kind != "cuda":
        use = min(AUTO_BATCH_FALLBACK, cap)
        info = f"needs a CUDA GPU (this run is on {hw.kind}): using batch_size={use}"
    else:
        start = time.perf_counter()
        largest, use = find_batch_size(cfg, hw, prec, cap)
        if largest == 0:
            raise UserError(f"batch_size=auto: not even a batch of {min(2, cap)} fits in {describe(hw)}'s "
                            f"memory at image_size={cfg['image_size']}: lower image_size, use a smaller "
                            f"encoder_name or use_amp=True")
        use = int(all_reduce_(torch.tensor(use, device=hw.device), "min").item())  # same on every rank
        limit = "the training set" if largest == cap else f"{AUTO_BATCH_HEADROOM:.0%} headroom"
        info = (f"largest that fit {largest}, using {use} ({limit}; {prec.name}"
                f"{', channels_last' if cfg['channels_last'] else ''}; {time.perf_counter() - start:.1f}s)")
        seed_everything(cfg["seed"])  # the trials used the RNG: the run starts as with a fixed batch
    notes.append(("batch", f"auto -> {use}: {info}"))
    return validate_config({**cfg, "batch_size": use}), {"requested": "auto", "batch_size": use, "how": info}


# ----------------------------------------------------------------------------------------------------
# Main: set up, train epoch by epoch, checkpoint, stop early.
# ----------------------------------------------------------------------------------------------------
def setup_precision(cfg):
    hw = detect_hardware(cfg["device"])
    prec = decide_precision(hw, cfg["use_amp"], cfg["amp_dtype"], cfg["force_amp_dtype"])
    tf32_note = apply_tf32(cfg["tf32_matmul_precision"], prec)
    notes = [prec.warning, tf32_note]
    if cfg["compile_model"] and hw.kind == "cpu":
        notes.append("compile_model=True on CPU: expect 30-70 s of compiling and no speed-up")
    return hw, prec, notes


def prepare_model(cfg, hw):
    model = build_model(cfg).to(hw.device)
    if cfg["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    return model


def resume_state(cfg, ckpt_dir):
    path = ckpt_dir / "last.pt"
    if not path.is_file():
        raise UserError(f"resume=True but {path} does not exist: start without resume, or set "
                        f"checkpoint_dir to the run you want to continue")
    state = load_checkpoint(path)
    for key in RESUME_KEYS:
        if key in AUTO_KEYS and cfg[key] == "auto":  # resolved from the checkpoint (resolve_batch_size)
            continue
        if state["config"].get(key) != cfg[key]:
            raise UserError(f"cannot resume exactly: {path} was trained with {key}="
                            f"{state['config'].get(key)!r}, this run has {key}={cfg[key]!r}: resume with "
                            f"the same value, or start a new run in another checkpoint_dir")
    if state["epoch"] >= cfg["epochs"]:
        raise UserError(f"{path} has already trained {state['epoch']} epoch(s) and epochs={cfg['epochs']}: "
                        f"raise epochs to continue, e.g. epochs={state['epoch'] + 5}")
    return state


@dataclass
class Run:
    """Everything that changes while training; saved in checkpoints, restored on resume/rollback."""
    model: nn.Module
    run_model: nn.Module          # what trains: `model`, compiled and/or wrapped in DDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    prec: Precision
    history: list
    fallbacks: list               # precision fallback events, kept so a resume stays safe
    best_iou: float = -1.0
    since_best: int = 0
    epoch: int = 0                # last finished epoch
    bad_streak: int = 0           # consecutive bad optimizer steps, across epoch boundaries
    eval_model: nn.Module | None = None  # `model`, compiled if asked, never DDP-wrapped
    logger: RunLogger | None = None      # TensorBoard (rank 0), or a no-op
    class_names: list | None = None      # for the per-class history columns

    def state(self, cfg):
        return {"model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler else None, "epoch": self.epoch,
                "best_iou": self.best_iou, "epochs_since_best": self.since_best, "rng": rng_state(),
                "config": cfg, "history": self.history, "precision": self.prec.name,
                "fallbacks": self.fallbacks}

    def load(self, state):
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.best_iou, self.since_best = state["epoch"], state["best_iou"], state["epochs_since_best"]
        self.history, self.fallbacks = list(state["history"]), list(state.get("fallbacks", []))


def to_cpu(obj):
    """A detached CPU copy of a (nested) state dict: the in-memory rollback snapshot."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


SAFETY_ORDER = ("fp16", "bf16", "fp32")  # a fallback only ever moves right


def safer_precision(prec, hw):
    """fp16 -> bf16 where native, else fp32; bf16 -> fp32; fp32 -> None (nothing safer)."""
    if prec.dtype == torch.float16 and hw.bf16:
        return Precision(torch.bfloat16, False, "fallback from fp16 (non-finite)")
    if prec.amp:
        return Precision(torch.float32, False, f"fallback from {prec.name} (non-finite)")
    return None


def keep_safer_precision(prec, state):
    """On resume, a run that fell back earlier keeps its safer precision."""
    if state.get("fallbacks") and SAFETY_ORDER.index(state["precision"]) > SAFETY_ORDER.index(prec.name):
        name = state["precision"]
        return Precision(DTYPES[name], False, f"kept from the checkpoint: this run fell back to {name} "
                                              f"({state['fallbacks'][-1]['event']})")
    return prec


def diagnose_nonfinite(model, batch, loss_fn):
    """Re-run one batch in fp32 with hooks (installed only here) to find where NaN/inf first appears."""
    x, y = batch
    if not torch.isfinite(x).all():
        return "the input batch itself holds NaN/inf values: check the data"
    bad = [n for n, p in model.named_parameters() if not torch.isfinite(p).all()]
    if bad:
        return f"the weights are already non-finite, first {bad[0]}"
    found = []

    def hook(name):
        def check(module, inputs, output):
            if not found and isinstance(output, torch.Tensor) and not torch.isfinite(output).all():
                found.append(f"the first non-finite value is the forward output of {name} "
                             f"({type(module).__name__})")
        return check

    leaves = [(n, m) for n, m in model.named_modules() if not list(m.children())]
    handles = [m.register_forward_hook(hook(n)) for n, m in leaves]
    try:
        loss = loss_fn(model(x.float()), y)
        if not found and not torch.isfinite(loss):
            found.append("the loss is non-finite while the model's outputs are finite: check the masks")
        if not found:
            model.zero_grad(set_to_none=True)
            loss.backward()
            owners = {id(p): n for n, m in leaves for p in m.parameters(recurse=False)}
            for p in reversed(list(model.parameters())):  # backward runs from the output end
                if p.grad is not None and not torch.isfinite(p.grad).all():
                    found.append(f"the first non-finite gradient is that of "
                                 f"{owners.get(id(p), 'a parameter')}")
                    break
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return found[0] if found else "nothing is non-finite when this batch is re-run in fp32 (intermittent)"


def banner_line(text):
    rule = "!" * 78
    print(f"{rule}\n{text}\n{rule}", flush=True)


def fall_back(run, bad, snapshot, hw, cfg, loss_fn, epoch):
    """nan_patience bad steps in a row: roll back and continue in a safer precision, or stop in fp32."""
    nxt = safer_precision(run.prec, hw)
    ckpt = Path(cfg["checkpoint_dir"]) / "last.pt"
    if nxt is None:
        where = diagnose_nonfinite(unwrap(run.model), bad.batch, loss_fn)
        kept = f"{ckpt} (epoch {run.epoch}) is intact" if run.epoch else "no checkpoint was written yet"
        raise UserError(f"training went non-finite in fp32 at step {bad.step} (epoch {epoch}): "
                        f"{where}; likely causes: learning_rate={cfg['learning_rate']} "
                        f"too high, or NaN/inf/garbage in the data; {kept}")
    events = run.fallbacks
    run.load(snapshot)  # model, optimizer, scheduler, scaler as they were at the start of the epoch
    run.fallbacks = events
    set_rng_state(snapshot["rng"])
    event = (f"{run.prec.name} went non-finite at step {bad.step}: falling back to {nxt.name}, "
             f"rolled back to " + (f"epoch {run.epoch}" if run.epoch else "the start"))
    run.fallbacks.append({"epoch": epoch, "step": bad.step, "from": run.prec.name, "to": nxt.name,
                          "event": event})
    run.prec, run.scaler, run.bad_streak = nxt, build_scaler(nxt, hw, cfg), 0
    banner_line(event)


def setup_run(cfg, hw, prec, steps_per_epoch, state, notes):
    model = prepare_model(cfg, hw)
    if cfg["sync_batchnorm"] and DIST.enabled:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = build_optimizer(model, cfg)
    run = Run(model, model, optimizer, build_scheduler(optimizer, cfg, steps_per_epoch), None, prec, [], [])
    if state is not None:
        run.prec = keep_safer_precision(prec, state)
        run.scaler = build_scaler(run.prec, hw, cfg)
        run.load(state)
        set_rng_state(state["rng"])
        notes.append(f"resumed from {cfg['checkpoint_dir']}/last.pt after epoch {state['epoch']}")
        if state["config"]["epochs"] != cfg["epochs"]:
            notes.append(f"epochs changed from {state['config']['epochs']} to {cfg['epochs']}: the learning "
                         f"rate schedule now spans {cfg['epochs']} epochs")
        notes.append(run.prec.reason if run.prec is not prec else None)
    else:
        run.scaler = build_scaler(prec, hw, cfg)
        moved = archive_previous_run(cfg["checkpoint_dir"]) if DIST.is_main else None
        notes.append(moved and f"an earlier run in {cfg['checkpoint_dir']} was moved to {moved}")
    run.eval_model = torch.compile(model) if cfg["compile_model"] else model
    run.run_model = run.eval_model
    if DIST.enabled:  # wrapped after compile; gradients are all-reduced in buckets during backward
        ids = [hw.device] if hw.kind == "cuda" else None
        run.run_model = nn.parallel.DistributedDataParallel(run.eval_model, device_ids=ids)
    return run


def train(cfg, explicit=()):
    """Train with a config; returns {'history', 'best_iou', 'fallbacks', ...}.

    `explicit`: keys the user gave on the command line; with keys whose value differs from CONFIG they
    win over the preset (apply_preset).
    """
    cfg, preset_line = apply_preset(validate_config(cfg), explicit)
    hw, prec, notes = setup_precision(cfg)
    notes.insert(0, preset_line and ("preset", preset_line))
    if cfg["sync_batchnorm"] and hw.kind != "cuda":
        raise UserError("sync_batchnorm=True needs CUDA GPUs (PyTorch's SyncBatchNorm has no CPU kernel): "
                        "set sync_batchnorm=False")
    seed_everything(cfg["seed"])
    ckpt_dir = Path(cfg["checkpoint_dir"])
    if DIST.is_main:
        check_writable(ckpt_dir, "checkpoint_dir")
    state = resume_state(cfg, ckpt_dir) if cfg["resume"] else None
    train_pairs, val_pairs = prepare_data(cfg if cfg["batch_size"] != "auto" else {**cfg, "batch_size": 1})
    class_names = load_class_names(cfg)  # a bad class_names.txt stops the run before anything moves
    cfg, auto_batch = resolve_batch_size(cfg, hw, prec, state, len(train_pairs), notes)
    train_loader, val_loader = build_loaders(train_pairs, val_pairs, cfg, hw)
    steps_per_epoch = optimizer_steps_per_epoch(len(train_loader), cfg["accumulation_steps"])
    run = setup_run(cfg, hw, prec, steps_per_epoch, state, notes)
    run.class_names, run.logger = class_names, RunLogger.create(cfg)
    loss_fn = SegLoss(cfg["num_classes"], cfg["loss"])

    print(banner(hw, run.prec, cfg, notes))
    print("config:\n" + format_config(cfg))
    print(f"data: {len(train_pairs)} train / {len(val_pairs)} val images from {cfg['data_dir']}; "
          f"{len(train_loader)} batches of {cfg['batch_size']}, {steps_per_epoch} optimizer steps/epoch")
    if DIST.enabled:
        print(f"distributed: {DIST.world} processes ({'nccl' if hw.kind == 'cuda' else 'gloo'}); effective "
              f"batch {cfg['batch_size']} x {cfg['accumulation_steps']} x {DIST.world}")
    if DIST.is_main:
        write_json(ckpt_dir / "config.json", {"config": cfg, "precision": run.prec.name,
                                              "device": describe(hw), "world_size": DIST.world,
                                              "preset": preset_line, "batch_size_auto": auto_batch})

    epoch = run.epoch + 1
    while epoch <= cfg["epochs"]:
        snapshot = to_cpu(run.state(cfg)) if cfg["nan_guard"] else None  # last known-good state
        try:
            row = run_epoch(run, epoch, train_loader, val_loader, loss_fn, hw, cfg)
        except NonFiniteStreak as bad:
            run.logger.flush_steps("rolled_back")  # the steps that went bad stay visible
            fall_back(run, bad, snapshot, hw, cfg, loss_fn, epoch)
            continue  # the same epoch again, same data order, safer precision
        finish_epoch(run, row, cfg)
        run.logger.log_epoch(row)
        patience = cfg["early_stopping_patience"]
        if patience is not None and run.since_best >= patience and epoch < cfg["epochs"]:
            print(f"early stopping: val IoU has not improved for {patience} epochs (best {run.best_iou:.4f})")
            break
        epoch += 1
    run.logger.close()
    print(f"done: best val IoU {run.best_iou:.4f}; checkpoints in {ckpt_dir}/ (best.pt, last.pt, history.csv)")
    table = end_of_run_table(run)
    if table:
        print(table)
    return {"history": run.history, "best_iou": run.best_iou, "checkpoint_dir": str(ckpt_dir),
            "precision": run.prec.name, "fallbacks": run.fallbacks, "device": describe(hw)}


def run_epoch(run, epoch, train_loader, val_loader, loss_fn, hw, cfg):
    """Train and validate one epoch; returns its history row."""
    if hw.kind == "cuda":
        torch.cuda.reset_peak_memory_stats(hw.device)
    start_epoch_data(train_loader, epoch, cfg["seed"])
    anomaly = torch.autograd.set_detect_anomaly(True) if cfg["detect_anomaly"] else contextlib.nullcontext()
    with anomaly:  # switched off again after the epoch
        tr = train_one_epoch(run.run_model, train_loader, loss_fn, run.optimizer, run.scheduler, run.scaler,
                             run.prec, hw, cfg, desc=f"epoch {epoch}/{cfg['epochs']} train",
                             streak=run.bad_streak, logger=run.logger)
    run.bad_streak = tr["stats"].bad_streak
    val_start = time.perf_counter()
    broadcast_buffers(run.model)  # BatchNorm statistics: rank 0's, the ones its checkpoint holds
    va = evaluate(run.eval_model, val_loader, loss_fn, run.prec, hw, cfg, desc=f"epoch {epoch} val")
    val_time = time.perf_counter() - val_start
    mem, mem_kind = peak_memory_mb(hw)
    stats = tr["stats"]
    events = [f["event"] for f in run.fallbacks if f["epoch"] == epoch]
    return {"epoch": epoch, "train_loss": tr["loss"], "val_loss": va["loss"], "train_iou": tr["iou"],
            "train_dice": tr["dice"], "val_iou": va["iou"], "val_dice": va["dice"], "lr": run.scheduler.get_last_lr()[0],
            "epoch_time_s": tr["time"], "val_time_s": val_time, "images_per_s": tr["images_per_s"],
            "peak_mem_mb": mem, "peak_mem_kind": mem_kind, "precision": run.prec.name,
            "grad_norm": stats.grad_norm, "grad_norm_max": stats.grad_norm_max,
            "zero_grad_pct": stats.zero_grad_pct,
            "scaler_scale": run.scaler.get_scale() if run.scaler else None,
            "optimizer_steps": stats.optimizer_steps, "skipped_steps": stats.skipped_steps,
            "fallback": "; ".join(events), **per_class_columns(va, run.class_names or [])}


def end_of_run_table(run):
    """Multi-class runs: IoU/Dice per class at the best epoch (mIoU, the headline, is its mean)."""
    best = max(run.history, key=lambda r: r["val_iou"], default=None)
    table = best and per_class_table(best, run.class_names or [])
    return f"val per class at the best epoch ({best['epoch']}):\n{table}" if table else ""


def broadcast_buffers(model):
    if DIST.enabled:
        for buffer in model.buffers():
            torch.distributed.broadcast(buffer, src=0)


def finish_epoch(run, row, cfg):
    """Record the epoch, write last.pt (and best.pt when it improved) and the history CSV."""
    ckpt_dir = Path(cfg["checkpoint_dir"])
    run.history.append(row)
    run.epoch = row["epoch"]
    improved = row["val_iou"] > run.best_iou
    run.best_iou, run.since_best = (row["val_iou"], 0) if improved else (run.best_iou, run.since_best + 1)
    if DIST.is_main:  # one writer; the other ranks hold the same weights
        state = run.state(cfg)
        save_checkpoint(ckpt_dir / "last.pt", state)
        if improved:
            save_checkpoint(ckpt_dir / "best.pt", state)
        write_history(ckpt_dir / "history.csv", run.history)
    print(epoch_summary(row, cfg, improved))
    # Some zero gradients are normal (dead ReLUs: ~5-7% here in fp32); under fp16 a high share is
    # the sign of gradients underflowing below fp16's smallest values.
    if row["precision"] == "fp16" and row["zero_grad_pct"] > 5:
        print(f"warning: {row['zero_grad_pct']:.1f}% of gradient entries were exactly zero: fp16 underflow? "
              f"Compare with a bf16/fp32 run; try amp_dtype=bfloat16 or a larger init_scale")


def epoch_summary(row, cfg, improved):
    skipped = f" | skipped {row['skipped_steps']}" if row["skipped_steps"] else ""
    scale = f" | scale {row['scaler_scale']:.0f}" if row["scaler_scale"] else ""
    return (f"epoch {row['epoch']:>3}/{cfg['epochs']} | train loss {row['train_loss']:.4f} "
            f"IoU {row['train_iou']:.4f} | val loss {row['val_loss']:.4f} IoU {row['val_iou']:.4f} "
            f"Dice {row['val_dice']:.4f} | lr {row['lr']:.2e} | {row['epoch_time_s']:.1f}s "
            f"{row['images_per_s']:.1f} img/s | peak {row['peak_mem_mb']:.0f} MB | {row['precision']}"
            f" | grad {row['grad_norm']:.2f}{scale}{skipped}{' | best' if improved else ''}")


def train_main(cfg, explicit=()):
    """`train`, also under torchrun: only rank 0 prints, the others train quietly."""
    setup_distributed(cfg["device"])
    try:
        if not DIST.is_main:
            with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
                return train({**cfg, "progress": False}, set(explicit) | {"progress"})
        return train(cfg, explicit)
    except UserError as exc:
        if DIST.enabled:  # say which process failed; torchrun then stops the others
            raise UserError(f"[rank {DIST.rank}] {exc}") from None
        raise
    finally:
        cleanup_distributed()


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    command, args = (argv[0], argv[1:]) if argv and "=" not in argv[0] else ("train", argv)
    if command in ("-h", "--help", "help"):
        print(__doc__.strip() + "\n\nkeys and defaults (CONFIG):\n" + format_config(CONFIG)
              + "\n\npresets (preset=NAME; key=value on the command line wins):\n" + preset_table())
        return 0
    try:
        if command == "train":
            train_main(parse_overrides(args), explicit_keys(args))
        elif command == "predict":
            return 1 if predict(parse_overrides(args, defaults=PREDICT_CONFIG))["failed"] else 0
        elif command == "benchmark":
            rows = run_benchmark(args)["rows"]
            return 1 if any(r["status"].startswith("failed") for r in rows) else 0
        else:
            raise UserError(f"unknown command {command!r}: use train (the default), predict or benchmark, "
                            f"followed by key=value settings")
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: checkpoints written so far are intact; resume=True continues", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
