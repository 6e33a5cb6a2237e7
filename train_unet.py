"""
unet-amp: train a U-Net segmentation model with mixed precision done right.

    python train_unet.py                              # train with CONFIG below
    python train_unet.py batch_size=2 epochs=3        # override any CONFIG key
    python train_unet.py resume=True epochs=20        # continue checkpoints/last.pt exactly
    python train_unet.py predict checkpoint=checkpoints/best.pt input=photos/ output=masks/
    python train_unet.py export checkpoint=checkpoints/best.pt  # model.onnx + model.json, checked in onnxruntime
    python train_unet.py predict backend=onnxruntime checkpoint=model.onnx input=photos/ output=masks/
    python train_unet.py benchmark                    # FP32 vs BF16 (and more), one process each
    torchrun --nproc_per_node=8 train_unet.py         # several GPUs

Contents: the file reads in the order it runs (Python resolves names at call time). Each entry is a
section header below; tests/test_layout.py keeps this list and the headers the same.

  I. What you edit: CONFIG and PRESETS
      I.1 Config
      I.2 Presets
  II. The run, in call order: main -> train -> set-up -> epoch loop -> training step -> evaluate
      II.1 Entry
      II.2 Train
      II.3 One epoch
      II.4 The training step
      II.5 Evaluate
  III. Machinery, one section per concern, in the order part II calls it
      III.1 Command line and config
      III.2 Distributed
      III.3 Precision
      III.4 CPU probe
      III.5 Data
      III.6 Large images
      III.7 Model, loss, optimizer, schedule, EMA
      III.8 Metrics
      III.9 Numerical safety
      III.10 Checkpoints and history
      III.11 Logging
  IV. Other commands
      IV.1 Predict
      IV.2 batch_size=auto
      IV.3 Benchmark
      IV.4 Export

The script imports cleanly as a module; tests, tools and the notebooks use its functions.
"""
from __future__ import annotations

import codecs
import collections
import contextlib
import copy
import csv
import ctypes
import datetime
import difflib
import errno
import functools
import gc
import glob
import hashlib
import itertools
import json
import io
import math
import multiprocessing
import os
import platform
import random
import re
import shlex
import shutil
import signal
import stat
import struct
import sys
import tempfile
import threading
import time
import traceback
import types
import unicodedata
import warnings
import weakref
import zlib
from concurrent.futures import Executor, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

# OpenCV refuses images over 2**30 pixels (a guard for untrusted downloads) with an exception from its
# depths; a user's own scene may be larger. The limit is raised here because OpenCV reads it once, when
# it loads; a limit the user set stays, as does OpenCV's own where it was imported before this script
# (a notebook). predict checks each image against the memory there is instead (MemoryBudget, IV.1).
if "cv2" not in sys.modules:
    os.environ.setdefault("OPENCV_IO_MAX_IMAGE_PIXELS", str(1 << 40))
try:  # the libraries take seconds to load: Ctrl-C then is a stop like any other, not a 30-line traceback
    import cv2  # noqa: E402
    import numpy as np
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, Dataset
    from tqdm import tqdm
except KeyboardInterrupt:
    if __name__ != "__main__":
        raise
    if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 alone says it, as for any other stop
        print("interrupted: while loading its libraries; nothing was written", file=sys.stderr)
    sys.exit(130)

# The LR schedule counts attempted optimizer steps, including those GradScaler skips; PyTorch warns
# about that ordering on a skipped first step, which is expected here.
warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
# DataLoader's warning for more workers than cores, printed once per loader ahead of the banner: the
# script's own note says it, with the fix (check_worker_count).
warnings.filterwarnings("ignore", message="This DataLoader will create .* worker processes in total")


# ====================================================================================================
# I. What you edit: CONFIG and PRESETS
# ====================================================================================================


# ----------------------------------------------------------------------------------------------------
# I.1 Config: the defaults. Edit here, or override any key on the command line: key=value.
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
    "num_workers": None,           # None = auto: 1 on a CPU with 2+ cores, else a share of the cores
    "cache_images": True,          # fit mode: decode and resize each image once per run (temporary .npy
                                   # files: image_size^2 x (channels + 1) bytes each); False = every epoch
    "intensity_range": None,       # integer images wider than 8 bits: [low, high] mapped to [0, 1]; None =
                                   # the training images' [min, max], learnt by the data check; in checkpoints
    # large images (README "Large images"): "fit" resizes each image to image_size (and pads);
    # "patch" trains on image_size patches and validates/predicts whole images by a sliding window
    "data_mode": "fit",            # "fit" | "patch"
    "patch_scale": 1.0,            # patch mode: resize images by this factor first (1.0 = native)
    "patch_foreground": 0.33,      # patch mode: share of training patches centred on a foreground pixel
    "patches_per_image": None,     # patch mode: patches per image per epoch; None = enough to tile it once
    "tile_overlap": 0.25,          # sliding window: overlap of neighbouring tiles (share of a tile)
    "tile_batch_size": 8,          # sliding window: tiles per forward pass
    # model
    "arch": "Unet",                # any segmentation_models_pytorch architecture
    "encoder_name": "resnet18",
    "encoder_weights": None,       # None = random init, fully offline; "imagenet" downloads weights
    "loss": "dice+ce",             # terms joined by +: ce (BCE when binary), dice, focal, lovasz, tversky
    "class_weights": None,         # CE/focal weights: None, "auto" (inverse class frequency of the training
                                   # masks) or one per class ([background, foreground] when binary); in checkpoints
    # optimisation
    "epochs": 10,
    "batch_size": 8,               # or "auto" (CUDA): the largest batch that fits, minus headroom
    "accumulation_steps": 1,       # effective batch = batch_size * accumulation_steps
    "learning_rate": 2e-3,
    "weight_decay": 1e-4,
    "warmup_fraction": 0.05,       # linear warm-up, then cosine decay, stepped per optimizer step
    "grad_clip_norm": 1.0,         # None = no clipping (the norm is still measured)
    "ema_decay": None,             # None = off; e.g. 0.99: validation, best.pt and predict use an EMA of the weights
    "early_stopping_patience": 5,  # epochs without a better val IoU; None = off
    "seed": 42,
    # precision and speed
    "device": "auto",              # "auto", "cpu", "cuda", "cuda:1", "mps"
    "use_amp": True,               # False = plain fp32
    "amp_dtype": "auto",           # "auto" | "bfloat16" | "float16"
    "force_amp_dtype": False,      # True = use amp_dtype even where it has no fast kernels (slow; tests)
    "eval_amp": False,             # False = validate in fp32, so fp32 and bf16 runs are judged alike
    "tta": "none",                 # validation's test-time augmentation: "none" | "flip" (4 views) | "d4" (8)
    "channels_last": "auto",       # NHWC memory layout: "auto" (on where it is faster), True, False
    "cpu_probe": True,             # CPU: amp_dtype/channels_last "auto" confirmed by a short timed probe
                                   # (cached per machine and setting); False = the feature-flag rule only
    "compile_model": False,        # torch.compile: for GPUs; a CPU pays ~1 min for little or no gain
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


# ----------------------------------------------------------------------------------------------------
# I.2 Presets: named sets of overrides. CONFIG < preset < command line.
# ----------------------------------------------------------------------------------------------------
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
    "fast": "daily experiments on a GPU (compile takes about a minute up front and does not pay off on a CPU)",
    "stable": "the final model, or after NaN trouble: fp32, no compile, clipping and the guard",
    "low_memory": "small GPUs (~4 GB): AMP and half the batch, accumulated to the same effective batch",
    "debug": "finding a bug in seconds on a laptop CPU: tiny fp32 run, anomaly detection, first NaN stops",
}


# ====================================================================================================
# II. The run, in call order: main -> train -> set-up -> epoch loop -> training step -> evaluate
# ====================================================================================================


# ----------------------------------------------------------------------------------------------------
# II.1 Entry: the command, and train under torchrun (only rank 0 prints).
# ----------------------------------------------------------------------------------------------------
def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    command, args = (argv[0], argv[1:]) if argv and "=" not in argv[0] else ("train", argv)
    help_words = {"-h", "--help", "help"}
    if (command in help_words or set(args) & help_words) and os.environ.get("RANK", "0") != "0" \
            and int(os.environ.get("WORLD_SIZE", "1")) > 1:  # under torchrun: rank 0's help alone (each printed it)
        return 0
    if command in help_words or (command == "train" and set(args) & help_words):
        print(__doc__.strip() + "\n\nkeys and defaults (CONFIG):\n" + format_config(CONFIG, commented=True)
              + "\n\npresets (preset=NAME; key=value on the command line wins):\n" + preset_table())
        return 0
    if set(args) & help_words and command in COMMAND_KEYS:  # predict --help, ...
        print(f"python train_unet.py {command} key=value ...\n\nkeys and defaults:\n"
              + format_config(COMMAND_KEYS[command](), commented=True))
        return 0
    keep_freed_memory()
    printable_file_names()
    guard_output_streams()
    quiet_readers()
    try:
        with sigterm_as_exit():
            stop_with_benchmark()
            return run_command(command, args)
    except UserError as exc:
        if not (same_error_on_every_rank(exc) or getattr(exc, "silent", False)):
            print(f"error: {user_message(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk under any write that has no message of its own (history, logs)
        if exc.errno == errno.EISDIR and exc.filename2:  # a rename onto a folder made meanwhile
            print(f"error: cannot write {exc.filename2}: a folder of that name is in the way: move or rename it",
                  file=sys.stderr)
            return 2
        if exc.errno not in (*FULL_DISK, *OPEN_FILES_LIMITS, *NO_PERMISSION, errno.EFBIG):
            raise
        print(f"error: {system_limit_message(exc)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        left = exc.args[0] if exc.args else INTERRUPTED.get(command, "files written so far are complete")
        if os.environ.get("RANK", "0") == "0":  # under torchrun rank 0 alone says it (DIST is reset by now)
            print(f"{stop_word()}: {left}", file=sys.stderr)
        return 130


def exit_at_next_interrupt(code):
    """Once the script's command has returned, Python joins its threads and runs its exit handlers (a cache
    folder's removal): a Ctrl-C meanwhile (a second one, after a stop) printed a traceback from threading's
    shutdown and ended the process by the signal. It now ends it at once with the command's own exit code
    (130 had followed 'done: ...' with every file written: a script read the run as failed); a cache folder
    left behind is removed by the next run (remove_stale_caches). Only as a script: a notebook keeps its Ctrl-C."""
    def exit_now(signum, frame):
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # os._exit flushes nothing: a piped stdout's last lines
                stream.flush()
        os._exit(code)
    signal.signal(signal.SIGINT, exit_now)


# Each command's own keys, for `COMMAND --help` (the benchmark takes training keys beside its own).
COMMAND_KEYS = {"predict": lambda: PREDICT_CONFIG, "export": lambda: EXPORT_CONFIG, "benchmark": lambda: BENCHMARK_CONFIG}

# What an interrupted command leaves (every file is written under a temporary name and renamed);
# train says which of the two (train_main).
INTERRUPTED = {"train": "checkpoints written so far are intact; resume=True continues",
               "train, no checkpoint": "no epoch had finished, so there is no checkpoint to resume: train again",
               "train, at start": "stopped while the config was checked: nothing was written",
               "train, in set-up": "stopped before training began: nothing of this run was written, and the run "
                                   "already in {folder} is untouched",
               "train, a benchmark row": "the benchmark stopped this row: run the benchmark again (each row trains "
                                         "afresh; resume=True is not for it)",
               "predict": "the masks written so far are complete; no partial file is left",
               "benchmark": "the benchmark did not finish (its benchmark.json, where written, says \"complete\": "
                            "false); the runs and files written so far are intact: run it again for the whole table"}


def said_once_if_alike(exc):
    """Raises a start-up error (or returns where this process met none). Under torchrun every process
    tells the others its error first: where all met the same one (a config key, a resume refusal), it is
    marked alike and rank 0 alone says it, untagged (same_error_on_every_rank); it was printed once per
    process. An error not every process met (CPU binding, a node's own disk) keeps its [rank N], and the
    processes that met none stop here, unsaid: at the next collective each had said 'another process ended;
    last.pt is intact: resume=True continues', a resume that meets the same error (an unwritable folder)."""
    seen = gather_setup(None if exc is None else user_message(exc))
    if exc is None:
        if any(message is not None for message in seen):
            stop = UserError("stopped: another process could not start (it says why)")
            stop.silent = True  # main prints nothing for it (the failed process's line is the one to read)
            raise stop
        return
    exc.alike = all(message == seen[0] for message in seen)
    raise exc


def said_once_where_alike(fn, *args):
    """fn(*args), whose UserError is said once where every torchrun process met the same (said_once_if_alike):
    for start-up work with no collective inside (each process would wait in a different one), which every
    process runs on the same files or facts (the data's folders; the exchanged data check)."""
    try:
        result = fn(*args)
    except UserError as exc:
        said_once_if_alike(exc)
    said_once_if_alike(None)
    return result


def same_error_on_every_rank(exc):
    """Under torchrun (WORLD_SIZE > 1), whether this is a rank other than 0 and the error came before the
    processes joined (a key every rank read alike): rank 0 alone says it. Errors from a rank's own run carry
    its [rank N]."""
    torchrun = int(os.environ.get("WORLD_SIZE", "1")) > 1
    return torchrun and os.environ.get("RANK", "0") != "0" and not user_message(exc).startswith("[rank ")


def run_command(command, args):
    """train, predict, benchmark or export: the exit code."""
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    if command in COMMAND_KEYS and world > 1:  # each process ran it whole, into one folder; one failed, unsaid
        raise UserError(f"{command} runs in one process, not under torchrun (its {world} processes would each "
                        f"run it whole, into the same folder): python train_unet.py {command} key=value ...")
    if command == "train":
        try:  # the config check imports the model library: seconds in which a Ctrl-C has written nothing
            cfg = parse_overrides(args)
        except KeyboardInterrupt:
            raise KeyboardInterrupt(INTERRUPTED["train, at start"]) from None
        train_main(cfg, explicit_keys(args))
        return 0
    if command == "predict":
        return 1 if predict(parse_overrides(args, defaults=PREDICT_CONFIG))["failed"] else 0
    if command == "benchmark":
        rows = run_benchmark(args)["rows"]
        return 1 if any(r["status"].startswith("failed") for r in rows) else 0
    if command == "export":
        export(parse_overrides(args, defaults=EXPORT_CONFIG))
        return 0
    hint = split_argument_hint([command, *args], 0)
    raise UserError(f"{command!r} is a key, not a command{hint}" if hint else
                    f"unknown command {command!r}: use train (the default), predict, benchmark or export, "
                    f"followed by key=value settings")


def train_main(cfg, explicit=()):
    """`train`, also under torchrun: only rank 0 prints, the others train quietly."""
    started = time.time()
    try:
        setup_distributed(cfg["device"])  # in the try: a stop while joining says what a stop in start-up says
        if not DIST.is_main:
            with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):
                return train({**cfg, "progress": False}, set(explicit) | {"progress"})
        return train(cfg, explicit)
    except UserError as exc:
        if DIST.enabled and not (getattr(exc, "alike", False) or getattr(exc, "silent", False)):  # the one that failed
            raise UserError(f"[rank {DIST.rank}] {user_message(exc)}") from None  # the others
        raise
    except (KeyboardInterrupt, RuntimeError, MemoryError) as exc:  # resume=True continues from last.pt
        if isinstance(exc, RuntimeError) and DIST.enabled and peer_failed(exc):
            with contextlib.suppress(KeyboardInterrupt):  # torchrun's SIGTERM meanwhile: this line all the same
                time.sleep(PEER_FAILED_GRACE_S)  # the failed rank's own error first (not mid-line), and its exit
            raise UserError(f"[rank {DIST.rank}] stopped: another process of this torchrun job ended (its error, "
                            f"where it printed one, and torchrun's report say which); "
                            f"{checkpoint_kept_words(cfg, started)}") from None
        if isinstance(exc, (RuntimeError, MemoryError)) and not stopped_with_its_workers(exc):
            died = worker_death(exc, cfg, started) or out_of_memory(exc, cfg, started)
            if died:
                raise (UserError(f"[rank {DIST.rank}] {died}") if DIST.enabled else died) from None
            raise
        stopped_workers_unreported()  # the run is over: its other loader's workers are shut down at exit
        raise KeyboardInterrupt(interrupted_run_words(cfg, started, explicit)) from None
    finally:
        cleanup_distributed()


def interrupted_run_words(cfg, started, explicit=()):
    """The line a run stopped by Ctrl-C (or SIGTERM) ends with. Its last.pt is the run's own where it resumed
    or wrote it since `started`; one older in a fresh run's folder is the earlier run's, not yet moved to
    previous/ (set-up stopped first), which resume=True with this run's settings would refuse."""
    folder = Path(cfg["checkpoint_dir"])
    last = folder / "last.pt"
    if STARTED_BY_BENCHMARK:  # a benchmark's row (run_child): its log had said resume=True, which it refuses
        return INTERRUPTED["train, a benchmark row"]
    if last.is_file() and (cfg["resume"] or last.stat().st_mtime >= started - 1):
        return INTERRUPTED["train"].replace("resume=True", resume_words(cfg, explicit))
    if last.is_file():
        return INTERRUPTED["train, in set-up"].format(folder=folder)
    moved = archived_since(folder, started)
    return INTERRUPTED["train, no checkpoint"] + (
        f"; the earlier run is in {moved}/ (move its files back to resume it)" if moved else "")


def resume_words(cfg, explicit=()):
    """What continues a stopped run: resume=True with its preset and every key it was given, as a resume must
    repeat them: checkpoint_dir finds its last.pt (left out, 'resume=True preset=debug epochs=4' resumed the run
    in checkpoints/, another one), data_dir and the data and optimisation keys are refused where they differ,
    epochs left out is CONFIG's (which would extend or shorten the run: a note, easily missed), and the other
    settings keep the run as it was. Given (given_keys): typed, or away from CONFIG (preset=debug epochs=10:
    'resume=True preset=debug' would end the run at debug's 2). `cfg`: as given, before the preset; its typed
    keys (parse_overrides') count where `explicit` is not passed (the out-of-memory and worker-death lines)."""
    preset, typed = cfg.get("preset"), given_keys(cfg, {*explicit, *getattr(cfg, "typed", ())})
    given = [k for k in CONFIG if k in typed and k not in ("resume", "preset")]
    return " ".join(["resume=True", *([f"preset={preset}"] if preset else []),
                     *(f"{k}={cli_value(cfg[k])}" for k in given)])


@contextlib.contextmanager
def interrupts_held():
    """Ctrl-C and SIGTERM wait until the block is done, then stop the run as usual. finish_epoch writes
    last.pt, best.pt and history.csv in it: stopped after last.pt alone, a resumed run would never write
    the best epoch's weights (last.pt already records its IoU as the one to beat)."""
    if threading.current_thread() is not threading.main_thread():  # signals reach only the main thread
        yield
        return
    held = []
    # SIGCHLD too: a stop sent to the whole process group also ends the DataLoader's workers, and torch's
    # handler for it raises (stopped_with_its_workers) mid-write. An ignored signal stays ignored.
    wanted = [signal.SIGINT, *STOP_SIGNALS, *([signal.SIGCHLD] if hasattr(signal, "SIGCHLD") else [])]
    previous = {sig: signal.getsignal(sig) for sig in wanted if signal.getsignal(sig) is not signal.SIG_IGN}
    for sig in previous:
        signal.signal(sig, lambda signum, frame: held.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if any(sig != getattr(signal, "SIGCHLD", None) for sig in held):
        stops = [sig for sig in held if sig in STOP_SIGNALS]
        if stops:
            STOP_SIGNAL.append(signal.Signals(stops[0]).name)  # named as sigterm_as_exit names one (stop_word)
        raise KeyboardInterrupt
    if held and callable(previous[signal.SIGCHLD]):  # a child ended meanwhile: its handler judges it now
        previous[signal.SIGCHLD](signal.SIGCHLD, None)


# A rank that saw another end waits this long before saying so: the other closes its connections just before
# printing its error, and the two lines came out of the shared pipe interleaved, this one first; torchrun's
# report then named the waiting rank, which exited first, as the root cause.
PEER_FAILED_GRACE_S = 2.0


def peer_failed(exc):
    """A collective's error where another process of the job has ended (a rank that stopped on an error only
    it checks, such as an unwritable checkpoint_dir, or one killed): gloo's "Connection closed by peer" with
    25 lines of traceback on every surviving rank, NCCL's aborted communicator."""
    return any(sign in str(exc) for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                                              "NCCL communicator was aborted"))


def stopped_with_its_workers(exc):
    """A stop sent to the whole process group (Slurm's scancel, `kill -TERM -PGID`, timeout) also reaches
    the DataLoader's workers, and torch's SIGCHLD handler reports their end as this RuntimeError, before
    or while the run stops: an interruption, not a failure."""
    text = str(exc)
    return "DataLoader worker" in text and ("signal: Terminated" in text or "signal: Interrupt" in text)


def worker_death(exc, cfg, started=None):
    """A one-line UserError for a DataLoader worker that died other than by a stop (the out-of-memory
    killer's SIGKILL; a bus error where /dev/shm is full): torch's RuntimeError came with 30 lines of
    traceback and no word of what to do. None for any other RuntimeError."""
    text = str(exc)
    if "DataLoader worker" not in text:
        return None
    signal_name = (re.search(r"killed by signal: ([^.\n]+)", text) or [None, ""])[1].strip()
    why = {"Killed": ", as the out-of-memory killer ends a process", "Bus error": ": shared memory (/dev/shm) full?"}
    kept = checkpoint_kept_words(cfg, started)
    how = f" (signal {signal_name}{why.get(signal_name, '')})" if signal_name else ""
    limit = file_size_limit()  # it bounds the shared-memory files workers hand batches over in too
    size_limit = f"; the file-size limit here (ulimit -f: {size_text(limit)}) bounds the shared memory workers " \
                 f"pass batches through: raise it (ulimit -f unlimited)" if limit is not None else ""
    return UserError(f"a data loader worker died{how}; {kept}{little_shared_memory()}{size_limit}; to need less "
                     f"memory, use fewer num_workers (0 reads in the training process) or a smaller batch_size")


def checkpoint_kept_words(cfg, started=None):
    """Whether a stopped run left a last.pt to resume: its own (resumed, or written since `started`); in a new
    run's start-up the folder's last.pt is still the earlier run's, not yet moved to previous/ (as
    interrupted_run_words judges it)."""
    last = Path(cfg["checkpoint_dir"]) / "last.pt"
    if last.is_file() and (cfg["resume"] or started is None or last.stat().st_mtime >= started - 1):
        return f"last.pt is intact: {resume_words(cfg)} continues from it"
    return "no checkpoint of this run was written yet" + (" (the last.pt there is an earlier run's)"
                                                          if last.is_file() else "")


def out_of_memory(exc, cfg, started=None):
    """A one-line UserError for memory that ran out in a run: the GPU's (torch.cuda.OutOfMemoryError), or the
    host's (torch's 'DefaultCPUAllocator: can't allocate memory', numpy's MemoryError: a container's limit, or
    ulimit -v), or a thread that could not start (ulimit -u, or -v): each was a traceback. None for other errors."""
    text = str(exc)
    gpu = isinstance(exc, torch.cuda.OutOfMemoryError) or "CUDA out of memory" in text or "MPS backend out of " \
        "memory" in text
    if not (gpu or isinstance(exc, MemoryError) or "can't allocate memory" in text or "can't start new thread" in text):
        return None
    if "can't start new thread" in text:
        what = "could not start a thread (a limit on processes, ulimit -u, or on memory, ulimit -v)"
        fix = "raise the limit, or use num_workers=0"
    else:
        limit = address_space_limit()
        what = "ran out of " + ("GPU memory" if gpu else "memory" + (
            f" (this process may use {size_text(limit)}: ulimit -v)" if limit is not None else ""))
        fix = (f"use a smaller batch_size (accumulation_steps keeps the effective batch)"
               f"{', batch_size=auto' if gpu and cfg['batch_size'] != 'auto' else ''} or image_size"
               + ("" if gpu else ", or fewer num_workers"))
    return UserError(f"training {what} at batch_size={cfg['batch_size']}, image_size={cfg['image_size']}; "
                     f"{checkpoint_kept_words(cfg, started)}: {fix}")


def address_space_limit():
    """The memory this process may map (ulimit -v), in bytes; None where none is set."""
    return soft_limit("RLIMIT_AS")


def soft_limit(name):
    """This process's soft resource limit `name` (resource.RLIMIT_*); None where none is set, or where the system
    has no such limit (Windows)."""
    try:
        import resource

        soft = resource.getrlimit(getattr(resource, name))[0]
    except (ImportError, AttributeError, OSError, ValueError):
        return None
    return None if soft == resource.RLIM_INFINITY else soft


SHM_LOW_BYTES = 256 * 2**20  # /dev/shm with less free than this is named when a worker dies (Docker: 64 MB)


def little_shared_memory():
    """'; /dev/shm has X free ...' where it is small: DataLoader workers pass each batch through it, and a
    container's 64 MB default killed a worker on a batch of 4 x 1024² images, said only as 'worker died'."""
    try:
        free = shutil.disk_usage("/dev/shm").free
    except OSError:  # no /dev/shm (macOS, Windows)
        return ""
    return (f"; /dev/shm, through which workers pass batches, has {size_text(free)} free (Docker's default is "
            f"64 MB: run the container with --shm-size=2g)" if free < SHM_LOW_BYTES else "")


# ----------------------------------------------------------------------------------------------------
# II.2 Train: set up (or resume), then the epoch loop with its fallback to a safer precision.
# ----------------------------------------------------------------------------------------------------
def train(cfg, explicit=()):
    """Train with a config; returns {'history', 'best_iou', 'fallbacks', ...}.

    `explicit`: keys the user gave on the command line; with keys whose value differs from CONFIG they
    win over the preset (apply_preset).
    """
    explicit = set(explicit) | getattr(cfg, "typed", set())  # parse_overrides' keys (TypedConfig)
    cfg, started = check_config_dict(cfg), time.time()
    try:
        with process_state_kept():
            return train_checked(cfg, explicit)
    except KeyboardInterrupt as exc:  # a notebook's interrupt says what the command line's says
        let_the_run_go(exc)
        if exc.args:
            raise
        raise KeyboardInterrupt(interrupted_run_words(cfg, started, explicit)) from None
    except UserError as exc:
        let_the_run_go(exc)
        raise


def let_the_run_go(exc):
    """Free what a stopped run held: its loader workers (hundreds of MB each), decoded-image folders and
    the rest live in the locals of the frames `exc` passed through, and a notebook keeps its last
    exception (sys.last_value), so they outlived the run, until another error took its place. A
    command-line run frees them by ending; an internal bug keeps its frames, for a post-mortem."""
    if isinstance(exc, KeyboardInterrupt):
        stopped_workers_unreported()
    traceback.clear_frames(exc.__traceback__)  # a loader no cycle holds shuts its workers down here
    gc.collect()  # the loaders and caches sit in reference cycles: their workers and folders go now


def stopped_workers_unreported():
    """torch's SIGCHLD handler set back to the default, on the main thread, once a run has stopped: loader
    workers a SIGTERM to the whole process group stopped too were reported as the loaders shut them down, in a
    traceback ("Exception ignored in ... RuntimeError: DataLoader worker ... Terminated"). A later run's
    loaders still find a dead worker by polling its liveness."""
    if hasattr(signal, "SIGCHLD") and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


def train_checked(cfg, explicit):
    """train, its config a dict of known keys: the run set up in its folder, held, then the epoch loop."""
    reset_peak_memory()  # CUDA's peak is reset each epoch (run_epoch)
    with run_folders_held():  # no other run writes into this run's checkpoint folder meanwhile
        try:
            cfg, hw, run, (train_loader, val_loader) = set_up_training(cfg, explicit)
        finally:  # a start-up stopped by an error leaves no facts a later call could take (start_up_facts)
            CHECKED_HERE.clear()
        with run.logger.closed_if_stopped():
            return epoch_loop(run, train_loader, val_loader, hw, cfg)


def epoch_loop(run, train_loader, val_loader, hw, cfg):
    """The epochs from the one after run's last, each validated and checkpointed; a non-finite streak rolls
    back and runs the epoch again in a safer precision (fall_back); early stopping ends it."""
    epoch = run.epoch + 1
    while epoch <= cfg["epochs"]:
        snapshot = rollback_point(run, cfg)  # the last known-good state, on the host (nan_guard)
        try:
            row = run_epoch(run, epoch, train_loader, val_loader, hw, cfg)
        except NonFiniteStreak as bad:
            fall_back(run, bad, snapshot, hw, cfg, epoch)
            continue  # the same epoch again, same data order, safer precision
        finish_epoch(run, row, cfg)
        if stop_early(run, epoch, cfg):
            break
        epoch += 1
    return finish_run(run, hw, cfg)


def set_up_training(cfg, explicit):
    """What the epoch loop needs, settled in dependency order: (effective config, hardware, Run, loaders)."""
    # 1. The config as given (preset applied, values checked, the checkpoint folder writable); last.pt to resume.
    cfg, preset_line, state = checked_config_and_resume_state(cfg, explicit)
    auto_keys = auto_keys_given(cfg, state)
    # 2. Hardware, precision (a resumed run that fell back keeps its safer precision).
    cfg, hw, prec, notes = setup_precision(cfg, state, explicit)
    notes.insert(0, preset_line and ("preset", preset_line))
    seed_everything(cfg["seed"])
    # 3. The data: split, a resume's checked to be its run's, then checked; its intensity range and class weights
    # (saved with the model), class names.
    data_cfg = cfg if cfg["batch_size"] != "auto" else {**cfg, "batch_size": 1}  # data_pairs' why
    train_pairs, val_pairs = listed_pairs(data_cfg)
    # a resume's data is its run's before the data check reads it: another data set given as data_dir had been
    # refused for its masks (values the run's num_classes cannot hold), not for being another data set
    data_split = same_split_as_resumed(state, train_pairs, val_pairs, cfg, notes)
    checked_pairs(train_pairs, val_pairs, data_cfg)
    notes += [unused_val_fraction(cfg, explicit), unused_patch_keys(cfg, explicit), changed_loss_rule(cfg, state),
              unused_amp_dtype(cfg, explicit) if state is None else None]  # a resume puts the run's back
    cfg = {**cfg, "intensity_range": run_intensity_range(cfg, state, train_pairs, val_pairs, notes, data_split),
           "class_weights": run_class_weights(cfg, state, train_pairs, notes)}
    class_names = same_class_names(state, load_class_names(cfg), cfg)  # before anything moves
    # 4. The effective config (batch size, layout, CPU probe), and the loaders built from it.
    samples = training_samples(train_pairs, cfg)
    cfg, prec, layout, auto_batch = effective_config(cfg, hw, prec, state, samples, notes)
    loaders = build_loaders(train_pairs, val_pairs, cfg, hw)
    # 5. Model, optimizer, LR schedule, scaler: new, or resumed exactly; then the loss and the logger.
    steps_per_epoch = optimizer_steps_per_epoch(len(loaders[0]), cfg["accumulation_steps"])
    run = setup_run(cfg, hw, prec, (samples, steps_per_epoch), state, notes)
    run.class_names, run.logger, run.data_split = class_names, RunLogger.create(cfg), data_split
    run.auto_keys = auto_keys
    notes.append(run.logger.gap_note(state))
    run.loss_fn = SegLoss(cfg["num_classes"], cfg["loss"], cfg["class_weights"], hw.device)
    # 6. Say what was decided, and why.
    print(banner(hw, run.prec, cfg, notes, layout))
    announce_run(cfg, hw, run, (len(train_pairs), len(val_pairs), len(loaders[0]), steps_per_epoch, samples),
                 {"preset": preset_line, "batch_size_auto": auto_batch})
    return cfg, hw, run, loaders


def checked_config_and_resume_state(cfg, explicit):
    """(cfg with its preset, the preset's banner line, last.pt's state or None): the config's values, the
    checkpoint folder (rank 0) and, with resume=True, last.pt; a UserError said once where every torchrun
    process met it (said_once_if_alike)."""
    try:
        given = validate_config(cfg)
        typed = given_keys(given, explicit)  # before the preset's values are in: the refusal's hint
        cfg, preset_line = apply_preset(given, explicit)
        check_paths_given(cfg, ("data_dir", "checkpoint_dir"))  # empty: the current folder, its files moved aside
        check_not_in_a_data_set(cfg["checkpoint_dir"])
        check_worker_count(cfg)
        check_class_weights_weigh(cfg)
        check_model_takes_image_size(cfg)
        if DIST.is_main:
            if not Path(cfg["checkpoint_dir"]).exists():
                MADE_FOLDERS[Path(cfg["checkpoint_dir"])] = threading.get_ident()
            check_writable(Path(cfg["checkpoint_dir"]), "checkpoint_dir")
            hold_checkpoint_dir(Path(cfg["checkpoint_dir"]))
            remove_stale_temps(Path(cfg["checkpoint_dir"]))
        state, resumed = resume_state(cfg, Path(cfg["checkpoint_dir"]), typed) if cfg["resume"] else (None, cfg)
        kept = [k for k in PRESETS.get(cfg["preset"]) or () if resumed[k] != cfg[k]]
        cfg, preset_line = resumed, describe_preset(resumed, typed, kept) if kept else preset_line
    except UserError as exc:
        said_once_if_alike(exc)
    said_once_if_alike(None)  # every process joins the exchange, errors or not
    return cfg, preset_line, state


def auto_keys_given(cfg, state):
    """The AUTO_KEYS this run resolves from "auto" (batch_size, class_weights): given so now, or, resumed,
    given so by the run it continues and now the same: a refused resume of a class_weights=auto run had
    suggested its list of weights, not the auto it was given."""
    was = (state or {}).get("auto_keys") or ()
    return tuple(k for k in AUTO_KEYS if cfg[k] == "auto" or (k in was and cfg[k] == state["config"].get(k)))


def check_not_in_a_data_set(checkpoint_dir, key="checkpoint_dir", what="checkpoints and logs", example="checkpoints"):
    """checkpoint_dir= (or the benchmark's or export's output=) a data set's images/ or masks/ folder (the other
    beside it), or a folder inside one: best.pt, logs and tensorboard/ (or model.onnx) went among its files,
    and every later run over that data set noted them as entries not read. A folder above it counts only
    where it holds images itself: ~/images/projects/run1, with a ~/masks of other uses beside ~/images, is
    no data set's."""
    folder = Path(checkpoint_dir).resolve()
    part = next((p for p in (folder, *folder.parents) if data_set_part(p) and p.is_dir()
                 and (p == folder or holds_images(p))), None)
    if part is not None:
        where = "is" if part == folder else f"is inside {part}, which is"
        data_set = part.parent.parent if part.parent.name in ("train", "val") else part.parent
        raise UserError(f"{key}={checkpoint_dir} {where} a data set's {part.name} folder: {what} "
                        f"would go among its files; choose another {key} (e.g. "
                        f"{cli_value(data_set.parent / example / data_set.name)})")


def holds_images(folder):
    """Whether a folder holds image files itself; one that cannot be listed is taken to (refused as before)."""
    try:
        return image_file_count(folder) > 0
    except OSError:
        return True


def data_set_part(folder):
    """'images' or 'masks' where a (resolved) folder is named so and has its partner beside it, as a data set's
    have: a folder that predict's masks, or a run's checkpoints, would spoil. Else None."""
    partner = {"images": "masks", "masks": "images"}.get(folder.name)
    return folder.name if partner and (folder.parent / partner).is_dir() else None


def same_class_names(state, names, cfg):
    """class_names.txt's names (a bad file stops the run here); a resumed run's must be its checkpoint's:
    history.csv's per-class columns carry the run's names, and a renamed class's values had no column."""
    was = (state or {}).get("class_names")
    if was is None or was == names:
        return names
    path = Path(cfg["data_dir"]) / "class_names.txt"
    now = f"{path} names the classes {', '.join(names)}" if path.is_file() else \
        f"there is no {path} now (the classes would be called {', '.join(names)})"  # it was named, though gone
    raise UserError(f"cannot resume exactly: {now}; this run began with {', '.join(was)} (history.csv's columns): put "
                    f"the names back to resume (rename after the run), or start a new run in another checkpoint_dir")


def unused_val_fraction(cfg, explicit):
    """A note where val_fraction was given (on the command line, or changed in CONFIG) but data_dir's own
    train/ and val/ folders are the split; else None."""
    root = Path(cfg["data_dir"])
    given = "val_fraction" in explicit or cfg["val_fraction"] != CONFIG["val_fraction"]
    if not (given and split_folders(root)):
        return None
    return f"val_fraction={cfg['val_fraction']:g} not used: {root} has train/ and val/ folders, which are the split"


def unused_amp_dtype(cfg, explicit):
    """A note where amp_dtype was given (typed, or changed in CONFIG) with use_amp=False, which reads none of it:
    use_amp=False amp_dtype=bfloat16 trained in fp32, unsaid; else None."""
    given = "amp_dtype" in explicit or cfg["amp_dtype"] != CONFIG["amp_dtype"]
    if cfg["use_amp"] or not given or cfg["amp_dtype"] == "auto":
        return None
    return (f"amp_dtype={cfg['amp_dtype']} not used: use_amp=False runs in fp32 (give use_amp=True for "
            f"{cfg['amp_dtype']})")


# The keys of patch mode alone (data_mode="patch": its patches and its sliding window); fit mode reads none.
PATCH_ONLY_KEYS = ("patch_scale", "patch_foreground", "patches_per_image", "tile_overlap", "tile_batch_size")


def unused_patch_keys(cfg, explicit):
    """A note where patch-mode keys were given (on the command line, or changed in CONFIG) to a fit-mode run,
    which reads none of them; else None."""
    given = [k for k in PATCH_ONLY_KEYS if k in explicit or cfg[k] != CONFIG[k]]
    if cfg["data_mode"] != "fit" or not given:
        return None
    return (f"{', '.join(f'{k}={cfg[k]}' for k in given)} not used: data_mode=fit resizes each image whole (they "
            f"are data_mode=patch's)")


def split_folders(data_dir):
    """Whether data_dir has train/ and val/ folders, which are the split (val_fraction unused)."""
    root = Path(data_dir)
    return (root / "train").is_dir() and (root / "val").is_dir()


def check_class_weights_weigh(cfg):
    """class_weights weigh the ce and focal terms: with a loss that has neither they would change nothing
    while the banner shows them. Checked at training's start, not in validate_config: a checkpoint saved
    so before this check still loads for predict and export."""
    if cfg["class_weights"] is not None and not {"ce", "focal"} & set(loss_terms(cfg["loss"])):
        raise UserError(f"class_weights={cfg['class_weights']!r} weighs the ce and focal terms, and loss={cfg['loss']} "
                        f"has neither: add one (e.g. loss={cfg['loss']}+ce), or set class_weights=None")
    if isinstance(cfg["class_weights"], (list, tuple)):
        batch = cfg["batch_size"] if isinstance(cfg["batch_size"], int) else 1
        overflow = weights_overflow(max(float(w) for w in cfg["class_weights"]), batch * cfg["image_size"] ** 2)
        if overflow:
            raise UserError(overflow)


def resume_state(cfg, ckpt_dir, typed=()):
    """(last.pt's state for resume=True, cfg with the run's early_stopping_patience where not given), or a
    UserError saying why it cannot continue exactly. `typed`: the keys given (not set by a preset), for the
    refusal's hint."""
    path = ckpt_dir / "last.pt"
    if not path.is_file():
        archived = newest_archived_run(ckpt_dir)
        moved = f"; the run before moved to {archived}/ when a new run started there: move its files back to " \
                f"resume it" if archived and not path.exists() else ""
        raise UserError(f"resume=True but {path} {'is not a file' if path.exists() else 'does not exist'}: "
                        f"start without resume, or set checkpoint_dir to the run you want to continue{moved}")
    in_the_way = [name for name in ("best.pt", "history.csv", "config.json") if (ckpt_dir / name).is_dir()]
    if in_the_way:  # found at the first epoch's end, as a traceback (best.pt's was a line)
        raise UserError(f"{ckpt_dir / in_the_way[0]} is a folder, where the resumed run writes its file of that "
                        f"name: move or rename it")
    state = load_checkpoint(path, fix=f"restore it from a copy to resume, or train without resume=True (a new run "
                                      f"moves it to {ckpt_dir / 'previous'}/)")
    check_resumable(state, path)
    refuse_missing_data_dir(state, cfg, path)
    changed = changed_resume_keys(state, cfg)
    changed += [key for key in data_dir_left_out(state, cfg, typed) if key not in changed]
    if changed:
        was, now = state["config"].get("preset"), cfg.get("preset")
        hint = f" (it ran with preset={was}: give preset={was} again)" if was and was != now else \
            f" (set by preset={now}: leave it out)" if now and now != was and set(changed) & (set(PRESETS[now]) -
                                                                                          set(typed)) else ""
        saved = {k: state["config"].get(k, CONFIG[k]) for k in changed}
        if "data_dir" in saved:  # as the run resolved it: a relative data_dir from its own folder is found
            saved["data_dir"] = run_data_dir(state)
        auto = state.get("auto_keys") or ()  # given as auto (auto_keys_given): the same values are auto's
        again = " ".join(f"{k}={'auto' if k in auto else cli_value(v)}" for k, v in saved.items())
        raise UserError(f"cannot resume exactly: {path} was trained with "
                        + ", ".join(f"{k}={v!r}" for k, v in saved.items())
                        + "; this run has " + ", ".join(f"{k}={cfg[k]!r}" for k in changed) + hint
                        + f": resume with the same values ({again}), or start a new run in another checkpoint_dir")
    refuse_no_epochs_left(state, cfg, path)
    cfg = kept_patience(state, cfg, typed)
    refuse_early_stopped(state, cfg, path)
    return state, cfg


def kept_patience(state, cfg, typed):
    """early_stopping_patience not given on resume: the run's. CONFIG's 5 had stopped a run trained with None
    three epochs into its resume, unsaid (the uninterrupted run trained all 14), and refused one stopped by
    Ctrl-C with 'stopped early'; the stop's own 'resume=True continues' left it out. Given: typed, or set by a
    preset other than the run's (preset=debug's None had been said in the banner and the run's 5 kept, unsaid);
    the run's own preset, given again as its stop line says, keeps the run's."""
    preset, was = cfg.get("preset"), state["config"].get("preset")
    by_preset = preset and preset != was and "early_stopping_patience" in PRESETS[preset]
    if "early_stopping_patience" in typed or by_preset or "early_stopping_patience" not in state["config"]:
        return cfg
    return {**cfg, "early_stopping_patience": state["config"]["early_stopping_patience"]}


# What a resume reads of last.pt (Run.load, setup_run, keep_chosen_precision); the rest has defaults for
# checkpoints from before it
RESUME_STATE_KEYS = ("optimizer", "scheduler", "epoch", "best_iou", "epochs_since_best", "rng", "history",
                     "precision")


def newest_archived_run(ckpt_dir):
    """The newest folder in <ckpt_dir>/previous/ that holds a last.pt (archive_previous_run's), or None."""
    folders = [p for p in (ckpt_dir / "previous").glob("*") if (p / "last.pt").is_file()]
    return max(folders, key=lambda p: p.stat().st_mtime, default=None)


def data_dir_left_out(state, cfg, typed):
    """['data_dir'] where it was not given and is not the folder the run trained on, which is still there: the
    refusal then names it with the other keys (same_split_as_resumed would have, in a second refusal). A
    data_dir given is judged by its files: a data set moved or copied resumes."""
    was = run_data_dir(state)
    if "data_dir" in typed or was is None or not os.path.isdir(was) or \
            os.path.realpath(was) == os.path.realpath(cfg["data_dir"]):
        return []
    return ["data_dir"]


def cli_value(value, posix=os.name == "posix"):
    """A config value as the command line takes it (parse_overrides): a list as low,high; quoted where the
    shell would split it."""
    text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)
    if not posix:  # cmd.exe keeps single quote marks: double quotes, where needed
        import subprocess
        return subprocess.list2cmdline([text])
    return shlex.quote(text)


def check_resumable(state, path):
    """last.pt as training writes it: a best.pt copied there (no optimizer state), or a file saved another way
    (a notebook's torch.save of some of its keys: a KeyError deep in the resume, and a refusal quoting
    CONFIG's defaults as what the file 'was trained with'), is a one-line error."""
    if "optimizer" not in state and all(key in state for key in ("history", "epoch")):
        raise UserError(f"{path} holds a model's weights without the optimizer state a resume continues from (a "
                        f"best.pt copied there?): put back the last.pt training wrote, or start a new run")
    missing = [key for key in RESUME_STATE_KEYS if key not in state]
    if missing:
        raise UserError(f"{path} lacks {', '.join(missing)}, which a resume continues from: it is not a last.pt as "
                        f"training writes it (saved another way?): put back the last.pt training wrote, or start "
                        f"a new run")


def refuse_missing_data_dir(state, cfg, path):
    """A resume whose data_dir is not there: split_pairs' error would offer the embedded data set, which is
    another data set (refused later). The fix names the run's folder, or says to put its data back. The
    embedded set's folder is written again as it was (data_pairs)."""
    data_dir = Path(cfg["data_dir"])
    if data_dir.exists() or data_dir == Path(EMBEDDED_DATA_DIR):
        return
    was = run_data_dir(state)
    if was and os.path.isdir(was) and os.path.realpath(was) != os.path.realpath(data_dir):
        fix = f"{was}, which is still there: give data_dir={cli_value(was)}"
    else:
        fix = f"{was or data_dir}: put that data set back there, or give data_dir= the folder it moved to"
    raise UserError(f"resume=True but data_dir {data_dir} does not exist: {path} trained on {fix}")


def refuse_no_epochs_left(state, cfg, path):
    """A resume with epochs at or below those trained has nothing to do: refused, with the epochs that finish
    the run's schedule where it was stopped before its end (the plan, not a made-up extension)."""
    done, planned = state["epoch"], state["config"].get("epochs", 0)
    if done < cfg["epochs"]:
        return
    fix = f"give epochs={planned} to finish its schedule (it stopped after {done} of {planned})" if planned > done \
        else f"raise epochs to continue, e.g. epochs={done + 5}"
    raise UserError(f"{path} has already trained {done} epoch(s) and epochs={cfg['epochs']}: {fix}")


def refuse_early_stopped(state, cfg, path):
    """A run that stopped early, resumed with the same patience, trained one more epoch and stopped again,
    on every resume: refused, with the key that lets it go on."""
    patience, waited = cfg["early_stopping_patience"], state.get("epochs_since_best", 0)
    if patience is None or waited < patience:
        return
    saved = state["config"].get("early_stopping_patience", CONFIG["early_stopping_patience"])
    finished = state["epoch"] >= state["config"].get("epochs", state["epoch"])  # never stopped at its last epoch
    what = f"stopped early after epoch {state['epoch']}: its val IoU had not improved for {waited} epoch(s)" \
        if saved is not None and waited >= saved and not finished else \
        f"ended its {state['epoch']} epochs without a better val IoU for {waited} epoch(s)" if finished else \
        f"has not improved its val IoU for {waited} epoch(s) (it trained with early_stopping_patience={saved})"
    raise UserError(f"{path} {what}, and early_stopping_patience={patience}: raise it to go on (e.g. "
                    f"early_stopping_patience={waited + 3}), or set it to None to train every epoch")


def changed_resume_keys(state, cfg):
    """The RESUME_KEYS whose value differs from the checkpoint's config (all of them, so one
    refusal names every one). A key newer than the checkpoint counts at its default; "auto" (batch size,
    class weights) takes the checkpoint's, but class weights typed as a list: auto would weigh the masks
    anew (the banner had called a hand-typed [1, 5] 'of the training masks as the run began'); data_dir is
    judged by its files (same_split_as_resumed) where the checkpoint recorded them, not by how the folder is
    written or where it moved, unless it holds no data (no_data_elsewhere)."""
    changed, saved = [], state["config"]
    for key in RESUME_KEYS:
        if (key in AUTO_KEYS and cfg[key] == "auto" and resumed_as_auto(state, key)) or (
                key == "data_dir" and state.get("data_split") and not no_data_elsewhere(saved.get(key), cfg[key])):
            continue
        if key in PATCH_ONLY_KEYS and cfg["data_mode"] == saved.get("data_mode", "fit") == "fit":  # none read
            continue
        if key == "val_fraction" and split_folders(cfg["data_dir"]):  # train/ and val/ are the split, not it
            continue
        if saved.get(key, CONFIG[key]) != cfg[key]:
            changed.append(key)
    return changed


def resumed_as_auto(state, key):
    """Whether a resume given key="auto" takes the run's value: its batch size always (a resume keeps the
    batch); its class weights where the run was given auto too, or its last.pt predates the record of that
    (a run with none: run_class_weights says so)."""
    auto = state.get("auto_keys", AUTO_KEYS)
    return key == "batch_size" or key in auto or state["config"].get(key) is None


def split_record(train_pairs, val_pairs, data_dir):
    """Which files a run trains and validates on: their counts, a digest of their stems (the seeded split's
    order; not their folder: a data set moved, or given as ./data, is the same split) and one of their
    sizes in bytes (another data set with the same file names, e.g. 0001.png, ... differs in them), and
    the folder, resolved (a relative data_dir is then the same folder from any working directory)."""
    names = lambda pairs: "\n".join(Path(image).stem for image, _ in pairs)  # noqa: E731
    # surrogateescape: a name whose bytes are not UTF-8 is hashed as those bytes (strict UTF-8 stopped the run)
    stems = f"{names(train_pairs)}\n--\n{names(val_pairs)}".encode("utf-8", "surrogateescape")
    digest = hashlib.sha256(stems).hexdigest()[:16]
    stats = [os.stat(path) for pair in (*train_pairs, *val_pairs) for path in pair]
    sizes = ",".join(str(st.st_size) for st in stats)
    times = ",".join(str(int(st.st_mtime)) for st in stats)  # whole seconds: what a copy that keeps times keeps
    # status-change times: what no copy keeps, and a rename, a swap of two files' names or an edit whose times
    # were put back sets (two masks of one size swapped resumed with no word)
    changed = ",".join(str(st.st_ctime_ns) for st in stats)
    return {"train": len(train_pairs), "val": len(val_pairs), "digest": digest,
            "sizes": hashlib.sha256(sizes.encode()).hexdigest()[:16], "folder": os.path.realpath(data_dir),
            "times": hashlib.sha256(times.encode()).hexdigest()[:16],
            "changed": hashlib.sha256(changed.encode()).hexdigest()[:16]}


def same_split_as_resumed(state, train_pairs, val_pairs, cfg, notes):
    """This run's split_record; a resumed run's must be its checkpoint's. Images added to or removed from
    data_dir reshuffle the seeded split: images the model trained on would be validated (leakage), and
    best.pt would compare IoUs over two different validation sets. Files of the same names with other
    sizes: in another folder while the run's own still holds its data, another data set (refused); in the
    run's own folder, or in another where its own holds its data no more (moved, then edited), edited (a
    note). A checkpoint from before the record (or before its sizes): not checked (or not by size)."""
    record, saved = split_record(train_pairs, val_pairs, cfg["data_dir"]), (state or {}).get("data_split")
    if not saved:
        return record
    was = cli_value(run_data_dir(state) or cfg["data_dir"])
    folder = saved.get("folder", os.path.realpath(state["config"].get("data_dir", cfg["data_dir"])))
    elsewhere = folder != record["folder"]
    # the folder it began on holds its data still (a choice to make), or no more (gone, emptied, reused: moved)
    holds = elsewhere and still_holds_the_split({**saved, "folder": folder}, cfg)
    moved = elsewhere and not holds
    if [saved[k] for k in ("train", "val", "digest")] != [record[k] for k in ("train", "val", "digest")]:
        fix = "put the folder back as it was" if not elsewhere else f"give data_dir={was}" if not moved else \
            f"give data_dir= the folder that holds the data it began on in {folder}"
        raise UserError(f"cannot resume exactly: {cfg['data_dir']} is not the data set this run started on "
                        f"({saved['train']} train / {saved['val']} val images then, {record['train']} / "
                        f"{record['val']} now, or other files): {fix}, or start a new run in another checkpoint_dir")
    if saved.get("sizes", record["sizes"]) != record["sizes"]:
        if elsewhere and not moved:
            raise UserError(f"cannot resume exactly: {cfg['data_dir']} holds files named as those this run trained "
                            f"on in {was}, with other contents: give data_dir={was}, or start a new run in another "
                            f"checkpoint_dir")
        notes.append(f"files in {cfg['data_dir']} changed since this run began (same names, other file sizes)"
                     + (f"; it began in {folder}, which no longer holds them" if moved else "")
                     + ": the resume trains and validates on them as they are now" + (
                         " (if they are another data set, not the run's edited, start a new run in another "
                         "checkpoint_dir)" if moved else ""))
    elif not elsewhere and saved.get("times", record["times"]) != record["times"]:
        # same names and sizes (an uncompressed BMP or TIFF edited keeps its size), other modification times
        notes.append(f"files in {cfg['data_dir']} were rewritten since this run began (same names and sizes, other "
                     f"modification times: edited in place, or copied again without their times): the resume trains "
                     f"and validates on them as they are now")
    elif not elsewhere and saved.get("changed", record["changed"]) != record["changed"]:
        notes.append(f"files in {cfg['data_dir']} were changed since this run began (same names, sizes and "
                     f"modification times, other status-change times: renamed, swapped, edited with their times put "
                     f"back, copied again with their times kept (cp -a, rsync -a, tar) or their permissions changed): "
                     f"the resume trains and validates on them as they are now")
    elif holds and saved.get("folder"):
        # names and sizes alike (uncompressed BMPs and TIFFs of one size are all one size): a copy, or not
        notes.append(f"this run began on {saved['folder']}, which still holds its data; it goes on with "
                     f"{cfg['data_dir']}, whose files have the same names and sizes: if that is not a copy of the "
                     f"same data, give data_dir={was} to resume exactly")
    return record


def still_holds_the_split(saved, cfg):
    """Whether the folder a resumed run recorded still holds files of the names and sizes it trained on:
    where it holds others now (the data moved, the folder reused), it is no copy to choose from."""
    try:
        train, val = split_pairs({**cfg, "data_dir": saved["folder"]})
        record = split_record(train, val, saved["folder"])
    except (UserError, OSError):
        return False
    return all(record[k] == saved.get(k, record[k]) for k in ("train", "val", "digest", "sizes"))


def no_data_elsewhere(was, data_dir):
    """Whether a resume's data_dir holds no data and is not the folder its run trained on (data_dir left
    out: the embedded set's folder, which would be written before the split could be compared)."""
    return was is not None and os.path.realpath(was) != os.path.realpath(data_dir) and not has_files(data_dir)


def run_hardware(cfg):
    """The hardware of `device`, able to run the config (sync_batchnorm needs CUDA)."""
    hw = detect_hardware(cfg["device"])
    if cfg["sync_batchnorm"] and hw.kind != "cuda":
        raise UserError("sync_batchnorm=True needs CUDA GPUs (PyTorch's SyncBatchNorm has no CPU kernel): "
                        "set sync_batchnorm=False")
    return hw


def setup_precision(cfg, state=None, explicit=()):
    """(cfg, hardware, the precision this run trains in, notes): a resumed run that fell back keeps its safer
    precision (keep_safer_precision), one whose precision was set keeps it (keep_chosen_precision, whose
    keys cfg then records), decided here, before the layout and batch size are."""
    hw = said_once_where_alike(run_hardware, cfg)  # device=cuda on CPUs: once, not a tagged line per process
    decided = decide_precision(hw, cfg["use_amp"], cfg["amp_dtype"], cfg["force_amp_dtype"])
    prec, cfg = (decided, cfg) if state is None else keep_chosen_precision(keep_safer_precision(decided, state, hw),
                                                                             cfg, state, hw, explicit)
    # tf32's note and prec.warning are noted once the probe has settled the precision (effective_config)
    apply_tf32(cfg["tf32_matmul_precision"], prec)
    setup_cudnn(hw)
    kept = prec is not decided
    notes = [decided.warning if kept else None, fit_cpu_threads()]  # prec.reason: the banner's precision line
    if cfg["compile_model"] and hw.kind == "cpu":
        notes.append("compile_model=True on CPU: expect about a minute of compiling for little or no gain")
    return cfg, hw, prec, notes


def run_intensity_range(cfg, state, train_pairs, val_pairs=(), notes=None, record=None):
    """scale_image's range for this run: a resumed run's (its model learnt on that scale; None for a run
    from before ranges were learnt), else intensity_range as given, else learnt from the training images
    (with a note where one or two of them set it: range_set_by_few). With none, an image no range maps
    (wide_integers_unmapped) stops the run here, not at its first read."""
    if state is None:
        found = cfg["intensity_range"] or learnt_intensity_range(train_pairs, cfg)
        if found is None:
            wide_integers_unmapped([*train_pairs, *val_pairs], cfg)
            if notes is not None:
                notes.append(val_wider_than_training(val_pairs, cfg))
        elif notes is not None and cfg["intensity_range"]:
            notes.append(range_unused(train_pairs, val_pairs, cfg) or range_leaves_out(train_pairs, val_pairs, cfg,
                                                                                     found))
        elif notes is not None:
            notes += [range_set_by_few(train_pairs, cfg, found), val_outside_learnt(val_pairs, cfg, found)]
        return found
    saved = state["config"].get("intensity_range")
    if cfg["intensity_range"] is not None and cfg["intensity_range"] != saved:
        raise UserError(f"cannot resume exactly: the run was trained with intensity_range={saved!r}, this run "
                        f"has {cfg['intensity_range']!r}: resume with intensity_range=None (the run's), or "
                        f"start a new run in another checkpoint_dir")
    if saved is not None and notes is not None:
        notes.append(resumed_range_note(train_pairs, val_pairs, cfg, state, record))
    return saved


def effective_config(cfg, hw, prec, state, n_train, notes):
    """What this run uses, settled in dependency order before anything (loaders, caches, the model) is
    built from it. `prec` is already the resumed run's (setup_precision); then the batch size (auto:
    searched in that precision), then the layout (on a CPU it depends on the batch size) and, on a CPU,
    both confirmed by the probe at that batch (cpu_probe_decision). Returns (cfg with both resolved, as
    config.json saves it; the precision; the layout and why; what batch_size=auto did)."""
    cfg, auto_batch = resolve_batch_size(cfg, hw, prec, state, n_train, notes)
    kept = resumed_cpu_modes(cfg, hw, prec, state)
    job = training_job_steps(cfg, state, n_train)
    prec, layout = ranks_agree(*(kept or cpu_probe_decision(cfg, hw, prec, notes, job_forwards=job)), hw, notes)
    notes += [prec.warning, tf32_note(cfg["tf32_matmul_precision"], prec, hw)]  # of the final precision
    return {**cfg, "channels_last": layout[0]}, prec, layout, auto_batch


def training_job_steps(cfg, state, n_train):
    """The training steps (micro-batches) this run has left to make: a run of fewer is not probed (a short
    debug run on a busy machine paid a minute's probe, uncached, for an 8 s epoch)."""
    return (cfg["epochs"] - (state["epoch"] if state else 0)) * (n_train // DIST.world // cfg["batch_size"])


def resumed_cpu_modes(cfg, hw, prec, state):
    """A run resumed on a CPU, after training on one: (precision, layout), each the checkpoint's where it is
    "auto" here, so the run goes on exactly as it began. Decided afresh, by a probe measured again (its
    cache is per machine, and a probe beside busy processes is not cached) or by the flag rule, it may pick
    the other layout (NHWC sums a convolution's terms in another order) or precision. None where there is
    nothing to keep: no resume, another device (a GPU decides by its own rules), a checkpoint from before
    device_kind was saved."""
    if state is None or hw.kind != "cpu" or state.get("device_kind") != "cpu":
        return None
    saved, was = state["precision"], state["config"]
    was_auto = precision_was_auto(was)
    native = saved == "fp32" or (saved == "bf16" and hw.bf16)
    if autos_precision(cfg, hw, prec) and was_auto and saved != prec.name and native:
        prec = Precision.of(DTYPES[saved], "auto, kept from the checkpoint (a resume goes on as last.pt trained)")
    if cfg["channels_last"] != "auto":
        return prec, decide_channels_last(cfg, hw, prec)
    nhwc = was["channels_last"]
    return prec, (nhwc, f"auto, kept from the checkpoint ({'NHWC' if nhwc else 'NCHW'}: a resume goes on as "
                        f"last.pt trained)")


def ranks_agree(prec, layout, hw, notes):
    """(precision, layout) that every torchrun process shares. DDP averages gradients element by element:
    a process in fp16 (scaled gradients) beside one in bf16, or in NHWC beside one in NCHW (another order
    of the elements in its buckets), would train replicas that silently drift apart. Processes on GPUs of
    different generations decide differently: all then take the safest precision every one runs natively
    (SAFETY_ORDER), and rank 0's layout."""
    native = native_precisions(hw)
    seen = gather_setup((prec.name, native, layout))
    names = sorted({name for name, _, _ in seen}, key=SAFETY_ORDER.index)
    if len(names) > 1:
        agreed = next(n for n in SAFETY_ORDER[SAFETY_ORDER.index(names[-1]):] if all(ok[n] for _, ok, _ in seen))
        prec = Precision.of(DTYPES[agreed], f"agreed by the {len(seen)} processes, which decided {', '.join(names)} "
                                            f"on their devices: all train in {agreed}, the safest all run natively")
        notes.append(("ranks", prec.reason))
    if any(other[0] != seen[0][2][0] for _, _, other in seen):
        layout = (seen[0][2][0], f"rank 0's, shared by every process ({seen[0][2][1]})")
    return prec, layout


def setup_run(cfg, hw, prec, sizes, state, notes):
    """Model, optimizer, LR schedule and scaler: new, or resumed exactly from `state`. `sizes`: (training
    samples, optimizer steps) per epoch."""
    samples, steps_per_epoch = sizes
    # resumed: every weight comes from the checkpoint, so pretrained ones are not fetched (offline resume)
    model = prepare_model(cfg if state is None else {**cfg, "encoder_weights": None}, hw)
    if cfg["sync_batchnorm"] and DIST.enabled:
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    optimizer = build_optimizer(model, cfg)
    schedule = lr_schedule(cfg) if state is None else resumed_schedule(state, cfg, steps_per_epoch, notes)
    start = (0, 0) if state is None else (state["scheduler"]["last_epoch"], state["epoch"])
    scheduler = build_scheduler(optimizer, cfg, steps_per_epoch, schedule, start)
    run = Run(model, model, optimizer, scheduler, build_scaler(prec, hw, cfg), prec, lr_schedule=schedule,
              ema=WeightEMA(model, cfg["ema_decay"], cfg["compile_model"]), device_kind=hw.kind)
    notes.append(run.ema.note(state))
    if state is not None:
        run.load(state)
        set_rng_state(state["rng"])
        notes.append(f"resumed from {cfg['checkpoint_dir']}/last.pt after epoch {state['epoch']}"
                     + other_world_size(state, cfg, samples) + other_clipping(state, cfg)
                     + other_modes(state, cfg, prec) + patience_words(state, cfg))
        notes.append(set_aside_other_runs_files(cfg["checkpoint_dir"], state) if DIST.is_main else None)
        notes.append(set_aside_edited_history(cfg["checkpoint_dir"], state) if DIST.is_main else None)
        notes.append(check_checkpoint_room(run, cfg, replaced=True) if DIST.is_main else None)
    else:  # the room first: a run refused for it had moved the earlier run to previous/ first, unsaid
        notes.append(check_checkpoint_room(run, cfg, replaced=False) if DIST.is_main else None)
        stopped = stopped_run_words(Path(cfg["checkpoint_dir"]) / "last.pt") if DIST.is_main else ""
        moved = archive_previous_run(cfg["checkpoint_dir"]) if DIST.is_main else None
        epochs = moved and any((Path(moved) / name).exists() for name in ("history.csv", "best.pt", "last.pt"))
        what = "an earlier run" if not moved or epochs else \
            "what an earlier run that finished no epoch wrote (config.json, its TensorBoard log)"
        notes.append(moved and f"{what} in {cfg['checkpoint_dir']} was moved to {moved}" + stopped
                     + archive_size_note(Path(moved).parent))
    run.eval_model = compiled(model, cfg["compile_model"])
    run.run_model = run.eval_model
    if DIST.enabled:  # wrapped after compile; gradients are all-reduced in buckets during backward
        ids = [hw.device] if hw.kind == "cuda" else None
        run.run_model = nn.parallel.DistributedDataParallel(run.eval_model, device_ids=ids)
    return run


def stopped_run_words(last):
    """' (it had stopped after epoch 1 of 4: ...)' where the last.pt a new run moves aside is of a run stopped
    before its epochs (Ctrl-C, a crash) and not by early stopping, else '': started again without resume=True,
    it was moved with no word that it could have continued."""
    try:
        with warnings.catch_warnings():  # a foreign file's warnings from torch: this says nothing of it either
            warnings.simplefilter("ignore")
            state = torch.load(last, map_location="cpu", weights_only=True, mmap=True)
        done, epochs = int(state["epoch"]), int(state["config"]["epochs"])
        patience = state["config"].get("early_stopping_patience")
        early = patience is not None and int(state["epochs_since_best"]) >= int(patience)
    except Exception:  # noqa: BLE001 - none, or not one this script can read: nothing to say of it
        return ""
    if done >= epochs or early:
        return ""
    return (f" (it had stopped after epoch {done} of {epochs}: to continue it instead, move its files back and "
            f"give resume=True)")


def set_aside_other_runs_files(ckpt_dir, state):
    """Where the folder's best.pt is not of the run last.pt continues (its history is not the start of
    last.pt's: a last.pt copied in from another run), that run's files but last.pt move to previous/<time>/,
    as a new run's would, and the note says so: the resume kept the other run's best.pt as its own (the
    summary named a best IoU that file did not hold) and wrote over its history.csv. None otherwise."""
    best = Path(ckpt_dir) / "best.pt"
    if not best.is_file():
        return None
    try:
        kept = torch.load(best, map_location="cpu", weights_only=True, mmap=True)["history"]
    except Exception:  # noqa: BLE001 - unreadable: predict and export say what it is, as before
        return None
    n = min(len(kept), len(state["history"]))  # best.pt is written before last.pt: it may be one epoch ahead
    if [repr(row) for row in kept[:n]] == [repr(row) for row in state["history"][:n]]:
        return None
    moved = archive_previous_run(ckpt_dir, [name for name in RUN_FILES if name != "last.pt"])
    return (f"{best} is not of the run its last.pt continues (their histories differ: a last.pt copied from "
            f"another run?): that run's files but last.pt moved to {moved}")


def set_aside_edited_history(ckpt_dir, state):
    """history.csv is written again from last.pt's history after each epoch: one changed since (a column of
    notes added, a value changed) moves to previous/<time>/ first, and the note says so; before, the edits were
    written over without a word. Epochs behind or ahead of last.pt (stopped between the two writes, last.pt
    restored from an older copy), the same otherwise, are the run's own: its epochs are trained again."""
    path = Path(ckpt_dir) / "history.csv"
    if not path.is_file():
        return None
    with open(path, newline="", errors="replace") as f:
        lines = f.read().splitlines()
    own = history_text(state["history"]).splitlines()
    if (lines and own[:len(lines)] == lines) or (lines[:len(own)] == own and
                                                 later_epochs(lines[len(own):], own[0], state["epoch"])):
        return None
    moved = archive_previous_run(ckpt_dir, ["history.csv"])
    write_history(path, state["history"])  # now: a resume stopped before its first epoch leaves one too
    return (f"{path} differs from the history last.pt holds (edited, or written by another version): it moved "
            f"to {moved}, and history.csv is written again from last.pt's")


def later_epochs(lines, header, epoch):
    """Whether history.csv's lines past last.pt's history (up to `epoch`, under `header`) are rows of the
    epochs after it (last.pt restored from an older copy), not a line the user added (a summary)."""
    width = len(header.split(","))
    return all(len(row) == width and row[0] == str(epoch + 1 + i) for i, row in enumerate(csv.reader(lines)))


def other_clipping(state, cfg):
    """What the resume note adds where grad_clip_norm changed (to tame a run that diverged, say): allowed, but
    the steps from here are not those of the run as it began."""
    was = state["config"].get("grad_clip_norm", CONFIG["grad_clip_norm"])
    return "" if was == cfg["grad_clip_norm"] else \
        f"; grad_clip_norm changed from {was} to {cfg['grad_clip_norm']}: the steps from here differ from the run's"


def patience_words(state, cfg):
    """What the resume note adds of early stopping: the run's patience, kept (kept_patience) where it is not
    CONFIG's, or the one given now where it differs (the run stops, or goes on, where it would not have)."""
    was, now = state["config"].get("early_stopping_patience", CONFIG["early_stopping_patience"]), \
        cfg["early_stopping_patience"]
    if was != now:
        return f"; early_stopping_patience changed from {was} to {now}"
    return f"; early_stopping_patience={now} as it trained" if now != CONFIG["early_stopping_patience"] else ""


def other_modes(state, cfg, prec):
    """What the resume note adds where the precision, layout, torch.compile or preset is not last.pt's:
    allowed (a run may move to a faster or a safer mode), but the steps from here differ from the run's."""
    was, said = state["config"], []
    if state["precision"] != prec.name:
        said.append(f"it trained in {state['precision']}, this run in {prec.name}")
    if isinstance(was.get("channels_last"), bool) and was["channels_last"] != cfg["channels_last"]:
        said.append(f"it trained {'NHWC' if was['channels_last'] else 'NCHW'}, this run "
                    f"{'NHWC' if cfg['channels_last'] else 'NCHW'} (channels_last={cfg['channels_last']})")
    differ = [f"{k}={cfg[k]}" for k, v in PRESETS.get(was.get("preset"), {}).items() if cfg.get(k) != v]
    preset_said = was.get("preset") and was["preset"] != cfg.get("preset") and differ  # none: all kept, unsaid
    if isinstance(was.get("compile_model"), bool) and was["compile_model"] != cfg["compile_model"] and not (
            preset_said and f"compile_model={cfg['compile_model']}" in differ):  # said with the preset's keys
        said.append(f"it trained {'' if was['compile_model'] else 'un'}compiled, this run "
                    f"{'' if cfg['compile_model'] else 'un'}compiled (compile_model={cfg['compile_model']})")
    if preset_said:
        said.append(f"it ran with preset={was['preset']}, this run with {cfg.get('preset') or 'none'} ("
                    f"{', '.join(differ)}): give preset={was['preset']} to keep that preset's settings")
    return "".join(f"; {text}" for text in said)


def other_world_size(state, cfg, samples):
    """What the resume note adds where the run trained on another number of processes: the data order
    changes, and the effective batch where the processes' batches differ (the LR curve does not:
    resumed_schedule). `samples`: training samples per epoch, the run's (same_split_as_resumed)."""
    was = state.get("world_size", DIST.world)
    if was == DIST.world:
        return ""
    before, now = effective_batch(cfg, samples, was), effective_batch(cfg, samples, DIST.world)
    batch = f"the effective batch is {now} instead of {before}, and" if now != before else \
        f"the effective batch is the same ({now}), but"
    return f", trained on {was} process(es), now {DIST.world}: {batch} the data order changes; the LR curve does not"


def effective_batch(cfg, samples, world):
    """Images per optimizer step, all processes together: batch_size x accumulation_steps x world, where an
    epoch has fewer batches than accumulation_steps, x those (each process takes samples // world of the
    epoch's samples, in whole batches: build_loaders)."""
    batches = samples // world // cfg["batch_size"]
    return cfg["batch_size"] * max(1, min(cfg["accumulation_steps"], batches)) * world


def resumed_schedule(state, cfg, steps_per_epoch, notes):
    """The checkpoint's LR schedule; with a changed epochs, extended (extend_schedule)."""
    old_epochs, done, epochs = state["config"]["epochs"], state["epoch"], cfg["epochs"]
    schedule = checkpoint_schedule(state, cfg)
    if old_epochs == epochs:
        return schedule
    schedule = extend_schedule(schedule, done, epochs)
    lr, change = cfg["learning_rate"], f"epochs changed from {old_epochs} to {epochs}"
    if in_warmup(done, schedule):  # extended without a tail: the warm-up goes on
        notes.append(f"{change}: the warm-up goes on to {lr:.2e} at epoch {schedule['warmup']:.3g}, then a "
                     f"cosine down to {lr * LR_FLOOR:.2e} at epoch {epochs}")
    elif epochs > done and lr_factor(done, schedule) <= AT_LR_FLOOR * LR_FLOOR:  # no restart: it stays down there
        notes.append(f"{change}: the run had ended its schedule, so the learning rate stays at its floor, "
                     f"{lr * lr_factor(done, schedule):.2e} ({LR_FLOOR:.0%} of learning_rate), for the {epochs - done} "
                     f"added epoch{'s' * (epochs - done != 1)} (no restart): they change the weights little, though "
                     f"BatchNorm's running statistics, which follow no learning rate, are estimated again (on a "
                     f"short run that alone can move val IoU); to train longer at a higher rate, start a new run "
                     f"with epochs={epochs} in another checkpoint_dir")
    else:
        notes.append(f"{change}: the learning rate continues from {lr * lr_factor(done, schedule):.2e} (no "
                     f"restart), cosine down to {lr * LR_FLOOR:.2e} over the remaining {epochs - done} "
                     f"epochs ({(epochs - done) * steps_per_epoch} optimizer steps)")
    return schedule


# An extended run whose LR is within this factor of the floor (LR_FLOOR) gets resumed_schedule's note that
# its added epochs barely train: a finished run's is at the floor itself.
AT_LR_FLOOR = 2


def prepare_model(cfg, hw):
    model = build_model(cfg).to(hw.device)
    if cfg["channels_last"]:
        model = model.to(memory_format=torch.channels_last)
    return model


@dataclass
class Run:
    """Everything that changes while training; saved in checkpoints, restored on resume/rollback."""
    model: nn.Module
    run_model: nn.Module          # what trains: `model`, compiled and/or wrapped in DDP
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    scaler: torch.amp.GradScaler | None
    prec: Precision
    history: list = field(default_factory=list)
    fallbacks: list = field(default_factory=list)  # precision fallback events, kept so a resume stays safe
    best_iou: float = -1.0
    since_best: int = 0
    epoch: int = 0                # last finished epoch
    bad_streak: int = 0           # consecutive bad optimizer steps, across epoch boundaries
    eval_model: nn.Module | None = None  # `model`, compiled if asked, never DDP-wrapped
    lr_schedule: dict | None = None      # the LR schedule's shape (extend_schedule), kept for resume
    logger: RunLogger = field(default_factory=lambda: RunLogger())  # TensorBoard (rank 0), or a no-op
    class_names: list | None = None      # for the per-class history columns
    confusion: list | None = None        # the last validation's confusion matrix (counts, rows = true class)
    loss_fn: nn.Module | None = None     # SegLoss
    ema: WeightEMA = field(default_factory=lambda: WeightEMA())  # ema_decay (III.7); off: does nothing
    data_split: dict | None = None       # which files trained and validated (split_record), kept for resume
    device_kind: str | None = None       # "cpu", "cuda", "mps": a run resumed on a CPU keeps a CPU run's modes
    auto_keys: tuple = ()                # AUTO_KEYS given as "auto" (auto_keys_given): a refused resume says so

    def __post_init__(self):
        self.eval_model = self.model if self.eval_model is None else self.eval_model

    def state(self, cfg):
        return {"model": unwrap(self.model).state_dict(), "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict() if self.scaler else None, "epoch": self.epoch,
                "best_iou": self.best_iou, "epochs_since_best": self.since_best, "rng": rng_state(),
                "config": cfg, "history": self.history, "precision": self.prec.name,
                "fallbacks": self.fallbacks, "lr_schedule": self.lr_schedule, "ema": self.ema.state(),
                "data_split": self.data_split, "device_kind": self.device_kind, "world_size": DIST.world,
                "class_names": self.class_names, "auto_keys": list(self.auto_keys),
                "tensorboard_epochs": self.logger.held_epochs(self.epoch), "loss_rules": LOSS_RULES}

    def load(self, state):
        self.model.load_state_dict(state["model"])
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self.epoch, self.best_iou, self.since_best = state["epoch"], state["best_iou"], state["epochs_since_best"]
        self.history, self.fallbacks = list(state["history"]), list(state.get("fallbacks", []))
        self.ema.load(state.get("ema"), self.model)


# What only a resume needs, which last.pt keeps and best.pt leaves out: AdamW's two moments per weight made
# best.pt three times the model's size (172 MB for resnet18's U-Net), written again at every better epoch.
RESUME_ONLY = ("optimizer", "scaler", "rng")


def checkpoint_sizes(run):
    """(best.pt, last.pt) in bytes, about: the weights and their EMA copy; last.pt adds AdamW's two moments
    per trainable parameter (pickling adds a few KB)."""
    weights = sum(t.nbytes for t in run.model.state_dict().values())
    best = weights + (sum(t.nbytes for t in run.ema.model.state_dict().values()) if run.ema.model else 0)
    return best, best + 2 * sum(p.nbytes for p in run.model.parameters() if p.requires_grad)


def check_checkpoint_room(run, cfg, replaced):
    """A disk too small for the run's checkpoints, found before it trains (and, for a new run, before the
    earlier run's files move aside): its first epoch's best.pt and last.pt that cannot fit are refused (the run
    trained a whole epoch, then stopped at the write); a note where a later last.pt, written beside the one it
    replaces, would not. A resumed run's own files count as room (`replaced`); an earlier run's, which move to
    previous/ on the same disk, do not."""
    folder = Path(cfg["checkpoint_dir"])
    best, last = checkpoint_sizes(run)
    held = sum(p.stat().st_size for p in (folder / "best.pt", folder / "last.pt") if p.is_file()) if replaced else 0
    free = shutil.disk_usage(folder).free + held
    sizes = f"best.pt about {size_text(best)}, last.pt about {size_text(last)}"
    limit = file_size_limit()
    if limit is not None and max(best, last) + ZIP_SLACK >= limit:  # it failed after a whole epoch, as a full disk
        raise UserError(f"the run's checkpoints ({sizes}) are larger than the file-size limit here ({size_text(limit)}"
                        f", ulimit -f): raise it (ulimit -f unlimited) or run where none is set")
    if free < best + last:
        raise UserError(f"checkpoint_dir={folder} has {size_text(free)} free, too little for the run's checkpoints "
                        f"({sizes}): free disk space there or choose another checkpoint_dir")
    if free < best + 2 * last:
        return (f"checkpoint_dir={folder} has {size_text(free)} free: room for {sizes}, but not for a new last.pt "
                f"written beside the one it replaces; a later epoch's write may stop the run (free disk space)")
    return None


def best_checkpoint(state):
    """best.pt: the run's state but what only a resume needs (predict, export and the notebooks read the
    model, its EMA, config and history)."""
    return {key: value for key, value in state.items() if key not in RESUME_ONLY}


def announce_run(cfg, hw, run, sizes, extra):
    """Print the config and the data/distributed summary; rank 0 writes config.json."""
    n_train, n_val, n_batches, steps_per_epoch, samples = sizes  # samples: images (fit) or patches an epoch
    print("config:\n" + format_config(cfg))
    trained = n_batches * cfg["batch_size"] * DIST.world  # samples an epoch trains, all processes together
    # drop_last (build_loaders): a partial last batch is not trained; which samples miss out changes per epoch
    left = samples - trained
    print(f"data: {n_train} train / {n_val} val images from {cfg['data_dir']}; "
          f"{n_batches} batch{'es' * (n_batches != 1)} of {cfg['batch_size']}, {steps_per_epoch} optimizer "
          f"step{'s' * (steps_per_epoch != 1)}/epoch"
          + (f"; {left} random training image(s) left out each epoch (full batches only"
             + (", an equal share per process)" if DIST.world > 1 else ")")
             if left and cfg["data_mode"] == "fit" else "")
          + short_accumulation(n_batches, cfg["accumulation_steps"]))
    if cfg["data_mode"] == "patch":
        print(patch_summary(cfg, trained, left))
    if DIST.enabled:
        print(f"distributed: {DIST.world} processes ({'nccl' if hw.kind == 'cuda' else 'gloo'}); effective "
              f"batch {cfg['batch_size']} x {min(cfg['accumulation_steps'], n_batches)} x {DIST.world}")
    if DIST.is_main:
        write_json(Path(cfg["checkpoint_dir"]) / "config.json",
                   {"config": cfg, "precision": run.prec.name, "fp32_math": fp32_math(hw),
                    "device": describe(hw), "world_size": DIST.world, **extra})


def short_accumulation(n_batches, k):
    """What the data line says where an epoch's batches do not fill its accumulation groups: the last
    optimizer step (every step, where the epoch has fewer batches than k) averages fewer batches."""
    if k == 1 or n_batches % k == 0:
        return ""
    if n_batches < k:
        return (f"; accumulation_steps={k} is more than the epoch's {n_batches} batches: each epoch takes one "
                f"optimizer step over {n_batches}")
    return f"; each epoch's last optimizer step averages {n_batches % k} batch(es), not {k}"


def stop_early(run, epoch, cfg):
    """early_stopping_patience epochs without a better val IoU (never after the last epoch)."""
    patience = cfg["early_stopping_patience"]
    if patience is None or run.since_best < patience or epoch >= cfg["epochs"]:
        return False
    print(f"early stopping: val IoU has not improved for {run.since_best} epoch{'s' * (run.since_best != 1)} "
          f"(best {run.best_iou:.4f}; early_stopping_patience={patience})")
    return True


def finish_run(run, hw, cfg):
    run.logger.close()
    ckpt_dir = Path(cfg["checkpoint_dir"])
    files = [name for name in ("best.pt", "last.pt", "history.csv") if (ckpt_dir / name).is_file()]
    finite = run.best_iou >= 0  # else every validation was non-finite (nan_guard=False): none became best
    best = f"best val IoU {run.best_iou:.4f}" if finite else "no epoch validated finite"
    big = diverged_rows(run.history, cfg)  # noted once, at the first such epoch: the end of the run said nothing
    diverged = (f" (the model diverged from epoch {big[0]['epoch']}, val loss {big[0]['val_loss']:.3g}: try a "
                f"learning_rate 10 times lower)") if big else ""
    print(f"done: {best}{diverged}; checkpoints in {ckpt_dir}/ ({', '.join(files)})")
    if DIST.is_main and "best.pt" not in files:  # a last.pt copied alone, resumed: its best epoch's weights are elsewhere
        print(f"note: no best.pt in {ckpt_dir}: " + (
            f"no epoch of this run beat the val IoU its last.pt records ({run.best_iou:.4f}); use last.pt, or the "
            f"best.pt of the run it came from" if finite else "every epoch's val loss was NaN/inf, so none is a "
            "best.pt; last.pt holds the last epoch's (non-finite) model: train again with nan_guard=True"))
    table = end_of_run_table(run)
    if table:
        print(table)
    return {"history": run.history, "best_iou": run.best_iou, "checkpoint_dir": str(ckpt_dir),
            "precision": run.prec.name, "fallbacks": run.fallbacks, "device": describe(hw)}


def end_of_run_table(run):
    """Multi-class runs: IoU/Dice per class at the best epoch, best.pt's (mIoU, the headline, is its mean)."""
    best = best_epoch_row(run.history)
    absent = {i for i, row in enumerate(run.confusion or ()) if not sum(row)}  # true classes: every epoch's
    table = best and per_class_table(best, run.class_names or [], absent)
    return f"val per class at the best epoch ({best['epoch']}):\n{table}" if table else ""


# ----------------------------------------------------------------------------------------------------
# II.3 One epoch: train, validate, checkpoint, report.
# ----------------------------------------------------------------------------------------------------
def run_epoch(run, epoch, train_loader, val_loader, hw, cfg):
    """Train and validate one epoch; returns its history row."""
    if hw.kind == "cuda":
        torch.cuda.reset_peak_memory_stats(hw.device)
    start_epoch_data(train_loader, epoch, cfg["seed"])
    anomaly = torch.autograd.set_detect_anomaly(True) if cfg["detect_anomaly"] else contextlib.nullcontext()
    with anomaly:  # switched off again after the epoch
        trained = train_one_epoch(run, train_loader, cfg, hw, desc=f"epoch {epoch}/{cfg['epochs']} train")
    run.bad_streak = trained["stats"].bad_streak
    val_start = time.perf_counter()
    broadcast_buffers(run.model)  # BatchNorm statistics: rank 0's, the ones its checkpoint holds
    model = run.ema.evaluated(run.eval_model)  # the EMA weights when ema_decay is set
    validated = evaluate(model, val_loader, run.loss_fn, run.prec, hw, cfg, desc=f"epoch {epoch} val")
    run.confusion = validated["confusion"]
    return history_row(run, epoch, trained, validated, time.perf_counter() - val_start, hw)


def finish_epoch(run, row, cfg):
    """Record the epoch, write last.pt (and best.pt when it improved) and the history CSV."""
    ckpt_dir = Path(cfg["checkpoint_dir"])
    refuse_nonfinite_validation(run, row, cfg)
    run.history.append(row)
    run.epoch = row["epoch"]
    improved = may_be_best(row) and row["val_iou"] > run.best_iou  # best_epoch_row finds it again in the history
    run.best_iou, run.since_best = (row["val_iou"], 0) if improved else (run.best_iou, run.since_best + 1)
    with interrupts_held():  # the epoch's files all or none: last.pt alone would lose a best.pt for good
        if DIST.is_main:  # one writer; the other ranks hold the same weights
            state = run.state(cfg)
            if improved:  # before last.pt: a write that fails (a full disk) leaves last.pt at the epoch before,
                # which resume trains again; after it, last.pt would count a best.pt that was never written
                save_checkpoint(ckpt_dir / "best.pt", best_checkpoint(state))
                save_confusion(ckpt_dir, run.confusion, run.class_names or [])
            save_checkpoint(ckpt_dir / "last.pt", state)
            write_history(ckpt_dir / "history.csv", run.history)
        # in the hold too, and before the prints (a closed stdout stops a library run there): TensorBoard has
        # every epoch history.csv has
        run.logger.log_epoch(row)
        run.logger.log_confusion(run.confusion, run.class_names or [], row["epoch"])
        print(epoch_summary(row, cfg, improved))
        diverged = diverged_note(run.history, cfg)
        if diverged:
            print(diverged)


# A val loss past this (times the largest class weight, which scales the loss) is a model blown up: the losses
# here start near 1 (Dice at most 1, cross-entropy about ln(classes)). learning_rate=10 ran at 1e29 to 1e10, its
# IoU the same every epoch, with no word, while 1e6 went non-finite and was stopped (refuse_nonfinite_validation).
DIVERGED_VAL_LOSS = 1e4


def diverged_rows(history, cfg):
    """The epochs whose val loss is finite but past DIVERGED_VAL_LOSS (times the largest class weight)."""
    limit = DIVERGED_VAL_LOSS * max([1.0, *[float(w) for w in (cfg.get("class_weights") or [])
                                           if isinstance(w, (int, float))]])
    return [row for row in history if math.isfinite(row["val_loss"]) and row["val_loss"] > limit]


def diverged_note(history, cfg):
    """The note for the first epoch whose val loss is finite but past DIVERGED_VAL_LOSS, else None."""
    big = diverged_rows(history, cfg)
    if len(big) != 1 or big[0] is not history[-1]:
        return None
    return (f"note: val loss {big[0]['val_loss']:.3g} in epoch {big[0]['epoch']}: the model has diverged (the loss "
            f"starts near 1); likely learning_rate={cfg['learning_rate']} too high (grad_clip_norm="
            f"{cfg['grad_clip_norm']}): try one 10 times lower")


def refuse_nonfinite_validation(run, row, cfg):
    """A non-finite val loss with the guard on stops the run before the epoch is recorded: the model as
    predict would use it gives NaN/inf (its IoU is meaningless, and it would have become best.pt). The
    training steps can stay finite meanwhile: BatchNorm's running statistics, used only in eval mode, or
    weights grown too large overflow first. last.pt and best.pt of the last good epoch stay."""
    if math.isfinite(row["val_loss"]) or not cfg["nan_guard"]:
        return
    model = unwrap(run.ema.evaluated(run.eval_model))
    bad = next((n for n, t in [*model.named_parameters(), *model.named_buffers()]
                if t.is_floating_point() and not torch.isfinite(t).all()), None)
    weights = overflowing_weights(run.loss_fn, cfg["batch_size"] * cfg["image_size"] ** 2)
    where = ("the model in eval mode gives NaN/inf, " + (f"{bad} is non-finite" if bad else "its outputs overflow "
             "while its weights and statistics are finite (they grew too large)")) if bad or not weights else weights
    kept = (f"{Path(cfg['checkpoint_dir']) / 'last.pt'} (epoch {run.epoch}) is intact" if run.epoch else
            "no checkpoint was written")
    causes = "" if weights and not bad else \
        f"; likely learning_rate={cfg['learning_rate']} too high (grad_clip_norm={cfg['grad_clip_norm']})"
    raise UserError(f"validation went non-finite in epoch {row['epoch']} (val loss {row['val_loss']}, train loss "
                    f"{row['train_loss']:.3g}): {where}{causes}; {kept}")


def epoch_summary(row, cfg, improved):
    skipped = f" | skipped {row['skipped_steps']}" if row["skipped_steps"] else ""
    scale = f" | scale {row['scaler_scale']:.0f}" if row["scaler_scale"] else ""
    return (f"epoch {row['epoch']:>3}/{cfg['epochs']} | train loss {row['train_loss']:.4f} "
            f"IoU {row['train_iou']:.4f} | val loss {row['val_loss']:.4f} IoU {row['val_iou']:.4f} "
            f"Dice {row['val_dice']:.4f} | lr {row['lr']:.2e} | {row['epoch_time_s']:.1f}s "
            f"{row['images_per_s']:.1f} img/s | peak {row['peak_mem_mb']:.0f} MB | {row['precision']}"
            f" | grad {row['grad_norm']:.2f}{scale}{skipped}{' | best' if improved else ''}")


# ----------------------------------------------------------------------------------------------------
# II.4 The training step: one optimizer step per accumulation group, its micro-steps, the update.
# ----------------------------------------------------------------------------------------------------
def train_one_epoch(run, loader, cfg, hw, desc="train"):
    """One pass over `loader`, one optimizer step per accumulation group. run.bad_streak carries
    consecutive bad steps over from the last epoch. Returns the epoch's loss, IoU, Dice, speed and stats."""
    model = run.run_model
    model.train()
    tally, progress = EpochTally(cfg["num_classes"], hw.device), Progress(loader, desc, cfg)
    guard = StepGuard(model, cfg, hw.device, run.bad_streak)  # numerical safety (III.9)
    run.optimizer.zero_grad(set_to_none=True)
    for group, group_valid in accumulation_groups(progress, cfg["accumulation_steps"], hw.device):
        guard.start_group()  # BatchNorm statistics before this group's forward passes
        for i, (x, y) in enumerate(group):
            x, y = to_device(x, y, hw, cfg["channels_last"])
            with ddp_sync(model, i == len(group) - 1):  # DDP all-reduces gradients on the last micro-step
                logits, loss = forward_backward(run, x, y, hw, len(group), group_valid)
            finite = tally.add(loss, logits, y)  # a device bool: no sync per micro-step
            group_ok = finite if i == 0 else group_ok & finite
            progress.refresh(tally.loss_pair, tally.metric, tally.images)  # at most every PROGRESS_REFRESH_S
        # ---- the update: one per group; with nan_guard, the one host sync per optimizer step ----
        step = optimizer_step(run, cfg, agree(group_ok), guard.count_zeros_now())
        run.ema.update(step.applied)  # weight EMA (III.7); off: no op
        run.logger.log_step(run.scheduler, tally.loss_sum, tally.finite_losses, step.norm, run.scaler)
        run.scheduler.step()
        guard.after_step(step, run.scheduler.last_epoch, (x, y))  # nan_patience bad steps: NonFiniteStreak
    progress.close()
    trained = tally.result(guard.health, hw)
    warn_fp16_underflow(run, trained["stats"], guard.last_batch)  # fp16 only: zeros beyond fp32's (III.9)
    return trained


def accumulation_groups(batches, k, device):
    """(micro-batches, group_valid) for each group of k micro-batches (the last may be shorter).

    group_valid: the real (not padding, not void) pixels of the whole group, over all ranks and
    divided by the rank count (DDP averages gradients), so CE summed per micro-batch / group_valid
    is exactly one big batch's CE mean. Counted on the loader's CPU masks: no device sync. With one
    micro-batch per step in one process the group is the micro-batch (None: its own loss, as is).
    """
    batches = iter(batches)
    while group := list(itertools.islice(batches, k)):
        if k == 1 and not DIST.enabled:
            yield group, None
            continue
        count = sum(valid_pixels(y) for _, y in group).to(device, non_blocking=True)
        yield group, all_reduce_(count).float().clamp(min=1) / DIST.world


def to_device(x, y, hw, channels_last):
    x = x.to(hw.device, non_blocking=True)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y.to(hw.device, non_blocking=True)


def forward_backward(run, x, y, hw, group_len, group_valid=None):
    """Forward under autocast, fp32 loss outside it, backward (scaled for fp16) of the group's share:
    per-pixel terms (CE, focal) summed here / the group's real pixels (`group_valid`,
    accumulation_groups), region terms (Dice, Tversky, Lovasz) / group size; group_valid=None: the
    group is this one micro-batch, whose share is its own loss. Returns (logits, this micro-batch's own loss)."""
    with torch.autocast(hw.kind, dtype=run.prec.dtype, enabled=run.prec.amp):
        logits = run.run_model(x)
    pixel_sum, region = run.loss_fn.parts(logits, y)
    loss = pixel_sum / valid_pixels(y).clamp(min=1) + region
    share = loss if group_valid is None else pixel_sum / group_valid + region / group_len
    (run.scaler.scale(share) if run.scaler is not None else share).backward()
    return logits, loss


def optimizer_step(run, cfg, loss_ok, count_zeros=False):
    """Unscale once, measure (and clip) the gradient norm, then step where the guard lets it
    (step_if_finite). `loss_ok`: a device bool, every loss of this accumulation group was finite."""
    optimizer, scaler = run.optimizer, run.scaler
    if scaler is not None:
        scaler.unscale_(optimizer)
    params = [p for p in run.run_model.parameters() if p.grad is not None]
    grads = [p.grad for p in params]
    if cfg["grad_clip_norm"] is not None:
        norm = torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip_norm"])
    else:
        norm = torch.nn.utils.get_total_norm(grads)
    zeros = count_zero_grads(grads) if count_zeros else None
    result = StepResult(norm.detach(), True, zeros=zeros, elems=sum(g.numel() for g in grads) if count_zeros else 0)
    step_if_finite(optimizer, scaler, cfg, loss_ok, result)
    optimizer.zero_grad(set_to_none=True)
    return result


# ----------------------------------------------------------------------------------------------------
# II.5 Evaluate: loss and IoU/Dice at each image's original size, on the logits predict would use.
# ----------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, loader, loss_fn, prec, hw, cfg, desc="val"):
    """Loss and dataset-level IoU/Dice; in fp32 unless eval_amp=True. IoU/Dice are counted at each
    image's original size against its original mask, on the logits predict would turn into its mask
    (fit: fit_pieces; patch: whole images by the sliding window, window_pieces)."""
    model.eval()
    prec = prec if prec.amp and cfg["eval_amp"] else Precision.of(torch.float32, "validation in fp32")
    scored_pieces = window_pieces if cfg["data_mode"] == "patch" else fit_pieces
    metric = SegMetric(cfg["num_classes"], hw.device)
    totals = torch.zeros(2, device=hw.device, dtype=sum_dtype(hw.device))  # loss * images, images
    progress, seen = Progress(loader, desc, cfg), 0
    for batch in progress:
        for logits, y, images, scored in scored_pieces(model, batch, cfg, prec, hw):
            totals[0] += loss_fn(logits, y).detach().to(hw.device) * images
            totals[1] += images
            for score_logits, target in scored:
                metric.update(score_logits, target)
            seen += images
        progress.refresh(lambda: totals, metric, seen)
    progress.close()
    loss_sum, count = all_reduce_(totals).tolist()
    scores = metric.all_reduce().compute()
    return {"loss": loss_sum / max(1, count), **scores, "confusion": metric.confusion()}


def fit_pieces(model, batch, cfg, prec, hw):
    """A batch from ValidationImages: one piece (logits, resized targets, number of images, scored).
    The val loss is taken on the resized images, as the model sees them; `scored` gives the metric each
    image's logits at its original size (original_size_scores: what predict makes its mask from)
    against its original mask, read here, in this process, while a GPU computes the logits. A batch
    (x, y) with no mask paths is of images already image_size square: y is then the original masks too."""
    x, y, *paths = batch
    reads = [mask_readers().submit(read_classes, path, cfg) for path in paths[0]] if paths else None
    logits, y = eval_forward(model, x, cfg, prec, hw), y.to(hw.device, non_blocking=True)
    masks = [torch.from_numpy(read.result()) for read in reads] if paths else y
    yield logits, y, x.shape[0], original_size_scores(logits, masks, cfg, hw)


@functools.lru_cache(maxsize=None)
def mask_readers():
    """Threads that decode fit validation's original masks while the model runs (OpenCV and Pillow
    release the GIL): a 12 MP mask takes ~50 ms to decode, a batch of them would otherwise wait in turn."""
    return ThreadPoolExecutor(max_workers=4, thread_name_prefix="unet-amp-masks")


def original_size_scores(logits, masks, cfg, hw):
    """(N x classes x rows x w logits, N x rows x w masks) for the metric, at the images' original sizes
    (original_size, as predict's fit_masks): the images of one size together, a few ops a batch instead
    of nine an image, on a GPU each a kernel launch; an image over SCORE_BAND_PIXELS alone, in bands of rows."""
    logits = logits.float()
    for (h, w), indices in same_size_groups([tuple(m.shape) for m in masks]):
        full = original_size(rows_of(logits, indices), h, w, cfg)
        target = rows_of(masks, indices) if torch.is_tensor(masks) else stacked_masks([masks[i] for i in indices], hw)
        target = target.to(hw.device, non_blocking=True)
        for band in score_bands(h, w) if len(indices) == 1 else [slice(None)]:
            yield full[:, :, band], target[:, band]


def stacked_masks(masks, hw):
    """Masks read from their files (one size), stacked in host memory that is page-locked for CUDA: the copy
    to the GPU then waits for nothing (from pageable memory it waits for the stream's queued kernels)."""
    if hw.kind != "cuda":
        return torch.stack(masks)
    return torch.stack(masks, out=page_locked((len(masks), *masks[0].shape), masks[0].dtype))


SCORE_BAND_PIXELS = 1 << 24  # validation scores large images in bands of rows of this size


def score_bands(height, width):
    """Row slices of at most SCORE_BAND_PIXELS pixels: scoring's int64 temporaries stay a band's size."""
    rows = max(1, SCORE_BAND_PIXELS // width)
    return [slice(top, min(top + rows, height)) for top in range(0, height, rows)]


def window_pieces(model, batch, cfg, prec, hw):
    """One whole image (an unbatched loader item) through the sliding window, scored in bands of rows:
    (1 x classes x rows x W logits, 1 x rows x W mask, share of the image). The counts add up exactly;
    the loss of an image over SCORE_BAND_PIXELS is the row-weighted mean of its bands' losses. All on
    the CPU: a full-size image never goes to the device, and the scoring's int64 temporaries stay the
    size of a band."""
    image, mask = batch
    logits, (h, w) = predict_logits(model, image.numpy(), cfg, prec, hw), mask.shape
    for band in score_bands(h, w):
        pair = logits[None, :, band], mask[None, band].long()
        yield *pair, (band.stop - band.start) / h, [pair]


# ====================================================================================================
# III. Machinery, one section per concern, in the order part II calls it
# ====================================================================================================


# ----------------------------------------------------------------------------------------------------
# III.1 Command line and config: key=value overrides parsed to each key's type, validated; presets.
# Presets: "explicit" keys (given on the command line, or passed to train() with a value that differs from
# CONFIG) keep their value; the preset sets the others.
# ----------------------------------------------------------------------------------------------------
# Mask value of pixels that are not part of the image (padding, areas rotated in by augmentation):
# ignored by the loss and the metrics, so IoU is measured on real pixels only.
IGNORE_INDEX = 255
MODEL_STRIDE = 32  # the U-Net halves the image 5 times: sides must be multiples of this


def one_value_per_channel(batch_size, image_size):
    """Whether a batch leaves BatchNorm one value per channel at the U-Net's bottleneck (training raises)."""
    return batch_size * (image_size // MODEL_STRIDE) ** 2 <= 1


class UserError(Exception):
    """A problem the user can fix (bad config, bad data). Printed as one line, no traceback."""

    def _render_traceback_(self):
        """What IPython, and so Jupyter, shows in place of the traceback (12 to 49 lines around the message):
        the one line the command line prints."""
        return [f"UserError: {user_message(self)}"]


def user_message(exc):
    """A UserError's message. One raised in a DataLoader worker (a file that broke after the data check,
    a full disk) comes back re-raised with the worker's traceback as its text: its last line is the
    original "...UserError: message"."""
    text = str(exc)
    if "Original Traceback" not in text:
        return text
    lines = text.rstrip("\n").splitlines()
    last = max((i for i, line in enumerate(lines) if re.match(r"[\w.]*UserError: ", line)), default=None)
    return text if last is None else "\n".join(lines[last:]).split("UserError: ", 1)[1]


def first_line(exc, limit=160):
    """An exception's first line for a one-line message; a longer one is cut at a word, marked '...'."""
    line = (str(exc).splitlines() or [""])[0]
    return line if len(line) <= limit else line[:limit - 3].rsplit(" ", 1)[0].rstrip(" ,;:(") + "..."


STOP_SIGNAL = []  # "SIGTERM" or "SIGHUP" once sigterm_as_exit's handler has run: the stop is then not a Ctrl-C

# Signals that stop a command as Ctrl-C does (sigterm_as_exit): SIGHUP where the system has it (a closed
# terminal, a dropped ssh session), unless ignored (nohup), which keeps it ignored
STOP_SIGNALS = (signal.SIGTERM, *([signal.SIGHUP] if hasattr(signal, "SIGHUP") else []))


def stop_word():
    """How a stop is named: a Ctrl-C interrupts; a SIGTERM is a stop from outside (a scheduler, `kill`), and
    under torchrun most often torchrun stopping the others after one process ended (its report says which);
    a SIGHUP, the terminal that closed."""
    if not STOP_SIGNAL:
        return "interrupted"
    if STOP_SIGNAL[0] == "SIGHUP":
        return "stopped by SIGHUP (its terminal closed: nohup, tmux or screen keep a run going)"
    return "stopped by SIGTERM" + (" (under torchrun: another process ended, or the job was stopped)"
                                   if "LOCAL_RANK" in os.environ else "")


@contextlib.contextmanager
def sigterm_as_exit():
    """SIGTERM (torchrun stopping the other ranks, a cluster pre-empting the job) and SIGHUP (a closed
    terminal: it ended the process at once, its epoch lost) end the run like Ctrl-C: Python's exit handlers
    then remove the temporary image caches (DecodedImages), which a plain SIGTERM would leave behind.
    Checkpoints are written atomically either way."""
    if threading.current_thread() is not threading.main_thread():  # signals reach only the main thread
        yield
        return

    def stop(signum, frame):
        STOP_SIGNAL.append(signal.Signals(signum).name)
        raise KeyboardInterrupt
    STOP_SIGNAL.clear()  # a notebook's earlier command's stop is not this one's
    previous = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS if signal.getsignal(sig) is not signal.SIG_IGN}
    for sig in previous:
        signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


# glibc's malloc gives large freed blocks back to the kernel (its heap trim, and blocks above its moving
# mmap threshold), so on a CPU every forward faulted its activations in again: up to 1.6 million minor
# faults and 2.8 s of kernel time in a 6 s fp32 sliding window (BENCHMARKS.md "Memory kept for reuse").
MMAP_THRESHOLD_BYTES = 32 * 2**20  # blocks up to this come from the heap: glibc's largest allowed value
TRIM_THRESHOLD_BYTES = 2**31 - 1   # free memory at the heap's top kept up to this (mallopt takes an int)
MALLOC_TUNING_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "GLIBC_TUNABLES")


def printable_file_names():
    """Let the commands' messages print any file name: one whose bytes are not UTF-8 (Python keeps them as
    surrogates) stopped print with UnicodeEncodeError where stdout's encoding is strict (a UTF-8 locale
    such as en_US.UTF-8); such characters are now printed as escapes of the name's own bytes (caf\\xe9.png;
    backslashreplace had written Python's caf\\udce9.png, which names no byte), on both streams: in the C locale
    stdout wrote the raw bytes (surrogateescape) where stderr, the errors' stream, wrote escapes."""
    # The trade-off: escapes are one way to read on every terminal and log, but a script piping the output
    # no longer gets the name's bytes (os.listdir does).
    codecs.register_error(BYTE_ESCAPES, escaped_bytes)
    for stream in (sys.stdout, sys.stderr):
        if hasattr(stream, "reconfigure") and stream.errors in ("strict", "surrogateescape"):
            stream.reconfigure(errors=BYTE_ESCAPES)


BYTE_ESCAPES = "unet-amp-byte-escapes"  # printable_file_names' error handler, by its registered name


def escaped_bytes(exc):
    """An encoding error handler: a surrogate that stands for a byte no encoding decoded (U+DC80-U+DCFF, from
    surrogateescape) as that byte's \\xNN; any other character the stream cannot encode as its UTF-8 bytes, each
    \\xNN (a name's bytes on a UTF-8 file system: café.png on an ASCII stream is caf\\xc3\\xa9.png, not the
    caf\\xe9.png of a Latin-1 name)."""
    if not isinstance(exc, UnicodeEncodeError):
        raise exc
    data = b"".join(bytes([ord(c) - 0xDC00]) if 0xDC80 <= ord(c) <= 0xDCFF else c.encode("utf-8", "surrogatepass")
                    for c in exc.object[exc.start:exc.end])  # any other lone surrogate: its UTF-8 form
    return "".join(f"\\x{byte:02x}" for byte in data), exc.end


def system_limit_message(exc):
    """The one line for a full disk, the open-file or file-size limit met, or a path this user may not use, where
    no check before had a message of its own (num_workers=0 checks no limit: at ulimit -n 12 the image cache's
    np.load met it, in a traceback)."""
    if exc.errno in NO_PERMISSION:  # a folder of data this user may not list (data copied from another user)
        return (f"{exc.filename or 'a file or folder'}: permission denied for this user: let it be read (and, for "
                f"outputs, written: chmod, or run as its owner), or choose another path")
    if exc.errno == errno.EFBIG:
        return (f"cannot write {exc.filename or 'a file'}: {file_size_limit_words()}; files are written under "
                f"temporary names, so those written before are intact")
    if exc.errno == errno.ENFILE:
        return "too many open files on this machine, all processes together (ENFILE): close some, or retry later"
    if exc.errno == errno.EMFILE:
        limit = raise_open_files_limit()
        return (f"too many open files{f' (the limit here is {limit}, ulimit -n)' if limit else ''}: raise it "
                f"(ulimit -n 4096; in Docker --ulimit nofile=4096)")
    return (f"cannot write {exc.filename or 'a file'} ({exc.strerror}): {write_fix(exc)}; files are written under "
            f"temporary names, so those written before are intact")


ZIP_SLACK = 2**20  # a checkpoint's bytes past its tensors' (torch.save's zip records, the pickle): ~100 B a tensor


def file_size_limit():
    """The largest file this process may write (ulimit -f), in bytes; None where none is set. Past it a write
    fails with EFBIG, which reads as a full disk (torch's zip writer: 'unexpected pos')."""
    return soft_limit("RLIMIT_FSIZE")


def file_size_limit_words():
    limit = file_size_limit()
    return (f"larger than the file-size limit here (ulimit -f{f': {size_text(limit)}' if limit is not None else ''}"
            f"), not a full disk: raise it (ulimit -f unlimited) or run where none is set")


def guard_output_streams():
    """stdout and stderr each go on where their reader has ended (OutputReaderGone)."""
    for name in ("stdout", "stderr"):
        if not isinstance(getattr(sys, name), OutputReaderGone):
            setattr(sys, name, OutputReaderGone(getattr(sys, name), name))


class OutputReaderGone:
    """One of the script's output streams, which goes on where its reader has ended (`| head -3`): the first
    print after that raised BrokenPipeError wherever it was, a checkpoint's write included, and the run
    stopped with exit 1 and no word; with `2>&1 | head` the progress bar's next line did, in the first epoch.
    Now one note on the other stream (where it has a reader), and the run goes on, printing nowhere there."""

    def __init__(self, stream, which="stdout"):
        self.stream, self.which, self.gone = stream, which, False  # not .name: the stream's own ("<stdout>")

    def write(self, text):
        return self.unless_gone(self.stream.write, text) or len(text)

    def flush(self):
        self.unless_gone(self.stream.flush)

    def unless_gone(self, call, *args):
        if self.gone:
            return None
        try:
            return call(*args)
        except OSError as exc:  # EIO: a terminal that closed (SIGHUP's stop then says its line nowhere)
            if not isinstance(exc, BrokenPipeError) and exc.errno != errno.EIO:
                raise
            self.gone = True
            with contextlib.suppress(OSError, ValueError):  # Python's flush at exit finds the null device
                os.dup2(os.open(os.devnull, os.O_WRONLY), self.stream.fileno())
            other = sys.stderr if self.which == "stdout" else sys.stdout  # itself guarded: gone too, it is silent
            what = "output's" if self.which == "stdout" else "error output's"
            print(f"note: the {what} reader has ended (a pipe such as | head): the command goes on without "
                  f"printing there; its results are written as usual", file=other, flush=True)
            return None

    def __getattr__(self, name):
        return getattr(self.stream, name)


def quiet_readers():
    """A damaged file gets one line, the script's own (read_image's, or predict's 'failed:'): tifffile also
    logged '<tifffile.TiffFile ...> contains no pages' up to 4 times a file (each header read), and OpenCV
    '[ERROR:0@10.6] global loadsave.cpp:568 imread_(...): can't read header: ... Assertion failed', and
    '<tifffile.TiffPages @8> invalid offset to page 2' at its error level."""
    import logging

    logging.getLogger("tifffile").setLevel(logging.CRITICAL)  # its errors too: the read says what is wrong
    opencv_log = getattr(getattr(cv2, "utils", None), "logging", None)
    if opencv_log is not None:
        opencv_log.setLogLevel(opencv_log.LOG_LEVEL_FATAL)


@functools.lru_cache(maxsize=None)
def readers_quieted():
    """quiet_readers, once per process."""
    quiet_readers()


def keep_freed_memory():
    """Have glibc keep freed memory in the process for the next forward instead of returning it to the
    kernel; the peak memory stays about the same. The script's commands call it once (main); True if set. A
    no-op where malloc is not glibc's (macOS, Windows, musl) or the user tuned it (MALLOC_TUNING_ENV)."""
    if not sys.platform.startswith("linux") or any(key in os.environ for key in MALLOC_TUNING_ENV):
        return False
    libc = ctypes.CDLL(None)
    if not hasattr(libc, "gnu_get_libc_version"):
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
    # The mmap threshold first: a fixed trim threshold alone also fixes the mmap threshold at its 128 kB
    # default, and every larger block would be mapped and faulted in anew (measured: 2.6x slower)
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and \
        bool(libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


# Allowed values for keys with a fixed set of choices.
CHOICES = {
    "amp_dtype": ("auto", "bfloat16", "float16"),
    "tf32_matmul_precision": (None, "highest", "high", "medium"),
    "channels_last": ("auto", True, False),
    "in_channels": (1, 3),
    "preset": (None, "", "fast", "stable", "low_memory", "debug"),
    "logger": ("auto", "tensorboard", "csv", "none"),
    "data_mode": ("fit", "patch"),
    "tta": ("none", "flip", "d4"),  # the views of each: TTA_VIEWS (III.6)
}


# amp_dtype as the banner and the benchmark name precisions: amp_dtype=bf16 is amp_dtype=bfloat16
AMP_DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16"}
FP32_NAMES = ("float32", "fp32", "f32", "float", "tf32", "full")  # asked of amp_dtype: use_amp=False is meant


def amp_dtype_name(value):
    """amp_dtype's full name for a short one (training and predict both accept both); else as given."""
    return AMP_DTYPE_NAMES.get(value, value) if isinstance(value, str) else value


def check_choice(key, value):
    """A value of one of CHOICES' keys; else a one-line error listing them, with a near miss suggested."""
    allowed = CHOICES[key]
    if value in allowed:
        return
    if key == "amp_dtype" and str(value).lower() in FP32_NAMES:  # was 'did you mean float16?': the riskiest
        raise UserError(f"amp_dtype={value!r} is not allowed: fp32 is no mixed precision: set use_amp=False "
                        f"(amp_dtype chooses the mixed one: {', '.join(allowed)})")
    words = [str(a) for a in allowed if a not in (None, "")]  # "" is preset's None, not a choice to list
    if None in allowed and isinstance(value, str) and value.lower() in ("none", "null"):  # the command line's words
        raise UserError(f"{key}={value!r} is not allowed: in Python, write None (not the string), or use one of "
                        f"{', '.join(words)}")
    close = difflib.get_close_matches(str(value).lower(), words, n=1)
    raise UserError(f"{key}={value!r} is not allowed: use one of " + ", ".join(["None"] * (None in allowed) + words)
                    + (f" (did you mean {close[0]}?)" if close else ""))


# Every training and predict key's type, whatever value CONFIG holds: an edit at the top ("weight_decay": 0,
# "batch_size": "auto") is checked and parsed as the key's type, as on the command line, not as the type
# of the value typed there. Other keys are words. Tested against the shipped CONFIG and PREDICT_CONFIG.
KEY_TYPES = {
    **dict.fromkeys(("image_size", "in_channels", "num_classes", "max_train_images", "num_workers", "patches_per_image",
                     "tile_batch_size", "epochs", "batch_size", "accumulation_steps", "early_stopping_patience",
                     "seed", "growth_interval", "nan_patience"), int),
    **dict.fromkeys(("val_fraction", "patch_scale", "patch_foreground", "tile_overlap", "learning_rate",
                     "weight_decay", "warmup_fraction", "grad_clip_norm", "ema_decay", "init_scale", "growth_factor",
                     "backoff_factor"), float),
    **dict.fromkeys(("cache_images", "use_amp", "force_amp_dtype", "eval_amp", "cpu_probe", "compile_model",
                     "sync_batchnorm", "nan_guard", "detect_anomaly", "resume", "progress", "overlay"), bool),
    **dict.fromkeys(("intensity_range", "class_weights"), list),
}

# The keys of CONFIG and PREDICT_CONFIG as shipped (tested against them): an edit at the top that adds or
# deletes one is refused (check_edited_keys), and command-line keys are checked against these.
TRAINING_KEYS = (
    "preset", "data_dir", "image_size", "in_channels", "num_classes", "val_fraction", "max_train_images", "num_workers",
    "cache_images", "intensity_range", "data_mode", "patch_scale", "patch_foreground", "patches_per_image",
    "tile_overlap", "tile_batch_size", "arch", "encoder_name", "encoder_weights", "loss", "class_weights", "epochs",
    "batch_size", "accumulation_steps", "learning_rate", "weight_decay", "warmup_fraction", "grad_clip_norm",
    "ema_decay", "early_stopping_patience", "seed", "device", "use_amp", "amp_dtype", "force_amp_dtype", "eval_amp",
    "tta", "channels_last", "cpu_probe", "compile_model", "sync_batchnorm", "tf32_matmul_precision", "init_scale",
    "growth_factor", "backoff_factor", "growth_interval", "nan_guard", "nan_patience", "detect_anomaly",
    "checkpoint_dir", "resume", "progress", "logger")
PREDICT_KEYS = ("checkpoint", "input", "output", "overlay", "batch_size", "device", "use_amp", "amp_dtype",
                "force_amp_dtype", "cpu_probe", "channels_last", "progress", "tile_overlap", "tile_batch_size", "tta",
                "backend", "intensity_range")

# Keys that take None (each one's comment in CONFIG says what None means).
NONE_KEYS = ("preset", "max_train_images", "num_workers", "intensity_range", "patches_per_image", "tile_overlap",
             "tile_batch_size", "encoder_weights", "class_weights", "grad_clip_norm", "ema_decay",
             "early_stopping_patience", "tf32_matmul_precision")


def key_type(key, defaults):
    """A key's type: KEY_TYPES' for training and predict keys, its default's for the other commands'."""
    if key in KEY_TYPES:
        return KEY_TYPES[key]
    return str if edited_at_top(defaults) else type(defaults[key])


def takes_none(key, defaults):
    return key in NONE_KEYS or (not edited_at_top(defaults) and defaults[key] is None)


def edited_at_top(defaults):
    """Whether these are CONFIG or PREDICT_CONFIG, whose values a user's edits may have changed."""
    return defaults is CONFIG or defaults is PREDICT_CONFIG


# Keys that take a word or a bool (parsed as bool when the text is one, else kept as text).
BOOL_OR_TEXT = ("channels_last",)

# Keys that define the model's shape: a resumed run or a checkpoint must agree on them.
MODEL_KEYS = ("arch", "encoder_name", "in_channels", "num_classes")

# ... and those that define the data, the optimisation and what validation measures (tta, and patch
# mode's tile_overlap: best.pt compares every epoch's val IoU): a resume continues exactly only if they are unchanged (epochs may grow;
# precision, speed and output settings may change).
RESUME_KEYS = MODEL_KEYS + ("data_dir", "image_size", "val_fraction", "max_train_images", "loss", "class_weights",
                            "batch_size", "accumulation_steps", "learning_rate", "weight_decay", "warmup_fraction",
                            "seed", "data_mode", "patch_scale", "patch_foreground", "patches_per_image", "tta",
                            "tile_overlap", "eval_amp")


# Keys that also take the value "auto" (resolved at start-up; the resolved value is recorded).
AUTO_KEYS = ("batch_size", "class_weights")


def parse_value(key, text, defaults):
    kind, default = key_type(key, defaults), defaults[key]
    low = text.strip().lower()
    if key in CHOICES or key == "device":  # words of a fixed set, all lower case: tta=FLIP, device=CPU
        text = text.strip().lower()
    if key in BOOL_OR_TEXT:
        return {"true": True, "1": True, "yes": True, "on": True, "false": False, "0": False, "no": False,
                "off": False}.get(low, low)
    if low in ("none", "null") and takes_none(key, defaults):
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
        if kind is list:  # "0,4095" or "[0, 4095]"
            return [float(v) for v in text.strip().strip("[]()").split(",")]
        return text
    except ValueError:
        predict = defaults is PREDICT_CONFIG  # its batch_size takes no auto; training's tiling keys no None
        words = [TYPE_WORDS.get(kind, kind.__name__), *["auto"] * (key in AUTO_KEYS and not predict),
                 *["None"] * (takes_none(key, defaults) and (predict or key not in TILE_RULES))]  # "a number or None"
        words = f"{', '.join(words[:-1])} or {words[-1]}" if len(words) > 1 else words[0]
        raise UserError(f"{key}={text!r} is not {words} (default {default!r}"
                        + (none_means(key, defaults) if default is None else "") + ")"
                        + resume_file_hint(key, text)) from None


def resume_file_hint(key, value):
    """resume= names the run's last.pt or its folder: resume=True continues the run in checkpoint_dir."""
    text = str(value).strip() if isinstance(value, (str, os.PathLike)) else ""
    if key != "resume" or not text or not (text.endswith(".pt") or "/" in text or os.sep in text
                                           or Path(text).is_dir()):
        return ""  # resume=maybe: no path; resume= or None (Path("") is the current folder)
    path = Path(text)
    folder = path.parent if path.suffix == ".pt" else path
    return (f": to continue the run in {folder}, give checkpoint_dir={cli_value(folder)} resume=True"
            + (" (it continues from last.pt)" if path.suffix == ".pt" and path.name != "last.pt" else ""))


# What a value of each type is, in a message: "batch_size='x' is not a whole number"
TYPE_WORDS = {bool: "true or false", int: "a whole number", float: "a number", str: "a word",
              list: "a list of numbers"}


def parse_overrides(args, base=None, defaults=None):
    """['batch_size=2', 'amp_dtype=float16'] -> a copy of the config with those values.

    Training configs are validated here; other commands pass their own `defaults` and validate.
    """
    defaults = CONFIG if defaults is None else defaults
    check_argument_list(args)
    cfg, seen = copy.deepcopy(defaults if base is None else base), {}
    for i, arg in enumerate(args):
        key, sep, text = arg.partition("=")
        if not sep:
            raise UserError(f"argument {arg!r} is not key=value, e.g. batch_size=2" + split_argument_hint(args, i))
        key = normalize_key(key)
        check_known_key(key, defaults)
        if key in seen:  # the arguments as given, from a command line or a notebook's list
            raise UserError(f"{key} is given twice ({seen[key]} and {arg}): keep one")
        seen[key] = arg
        check_not_quoted(key, text)
        cfg[key] = parse_value(key, text, defaults)
    # a base parse_overrides made keeps its typed keys: base=parse_overrides(["preset=debug", "batch_size=8"])
    return TypedConfig(validate_config(cfg) if defaults is CONFIG else cfg, {*seen, *getattr(base, "typed", ())})


class TypedConfig(dict):
    """A training config parse_overrides made, which remembers the keys typed: train(parse_overrides([...]))
    keeps them over a preset, as the command line does (preset=debug batch_size=8 trained at the preset's 2,
    8 being CONFIG's value). cfg.copy(), cfg | {...}, cfg[key] = ... and cfg.update(...) keep them, the keys
    set typed too (a notebook's sweep: q = cfg.copy(); q["batch_size"] = 8 trained at debug's 2), of another
    TypedConfig merged in only its typed keys, with their values (all of its keys had switched the preset off);
    a key removed is no longer typed. {**cfg} and dict(cfg) are plain dicts: then only values away from
    CONFIG's count."""

    def __init__(self, values, typed):
        super().__init__(values)
        self.typed = frozenset(typed)

    def copy(self):
        return TypedConfig(self, self.typed)

    def __reduce__(self):  # deepcopy and pickle: the same keys typed (item by item, each would be typed)
        return TypedConfig, (dict(self), self.typed)

    @staticmethod
    def given(other):
        """What a merge of `other` sets, and types: of another TypedConfig its typed keys (the rest are CONFIG's
        values: parse_overrides(["epochs=5"])'s preset=None had wiped out a preset=debug), else all it holds."""
        return {k: other[k] for k in other.typed} if isinstance(other, TypedConfig) else dict(other)

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self.typed = self.typed | {key}

    def update(self, *others, **values):
        merged = {**(self.given(others[0]) if others else {}), **values}
        super().update(merged)
        self.typed = self.typed | set(merged)

    def setdefault(self, key, value=None):
        if key not in self:
            self[key] = value
        return self[key]

    def __delitem__(self, key):
        super().__delitem__(key)
        self.typed = self.typed - {key}

    def pop(self, key, *default):
        self.typed = self.typed - {key}
        return super().pop(key, *default)

    def popitem(self):
        key, value = super().popitem()
        self.typed = self.typed - {key}
        return key, value

    def clear(self):
        super().clear()
        self.typed = frozenset()

    def __or__(self, other):  # the keys given here are typed too: cfg | {"batch_size": 8} beats a preset's 2
        if not isinstance(other, dict):
            return NotImplemented
        merged = self.given(other)
        return TypedConfig({**self, **merged}, self.typed | set(merged))

    def __ior__(self, other):
        self.update(other)
        return self


def check_not_quoted(key, text):
    """A value wrapped in quote marks got them from a shell that passes them on (data_dir="'my data'",
    or data_dir='x' in Windows' cmd): they would be part of a path or a word, and its error would
    read 'not found'."""
    value = text.strip()
    if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
        raise UserError(f"{key}={value} holds its quote marks (the shell passed them on): write {key}={value[1:-1]}, "
                        f"or quote the whole argument where the value has spaces: \"{key}={value[1:-1]}\"")


def split_argument_hint(args, i, known=None):
    """Why args[i] has no '=' where the user wrote a key and its value apart ('epochs = 2', '--epochs 2') or a
    path with a space unquoted (data_dir=d/my data): the fix, after ': '; else ''."""
    known = known if known is not None else (*CONFIG, *PREDICT_CONFIG, *EXPORT_CONFIG, *BENCHMARK_CONFIG)
    arg, following = args[i], args[i + 1:i + 3]
    key = normalize_key(arg)
    if key in known and KEY_TYPES.get(key) is bool and (not following or "=" in following[0].lstrip("=")
                                                         or following[0].startswith("-")):
        # '--overlay use_amp=False', or 'overlay' last: a switch given alone ('write overlay=use_amp=False')
        return f": write {key}=True (every key takes a value: key=value)"
    if key in known and following:
        value = following[1] if following[0] == "=" and len(following) > 1 else following[0].lstrip("=")
        return f": write {key}={value}, with no spaces around = (the command line's key=value)"
    if i > 0 and "=" in args[i - 1]:
        return (f": a value with a space is one argument in quotes, e.g. \"{args[i - 1]} {arg}\" (or rename the "
                f"folder without spaces)")
    return ""


def normalize_key(key):
    """'--batch-size' -> 'batch_size'."""
    return key.strip().lstrip("-").replace("-", "_")


def explicit_keys(args):
    """The keys named in a key=value list: what the user typed wins over a preset."""
    return {normalize_key(a.partition("=")[0]) for a in args}


def check_argument_list(args):
    """A library call's key=value arguments as a list: a string was iterated a character at a time
    ("argument 'e' is not key=value" for "epochs=2")."""
    if not isinstance(args, (list, tuple)) or not all(isinstance(arg, str) for arg in args):
        raise UserError(f"{args!r}: pass the settings as a list of key=value strings, e.g. ['epochs=2']")


def check_config_dict(cfg):
    """A library call's config, as a dict of known keys: None or a list gave Python's TypeError, a typo was
    taken silently by prepare_data. Keys left out take CONFIG's values (as validate_config does)."""
    if not isinstance(cfg, dict):
        raise UserError(f"the config is {type(cfg).__name__}: pass a dict such as dict(train_unet.CONFIG, "
                        f"data_dir=...), or parse_overrides(['key=value', ...])")
    for key in cfg:
        check_known_key(key)
    return as_given({**CONFIG, **cfg})


def as_given(cfg):
    """A training config's values as the command line gives them, whoever wrote them (CONFIG's edits, a library
    dict): plain_values, words of a fixed set in lower case, and a leading ~ in its paths the home folder (the
    stop and out-of-memory messages look for last.pt in the folder the run writes)."""
    cfg = plain_values(cfg)
    cfg.update({k: v.strip().lower() for k, v in cfg.items() if (k in CHOICES or k == "device") and isinstance(v, str)})
    cfg.update({k: os.path.expanduser(cfg[k]) for k in ("data_dir", "checkpoint_dir")
                if isinstance(cfg.get(k), str) and cfg[k].startswith("~")})
    return cfg


def plain_values(values):
    """A library call's dict with its values as the command line gives them: pathlib.Path as str, numpy
    scalars as Python numbers and bools (a sweep's np.int64(2) read 'batch_size must be a whole number'),
    tuples and 1-D arrays as lists (intensity_range=(0, 4095))."""
    return {k: plain_value(v) for k, v in values.items()}


def plain_value(value):
    if isinstance(value, os.PathLike):
        return os.fspath(value)
    if isinstance(value, np.floating) and value.dtype.itemsize < 8:
        return float(str(value))  # np.float32(2e-3) is 2e-3 as typed, not float32's 0.0020000000949949026
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray) and value.ndim == 1:
        return [plain_value(v) for v in value]  # float32 entries as typed, as a scalar is
    if isinstance(value, (tuple, list)):
        return [plain_value(v) for v in value]
    return value


def check_command_dict(opts, defaults):
    """predict's or export's options in a library call, as a dict of that command's keys (the command line's
    parse_overrides checks its own): a typo such as backed=onnxruntime ran without it, silently, and export
    ended in a KeyError."""
    if not isinstance(opts, dict):
        raise UserError(f"the options are {type(opts).__name__}: pass a dict of the command's keys")
    for key in opts:
        check_known_key(key, defaults)
    return {**defaults, **plain_values(opts)}  # keys left out take the command's defaults, as on the command line


def check_known_key(key, defaults=CONFIG):
    known = shipped_keys(defaults)
    if key in known:
        return
    if defaults is PREDICT_CONFIG and key in TRAINING_KEYS:
        raise UserError(f"{key} is not a predict key: {predict_takes(key)}; predict's keys: {', '.join(known)}")
    owners = [command for command, keys in COMMAND_KEYS.items() if key in keys()] if defaults is CONFIG else []
    if owners:  # overlay=True given to training read "did you mean 'tile_overlap'?"
        raise UserError(f"{key} is a key of {' and '.join(owners)}, not of training: python train_unet.py "
                        f"{owners[0]} {key}=...")
    raise UserError(f"unknown key {key!r}: {near_key(key, known)}known keys: {', '.join(known)}")


# Training keys whose value the checkpoint holds and predict follows (in_channels=1 given to predict).
CHECKPOINT_HOLDS = MODEL_KEYS + ("image_size", "data_mode", "patch_scale")


def predict_takes(key):
    """How predict stands to a training key given to it: one the checkpoint holds, the EMA, or neither
    (logger=csv read 'the model was trained with one')."""
    if key in CHECKPOINT_HOLDS:
        return "the model was trained with one, and predict takes it from the checkpoint"
    if key == "ema_decay":
        return "predict uses the checkpoint's EMA weights where it was trained with ema_decay, else its weights"
    return "a training key, which predict does not use"


def near_key(key, known):
    """'did you mean ...? ' for a key not known (EPOCHS, Batch_Size, lr, encoder), else ''."""
    low = key.lower()
    near = [KEY_ALIASES[low]] if KEY_ALIASES.get(low) in known else difflib.get_close_matches(low, known, n=1)
    return f"did you mean {near[0]!r}? " if near else ""


def shipped_keys(defaults):
    """The keys of CONFIG or PREDICT_CONFIG as shipped, whatever an edit at the top did to them; other
    commands' defaults as they are."""
    return TRAINING_KEYS if defaults is CONFIG else PREDICT_KEYS if defaults is PREDICT_CONFIG else tuple(defaults)


def defaults_name(defaults):
    """The name in this file of a command's defaults (CONFIG, PREDICT_CONFIG, ...); None for any other dict."""
    return next((name for name in ("CONFIG", "PREDICT_CONFIG", "EXPORT_CONFIG", "BENCHMARK_CONFIG")
                 if globals()[name] is defaults), None)


def check_edited_keys(defaults):
    """CONFIG or PREDICT_CONFIG as edited at the top of the file has the keys it shipped with: a key added
    there (a typo: "encoder" for "encoder_name", "batchsize") would be ignored, or read as a word, and a key
    deleted would stop the run with a KeyError deep inside it."""
    name, known = defaults_name(defaults), shipped_keys(defaults)
    where = f"{name} at the top of {Path(__file__).name}"
    for key in defaults:
        if key not in known:
            raise UserError(f"{where} has a key unet-amp does not know, {key!r}: {near_key(key, known)}fix or remove "
                            f"it there (its keys: {', '.join(known)})")
    missing = [key for key in known if key not in defaults]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise UserError(f"{where} has no {missing[0]!r}{more}: put the key back there, with a value (the file as "
                        f"shipped has every key, each with a comment saying what it does)")


# Other trainers' names for keys of ours, too short or too unlike ours for difflib to match.
KEY_ALIASES = {"lr": "learning_rate", "bs": "batch_size", "wd": "weight_decay", "classes": "num_classes",
               "channels": "in_channels", "size": "image_size", "amp": "use_amp", "workers": "num_workers",
               "encoder": "encoder_name", "weights": "encoder_weights", "out": "output", "ckpt": "checkpoint"}


def check_types(cfg, defaults):
    """Every value has its default's type (None only where the default allows it)."""
    names = {**TYPE_WORDS, str: "a string"}
    for key, value in cfg.items():
        if key in BOOL_OR_TEXT:
            continue  # checked against CHOICES
        kind = key_type(key, defaults)
        if value is None and takes_none(key, defaults):
            continue
        if value == "auto" and key in AUTO_KEYS and defaults is CONFIG:
            continue
        ok = (isinstance(value, bool) if kind is bool else
              isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
              if kind is float else isinstance(value, kind) and not isinstance(value, bool))
        if not ok:
            word = "a finite number" if kind is float and isinstance(value, float) else names.get(kind, kind.__name__)
            alternatives = [word] + ["auto"] * (key in AUTO_KEYS and defaults is CONFIG) \
                + ["None"] * takes_none(key, defaults)
            allowed = " or ".join([", ".join(alternatives[:-1]), alternatives[-1]] if len(alternatives) > 1
                                  else alternatives)
            raise UserError(f"{key}={value!r} must be {allowed}{resume_file_hint(key, value)}"
                            + edited_value_hint(key, value, kind, defaults))


def edited_value_hint(key, value, kind, defaults):
    """Where a wrong value is the one edited into CONFIG (or PREDICT_CONFIG) at the top of the file, that says so
    ("use_amp='False' must be true or false": the user had written False, in quotes, up there)."""
    if key not in defaults or value != defaults[key] or type(value) is not type(defaults[key]):
        return ""
    if not edited_at_top(defaults):
        return ""
    name = defaults_name(defaults)
    unquoted = f": write {value.strip()} there, without quotes" if isinstance(value, str) and kind is not str else ""
    return f" (as {name} at the top of {Path(__file__).name} has it{unquoted})"


def validate_config(cfg, model_names=True):
    """Stop early, with a one-line message, on values that cannot be right. model_names=False leaves out
    the check of arch and encoder_name against smp's lists (an exported model runs without smp)."""
    check_edited_keys(CONFIG)
    for key in cfg:
        check_known_key(key)
    cfg = as_given({**CONFIG, **cfg})  # CONFIG's edits as a library dict's: a tuple, a Path, CPU for cpu, ~/x
    cfg["amp_dtype"] = amp_dtype_name(cfg["amp_dtype"])
    check_types(cfg, CONFIG)
    for key in CHOICES:
        check_choice(key, cfg[key])
    check_counts(cfg)
    for key, ok, rule in value_rules(cfg):
        if not ok:
            raise UserError(f"{key}={cfg[key]!r} {rule}")
    if model_names:
        check_model_names(cfg)
    return cfg


def check_counts(cfg):
    """Whole-number keys, the class count and the image size."""
    if cfg["num_classes"] >= IGNORE_INDEX:
        raise UserError(f"num_classes={cfg['num_classes']} must be below {IGNORE_INDEX} (mask value "
                        f"{IGNORE_INDEX} marks padding)")
    for key in ("epochs", "batch_size", "accumulation_steps", "num_classes", "growth_interval", "nan_patience"):
        if key in AUTO_KEYS and cfg[key] == "auto":
            continue
        if not isinstance(cfg[key], int) or cfg[key] < 1:
            raise UserError(f"{key}={cfg[key]!r} must be a whole number >= 1")
    size, stride = cfg["image_size"], MODEL_STRIDE
    if not isinstance(size, int) or size < stride or size % stride:
        ok = max(stride, round(size / stride) * stride) if isinstance(size, (int, float)) else 128
        raise UserError(f"image_size={size!r} must be a multiple of {stride}, at least {stride} (the U-Net halves "
                        f"it 5 times): try image_size={ok}")


def value_rules(cfg):
    """(key, value is allowed, the rule) for the keys with a range."""
    return [
        ("learning_rate", 0 < cfg["learning_rate"] < math.inf, "must be a finite number > 0"),
        ("seed", 0 <= cfg["seed"] < 2**32, "must be a whole number in [0, 2**32)"),
        ("weight_decay", cfg["weight_decay"] >= 0, "must be >= 0"),
        ("val_fraction", 0 < cfg["val_fraction"] < 1, "must be between 0 and 1, e.g. 0.2"),
        ("warmup_fraction", 0 <= cfg["warmup_fraction"] < 1, "must be in [0, 1)"),
        ("grad_clip_norm", cfg["grad_clip_norm"] is None or cfg["grad_clip_norm"] > 0,
         "must be > 0, or None for no clipping"),
        ("ema_decay", cfg["ema_decay"] is None or 0 < cfg["ema_decay"] < 1,
         "must be in (0, 1), e.g. 0.99 (README, losses and weight EMA), or None for no EMA"),
        ("early_stopping_patience", cfg["early_stopping_patience"] is None
         or cfg["early_stopping_patience"] >= 1, "must be >= 1, or None to train every epoch"),
        ("num_workers", cfg["num_workers"] is None or cfg["num_workers"] >= 0, "must be >= 0 or None"),
        ("max_train_images", cfg["max_train_images"] is None or cfg["max_train_images"] >= 1,
         "must be >= 1, or None for all"),
        ("init_scale", 0 < cfg["init_scale"] <= MAX_INIT_SCALE,
         f"must be in (0, 2**{MAX_INIT_SCALE.bit_length() - 1}]: fp16's loss scale to start from (2**16 by default); "
         f"a larger one only skips steps while it backs off (past float32's range, GradScaler fails)"),
        ("growth_factor", 1 < cfg["growth_factor"] <= MAX_GROWTH_FACTOR,
         f"must be in (1, {MAX_GROWTH_FACTOR}]: the loss scale's growth after growth_interval good steps (2.0 by "
         f"default); a larger one overflows at each growth, and the step is skipped"),
        ("backoff_factor", 0 < cfg["backoff_factor"] < 1, "must be between 0 and 1"),
        ("device", valid_device(cfg["device"]), "must be auto, cpu, cuda, cuda:N or mps"),
        ("patch_scale", 0 < cfg["patch_scale"] <= 4, "must be in (0, 4]: 1.0 = native resolution, 0.5 = half"),
        ("patch_foreground", 0 <= cfg["patch_foreground"] <= 1, "must be a share in [0, 1], e.g. 0.33"),
        ("patches_per_image", cfg["patches_per_image"] is None or cfg["patches_per_image"] >= 1,
         "must be >= 1, or None for as many as tile each image once"),
        ("intensity_range", cfg["intensity_range"] is None or valid_range(cfg["intensity_range"]),
         "must be [low, high] with low < high (the values mapped to 0 and 1), or None to learn it"),
        ("loss", loss_terms(cfg["loss"]) is not None,
         f"is not allowed: {loss_hint(cfg['loss'])}use terms from {', '.join(LOSS_TERMS)}, each once, joined by +, "
         f"e.g. focal+dice"),
        ("class_weights", valid_class_weights(cfg["class_weights"], cfg["num_classes"]),
         f"must be None, auto, or {max(2, cfg['num_classes'])} weights >= 0, one per class"
         f"{' [background, foreground]' if cfg['num_classes'] == 1 else ''}, not all 0, e.g. "
         f"class_weights={','.join(['1'] + ['5'] * max(1, cfg['num_classes'] - 1))}"),
        *((key, cfg[key] is not None and ok(cfg[key]), rule) for key, (ok, rule) in TILE_RULES.items()),
        ("batch_size", cfg["batch_size"] == "auto" or not one_value_per_channel(cfg["batch_size"], cfg["image_size"]),
         f"with image_size={cfg['image_size']} leaves BatchNorm one value per channel at the U-Net's "
         f"bottleneck: use batch_size >= 2 or image_size >= 64"),
    ]


# fp16's loss-scale keys' bounds: a scale of 1e30 skipped every step of a short run while it halved (unsaid), and
# 1e39, past float32, failed inside GradScaler. 2**32 is 65536x the default (fp16's whole range): backing off from
# it skips 16 steps at most. A growth factor past 16 overflows at each growth (growth_interval steps), skipped.
MAX_INIT_SCALE, MAX_GROWTH_FACTOR = 2**32, 16


# Sliding-window settings: checked for training, and at predict time when given (None = the checkpoint's).
TILE_RULES = {
    # 0.5 against 0.25: (0.75 / 0.5)^2 = 2.25x the tiles on a large scene, 1.8-2.2x on images of a few tiles
    "tile_overlap": (lambda v: 0 <= v <= 0.9, "must be in [0, 0.9]: 0.25, or 0.5 for smoother seams (about 2x "
                                              "the tiles of 0.25)"),
    "tile_batch_size": (lambda v: v >= 1, "must be a whole number >= 1"),
}


def valid_range(value):
    numbers = len(value) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                      and math.isfinite(v) for v in value)
    if not (numbers and value[0] < value[1]):
        return False
    with np.errstate(over="ignore"):  # scale_image divides by high - low in float32: it must be finite
        return bool(np.isfinite(np.float32(value[1]) - np.float32(value[0])))


def valid_class_weights(weights, num_classes):
    """None, "auto", or one finite weight >= 0 per class (binary: 2), not all 0."""
    if weights is None or weights == "auto":
        return True
    return (isinstance(weights, list) and len(weights) == max(2, num_classes)
            and all(isinstance(w, (int, float)) and not isinstance(w, bool) and 0 <= w < math.inf for w in weights)
            and sum(weights) > 0)


def valid_device(device):
    return re.fullmatch(r"auto|cpu|mps|cuda(:\d+)?", str(device)) is not None


ARCH_ALIASES = {"unet++": "UnetPlusPlus", "deeplabv3+": "DeepLabV3Plus"}  # the papers' names for smp's


def check_model_names(cfg):
    import segmentation_models_pytorch as smp

    archs = [n for n in ("Unet", "UnetPlusPlus", "FPN", "PSPNet", "DeepLabV3", "DeepLabV3Plus",
                         "Linknet", "MAnet", "PAN", "UPerNet", "Segformer") if hasattr(smp, n)]
    named = {a.lower(): a for a in archs}
    found = named.get(str(cfg["arch"]).lower()) or ARCH_ALIASES.get(str(cfg["arch"]).lower())
    if found not in archs:
        raise UserError(f"arch={cfg['arch']!r} is not allowed: use one of {', '.join(archs)}")
    cfg["arch"] = found  # arch=unet, Unet++: as smp names it (it was 'not allowed', with no word of Unet)
    names = smp.encoders.get_encoder_names()
    if cfg["encoder_name"] not in names:
        near = difflib.get_close_matches(cfg["encoder_name"], names, n=3)
        raise UserError(f"encoder_name={cfg['encoder_name']!r} is unknown: did you mean "
                        f"{', '.join(near) or 'resnet34'}? (smp.encoders.get_encoder_names() lists all)")


def apply_preset(cfg, explicit=()):
    """Return (cfg with the preset applied, a one-line description for the banner or None)."""
    name = cfg.get("preset")
    if not name:
        return cfg, None
    explicit = given_keys(cfg, explicit)
    out = validate_config({**cfg, **{k: v for k, v in PRESETS[name].items() if k not in explicit}})
    return out, describe_preset(out, explicit)


def describe_preset(cfg, explicit, resumed=()):
    """The banner's line for cfg's preset: the values it set, the user's it kept (`explicit`) and, on resume,
    the resumed run's it kept (`resumed`: early_stopping_patience, kept_patience)."""
    name, values = cfg["preset"], PRESETS[cfg["preset"]]
    line = f"{name}: " + (", ".join(f"{k}={v}" for k, v in values.items() if k not in {*explicit, *resumed})
                          or "nothing")
    kept = [k for k in values if k in explicit]
    if kept:
        line += "; kept yours: " + ", ".join(f"{k}={cfg[k]}" for k in kept)
    back = [k for k in values if k in resumed and k not in explicit]
    if back:
        line += "; kept the resumed run's: " + ", ".join(f"{k}={cfg[k]}" for k in back)
    return line


def given_keys(cfg, explicit=()):
    """The keys the user set (on the command line, or away from CONFIG's default in a library call's config):
    a preset leaves them as given."""
    shipped = as_given(CONFIG)  # an edit at the top read as validate_config reads it (channels_last="Auto")
    return set(explicit) | {k for k in cfg if k in CONFIG and cfg[k] != shipped[k] and k != "preset"}


def preset_table():
    """The README's presets table, generated from PRESETS (a test checks the README holds it)."""
    rows = ["| preset | for | sets |", "|---|---|---|"]
    for name, values in PRESETS.items():
        rows.append(f"| `{name}` | {PRESET_USES[name]} | " + ", ".join(f"`{k}={v}`" for k, v in values.items())
                    + " |")
    return "\n".join(rows)


def format_config(cfg, commented=False):
    """key = value lines; commented (--help): each key's comment in the source (key_comments) beside it."""
    width = max(map(len, cfg))
    lines = [f"  {k:<{width}} = {v!r}" for k, v in cfg.items()]
    comments = key_comments(cfg) if commented else {}
    column = min(max(map(len, lines)), width + 22)  # a long value pushes its own comment, not all of them
    return "\n".join(f"{line:<{column}}  # " + f"\n{'':<{column + 4}}".join(comments[k]) if comments.get(k) else line
                      for line, k in zip(lines, cfg))


@functools.lru_cache(maxsize=None)
def source_comments(name):
    """{key: [comment lines]} of the dict literal NAME (CONFIG, PREDICT_CONFIG, ...) in this file's source: a
    key's comment on its line and the comment-only lines under it, indented past the key (a section's
    heading comment is at the key's indent and is not one). {} where the source can't be read."""
    import ast
    import tokenize
    try:
        source = Path(__file__).read_text(encoding="utf-8")
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
        node = next(n.value for n in ast.parse(source).body if isinstance(n, ast.Assign)
                    and [getattr(t, "id", None) for t in n.targets] == [name] and isinstance(n.value, ast.Dict))
    except (OSError, NameError, UnicodeDecodeError, SyntaxError, tokenize.TokenError, StopIteration):
        return {}  # a copy run from a notebook cell or a zip: --help and the errors without the comments
    said = {t.start[0]: (t.start[1], t.string.lstrip("#").strip()) for t in tokens if t.type == tokenize.COMMENT}
    keys = [k for k in node.keys if isinstance(k, ast.Constant)]
    comments = {}
    for key, end in zip(keys, [k.lineno for k in keys[1:]] + [node.end_lineno]):
        lines = [said[key.lineno][1]] if key.lineno in said and said[key.lineno][0] > key.col_offset else []
        for line in range(key.end_lineno + 1, end):
            if line not in said or said[line][0] <= key.col_offset or not lines:
                break
            lines.append(said[line][1])
        comments[key.value] = lines
    return comments


def key_comments(defaults):
    """source_comments of the defaults dict these are (CONFIG, PREDICT_CONFIG, EXPORT_CONFIG, ...)."""
    name = defaults_name(defaults)
    return source_comments(name) if name else {}


def none_means(key, defaults):
    """What None means for this key, in its comment's words ("None = all; ..." -> " = all"), or ""."""
    said = re.search(r"None = (.+?)(;|$)", " ".join(key_comments(defaults).get(key, ())))
    return f" = {said.group(1).rstrip('.,')}" if said else ""


# ----------------------------------------------------------------------------------------------------
# III.2 Distributed: torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; one process per device.
# Module-level like nanoGPT's ddp variables: every function reads the same facts, nothing is threaded through.
# ----------------------------------------------------------------------------------------------------
@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    setup_group: object = None    # start-up waits (barrier, gather_setup); None = the default group

    @property
    def enabled(self):
        return self.world > 1

    @property
    def is_main(self):
        return self.rank == 0


DIST = Dist()

# Start-up work before training can keep some ranks waiting for long: the first data check of a large
# set, writing the embedded data set. Under the default group's timeout NCCL's watchdog kills a rank
# whose wait passes 10 minutes. Those waits use a gloo group of their own with a generous timeout (gloo
# has no watchdog and carries Python objects on the CPU); a rank that fails still stops the others at
# once (torchrun), and the check's decoding is shared by the ranks (checked_facts), so waits stay short.
SETUP_TIMEOUT = datetime.timedelta(hours=6)  # far beyond any start-up; a real hang still ends


def setup_distributed(device="auto"):
    """Join torchrun's process group (nccl on CUDA, gloo on CPU); a no-op in a plain run."""
    global DIST
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1 or torch.distributed.is_initialized():
        return DIST
    DIST = Dist(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))
    cuda = torch.cuda.is_available() and not device.startswith(("cpu", "mps"))
    if cuda:
        torch.cuda.set_device(DIST.local_rank)

    def join():
        if cuda:
            torch.cuda.set_device(DIST.local_rank)  # the current device is the calling thread's
        torch.distributed.init_process_group("nccl" if cuda else "gloo")
        DIST.setup_group = torch.distributed.new_group(backend="gloo", timeout=SETUP_TIMEOUT)
    joined_off_the_main_thread(join)
    return DIST


def joined_off_the_main_thread(join):
    """Joining the group waits in C++ for every peer, up to 30 minutes, deaf to signals: where a peer had left
    (Ctrl-C in start-up, a rank that failed before joining) the process ignored Ctrl-C and torchrun's SIGTERM
    until torchrun killed it 30 s later, unsaid. On a thread, the main thread stays in Python, where a stop
    is handled (KeyboardInterrupt, said as for any stop in start-up; the thread is left to the process's end)."""
    failed = []

    def run():
        try:
            join()
        except BaseException as exc:  # noqa: BLE001 - raised again in the main thread
            failed.append(exc)
    thread = threading.Thread(target=run, name="unet-amp-join", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
    if failed:
        raise failed[0]


def cleanup_distributed():
    global DIST
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    DIST = Dist()


def gather_setup(obj):
    """Every rank's `obj`, in rank order ([obj] in a single process), during start-up (SETUP_TIMEOUT)."""
    if not DIST.enabled:
        return [obj]
    objs = [None] * DIST.world
    torch.distributed.all_gather_object(objs, obj, group=DIST.setup_group)
    return objs


def barrier():
    """Wait for every rank (start-up work of unequal length: on the setup group, SETUP_TIMEOUT)."""
    if DIST.enabled:
        torch.distributed.barrier(group=DIST.setup_group)


def all_reduce_(tensor, op="sum"):
    """In-place sum/min over ranks (no-op in a single process); returns the tensor."""
    if DIST.enabled:
        reduce_op = torch.distributed.ReduceOp.MIN if op == "min" else torch.distributed.ReduceOp.SUM
        torch.distributed.all_reduce(tensor, reduce_op)
    return tensor


def agree(flag):
    """A device bool every rank agrees on: true only where it is true on every rank (as is in one process)."""
    return all_reduce_(flag.to(torch.int32), "min").bool() if DIST.enabled else flag


def ddp_sync(model, sync):
    """Under DDP, no gradient all-reduce unless `sync` (the micro-step that ends a group)."""
    return model.no_sync() if hasattr(model, "no_sync") and not sync else contextlib.nullcontext()


def broadcast_buffers(model):
    if DIST.enabled:
        for buffer in model.buffers():
            torch.distributed.broadcast(buffer, src=0)


# ----------------------------------------------------------------------------------------------------
# III.3 Precision: what the hardware really supports, and the one decision made from it.
# ----------------------------------------------------------------------------------------------------
# What the CPU rules rest on, measured side by side (BENCHMARKS.md "Precision on a CPU": machines, dates,
# commands): fp16 autocast is CPU_FP16_SLOWDOWN slower than fp32, even on a CPU with AVX512-FP16; bf16
# where oneDNN emulates it is 2.3x slower on AVX512 without AVX512-BF16 and 33x on an AVX2-only Zen 3;
# native bf16 can still lose to fp32 (0.75-0.79x on a Xeon with AVX512-BF16), hence the CPU probe (III.4).
CPU_FP16_SLOWDOWN = "33-188x"


@dataclass(frozen=True)
class Hardware:
    device: str                   # "cpu", "cuda:0", "mps"
    kind: str                     # "cpu" | "cuda" | "mps"
    name: str
    capability: tuple | None      # CUDA compute capability, e.g. (8, 0)
    bf16: bool                    # native (fast) bf16 kernels
    fp16: bool                    # native (fast) fp16 kernels
    bf16_feature: str = ""        # what makes bf16 native here ("AVX512-BF16", ...), or why it is not


DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}  # short names
# CUDA compute capabilities: bf16 kernels and TF32 need Ampere (8.0); fast fp16 needs Volta's tensor cores (7.0).
AMPERE = (8, 0)
VOLTA = (7, 0)


def capability_text(cap):
    return f"{cap[0]}.{cap[1]}"


@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype            # autocast dtype; float32 means autocast off
    use_scaler: bool              # GradScaler: only for float16
    reason: str                   # why this precision
    warning: str | None = None    # set when the request could not be honoured

    def __post_init__(self):
        assert self.use_scaler == (self.dtype == torch.float16), self  # fp16, and only fp16, needs GradScaler

    @classmethod
    def of(cls, dtype, reason, warning=None):
        """Every precision this script uses is built here: GradScaler exactly when the dtype is fp16."""
        return cls(dtype, dtype == torch.float16, reason, warning)

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


HIDE_NATIVE_BF16_ENV = "UNET_HIDE_NATIVE_BF16"  # =1: treat the CPU as lacking native bf16 (tests)


def cpu_flags():
    """The CPU feature words of /proc/cpuinfo ('flags' on x86, 'Features' on arm64); empty elsewhere."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() in ("flags", "Features"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def cpu_bf16_feature():
    """(native, feature or reason). Native only with real bf16 instructions: AMX or AVX512-BF16 on x86,
    the BF16 extension on arm64. Not mkldnn._is_mkldnn_bf16_supported(): that is true on any AVX512 CPU
    (Skylake to Ice Lake), where oneDNN emulates bf16, slower than fp32 (measured: see this section's top)."""
    hide = os.environ.get(HIDE_NATIVE_BF16_ENV, "")
    if hide.strip().lower() not in ("", "0", "false", "no", "off"):  # =false hid it, and the banner said =1
        return False, f"native bf16 hidden by {HIDE_NATIVE_BF16_ENV}={hide}"
    probe = lambda name: bool(getattr(torch.cpu, name, lambda: False)())
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64", "i386", "i686"):
        if probe("_is_amx_tile_supported"):
            return True, "AMX"
        if probe("_is_avx512_bf16_supported"):
            return True, "AVX512-BF16"
        avx512 = probe("_is_avx512_supported")
        return False, "AVX512 without AVX512-BF16 or AMX" if avx512 else "no AVX512-BF16 or AMX (AVX2 at best)"
    if machine in ("aarch64", "arm64"):
        if "bf16" in cpu_flags() or macos_has_arm_bf16():
            return True, "ARM BF16"
        return False, "arm64 without the BF16 extension"
    return False, f"no known bf16 instructions on {machine or 'this CPU'}"


def macos_has_arm_bf16():
    if sys.platform != "darwin":
        return False
    import subprocess
    try:
        out = subprocess.run(["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True)
        return out.stdout.strip() == "1"
    except OSError:
        return False


def as_hardware(hw):
    """detect_hardware's Hardware for a library call's `hw`: itself, or from a device name or torch.device
    ("cpu", "auto", torch.device("cuda", 1)); anything else a one-line error, not an AttributeError inside."""
    if isinstance(hw, (str, torch.device)):
        return detect_hardware(str(hw))
    if not (hasattr(hw, "kind") and hasattr(hw, "device")):
        raise UserError(f"hw is {type(hw).__name__}: pass detect_hardware()'s result, or a device name such as 'cpu'")
    return hw


def detect_hardware(device="auto"):
    if not valid_device(device):  # a library call's device= is not validate_config's ("gpu": torch's traceback)
        raise UserError(f"device={device!r} is not supported: use auto, cpu, cuda, cuda:N or mps")
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
                        bf16=cap >= AMPERE, fp16=cap >= VOLTA,
                        bf16_feature=f"compute capability {capability_text(cap)}"
                        + (f" < {capability_text(AMPERE)}" if cap < AMPERE else ""))
    if kind == "mps":
        if not torch.backends.mps.is_available():
            raise UserError("device='mps' but MPS is not available: use device=auto or device=cpu")
        bf16 = bool(getattr(torch.backends.mps, "is_macos_or_newer", lambda *a: False)(14, 0))
        return Hardware("mps", "mps", "Apple MPS", None, bf16=bf16, fp16=True,
                        bf16_feature="macOS 14+" if bf16 else "needs macOS 14+")
    if kind != "cpu":
        raise UserError(f"device={device!r} is not supported: use auto, cpu, cuda, cuda:N or mps")
    # CPU fp16 autocast is never treated as native: CPU_FP16_SLOWDOWN slower than fp32, even on a CPU
    # that advertises avx512_fp16, because PyTorch's CPU convolutions have no fast fp16 path.
    bf16, feature = cpu_bf16_feature()
    return Hardware("cpu", "cpu", cpu_name(), None, bf16=bf16, fp16=False, bf16_feature=feature)


def describe(hw):
    cap = f", compute capability {capability_text(hw.capability)}" if hw.capability else ""
    return f"{hw.device} ({hw.name}{cap})"


def decide_precision(hw, use_amp=True, amp_dtype="auto", force=False):
    """The one place that chooses bf16 / fp16 / fp32, and says why. `hw`: detect_hardware's, or a device name."""
    hw = detect_hardware(str(hw)) if isinstance(hw, (str, torch.device)) else hw  # not as_hardware: stand-ins pass
    amp_dtype = check_precision_args(use_amp, amp_dtype, force)
    if not use_amp:
        return Precision.of(torch.float32, "use_amp=False: plain fp32")
    if amp_dtype == "auto":
        if hw.bf16:
            return Precision.of(torch.bfloat16, "auto: native bf16 (fp32's range, no loss scaling)")
        if hw.fp16:
            return Precision.of(torch.float16, "auto: no native bf16, native fp16 -> fp16 + GradScaler")
        return Precision.of(torch.float32, f"auto: no native bf16 ({hw.bf16_feature}) or fp16 -> fp32")
    dtype = torch.bfloat16 if amp_dtype == "bfloat16" else torch.float16
    native = hw.bf16 if dtype == torch.bfloat16 else hw.fp16
    if native or force:
        slow = f"{amp_dtype} {missing_support(hw, amp_dtype)}" if hw.kind == "cpu" else "no native kernels, slow"
        note = "" if native else f" (force_amp_dtype=True: {slow})"
        return Precision.of(dtype, f"{amp_dtype} as requested{note}")
    # Not native here: the automatic choice is the fallback (it can never be the requested dtype).
    auto = decide_precision(hw)
    return Precision.of(auto.dtype, f"fallback from {amp_dtype}", fallback_warning(hw, amp_dtype, auto))


def check_precision_args(use_amp, amp_dtype, force):
    """decide_precision's arguments, as validate_config checks them in a config (a library call passes them
    itself: use_amp="False", a string, is true, and chose bf16); returns amp_dtype's full name."""
    for key, value in (("use_amp", use_amp), ("force_amp_dtype", force)):
        if not isinstance(value, bool):
            raise UserError(f"{key}={value!r} must be true or false")
    amp_dtype = amp_dtype_name(amp_dtype)
    check_choice("amp_dtype", amp_dtype)
    return amp_dtype


def fallback_warning(hw, amp_dtype, used):
    return (f"amp_dtype={amp_dtype} {missing_support(hw, amp_dtype)}: using {_dtype_label(used)} instead "
            f"(force_amp_dtype=True insists)")


def missing_support(hw, amp_dtype):
    if hw.kind == "cuda":
        need = capability_text(AMPERE if amp_dtype == "bfloat16" else VOLTA)
        return f"needs compute capability >= {need}, {hw.device} has {capability_text(hw.capability)}"
    if hw.kind == "cpu" and amp_dtype == "float16":
        return (f"has no fast CPU kernels (fp16 autocast measured {CPU_FP16_SLOWDOWN} slower than fp32, even with "
                f"AVX512-FP16)")
    return f"is not native on {hw.device} ({hw.bf16_feature})" if amp_dtype == "bfloat16" and hw.bf16_feature \
        else f"is not native on {hw.device}"


def _dtype_label(p):
    return {"bf16": "bfloat16", "fp16": "float16 + GradScaler", "fp32": "float32"}[p.name]


def apply_tf32(setting, prec):
    """Apply tf32_matmul_precision; return a warning when it cannot matter for autocast ops (tf32_note).
    predict applies its checkpoint's: a run set to highest validates in strict fp32 (the benchmark's
    fp32 rows), and PyTorch's default TF32 convolutions on Ampere+ made use_amp=False's masks differ from those
    its val IoU scored."""
    if setting is None:
        return None
    torch.set_float32_matmul_precision(setting)
    torch.backends.cudnn.allow_tf32 = setting != "highest"
    return tf32_note(setting, prec)


def tf32_note(setting, prec, hw=None):
    """A warning when tf32_matmul_precision is set and cannot matter: on a GPU before Ampere, which has no TF32
    (it said 'it only changes fp32 matmuls/convolutions' while the banner said fp32 stays strict), or for
    autocast ops in `prec`. (On a CPU, 'medium' lets oneDNN run fp32 matmuls in bf16: it can matter there.)"""
    if setting is not None and hw is not None and hw.kind == "cuda" and hw.capability and hw.capability < AMPERE:
        return (f"tf32_matmul_precision={setting} changes nothing here: TF32 needs a CUDA GPU of compute "
                f"capability 8.0 or more")
    if setting is not None and prec.amp:
        return (f"tf32_matmul_precision={setting} has no effect on autocast ops (they run in "
                f"{prec.name}); it only changes fp32 matmuls/convolutions, e.g. fp32 validation")
    return None


# Pixels per batch (batch_size * image_size**2) from which NHWC beats NCHW on a CPU. Measured (short
# forward/backward/step loops, smp U-Net): NHWC lost at 64 px, batch 2 (8k px: 0.66x and worse) and
# won from 128 px, batch 8 (131k px) up, in fp32 (1.15x at 256 px, Zen 3) and bf16 (1.38x, Zen 4;
# 2.01x vs 1.77x over fp32 at 128 px, batch 8 on Zen 4). At 32k px (64 px x 8, 128 px x 2) short loops
# on Zen 4 were within noise (0.96-1.04x): the line sits there, where NHWC stops losing.
CPU_CHANNELS_LAST_MIN_PIXELS = 64 * 64 * 8


def decide_channels_last(cfg, hw, prec):
    """The one place that chooses the memory layout: (channels_last, why)."""
    setting = cfg["channels_last"]
    if setting is True or setting is False:
        return setting, f"channels_last={setting} as set"
    assert setting == "auto", setting  # validated before; a bug otherwise
    if hw.kind == "cuda":
        if prec.amp or (hw.capability and hw.capability >= AMPERE):
            cores = hw.capability and hw.capability >= VOLTA  # tensor cores: Volta on; Pascal has none
            what = "AMP" if prec.amp else "TF32" if fp32_math(hw) == "tf32" else "strict fp32 (TF32 off)"
            return True, (f"auto: {what} convolutions on tensor cores want NHWC" if cores and what != "strict fp32 "
                          "(TF32 off)" else f"auto: {what} convolutions on this GPU: NHWC by the rule, not measured")
        # A judgement call, not a measurement: cuDNN's fp32 kernels before Ampere are NCHW-first.
        # `make gpu-check` times fp32 NCHW vs NHWC (bare loop) on a GPU for the README.
        return False, "auto: fp32 without tensor cores gains nothing from NHWC"
    if hw.kind == "mps":
        return False, "auto: NHWC is not faster on MPS"
    pixels = cfg["batch_size"] * cfg["image_size"] ** 2
    if pixels >= CPU_CHANNELS_LAST_MIN_PIXELS:
        return True, f"auto: CPU convolutions are faster in NHWC at batch {cfg['batch_size']} x " \
                     f"{cfg['image_size']}px"
    return False, f"auto: batch {cfg['batch_size']} x {cfg['image_size']}px is too small for NHWC to pay " \
                  f"off on a CPU (from {CPU_CHANNELS_LAST_MIN_PIXELS} pixels per batch)"


def fp32_math(hw):
    """What plain fp32 convolutions/matmuls really run in here: 'tf32' or 'strict fp32'."""
    if hw.kind != "cuda" or not hw.capability or hw.capability < AMPERE:
        return "strict fp32"
    conv = torch.backends.cudnn.allow_tf32  # True by default: cuDNN runs fp32 convolutions in TF32
    matmul = torch.get_float32_matmul_precision() != "highest"
    return "tf32" if conv or matmul else "strict fp32"


def setup_cudnn(hw):
    """Input shapes are fixed (image_size): let cuDNN time its algorithms once and keep the fastest."""
    if hw.kind == "cuda":
        torch.backends.cudnn.benchmark = True


def banner(hw, prec, cfg, notes=(), layout=None):
    """The run's settings at a glance; `layout` = decide_channels_last's answer when cfg is resolved."""
    layout, why = layout or decide_channels_last(cfg, hw, prec)
    fp32 = fp32_math(hw)
    tf32_detail = (" (convolutions in TF32: cudnn.allow_tf32=True is PyTorch's default on Ampere+; "
                   "tf32_matmul_precision=highest makes fp32 strict)" if fp32 == "tf32" else "")
    lines = [
        f"device       {describe(hw)}  native bf16: {'yes' if hw.bf16 else 'no'} ({hw.bf16_feature}), "
        f"native fp16: {'yes' if hw.fp16 else 'no'}",
        f"precision    {prec.name} ({prec.reason}); GradScaler {'on' if prec.use_scaler else 'off'}",
        f"validation   {prec.name if cfg['eval_amp'] and prec.amp else 'fp32'}{tta_summary(cfg['tta'])}",
        f"fp32 means   {fp32}{tf32_detail}; tf32_matmul_precision "
        f"{cfg['tf32_matmul_precision'] or 'not set (PyTorch default)'}",
        f"layout       {'channels_last (NHWC)' if layout else 'contiguous (NCHW)'} ({why}); "
        f"compile {'on' if cfg['compile_model'] else 'off'}"
        + ("; cudnn.benchmark on (fixed input shapes)" if hw.kind == "cuda" else ""),
    ] + [f"{n[0]:<12} {n[1]}" if isinstance(n, tuple) else f"note         {n}" for n in notes if n]
    rule = "=" * 78
    return "\n".join([rule, "unet-amp", *lines, rule])


# ----------------------------------------------------------------------------------------------------
# III.4 CPU probe: a few timed steps confirm the feature-flag rule on a CPU, cached per machine and setting.
# On a CPU, "native bf16" by feature flag does not mean faster (an AVX512-BF16 Xeon ran bf16 0.7x fp32),
# so amp_dtype="auto" and channels_last="auto" are confirmed by timed steps of the run's own model,
# image size and batch. The timing machinery (bare steps, alternating rounds) is shared with the benchmark.
# ----------------------------------------------------------------------------------------------------
# bf16 is kept only if its fastest layout beats fp32's by this factor: fp32 is the safer mode (no
# autocast rounding), so a gain within the probe's noise is not worth it. Noise measured on a shared
# 2-core Xeon (BENCHMARKS.md "The CPU probe"): the same mode probed 4 times differed by up to 7% (fp32 0.332-0.355
# s/step at the default run), the bf16/fp32 ratio by 4%; 1.15x is twice the worst spread.
CPU_PROBE_BF16_MARGIN = 1.15

# The other layout replaces the flag rule's only when faster by more than that noise (a layout carries
# no numerical risk, so the bar is the noise alone).
CPU_PROBE_LAYOUT_MARGIN = 1.08

# Timed steps per mode, after one untimed warm-up step each, in alternating rounds (alternate_timings;
# the median of 3 shrugs off one disturbed step): 7 s, ~5% of the default run on 2 cores (BENCHMARKS.md).
CPU_PROBE_ROUNDS = 3

CPU_PROBE_MODES = {"fp32": ("fp32", False), "fp32_cl": ("fp32", True),   # label: (precision, NHWC),
                   "bf16": ("bf16", False), "bf16_cl": ("bf16", True)}   # the benchmark's labels

# A probe during which other processes used more than this share of this process's cores is used for
# its run and not cached: a compile or a second training beside it can flip bf16/fp32 (both modes run
# under the load, but it comes and goes between rounds), and a cached answer would outlive the load.
# Measured on a 2-core EPYC (BENCHMARKS.md "The CPU probe"): 0.5-0.6 % quiet, 37 % beside one busy process.
CPU_PROBE_BUSY_SHARE = 0.25


CPU_PROBE_VERSION = 1  # of the cache file's layout; another version's file is ignored

CPU_PROBE_SETTING = ("arch", "encoder_name", "image_size", "batch_size", "in_channels", "num_classes")


def cpu_probe_decision(cfg, hw, prec, notes, kind="train", job_forwards=None):
    """(precision, (channels_last, why)) for a resolved cfg (a number for batch_size): the flag rule's
    (decide_precision, decide_channels_last), confirmed on a CPU by the probe where cpu_probe is on.
    job_forwards: the job's forwards (predict) or training steps (train): a probe longer than the job is
    skipped."""
    rule_layout = decide_channels_last(cfg, hw, prec)
    probe_prec, probe_layout = cpu_probe_dimensions(cfg, hw, prec)
    if not (probe_prec or probe_layout):
        return prec, rule_layout
    labels = probe_labels(prec, rule_layout[0], probe_prec, probe_layout)
    decides = lambda t: modes_key(choose_cpu_modes(t, prec, rule_layout, probe_prec, probe_layout))  # noqa: E731
    times, how = cpu_probe_times(cfg, hw, kind, labels, job_forwards, decides)
    if times is None:
        notes.append(("probe", how))
        return prec, rule_layout
    chosen, layout = choose_cpu_modes(times, prec, rule_layout, probe_prec, probe_layout)
    per_step = ", ".join(f"{mode_label(label)} {times[label]:.3f}" for label in labels)
    notes.append(("probe", f"s/{'step' if kind == 'train' else 'forward'} at batch {cfg['batch_size']} x "
                           f"{cfg['image_size']}px: {per_step}; {how}"))
    if prec.warning and chosen is not prec:  # a fallback from a dtype not native here: say what is used
        chosen = Precision.of(chosen.dtype, chosen.reason, fallback_warning(hw, cfg["amp_dtype"], chosen))
    return chosen, layout


def modes_key(modes):
    """What a probe decided, comparable: (precision name, channels_last) of choose_cpu_modes' answer."""
    prec, (nhwc, _) = modes
    return prec.name, nhwc


def mode_label(label):
    name, nhwc = CPU_PROBE_MODES[label]
    return name + (" + NHWC" if nhwc else "")


def cpu_probe_cache_path():
    """$XDG_CACHE_HOME/unet-amp/cpu_probe.json (~/.cache/... without it, or where it is relative, which
    the XDG spec says to ignore): per user, shared by runs. None where there is no home folder either (a
    container user without $HOME or a passwd entry): the probe then runs without a cache."""
    root = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(root):
        try:
            home = Path.home()
        except (RuntimeError, KeyError):
            return None
        if not home.is_absolute():
            return None
        root = home / ".cache"
    return Path(root) / "unet-amp" / "cpu_probe.json"


def cpu_probe_key(cfg, hw, kind):
    """What a probe's answer depends on. hw.bf16 is in it (UNET_HIDE_NATIVE_BF16=1 hides the bf16
    modes), and the torch version: after an upgrade the old entry is not used (and dropped on save)."""
    flags = " ".join(sorted(cpu_flags()))
    setting = {"kind": kind, "cpu": cpu_name(), "flags": flags, "machine": platform.machine(),
               "torch": torch.__version__, "threads": torch.get_num_threads(), "bf16": hw.bf16,
               **{k: cfg[k] for k in CPU_PROBE_SETTING}}
    return json.dumps(setting, sort_keys=True)


def usable_seconds(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


def usable_probe_entry(entry):
    """The entry with only its usable times (a positive number for a known mode), or None where it is not
    one this torch wrote in save_cpu_probe_entry's shape (another torch version: stale; a hand edit,
    another tool): what is not usable is measured anew, never a crash."""
    shaped = (isinstance(entry, dict) and entry.get("torch") == torch.__version__
              and isinstance(entry.get("times"), dict) and isinstance(entry.get("date"), str)
              and usable_seconds(entry.get("seconds")))
    if not shaped:
        return None
    if entry.get("busy") not in (None, True):
        return None
    return {**entry, "times": {k: t for k, t in entry["times"].items() if k in CPU_PROBE_MODES and usable_seconds(t)}}


def load_cpu_probe_cache(path):
    """{key: usable entry}; an unreadable, corrupt or other-version file reads as empty (the probe reruns)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: deeply nested JSON
        return {}
    ok = isinstance(data, dict) and data.get("version") == CPU_PROBE_VERSION and isinstance(data.get("entries"), dict)
    entries = {key: usable_probe_entry(entry) for key, entry in data["entries"].items()} if ok else {}
    return {key: entry for key, entry in entries.items() if entry is not None}


def save_cpu_probe_entry(path, key, entry):
    """Add an entry, dropping those load_cpu_probe_cache does not use (stale); returns None or why it was
    not saved: an unwritable cache costs a probe next time, never the run."""
    if path is None:
        return "not cached: no home folder for ~/.cache ($HOME unset, no passwd entry) and no absolute XDG_CACHE_HOME"
    entries = {**load_cpu_probe_cache(path), key: entry}
    text = json.dumps({"version": CPU_PROBE_VERSION, "entries": entries}, indent=1)
    try:
        atomic_write(path, lambda tmp: Path(tmp).write_text(text))
    except OSError as exc:
        return f"not cached: {path}: {exc.strerror or exc}"
    return None


def measure_cpu_modes(cfg, hw, labels, kind):
    """Seconds per step of each mode in `labels` ("train": bare training steps; "predict": inference
    forwards), on random data, timed side by side in alternating rounds after one warm-up step each;
    one fresh model per layout (autocast does not change it). The global RNG is left as it was: a probed
    run trains like one answered from the cache."""
    make = bare_step_runners if kind == "train" else bare_inference_runners
    with torch.random.fork_rng(devices=[]):
        runs = {}
        for nhwc in dict.fromkeys(CPU_PROBE_MODES[label][1] for label in labels):
            mine = [label for label in labels if CPU_PROBE_MODES[label][1] == nhwc]
            steps = make(cfg, hw, [DTYPES[CPU_PROBE_MODES[label][0]] for label in mine], nhwc)
            runs.update({label: steps[DTYPES[CPU_PROBE_MODES[label][0]]] for label in mine})
        times = alternate_timings({label: runs[label] for label in labels}, CPU_PROBE_ROUNDS, hw)
    return {label: float(np.median(t)) for label, t in times.items()}


def cpu_probe_times(cfg, hw, kind, labels, job_forwards=None, decides=None):
    """(seconds per step of each mode in `labels` or None, what the banner says about it). Under torchrun
    rank 0 answers (probe_times_here) and the other ranks use its answer. decides(times): what times
    decide (modes_key), to compare two probes on a busy machine (busy_probe_note)."""
    here = probe_times_here(cfg, hw, kind, labels, job_forwards, decides) if DIST.is_main else None
    return gather_setup(here)[0]


def probe_times_here(cfg, hw, kind, labels, job_forwards, decides):
    """The times of `labels`: from the cache where it holds all of them, else all measured again, side by
    side, and the entry replaced by them (never merged: a ratio of times taken in different runs would
    carry those runs' different loads). A job of fewer forwards than the probe (job_forwards: predict)
    is not worth probing: None, the flag rule."""
    path, key = cpu_probe_cache_path(), cpu_probe_key(cfg, hw, kind)
    entry = load_cpu_probe_cache(path).get(key) if path else None
    cached = entry["times"] if entry and not entry.get("busy") else {}
    if all(label in cached for label in labels):
        return ({label: cached[label] for label in labels},
                f"from {path} (measured {entry['date']} in {entry['seconds']:.1f}s; delete it to measure again)")
    cost = len(labels) * (1 + CPU_PROBE_ROUNDS)
    if job_forwards is not None and job_forwards < cost:
        unit = "training step(s)" if kind == "train" else "forward(s)"
        return None, (f"skipped: this job is {job_forwards} {unit}, the probe {cost}; the flag rule (a job of at "
                      f"least {cost} {unit} at this batch measures it, cached for later ones)")
    unit = "training steps" if kind == "train" else "forwards"
    print(f"probe: timing {len(labels)} modes on this CPU, {cost} {unit} (seconds to a minute; cached for later "
          f"runs)...", flush=True)  # the banner, which says what it found, comes after it
    measured, seconds, busy = timed_beside_others(lambda: measure_cpu_modes(cfg, hw, labels, kind))
    times = {label: measured[label] for label in labels}
    record = {"torch": torch.__version__, "times": times, "rounds": CPU_PROBE_ROUNDS, "seconds": seconds,
              "date": datetime.date.today().isoformat()}
    busy_note, agreed = busy_probe_note(busy, entry, times, decides)
    if busy_note and path:  # kept apart (never used as an answer) for the next busy probe to compare
        save_cpu_probe_entry(path, key, {**record, "busy": True})
    unsaved = busy_note or save_cpu_probe_entry(path, key, record)
    how = (f"measured in {seconds:.1f}s ({len(labels)} modes x {CPU_PROBE_ROUNDS} "
           f"{'training steps' if kind == 'train' else 'forwards'} + 1 warm-up), "
           + (unsaved or f"cached in {path}" + agreed))
    return times, how


def busy_probe_note(busy, earlier, times, decides):
    """(why a probe is not cached, or None; what the banner adds where it is). Not cached where other
    processes were busy on this process's cores, unless the previous probe of the setting, also beside
    busy processes, decided the same: a load that comes and goes flips answers, a steady one does not."""
    if busy is None or busy[0] <= CPU_PROBE_BUSY_SHARE:
        return None, ""
    share = f"other processes used {busy[0]:.0%} of this process's {busy[1]} core(s)"
    before = earlier["times"] if earlier and earlier.get("busy") else {}
    if decides and all(label in before for label in times) and decides(before) == decides(times):
        return None, f" ({share}, as in the previous probe, which decided the same)"
    return (f"not cached: {share} meanwhile (a run on a quieter machine measures it again and caches it, as "
            f"does a second probe beside busy processes that decides the same)"), ""


def timed_beside_others(run):
    """(run(), its seconds, (the share of this process's cores that other processes used meanwhile, those
    cores) or None where not known: no /proc/stat (not Linux), or a run under half a second, too short
    for its 10 ms ticks). Steal time counts as others': a shared VM's neighbours take it. Under a CPU
    quota of q cores on n, only what others used beyond n - q cores counts, as a share of q."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    busy, own, start = cpu_busy_seconds(cpus), time.process_time(), time.perf_counter()
    result = run()
    seconds, busy_after = time.perf_counter() - start, cpu_busy_seconds(cpus)
    if busy is None or busy_after is None or seconds < 0.5:
        return result, seconds, None
    others = (busy_after - busy) - (time.process_time() - own)  # this process's threads share its cores
    # Under a CPU quota this process uses `share` of its cores' time: others may use the rest unfelt.
    share = min(float(len(cpus)), cpu_quota())
    felt = max(others / seconds - (len(cpus) - share), 0.0)
    return result, seconds, (felt / share, math.ceil(share))


def cpu_busy_seconds(cpus):
    """Seconds the CPUs numbered `cpus` have spent busy since boot, every process's time and steal time
    included (/proc/stat: all but idle and iowait); None where unreadable or a CPU is not listed."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    ticks = {}
    for line in lines:
        name, *fields = line.split()
        if name[:3] == "cpu" and name[3:].isdigit() and len(fields) >= 8:
            user, nice, system, idle, iowait, irq, softirq, steal = map(int, fields[:8])
            ticks[int(name[3:])] = user + nice + system + irq + softirq + steal
    if not cpus or any(cpu not in ticks for cpu in cpus):
        return None
    return sum(ticks[cpu] for cpu in cpus) / os.sysconf("SC_CLK_TCK")


def autos_precision(cfg, hw, prec):
    """Whether `prec` is amp_dtype="auto"'s choice: auto itself, or decide_precision's fallback from a
    dtype not native here (float16 on a CPU falls back to auto's); not a dtype as set, nor a resumed
    run's safer precision (keep_safer_precision)."""
    decided = decide_precision(hw, cfg["use_amp"], cfg["amp_dtype"], cfg["force_amp_dtype"])
    requested = {"bfloat16": torch.bfloat16, "float16": torch.float16}.get(cfg["amp_dtype"])
    return cfg["use_amp"] and prec == decided and prec.dtype == decide_precision(hw).dtype and prec.dtype != requested


def cpu_probe_dimensions(cfg, hw, prec):
    """(probe the precision, probe the layout): only on a CPU with cpu_probe on, for what is "auto".
    The precision only where auto's choice is bf16 (a CPU without native bf16 never probes it; a
    resumed run that fell back keeps its safer precision)."""
    if hw.kind != "cpu" or not cfg["cpu_probe"]:
        return False, False
    auto_bf16 = autos_precision(cfg, hw, prec) and prec.name == "bf16" and hw.bf16
    measured = prec.name == "fp32" or (prec.name == "bf16" and hw.bf16)  # forced fp16/emulated bf16: not probed
    return bool(auto_bf16), cfg["channels_last"] == "auto" and measured


def probe_labels(prec, rule_nhwc, probe_prec, probe_layout):
    """The modes the decision compares, no more: both precisions where the precision is probed (else the
    one in use), each in both layouts where the layout is probed (else the flag rule's)."""
    names = ("fp32", "bf16") if probe_prec else (prec.name,)
    layouts = (False, True) if probe_layout else (rule_nhwc,)
    return [label for label, (name, nhwc) in CPU_PROBE_MODES.items() if name in names and nhwc in layouts]


def faster_layout(times, name, rule_nhwc):
    """(NHWC?, ratio of the chosen layout's speed over the other's) in precision `name`: the flag rule's
    layout unless the other was faster by CPU_PROBE_LAYOUT_MARGIN."""
    rule, other = (f"{name}_cl", name) if rule_nhwc else (name, f"{name}_cl")
    flip = times[rule] / times[other] >= CPU_PROBE_LAYOUT_MARGIN
    chosen, rejected = (other, rule) if flip else (rule, other)
    return chosen.endswith("_cl"), times[rejected] / times[chosen]


def choose_cpu_modes(times, prec, rule_layout, probe_prec, probe_layout):
    """(Precision, (channels_last, why)) from the probe's seconds per step: bf16 only if its fastest
    probed layout beats fp32's by CPU_PROBE_BF16_MARGIN; the layout as faster_layout says."""
    nhwc = {}
    for name in ("fp32", "bf16") if probe_prec else (prec.name,):
        nhwc[name], _ = faster_layout(times, name, rule_layout[0]) if probe_layout else (rule_layout[0], 1.0)
    if probe_prec:
        t = {name: times[f"{name}_cl" if on else name] for name, on in nhwc.items()}
        ratio = t["fp32"] / t["bf16"]
        keep = ratio >= CPU_PROBE_BF16_MARGIN
        # each in the layout it would train in: where those differ, the probe line's same-layout times gave
        # another ratio (fp32 0.223, + NHWC 0.239, bf16 0.169: '1.41x' beside 1.32x), unsaid
        lay = {n: f" ({'NHWC' if on else 'NCHW'})" for n, on in nhwc.items()} if len(set(nhwc.values())) > 1 \
            else {"fp32": "", "bf16": ""}
        prec = Precision.of(torch.bfloat16 if keep else torch.float32,
                            f"auto: bf16{lay['bf16']} measured {ratio:.2f}x fp32{lay['fp32']} here; "
                            f"{'kept' if keep else 'not kept'}: needs {CPU_PROBE_BF16_MARGIN:.2f}x")
    if not probe_layout:
        return prec, rule_layout
    on, ratio = faster_layout(times, prec.name, rule_layout[0])
    why = f"auto: {'NHWC' if on else 'NCHW'} measured {ratio:.2f}x {'NCHW' if on else 'NHWC'} in {prec.name} here"
    if ratio < 1:  # the slower one, within the noise: 'NHWC measured 0.98x NCHW' read as a contradiction
        why += (f"; kept: the rule of thumb's layout, unless the other measures {CPU_PROBE_LAYOUT_MARGIN:.2f}x "
                f"or faster")
    return prec, (on, why + ("" if on == rule_layout[0] else " (the rule of thumb said otherwise)"))


def alternate_timings(runs, rounds, hw):
    """{name: seconds per round} for each function in `runs`, called in turn every round after one
    untimed round (first passes are slower); the order flips each round (A B C, C B A, A B C, ...), so
    A and B run next to each other every round, and neither always first."""
    names, times = list(runs), {name: [] for name in runs}
    for name in names:
        runs[name]()
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            synchronize(hw)
            start = time.perf_counter()
            runs[name]()
            synchronize(hw)
            times[name].append(time.perf_counter() - start)
    return times


def synchronize(hw):
    if hw.kind == "cuda":
        torch.cuda.synchronize(hw.device)


def bare_step_runners(base, hw, dtypes, channels_last):
    """{dtype: bare_step_runner's function} for each of `dtypes`, all on one fresh model, optimizer and
    batch: autocast does not change the model, so one per layout is enough (half the probe's memory)."""
    torch.manual_seed(0)
    model = build_model({**base, "encoder_weights": None}).to(hw.device)
    x, y = random_batch(base, hw)
    if channels_last:
        model, x = model.to(memory_format=torch.channels_last), x.contiguous(memory_format=torch.channels_last)
    # The same bare step as tools/overhead.py's (clipping, the run's optimizer); no GradScaler: fp32/bf16
    opt, loss_fn = build_optimizer(model, base), SegLoss(base["num_classes"])

    def runner(prec):
        return lambda: bare_training_step(model, [(x, y)], loss_fn, opt, None, prec, hw, base["grad_clip_norm"])
    return {dtype: runner(Precision.of(dtype, "bare loop")) for dtype in dtypes}


def bare_inference_runners(base, hw, dtypes, channels_last):
    """{dtype: a function that runs one inference forward (eval_forward, as predict)} of one fresh model
    in eval mode on a random batch at base's batch and image size, in that dtype's autocast and the
    given layout (one model for all dtypes, as bare_step_runners)."""
    torch.manual_seed(0)
    model = build_model({**base, "encoder_weights": None}).to(hw.device).eval()
    model = model.to(memory_format=torch.channels_last) if channels_last else model
    x, _ = random_batch(base, hw)
    layout = {"channels_last": channels_last, "tta": "none"}  # base's batch is a forward's, views included

    def runner(prec):
        def forward():
            with torch.inference_mode():
                eval_forward(model, x, layout, prec, hw)
        return forward
    return {dtype: runner(Precision.of(dtype, "bare loop")) for dtype in dtypes}


def random_batch(base, hw):
    """A random (images, class indices) batch at base's batch size, image size and channels."""
    x = torch.randn(base["batch_size"], base["in_channels"], base["image_size"], base["image_size"],
                    device=hw.device)
    y = (torch.rand(base["batch_size"], base["image_size"], base["image_size"], device=hw.device)
         * max(2, base["num_classes"])).long().clamp(max=max(1, base["num_classes"] - 1))
    return x, y


def bare_training_step(model, micro_batches, loss_fn, optimizer, scaler, prec, hw, clip):
    """What a minimal PyTorch loop does per optimizer step over its (x, y) micro-batches: forward
    under autocast, backward (scaled under fp16), clip, step, zero the gradients. The reference for
    the trainer's overhead."""
    for x, y in micro_batches:
        with torch.autocast(hw.kind, dtype=prec.dtype, enabled=prec.amp):
            logits = model(x)
        loss = loss_fn(logits, y) / len(micro_batches)
        (scaler.scale(loss) if scaler is not None else loss).backward()
    if scaler is not None:
        scaler.unscale_(optimizer)
    if clip is not None:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    if scaler is not None:
        scaler.step(optimizer)
        scaler.update()
    else:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------------------------------
# III.5 Data: the embedded shapes data set, the folder layout, checks with clear errors, loaders.
# ----------------------------------------------------------------------------------------------------
IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")

EMBEDDED_DATA_DIR = "data/shapes"


def prepare_data(cfg):
    """Return (train_pairs, val_pairs); generate the embedded data set on first use. For library callers
    (notebooks, tools): their config's values are checked as a training run's are."""
    return data_pairs(validate_config(check_config_dict(cfg), model_names=False))


def data_pairs(cfg):
    """prepare_data for a config training or the benchmark has already checked (and adapted: batch_size=auto
    is checked with batch 1, which validate_config would refuse at some image sizes): the pairs found and
    split (listed_pairs), then checked (checked_pairs). Training runs the two itself, a resume's check between."""
    return checked_pairs(*listed_pairs(cfg), cfg)


def listed_pairs(cfg):
    """data_pairs' (train, val) pairs as found and split, with the notes on how the folder is laid out."""
    root = Path(cfg["data_dir"])
    if DIST.is_main and root == Path(EMBEDDED_DATA_DIR) and not has_files(root):
        print(f"no data in {root}: writing the embedded shapes data set there (300 PNG pairs)")
        write_embedded_dataset(root)
    barrier()  # the other ranks wait until rank 0 has written it
    train, val = said_once_where_alike(split_pairs, cfg)  # data_dir not found: said once, not by each process
    unread = unread_entries(root)
    if unread and DIST.is_main:
        print(f"note: {len(unread)} entr{'y' if len(unread) == 1 else 'ies'} in {root} not read (e.g. "
              f"{', '.join(unread[:3])}): only {', '.join(IMAGE_EXTS)} files directly in images/ and masks/ are used, "
              f"and none whose name starts with '.'")
    for note in (pairs_in_both(train, val, root), pairs_beside_the_split(root), half_a_split_note(root)):
        if note and DIST.is_main:
            print(note)
    return train, val


def checked_pairs(train, val, cfg):
    """The data check of data_pairs (check_pairs), its notes on what the masks hold, the samples counted."""
    check_pairs(train + val, cfg)
    for note in (nothing_to_score(val, cfg), classes_only_in_val(train, val, cfg), patches_of_padding(train, val, cfg)):
        if note and DIST.is_main:
            print(note)
    said_once_where_alike(check_enough_samples, train, cfg)
    return train, val


def half_a_split_note(root):
    """data_dir=d/split/train, its val/ beside it: validation was cut from the training images by val_fraction,
    and the user's val/ left unread, unsaid. A note, not a refusal: a run may hold val/ out on purpose, and
    runs begun so resume."""
    other = {"train": "val", "val": "train"}.get(root.name)
    if other is None or (root / "train").is_dir() or not (root.parent / other / "images").is_dir():
        return None
    return (f"note: data_dir={root} is the {root.name}/ part of a split: validation is cut from its images by "
            f"val_fraction, and {root.parent / other}/ is not read; to train on train/ and validate on val/, give "
            f"data_dir={cli_value(root.parent)}")


# Patches an epoch may hold: the samplers shuffle with torch.randperm(n).tolist(), about 46 bytes a patch
# as Python ints (10**7: 460 MB measured), and at 1,000 patches/s such an epoch lasts 2.8 hours.
# patches_per_image=10**9 asked randperm for 80 GB, a traceback from torch.
MAX_EPOCH_SAMPLES = 10**7


def check_enough_samples(train, cfg):
    """A batch_size each process can fill from its share of the training set, else the fix: fewer
    processes, where a resume keeps its batch_size; and no more than MAX_EPOCH_SAMPLES patches."""
    samples = training_samples(train, cfg)
    if samples > MAX_EPOCH_SAMPLES:
        given = (f"patches_per_image={cfg['patches_per_image']}" if cfg["patches_per_image"] else
                 f"tiling each image once at image_size={cfg['image_size']}")
        raise UserError(f"{given} makes {samples:,} patches per epoch from {len(train)} image(s), more than "
                        f"{MAX_EPOCH_SAMPLES:,}: set patches_per_image={MAX_EPOCH_SAMPLES // len(train)} or less")
    if samples // DIST.world < cfg["batch_size"]:
        what = f"{len(train)} image(s)" if cfg["data_mode"] == "fit" else \
            f"{samples} patch(es) per epoch from {len(train)} image(s)"
        per = f" ({samples // DIST.world} per process)" if DIST.enabled else ""
        more = "add images" if cfg["data_mode"] == "fit" else "raise patches_per_image"
        fix = f"lower batch_size or {more}"
        fits = samples // DIST.world  # the largest batch each process fills
        if fits == 1 and cfg["image_size"] < 2 * MODEL_STRIDE:  # batch_size=1 is refused at this size (value_rules)
            fix = f"give batch_size=1 image_size={2 * MODEL_STRIDE}, or {more}"
        if cfg["batch_size"] == 1 and DIST.enabled and samples:  # not one each: batch_size cannot go lower
            fix = f"run on at most {samples} process(es), or {more}"
        if cfg["resume"]:  # a resume keeps batch_size and patches_per_image (changed_resume_keys)
            fewer = samples // cfg["batch_size"]
            fix = (f"resume on at most {fewer} process(es) (batch_size is the run's)" if DIST.enabled and fewer else
                   "the run trained on more: were files removed from data_dir? put them back, or start a new run")
        raise UserError(f"the training set has {what}{per}, fewer than batch_size={cfg['batch_size']}: {fix}")


def split_pairs(cfg):
    """(train_pairs, val_pairs) of data_dir: its train/ and val/ folders, else a seeded val_fraction
    split; the first max_train_images of train. Files are matched, not read (export finds the val
    images here too)."""
    root = Path(cfg["data_dir"])
    if root.exists() and not root.is_dir():
        raise UserError(f"data_dir {root} is a file: give the folder that holds images/ and masks/ (or train/ "
                        f"and val/)")
    if not root.is_dir():
        raise UserError(f"data_dir {root} not found: create {root}/images and {root}/masks, or use "
                        f"data_dir={EMBEDDED_DATA_DIR} for the embedded data set")
    split = [(root / name).is_dir() for name in ("train", "val")]
    misnamed = misnamed_split(root, split)
    if misnamed:
        raise UserError(misnamed)
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
        if len(pairs) < 2:
            raise UserError(f"{root} has only {len(pairs)} image(s): need at least 2 to split train/val")
        if len(pairs) - n_val < 1:
            raise UserError(f"val_fraction={cfg['val_fraction']:g} of {root}'s {len(pairs)} images leaves none to "
                            f"train on: {largest_val_fraction(len(pairs), cfg)}")
        val = [pairs[i] for i in sorted(order[:n_val])]
        train = [pairs[i] for i in sorted(order[n_val:])]
    train = train[:cfg["max_train_images"]]
    return train, val


# The split's folders as data sets name them otherwise (compared in lower case): Val/, validation/, Training/.
SPLIT_FOLDER_NAMES = {"train": ("train", "training"), "val": ("val", "valid", "validation")}


def misnamed_split(root, split):
    """Where data_dir lacks train/ or val/ but has it named otherwise (Val/, validation/), beside the other or
    both so named with no images/ of data_dir's own, the error that says which to rename, else None: "no val/"
    or "images/ not found" hid that the folder was there."""
    if all(split) or (not any(split) and (root / "images").is_dir()):
        return None
    try:
        entries = sorted(root.iterdir())
    except OSError:  # entered but not listed (mode 711): the usual messages say what is missing
        return None
    found = {name: next((p.name for p in entries if p.is_dir() and p.name.lower() in names), None)
             for name, names in SPLIT_FOLDER_NAMES.items()}
    wrong = [(found[name], name) for name, there in zip(("train", "val"), split) if not there]
    if not all(was for was, _ in wrong) or not wrong:
        return None
    have = [f"{name}/" for name, there in zip(("train", "val"), split) if there] + [f"{was}/" for was, _ in wrong]
    return (f"{root} has {' and '.join(have)}, but the split's folders are named train/ and val/: rename "
            f"{' and '.join(f'{was}/ to {name}/' for was, name in wrong)}")


def largest_val_fraction(count, cfg):
    """The fix for a val_fraction that leaves no training image: the largest (two decimals) that leaves a
    batch of them in fit mode, so the advice does not run into the batch_size check next (patch mode's
    batches are of patches: one image is enough), and a smaller batch_size where the set is too small."""
    need = cfg["batch_size"] if cfg["data_mode"] == "fit" and isinstance(cfg["batch_size"], int) else 1
    keep = min(need, count - 1)
    most = math.floor(100 * (count - keep) / count) / 100  # two decimals that leave `keep`
    smaller = f", with batch_size={keep} or less" if keep < need else ""
    return f"use val_fraction={most:g} or less (e.g. 0.2){smaller}"


def held_values(pairs):
    """The values the pairs' masks hold, together, from this start-up's data check (CHECKED_HERE)."""
    return set().union(*(CHECKED_HERE[os.path.abspath(mask)]["values"] for _, mask in pairs))


def classes_only_in_val(train, val, cfg):
    """A note where validation masks hold a class no training mask holds: the model cannot learn it, and
    val_iou averages its IoU, 0 unless the model predicts it by chance. From the data check's facts."""
    if cfg["num_classes"] < 2 or not val:
        return None
    only = sorted(held_values(val) - held_values(train) - {IGNORE_INDEX})
    if not only:
        return None
    fix = ("move images holding them into train/" if (Path(cfg["data_dir"]) / "val").is_dir() else
           "change seed or val_fraction, or add images holding them")
    if cfg["max_train_images"] is not None:  # it may have cut them away (preset=debug keeps 8)
        fix = f"raise max_train_images (now {cfg['max_train_images']}), or {fix}"
    return (f"note: class(es) {', '.join(map(str, only))} appear in validation masks but in no training mask: the "
            f"model cannot learn them, and val_iou averages their IoU, 0 unless predicted by chance; {fix}")


def nothing_to_score(val, cfg):
    """A note where no validation mask holds anything to find, so the val IoU (SegMetric) cannot rank models and
    best.pt and early stopping follow noise: binary masks with no foreground (1.0 while the model predicts
    nothing, 0 once it predicts anything), class masks with none above 0 (background's IoU, averaged with 0
    for each other class predicted), or all void (1.0 whatever is predicted). From the data check's facts."""
    if not val:
        return None
    values = held_values(val)
    binary = cfg["num_classes"] == 1
    if values - {0, IGNORE_INDEX} or (binary and IGNORE_INDEX in values):
        return None
    if binary:
        what = ("none holds foreground: val IoU will be 1.0 while the model predicts nothing there and 0 once it "
                "predicts anything")
    elif 0 in values:
        what = ("none holds a class above 0 (background): val_iou will be background's IoU, averaged with 0 for "
                "each other class the model predicts there")
    else:
        what = f"all their pixels are void ({IGNORE_INDEX}): val_iou will be 1.0 whatever the model predicts"
    thing = "foreground" if binary else "classes above 0"
    fix = (f"move images with {thing} into val/" if (Path(cfg["data_dir"]) / "val").is_dir() else
           "change seed or raise val_fraction")
    return (f"note: of the {len(val)} validation mask(s), {what}, so best.pt and early stopping follow that, not "
            f"the model's quality; {fix}")


def pairs_beside_the_split(root):
    """A note where data_dir has train/ and val/ and also images/ or masks/ with files in them: the split
    is train/ and val/, so those files are not read (a silent loss of data). Else None."""
    if not ((root / "train").is_dir() and (root / "val").is_dir()):
        return None
    extra = {f"{sub}/": image_file_count(root / sub) for sub in ("images", "masks") if (root / sub).is_dir()}
    extra = {name: n for name, n in extra.items() if n}
    if not extra:
        return None
    counts = " and ".join(f"{n} file(s) in {name}" for name, n in extra.items())
    return f"note: {root} has train/ and val/, so the {counts} beside them are not read: move those pairs into " \
           f"train/ or val/ to use them"


def pairs_in_both(train, val, root):
    """A note where a pair was copied into both train/ and val/ (same name; image and mask the same bytes):
    validated after training on it, it flatters the val IoU. A note, not an error: tiled data sets can hold
    byte-identical blank tiles of the same name in both. Only names in both are compared. Else None."""
    import filecmp

    same = lambda a, b: filecmp.cmp(a, b, shallow=False)  # noqa: E731
    train_pairs = {Path(image).stem: (image, mask) for image, mask in train}
    both = [Path(image).stem for image, mask in val if Path(image).stem in train_pairs
            and all(map(same, train_pairs[Path(image).stem], (image, mask)))]
    if not both:
        return None
    return (f"note: {len(both)} image(s) in both {root}/train and {root}/val with the same mask (e.g. {both[0]}): "
            f"validating on images the model trains on flatters its val IoU; remove them from one of the two")


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
    """Any file but our own data-check cache (which alone does not make a data set)."""
    return Path(folder).exists() and any(p.is_file() and p.name != CHECK_CACHE_NAME
                                         for p in Path(folder).rglob("*"))


def write_embedded_dataset(root):
    """Write into a temporary folder, then rename: an interrupted first run leaves no half data set.

    Only ever called for a missing or empty folder: a user's files are never mixed or deleted.
    """
    root = Path(root)
    tmp = root.with_name(f".{root.name}.tmp{os.getpid()}")
    for stale in root.parent.glob(f".{root.name}.tmp*"):  # a killed first run's (Ctrl-C's is removed below)
        pid = stale.name[len(f".{root.name}.tmp"):]
        if pid.isdigit() and not process_alive(int(pid)):
            shutil.rmtree(stale, ignore_errors=True)
    try:
        generate_shapes_dataset(tmp)
    except BaseException:  # Ctrl-C while writing: a hidden 10 MB folder was left behind for good
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(root, ignore_errors=True)  # empty folders only (has_files checked by the caller)
    os.replace(tmp, root)
    return root


def find_pairs(folder):
    """Match <folder>/images/* with <folder>/masks/* by file stem."""
    folder = Path(folder)
    for sub in ("images", "masks"):
        if not (folder / sub).is_dir() and (folder.parent / "masks").is_dir() and image_file_count(folder):
            root = folder.parent.parent if folder.parent.name in ("train", "val") else folder.parent
            raise UserError(f"{folder} holds the images themselves: give the folder that holds images/ and "
                            f"masks/{' (in train/ and val/)' if root != folder.parent else ''}, data_dir={root}")
        if not (folder / sub).is_dir():
            raise UserError(f"{folder / sub} " + ("is a file, not a folder" if (folder / sub).exists() else "not found")
                            + f": put images in {folder}/images and masks with the same file names in {folder}/masks")
    if (folder / "masks").resolve() == (folder / "images").resolve():  # a link: each image its own "mask"
        raise UserError(f"{folder / 'masks'} and {folder / 'images'} are one folder ({(folder / 'images').resolve()}): "
                        f"masks are files of their own, one channel of class indices: put them in a masks/ folder "
                        f"of their own")
    images, masks = (index_by_stem(folder / sub) for sub in ("images", "masks"))
    if not images:
        raise no_images_in(folder)
    renamed = renamed_partners(images, masks, folder) or partners_in_other_case(images, masks, folder)
    if renamed:
        raise UserError(renamed)
    for missing, have, there, fix in ((set(images) - set(masks), images, folder / "masks", "add masks"),
                                      (set(masks) - set(images), masks, folder / "images", "add images")):
        what = f"image(s) in {folder / 'images'} have no mask" if have is images else \
            f"mask(s) in {folder / 'masks'} have no image"
        if missing:
            alike = sorted(there.glob(f"{glob.escape(min(missing))}.*"))  # the first unpaired stem's namesakes there
            partner = next((p for p in alike if p.is_dir()), None)
            if partner:  # a folder named like one ('has no mask' hid it): unread_entries' rule, said here
                raise UserError(f"{partner} is a folder, not {'a mask' if there.name == 'masks' else 'an image'}: "
                                f"{have[min(missing)].name}'s partner must be a file; move it out of that folder")
            unreadable = next((p.name for p in alike if p.suffix.lower() not in IMAGE_EXTS), None)
            if unreadable:  # s000.webp beside s000.png: not "no partner", a format this script cannot read
                raise UserError(f"{there / unreadable} is not a format this script reads ({', '.join(IMAGE_EXTS)}): "
                                f"convert it (and any like it), e.g. to PNG")
            names = ", ".join(have[s].name for s in sorted(missing)[:3])
            raise UserError(f"{len(missing)} {what} in {there} (e.g. {names}): {fix} with the same file stem, "
                            f"or remove them")
    # in the order of the images' own stems, as before they were keyed composed (index_by_stem): the seeded split
    # of a set named in NFD (copied from macOS) stays the one its runs began on
    return [(images[s], masks[s]) for s in sorted(images, key=lambda s: images[s].stem)]


def no_images_in(folder):
    """The UserError for a data set's images/ with no image in it, with what to do: its subfolders' files moved
    up, its files of other types converted, or images put there (a train/ or val/ of the split is named as
    the folder to fill: data_dir is the folder above it)."""
    entries = [p for p in sorted((folder / "images").iterdir()) if not p.name.startswith(".")]
    subs, others = [p.name + "/" for p in entries if p.is_dir()], [p.name for p in entries if p.is_file()]
    other_part = folder.parent / ("val" if folder.name == "train" else "train")
    split = folder.name in ("train", "val") and other_part.is_dir()
    return UserError(f"no images ({', '.join(IMAGE_EXTS)}) in {folder / 'images'}" + (
        f" (its subfolders {', '.join(subs[:3])} are not searched: move their files up)" if subs else
        f" ({len(others)} file(s) of other types, e.g. {others[0]}): convert them to one of these types" if others
        else f": put the images there, each with its mask of the same file name in {folder / 'masks'}" + (
            "" if split else ", or give data_dir= the folder that holds images/ and masks/")))


def renamed_partners(images, masks, folder):
    """Where the unpaired masks are the unpaired images' stems with one word added (shape_0000_mask.png for
    shape_0000.png; mask_shape_0000.png; or the images so named), the error that says so, else None."""
    lone = {"images": sorted(set(images) - set(masks)), "masks": sorted(set(masks) - set(images))}
    for named, other in (("masks", "images"), ("images", "masks")):
        stems, sample = set(lone[other]), lone[named][:200]  # each split of a name looked up: no n x n
        affixes = [(stem[k:], True) for stem in sample for k in range(1, len(stem)) if stem[:k] in stems] + \
                  [(stem[:k], False) for stem in sample for k in range(1, len(stem)) if stem[k:] in stems]
        if not affixes:
            continue
        (affix, suffix), n = collections.Counter(affixes).most_common(1)[0]
        if n * 2 < len(sample):
            continue
        n = sum((stem.endswith(affix) and stem[:-len(affix)] in stems) if suffix else
                (stem.startswith(affix) and stem[len(affix):] in stems) for stem in lone[named])
        example = next(stem for stem in lone[named] if (stem.endswith(affix) if suffix else stem.startswith(affix)))
        base = example[:-len(affix)] if suffix else example[len(affix):]
        have = (masks if named == "masks" else images)[example]
        return (f"{n} of the {named} in {folder / named} are named as the {other} with {affix!r} added (e.g. "
                f"{have.name} for {base}): {named} pair with {other} by the same file stem, so rename them (e.g. "
                f"{have.name} -> {base}{have.suffix})")
    return None


def partners_in_other_case(images, masks, folder):
    """Where unpaired masks are unpaired images' stems in other letter case (IMG_01.png for img_01.tif, as
    one tool or camera names them), the error that says so, else None: stems are matched exactly, on every
    file system, and "no partner" hid that the partner was there."""
    lone = {stem.lower(): stem for stem in sorted(set(images) - set(masks), reverse=True)}  # the first by name
    pairs = [(lone[stem.lower()], stem) for stem in sorted(set(masks) - set(images)) if stem.lower() in lone]
    if not pairs:
        return None
    image, mask = pairs[0]
    return (f"{len(pairs)} of the masks in {folder / 'masks'} are named as their images in other letter case (e.g. "
            f"{masks[mask].name} for {images[image].name}): stems are matched exactly, so rename them (e.g. "
            f"{masks[mask].name} -> {image}{masks[mask].suffix})")


def unread_entries(root):
    """What data_dir's images/ and masks/ folders (train/ and val/'s too) hold that is not read: their
    subfolders (not searched), files of other formats, and hidden files named like images (hidden_image);
    other hidden entries (.ipynb_checkpoints/, .DS_Store, macOS's ._ files) are left out."""
    folders = [root / part / sub for part in ("", "train", "val") for sub in ("images", "masks")]
    return [f"{p.relative_to(root)}{'/' if p.is_dir() else ''}" for folder in folders if folder.is_dir()
            for p in sorted(folder.iterdir())
            if hidden_image(p.name, p.is_dir()) or not p.name.startswith(".")
            and (p.is_dir() or p.suffix.lower() not in IMAGE_EXTS)]


def hidden_image(name, is_dir):
    """A hidden file named like an image (.g.png): never read, but said to be skipped. Not macOS's ._
    metadata files beside copied images, which are no images."""
    return name.startswith(".") and not name.startswith("._") and not is_dir and Path(name).suffix.lower() in IMAGE_EXTS


def image_file_count(folder):
    """Files of an image format in a folder, as index_by_stem would take them, for a note or a hint only:
    nothing is checked (a folder no run reads must not stop one)."""
    return sum(1 for p in folder.iterdir() if p.suffix.lower() in IMAGE_EXTS and not p.name.startswith(".")
               and not p.is_dir())


def index_by_stem(folder):
    """{stem: path} of a folder's images, each stem in Unicode's composed form (NFC): a name with an accent
    copied from macOS (é as e + accent, NFD) beside one written on Linux (é as one character) looks the same
    and pairs; its mask was 'missing', the two names alike on screen."""
    found = {}
    for path in sorted(folder.iterdir()):
        if path.suffix.lower() not in IMAGE_EXTS or path.name.startswith(".") or path.is_dir():
            continue  # a folder named like an image is not read: unread_entries' note says so
        if not path.exists():  # before pairing, where it would read as a file without a partner
            raise UserError(f"{path} is a broken link (it points to {os.readlink(path)}, which is not there): "
                            f"fix or remove it")
        refuse_special_file(path, "mask" if folder.name == "masks" else "image")
        stem = unicodedata.normalize("NFC", path.stem)
        if stem in found:
            alike = " (spelt in two Unicode forms that look alike)" if found[stem].stem != path.stem else ""
            raise UserError(f"{found[stem].name} and {path.name} in {folder} share the stem {stem!r}{alike}: keep "
                            f"one file per name")
        found[stem] = path
    return found


def read_image(path, channels, intensity_range=None, look=None):
    """An image file as the network's input: HxW (channels=1) or HxWx3 RGB, scaled by scale_image.

    Training, validation, predict and the notebook all read images here, each passing its config's
    intensity_range, so they all see the same values: 8-bit files stay uint8, everything else becomes
    float32 ([0, 1] for the training images). look(path, as decoded, as scaled): predict's InputNotes.look.
    """
    check_choice("in_channels", channels)  # a library call's (2 gave a grey image, unsaid)
    image = decode_image(path, channels)
    scaled = scale_image(image, path, intensity_range)
    shaped = to_channels(scaled, channels, path)
    if look is not None:  # an image the checks took
        look(path, image, scaled)
    return shaped


def decode_image(path, channels=3):
    """Pixels at their stored depth, RGB order. TIFF goes through tifffile, the field's reader,
    which also tells multi-page stacks apart; OpenCV reads the rest, and the TIFFs read_tiff leaves to it
    (palette colours, CMYK), which OpenCV's TIFF decoder turns by their Orientation tag whatever the flags."""
    readers_quieted()  # a library caller's (a notebook's) too: OpenCV's log lines came before its one-line error
    refuse_special_file(path, "image")
    with read_errors_named(path, "image"):
        image = read_tiff(path) if is_tiff(path) else None
        return image if image is not None else opencv_image(path, channels)


def opencv_image(path, channels):
    """decode_image's OpenCV read: RGB order, the depth kept."""
    # ANYDEPTH keeps 16-bit and float pixels; the colour flag makes 8-bit files decode exactly as
    # before (the decoder's own gray conversion); not IMREAD_UNCHANGED, which ignores EXIF rotation.
    colour = cv2.IMREAD_COLOR if channels == 3 else cv2.IMREAD_GRAYSCALE
    image = opencv_read(path, cv2.IMREAD_ANYDEPTH | colour, "image")
    if image.ndim == 3 and image.shape[2] in (3, 4):  # in place: no second copy of a large scene
        if image.dtype in CVT_COLOR_DTYPES:
            code = cv2.COLOR_BGR2RGB if image.shape[2] == 3 else cv2.COLOR_BGRA2RGBA
            image = cv2.cvtColor(image, code, dst=image)
        else:  # signed 16/32-bit, float64: cvtColor refuses them
            image[..., [0, 2]] = image[..., [2, 0]]
    return image


CVT_COLOR_DTYPES = (np.uint8, np.uint16, np.float32)  # the depths cv2.cvtColor converts


def opencv_read(path, flags, kind):
    """cv2.imread, with its failures as one-line errors: an unreadable file, and an image over the
    pixel limit the user set for OpenCV (OPENCV_IO_MAX_IMAGE_PIXELS; this script raises OpenCV's own)."""
    if not Path(path).is_file():  # before OpenCV, which would print its own warning for it
        raise UserError(f"cannot read {kind} {path} ({unreadable_why(path)}): fix or remove it")
    try:
        array = opencv_decode(path, flags, kind)
    except cv2.error as exc:
        if "MAX_IMAGE_PIXELS" in str(exc):
            raise UserError(f"{kind} {path} has more pixels than OpenCV may read here (OPENCV_IO_MAX_IMAGE_"
                            f"PIXELS, 2**30 unless set before OpenCV was first imported): set it higher before "
                            f"that (importing this script first does), or cut the image into parts") from None
        if "Insufficient memory" in str(exc) or "Failed to allocate" in str(exc):  # not the file: it was 'fix it'
            raise UserError(f"cannot read {kind} {path}: not enough memory here to decode it: free memory (or raise "
                            f"ulimit -v), or cut the image into parts") from None
        raise UserError(too_long_a_side(path, kind) or f"cannot read {kind} {path} ({first_line(exc)}): fix "
                                                       f"or remove it") from None
    if array is None:
        raise UserError(too_long_a_side(path, kind) or f"cannot read {kind} {path} ({unreadable_why(path)}): "
                                                       f"fix or remove it")
    return array


def opencv_decode(path, flags, kind):
    """cv2.imread(path, flags), but decoded from the file's bytes (cv2.imdecode, which turns a JPEG upright
    by its EXIF as imread does) where imread cannot be trusted: a JPEG, whose end is checked first
    (libjpeg decodes a truncated one with grey in place of the missing rows, and only warns), and a name
    that is not UTF-8 (cv2.imread crashed the process on one). A PNG's chunks are checked first (png_damage:
    libpng prints its own "libpng error" line to stderr before failing on a damaged one), then imread reads it."""
    name = str(path)
    if format_suffix(path) not in (*JPEG_EXTS, ".png") and utf8_name(name):
        return cv2.imread(name, flags)
    with open(path, "rb") as f:
        data = f.read()
    if not data:
        return None  # imdecode asserts on no bytes; opencv_read names the empty file
    if data[:2] == b"\xff\xd8" and not jpeg_complete(data):
        raise UserError(f"cannot read {kind} {path} (a truncated JPEG: its data stop before the end-of-image "
                        f"marker): fix or remove it")
    damage = png_damage(data) if data[:8] == PNG_SIGNATURE else None
    if damage:
        raise UserError(f"cannot read {kind} {path} ({damage}): fix or remove it")
    if data[:8] == PNG_SIGNATURE and utf8_name(name):
        del data  # checked: its bytes (as large as the image where it barely compresses) not held while it decodes
        return cv2.imread(name, flags)  # decoded as before (imdecode reads a grey APNG 1 level apart)
    if data[:2] == b"\xff\xd8":
        return jpeg_decode(data, flags, path, kind)
    return cv2.imdecode(np.frombuffer(data, np.uint8), flags)


# The warnings libjpeg gives for damaged data, which it decodes all the same into wrong pixels; found anywhere in
# what fd 2 got (a progress bar's line, written with no newline, may come just before one)
JPEG_DAMAGE = re.compile(rb"Corrupt JPEG data: [^\r\n]*|Premature end of JPEG file")
JPEG_DAMAGE_LINE = re.compile(rb"(?:" + JPEG_DAMAGE.pattern + rb")\r?\n?")  # as libjpeg prints it
JPEG_FILLER = re.compile(rb"Corrupt JPEG data: (\d+) extraneous bytes before marker 0xd9")


def jpeg_decode(data, flags, path, kind):
    """cv2.imdecode of a JPEG, refused where libjpeg finds its data damaged (a flipped bit, a bad sector): it
    decodes such a file into wrong pixels and prints one warning to stderr that names no file, and OpenCV
    returns the image. The warning is caught from file descriptor 2 (WATCHED_DECODES); a JPEG decoded while
    one was said is decoded again alone, to tell which it was. Padding before the end marker (all 0x00 or
    0xFF, as some cameras write) draws the same warning with the pixels exact: taken (jpeg_padding)."""
    decode = lambda: cv2.imdecode(np.frombuffer(data, np.uint8), flags)  # noqa: E731
    array, said = WATCHED_DECODES.decode(decode)
    if said:
        array, said = WATCHED_DECODES.decode(decode, alone=True)
    damage = [m.decode("latin-1") for m in said if not jpeg_padding(m, data)]
    if damage:
        raise UserError(f"cannot read {kind} {path} (a damaged JPEG: libjpeg says '{damage[0]}', and fills what it "
                        f"cannot read with made-up pixels): remove it, or replace it with an intact copy")
    return array


def jpeg_padding(message, data):
    """Whether libjpeg's warning is of N bytes before the end marker that are all 0x00 or all 0xFF: filler, the
    image whole (a flipped byte draws the same warning, with other bytes)."""
    found, end = JPEG_FILLER.fullmatch(message), jpeg_end(data)
    if not found or end is None or end < 0:
        return False
    filler = data[end - int(found[1]):end]
    return len(filler) == int(found[1]) and len(set(filler)) == 1 and filler[:1] in (b"\x00", b"\xff")


class WatchedDecodes:
    """Decodes in rounds while fd 2 (the process's stderr, where libjpeg prints) is caught in a temporary file:
    the threads that decode at once (the data check's, predict's readers) share a round and each waits for
    its end, when fd 2 is put back, what was caught is read, and all but libjpeg's warnings is written back
    as it came (another thread's output meanwhile, a progress bar's). Decoding one at a time had cost the
    readers' parallel decoding; the round's warnings go to each of its decodes, and one that got a warning
    is decoded again alone (alone=True) to tell whose it was. Where fd 2 cannot be caught, decodes run
    unwatched."""

    def __init__(self):
        self.cond, self.active, self.alone, self.wanting, self.round = threading.Condition(), 0, False, 0, None
        self.file = None  # the temporary file rounds catch fd 2 in (opened)

    def decode(self, fn, alone=False):
        """(fn(), libjpeg's warnings fd 2 got in its round)."""
        with self.cond:
            self.wanting += alone  # a decode waiting to be alone holds back new rounds
            try:
                while self.alone or (self.active if alone else self.wanting):
                    self.cond.wait()
            finally:  # a Ctrl-C in the wait (a notebook's) must not hold back every later decode
                self.wanting -= alone
            if self.active == 0:
                self.round, self.alone = self.opened(), alone
            self.active, mine = self.active + 1, self.round
        try:
            result = fn()
        finally:
            said = self.closed_round(mine)
        return result, said

    def closed_round(self, mine):
        """The round's warnings, once its last decode has ended (the last one closes it)."""
        with self.cond:
            self.active -= 1
            if self.active == 0:
                try:
                    mine["said"] = self.put_back(mine)
                finally:
                    mine.setdefault("said", [])
                    self.round, self.alone = None, False
                    self.cond.notify_all()
            while "said" not in mine:
                self.cond.wait()
        return mine["said"]

    def opened(self):
        """A round: fd 2 into the process's temporary file (made at the first round, then kept: one made per
        round cost 0.2 ms, more than a 256² JPEG's decode), or unwatched where fd 2 cannot be caught."""
        with contextlib.suppress(OSError, ValueError, AttributeError):
            sys.stderr.flush()  # what Python printed before goes out before
        try:
            if self.file is None:
                self.file = tempfile.TemporaryFile()
            saved = os.dup(2)
        except OSError:
            return {"saved": None}
        try:
            os.dup2(self.file.fileno(), 2)
        except OSError:
            os.close(saved)
            return {"saved": None}
        return {"saved": saved}

    def put_back(self, mine):
        """fd 2 as it was; libjpeg's warnings caught (the file emptied for the next round), the rest written back
        to fd 2 byte for byte."""
        if mine["saved"] is None:
            return []
        try:
            os.dup2(mine["saved"], 2)
        finally:
            os.close(mine["saved"])
            mine["saved"] = None
        fd = self.file.fileno()
        size = os.lseek(fd, 0, os.SEEK_CUR)
        if not size:
            return []
        os.lseek(fd, 0, os.SEEK_SET)
        caught = os.read(fd, size)
        os.ftruncate(fd, 0)
        os.lseek(fd, 0, os.SEEK_SET)
        kept = JPEG_DAMAGE_LINE.sub(b"", caught)
        if kept:
            with contextlib.suppress(OSError):  # a stderr whose reader has gone
                os.write(2, kept)
        return JPEG_DAMAGE.findall(caught)

    def after_fork(self):
        """In a child forked mid-round (a loader's worker, a subprocess): its fd 2 as it was, and no round."""
        if self.round is not None and self.round.get("saved") is not None:
            with contextlib.suppress(OSError):
                os.dup2(self.round["saved"], 2)
                os.close(self.round["saved"])
        self.__init__()


def reserve_stderr():
    """/dev/null on file descriptor 2 where it is closed (a daemon's): else the next file opened gets it, and a
    watched decode (WATCHED_DECODES) would take that file for stderr."""
    try:
        os.fstat(2)
    except OSError:
        with contextlib.suppress(OSError):
            null = os.open(os.devnull, os.O_WRONLY)
            if null != 2:
                os.dup2(null, 2)
                os.close(null)


WATCHED_DECODES = WatchedDecodes()
reserve_stderr()
if hasattr(os, "register_at_fork"):  # a loader worker forked mid-round would inherit its count, lock and fd 2
    os.register_at_fork(after_in_child=WATCHED_DECODES.after_fork)


PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_damage(data):
    """Why a PNG's bytes are damaged as libpng would refuse them, or None: a chunk libpng needs (IHDR, IDAT,
    and PLTE in a palette image) whose CRC does not match (a bit flipped on disk or in a copy), or data that
    stop before the IEND chunk (a partial copy or download). Other chunks' CRCs are not checked: libpng
    only warns (text, EXIF, IEND's own, a truecolour image's suggested PLTE). Measured on a busy 2-core Xeon,
    the check and the read of the bytes added 8 % to a 512² PNG's imread and 15 % to a 2048²'s (crc32 at
    about 1 GB/s)."""
    view, pos, palette = memoryview(data), len(PNG_SIGNATURE), False
    while pos + 12 <= len(data):
        end = pos + 8 + int.from_bytes(view[pos:pos + 4], "big")
        if end + 4 > len(data):
            break
        kind = bytes(view[pos + 4:pos + 8])
        if kind == b"IEND":
            return None
        if kind == b"IHDR" and end - pos > 17:
            palette = view[pos + 17] == 3  # colour type 3: indexed
        needed = kind in (b"IHDR", b"IDAT") or (kind == b"PLTE" and palette)
        if needed and zlib.crc32(view[pos + 4:end]) != int.from_bytes(view[end:end + 4], "big"):
            return f"a damaged PNG: its {kind.decode('latin-1')} chunk fails its CRC check"
        pos = end + 4
    return "a truncated PNG: its data stop before the IEND chunk"


JPEG_EXTS = (".jpg", ".jpeg", ".jpe", ".jfif")


def utf8_name(name):
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:  # bytes no encoding decodes, kept by Python as surrogates
        return False
    return True


def jpeg_complete(data):
    """Whether a JPEG's bytes hold its end-of-image marker (FF D9) after its first scan begins (jpeg_end), or
    are not the markers a JPEG has (imdecode judges them)."""
    return jpeg_end(data) != -1


def jpeg_end(data):
    """The offset of a JPEG's end-of-image marker (FF D9) after its first scan begins; -1 where its data stop
    before it; None where the bytes are not the markers a JPEG has. The segments before the scan are stepped
    over by their lengths (an EXIF thumbnail's own markers inside them are not read); inside the entropy-coded
    data an FF byte is always followed by 00 or a restart marker, so the first FF D9 there is the real end (a
    camera's trailer after it, a motion photo's video, does not matter)."""
    i = 2
    while i + 4 <= len(data):
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xDA:  # start of scan
            return data.find(b"\xff\xd9", i)
        i += 1 if marker == 0xFF else 2 if 0xD0 <= marker <= 0xD9 or marker == 0x01 else \
            2 + int.from_bytes(data[i + 2:i + 4], "big")
    return -1  # the file stops among the headers


def unreadable_why(path):
    """What is wrong with a file OpenCV could not decode, as far as the file system tells."""
    path = Path(path)
    if path.is_dir():
        return "a folder, not an image"
    if not path.exists():
        return "a broken link" if path.is_symlink() else "not found"
    if special := special_file(path):
        return f"{special}, not a file"
    if not os.access(path, os.R_OK):  # cv2.imread returns None for it, as for a damaged file
        return "permission denied: this user may not read it"
    return "an empty file" if path.stat().st_size == 0 else "corrupt or not an image"


def special_file(path):
    """'a named pipe', 'a socket' or 'a device' where `path` (or what it links to) is one, else None. Opening a
    named pipe waits for a writer: one named like an image hung the data check and predict for ever (and the
    run then outlived its SIGTERM, a thread still in open()); none is opened."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):
        return None
    return ("a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else
            "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else None)


def refuse_special_file(path, kind):
    special = special_file(path)
    if special:
        raise UserError(f"cannot read {kind} {path} ({special}, not a file): remove it, or put the {kind} file in "
                        f"its place")


@contextlib.contextmanager
def read_errors_named(path, kind):
    """An OSError met reading a data file as its one-line UserError: no permission to read it (data copied
    from another user, root's 600 files), or an I/O error (a failing disk, a network share gone). It was a
    traceback from inside the reader: the data check stopped there, and predict with it, which names an
    unreadable image and goes on. The open-file limit is left to main's message (system_limit_message)."""
    try:
        yield
    except OSError as exc:
        if exc.errno in OPEN_FILES_LIMITS:
            raise
        raise UserError(f"cannot read {kind} {path} ({os_error_words(exc)}): {os_error_fix(exc)}") from None


def os_error_words(exc):
    return "permission denied: this user may not read it" if exc.errno in NO_PERMISSION else \
        (exc.strerror or type(exc).__name__)


def os_error_fix(exc, other="remove it"):
    """The fix for a file that could not be read: its permissions, or the file itself."""
    if exc.errno in NO_PERMISSION:
        return f"let this user read it (chmod a+r, or run as its owner), or {other}"
    return f"check the disk or share it is on, or {other}"


NO_PERMISSION = (errno.EACCES, errno.EPERM)
OPEN_FILES_LIMITS = (errno.EMFILE, errno.ENFILE)  # this process's (ulimit -n), the system's: not the file's fault


def too_long_a_side(path, kind):
    """Why OpenCV could not read an image whose header is sound, where a side is over its readers' limit
    (libpng's 1,000,000 px for PNG, OpenCV's 2**20 for the others); else None."""
    size = image_header(path)
    limit = 1_000_000 if Path(path).suffix.lower() == ".png" else 1 << 20
    if size is None or max(size[:2]) <= limit:
        return None
    return (f"{kind} {path} is {size[1]}x{size[0]} px: OpenCV reads {Path(path).suffix.lower()[1:].upper()} files "
            f"of at most {limit:,} px a side; save it as a TIFF (read with tifffile, which has no such limit) "
            f"or cut it into parts")


def is_tiff(path):
    return Path(path).suffix.lower() in (".tif", ".tiff")


def read_tiff(path, mask=False):
    """Level 0 of a TIFF's first image as an array, or None where tifffile leaves it to OpenCV (an image's
    palette colours, CMYK); a codec imagecodecs lacks is a UserError naming it. A mask's palette is read as
    its indices (the VOC/labelme convention), as tifffile returns them. Overview levels (GeoTIFF, COG,
    pyramidal slides) are not extra images; a stack of full-size images is refused."""
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            if plane_of(series) is None or not all(series.shape):  # a damaged file's series without an image
                return None
            shape, axes = squeezed(series)
            planar = axes == "SYX" and shape[0] <= 4  # RGB stored plane by plane
            check_single_image(path, tif, series, planar, "mask" if mask else "image")
            if series.keyframe.photometric in OPENCV_PHOTOMETRICS and not mask:
                return None
            check_tiff_complete(path, tif, series.keyframe, "mask" if mask else "image")
            try:
                image = series.asarray().reshape(shape)  # level 0
            except (ValueError, NotImplementedError, KeyError) as exc:
                if "imagecodecs" in str(exc):  # OpenCV would read it turned by its Orientation tag, a palette as colours
                    raise UserError(f"cannot read {'mask' if mask else 'image'} {path}: tifffile says "
                                    f"'{first_line(exc)}': pip install -U imagecodecs (requirements.txt has it)") from None
                return None
            except Exception as exc:  # noqa: BLE001 - damaged data: zlib.error, imagecodecs' errors, EOFError
                raise UserError(f"cannot read {'mask' if mask else 'image'} {path} (corrupt TIFF data: "
                                f"{first_line(exc)}): fix or remove it") from None
            if image.dtype == bool and not mask:  # bilevel (1-bit): 0 and 255, as OpenCV reads a 1-bit PNG or TIFF
                image = image.view(np.uint8) * np.uint8(255)
            if series.keyframe.photometric == 0 and not mask:  # MINISWHITE: 0 is white
                image = as_shown(image)
            return np.moveaxis(image, 0, -1) if planar else image
    except (tifffile.TiffFileError, OSError, IndexError, ValueError, TypeError, struct.error):
        # not a TIFF tifffile understands (a truncated one: struct.error): OpenCV tries, then says it cannot read it
        return None


def check_tiff_complete(path, tif, page, kind):
    """A compressed TIFF whose image data (strips or tiles) run past the end of the file is refused: a partial
    copy or download. Cut within JPEG-compressed data, it decoded with the rest of the image made up, unsaid
    (other codecs fail on it later, with their own words; a cut uncompressed one fails to read)."""
    size = tif.filehandle.size
    if page.compression == 1:  # uncompressed: a writer may count a short last strip in full; a cut one fails
        return
    if any(offset + count > size for offset, count in zip(page.dataoffsets, page.databytecounts)):
        raise UserError(f"cannot read {kind} {path} (a truncated TIFF: its image data run past the end of the "
                        f"file, {size} bytes): fix or remove it")


def as_shown(image):
    """A MinIsWhite TIFF image as viewers, OpenCV and PIL show it (tifffile returns the stored values, 0 for
    white): a data set mixing such TIFFs with PNGs, or a model trained on PNG exports of them, saw them
    inverted, silently. Unsigned integers and bilevel images (0/255) are inverted within their type's range; a float
    or signed one has no such range and is read as stored."""
    return np.iinfo(image.dtype).max - image if np.issubdtype(image.dtype, np.unsignedinteger) else image


# TIFF colour spaces read_tiff leaves to OpenCV (libtiff's conversion to RGB): palette colours (3) and
# CMYK (5; tifffile would return its 4 inks, and K would be dropped as if it were alpha)
OPENCV_PHOTOMETRICS = (3, 5)


def check_single_image(path, tif, series, planar, kind):
    """One image per file: level 0 of the first series holds one (gray, RGB or planar RGB) image, and no
    other series is a second full-size image (smaller ones, a slide's thumbnail or label, are ignored)."""
    shape, axes = squeezed(series)
    extra = len(shape) > 3 or (len(shape) == 3 and axes[-1] != "S" and not planar)
    twins = [other for other in tif.series[1:] if plane_size(other) == plane_size(series)]
    if (len(series.pages) > 1 or extra) and axes == "CYX":  # Fiji's composites, OME's channels: one image
        raise UserError(f"{kind} {path} holds {shape[0]} channels as pages (shape {series.shape}, axes "
                        f"{series.axes}: a Fiji composite or an OME-TIFF), which this script does not read: save it "
                        f"as one RGB image (Fiji: Image > Type > RGB Color), or its channel the model should see as "
                        f"a grey one")
    if len(series.pages) > 1 or extra or twins:
        raise UserError(f"{kind} {path} is a stack ({len(tif.pages)} page(s), first image shape "
                        f"{series.shape}, axes {series.axes}): multi-page TIFFs are not supported; save "
                        f"one image per file")


def plane_size(series):
    """(height, width) of a tifffile series' level 0."""
    shape, axes = squeezed(series)
    return tuple(shape[-3:-1] if axes.endswith("S") else shape[-2:])


def squeezed(series):
    """(shape, axes) of a tifffile series without its length-1 axes other than Y, X and S: a grey image saved
    from numpy as (H, W, 1) or (1, H, W), or RGB as (1, H, W, 3), is one image (tifffile names the extra axis Q)."""
    kept = [(n, a) for n, a in zip(series.shape, series.axes) if n != 1 or a in "YXS"]
    return tuple(n for n, _ in kept), "".join(a for _, a in kept)


def plane_of(series):
    """plane_size where the series has an image plane, else None (a damaged file's series of shape ())."""
    hw = plane_size(series)
    return hw if len(hw) == 2 and min(hw) > 0 else None


def scale_image(image, path="image", intensity_range=None):
    """THE scaling rule, one function for training, validation, predict and the notebook.

    8-bit images stay uint8 (Normalize divides them by 255 on albumentations' exact fast path).
    Wider integers are mapped from `intensity_range` [low, high] to [0, 1] (float32): the training
    images' [min, max] (learnt_intensity_range: 12-bit data in 16-bit files -> about [0, 4095]), stored
    in the checkpoint's config so validation, predict and the notebook use the same one. None
    (checkpoints from before the range was learnt) = the dtype's range, uint16 / 65535; wider integers
    need a range (over int32's, an image is one flat grey): a UserError. Values outside
    the range are not clipped. Floats have no bit depth: each image is mapped by its
    own min/max to [0, 1] (not percentiles: clipping would saturate the brightest pixels, often the
    objects).
    """
    if intensity_range is not None and not (isinstance(intensity_range, (list, tuple))
                                            and valid_range(intensity_range)):
        # a library call's (a notebook's): [4095, 0] inverted the image, unsaid; "0,4095" failed in unpacking
        raise UserError(f"intensity_range={intensity_range!r} must be [low, high] with low < high (the values mapped "
                        f"to 0 and 1), or None")
    if image.dtype == np.uint8:
        return image
    check_pixels(image, path)
    if np.issubdtype(image.dtype, np.integer):
        if intensity_range is None and image.dtype.itemsize > 2:  # over the whole int32 range: one flat grey
            raise no_range_for(path, image.dtype, image.min(), image.max())
        low, high = intensity_range or dtype_range(image.dtype)
        return unit_scale(image.astype(np.float32), low, high)
    image = image.astype(np.float32)
    low, high = float(image.min()), float(image.max())
    return unit_scale(image, low, high) if high > low else np.zeros_like(image)


def no_range_for(path, dtype, low, high):
    """The UserError for integers over 16 bits that no intensity_range maps (scale_image's rule)."""
    return UserError(f"image {path} has {dtype} pixels ({low} to {high}) and no intensity_range maps them to 0-1 "
                     f"(none was learnt from the training images, or given): set intensity_range=low,high, the "
                     f"span of such images' values")


def wide_integers_unmapped(pairs, cfg):
    """At start-up, from the data check's facts, the images scale_image would refuse with no intensity_range
    (int32 and wider): one stopped the run only once the first epoch read it."""
    facts = start_up_facts(pairs, cfg)
    for image, _ in pairs:
        entry = facts[os.path.abspath(image)]
        dtype = np.dtype(entry["dtype"])
        if np.issubdtype(dtype, np.integer) and dtype.itemsize > 2:
            raise no_range_for(image, dtype, *entry.get("range", ("?", "?")))


def check_pixels(image, path):
    """Pixels scale_image can scale: integers, or floats without NaN or inf."""
    if np.issubdtype(image.dtype, np.integer):
        return
    if not np.issubdtype(image.dtype, np.floating):
        raise UserError(f"image {path} has pixels of type {image.dtype}: use 8- or 16-bit integers or "
                        f"float32")
    if not np.isfinite(image).all():
        raise UserError(f"image {path} holds NaN or inf pixels: replace them (e.g. by 0) first")


def dtype_range(dtype):
    info = np.iinfo(dtype)
    return info.min, info.max


def unit_scale(image, low, high):
    """(image - low) / (high - low), in place in a float32 copy that scale_image made: 4 bytes a pixel
    in all (float64 arithmetic took three times that). Integers up to 2**24 and their differences are
    exact in float32, so each result is the exact quotient rounded once: within half an ulp."""
    image -= np.float32(low)
    image /= np.float32(high - low)
    return image


def to_channels(image, channels, path):
    """HxW gray or HxWx3 RGB as asked: gray is repeated, RGB averaged by luminance, alpha dropped."""
    image = without_alpha(image)
    check_channels(image, path)
    if channels == 3:
        return np.ascontiguousarray(np.repeat(image[..., None], 3, axis=2)) if image.ndim == 2 else image
    return cv2.cvtColor(image, cv2.COLOR_RGB2GRAY) if image.ndim == 3 else image


def check_channels(image, path):
    """Gray or RGB once the alpha is dropped (without_alpha)."""
    if image.ndim not in (2, 3) or (image.ndim == 3 and image.shape[2] != 3):
        raise UserError(f"image {path} has shape {image.shape}: use grayscale, RGB or RGBA images "
                        f"(at most 4 channels)")


def without_alpha(image):
    """A view of the image's gray or RGB values: gray + alpha -> gray, RGBA -> RGB (alpha is dropped)."""
    if image.ndim == 3 and image.shape[2] in (1, 2):
        return image[..., 0]
    if image.ndim == 3 and image.shape[2] == 4:
        return image[..., :3]
    return image


def to_uint8_view(image):
    """An image from read_image as 8-bit for looking at (overlays): uint8 as is, [0, 1] floats * 255."""
    if image.dtype == np.uint8:
        return image
    return (np.clip(image, 0, 1) * 255 + 0.5).astype(np.uint8)


def read_mask(path, num_classes):
    """A mask as class indices (uint8), values checked: binary 0/255 and 0/1 both become 0/1;
    multi-class masks keep their indices, and 255 (void, the VOC convention) stays IGNORE_INDEX."""
    if isinstance(num_classes, bool) or not isinstance(num_classes, (int, np.integer)) or \
            not 1 <= num_classes < IGNORE_INDEX:  # a library call's
        raise UserError(f"num_classes={num_classes!r} must be a whole number from 1 to {IGNORE_INDEX - 1}")
    mask = decode_mask(path)
    values = set(np.unique(mask).tolist())
    refuse_jpeg_codec(path, values, mask_codec(path), num_classes)  # as the data check (check_pair_facts)
    check_mask_values(path, values, num_classes, mask.dtype)
    if num_classes > 1 and values == {0, IGNORE_INDEX}:  # one file cannot tell; training refuses such a data set
        print(f"note: mask {path} holds only 0 and {IGNORE_INDEX}: with num_classes={num_classes}, {IGNORE_INDEX} is "
              f"void (not scored); if it is a binary mask (its foreground 255), read it with num_classes=1",
              flush=True)
    return mask_to_classes(mask, num_classes, path)


def decode_mask(path):
    """A mask's stored values. Palette files (VOC and labelme PNGs) give their indices, not colours;
    TIFFs follow read_tiff's rules (level 0, no stacks)."""
    readers_quieted()
    refuse_special_file(path, "mask")
    with read_errors_named(path, "mask"):
        mask = read_tiff(path, mask=True) if is_tiff(path) else palette_indices(path)
        if mask is None:
            mask = opencv_read(path, cv2.IMREAD_UNCHANGED, "mask")
    if mask.ndim == 3:
        check_mask_alpha(mask, path)
        mask = mask[..., :3]  # ignore an alpha channel
        if not (mask == mask[..., :1]).all():
            raise UserError(f"mask {path} is a colour image: save masks as one channel of class indices")
        mask = mask[..., 0]
    return mask


def check_mask_alpha(mask, path):
    """A mask (H x W x channels) whose shape is drawn in its alpha channel on one flat value ("white on
    transparent", as some editors export): without its alpha it reads as one class everywhere."""
    if mask.shape[2] not in (2, 4):
        return
    values, alpha = mask[..., :-1], mask[..., -1]
    if (values == values.flat[0]).all() and not (alpha == alpha.flat[0]).all():
        raise UserError(f"mask {path} is {values.flat[0]} everywhere and draws its shape in the alpha channel "
                        f"(transparency), which masks do not use: save the labels as pixel values (e.g. 255 where "
                        f"it is opaque, 0 elsewhere) in a one-channel PNG")


def pillow_reader(path, suffixes=(".png", ".bmp", ".jpg", ".jpeg")):
    """Pillow's reader class for the file's format (one of `suffixes`), or None. The format's own reader,
    not Image.open: its decompression-bomb limit (179 Mpx), a guard against untrusted downloads, would
    refuse a user's own large scenes and their masks. The format is the one its first bytes say, as for
    OpenCV, which decodes by them: a JPEG named .png is read, and turned by its EXIF, as a JPEG."""
    from PIL import BmpImagePlugin, JpegImagePlugin, PngImagePlugin

    suffix = format_suffix(path)
    readers = {".png": PngImagePlugin.PngImageFile, ".bmp": BmpImagePlugin.BmpImageFile,
               ".jpg": JpegImagePlugin.JpegImageFile, ".jpeg": JpegImagePlugin.JpegImageFile}
    return readers.get(suffix) if suffix in suffixes else None


IMAGE_SIGNATURES = {PNG_SIGNATURE: ".png", b"\xff\xd8\xff": ".jpg", b"BM": ".bmp"}


def format_suffix(path):
    """The suffix of the format a file's first bytes say (PNG, JPEG, BMP) whatever its name, else its name's."""
    try:
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        head = b""
    said = (suffix for sign, suffix in IMAGE_SIGNATURES.items() if head.startswith(sign))
    return next(said, Path(path).suffix.lower())


def palette_indices(path):
    """A palette image's indices (Pillow reads them as stored), or None for any other file."""
    reader = pillow_reader(path, (".png", ".bmp"))
    if reader is None:
        return None
    try:
        with reader(path) as image:
            if image.mode != "P":
                return None
            indices, palette = np.asarray(image), palette_entries(image)
    except (OSError, SyntaxError, ValueError):
        return None  # not what its name says, or damaged: OpenCV tries, then says it cannot read it
    if indices.size and indices.max() < len(palette) and all_grey(palette) and not display_ramp(palette):
        # An all-gray palette covering every index is a gray mask stored compactly (PNG optimisers do
        # this): its gray values are the mask, as an image viewer shows it, whatever order the entries
        # have. The inverted 256-level ramp is a display table (ImageJ's inverting LUT shows 255 black):
        # its indices are the data, as for a colour palette (the identity ramp reads alike either way).
        # Indices past the palette's end (Pillow writes a one-entry palette for mode "P" unless given
        # one) are class indices saved without a palette: kept as they are.
        return palette[indices, 0]
    return indices


def mask_to_classes(mask, num_classes, path="mask"):
    """Conversion, for masks whose values the data check has accepted (no np.unique per sample). A
    multi-class mask is still guarded by its maximum: a file changed since the check must stop the run
    with its name, not reach cross-entropy (on CUDA a device-side assert) or wrap around in uint8."""
    if num_classes == 1:
        return (mask > 0).astype(np.uint8)
    classes = mask.astype(np.uint8)
    if mask.dtype != np.uint8 and not np.array_equal(classes, mask):
        check_mask_values(path, set(np.unique(mask).tolist()), num_classes, mask.dtype)  # says which values
    # + 1 wraps void (255) to 0, so the maximum is the top class + 1 (0 for an all-void mask).
    top = int(np.add(classes, 1, dtype=np.uint8).max()) - 1
    if top >= num_classes:
        raise UserError(f"mask {path} holds class {top} but num_classes={num_classes}, unseen by the data "
                        f"check (changed since?): set num_classes={top + 1} or fix the mask")
    return classes


def check_mask_values(path, values, num_classes, dtype, others=None, greys=None, at_least=0):
    """Binary: 0/1 or 0/255 (255 = foreground). Multi-class: 0..num_classes-1, and 255 = void. `others`:
    binary_others' word on the rest of the set, for a binary run's odd mask; `greys`: the set's values, where
    they are classes saved as evenly spaced greys (even_grey_levels; else this mask's are looked at, where its
    values are wrong: not for every mask at every start-up); `at_least`: the num_classes the whole set needs
    (set_classes), so the fix suggested is not one the next mask refuses."""
    check_finite_mask(path, values, num_classes, dtype)
    if num_classes == 1:
        if values <= {0, 1} or values <= {0, 255}:
            return
        greys = greys or even_grey_levels(values)
        hint = (f"the other masks are binary ({others}): fix this one (a stray value?); num_classes > 1 would "
                f"make {IGNORE_INDEX} void in them" if others and others.endswith("0/255") else
                greys_hint(greys) if greys else mask_hint(path, dtype, values, at_least))
        raise UserError(f"mask {path} holds values {sorted(values)[:8]}: with num_classes=1 masks must be "
                        f"0/1 or 0/255; {hint}")
    if Path(path).suffix.lower() in JPEG_EXTS:  # by name here; by its bytes where the values are wrong (below);
        check_not_jpeg(path, values)             # a TIFF's codec by the data check (check_pair_facts)
    odd = not_class_indices(values)
    if odd:
        check_not_jpeg(path, values)
        fix = (f"mark ignored pixels with {IGNORE_INDEX}, not negative values" if odd[0] < 0 else
               "save masks as 8-bit class indices (no scaling or interpolation)")
        raise UserError(f"mask {path} ({np.dtype(dtype)}) holds values {format_values(odd)} that are not "
                        f"class indices: with num_classes={num_classes} masks hold whole numbers "
                        f"0..{num_classes - 1} and {IGNORE_INDEX} = void; {fix}")
    classes = {int(v) for v in values} - {IGNORE_INDEX}
    if classes and max(classes) >= num_classes:
        check_not_jpeg(path, values)
        top = max(classes)
        others = sorted(classes - {top})
        hint = (f"class indices must be below {IGNORE_INDEX} ({IGNORE_INDEX} = void)" if top >= IGNORE_INDEX else
                f"set num_classes={max(top + 1, at_least)} or fix the mask"
                if top < 2 * max(num_classes, len(classes)) or not others else
                f"it stands far above the others ({format_values(others)}): a stray value? fix the mask, or "
                f"set num_classes={max(top + 1, at_least)} if it is a class")
        palette = grey_palette_hint(path)  # its indices may be the classes: the likelier fix first
        greys = greys or even_grey_levels(values)
        hint = greys_hint(greys) if greys else hint
        raise UserError(f"mask {path} holds class {top} but num_classes={num_classes} (255 = void is "
                        f"allowed): " + (f"{palette}; else {hint}" if palette else hint))


def check_finite_mask(path, values, num_classes, dtype):
    """A float mask holding NaN (or inf), which some pipelines write for 'no label': no class is NaN. A binary
    mask's error had advised 0/255 beside values [0.0, nan] (its other values), never the NaN."""
    unset = sorted({f"{v}" for v in values if not math.isfinite(v)})
    if unset:
        fill = "0 (background) or 1 (foreground)" if num_classes == 1 else f"a class index, or {IGNORE_INDEX} for void"
        raise UserError(f"mask {path} ({np.dtype(dtype)}) holds {' and '.join(unset)} pixels, which are no class: "
                        f"give them {fill} and save it again")


def even_grey_levels(values):
    """The sorted values, void aside where it does not fit, where they are 0 and evenly spaced greys that reach
    at least 64 (0/100/200, 0/128/255, 0/85/170/255: class i saved as level i x step, as an export for viewing
    writes them), else None. Closer values (0/2: class 1 absent?) are left to the usual hints."""
    whole = sorted(int(v) for v in values if math.isfinite(v) and v == int(v))
    for levels in (whole, LevelsBesideVoid(v for v in whole if v != IGNORE_INDEX)):
        n = len(levels)
        if n >= 2 and levels[0] == 0 and levels[1] >= 2 and levels[-1] >= 64 and \
                all(abs(v - i * levels[-1] / (n - 1)) <= 1 for i, v in enumerate(levels)):
            return levels
    return None


class LevelsBesideVoid(list):
    """even_grey_levels' levels where the masks also hold void (IGNORE_INDEX), set aside."""


def greys_hint(levels):
    """The fix for masks whose values are classes saved as evenly spaced greys (even_grey_levels)."""
    n = len(levels)
    void = isinstance(levels, LevelsBesideVoid)  # {0, 100, 255}: void beside a class saved as 100, not binary
    if n == 2 and not void:  # 0/65535 in 16-bit files, 0/128: binary, whatever level the foreground was saved at
        return (f"the masks' values {format_values(levels)} look like binary masks with their foreground saved as "
                f"{levels[1]}: save it as 1 (or 255) with num_classes=1")
    return (f"the masks' values {format_values(levels)}{f' (and {IGNORE_INDEX}, void)' if void else ''} look like "
            f"{n} classes saved as evenly spaced greys: save class i as value i (0..{n - 1}) and set num_classes={n}")


def grey_palette_hint(path):
    """The fix for a mask palette_indices read by a short grey palette's greys (a PNG optimiser's way) whose
    indices may be the classes ([black, white, grey] for 0, 1, 2 read as 0, 255, 128), else None."""
    reader = pillow_reader(path, (".png", ".bmp"))
    if reader is None:
        return None
    try:
        with reader(path) as image:
            raw = np.asarray(image) if image.mode == "P" else None
    except (OSError, SyntaxError, ValueError):
        return None
    if raw is None or np.array_equal(palette_indices(path), raw):  # read by its indices
        return None
    return (f"it is a palette image of greys, read by its greys as a viewer shows it; if its palette indices "
            f"({format_values(np.unique(raw).tolist())}) are the classes, save it as plain grey values (class i "
            f"as level i)")


def check_not_jpeg(path, values):
    """A class mask stored as JPEG (lossy_format), whatever its name: its edge noise could pass as classes
    ('holds class 2: set num_classes=3' led to training on it). Only the name is looked at on every start-up;
    the bytes where the name says JPEG or the values are wrong, or the data check found a TIFF's codec JPEG."""
    lossy = lossy_format(path)
    if lossy:
        # a quality-100 JPEG of block-aligned shapes decodes exactly: 'changes class indices (values 0, 255)' was
        # a claim its own numbers did not show
        raise UserError(f"mask {path} is {lossy}: lossy compression can change class indices along every edge, and "
                        f"its values ({format_values(sorted(values))}) cannot show which pixels kept theirs: save "
                        f"masks as PNG")


# TIFF compressions that are JPEG (tifffile's COMPRESSION: 6 old-style JPEG, 7 JPEG, 34892 lossy JPEG): a mask
# so stored is refused; and those lossy or lossless by their settings, which the file does not tell: noted.
JPEG_TIFF_COMPRESSIONS = (6, 7, 34892)
MAYBE_LOSSY_TIFF_COMPRESSIONS = {22610: "JPEG XR", 33003: "JPEG 2000", 33005: "JPEG 2000", 34712: "JPEG 2000",
                                 34887: "LERC", 34934: "JPEG XR", 50001: "WebP", 50002: "JPEG XL", 52546: "JPEG XL"}


def lossy_format(path):
    """'a JPEG' where a file's bytes are one (format_suffix), 'a JPEG-compressed TIFF' where a TIFF's first
    image is stored so, else None."""
    if format_suffix(path) == ".jpg":
        return "a JPEG"
    if tiff_codec(path) == "JPEG":
        return "a JPEG-compressed TIFF"
    return None


def mask_codec(path):
    """'JPEG' where a mask file is a JPEG by its bytes, whatever its name (a JPEG named .png, a converter's output
    renamed, passed with 37 edge pixels of a class-2 square made class 1), else its TIFF codec (tiff_codec)."""
    return "JPEG" if format_suffix(path) == ".jpg" else tiff_codec(path)


def refuse_jpeg_codec(path, values, codec, num_classes):
    """check_not_jpeg for a mask stored as JPEG (mask_codec): a class mask, or a JPEG-compressed TIFF. A binary
    JPEG file is judged by its values (check_mask_values: JPEG's noise is not 0/1 or 0/255), as one named .jpg."""
    if codec == "JPEG" and (num_classes > 1 or is_tiff(path)):
        check_not_jpeg(path, values)


def tiff_codec(path):
    """'JPEG', or the name of a codec that may be lossy (MAYBE_LOSSY_TIFF_COMPRESSIONS), where a TIFF's first
    image is stored so; else None (another compression, or not a TIFF)."""
    if not is_tiff(path):
        return None
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            compression = int(tif.pages.first.compression)
    except Exception:  # noqa: BLE001 - as tiff_header: the read itself says what is wrong
        return None
    return "JPEG" if compression in JPEG_TIFF_COMPRESSIONS else MAYBE_LOSSY_TIFF_COMPRESSIONS.get(compression)


def binary_others(values):
    """'<n> of <m> hold only 0/255' (or 0/1) where at least 90% of the masks are binary one way, else None:
    a binary set with one odd mask, whose fix is the mask, not num_classes."""
    for convention, allowed in (("0/255", {0, 255}), ("0/1", {0, 1})):
        n = sum(v <= allowed for v in values)
        if n >= 0.9 * len(values) and n < len(values):
            return f"{n} of {len(values)} hold only {convention}"
    return None


def not_class_indices(values):
    """The values that cannot be class indices: negative, fractional, NaN/inf. Whole-numbered floats
    (a float32 TIFF of 0.0/1.0/2.0) are accepted: they convert to uint8 exactly."""
    return sorted((v for v in values if not (math.isfinite(v) and v >= 0 and v == int(v))),
                  key=lambda v: (math.isnan(v), v))


def format_values(values, limit=8):
    return f"[{first_few([value_text(v) for v in values[:limit + 1]], limit)}]"  # one past the limit: ', ...' or not


def value_text(v):
    """A mask value as short as it reads back: 6 digits where they do (0.5, 255), more where they would show
    a value that is not whole as whole (a float32 0.9999999 is not class 1) or cut a large integer."""
    for digits in range(6, 18):
        text = f"{v:.{digits}g}"
        if v in (float(text), float(np.float32(text))):  # float32 masks: the float32's own shortest digits
            return text
    return f"{v:g}"  # nan, inf


def first_few(items, limit=3):
    """'a, b, c, ...': the first `limit` of items (strings) for a message, with ', ...' where there are more."""
    return ", ".join(items[:limit]) + (", ..." if len(items) > limit else "")


def mask_hint(path, dtype, values, at_least=0):
    if np.dtype(dtype) != np.uint8:
        return f"this {dtype} mask needs saving as 8-bit 0/255 or 0/1"
    lossy = lossy_format(path)
    if lossy:
        return f"it is {lossy}, whose compression blurs the edges: save masks as PNG"
    classes = values - {IGNORE_INDEX}
    if len(classes) <= 16 and max(classes) < 16:
        void = f" ({IGNORE_INDEX} = void there)" if IGNORE_INDEX in values else ""
        return f"class indices? set num_classes={max(max(classes) + 1, 2, at_least)}{void}"
    return "anti-aliased edges? save masks with exact values only"


CHECK_CACHE_NAME = ".unet_amp_data_check.json"  # in data_dir, else in checkpoint_dir (read-only data)

CHECK_CACHE_VERSION = 13  # 2: stamps with ctime (file_stamp); 3: images' dtype and value range (image_facts);
                         # 4: masks' pixel count per value (class_pixel_counts); 5: images' in_channels;
                         # 6: images' EXIF orientation (exif_turned_images); 7: colour read as grey
                         # (colour_read_as_grey); 8: a full grey palette read by index (palette_indices),
                         # LZW TIFFs by tifffile, as stored (imagecodecs); a TIFF's extra channel that is
                         # not alpha (extra_channels_dropped); colour in wide images by their span (holds_colour);
                         # 9: a TIFF mask's lossy codec (tiff_codec); 10: MinIsWhite images as shown (as_shown);
                         # 11: wide images' span without their outer 1% each side (range_leaves_out);
                         # 12: damaged JPEGs (jpeg_decode) and truncated TIFFs (check_tiff_complete) refused;
                         # 13: a mask that is a JPEG by its bytes, whatever its name (codec "JPEG")


def check_pairs(pairs, cfg):
    """Check every image and mask before training, so a bad file stops the run at minute 0.

    Each file is decoded once: its result (size; a mask's set of values) is cached by path and
    file_stamp, so later runs only stat the files. Under torchrun each rank checks its share of the
    pairs, all exchange their results, and rank 0 writes the cache.
    """
    paths = [os.path.abspath(p) for pair in pairs for p in pair]  # keys valid from any working dir
    CHECKED_HERE.clear()  # a start-up's check trusts the caches and the files, not an earlier run's memory
    facts = checked_facts(paths, cfg, write=DIST.is_main, share=True)
    barrier()  # every rank has the exchanged facts; this keeps them in step until rank 0's cache is on disk
    said_once_where_alike(check_pair_facts, pairs, facts, cfg)  # every process judges the same facts


def size_mismatch(image_path, hw, mask_hw, pairs, facts):
    """The error for an image and mask of different sizes, with how many other pairs differ (each run
    named one: a folder of them took a run per pair)."""
    turned = exif_turn(image_path, hw)
    if turned:
        fix = ""
    elif tuple(mask_hw) == tuple(hw)[::-1]:  # resizing as said below would squash a turned mask onto the image
        fix = (": its width and height are the image's swapped (a mask turned or transposed by a quarter?): turn "
               "it to match the image, or pair it with its own image")
    else:
        fix = (f": resize the mask to {hw[1]}x{hw[0]} with nearest-neighbour interpolation (class values stay "
               f"exact), or pair it with its own image")
    more = sum(facts[os.path.abspath(i)]["hw"] != facts[os.path.abspath(m)]["hw"] for i, m in pairs) - 1
    return (f"image {image_path} is {hw[1]}x{hw[0]}{turned} but its mask is {mask_hw[1]}x{mask_hw[0]}: they must "
            f"have the same size{fix}" + (f" ({more} other pair(s) differ in size too)" if more else ""))


def check_pair_facts(pairs, facts, cfg):
    """check_pairs' verdict on the data check's facts: a UserError for a bad mask or pair, else its notes."""
    values = [set(facts[os.path.abspath(m)]["values"]) for _, m in pairs]
    others = binary_others(values)  # once: per pair it would compare every mask with every other
    greys = even_grey_levels(set().union(*values))  # the set's: one mask may hold only some of the levels
    at_least = set_classes(values, cfg)
    for (image_path, mask_path), found in zip(pairs, values):
        image, mask = facts[os.path.abspath(image_path)], facts[os.path.abspath(mask_path)]
        refuse_jpeg_codec(mask_path, found, mask.get("codec"), cfg["num_classes"])
        check_mask_values(mask_path, found, cfg["num_classes"], mask["dtype"], others, greys, at_least)
        if image["hw"] != mask["hw"]:
            raise UserError(size_mismatch(image_path, image["hw"], mask["hw"], pairs, facts))
    if all(v <= {0} for v in values):
        raise UserError(f"every mask is all 0: there is no foreground to learn, and IoU would be 1.0 for a model "
                        f"that predicts none, less for any that does (it cannot rank models); check that the masks "
                        f"were saved with their labels")
    if cfg["num_classes"] == 1 and not any(0 in v for v in values):
        raise UserError(f"no mask holds a 0 (background): every pixel is foreground, so there is nothing to tell "
                        f"apart, and IoU would be 1 whatever the model does; check that the masks were saved with "
                        f"their labels, 0 for background")
    if cfg["num_classes"] > 1 and all(v <= {0, IGNORE_INDEX} for v in values):
        palette = next(filter(None, map(grey_palette_hint, (m for _, m in pairs[:20]))), None)
        raise UserError(f"every mask holds only 0 and {IGNORE_INDEX}: with num_classes={cfg['num_classes']} "
                        f"{IGNORE_INDEX} means void (ignored), so nothing would be learnt; for binary "
                        f"0/255 masks use num_classes=1" + (f"; or: {palette}" if palette else ""))
    notes = [mixed_binary_masks(pairs, values, cfg), exif_turned_images(pairs, facts), absent_classes(values, cfg),
             colour_read_as_grey(pairs, facts), extra_channels_dropped(pairs, facts),
             thin_in_fit_mode(pairs, facts, cfg), enlarged_in_fit_mode(pairs, facts, cfg),
             maybe_lossy_masks(pairs, facts)]
    for note in filter(None, notes if DIST.is_main else ()):
        print(note)


def set_classes(values, cfg):
    """The num_classes the whole set asks for, for a fix to suggest: its masks' largest class index + 1 where
    their indices are dense (the largest under twice as many as there are: 0..20 of a VOC-like set, not a
    stray 200, which each mask's own hint names), else the largest below 16; or class_names.txt's lines
    where more. The first bad mask's own values suggested num_classes=3, and the next mask, holding
    class 3, was refused then."""
    whole = {int(v) for v in set().union(*values) if math.isfinite(v) and v == int(v) and 0 <= v < IGNORE_INDEX}
    dense = whole and max(whole) < 2 * len(whole)
    top = max(whole) if dense else max((v for v in whole if v < 16), default=0)
    try:
        named = class_name_lines(Path(cfg["data_dir"], "class_names.txt"))
    except (OSError, UnicodeDecodeError):  # none, or unreadable: load_class_names says so in its turn
        named = []
    return max(top + 1, len(named))


def absent_classes(values, cfg):
    """A note where classes below num_classes appear in no mask (num_classes set too high?): the model still
    has an output for each, and the mean IoU, val_iou, counts them wherever the model predicts them."""
    if cfg["num_classes"] < 2:
        return None
    present = set().union(*values)
    absent = [c for c in range(cfg["num_classes"]) if c not in present]
    if not absent:
        return None
    names = first_few([str(v) for v in absent], 5)
    top = int(max(present - {IGNORE_INDEX}))
    fits = (f"if the masks hold classes 0-{top}, num_classes={top + 1} fits them; " if top + 1 < cfg["num_classes"]
            else "")
    return (f"note: class(es) {names} of num_classes={cfg['num_classes']} appear in no mask: {fits}a class the model "
            f"predicts but no mask holds counts as IoU 0 in val_iou")


def flag_note(pairs, facts, key, say):
    """say(how many, an example's name) where images' data-check facts carry the flag `key` (image_facts'),
    else None."""
    flagged = [image for image, _ in pairs if facts[os.path.abspath(image)].get(key)]
    return say(len(flagged), Path(flagged[0]).name) if flagged else None


def colour_read_as_grey(pairs, facts):
    """A note where in_channels=1 reads colour images as grey (their luminance): right for colour scans of
    grey data, a loss where colour tells the classes apart (stains, vegetation, lesions)."""
    return flag_note(pairs, facts, "colour", lambda n, name: (
        f"note: {n} of {len(pairs)} image(s) hold colour (e.g. {name}) but in_channels=1 reads them as grey, their "
        f"luminance; if colour tells the classes apart, set in_channels=3"))


def extra_channels_dropped(pairs, facts):
    """A note where images hold a channel the model never sees that is not alpha (extra_channel_not_alpha):
    RGB + near-infrared trained on the RGB alone, unsaid, where the near-infrared told the classes apart."""
    return flag_note(pairs, facts, "extra", lambda n, name: (
        f"note: {n} of {len(pairs)} image(s) hold a channel that is not alpha beside their grey or RGB (e.g. {name}: "
        f"a TIFF extra sample such as near-infrared), and it is dropped: the model takes in_channels=1 or 3; if it "
        f"tells the classes apart, save it in place of one of those"))


def maybe_lossy_masks(pairs, facts):
    """A note where masks are TIFFs compressed with a codec that is lossy by its settings (JPEG 2000, WebP...):
    saved lossy, the class indices change along every edge, within the classes where the noise is small."""
    masks = [(mask, facts[os.path.abspath(mask)].get("codec")) for _, mask in pairs]
    found = [(mask, codec) for mask, codec in masks if codec not in (None, "JPEG")]
    if not found:
        return None
    (mask, codec), n = found[0], len(found)
    return (f"note: {n} mask(s) are TIFFs compressed with a codec that can be lossy (e.g. {Path(mask).name}: {codec}): "
            f"saved lossy, their class indices change along every edge; unless they were saved lossless, save masks "
            f"as PNG")


def thin_in_fit_mode(pairs, facts, cfg):
    """A note where fit mode's resize leaves images under FIT_THIN_SIDE px across (fitted_thin)."""
    if cfg["data_mode"] != "fit":
        return None
    thin = [(image, fitted) for image, _ in pairs
            for fitted in [fitted_thin(facts[os.path.abspath(image)]["hw"], cfg["image_size"])] if fitted]
    if not thin:
        return None
    (image, (fh, fw)), (h, w) = thin[0], facts[os.path.abspath(thin[0][0])]["hw"]
    return (f"note: {len(thin)} of {len(pairs)} image(s) are so elongated that fit mode (longest side to image_size="
            f"{cfg['image_size']}) leaves them under {FIT_THIN_SIDE} px across (e.g. {Path(image).name}: {w}x{h} -> "
            f"{fw}x{fh}): their detail across is lost; data_mode=patch trains on them at full resolution")


def enlarged_in_fit_mode(pairs, facts, cfg):
    """A note where fit mode enlarges every image FIT_ENLARGED times or more (image_size=512 on 128 px images:
    16 times the compute and memory per image, no detail gained), else None."""
    largest = max(max(facts[os.path.abspath(image)]["hw"]) for image, _ in pairs)
    if cfg["data_mode"] != "fit" or cfg["image_size"] < FIT_ENLARGED * largest:
        return None
    least = 2 * MODEL_STRIDE if cfg["batch_size"] == 1 else MODEL_STRIDE  # batch_size=1 at 32 px is refused
    keeps = max(least, math.ceil(largest / MODEL_STRIDE) * MODEL_STRIDE)
    times = cfg["image_size"] / largest
    fix = f"image_size={keeps} keeps them about as they are" if keeps < cfg["image_size"] else \
        f"image_size={cfg['image_size']} is the least the model takes{' at batch_size=1' * (least > MODEL_STRIDE)}: " \
        f"they cannot stay smaller"  # 'image_size=32 keeps them about as they are' was said at image_size=32
    return (f"note: every image is at most {largest} px on its longer side: fit mode enlarges them to image_size="
            f"{cfg['image_size']} ({times:.3g} times), at about {times ** 2:.0f} times the compute and memory per "
            f"image, with no detail gained: {fix}")


# fit mode enlarging every image this many times or more gets a note (enlarged_in_fit_mode)
FIT_ENLARGED = 2


# fit mode resizes an image's longest side to image_size: one so elongated that its short side then falls under
# this many pixels, from more, loses its detail across (a 1000x40 strip at 64 px: 64x3); patch mode keeps it.
FIT_THIN_SIDE = 16


def fitted_thin(hw, size):
    """(h, w) an image of size hw takes in fit mode (fit_transforms' LongestMaxSize) where that leaves its short
    side under FIT_THIN_SIDE px and shorter than it was, else None."""
    scale = size / max(hw)
    fitted = tuple(max(1, round(side * scale)) for side in hw)
    return fitted if min(fitted) < FIT_THIN_SIDE and min(fitted) < min(hw) else None


def exif_turned_images(pairs, facts):
    """A note where images are read turned or mirrored by their EXIF Orientation while masks are read as
    stored: right for a mask drawn on the image as viewers show it, misaligned for one drawn on the stored
    pixels, which the size check cannot see for a half turn, a mirror, or a square image (a quarter turn
    of any other passed the size check only with a mask drawn on the turned image: not counted)."""
    entries = [(image, facts[os.path.abspath(image)]) for image, _ in pairs]
    turned = [(image, entry["orientation"]) for image, entry in entries if entry.get("orientation")
              and not (entry["orientation"] in QUARTER_TURNS and entry["hw"][0] != entry["hw"][1])]
    if not turned:
        return None
    (example, tag), n = turned[0], len(turned)
    return (f"note: {n} image(s) carry an EXIF Orientation that OpenCV applies when reading them (e.g. "
            f"{Path(example).name}: tag {tag}, {EXIF_TURNS[tag]}); their masks are read as stored, so they must be "
            f"drawn on the image as viewers show it (labelme does); a mask drawn on the stored pixels is misaligned: "
            f"look at one beside its mask (notebooks/my_run.ipynb shows them side by side)")


def mixed_binary_masks(pairs, values, cfg):
    """A note where, with classes, some masks hold only 0 and 255 while others hold classes: the two binary
    conventions (0/1, 0/255) mixed in one set, or a binary set given num_classes > 1 for one odd mask. 255
    is void there, so those masks' foreground is ignored."""
    void_only = sorted((str(mask), 0 in v) for (_, mask), v in zip(pairs, values)
                       if IGNORE_INDEX in v and v <= {0, IGNORE_INDEX})  # the first by name is named
    if any(IGNORE_INDEX in v and v - {0, IGNORE_INDEX} for v in values):  # masks with classes use 255 as void too:
        void_only = [(mask, zero) for mask, zero in void_only if not zero]  # 0/255 ones are negatives with void
    classes = sorted(set().union(*values) - {0, IGNORE_INDEX})
    if cfg["num_classes"] < 2 or not void_only or not classes:
        return None
    kinds = {with_zero for _, with_zero in void_only}  # all void (every pixel 255) says nothing of 0s
    what = {frozenset({True}): f"only 0 and {IGNORE_INDEX}", frozenset({False}): f"only {IGNORE_INDEX}",
            frozenset({True, False}): f"only 0 and {IGNORE_INDEX}, or only {IGNORE_INDEX}"}[frozenset(kinds)]
    ignored = "their foreground is ignored" if True in kinds else "those images are ignored whole"
    return (f"note: {len(void_only)} of {len(values)} mask(s) hold {what} (e.g. {Path(void_only[0][0]).name}) while "
            f"others hold class(es) {format_values(classes, 3)}: with num_classes={cfg['num_classes']} {IGNORE_INDEX} "
            f"is void, so {ignored}; if {IGNORE_INDEX} is their foreground, save them with its class index (binary: "
            f"num_classes=1, the masks 0/1 or 0/255)")


def exif_turn(path, hw):
    """Where an image read as `hw` was turned a quarter by its EXIF Orientation tag (OpenCV applies it, as
    cameras and viewers do; file managers and Pillow's .size give the stored size; tifffile ignores it):
    words saying so, else "". The tag as the data check reads it (exif_orientation); read turned, the
    image is stored as `hw`'s width and height swapped."""
    turn = exif_orientation(path)
    if turn not in QUARTER_TURNS or hw[0] == hw[1]:
        return ""
    return (f" as read (stored {hw[0]}x{hw[1]}, turned by its EXIF Orientation tag {turn}; draw the mask on the "
            f"turned image)")


def checked_facts(paths, cfg, write, share=False):
    """{path: facts} for every file (image, mask, image, mask, ...), decoding only those no cache knows
    in their present state. share=True, called by every rank: each checks whole pairs r, r + world, ...
    and all receive every rank's facts, so a large first check takes 1/world of the time on each."""
    cache_paths = check_cache_paths(cfg)
    caches = [load_check_cache(path) for path in cache_paths]
    known = [*caches, CHECKED_HERE]  # a file checked earlier in this process: not decoded again
    mine = [p for i, p in enumerate(paths) if i // 2 % DIST.world == DIST.rank] if share else paths
    masks = set(paths[1::2])
    stamps = {p: file_stamp(p) for p in mine}
    facts = {p: known_facts(known, p, stamps[p], p in masks, cfg["in_channels"]) for p in mine}
    todo = [p for p in mine if facts[p] is None]
    if len(todo) >= DATA_CHECK_SAY_FILES and DIST.is_main:  # the first check of a large set: minutes, said
        print(f"data check: reading {len(todo)} file(s) not checked before (once: the answers are cached)...",
              flush=True)

    def check(path):
        if path in masks:
            mask = decode_mask(path)
            values, counts = np.unique(mask, return_counts=True)
            codec = mask_codec(path)  # a JPEG's noise can stay within the classes: its values cannot tell
            return {"hw": list(mask.shape[:2]), "values": values.tolist(), "counts": counts.tolist(),
                    "dtype": str(mask.dtype), **({"codec": codec} if codec else {})}
        return image_facts(path, cfg["in_channels"])

    def check_or_fail(path):
        try:
            return check(path)
        except UserError as exc:
            return exc
    with ThreadPoolExecutor(max_workers=4) as pool:  # cv2 releases the GIL while decoding
        for path, found in zip(todo, pool.map(check_or_fail, todo)):
            facts[path] = found if isinstance(found, UserError) else {"stamp": stamps[path], **found}
    if share:  # the files a rank could not read too: every rank then says the same error, said once
        facts = {p: entry for part in gather_setup(facts) for p, entry in part.items()}
    order = {p: i for i, p in enumerate(paths)}
    failed = sorted(((p, f) for p, f in facts.items() if isinstance(f, UserError)), key=lambda pf: order[pf[0]])
    if failed:
        if write:  # the files read so far are not read again by the run after the fix
            save_check_cache(cache_paths, caches, {p: f for p, f in facts.items() if not isinstance(f, UserError)})
        error = files_failed(failed)
        if share:
            said_once_if_alike(error)  # under torchrun: it was '[rank 1] cannot read', '[rank 0] stopped'
        raise error
    CHECKED_HERE.update(facts)
    if write:
        save_check_cache(cache_paths, caches, facts)
    return facts


def files_failed(failed):
    """The data check's error for the files it could not read: the first one's, with how many others (each
    run named one: a folder with several damaged files took a run per file)."""
    (_, first), others = failed[0], [Path(p).name for p, _ in failed[1:]]
    if not others:
        return first
    return UserError(f"{user_message(first)}; {len(others)} other file(s) fail the check too ("
                     + first_few(others) + ")")


def start_up_facts(pairs, cfg):
    """{path: facts} for the pairs' files: this start-up's own (CHECKED_HERE, held from check_pairs until the
    loaders are built or the start-up fails) where its check holds them all, so each later question (the
    intensity range, class counts, cache size...) neither stats every file nor loads the caches again; else
    from checked_facts (a caller outside a start-up: a tool, a notebook)."""
    paths = [os.path.abspath(p) for pair in pairs for p in pair]
    images = paths[::2]
    if all(p in CHECKED_HERE for p in paths) and \
            all(CHECKED_HERE[p].get("channels") == cfg["in_channels"] for p in images):
        return CHECKED_HERE
    return checked_facts(paths, cfg, write=False)


DATA_CHECK_SAY_FILES = 500  # a data check that reads this many files or more says so before it starts


# Facts checked_facts found since this process's last check_pairs, by path, stamped like the caches'
# entries: the start-up's later questions (learnt_intensity_range, cache_bytes, image_sizes) take them
# (start_up_facts) with no decoding, stat or cache load, and under torchrun they take the facts the ranks
# exchanged. Cleared once build_loaders has asked them, or where the start-up stopped on an error (train).
CHECKED_HERE = {}


def image_facts(path, channels):
    """What the data check keeps of an image: its size and, for integers wider than 8 bits, their
    [min, max] (learnt_intensity_range) and their bulk_span (range_leaves_out). Checked as read_image would
    check it, on the decoded pixels only: no scaled float copy (4 bytes a value, in each of the check's
    threads) just to learn a size."""
    image = decode_image(path, channels)
    check_pixels(image, path)
    values = without_alpha(image)  # what the network sees: an opaque 16-bit alpha is not data
    check_channels(values, path)
    facts = {"hw": list(image.shape[:2]), "dtype": str(image.dtype), "channels": channels}  # dtype: cache_bytes' depth
    if np.issubdtype(image.dtype, np.integer) and image.dtype != np.uint8:
        facts["range"] = [int(values.min()), int(values.max())]
        facts["bulk"] = bulk_span(values)
    orientation = exif_orientation(path)
    if orientation:
        facts["orientation"] = orientation
    if channels == 1 and holds_colour(path, values):
        facts["colour"] = True  # read as grey all the same (to_channels, the decoder): colour_read_as_grey
    if extra_channel_not_alpha(path, image):
        facts["extra"] = True  # dropped all the same (without_alpha): extra_channels_dropped
    return facts


def bulk_span(values):
    """[low, high] of integer pixels: the least value with over OUTSIDE_RANGE_SHARE of them at or below it, and
    the least with 1 - OUTSIDE_RANGE_SHARE at or below it, so a range that starts above low or ends below high
    leaves more than that share outside it, and only such a range (range_leaves_out). Up to 16 bits from a
    histogram counted in bands of rows: np.quantile sorts a copy of the whole image (2x its bytes at the peak)."""
    if values.dtype.itemsize > 2:
        return [int(v) for v in np.quantile(values, [OUTSIDE_RANGE_SHARE, 1 - OUTSIDE_RANGE_SHARE], method="lower")]
    offset = -int(np.iinfo(values.dtype).min)
    counts = np.zeros(2 ** (8 * values.dtype.itemsize), np.int64)
    rows = max(1, 2 ** 14 // max(1, values[:1].size))  # bands of about 128 kB as bincount's intp
    for top in range(0, values.shape[0], rows):
        band = values[top:top + rows].astype(np.intp).ravel()
        band += offset
        found = np.bincount(band)  # as long as the band's top value: 512 kB at most
        counts[:found.size] += found
    cumulative = np.cumsum(counts, out=counts)
    low = np.searchsorted(cumulative, OUTSIDE_RANGE_SHARE * cumulative[-1], side="right")
    high = np.searchsorted(cumulative, (1 - OUTSIDE_RANGE_SHARE) * cumulative[-1], side="left")
    return [int(low) - offset, int(high) - offset]


def extra_channel_not_alpha(path, image):
    """Whether the channel without_alpha drops, a grey image's 2nd or an RGB image's 4th, is a TIFF's extra
    sample declared no alpha ('unspecified': near-infrared, a second band), or undeclared and not constant
    (OpenCV writes RGBA TIFFs without the tag, their alpha often all opaque)."""
    if image.ndim != 3 or image.shape[2] not in (2, 4) or not is_tiff(path):
        return False
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            extra = tuple(tif.series[0].keyframe.extrasamples)
    except Exception:  # noqa: BLE001 - as tiff_header: the read itself has succeeded
        return False
    if extra:
        return int(extra[0]) == 0
    return bool(image[..., -1].min() != image[..., -1].max())


GREY_MODES = ("1", "L", "LA", "I", "I;16", "I;16B", "I;16L", "F")  # Pillow's modes of grey files


def holds_colour(path, decoded):
    """Whether an image read for in_channels=1 holds colour that grey drops: channels that differ by more
    than 3 levels of 255 of its span anywhere (a grey image saved as RGB, JPEG's rounding included, does not). A TIFF
    comes decoded in colour; a file whose header says grey is not decoded again; others are, in colour."""
    if decoded.ndim == 3 or is_tiff(path):
        colour = decoded
    elif header_says_grey(path):
        return False
    else:
        colour = without_alpha(opencv_read(path, cv2.IMREAD_ANYDEPTH | cv2.IMREAD_COLOR, "image"))
    if colour.ndim != 3:
        return False
    # 3 levels of 255 of what scale_image maps to 0-1: an 8-bit image's 0-255; wider ones and floats by their
    # values' span (12-bit data in 16-bit files spans about 4095, not the type's 65535: 771 levels hid colour)
    span = 255 if colour.dtype == np.uint8 else float(colour.max()) - float(colour.min())
    tolerance = 3 * span / 255
    for top in range(0, colour.shape[0], 256):  # in bands: a large scene's float copy stays a band's size
        band = colour[top:top + 256].astype(np.float32)
        if any((np.abs(band[..., c] - band[..., c + 1]) > tolerance).any() for c in (0, 1)):
            return True
    return False


def header_says_grey(path):
    """Whether a PNG, BMP or JPEG header says grey: a grey mode, or a palette of greys. False where it says
    colour or cannot be read here."""
    reader = pillow_reader(path)
    if reader is None:
        return False
    try:
        with reader(path) as image:  # the header only (a PNG's palette comes before its pixels)
            return image.mode in GREY_MODES or image.mode == "P" and all_grey(palette_entries(image))
    except (OSError, SyntaxError, ValueError):  # a header the reader refuses: decoded in colour to look
        return False


def palette_entries(image):
    """A Pillow palette image's palette as N x 3 uint8 entries (one black entry where it has none)."""
    return np.asarray(image.getpalette() or [0, 0, 0], np.uint8).reshape(-1, 3)


def display_ramp(entries):
    """Whether a palette is the 256-level inverted grey ramp (entry i = 255 - i): ImageJ's inverting LUT."""
    return len(entries) == 256 and bool((entries[:, 0] == 255 - np.arange(256)).all())


def all_grey(entries):
    """Whether every palette entry is a grey (R = G = B)."""
    return bool((entries == entries[:, :1]).all())


def exif_orientation(path):
    """The EXIF Orientation tag (2-8) OpenCV applied when it read this image, or None: it turns or mirrors
    JPEG and PNG files by it (as cameras and viewers show them); BMP has no such tag, and tifffile reads
    TIFFs as stored. From the header, by the format's own reader (pillow_reader: no decompression-bomb
    limit, so no warning for a large scan)."""
    from PIL import Image

    reader = pillow_reader(path, (".png", ".jpg", ".jpeg"))
    if reader is None:
        return None
    try:
        with reader(path) as image:  # the header only: no pixels decoded
            exif = image.info.get("exif")  # not getexif(): for a PNG that decodes every pixel to look on
        tags = Image.Exif()
        tags.load(exif or b"")
    except Exception:  # noqa: BLE001 - a file Pillow cannot open (OpenCV read it): no tag to report
        return None
    tag = tags.get(EXIF_ORIENTATION)
    return tag if tag in EXIF_TURNS else None


EXIF_TURNS = {2: "mirrored", 3: "turned 180°", 4: "mirrored upside down", 5: "turned and mirrored",
              6: "turned 90° clockwise", 7: "turned and mirrored", 8: "turned 90° counter-clockwise"}


def learnt_intensity_range(pairs, cfg):
    """scale_image's range for integer images wider than 8 bits: [min, max] over the training images
    (12-bit data in 16-bit files -> about [0, 4095]). Any gain and offset of the encoding drop out:
    12-bit, 16-bit and offset copies of one data set give the network the same values, those of an
    8-bit copy that spans 0..255. Chosen by measurement (BENCHMARKS.md "Bit depths"): on a camera-like copy
    with a dark offset, [min, max] trained to a 0.02 higher IoU than the range rounded out to whole bits
    (0..4095), and percentiles, which clip, did not beat it. None: no such images (8-bit and float
    files have their own rules) or all of one value. From the data check's cache: no decoding."""
    facts = start_up_facts(pairs, cfg)
    ranges = [facts[os.path.abspath(image)].get("range") for image, _ in pairs]
    ranges = [r for r in ranges if r is not None]
    if not ranges:
        return None
    low, high = min(r[0] for r in ranges), max(r[1] for r in ranges)
    return [low, high] if high > low else None


def range_set_by_few(pairs, cfg, found):
    """A note where the learnt range is set by one image's maximum or minimum (a hot pixel, a saturated
    frame) standing apart from the rest (further out than the rest's own span), and the others use under half
    of it: every other image reached the model squashed into a fraction of 0-1, said only by the config's
    intensity_range line. Else None."""
    facts = start_up_facts(pairs, cfg)
    ranged = [(facts[os.path.abspath(image)]["range"], Path(image).name) for image, _ in pairs
              if facts[os.path.abspath(image)].get("range") is not None]
    if len(ranged) < 3:  # two images: neither is "the rest"
        return None
    top, bottom = max(ranged, key=lambda r: r[0][1]), min(ranged, key=lambda r: r[0][0])
    core = (min(r[0][0] for r in ranged if r is not bottom), max(r[0][1] for r in ranged if r is not top))
    span = core[1] - core[0]
    apart = {"maximum": found[1] - core[1] > span > 0, "minimum": core[0] - found[0] > span > 0}
    low, high = (core[0] if apart["minimum"] else found[0]), (core[1] if apart["maximum"] else found[1])
    if not any(apart.values()) or 2 * (high - low) >= found[1] - found[0]:
        return None
    by = [(name, f"{name}'s {what} ({value})") for value, name, what in
          ((found[1], top[1], "maximum"), (found[0], bottom[1], "minimum")) if apart[what]]
    others = len(ranged) - len({name for name, _ in by})
    return (f"intensity_range={found} is set by {' and '.join(text for _, text in by)}; the other {others} "
            f"training image(s) lie within [{low}, {high}], under half of it, so they reach the model squashed: if "
            f"{low}-{high} is the data's range (a hot pixel, a saturated frame?), set intensity_range={low},{high}")


def range_unused(train_pairs, val_pairs, cfg):
    """A note where intensity_range is given but no image is an integer image wider than 8 bits, the only kind
    it maps (predict says the same of its images): the run trained as without it, unsaid. Else None."""
    pairs = [*train_pairs, *val_pairs]
    facts = start_up_facts(pairs, cfg)
    if any(facts[os.path.abspath(image)].get("range") is not None for image, _ in pairs):
        return None
    low, high = cfg["intensity_range"]
    return (f"intensity_range={low:g},{high:g} is not used: every image is 8-bit or float, and the range maps "
            f"integer images wider than 8 bits (8-bit images are divided by 255, float images mapped by their own "
            f"min and max); the checkpoint keeps it for predict's wider images")


def range_leaves_out(train_pairs, val_pairs, cfg, given):
    """A note where a given intensity_range leaves over OUTSIDE_RANGE_SHARE of an image's pixels below its low
    or above its high (by image_facts' bulk): scale_image maps them outside 0-1, unclipped, as predict's note
    on such images says (InputNotes), while RandomBrightnessContrast clips a float image to 0-1 (albumentations
    2.0.8, measured) in the share of training samples it is applied to. Else None."""
    (low, high), (out, ranged) = given, images_outside([*train_pairs, *val_pairs], cfg, given)
    if not out:
        return None
    (name, (least, most)), scale = out[0], lambda v: (v - low) / (high - low)  # noqa: E731 - scale_image's map
    learnt = learnt_intensity_range(train_pairs, cfg)
    return (f"{len(out)} of {ranged} image(s) wider than 8 bits have over {OUTSIDE_RANGE_SHARE:.0%} of their "
            f"pixels outside intensity_range={low:g},{high:g} (e.g. {name}, whose values span {least}-{most}): they "
            f"are mapped outside 0-1 (there {scale(least):.3g} to {scale(most):.3g}), clipped to 0-1 only by the "
            f"brightness augmentation, in half the training samples, not in validation or predict; check the range"
            + (f", or leave intensity_range=None to learn it from the training images ({learnt[0]},{learnt[1]} here)"
               if learnt else ""))


def val_outside_learnt(val_pairs, cfg, found):
    """A note where validation images have over OUTSIDE_RANGE_SHARE of their pixels outside the range learnt from
    the training images (a bit depth or an instrument the training images lack): they reach the model outside
    0-1, and the val IoU that picks best.pt scores them so, unsaid, while predict's note named such images.
    Else None."""
    said = outside_range_words(val_pairs, cfg, found, "validation image(s)", "learnt from the training images")
    return said and (f"{said}, and the val IoU that picks best.pt scores them so; if their bit depth or instrument "
                     f"differs, put such images in training too, or give intensity_range= a range that holds both")


def val_wider_than_training(val_pairs, cfg):
    """A note where validation images are 16-bit and no training image is wider than 8 bits: with no range
    learnt they are scaled from their type's range (12-bit data: 16 times too dark), and the val IoU that picks
    best.pt scores them so, unsaid, while predict's note named such images. Else None."""
    facts = start_up_facts(val_pairs, cfg)
    wide = [(Path(image).name, facts[os.path.abspath(image)]) for image, _ in val_pairs
            if facts[os.path.abspath(image)].get("range") is not None]
    if not wide:
        return None
    name, entry = wide[0]
    (least, most), (low, high) = entry["range"], dtype_range(np.dtype(entry["dtype"]))
    bits = narrow_bits(max(f["range"][1] for _, f in wide)) if low == 0 else None
    guess = (f" (if they hold {bits}-bit data, {2 ** (16 - bits)} times too dark)" if bits else "")
    return (f"{len(wide)} of {len(val_pairs)} validation image(s) are {np.dtype(entry['dtype'])} (e.g. {name}, values "
            f"{least}-{most}) but the training images are 8-bit or float, so no intensity_range was learnt: they are "
            f"scaled from {low}-{high}{guess}, and the val IoU that picks best.pt scores them so; put such images in "
            f"training too, or give intensity_range=" + (f"0,{2 ** bits - 1}" if bits else "low,high, their range"))


def resumed_range_note(train_pairs, val_pairs, cfg, state, record=None):
    """A resumed run's note where its files changed since it began (split_record's sizes or times: `record`, the
    one same_split_as_resumed took, else taken here) and its images now have over OUTSIDE_RANGE_SHARE of their
    pixels outside the range it keeps (edited 16 times brighter, it trained on them at up to 16, val loss 1.25
    -> 4.49, with only 'files changed'), else None. Data as the run had it: what lies outside was said at its
    start (val_outside_learnt, range_leaves_out), not at each resume."""
    record = record or split_record(train_pairs, val_pairs, cfg["data_dir"])  # a stat of every file: once
    was, saved = state.get("data_split") or {}, state["config"]["intensity_range"]
    if all(was.get(key, record[key]) == record[key] for key in ("sizes", "times")):
        return None
    said = outside_range_words([*train_pairs, *val_pairs], cfg, saved, "image(s)", "the run's, which a resume keeps")
    return said and f"{said}; if the data changed since the run began, start a new run in another checkpoint_dir"


def outside_range_words(pairs, cfg, given, which, whose):
    """'N of M <which> wider than 8 bits have over 1% of their pixels outside intensity_range=low,high, <whose>
    (e.g. ...): they reach the model outside 0-1 (there ...)', or None where no image is outside."""
    (low, high), (out, ranged) = given, images_outside(pairs, cfg, given)
    if not out:
        return None
    (name, (least, most)), scale = out[0], lambda v: (v - low) / (high - low)  # noqa: E731 - scale_image's map
    return (f"{len(out)} of {ranged} {which} wider than 8 bits have over {OUTSIDE_RANGE_SHARE:.0%} of their pixels "
            f"outside intensity_range={low:g},{high:g}, {whose} (e.g. {name}, whose values span {least}-{most}): "
            f"they reach the model outside 0-1 (there {scale(least):.3g} to {scale(most):.3g})")


def images_outside(pairs, cfg, given):
    """([(name, its (min, max))] of the images wider than 8 bits with over OUTSIDE_RANGE_SHARE of their pixels
    outside `given`, by image_facts' bulk; how many images wider than 8 bits there are)."""
    facts = start_up_facts(pairs, cfg)
    entries = [(Path(image).name, facts[os.path.abspath(image)]) for image, _ in pairs]
    ranged = [(name, entry) for name, entry in entries if entry.get("bulk") is not None]
    low, high = given
    return [(name, entry["range"]) for name, entry in ranged
            if entry["bulk"][0] < low or entry["bulk"][1] > high], len(ranged)


def class_pixel_counts(pairs, cfg):
    """Pixels of each class in the training masks, void left out (binary: [background, foreground]):
    class_weights=auto's frequencies. From the data check's facts: no decoding."""
    facts = start_up_facts(pairs, cfg)
    counts = np.zeros(max(2, cfg["num_classes"]), np.int64)
    for _, mask in pairs:
        entry = facts[os.path.abspath(mask)]
        for value, n in zip(entry["values"], entry["counts"]):
            if cfg["num_classes"] == 1:
                counts[int(value > 0)] += n  # 0/1 or 0/255
            elif value != IGNORE_INDEX:
                counts[int(value)] += n
    return counts


def file_stamp(path):
    """What tells a file's present state from the one checked: size and mtime, which copies that keep
    times (cp -p, rsync -a, tar) carry over, and ctime, which every write, copy, rename and os.utime
    sets to now and nothing sets back. Cheaper than hashing the contents, which would read every file
    at every start-up; no inode, which some network and FUSE mounts renumber at each mount."""
    try:
        return stat_stamp(os.stat(path))
    except OSError as exc:
        raise UserError(f"cannot read {path} ({exc.strerror}): fix its permissions or remove it") from None


def stat_stamp(stat):
    return [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns]


def known_facts(caches, path, stamp, mask, channels):
    """The first cache entry for path taken from the file as it is now, an image's read with `channels`
    (read as gray, an RGB image has another value range), or None: check it again."""
    for cache in caches:
        entry = cache.get(path)
        if entry_valid(entry, mask) and entry["stamp"] == stamp and (mask or entry.get("channels") == channels):
            return entry
    return None


def valid_span(span):
    """A value span as image_facts writes it: a pair of whole numbers, low <= high."""
    return isinstance(span, list) and len(span) == 2 and all(isinstance(n, int) for n in span) and span[0] <= span[1]


def entry_valid(entry, mask):
    """A whole entry, as checked_facts writes it: a damaged or hand-edited one counts as unchecked."""
    if not (isinstance(entry, dict) and isinstance(entry.get("stamp"), list) and len(entry["stamp"]) == 3
            and all(isinstance(n, int) for n in entry["stamp"]) and isinstance(entry.get("hw"), list)
            and len(entry["hw"]) == 2 and all(isinstance(n, int) and n > 0 for n in entry["hw"])):
        return False
    if not valid_dtype(entry.get("dtype")):
        return False
    if not mask:  # an image: a value range (image_facts) is a pair of whole numbers, low <= high
        span, bulk = entry.get("range"), entry.get("bulk")
        if (span is None) != (bulk is None) or not (bulk is None or valid_span(bulk)):
            return False
        if entry.get("orientation") not in (None, *EXIF_TURNS) or entry.get("colour") not in (None, True) \
                or entry.get("extra") not in (None, True):
            return False
        return span is None or valid_span(span)
    values, counts = entry.get("values"), entry.get("counts")
    if entry.get("codec") not in (None, "JPEG", *MAYBE_LOSSY_TIFF_COMPRESSIONS.values()):
        return False
    return (isinstance(values, list) and bool(values) and all(isinstance(v, (int, float)) for v in values)
            and isinstance(counts, list) and len(counts) == len(values)
            and all(isinstance(n, int) and n > 0 for n in counts))


def valid_dtype(name):
    try:
        return isinstance(name, str) and np.dtype(name).kind in "biuf"
    except TypeError:
        return False


def check_cache_paths(cfg):
    return [Path(cfg["data_dir"]) / CHECK_CACHE_NAME, Path(cfg["checkpoint_dir"]) / CHECK_CACHE_NAME]


def load_check_cache(path):
    """A cache's {path: entry}; a missing or damaged one is empty (its files are checked again)."""
    try:
        data = json.loads(path.read_text())
        if data.get("version") == CHECK_CACHE_VERSION and isinstance(data.get("files"), dict):
            return data["files"]
    except (OSError, ValueError, AttributeError, RecursionError):
        pass
    return {}


def save_check_cache(candidates, caches, facts):
    """Into the data folder if it is writable (shared by every run on it), else into checkpoint_dir;
    nothing is written where the first cache that takes it already holds these facts."""
    files = None
    for path, cache in zip(candidates, caches):
        if all(cache.get(p) == entry for p, entry in facts.items()):
            return path
        if files is None:
            files = {**entries_still_current(caches, facts), **facts}
        try:
            text = json.dumps({"version": CHECK_CACHE_VERSION, "files": files}, separators=(",", ":"))
            atomic_write(path, lambda tmp: Path(tmp).write_text(text))
            return path
        except OSError:
            continue
    return None


def entries_still_current(caches, skip):
    """The caches' entries for files other than skip that still match their file: other runs may use
    other subsets of data_dir (max_train_images) and keep theirs; files gone or changed are dropped."""
    kept = {}
    for cache in caches:
        for path, entry in cache.items():
            is_mask = isinstance(entry, dict) and "values" in entry
            if path in skip or path in kept or not entry_valid(entry, is_mask):
                continue
            try:
                if entry["stamp"] == stat_stamp(os.stat(path)):
                    kept[path] = entry
            except OSError:
                continue  # gone
    return kept


def training_samples(pairs, cfg):
    """Samples per epoch: images (fit), or patches (patch mode: patch_counts)."""
    return len(pairs) if cfg["data_mode"] == "fit" else sum(patch_counts(image_sizes(pairs, cfg), cfg))


def build_loaders(train_pairs, val_pairs, cfg, hw):
    common = loader_options(cfg, hw)
    train_set, val_set = build_datasets(train_pairs, val_pairs, cfg)
    # drop_last: every micro-batch has batch_size images, so accumulation weights are exact and
    # BatchNorm never sees a batch of one.
    if DIST.enabled:
        sampler = torch.utils.data.DistributedSampler(train_set, DIST.world, DIST.rank, shuffle=True,
                                                      seed=cfg["seed"], drop_last=True)
        train_loader = DataLoader(train_set, cfg["batch_size"], sampler=sampler, drop_last=True, **common)
    else:
        # The shuffle has its own generator: a DataLoader also draws from `generator` when it starts
        # an iterator, which persistent workers do only once, so sharing one would make the order
        # depend on whether the workers were kept (and differ after a resume).
        sampler = torch.utils.data.RandomSampler(train_set, generator=torch.Generator().manual_seed(cfg["seed"]))
        train_loader = DataLoader(train_set, cfg["batch_size"], sampler=sampler, drop_last=True,
                                  generator=torch.Generator().manual_seed(cfg["seed"]), **common)
    # Validation shards the set without padding (validation_shard): with the counts all-reduced, every
    # image is counted exactly once, so the IoU equals a single process's.
    if cfg["data_mode"] == "fit":
        val_loader = DataLoader(val_set, cfg["batch_size"], sampler=validation_shard(val_pairs, cfg),
                                collate_fn=with_mask_paths, **common)
    else:  # whole images, one at a time, read in this process (ReadAhead)
        val_loader = ReadAhead(val_set, validation_shard(val_pairs, cfg))
    CHECKED_HERE.clear()  # the start-up's questions are answered: a million files' facts need not stay
    return train_loader, val_loader


def build_datasets(train_pairs, val_pairs, cfg):
    """fit: resized images (validation also with the original masks); patch: training patches, and whole
    validation images for the sliding window."""
    # First: a killed run's decoded images count as used space in the estimates below (and in fit mode
    # with caching off or skipped, no DecodedImages would ever remove them).
    remove_stale_caches(tempfile.gettempdir())
    if cfg["data_mode"] == "patch":
        return PatchDataset(train_pairs, cfg, image_sizes(train_pairs, cfg)), WholeImages(val_pairs, cfg)
    return SegDataset(train_pairs, cfg, True), ValidationImages(val_pairs, cfg)


def validation_shard(val_pairs, cfg):
    """This rank's validation images: rank r takes r, r + world, ... so each is counted exactly once
    (the counts are all-reduced). Patch mode deals them largest first: the sliding window's time
    follows the pixels, and sizes vary."""
    order = list(range(len(val_pairs)))
    if cfg["data_mode"] == "patch" and DIST.enabled:
        sizes = image_sizes(val_pairs, cfg)
        order.sort(key=lambda i: -sizes[i][0] * sizes[i][1])
    return order[DIST.rank::DIST.world]


def start_epoch_data(loader, epoch, seed):
    """Same shuffle and augmentation for a given epoch, whether or not the run was resumed."""
    loader.dataset.epoch = epoch
    if isinstance(loader.sampler, torch.utils.data.DistributedSampler):
        loader.sampler.set_epoch(epoch)
    elif getattr(loader.sampler, "generator", None) is not None:
        loader.sampler.generator.manual_seed(seed * 1000 + epoch)


def build_transforms(cfg, train, resize=True):
    """Resize and pad to image_size (fit mode; patches come cut to size: resize=False), augment when
    training, normalize."""
    import albumentations as A

    fit = fit_transforms(cfg["image_size"]) if resize else []
    augment = [A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5),
               A.Affine(scale=(0.9, 1.1), translate_percent=(-0.05, 0.05), rotate=(-15, 15),
                        fill_mask=IGNORE_INDEX, p=0.5),
               A.RandomBrightnessContrast(0.2, 0.2, p=0.5)] if train else []
    return A.Compose(fit + augment + [A.Lambda(image=normalizer(cfg), name="normalize")])


def fit_input(image, cfg):
    """One fit-mode image as the model takes it (C x image_size x image_size, float32): resized, padded
    and normalised, to the bit as build_transforms' pipeline does it (tested). Predict, the benchmark and
    fit-mode validation (fit_pair) all make the model's input here."""
    return fit_pair(image, None, cfg)[0]


def fit_pair(image, mask, cfg):
    """(fit_input's tensor, the mask resized and padded alike: nearest-neighbour, the padding IGNORE_INDEX;
    None without a mask). An image already at the model's size (cache_images' resized copies included)
    needs neither resize nor padding, nor does its mask."""
    size = cfg["image_size"]
    if image.shape[:2] != (size, size):
        geometry = fit_geometry(size, threading.get_ident())
        resized = geometry(image=image) if mask is None else geometry(image=image, mask=mask)
        image, mask = resized["image"], resized.get("mask")
    return torch.from_numpy(normalizer(cfg).planes(image)), mask


@functools.lru_cache(maxsize=32)
def fit_geometry(size, thread):
    """fit_transforms as one pipeline, built once per size and thread (predict's readers share no
    albumentations pipeline): building one cost more than transforming a batch of 128 px images."""
    import albumentations as A

    return A.Compose(fit_transforms(size))


def fit_transforms(size):
    """Fit mode's resize: longer side to `size`, then padded to a square. Keeps the aspect ratio and pads
    at the bottom/right, so predictions crop back exactly. Draws no random numbers: it can run once per
    run (ResizedImages) and leave the augmentation's random sequence unchanged."""
    import albumentations as A

    return [A.LongestMaxSize(max_size=size),
            A.PadIfNeeded(size, size, position="top_left", border_mode=cv2.BORDER_CONSTANT, fill=0,
                          fill_mask=IGNORE_INDEX)]


def normalizer(cfg):
    """The mean/std normalisation every model input gets (after scale_image's [0, 1] rule)."""
    return channel_normalizer(cfg["in_channels"])


@functools.lru_cache(maxsize=4)
def channel_normalizer(in_channels):
    """normalizer's, built once per channel count (UnitRangeNormalize makes its lookup tables then)."""
    mean, std = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) if in_channels == 3 else ((0.5,), (0.25,))
    return UnitRangeNormalize(mean, std)


def image_tensor(image):
    """A normalized HxW or HxWxC array -> a CxHxW float tensor."""
    image = image[..., None] if image.ndim == 2 else image
    return torch.from_numpy(image.transpose(2, 0, 1).copy())


class UnitRangeNormalize:
    """(x - mean) / std on the [0, 1] scale of scale_image: uint8 divided by 255 (albumentations'
    exact uint8 path, so 8-bit results are unchanged), floats already in [0, 1] by 1."""

    def __init__(self, mean, std):
        import albumentations as A

        self.by_dtype = {np.dtype(np.uint8): A.Normalize(mean, std, max_pixel_value=255.0, p=1.0),
                         np.dtype(np.float32): A.Normalize(mean, std, max_pixel_value=1.0, p=1.0)}

        # What the uint8 normalisation gives each of the 256 values, per channel (tables[c][v]): the same
        # numbers, looked up straight into the planes of the model's C x H x W input (planes)
        ramp = np.repeat(np.arange(256, dtype=np.uint8).reshape(256, 1, 1), len(mean), axis=2)
        self.tables = np.ascontiguousarray(self(ramp).reshape(256, len(mean)).T)
        self.interleaved = self.tables.T.reshape(1, 256, len(mean)).copy()  # cv2.LUT's table for H x W x C

    def __call__(self, image, **params):
        return self.by_dtype[image.dtype].apply(image)

    def planes(self, image, out=None):
        """self(image) as a C x H x W float32 array (into `out` if given). A uint8 image is looked up in
        `tables` a channel at a time (cv2.LUT), each written straight into its plane: a third of the time
        of normalising, then transposing."""
        if image.dtype != np.uint8:
            normalized = self(image)
            normalized = (normalized[..., None] if normalized.ndim == 2 else normalized).transpose(2, 0, 1)
            if out is None:
                return normalized.copy()
            out[...] = normalized
            return out
        channels = cv2.split(image) if image.ndim == 3 else [image]
        out = np.empty((len(channels), *image.shape[:2]), np.float32) if out is None else out
        for plane, channel, table in zip(out, channels, self.tables):
            cv2.LUT(channel, table, dst=plane)
        return out

    def into(self, out, images, interleaved=False):
        """Equal-sized images normalised into `out`, N x C x H x W or (interleaved) N x H x W x C: uint8
        RGB in the second is one lookup per image in a 3-channel table, straight into its H x W x C."""
        for target, image in zip(out, images):
            if not interleaved:
                self.planes(image, target)
            elif image.dtype == np.uint8 and image.ndim == 3:
                cv2.LUT(image, self.interleaved, dst=target)
            else:
                target[...] = self(image).reshape(target.shape)
        return out


def seed_augmentation(transform, seed, epoch, index):
    """One generator pair for the whole pipeline, seeded from (seed, epoch, index): the transforms
    draw from it in turn, so each flip, affine and colour change fires independently with its own
    probability, the same on every worker count and after resume. (Compose.set_random_seed would
    give every transform its own generator with the same seed: all would fire together.)"""
    sequence = np.random.SeedSequence([seed, epoch, index])
    transform.set_random_state(np.random.default_rng(sequence),
                               random.Random(int(sequence.generate_state(1)[0])))


def read_pair(pair, cfg):
    """(image from read_image, mask of class indices): how every data set reads a pair. The mask's
    values were validated once by the data check, so this only converts (no np.unique per sample)."""
    image_path, mask_path = pair
    return read_image(image_path, cfg["in_channels"], cfg["intensity_range"]), read_classes(mask_path, cfg)


def read_classes(mask_path, cfg):
    """A mask of class indices at its own size, as read_pair reads it (fit-mode validation also reads
    the original mask alone, when the image comes resized from the cache)."""
    return mask_to_classes(decode_mask(mask_path), cfg["num_classes"], mask_path)


class SegDataset(Dataset):
    """(image, mask) pairs -> (float tensor CxHxW, long tensor HxW of class indices).

    Augmentation is seeded from (seed, epoch, index): the same on every worker count and after resume.
    """

    def __init__(self, pairs, cfg, train):
        self.pairs, self.cfg, self.train = pairs, cfg, train
        self.resized = image_cache(pairs, cfg)
        self.transform = build_transforms(cfg, train, resize=self.resized is None)
        # In shared memory: persistent DataLoader workers keep their copy of the dataset across
        # epochs, and must still see the epoch the main process sets. Where shared memory cannot be made
        # (a read-only /dev/shm), there are no workers (worker_count), and a plain number does.
        self._epoch = types.SimpleNamespace(value=0) if shared_memory_problem() else multiprocessing.RawValue("q", 0)

    @property
    def epoch(self):
        return self._epoch.value

    @epoch.setter
    def epoch(self, value):
        self._epoch.value = value

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        image, mask = self.read(index)
        seed_augmentation(self.transform, self.cfg["seed"], self.epoch, index)
        out = self.transform(image=image, mask=mask)
        return image_tensor(out["image"]), torch.from_numpy(out["mask"]).long()

    def read(self, index):
        """The pair as read_pair gives it, or (cache_images) already resized, from the run's cache."""
        if self.resized is None:
            return read_pair(self.pairs[index], self.cfg)
        return self.resized.get(index, self.pairs[index])


class ValidationImages(SegDataset):
    """Fit-mode validation: (resized image, resized mask, original mask's path). The resized pair is the
    model's input (exactly what predict gives the model) and the val loss's target; IoU/Dice are
    counted against the original mask (read_classes, at the image's own size: fit_pieces), as predict's
    output would be. Only its path leaves a loader worker: a worker hands items over in shared memory
    (/dev/shm, 64 MB in a default Docker container), and a batch of 12 MP masks is 96 MB."""

    def __init__(self, pairs, cfg):
        super().__init__(pairs, cfg, train=False)
        self.transform = None  # no pipeline: fit_pair makes each item, as it makes predict's input

    def __getitem__(self, index):
        x, mask = fit_pair(*self.read(index), self.cfg)  # predict's input, made by the same function
        return x, torch.from_numpy(mask).long(), str(self.pairs[index][1])


def with_mask_paths(items):
    """Collates ValidationImages items: resized images and masks stacked, the original masks' paths listed."""
    images, masks, paths = zip(*items)
    return torch.stack(images), torch.stack(masks), list(paths)


def image_cache(pairs, cfg):
    """ResizedImages for cache_images in fit mode, or None: off, or the caches of this node's processes
    would take more than half the free space where temporary files go (checkpoints need room too): then
    decoded every epoch."""
    if not (cfg["cache_images"] and cfg["data_mode"] == "fit" and pairs):
        return None
    need, folder = cache_bytes(pairs, cfg) * processes_per_node(), tempfile.gettempdir()
    free = shutil.disk_usage(folder).free
    if need > free / 2:
        print(f"cache_images: the resized images would take {size_text(need)}{node_share()} of the "
              f"{size_text(free)} free in {folder}: decoding them every epoch instead (point TMPDIR at a "
              f"larger disk to cache them)")
        return None
    if (files := cache_files_short(pairs, folder)) is not None:
        print(f"cache_images: {files}: decoding them every epoch instead (point TMPDIR at another disk to cache them)")
        return None
    return ResizedImages(cfg, images=len(pairs))


# Files the temporary directory must still have room for beside a cache's: the loader workers' socket files
# (worker_files_problem), the cache's folder and lock, a write's temporary name.
CACHE_SPARE_FILES = 64


def cache_files_short(pairs, folder):
    """Where the file system of `folder` cannot make a decoded copy's files (2 an image, a copy per process on
    this machine), those the caches made before it have still to write, and CACHE_SPARE_FILES more: how many
    it can make, in words; else None. A tmpfs's inodes, used up by the cache, left a loader worker no socket
    file: a traceback, then training waited for ever."""
    own = len(DecodedImages.PARTS) * len(pairs) * processes_per_node()
    coming = sum(c.files_to_come() for c in LIVE_CACHES)
    left = files_left(folder)
    if left is None or left >= own + coming + CACHE_SPARE_FILES:
        return None
    return (f"the decoded copies would make {own} files{node_share()} in {folder}"
            + (f" beside the {coming} still to come from the other set's" if coming else "")
            + f", whose file system can create only {left} more (its inodes; {CACHE_SPARE_FILES} kept for loader "
              f"workers)")


def check_patch_cache_room(pairs, sizes, cfg):
    """Patch mode trains only from its decoded copies (decoding a large scene again for each patch would
    take longer than training on it): where the copies of this node's processes would not fit in the
    free space, the run stops before the first epoch instead of filling the disk in the middle of one."""
    need, folder = cache_bytes(pairs, cfg, sizes) * processes_per_node(), tempfile.gettempdir()
    free = shutil.disk_usage(folder).free
    if pairs and need > free:
        raise UserError(f"patch mode decodes the training images once, into {size_text(need)}{node_share()} "
                        f"of temporary files, but {folder} has {size_text(free)} free: point TMPDIR at a "
                        f"larger disk, lower patch_scale or max_train_images")
    if pairs and (files := cache_files_short(pairs, folder)) is not None:
        raise UserError(f"patch mode decodes the training images once, and {files}: point TMPDIR at another "
                        f"disk, delete files there or lower max_train_images")


def size_text(n):
    """Bytes for people: 850 MB, 1.2 GB, 3.0 TB; 48 kB under a megabyte (a tiny disk read '0 MB of 0 MB free')."""
    for unit, scale in (("TB", 2**40), ("GB", 2**30)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n / 2**20:.0f} MB" if n >= 2**19 else f"{n / 2**10:.0f} kB"


def processes_per_node():
    """Training processes on this machine: LOCAL_WORLD_SIZE under torchrun, else 1."""
    return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def node_share():
    """How a per-node figure is counted, for messages: empty for a single process."""
    n = processes_per_node()
    return f" ({n} processes on this machine, a copy each)" if n > 1 else ""


def cache_bytes(pairs, cfg, sizes=None):
    """One process's cache: image_size² pixels per pair (fit mode), or each image's `sizes` after
    patch_scale (patch mode); channels at the set's widest depth after scale_image (1 byte where every
    image is 8-bit, else 4: scale_image makes wider integers and floats float32), 1 byte per mask pixel."""
    if not pairs:
        return 0
    facts = start_up_facts(pairs, cfg)
    depth = 1 if all(facts[os.path.abspath(image)]["dtype"] == "uint8" for image, _ in pairs) else 4
    pixels = (len(pairs) * cfg["image_size"] ** 2 if sizes is None else
              sum(h * w for h, w in (scaled_size(size, cfg["patch_scale"]) for size in sizes)))
    return pixels * (cfg["in_channels"] * depth + 1)


class ResizedImages:
    """cache_images (fit mode): each image and mask decoded and resized once per run, then read back from
    a .npy file (DecodedImages), where decoding a large PNG or TIFF every epoch would cost the model's
    CPU time (BENCHMARKS.md "Data loading"). The result is the same to the bit: the resize draws no random
    numbers, so the augmentation that follows draws the same ones."""

    def __init__(self, cfg, images=0):
        import albumentations as A

        self.cfg, self.fit = cfg, A.Compose(fit_transforms(cfg["image_size"]))
        self.decoded = DecodedImages(fix=("set cache_images=False",), images=images)

    def get(self, index, pair):
        # Copied into memory: small at image_size, and the augmentation may write to its input.
        return [np.array(array) for array in self.decoded.get(index, lambda: self.decode(pair))]

    def decode(self, pair):
        image, mask = read_pair(pair, self.cfg)
        out = self.fit(image=image, mask=mask)
        return out["image"], out["mask"]


class DecodedImages:
    """Images decoded once per run (fit mode: resized, ResizedImages; patch mode: scaled), then read
    through a memory map: a patch of a 10,000² scene reads its own pixels, not the whole file. The .npy
    copies live in a temporary folder (as much disk as the decoded images) that the process that made
    it removes when the data set is collected or at exit, and the next run removes if this one was
    killed first (remove_stale_caches); the kernel's page cache keeps the busy ones in memory. Loader
    workers share the files (each written atomically), so an image is decoded about once in all.
    `fix`: what else the user can do when the disk is full; `images`: how many it will hold (cache_files_short).
    """

    PARTS = ("image", "mask")  # the files of one decoded image: <key>_image.npy, <key>_mask.npy

    def __init__(self, fix=(), images=0):
        try:
            remove_stale_caches(tempfile.gettempdir())
            (self.folder, lock), self.fix, self.layouts = locked_cache_folder(), fix, {}
        except OSError as exc:
            raise UserError(f"cannot make a folder for decoded images in {tempfile.gettempdir()} "
                            f"({exc.strerror or exc}): point TMPDIR at a writable folder") from None
        weakref.finalize(self, remove_folder, self.folder, os.getpid(), lock)
        self.files = len(self.PARTS) * images
        LIVE_CACHES.add(self)

    def files_to_come(self):
        """How many of its files this cache has still to write (a loader worker writes them as it decodes)."""
        try:
            return max(0, self.files - sum(1 for _ in os.scandir(self.folder)))
        except OSError:
            return 0

    def get(self, key, decode):
        """(image, mask) as read-only memory maps; `decode()` makes them the first time. Each file's
        layout is read once per process: parsing a .npy header takes 4x as long as mapping the file."""
        paths = [self.folder / f"{key}_{part}.npy" for part in self.PARTS]
        if key in self.layouts:
            try:
                return [np.memmap(path, mode="r", **layout) for path, layout in zip(paths, self.layouts[key])]
            except FileNotFoundError:  # removed since (a temporary-file cleaner): decoded and written again
                del self.layouts[key]
        if not all(path.exists() for path in paths):
            for path, array in zip(paths, decode()):
                self.write(path, array)
        maps = [np.load(path, mmap_mode="r") for path in paths]
        self.layouts[key] = [dict(dtype=m.dtype, offset=m.offset, shape=m.shape,
                                  order="F" if m.flags.f_contiguous and not m.flags.c_contiguous else "C")
                             for m in maps]
        return maps

    def write(self, path, array):
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "wb") as f:
                np.save(f, array)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            fixes = [*([room_fix(self.folder), "point TMPDIR at a larger disk"] if exc.errno in FULL_DISK else
                       ["check that it still exists and is writable (a temporary-file cleaner may have removed it)",
                        "point TMPDIR elsewhere"]), *self.fix]
            raise UserError(f"cannot write decoded images to {self.folder} ({exc.strerror or exc}): "
                            f"{', '.join(fixes[:-1])} or {fixes[-1]}") from None


FULL_DISK = (errno.ENOSPC, errno.EDQUOT)
LIVE_CACHES = weakref.WeakSet()  # this process's DecodedImages: the files they have still to write count as used


def files_left(folder):
    """How many more files (inodes) the file system holding `folder` lets this user make; None where it keeps
    no such count (btrfs, ZFS and many network mounts report 0 in all) or cannot be asked (Windows). A tmpfs
    or a volume of many small files runs out of them with gigabytes free: 'No space left on device' too."""
    try:
        stat = os.statvfs(folder)
    except (AttributeError, OSError):
        return None
    return stat.f_favail if stat.f_files else None


def room_fix(folder):
    """The first fix for a full disk at `folder`: room, or, where its file system has bytes free but can make
    no more files (its inodes are used up), files to delete: 'free disk space' sent users to the wrong fix
    beside gigabytes free."""
    if files_left(folder) == 0:
        return (f"delete files there (its file system can create no more files: every inode is in use, with "
                f"{size_text(free_bytes(folder))} free)")
    return "free disk space there"

CACHE_PREFIX = "unet_amp_decoded_"  # DecodedImages' folders in the temporary directory: + "<pid>-<random>"


def remove_folder(folder, owner, lock=None):
    if os.getpid() == owner:  # forked loader workers hold the same finalizer: only the owner removes
        shutil.rmtree(folder, ignore_errors=True)
        if lock is not None:
            os.close(lock)


def locked_cache_folder():
    """(a new cache folder, the descriptor holding its lock, or None where the file system has no
    flock). The kernel drops a flock when the last process holding it ends (loader workers inherit it),
    however it ends, so a folder whose lock can be taken belongs to no live run, in any container that
    shares this directory and kernel. The folder gets its searchable name only once locked:
    remove_stale_caches never sees a live one unlocked."""
    staging = Path(tempfile.mkdtemp(prefix=f".{CACHE_PREFIX}{os.getpid()}-"))
    lock = None
    with contextlib.suppress(ImportError, OSError):  # Windows; a network file system without flock
        import fcntl

        lock = os.open(staging, os.O_RDONLY)
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return staging.rename(staging.with_name(staging.name[1:])), lock


def remove_stale_caches(root):
    """Removes the cache folders in `root` whose lock no live process holds: left by a run killed before
    its exit handlers ran (kill -9, the out-of-memory killer). Folders named without the "<pid>-" (from
    older versions) stay: nothing tells whether their run still lives."""
    try:
        import fcntl
    except ImportError:
        return
    for folder in Path(root).glob(f"{CACHE_PREFIX}*-*"):
        try:
            lock = os.open(folder, os.O_RDONLY)
        except OSError:  # another user's, or just removed
            continue
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # held by a live run (or no flock here)
            pass
        finally:
            os.close(lock)


def worker_count(cfg, hw):
    """num_workers=None: a share of this process's cores. Under torchrun the node's cores are split
    between its LOCAL_WORLD_SIZE processes first (8 GPUs on 16 cores: 2 cores, 1 worker each).

    On a CPU the model's own threads use every core, yet one worker (on machines with 2+ cores per
    process) still pays: image decoding and augmentation overlap the compute instead of adding to it.
    """
    if cfg["num_workers"] is not None:
        return cfg["num_workers"]
    if shared_memory_problem():  # workers hand batches over in it (check_worker_count's note)
        return 0
    cores = cores_per_process()
    workers = (CPU_WORKERS if cores >= 2 else 0) if hw.kind == "cpu" else most_auto_workers(cores)
    if workers and worker_files_problem(workers):  # no room for their socket files (check_worker_files' note)
        return 0
    return workers


def most_auto_workers(cores):
    """num_workers=None's workers on a GPU: half the cores, 1 to 8 (the most it takes anywhere)."""
    return min(8, max(1, cores // 2))


CPU_WORKERS = 1  # num_workers=None on a CPU with 2+ cores per process (measured: BENCHMARKS.md "Data loading")
WORKERS_PER_CORE = 4  # the most num_workers may ask for per core (999 on 2 cores: killed out of memory)


def cores_per_process():
    """The cores this process may run on, shared among the node's torchrun processes (at least 1)."""
    return max(1, (usable_cores() or 1) // processes_per_node())


def usable_cores():
    """The cores this process may run on: its CPU affinity (taskset, Slurm, a container's cpuset) where
    the system tells it, else the machine's, and no more than its CPU quota allows, rounded up; None
    where unknown."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = cpu_quota()
    return cores if cores is None or quota == math.inf else max(1, min(cores, math.ceil(quota)))


def cpu_quota(proc="/proc/self/cgroup", sys_root="/sys/fs/cgroup"):
    """Cores' worth of CPU time a period that this process's cgroups allow (docker --cpus, a Kubernetes
    CPU limit, systemd's CPUQuota), the tightest over its cgroup and their parents; inf where none is set."""
    def cores(folder, version):
        try:
            if version == 2:
                quota, period = (folder / "cpu.max").read_text().split()[:2]
            else:
                quota, period = ((folder / f"cpu.cfs_{name}_us").read_text().strip() for name in ("quota", "period"))
            return math.inf if quota in ("max", "-1") else int(quota) / int(period)
        except (OSError, ValueError, ZeroDivisionError):
            return math.inf
    return min((cores(*level) for level in cgroup_levels("cpu", proc, sys_root)), default=math.inf)


def fit_cpu_threads():
    """torch's threads cut to the cores this process may use (cores_per_process), where its default counts
    more: it sees the CPU affinity, not a CPU quota, and each thread past the quota waits out the period
    (a resnet18 step under a 1-core quota on 2 cores: 1.24x as long with 2 threads on a quiet machine,
    3.4x beside other jobs; BENCHMARKS.md "CPU quota"). OMP_NUM_THREADS, set by the user or torchrun, is
    left as it is. A note for the banner, or None."""
    threads, cores = torch.get_num_threads(), cores_per_process()
    if threads <= cores or os.environ.get("OMP_NUM_THREADS"):
        return None
    torch.set_num_threads(cores)
    quota, processes = cpu_quota(), processes_per_node()
    why = [f"a CPU quota of {quota:g} core(s), from its cgroup" if quota < math.inf else "",
           f"shared by {processes} processes on this node" if processes > 1 else ""]
    return (f"torch threads {threads} -> {cores}: the cores this process may use ({'; '.join(filter(None, why))}); "
            f"set OMP_NUM_THREADS to choose")


def check_worker_count(cfg):
    """num_workers the machine that starts them can run, checked before the run moves anything aside
    (a checkpoint from a larger machine keeps its num_workers; this is a check of here, not of the key):
    cores, and open files (the soft limit raised to the hard one first: raise_open_files_limit)."""
    cores = cores_per_process()
    if cfg["num_workers"] is not None and cfg["num_workers"] > (most := WORKERS_PER_CORE * cores):
        raise UserError(f"num_workers={cfg['num_workers']} is more than this machine can run: "
                        f"{cores} core(s) per process here, and each worker is a process with "
                        f"memory of its own; use num_workers=None (automatic) or at most {most}")
    if cfg["num_workers"] is not None and cfg["num_workers"] > cores and DIST.is_main:
        print(f"note: num_workers={cfg['num_workers']} on {cores} core(s) per process here: the workers share the "
              f"cores with the training itself and each other, which slows an epoch; num_workers=None picks for "
              f"this machine")
    check_shared_memory(cfg)
    workers = cfg["num_workers"] if cfg["num_workers"] is not None else most_auto_workers(cores)
    check_worker_files(cfg, workers)
    limit = raise_open_files_limit()
    if workers and limit is not None and limit < OPEN_FILES_BASE + OPEN_FILES_PER_WORKER * workers:
        raise UserError(f"the open-file limit here is {limit} (ulimit -n, its hard limit too): too few for "
                        f"{workers} data loader worker(s), whose pipes and shared batches need about "
                        f"{OPEN_FILES_PER_WORKER} each: raise it (ulimit -n 4096; in Docker --ulimit "
                        f"nofile=4096) or set num_workers=0")


def check_shared_memory(cfg):
    """Loader workers hand each batch over in shared memory (/dev/shm on Linux): where it cannot be written (a
    read-only or foreign-owned /dev/shm, a sandbox), num_workers=None reads in the training process (a note), and
    workers asked for are refused. Every run crashed there in a traceback, num_workers=0 too."""
    problem = shared_memory_problem()
    if not problem:
        return
    fix = "make /dev/shm writable (a container: --shm-size=2g, or --ipc=host)"
    no_workers_here(cfg, f"loader workers pass batches through shared memory, which cannot be made here ({problem}): "
                         f"{fix}, or set num_workers=0",
                    f"shared memory cannot be made here ({problem}): images are read in the training process "
                    f"(num_workers=0), with no loader workers to overlap it; {fix} for them")


def no_workers_here(cfg, refusal, note):
    """Where loader workers cannot run here: workers asked for (num_workers=N) are refused with `refusal`;
    num_workers=None reads in the training process (worker_count), with `note` said once."""
    if cfg["num_workers"]:
        raise UserError(f"num_workers={cfg['num_workers']}: {refusal}")
    if cfg["num_workers"] is None and DIST.is_main:
        print(f"note: {note}")


def check_worker_files(cfg, workers):
    """Loader workers each make a socket file in a folder of the temporary directory: where it cannot hold
    them (worker_files_problem), num_workers=None reads in the training process (a note), and workers asked
    for are refused. A worker that met it had printed a traceback, and training waited for its batch for ever."""
    problem = worker_files_problem(workers) if workers else None
    if not problem:
        return
    fix = "point TMPDIR at a folder on another disk (TMPDIR=/var/tmp)"
    no_workers_here(cfg, f"each loader worker makes a socket file in the temporary directory, and {problem}: {fix}, "
                         f"delete files there or set num_workers=0",
                    f"loader workers make socket files in the temporary directory, and {problem}: images are read "
                    f"in the training process (num_workers=0); for workers, {fix} or delete files there")


# Files a loader worker makes in the temporary directory: the socket through which it hands over its
# batches' shared memory (multiprocessing's resource sharer), and one to spare. Each loader has its workers.
WORKER_FILES, LOADERS = 2, 2


def worker_files_problem(workers):
    """Why `workers` loader workers (of each loader) could not make their socket files here, in words, or None.
    The folder multiprocessing puts them in is made now, in this process: the workers it forks share it."""
    import multiprocessing.util

    try:
        folder = multiprocessing.util.get_temp_dir()
    except OSError as exc:
        return f"no folder can be made in {tempfile.gettempdir()} ({exc.strerror or exc})"
    left, need = files_left(folder), WORKER_FILES * LOADERS * workers * processes_per_node()
    if left is None or left >= need:
        return None
    return (f"{os.path.dirname(folder)}'s file system can create only {left} more file(s) (its inodes; "
            f"{need} wanted)")


@functools.lru_cache(maxsize=None)
def shared_memory_problem():
    """Why this process cannot make shared memory (an OSError's words), or None where it can."""
    try:
        multiprocessing.RawValue("q", 0)
    except OSError as exc:
        return f"{exc.strerror or exc}{f' in {os.path.dirname(exc.filename)}' if exc.filename else ''}"
    return None


# Measured on a 2-core Xeon (tiny run, ulimit -n): 1 worker trained at 28 open files, not 24; 2 workers
# failed at 32 (at 20, a run hung for good in a worker's start-up).
OPEN_FILES_BASE, OPEN_FILES_PER_WORKER = 24, 8


def raise_open_files_limit():
    """The soft limit on open files, raised to the hard one where lower (as Go's runtime does at start;
    no privilege needed): 1024 is common, 256 on macOS. None where it cannot be read (Windows)."""
    try:
        import resource

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        want = min(hard, 2**16) if hard != resource.RLIM_INFINITY else 2**16
        if soft != resource.RLIM_INFINITY and soft < want:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return None if soft == resource.RLIM_INFINITY else soft
    except (ImportError, OSError, ValueError):
        return None


def loader_options(cfg, hw):
    """DataLoader settings every loader shares. Workers are kept across epochs (no restart cost per
    epoch) and run OpenCV on one thread; on CUDA, batches come in pinned memory, so to_device's
    non_blocking copies overlap the compute."""
    workers = worker_count(cfg, hw)
    return dict(num_workers=workers, pin_memory=hw.kind == "cuda", persistent_workers=workers > 0,
                worker_init_fn=start_worker if workers else None)


def start_worker(worker_id):
    """A DataLoader worker, forked from the training process, starts here: OpenCV on one thread, and its copy
    of the checkpoint folder's lock closed (the lock stays the training process's). Killed (out of memory),
    that process left workers alive for seconds, holding the lock: an immediate resume=True was refused."""
    one_opencv_thread(worker_id)
    for fd, _ in HELD_FOLDERS.values():
        with contextlib.suppress(OSError):
            os.close(fd)  # this process's descriptor only: the lock goes when the last one is closed


def one_opencv_thread(worker_id):
    """In a DataLoader worker (PyTorch already gives each one torch thread): OpenCV would start a
    thread per core in every worker; on a CPU those take cores from the model's threads (measured:
    1.76 ms of CPU time per augmented image with OpenCV's pool, 0.99 ms without; BENCHMARKS.md "Data
    loading"). 0 = run on the calling thread; setNumThreads(1) hangs in a worker forked from a
    process whose OpenCV pool had started."""
    cv2.setNumThreads(0)


# ----------------------------------------------------------------------------------------------------
# III.6 Large images: data_mode="patch".
# Training on image_size patches cut at patch_scale (1.0 = native resolution); validation and predict run
# whole images through one blended sliding window (predict_logits), so the val IoU is the IoU predict gives.
# eval_forward is the one inference forward of validation and predict, with test-time augmentation (TTA).
# ----------------------------------------------------------------------------------------------------
def scaled_size(hw, scale):
    """(height, width) after patch_scale: the one rounding rule for patches, tiles and patch counts."""
    return tuple(hw) if scale == 1.0 else tuple(max(1, round(n * scale)) for n in hw)


def rescale(image, mask, scale):
    """Resize by patch_scale: area averaging when shrinking (no aliasing), nearest for the mask."""
    if scale == 1.0:
        return image, mask
    h, w = scaled_size(image.shape[:2], scale)
    image = cv2.resize(image, (w, h), interpolation=cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)
    return image, None if mask is None else cv2.resize(mask, (w, h), interpolation=cv2.INTER_NEAREST)


def image_sizes(pairs, cfg):
    """(height, width) of each pair's image, from the data check's cache: no decoding."""
    facts = start_up_facts(pairs, cfg)
    return [tuple(facts[os.path.abspath(image)]["hw"]) for image, _ in pairs]


MIN_SCALED_SIDE = 8  # px: an image patch_scale shrinks below this on a side has no shape left to segment


def patches_of_padding(train, val, cfg):
    """Patch mode, from the data check's sizes, as a run begins (a resume keeps both keys): a UserError where
    patch_scale shrinks an image, training or validation, below MIN_SCALED_SIDE on a side (check_scaled_sides;
    a validation image so shrunk had been scored, unsaid, in the val IoU that picks best.pt); a note where every
    training image covers less than half a patch, so patches are mostly padding (left out of the loss),
    naming the largest image_size at which one covers half, if any."""
    if cfg["data_mode"] != "patch" or not train or cfg["resume"]:
        return None
    scale, size, sizes = cfg["patch_scale"], cfg["image_size"], image_sizes(train + val, cfg)
    check_scaled_sides(train + val, sizes, scale)
    scaled = [scaled_size(hw, scale) for hw in sizes[:len(train)]]
    cover = [min(h, size) * min(w, size) / size ** 2 for h, w in scaled]
    if max(cover) >= 0.5:
        return None
    h, w = scaled[cover.index(max(cover))]
    fits = next((s for s in range(size - 32, 31, -32)
                 if max(min(a, s) * min(b, s) for a, b in scaled) >= s * s / 2), None)
    fixes = [f"set image_size={fits}"] * (fits is not None) + ["raise patch_scale"] * (scale < 1) + ["use data_mode=fit"]
    at = f" at patch_scale={scale:g}" if scale != 1 else ""
    return (f"note:{at} every training image covers less than half a {size}x{size} patch (the largest: {w}x{h} px), "
            f"so most of each patch is padding, computed and left out of the loss: {', or '.join(fixes)}")


def scaled_thin(hw, scale):
    """(h, w) an image of size hw takes at patch_scale where that leaves a side under MIN_SCALED_SIDE px that
    was not as stored (check_scaled_sides' rule, for predict's note), else None."""
    scaled = scaled_size(hw, scale)
    return scaled if min(hw) >= MIN_SCALED_SIDE > min(scaled) else None


def check_scaled_sides(pairs, sizes, scale):
    """No image patch_scale shrinks below MIN_SCALED_SIDE on a side (0.01 made 64 px images 1 px, unsaid);
    an image already that small as stored is the user's data, and does not hide a larger one shrunk."""
    shrunk = [i for i, hw in enumerate(sizes) if min(hw) >= MIN_SCALED_SIDE > min(scaled_size(hw, scale))]
    if shrunk:
        i = min(shrunk, key=lambda i: min(sizes[i]))
        (h, w), least = scaled_size(sizes[i], scale), math.ceil(100 * MIN_SCALED_SIDE / min(sizes[i])) / 100
        raise UserError(f"patch_scale={scale:g} shrinks {pairs[i][0]} ({sizes[i][1]}x{sizes[i][0]}) to {w}x{h} px, "
                        f"too small to hold a shape: use patch_scale={least:g} or more ({MIN_SCALED_SIDE} px on its "
                        f"shorter side)")


def patch_counts(sizes, cfg):
    """Patches per image per epoch: patches_per_image, or (None) as many as tile the scaled image once,
    so an epoch covers every image's area about once whatever the sizes."""
    if cfg["patches_per_image"] is not None:
        return [cfg["patches_per_image"]] * len(sizes)
    p = cfg["image_size"]
    return [math.ceil(h / p) * math.ceil(w / p) for h, w in (scaled_size(s, cfg["patch_scale"]) for s in sizes)]


def pad_to(array, height, width, fill):
    """Pad at the bottom/right up to height x width (as fit mode pads): images with 0, masks with
    IGNORE_INDEX, so padding is left out of the loss and the metrics."""
    rows, cols = max(0, height - array.shape[0]), max(0, width - array.shape[1])
    if not rows and not cols:
        return array
    return np.pad(array, ((0, rows), (0, cols)) + ((0, 0),) * (array.ndim - 2), constant_values=fill)


def foreground_index(mask, band_rows=1024):
    """Per foreground class in the mask: (class, rows holding it, running count of its pixels over those
    rows), so foreground_pixel can draw a centre uniformly among ALL the class's pixels. Memory grows
    with the rows, not the pixels (a 10,000² scene: at most 120 kB per class); found one band of rows
    at a time, so reading the mask takes a band's worth of memory."""
    per_row = {}
    for top in range(0, mask.shape[0], band_rows):
        band = np.asarray(mask[top:top + band_rows])
        for c in np.flatnonzero(np.bincount(band.ravel(), minlength=IGNORE_INDEX + 1)[1:IGNORE_INDEX]) + 1:
            counts = per_row.setdefault(int(c), np.zeros(mask.shape[0], np.int64))
            counts[top:top + len(band)] = (band == c).sum(axis=1)
    index = []
    for c in sorted(per_row):
        rows = np.flatnonzero(per_row[c]).astype(np.int32)
        index.append((c, rows, np.cumsum(per_row[c][rows])))
    return index


def foreground_pixel(mask, entry, v):
    """(row, col) of the pixel at share v in [0, 1) of one class's pixels in raster order: a uniform v
    gives every pixel of the class the same chance. Reads one row of the mask."""
    c, rows, cumulative = entry
    k = int(v * int(cumulative[-1]))
    i = int(np.searchsorted(cumulative, k, side="right"))
    before = int(cumulative[i - 1]) if i else 0
    return int(rows[i]), int(np.flatnonzero(np.asarray(mask[rows[i]]) == c)[k - before])


def cut_patch(image, mask, foreground, cfg, rng):
    """One image_size patch. With probability patch_foreground it is centred on a foreground pixel of a
    class drawn uniformly among those present (a rare class gets as many patches as a common one);
    else it lies anywhere, so the background keeps its natural share and false positives stay honest."""
    size, (h, w) = cfg["image_size"], mask.shape
    centred, u, v = rng.random() < cfg["patch_foreground"], rng.random(), rng.random()
    if centred and foreground:
        cy, cx = foreground_pixel(mask, foreground[int(u * len(foreground))], v)
        top, left = cy - size // 2, cx - size // 2
    else:
        top, left = int(u * (max(h - size, 0) + 1)), int(v * (max(w - size, 0) + 1))
    top, left = int(np.clip(top, 0, max(h - size, 0))), int(np.clip(left, 0, max(w - size, 0)))
    window = (slice(top, top + size), slice(left, left + size))  # copied out: the image may be a memory map
    return (pad_to(np.array(image[window]), size, size, 0),
            pad_to(np.array(mask[window]), size, size, IGNORE_INDEX))


OPEN_FILES_SHARE = 8      # training images kept open take at most 1/8 of a process's file-descriptor limit

MAX_OPEN_IMAGES = 8192    # ... and 2 of the 65,530 memory maps a process may have (vm.max_map_count) each


def open_images_limit():
    """How many training images a process keeps mapped: each holds 2 file descriptors (image and
    mask), and the process's limit on those (RLIMIT_NOFILE, often 1024, 256 on macOS) is shared with
    the DataLoader's pipes, the logs and the libraries."""
    try:
        import resource

        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ImportError, OSError, ValueError):  # no resource module on Windows
        return MAX_OPEN_IMAGES
    if soft == resource.RLIM_INFINITY:
        return MAX_OPEN_IMAGES
    return max(1, min(MAX_OPEN_IMAGES, soft // (2 * OPEN_FILES_SHARE)))


PATCH_STREAM = 1  # keeps the patch-position generator apart from the augmentation's (seed_augmentation)


class PatchDataset(SegDataset):
    """Training patches: item i is patch k of image j (patch_counts), cut at a position drawn from
    (seed, epoch, i), then augmented as in fit mode: the same on every worker count and after resume."""

    def __init__(self, pairs, cfg, sizes):
        super().__init__(pairs, cfg, train=True)
        self.transform = build_transforms(cfg, train=True, resize=False)
        self.starts = np.cumsum([0, *patch_counts(sizes, cfg)])
        check_patch_cache_room(pairs, sizes, cfg)
        self.decoded, self.maps, self.foreground = DecodedImages(images=len(pairs)), {}, {}
        self.open_limit = open_images_limit()

    def __len__(self):
        return int(self.starts[-1])

    def __getitem__(self, index):
        image, mask, foreground = self.load(int(np.searchsorted(self.starts, index, side="right")) - 1)
        rng = np.random.default_rng(np.random.SeedSequence([self.cfg["seed"], self.epoch, index, PATCH_STREAM]))
        image, mask = cut_patch(image, mask, foreground, self.cfg, rng)
        seed_augmentation(self.transform, self.cfg["seed"], self.epoch, index)
        out = self.transform(image=image, mask=mask)
        return image_tensor(out["image"]), torch.from_numpy(out["mask"]).long()

    def load(self, j):
        """Image j scaled by patch_scale and its mask as memory maps (decoded once: DecodedImages), and
        its foreground index (found once per process). Each map holds a file descriptor, so only the
        open_limit images used last stay open (opening one again: 0.2-0.5 ms of a patch's ~1.4 ms on
        1100x700 frames, BENCHMARKS.md "Large images")."""
        if j in self.maps:
            self.maps[j] = self.maps.pop(j)  # the dict keeps use order: the least recent first
        else:
            if len(self.maps) >= self.open_limit:
                del self.maps[next(iter(self.maps))]
            self.maps[j] = self.decoded.get(j, lambda: self.decode(j))
        image, mask = self.maps[j]
        if j not in self.foreground:
            self.foreground[j] = foreground_index(mask)
        return image, mask, self.foreground[j]

    def decode(self, j):
        return rescale(*read_pair(self.pairs[j], self.cfg), self.cfg["patch_scale"])


class WholeImages(Dataset):
    """Patch-mode validation: (image as read_image gives it, mask of class indices), whole, at the
    original size. The loader passes them through unbatched: sizes differ."""

    def __init__(self, pairs, cfg):
        self.pairs, self.cfg = pairs, cfg

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        return tuple(torch.from_numpy(array) for array in read_pair(self.pairs[index], self.cfg))


class ReadAhead:
    """Patch-mode validation images in `order`, read in this process, the next one on a thread while
    the model works on the current one (OpenCV and tifffile release the GIL while decoding). Not
    through DataLoader workers: a worker hands its items over in shared memory (/dev/shm, 64 MB in a
    default Docker container), and a whole 8000² RGB image is 192 MB. They stay on the CPU: not pinned."""

    def __init__(self, dataset, order):
        self.dataset, self.order = dataset, list(order)

    def __len__(self):
        return len(self.order)

    def __iter__(self):
        with ThreadPoolExecutor(max_workers=1) as pool:
            reads = (pool.submit(self.dataset.__getitem__, i) for i in self.order)
            current = next(reads, None)
            while current is not None:
                following = next(reads, None)  # the next read starts before this image is handed out
                yield current.result()
                current = following


def predict_logits(model, image, cfg, prec, hw):
    """Patch mode: fp32 logits (classes x H x W, CPU) at the image's own size: scaled by patch_scale,
    through the sliding window, resized back. Validation and predict both call this."""
    h, w = image.shape[:2]
    logits = sliding_window(model, rescale(image, None, cfg["patch_scale"])[0], cfg, prec, hw)
    if logits.shape[1:] != (h, w):
        logits = nn.functional.interpolate(logits[None], size=(h, w), mode="bilinear", align_corners=False)[0]
    return logits


def tile_starts(length, window, overlap):
    """Tile offsets along one axis: one every window * (1 - overlap) pixels, the last flush with the end."""
    if length <= window:
        return [0]
    stride = max(1, int(window * (1 - overlap)))
    return sorted(set(range(0, length - window, stride)) | {length - window})


def tile_grid(image, cfg):
    """(the image padded to at least one tile, the tiles' row starts, their column starts): a side
    smaller than a tile is padded as in fit mode (the logits are cropped after)."""
    size = cfg["image_size"]
    padded = pad_to(image, size, size, 0)
    return (padded, *(tile_starts(n, size, cfg["tile_overlap"]) for n in padded.shape[:2]))


def gaussian_ramp(window):
    """1-D blending weights, sigma = window / 8 (as nnU-Net and MONAI use): a tile's centre counts most,
    its border, where the convolutions saw the tile's edge rather than the image, least: no seams."""
    t = torch.arange(window, dtype=torch.float64) + 0.5 - window / 2
    return torch.exp(-t ** 2 / (2 * (window / 8) ** 2)).float()


def coverage(starts, length, ramp):
    """Sum of the ramps of every tile along one axis: the 2-D weight sum is the product of two such
    vectors (tiles form a grid), so no full-size weight map is ever stored."""
    total = torch.zeros(length)
    for start in starts:
        total[start:start + len(ramp)] += ramp
    return total


@torch.no_grad()
def sliding_window(model, image, cfg, prec, hw):
    """fp32 logits (classes x H x W, on the CPU) of an image from read_image, by overlapping
    image_size tiles, tile_batch_size at a time (tile_batches), blended with Gaussian weights (TileBlend).
    Only one batch of tiles is ever on the device, plus the blended sum where it fits there, so device
    memory does not grow with the image."""
    size, (h, w) = cfg["image_size"], image.shape[:2]
    padded, ys, xs = tile_grid(image, cfg)
    blend = TileBlend(cfg["num_classes"], padded.shape[:2], size, hw)
    for batch, x in tile_batches(padded, ys, xs, cfg, hw):
        blend.add(batch, eval_forward(model, x, cfg, prec, hw))
    return blend.result(ys, xs)[:, :h, :w]


def tile_batches(image, ys, xs, cfg, hw):
    """(tile positions, N x C x size x size model input) per tile_batch_size tiles of the grid of row
    starts ys and column starts xs (tile_grid), row by row, cut from the image as read (uint8 or float32:
    1-4 bytes a pixel). On the host each tile is normalised straight into the batch's memory, in the
    model's layout (host_tiles); on CUDA an 8-bit image's tiles go to the device as they are and are
    normalised there (DeviceNormalize). Either way per pixel, so the values are those of each tile
    normalised alone, to the bit."""
    size, step, tiles = cfg["image_size"], cfg["tile_batch_size"], [(y, x) for y in ys for x in xs]
    make = DeviceNormalize(cfg, hw) if normalise_on_device(image, hw) else host_tiles(cfg, hw)
    for i in range(0, len(tiles), step):
        batch = tiles[i:i + step]
        yield batch, make([image[top:top + size, left:left + size] for top, left in batch])


def normalise_on_device(image, hw):
    """Whether tile_batches normalises on the device: on CUDA, for 8-bit images (a lookup of 256 values per
    channel; float images keep albumentations' arithmetic on the host). On an H100, side by side (BENCHMARKS.md
    "GPU: H100 (2026-11-28)"): the window's host work 0.18 s per 16 Mpx with the tiles normalised on the host by
    the thread that launches the model's kernels, 0.10 s with this."""
    return hw.kind == "cuda" and image.dtype == np.uint8


def host_tiles(cfg, hw):
    """tile_batches' host maker: tiles -> their batch normalised (UnitRangeNormalize.into) straight into its
    memory in the model's layout, page-locked on CUDA so that its copy to the device overlaps the model's
    work (eval_forward's non_blocking copy; the caching host allocator keeps it until that copy is done)."""
    normalize, nhwc = normalizer(cfg), cfg["channels_last"] is True

    def make(tiles):
        size = tiles[0].shape[0]
        x, memory = host_batch((len(tiles), cfg["in_channels"], size, size), nhwc, hw.kind == "cuda")
        normalize.into(memory, tiles, interleaved=nhwc)
        return x
    return make


class DeviceNormalize:
    """tile_batches' device maker for 8-bit images: the raw tiles (N x H x W x C uint8, a quarter of the
    float32 batch's bytes) copied from page-locked memory without blocking, then looked up on the device in
    normalizer's tables, the very values UnitRangeNormalize writes on the host (the same logits to the bit),
    into the model's layout. The host only copies bytes; three small kernels replace its work per pixel."""

    def __init__(self, cfg, hw):
        tables = normalizer(cfg).tables  # C x 256 float32: channel c's value for each 8-bit level
        self.hw, self.nhwc, self.channels = hw, cfg["channels_last"] is True, len(tables)
        self.flat = torch.from_numpy(tables.reshape(-1)).to(hw.device)
        self.offsets = torch.arange(0, 256 * self.channels, 256, device=hw.device)  # channel c's table starts

    def __call__(self, tiles):
        size = tiles[0].shape[0]
        raw, memory = host_memory((len(tiles), size, size, self.channels), np.uint8, self.hw.kind == "cuda")
        for target, tile in zip(memory, tiles):
            target[...] = tile if tile.ndim == 3 else tile[..., None]
        levels = raw.to(self.hw.device, non_blocking=True).long() + self.offsets
        x = self.flat[levels].permute(0, 3, 1, 2)  # N x C x H x W, stored channels-last
        # NCHW's own strides, even for one channel (where the permuted view also counts as contiguous, and a
        # CPU convolution then takes it as channels-last: other rounding)
        return x if self.nhwc else x.clone(memory_format=torch.contiguous_format)


def host_batch(shape, channels_last, pinned):
    """(an empty N x C x H x W float32 tensor on the host, its memory as a numpy array in storage order:
    N x C x H x W, or N x H x W x C for channels_last). Page-locked (pinned) for a CUDA device, so its
    copy there can overlap the model's work."""
    stored = (shape[0], *shape[2:], shape[1]) if channels_last else shape
    tensor, memory = host_memory(stored, np.float32, pinned)
    return (tensor.permute(0, 3, 1, 2) if channels_last else tensor), memory


def host_memory(shape, dtype, pinned):
    """(an empty host tensor, the same memory as a numpy array), page-locked where `pinned`."""
    if pinned:
        tensor = page_locked(shape, torch.from_numpy(np.empty(0, dtype)).dtype)
        return tensor, tensor.numpy()  # a host tensor: no device sync
    memory = np.empty(shape, dtype)
    return torch.from_numpy(memory), memory


def page_locked(shape, dtype):
    """An empty page-locked (pinned) host tensor: a copy between it and a GPU need not wait for the stream."""
    return torch.empty(shape, dtype=dtype, pin_memory=True)


# A blended sum may take this share of the device's free memory; the rest is for the forwards.
DEVICE_BLEND_SHARE = 0.5


def cuda_free_memory(device):
    """Bytes a new tensor can have on a CUDA device: what the driver has free, plus what torch's caching
    allocator holds unused (after a training epoch, validation would otherwise see its cache as taken)."""
    return torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


class TileBlend:
    """The Gaussian-weighted sum of tile logits (fp32) and its division by the weights' sum.

    On a CPU, and on CUDA where the sum fits in DEVICE_BLEND_SHARE of the free memory, the sum lives
    on the device: a tile batch's logits never cross to the host, no sync per batch, one copy at the
    end. Otherwise (CUDA) each batch's weighted logits go to page-locked host memory with a
    non-blocking copy and are added one batch later, while the device computes the next: device memory
    stays one tile batch whatever the image. (MPS: summed on the host, one copy per batch.)
    The same adds in the same order on any device: the same logits to the bit.
    """

    def __init__(self, classes, shape, size, hw):
        self.size, self.ramp, self.pending = size, gaussian_ramp(size), None
        self.weight = (self.ramp[:, None] * self.ramp[None, :]).to(hw.device)
        fits = hw.kind == "cpu" or (hw.kind == "cuda" and 4 * classes * shape[0] * shape[1]
                                    < DEVICE_BLEND_SHARE * cuda_free_memory(hw.device))
        self.total = torch.zeros(classes, *shape, device=hw.device if fits else "cpu")

    def add(self, tiles, logits):
        weighted = logits.float() * self.weight
        if weighted.device == self.total.device:
            return self.accumulate(tiles, weighted)
        if weighted.device.type != "cuda":  # MPS: no events to wait on; a plain copy
            return self.accumulate(tiles, weighted.cpu())
        host = page_locked(weighted.shape, weighted.dtype)
        host.copy_(weighted, non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(weighted.device))  # the copy's stream: cuda:1's, not the current device's
        self.flush()  # the batch before this one: its copy had the whole forward above to finish
        self.pending = (tiles, host, done)

    def flush(self):
        if self.pending is not None:
            tiles, host, done = self.pending
            done.synchronize()
            self.pending = None
            self.accumulate(tiles, host)

    def accumulate(self, tiles, weighted):
        size = self.size
        for (y, x), tile in zip(tiles, weighted):
            self.total[:, y:y + size, x:x + size].add_(tile)  # add_: `+=` on a slice would copy it back

    def result(self, ys, xs):
        """The blended logits on the CPU (the classes x H x W sum divided by the weights' sum)."""
        self.flush()
        height, width = self.total.shape[1:]
        rows = coverage(ys, height, self.ramp).to(self.total.device)
        cols = coverage(xs, width, self.ramp).to(self.total.device)
        return self.total.div_(rows[None, :, None]).div_(cols[None, None, :]).cpu()


def eval_forward(model, x, cfg, prec, hw):
    """Inference forward of a batch in the run's layout, under autocast when prec says so: the one
    forward of validation (fit and sliding window) and predict. With test-time augmentation (cfg["tta"])
    the batch's views go through the model together, and their logits come back mapped to the input's
    orientation and averaged in fp32 (TTA); tta="none" adds no op."""
    views = TTA(cfg["tta"])
    x = views.expand(x.to(hw.device, non_blocking=True))
    if cfg["channels_last"] is True:  # resolved before: train() and predict_layout() decide it
        x = x.contiguous(memory_format=torch.channels_last)
    with torch.autocast(hw.kind, dtype=prec.dtype, enabled=prec.amp):
        logits = model(x)
    return views.merge(logits)


# Test-time augmentation: each view is (quarter turns, mirrored), applied as a left-right mirror, then
# the turns (torch.rot90 over height and width). "flip" is the four mirror images nnU-Net averages in 2-D
# (none, left-right, up-down, both = half a turn); "d4" all eight symmetries of the square.
TTA_VIEWS = {
    "none": ((0, False),),
    "flip": ((0, False), (0, True), (2, True), (2, False)),
    "d4": tuple((turns, mirrored) for mirrored in (False, True) for turns in range(4)),
}


class TTA:
    """The views of a batch under test-time augmentation: expand stacks them into one batch (view-major:
    view v of image i is row v * B + i), merge maps each view's logits back and averages them as fp32
    logits. With one view ("none") both return their input unchanged: no op, no copy."""

    def __init__(self, name):
        self.name, self.views = name, TTA_VIEWS[name]

    def __len__(self):
        return len(self.views)

    def expand(self, x):
        if len(self.views) == 1:
            return x
        if x.shape[-2] != x.shape[-1] and any(turns % 2 for turns, _ in self.views):
            raise UserError(f"tta={self.name} turns images by quarter turns, which needs square inputs; got "
                            f"{x.shape[-2]}x{x.shape[-1]}: use tta=flip (mirrors keep any shape)")
        return torch.cat([to_view(x, turns, mirrored) for turns, mirrored in self.views])

    def merge(self, logits):
        if len(self.views) == 1:
            return logits
        parts = logits.float().chunk(len(self.views))
        return torch.stack([from_view(part, *view) for part, view in zip(parts, self.views)]).mean(0)


def tta_summary(name):
    """A clause for the run's banner and predict's first line: empty for tta=none."""
    views = len(TTA_VIEWS[name])
    return "" if views == 1 else (f"; tta={name}: {views} views of each image in the same forward "
                                  f"({views}x the images per forward), logits averaged")


def to_view(x, turns, mirrored):
    x = x.flip(-1) if mirrored else x
    return x.rot90(turns, dims=(-2, -1)) if turns else x


def from_view(y, turns, mirrored):
    """to_view's inverse: turn back, then mirror back."""
    y = y.rot90(-turns, dims=(-2, -1)) if turns else y
    return y.flip(-1) if mirrored else y


def patch_summary(cfg, patches, left=0):
    """The banner's patch-mode line; `left`: the patches drop_last leaves out each epoch, as fit mode's images."""
    dropped = (f" ({left} more left out at random each epoch: full batches only"
               + (", an equal share per process)" if DIST.world > 1 else ")")) if left else ""
    return (f"patch mode: {patches} patches of {cfg['image_size']}x{cfg['image_size']} per epoch{dropped} at scale "
            f"{cfg['patch_scale']:g} ({cfg['patch_foreground']:.0%} centred on foreground); validation on "
            f"whole images by sliding window (overlap {cfg['tile_overlap']:g}, {cfg['tile_batch_size']} tiles "
            f"per forward)")


# ----------------------------------------------------------------------------------------------------
# III.7 Model, loss, optimizer, schedule, EMA.
# ----------------------------------------------------------------------------------------------------
def check_model_takes_image_size(cfg):
    """A model that cannot take image_size x image_size (PAN pools its 1/16 feature map three more times:
    it needs 128 px) is refused before anything moves, with the smallest size it takes; else a
    traceback from deep inside torch at the first batch, after the earlier run was moved aside. Judged on
    the meta device; a refusal there is confirmed by a real forward (an op the meta device lacks is not
    the model's limit), and a model that cannot be built there (mit_b* encoders) is not judged."""
    size = cfg["image_size"]
    if model_takes(cfg, size) is not False or model_runs_on_cpu(cfg, size):
        return
    side = smallest_model_side(cfg)
    raise UserError(f"arch={cfg['arch']} with encoder_name={cfg['encoder_name']} cannot take image_size={size} "
                    f"(its feature maps shrink below one pixel): use "
                    + (f"image_size={side} (the smallest it takes)" if side else "another image_size")
                    + ", or another arch")


def smallest_model_side(cfg, largest=1024):
    """The smallest side, a multiple of MODEL_STRIDE, of a square input the model takes on the meta device;
    None where no side up to `largest` does, or the model cannot be judged there."""
    sides = range(MODEL_STRIDE, largest + 1, MODEL_STRIDE)
    return next((side for side in sides if model_takes(cfg, side)), None)


def model_takes(cfg, side):
    return model_takes_side(*(cfg[k] for k in MODEL_KEYS), side)


@functools.lru_cache(maxsize=None)
def model_takes_side(arch, encoder_name, in_channels, num_classes, side):
    """Whether the model runs on a side x side input, traced on the meta device (shapes only: no memory,
    ~0.1 s), in eval mode (training BatchNorm refuses a 1x1 map of one image for another reason); None
    where it cannot be built there (mit_b* encoders read a value while built)."""
    cfg = {"arch": arch, "encoder_name": encoder_name, "in_channels": in_channels, "num_classes": num_classes,
           "encoder_weights": None}
    with torch.device("meta"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            model = build_model(cfg).eval()
        except Exception:  # noqa: BLE001 - not judged here; the real build reports its own errors
            return None
        try:
            model(torch.empty(1, in_channels, side, side))
        except Exception:  # noqa: BLE001 - pooling's RuntimeError, timm's AssertionError on a size
            return False
    return True


def model_runs_on_cpu(cfg, side):
    """Whether a real forward of one side x side image runs (the confirmation of a meta refusal)."""
    model = build_model({**cfg, "encoder_weights": None}).eval()
    try:
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model(torch.zeros(1, cfg["in_channels"], side, side))
    except Exception:  # noqa: BLE001 - the same failure as on the meta device
        return False
    return True


def build_model(cfg):
    import segmentation_models_pytorch as smp

    hub = None if cfg["encoder_weights"] is None else unreachable_hub()
    try:
        with hub_cache_only(hub):
            return getattr(smp, cfg["arch"])(encoder_name=cfg["encoder_name"],
                                             encoder_weights=cfg["encoder_weights"],
                                             in_channels=cfg["in_channels"], classes=cfg["num_classes"])
    except (OSError, ConnectionError, RuntimeError) as exc:
        if cfg["encoder_weights"] is None:
            raise
        why = (f"{hub} cannot be reached from here, and they are not in the local Hugging Face cache" if hub else
               f"{type(exc).__name__}: {str(exc)[:120]}")
        raise UserError(f"could not get encoder_weights={cfg['encoder_weights']!r} for {cfg['encoder_name']} "
                        f"({why}): to run offline use encoder_weights=None, or place the weights in the torch/HF "
                        f"cache first") from None
    except (KeyError, ValueError) as exc:
        none = " (or encoder_weights=None: random initial weights, no download)" if cfg["encoder_weights"] else ""
        raise UserError(f"cannot build {cfg['arch']}({cfg['encoder_name']}, encoder_weights="
                        f"{cfg['encoder_weights']!r}): {str(exc)[:200]}{none}") from None


# Pretrained weights come from the Hugging Face hub (smp-hub/<encoder>.imagenet; timm's too). Where it cannot
# be reached, huggingface_hub retries each request 5 times over 23 s, a log line each, before the one line
# build_model says: so the hub is asked first, and where it does not answer the weights come from its cache only.
HUB_PROBE_TIMEOUT_S = 3


def unreachable_hub():
    """The hub's host where a TCP connection to it fails within HUB_PROBE_TIMEOUT_S, else None. Behind a proxy
    (HTTPS_PROXY, ALL_PROXY) a direct connection says nothing: the download is left to try."""
    if any(os.environ.get(key) for key in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    import socket
    from urllib.parse import urlparse

    import huggingface_hub.constants

    url = urlparse(huggingface_hub.constants.ENDPOINT)  # HF_ENDPOINT: a mirror
    try:
        socket.create_connection((url.hostname, url.port or 443), timeout=HUB_PROBE_TIMEOUT_S).close()
    except OSError:
        return url.hostname
    return None


@contextlib.contextmanager
def hub_cache_only(unreachable):
    """huggingface_hub's offline mode (HF_HUB_OFFLINE, read at each request) while the hub is unreachable:
    cached weights load, missing ones fail at once. Nothing where it answers."""
    if not unreachable:
        yield
        return
    import huggingface_hub.constants as hub

    saved, hub.HF_HUB_OFFLINE = hub.HF_HUB_OFFLINE, True
    try:
        yield
    finally:
        hub.HF_HUB_OFFLINE = saved


def compiled(model, compile_model):
    """torch.compile(model) where compile_model is on (it compiles at the first call). Where no GPU answers
    but a CUDA toolkit is installed, torch's C++ builder logged 'No CUDA runtime is found, using
    CUDA_HOME=...' mid-way through the first batch: noise on a CPU run, whose banner says where it runs."""
    if not compile_model:
        return model
    import logging

    logging.getLogger("torch.utils.cpp_extension").setLevel(logging.ERROR)
    return torch.compile(model)


# The loss terms (loss="focal+dice", ...): smp's own implementations, summed with equal weights.
LOSS_TERMS = ("ce", "dice", "focal", "lovasz", "tversky")
FOCAL_GAMMA = 2.0                       # smp's default, Lin et al. 2017: well-classified pixels count less
TVERSKY_ALPHA, TVERSKY_BETA = 0.3, 0.7  # false positives, false negatives (Salehi et al. 2017): missed
                                        # foreground costs more; 0.5/0.5 would be Dice
SURE_LOGIT = 1e4  # focal: an ignored pixel becomes a certain, correct prediction, which focal scores as 0


def loss_terms(text):
    """'focal+dice' -> ('focal', 'dice'); None unless it is LOSS_TERMS joined by +, each at most once."""
    terms = tuple(t.strip().lower() for t in text.split("+")) if isinstance(text, str) else ()
    return terms if terms and set(terms) <= set(LOSS_TERMS) and len(set(terms)) == len(terms) else None


# The loss's rules as checkpoints record them: 2, multi-class focal's class_weights weigh each pixel (focal_term).
LOSS_RULES = 2


def changed_loss_rule(cfg, state):
    """A note where a resumed run's loss follows another rule than the one it began with, else None."""
    if state is None or state.get("loss_rules", 1) >= LOSS_RULES or cfg["class_weights"] is None \
            or cfg["num_classes"] == 1 or "focal" not in loss_terms(cfg["loss"]):
        return None
    return ("loss", "last.pt's focal term averaged its per-class terms by class_weights; from here each pixel is "
                    "weighted by its class, as in CE: the loss is on another scale from this epoch (val_loss jumps)")


# Other names users give a term (loss=bce read only the list of terms, no 'did you mean ce?').
LOSS_ALIASES = {"bce": "ce", "cross_entropy": "ce", "crossentropy": "ce", "xent": "ce", "softdice": "dice"}


def loss_hint(text):
    """'did you mean dice+ce? ' for a loss whose terms are each a known one misspelt or by another name
    (dise+ce, bce) or joined by a comma (dice,ce), else ''."""
    terms = [t.strip().lower() for t in re.split("[+,]", text)] if isinstance(text, str) else []
    fixed = [LOSS_ALIASES.get(t) or next(iter(difflib.get_close_matches(t, LOSS_TERMS, n=1)), None) for t in terms]
    if not terms or None in fixed or len(set(fixed)) != len(fixed):
        return ""
    return f"did you mean {'+'.join(fixed)}? "


class SegLoss(nn.Module):
    """The loss's terms from smp (CE is torch's), summed; always evaluated in fp32 with autocast off, and
    with padding and void (IGNORE_INDEX) ignored by every term. Per-pixel terms (CE, focal) are summed
    over the real pixels, region terms (Dice, Tversky, Lovasz) are batch means: parts() keeps the two
    apart, since accumulation divides them differently (forward_backward). class_weights (a list, one
    per class; binary: [background, foreground]) weight each pixel of the CE and focal terms by its class."""

    def __init__(self, num_classes, kind="dice+ce", class_weights=None, device=None):
        super().__init__()
        import segmentation_models_pytorch as smp

        terms = loss_terms(kind)
        assert terms is not None and class_weights != "auto", (kind, class_weights)  # validated, resolved before
        self.binary = num_classes == 1
        mode = "binary" if self.binary else "multiclass"
        self.weights = None if class_weights is None else torch.tensor(
            class_weights, dtype=torch.float32, device=device)  # on the device: no copy per step
        self.ce = "ce" in terms
        self.focal, self.focal_scale = (focal_term(mode, class_weights, self.weights) if "focal" in terms
                                        else (None, None))
        region = {"dice": lambda: smp.losses.DiceLoss(mode, from_logits=True, ignore_index=IGNORE_INDEX),
                  "tversky": lambda: smp.losses.TverskyLoss(mode, from_logits=True, ignore_index=IGNORE_INDEX,
                                                            alpha=TVERSKY_ALPHA, beta=TVERSKY_BETA),
                  "lovasz": lambda: LovaszTerm(mode)}
        self.region = nn.ModuleList(region[t]() for t in terms if t in region)

    def forward(self, logits, target):
        """The batch's loss: per-pixel terms averaged over its real (not ignored) pixels, plus region terms."""
        pixel_sum, region = self.parts(logits, target)
        return pixel_sum / valid_pixels(target).clamp(min=1) + region

    def parts(self, logits, target):
        """(per-pixel terms summed over the real pixels, region terms' batch means), both in fp32:
        accumulation divides the sum by its group's real pixels and the means by the group's size."""
        with torch.autocast(logits.device.type, enabled=False):  # smp #463: a Dice sum over 512^2 in fp16
            logits = logits.float()
            pixel = [self.ce_sum(logits, target)] if self.ce else []
            if self.focal is not None:
                pixel.append(self.focal_sum(logits, target))
            y = target.unsqueeze(1) if self.binary else target
            region = [term(logits, y) for term in self.region]
            return total(pixel, logits), total(region, logits)

    def ce_sum(self, logits, target):
        """Cross-entropy (binary: BCE) summed over the real pixels, each weighted by its class's weight.
        The weights follow the logits: patch-mode validation scores the window's logits where TileBlend
        left them, on the host, while the weights live on the training device."""
        weights = None if self.weights is None else self.weights.to(logits.device)  # no copy where they match
        if not self.binary:
            return nn.functional.cross_entropy(logits, target, weight=weights, ignore_index=IGNORE_INDEX,
                                               reduction="sum")
        weight = (target != IGNORE_INDEX).unsqueeze(1).float()
        if weights is not None:
            weight = weight * weights[(target == 1).long()].unsqueeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, (target.unsqueeze(1) == 1).float(), weight,
                                                              reduction="sum")

    def focal_sum(self, logits, target):
        """smp's focal loss summed over the real pixels. smp's own ignore_index drops ignored pixels by
        boolean indexing, a device sync per class on a GPU; here they become class 0, predicted with
        certainty (SURE_LOGIT), which the focal term scores as exactly 0, with zero gradient."""
        real = target != IGNORE_INDEX
        sure = logits.new_full((logits.shape[1],), -SURE_LOGIT)
        if not self.binary:
            sure[0] = SURE_LOGIT  # one-vs-rest per class: class 0 certain, every other class certainly not
        loss = self.focal(torch.where(real.unsqueeze(1), logits, sure.view(1, -1, 1, 1)), torch.where(real, target, 0))
        return loss if self.focal_scale is None else loss * self.focal_scale


def focal_term(mode, class_weights, weights):
    """(the focal term summed over the pixels, a factor for it or None), each pixel weighted by its class's
    weight, as in CE: the weights' scale counts as their ratios do (all weights x2 double the term against
    the region terms; ones are no weights). Binary, where smp takes no class_weights: its alpha = w_fg /
    (w_bg + w_fg), times (w_bg + w_fg). Multi-class: PixelWeightedFocal, since smp's class_weights weigh its
    per-class terms and divide by their sum, so 5,5,5 trained as no weights while binary 5,5 was x5."""
    import segmentation_models_pytorch as smp

    if class_weights is None:
        return smp.losses.FocalLoss(mode, gamma=FOCAL_GAMMA, reduction="sum"), None
    if mode == "multiclass":
        return PixelWeightedFocal(weights), None
    background, foreground = class_weights
    alpha = foreground / (background + foreground)
    return smp.losses.FocalLoss(mode, alpha=alpha, gamma=FOCAL_GAMMA, reduction="sum"), background + foreground


class PixelWeightedFocal(nn.Module):
    """smp's multi-class focal loss (one sigmoid focal term per class, one-vs-rest, summed over the pixels
    and averaged over the classes) with each pixel weighted by its true class's weight. In one pass over
    the classes, where smp loops over them."""

    def __init__(self, weights):
        super().__init__()
        self.weights = weights

    def forward(self, logits, target):
        classes = torch.arange(logits.shape[1], device=logits.device).view(1, -1, 1, 1)
        bce = nn.functional.binary_cross_entropy_with_logits(logits, (target.unsqueeze(1) == classes).to(logits.dtype),
                                                             reduction="none")
        focal = (1.0 - torch.exp(-bce)).pow(FOCAL_GAMMA) * bce  # smp's focal_loss_with_logits, per element
        weights = self.weights.to(logits.device)  # no copy where they match (SegLoss.ce_sum)
        return (focal.sum(1) * weights[target]).sum() / logits.shape[1]


class LovaszTerm(nn.Module):
    """smp's LovaszLoss, 0 for a batch of ignored pixels only (where smp's multi-class one returns an
    empty tensor). Unlike the other terms it makes the host wait for a GPU: it drops ignored pixels by
    boolean indexing and (multi-class) skips absent classes by a host check, once per class per batch;
    and it sorts every pixel's error."""

    def __init__(self, mode):
        super().__init__()
        import segmentation_models_pytorch as smp

        self.loss = smp.losses.LovaszLoss(mode, ignore_index=IGNORE_INDEX)

    def forward(self, logits, target):
        return self.loss(logits, target).sum()


def total(values, like):
    """The sum of a list of scalar tensors; 0 for none."""
    return functools.reduce(torch.add, values) if values else like.new_zeros(())


def run_class_weights(cfg, state, train_pairs, notes):
    """class_weights as this run uses them, saved with its config: "auto" is a resumed run's list, else
    inverse_frequency_weights of the training masks' pixels (class_pixel_counts)."""
    if cfg["class_weights"] != "auto":
        return cfg["class_weights"]
    if state is not None:
        saved = state["config"].get("class_weights")
        if saved is None:
            raise UserError("cannot resume exactly: the run was trained without class_weights, this run has "
                            "class_weights=auto: resume with class_weights=None, or start a new run in another "
                            "checkpoint_dir")
        notes.append(("loss", f"{cfg['loss']}; class_weights=auto -> {saved} (last.pt's: of the training masks "
                              f"as the run began)"))
        return saved
    counts = class_pixel_counts(train_pairs, cfg)
    weights = inverse_frequency_weights(counts)
    shares = " / ".join(f"{n / max(1, counts.sum()):.1%}" for n in counts)
    notes.append(("loss", f"{cfg['loss']}; class_weights=auto -> {weights} (inverse class frequency, mean pixel "
                          f"weight 1; the training masks' classes: {shares})"))
    return weights


def inverse_frequency_weights(counts):
    """class_weights=auto: w_c = 1 / (K f_c) for the K classes present with pixel shares f_c, absent
    classes 1. The ratios are median-frequency balancing's (SegNet); this scale makes the average
    training pixel weigh 1, so the weighted CE keeps the unweighted one's size next to the region terms
    and under the same learning rate (median frequency shrinks it as classes are added: x0.15 for
    shares 90/5/5%). Binary: both rules give 0.5 / f_c. Rounded to 4 significant digits."""
    shares = np.asarray(counts, np.float64) / max(1, int(np.sum(counts)))
    present = int(np.count_nonzero(shares))
    return [float(f"{1 / (present * f):.4g}") if f > 0 else 1.0 for f in shares]


def valid_pixels(target):
    """Pixels the loss and the metrics count (not padding, not void), as a device tensor: no sync."""
    return (target != IGNORE_INDEX).sum()


def build_optimizer(model, cfg):
    # No weight decay on biases and norm parameters (1-D tensors): decaying them only hurts.
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg["weight_decay"]},
              {"params": no_decay, "weight_decay": 0.0}]
    # Fused: one kernel updates every parameter. Without it PyTorch loops over the parameters in
    # Python on a CPU (measured: 46 -> 8 ms per step for the default model) and launches a dozen
    # grouped kernels per step on a GPU.
    fused = next(model.parameters()).device.type in FUSED_ADAMW_DEVICES or None
    return torch.optim.AdamW(groups, lr=cfg["learning_rate"], fused=fused)


FUSED_ADAMW_DEVICES = ("cpu", "cuda")

# How the update runs on this device, not what it computes: on resume they stay as build_optimizer set
# them, since a checkpoint's flags belong to the device (and PyTorch version) it was written on.
OPTIMIZER_RUNTIME_FLAGS = ("fused", "foreach")


def load_optimizer_state(optimizer, saved):
    """optimizer.load_state_dict, keeping this device's fused/foreach and the parameters' memory format.

    load_state_dict replaces the param groups' flags with the checkpoint's and keeps the moments' strides
    as saved; the fused kernel walks parameters and moments as flat arrays, so after a resume with
    another channels_last the moments would update the wrong elements.
    """
    now = [{k: g[k] for k in OPTIMIZER_RUNTIME_FLAGS if k in g} for g in optimizer.param_groups]
    groups = [{**g, **flags} for g, flags in zip(saved["param_groups"], now)]
    optimizer.load_state_dict({**saved, "param_groups": groups})  # also places `step` for these flags
    for param, state in optimizer.state.items():
        for key, value in state.items():
            if torch.is_tensor(value) and value.shape == param.shape and value.stride() != param.stride():
                state[key] = torch.empty_like(param, dtype=value.dtype).copy_(value)


LR_FLOOR = 0.01  # the warm-up starts and the cosine ends at 1% of the peak learning rate


def build_scheduler(optimizer, cfg, steps_per_epoch, schedule=None, start=(0, 0)):
    """Stepped once per optimizer step: each step takes the schedule's LR at the training progress it
    starts from (lr_factor). Progress counts epochs, so the curve does not depend on the steps per
    epoch, which change with the GPU count under torchrun.

    `schedule` (lr_schedule / extend_schedule, kept in checkpoints) fixes the shape; by default it is
    the one for cfg's epochs. `start`: (scheduler step, finished epochs) where this run begins: a
    resumed run counts its progress from the checkpoint's epoch with its own steps per epoch.
    """
    schedule = schedule or lr_schedule(cfg)
    step0, epoch0 = start

    def progress(step):
        # In integers first, so a resumed run's progress is bit-identical to an uninterrupted run's.
        # Before a resume's state is loaded, LambdaLR evaluates step 0: clamped to the resume point.
        epochs, within = divmod(max(0, step - step0), steps_per_epoch)
        return epoch0 + epochs + within / steps_per_epoch
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(progress(step), schedule))


def lr_schedule(cfg):
    """The schedule's shape in epochs: linear warm-up from the floor to the peak, cosine to the floor."""
    return {"epochs": cfg["epochs"], "warmup": cfg["epochs"] * cfg["warmup_fraction"], "tails": []}


def lr_factor(progress, schedule):
    """The LR multiplier at `progress` (epochs, fractional): warm-up and cosine, or the latest tail begun."""
    tails = [tail for tail in schedule["tails"] if tail[0] <= progress]
    if tails:
        start, end, begin = tails[-1]
        return cosine_factor(begin, (progress - start) / (end - start))
    warmup, epochs = schedule["warmup"], schedule["epochs"]
    if progress < warmup:
        return LR_FLOOR + (1 - LR_FLOOR) * progress / warmup
    return cosine_factor(1.0, (progress - warmup) / (epochs - warmup))


def cosine_factor(begin, progress):
    return LR_FLOOR + (begin - LR_FLOOR) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


def in_warmup(progress, schedule):
    return progress < schedule["warmup"] and not any(tail[0] <= progress for tail in schedule["tails"])


def extend_schedule(schedule, progress, epochs):
    """epochs changed on resume, at `progress`. Still in warm-up: the warm-up goes on to the peak as
    before, then the cosine spans the new length. Past it: from `progress` on, a cosine from the LR
    reached there down to the floor at the new end. No restart: a finished run (at the floor) stays there."""
    if in_warmup(progress, schedule) and schedule["warmup"] < epochs:
        return {**schedule, "epochs": epochs}
    return {**schedule, "tails": [*schedule["tails"], [progress, epochs, lr_factor(progress, schedule)]]}


def checkpoint_schedule(state, cfg):
    """The checkpoint's LR schedule. Older checkpoints count it in optimizer steps ("total"), converted
    with the steps per epoch they ran; the oldest have none: the default one for their epochs."""
    schedule = state.get("lr_schedule")
    if schedule is None:
        return lr_schedule({**cfg, "epochs": state["config"]["epochs"]})
    if "total" not in schedule:
        return schedule
    per = state["scheduler"]["last_epoch"] / state["epoch"]
    return {"epochs": schedule["total"] / per, "warmup": schedule["warmup"] / per,
            "tails": [[start / per, end / per, begin] for start, end, begin in schedule["tails"]]}


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


# The EMA's warm-up (TensorFlow's ExponentialMovingAverage with num_updates; timm and ultralytics warm
# theirs up too): the n-th applied update uses decay min(ema_decay, (1 + n) / (EMA_WARMUP + n)), so the
# shadow averages about the last n/9 steps until ema_decay takes over (after (10 * ema_decay - 1) /
# (1 - ema_decay) updates: 890 for 0.99) instead of keeping the random initialisation's weight
# ema_decay**n (0.999**500 = 61 %) through a run that is short for its decay.
EMA_WARMUP = 10


class WeightEMA:
    """An exponential moving average of the weights and BatchNorm statistics; ema_decay=None: off, holding
    nothing and doing nothing (not one op).

    The shadow `model` is an fp32 copy of the model in eval mode (`eval_model`: compiled when the run
    compiles; never DDP-wrapped: every rank keeps its own, updated alike). update(step.applied) after each
    optimizer step averages the parameters and floating-point buffers (running mean/var) in one grouped op
    and copies the integer ones (num_batches_tracked), with no host sync:
    - `applied` a host bool (nan_guard on, or no GradScaler): a skipped step returns before any op; the
      decay is counted and computed on the host.
    - a device bool (fp16 without nan_guard: the GradScaler decides on the device): the count and the decay
      are on the device, and a skipped step's decay is 1 (no change).
    """

    def __init__(self, model=None, decay=None, compile_model=False):
        self.decay, self.updates, self.model = decay, 0, None  # updates: applied ones (int, or device int)
        self.eval_model = None
        if decay is None:
            return
        live = unwrap(model)
        self.model = copy.deepcopy(live).float().eval().requires_grad_(False)
        self.eval_model = compiled(self.model, compile_model)
        self.live, self.shadow = ema_tensors(live), ema_tensors(self.model)

    def decay_at(self, n):
        """The decay of the n-th applied update (n from 1, a number or a device tensor): the warm-up,
        then ema_decay."""
        warm = (1 + n) / (EMA_WARMUP + n)
        return warm.clamp(max=self.decay) if isinstance(warm, torch.Tensor) else min(self.decay, warm)

    @torch.no_grad()
    def update(self, applied):
        if self.model is None or applied is False:
            return
        (floats, ints), (live_floats, live_ints) = self.shadow, self.live
        if isinstance(applied, torch.Tensor):
            self.updates = self.updates + applied  # a device int from here on
            decay = torch.where(applied, self.decay_at(self.updates.float()), 1.0)
            torch._foreach_mul_(floats, decay)
            torch._foreach_add_(floats, torch._foreach_mul(live_floats, 1 - decay))
        else:
            self.updates += 1
            torch._foreach_lerp_(floats, live_floats, 1 - self.decay_at(self.updates))
        if ints:
            torch._foreach_copy_(ints, live_ints)

    def evaluated(self, model):
        """The model validation runs: the shadow when on (its BatchNorm statistics rank 0's, the ones its
        checkpoint holds), else `model`."""
        if self.model is None:
            return model
        broadcast_buffers(self.model)
        return self.eval_model

    def state(self):
        """For checkpoints: None when off. Reading a device count back is one sync, at the epoch's end."""
        if self.model is None:
            return None
        return {"model": self.model.state_dict(), "updates": int(self.updates), "decay": self.decay}

    def load(self, saved, model):
        """A checkpoint's EMA; where it has none (a run without EMA, or from before it), the EMA starts
        from `model`'s weights (those just resumed) with its warm-up."""
        if self.model is None:
            return
        self.model.load_state_dict(saved["model"] if saved else unwrap(model).state_dict())
        self.updates = saved["updates"] if saved else 0

    def note(self, state):
        """The banner's line: what the EMA does in this run (off: None, unless a resumed EMA is dropped)."""
        saved = state is not None and bool(state.get("ema"))
        if self.model is None:
            return ("ema", "off (ema_decay=None): the EMA that last.pt holds is not carried on; best.pt's IoU to "
                           "beat is the EMA weights'") if saved else None
        start = ("; last.pt holds no EMA: it starts from the resumed weights, and best.pt's IoU to beat is the raw "
                 "weights'" if state is not None and not saved else "")
        was = state["ema"].get("decay") if saved else self.decay
        if was not in (None, self.decay):  # a changed decay had no word, where a started or dropped EMA had one
            start = (f"; changed from {was}, last.pt's: its averaged weights go on at the new decay (the epochs "
                     f"from here average about the last {1 / (1 - self.decay):.0f} steps, not {1 / (1 - was):.0f})")
        return ("ema", f"decay {self.decay} (warm-up: min(decay, (1+n)/({EMA_WARMUP}+n)) at update n); "
                       f"validation, best.pt and predict use the EMA weights{start}")


def ema_tensors(model):
    """(floating-point parameters and buffers, integer buffers) of a model, in a fixed order."""
    tensors = [*model.parameters(), *model.buffers()]
    return [t for t in tensors if t.is_floating_point()], [t for t in tensors if not t.is_floating_point()]


# ----------------------------------------------------------------------------------------------------
# III.8 Metrics: dataset-level IoU / Dice from a confusion matrix on the device; per-class tables.
# ----------------------------------------------------------------------------------------------------
def sum_dtype(device):
    """dtype of the running sums kept on the device (losses, gradient norms): float64, so an epoch's
    sum loses nothing, except on MPS, which has no float64. Exact counts are int64 everywhere."""
    return torch.float32 if torch.device(device).type == "mps" else torch.float64


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
        # n*n counts plus one bin for ignored pixels; `matrix` is a view of the counts.
        self.flat = torch.zeros(self.n * self.n + 1, dtype=torch.int64, device=device)
        self.matrix = self.flat[:self.n * self.n].view(self.n, self.n)
        self._one = torch.ones((), dtype=torch.int64, device=device)

    @torch.no_grad()
    def update(self, logits, target):
        pred = (logits[:, 0] > 0) if self.binary else logits.argmax(1)
        target = target.reshape(-1).long()
        # A fixed-size scatter-add: unlike torch.bincount (which reads its input's min/max back to the
        # host) it never syncs. Ignored pixels (255, and n <= 255 classes) land past the n*n counts:
        # the clamp puts them in the extra bin (no boolean indexing either).
        index = torch.add(pred.reshape(-1), target, alpha=self.n).clamp_(max=self.n * self.n)
        if index.device == self.flat.device:
            self.flat.scatter_add_(0, index, self._one.expand(index.shape))
        else:  # whole images (patch mode) are counted on the CPU where their logits are; only counts move
            ones = torch.ones((), dtype=torch.int64, device=index.device).expand(index.shape)
            self.flat += torch.zeros_like(self.flat, device=index.device).scatter_add_(0, index, ones).to(self.flat.device)

    def with_counts(self, flat):
        """A copy of this metric holding the given counts (e.g. a host copy, for a progress bar)."""
        copy = SegMetric(1 if self.binary else self.n, flat.device)
        copy.flat.copy_(flat)
        return copy

    def all_reduce(self):
        """Sum the counts over ranks (exact: integers), so every rank sees the whole set's IoU."""
        all_reduce_(self.matrix)
        return self

    def counts(self):
        """Per-class (TP, FP, FN) as int64 tensors; rows of the matrix are targets, columns predictions."""
        tp = self.matrix.diag()
        return tp, self.matrix.sum(0) - tp, self.matrix.sum(1) - tp

    def compute(self):
        # The rates in float64 on the host: the exact counts go there anyway, and MPS has no float64.
        tp, fp, fn = (c.double() for c in self.with_counts(self.flat.cpu()).counts())
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

    def confusion(self):
        """The counts as a list of rows (true class) of columns (predicted class): what IoU is computed from."""
        return self.flat[:self.n * self.n].cpu().view(self.n, self.n).tolist()


def score_masks(pred, truth, num_classes):
    """SegMetric's result for one predicted mask (class indices, as predict writes them) against its truth
    (read_mask's; void left out): a mask scored as validation scores logits (the notebook's per-image IoU)."""
    if np.shape(pred) != np.shape(truth) or np.ndim(pred) != 2:
        raise UserError(f"the predicted mask is {'x'.join(map(str, np.shape(pred)))} and its truth "
                        f"{'x'.join(map(str, np.shape(truth)))}: score masks of one image, both H x W class "
                        f"indices (a mask predicted at another size: predict writes each at its image's size)")
    metric, pred = SegMetric(num_classes), torch.as_tensor(np.asarray(pred)).long()
    logits = (pred > 0).float()[None, None] * 2 - 1 if num_classes == 1 else \
        nn.functional.one_hot(pred, num_classes).permute(2, 0, 1)[None].float()  # argmax gives pred back
    metric.update(logits, torch.as_tensor(np.asarray(truth))[None])
    return metric.compute()


class EpochTally:
    """A training pass's loss and IoU/Dice, summed on the device (no host sync per micro-step) and read
    back once, by result(). Non-finite losses count as 0 and are left out of the mean (nan where all were)."""

    def __init__(self, num_classes, device):
        self.metric = SegMetric(num_classes, device)
        self.loss_sum = torch.zeros((), device=device, dtype=sum_dtype(device))
        self.finite_losses = torch.zeros((), device=device, dtype=torch.int64)
        self.images, self.start = 0, time.perf_counter()

    def add(self, loss, logits, y):
        """Count one micro-batch; returns whether its loss was finite (a device bool)."""
        finite = loss.detach() * 0 == 0  # isfinite in two ops instead of four
        self.loss_sum += loss.detach().nan_to_num(0.0, 0.0, 0.0)
        self.finite_losses += finite
        self.metric.update(logits.detach(), y)
        self.images += y.shape[0]
        return finite

    def loss_pair(self):
        return torch.stack([self.loss_sum, self.finite_losses.to(self.loss_sum.dtype)])

    def result(self, health, hw):
        synchronize(hw)  # CUDA runs asynchronously: wait for the last kernel before reading the clock
        elapsed = time.perf_counter() - self.start
        scores = self.metric.all_reduce().compute()
        all_reduce_(self.loss_sum), all_reduce_(self.finite_losses)
        images = self.images * DIST.world
        finite = self.finite_losses.item()  # none (nan_guard=False, every loss NaN): nan, not a perfect 0.0
        return {"loss": self.loss_sum.item() / finite if finite else math.nan, "iou": scores["iou"],
                "dice": scores["dice"], "time": elapsed, "images_per_s": images / elapsed if elapsed else 0.0,
                "stats": health.stats()}


def class_name_lines(path):
    """class_names.txt's lines, each a class, as load_class_names and the data check's hint (set_classes) count
    them: stripped, trailing blank lines left out, and labelme's first line __ignore__ (void, -1: here 255)."""
    # utf-8-sig: the byte-order mark Windows Notepad writes is not part of class 0's name
    names = [line.strip() for line in Path(path).read_text(encoding="utf-8-sig").rstrip("\n").splitlines()]
    while names and not names[-1]:  # trailing blank lines, spaces and all
        names.pop()
    return names[1:] if names[:1] == ["__ignore__"] else names


def load_class_names(cfg):
    """Class names, one per line, class 0 first (VOC/labelme convention); indices when there is no file.

    Binary runs have one class, the foreground: the file may list it alone or after the background.
    """
    n = cfg["num_classes"]
    path = Path(cfg["data_dir"]) / "class_names.txt"
    if not_a_file := ("a folder" if path.is_dir() else special_file(path)):  # was taken as no file: the indices
        raise UserError(f"{path} is {not_a_file}: class names are a text file, one name per line, class 0 first: "
                        f"put that file in its place, or remove it")
    if not path.is_file():
        return ["foreground"] if n == 1 else [str(i) for i in range(n)]
    try:
        names = class_name_lines(path)
    except (OSError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path} ({type(exc).__name__}): save it as UTF-8 text, one class "
                        f"name per line") from None
    if "" in names:  # one in the middle read 'has 4 line(s) but num_classes=3 needs 3', the blank one unnamed
        line = names.index("") + 1
        raise UserError(f"{path}: line {line} is blank: one class name per line, class 0 first (remove the line, "
                        f"or name the class, e.g. unused_{line - 1})")
    names = without_indices(names, path)
    allowed = (1, 2) if n == 1 else (n,)
    if len(names) not in allowed:
        want = "1 (the foreground) or 2 (background, foreground)" if n == 1 else str(n)
        raise UserError(f"{path} has {len(names)} line(s) but num_classes={n} needs {want}: one class "
                        f"name per line, class 0 first (e.g. background)")
    slugs = [class_slug(name) for name in names]
    if not all(slugs) or len(set(slugs)) < len(slugs):
        raise UserError(f"{path}: every line needs a name of its own once spaces and punctuation become _ "
                        f"(as in history.csv's columns: {', '.join(map(repr, slugs))}), got {names}")
    return names[-1:] if n == 1 else names


def without_indices(names, path="class_names.txt"):
    """Lines that start with their class index ('0 background', '1: road', as some label tools write them):
    the names alone, where every line starts with an index, each of 0..N-1 once (in any order: the names
    by their index; a binary file's one line: 1). Numbers beyond N-1 are no indices ('10 cm', 1-based
    lines): the lines as they are, in line order. A repeat, or a gap, among 0..N-1 is refused: the lines
    had been kept as names, given by line, so '0 background, 2 dog, 1 cat' labelled class 1's scores 'dog' (and
    '0 background, 1 cat, 2 dog, 4 fish', most of its numbers indices, put 'fish' on class 3)."""
    found = [re.fullmatch(r"(\d+)(?:\s*[:,;=]\s*|\s+)(\S.*)", name) for name in names]
    if not names or not all(found):
        return names
    indices = [int(match.group(1)) for match in found]
    if indices == [1]:
        return [found[0].group(2)]
    within = sum(index < len(names) for index in indices)
    zero_based = 0 in indices and 2 * within > len(names)  # '0 background, 1 cat, 2 dog, 4 fish': class 3 had none
    if any(index >= len(names) for index in indices) and not zero_based:  # '10 cm', or 1-based: names as written
        return names
    if sorted(indices) != list(range(len(names))):
        raise UserError(f"{path} numbers its lines {', '.join(map(str, indices))}: a line's number is its class "
                        f"index (the mask value), each of 0 to {len(names) - 1} once: number them so, or give the "
                        f"names alone, one per line, class 0 first")
    return [match.group(2) for _, match in sorted(zip(indices, found))]


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


def per_class_table(row, names, absent=()):
    """The end-of-run table: IoU and Dice per class of one history row (multi-class runs). `absent`: the
    classes no validation mask holds; one the model predicted all the same has IoU 0, said as such."""
    if len(names) < 2:
        return None
    width = max(len("class"), *map(len, names))
    lines = [f"  {'class':<{width}}    IoU    Dice"]
    for i, name in enumerate(names):
        iou, dice = row[f"val_iou_{class_slug(name)}"], row[f"val_dice_{class_slug(name)}"]
        cells = "absent from the val set" if math.isnan(iou) else f"{iou:.4f}  {dice:.4f}"
        if i in absent and not math.isnan(iou):
            cells += "  absent from the val set but predicted: 0 in the mean"
        lines.append(f"  {name:<{width}}  {cells}")
    mean = "(mean)" if "mean" in (name.lower() for name in names) else "mean"  # not a second row of a class
    lines.append(f"  {mean:<{width}}  {row['val_iou']:.4f}  {row['val_dice']:.4f}")
    return "\n".join(lines)


CONFUSION_FILES = ("confusion_matrix.csv", "confusion_counts.csv")  # normalised per true class; counts


def save_confusion(ckpt_dir, counts, names):
    """Multi-class runs, at the best epoch: the validation confusion matrix, rows = true class, columns =
    predicted class, with class names: the share of each true class's pixels (CONFUSION_FILES[0]; a
    class absent from the set has an empty row) and the pixel counts (CONFUSION_FILES[1])."""
    if counts is None or len(names) < 2:
        return
    for name, values in zip(CONFUSION_FILES, (confusion_shares(counts), counts)):
        rows = [["true \\ predicted", *names]] + [[true, *row] for true, row in zip(names, values)]
        atomic_write(Path(ckpt_dir) / name, lambda tmp, rows=rows: write_csv_rows(tmp, rows))


def confusion_shares(counts):
    """Each row of a counts matrix divided by its sum (None where the true class has no pixels)."""
    return [[c / sum(row) if sum(row) else None for c in row] for row in counts]


def write_csv_rows(path, rows):
    with open(path, "w", newline="") as f:
        csv.writer(f).writerows(rows)


# The confusion figure's class names are cut to this many characters (the rest as …): a 40-character name had
# no room beside the cells (cut off, and a tight_layout warning every epoch); class_names.txt keeps them whole.
CONFUSION_NAME_CHARS = 32


def confusion_figure(counts, names):
    """The confusion matrix normalised per true class, as a matplotlib figure (TensorBoard, notebook)."""
    from matplotlib.figure import Figure

    shares = np.array([[math.nan if v is None else v for v in row] for row in confusion_shares(counts)])
    names = [n if len(n) <= CONFUSION_NAME_CHARS else n[:CONFUSION_NAME_CHARS - 1] + "…" for n in map(str, names)]
    size, label = 1.2 + 0.5 * len(names), 0.075 * max(map(len, names))  # inches: the labels' room beside the cells
    fig = Figure(figsize=(size + 1.5 + label, size + 0.75 * label))  # x labels at 45°: about 3/4 as tall as long
    ax = fig.add_subplot()
    image = ax.imshow(shares, vmin=0, vmax=1, cmap="Blues")
    ax.set_xticks(range(len(names)), names, rotation=45, ha="right")
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    for (i, j), share in np.ndenumerate(shares):
        if not math.isnan(share):
            ax.text(j, i, f"{share:.2f}", ha="center", va="center", color="white" if share > 0.5 else "black")
    fig.colorbar(image, ax=ax, label="share of the true class's pixels")
    fig.tight_layout()
    return fig


# ----------------------------------------------------------------------------------------------------
# III.9 Numerical safety: guard, BatchNorm snapshot, gradient health, streak, fallback, diagnosis.
# ----------------------------------------------------------------------------------------------------
class NonFiniteStreak(Exception):
    """Internal: nan_patience bad steps in a row. train() falls back to a safer precision."""

    def __init__(self, step, batch):
        super().__init__(f"non-finite loss or gradients for several steps up to step {step}")
        self.step, self.batch = step, batch


class StepGuard:
    """The training loop's numerical safety as one object: each accumulation group's BatchNorm
    snapshot, the epoch's gradient health, and the streak of bad steps that ends in a fallback.
    With nan_guard off the snapshot does nothing and no step is bad (step_if_finite), so the streak
    never grows; gradient health is recorded either way."""

    def __init__(self, model, cfg, device, streak=0):
        self.snapshot = BatchNormSnapshot(model, enabled=cfg["nan_guard"])
        self.health = GradHealth(device, streak)
        self.patience = cfg["nan_patience"]
        self.last_batch = None  # the epoch's last micro-batch: warn_fp16_underflow's comparison

    def start_group(self):
        self.snapshot.save()

    def count_zeros_now(self):
        return self.health.sample_zeros()

    def after_step(self, step, step_number, batch):
        if step.loss_bad:  # its forward poisoned BatchNorm's running statistics
            self.snapshot.restore()
        self.health.record(step)
        self.last_batch = batch
        if self.health.bad_streak >= self.patience:
            raise NonFiniteStreak(step_number, batch)


def step_if_finite(optimizer, scaler, cfg, loss_ok, result):
    """The guard: step unless a loss of the group or the gradient norm is non-finite (a non-finite
    gradient makes the norm so, so the norm is the whole gradient check). With nan_guard on, the one
    host sync per optimizer step reads these flags (never per micro-batch); with it off there is none
    (fp16's GradScaler.step then makes its own, as in any PyTorch loop)."""
    if scaler is not None:
        scaler_step(optimizer, scaler, cfg, loss_ok, result)
    elif cfg["nan_guard"]:
        loss_fine, norm_value = host_flags(loss_ok.to(result.norm.dtype), result.norm)
        grads_fine = math.isfinite(norm_value)
        result.applied, result.loss_bad = bool(loss_fine) and grads_fine, not loss_fine
        result.bad = not result.applied
        if result.applied:
            optimizer.step()
    else:  # plain PyTorch behaviour: no check, no sync
        optimizer.step()


@dataclass
class StepResult:
    """What one optimizer step did. `applied` is a host bool, or a device bool under fp16 without
    nan_guard (the scaler decides on the device; nothing reads it back)."""
    norm: torch.Tensor            # pre-clip total gradient norm (device)
    applied: bool | torch.Tensor
    bad: bool = False             # counts towards the fallback streak
    loss_bad: bool = False        # a loss of the group was non-finite: its forward poisoned BatchNorm
    zeros: torch.Tensor | None = None  # zero gradient entries (device), on sampled steps only
    elems: int = 0                # gradient entries counted


def scaler_step(optimizer, scaler, cfg, loss_ok, result):
    """fp16: step when the scaler found no inf/NaN gradient, then update the scale.

    A step is `bad` when its loss was non-finite (a forward overflow no scale can fix), or when its
    gradients overflow even with the loss scaled *down* (scale < 1): fp16 cannot hold them. Any
    other skip is the scaler's normal business.
    """
    found_inf = sum(scaler._found_inf_per_device(optimizer).values())  # recorded by unscale_()
    if not cfg["nan_guard"]:
        scaler.step(optimizer)
        scaler.update()
        result.applied = found_inf == 0
        return
    # The guard's one sync also answers GradScaler.step's question (any inf?), so the optimizer is
    # stepped here directly, exactly when GradScaler.step would.
    loss_fine, grads_fine, scale = host_flags(loss_ok.float(), (found_inf == 0).float(), scaler._scale.float())
    if grads_fine:
        optimizer.step()
    scaler.update()
    result.applied, result.loss_bad = bool(grads_fine), not loss_fine
    result.bad = not loss_fine or (not grads_fine and scale * scaler.get_backoff_factor() < 1.0)


def host_flags(*flags):
    """The guard's one device->host sync per optimizer step: small same-dtype scalars, read together."""
    return torch.stack(flags).tolist()


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


ZERO_GRAD_EVERY = 8  # optimizer steps between zero-gradient counts (a count reads every gradient)


class GradHealth:
    """Gradient health of one epoch, accumulated on the device and read back once, by stats().

    No host sync per step. `last_norm` is the latest step's pre-clip norm (a device tensor), for
    anyone who wants per-step values (reading it syncs).
    """

    def __init__(self, device, streak=0):
        self.norm_sum = torch.zeros((), dtype=sum_dtype(device), device=device)
        self.norm_max = torch.zeros((), dtype=torch.float32, device=device)
        self.counts = torch.zeros(3, dtype=torch.int64, device=device)  # skipped, zero entries, entries
        self.steps, self.skipped, self.bad_streak, self.last_norm = 0, 0, streak, None

    def sample_zeros(self):
        """Count zero gradients on this step? Every ZERO_GRAD_EVERY-th step, starting with the first."""
        return self.steps % ZERO_GRAD_EVERY == 0

    def record(self, step):
        self.steps += 1
        self.bad_streak = self.bad_streak + 1 if step.bad else 0
        self.last_norm = step.norm
        if step.applied is False:  # known on the host (nan_guard on): nothing else to add
            self.skipped += 1
            return
        on_device = isinstance(step.applied, torch.Tensor)
        norm = torch.where(step.applied, step.norm, 0.0) if on_device else step.norm.float()
        self.norm_sum += norm
        torch.maximum(self.norm_max, norm, out=self.norm_max)
        if on_device:
            self.counts[0] += ~step.applied
        if step.zeros is not None:
            weight = step.applied if on_device else 1
            self.counts[1] += step.zeros * weight
            self.counts[2] += weight * step.elems

    def stats(self):
        """The epoch's StepStats: two small device->host reads (the norms, the exact counts)."""
        norm_sum, norm_max = torch.stack([self.norm_sum, self.norm_max.to(self.norm_sum.dtype)]).tolist()
        device_skips, zeros, elems = self.counts.tolist()
        return StepStats(self.steps, self.skipped + device_skips, norm_sum, norm_max, zeros, elems,
                         self.bad_streak)


# Where _foreach_norm has a fused kernel for ord 1, 2 and inf only (CUDA's multi-tensor kernels).
ZERO_COUNT_BY_L1 = ("cuda",)


def count_zero_grads(grads):
    """Gradient entries exactly 0, as a device scalar, in grouped (foreach) ops, not one per tensor.

    CUDA: |sign(g)| is 1 where g != 0, so its L1 norm counts the non-zeros (three fused kernels).
    Elsewhere foreach ops loop over the tensors in C++ anyway, and the L0 norm counts the non-zeros
    in one pass with no temporaries (a CPU: 12 ms instead of 40 for the default model's gradients).
    """
    if not grads:
        return torch.zeros((), dtype=torch.int64)
    if grads[0].device.type in ZERO_COUNT_BY_L1:
        nonzero = torch._foreach_sign(grads)
        torch._foreach_abs_(nonzero)
        norms = torch._foreach_norm(nonzero, 1)
    else:
        norms = torch._foreach_norm(grads, 0)
    total = sum(g.numel() for g in grads)
    return total - torch.stack(norms).long().sum()  # each norm is a whole count: exact in int64


class BatchNormSnapshot:
    """BatchNorm running statistics as they were at the start of an accumulation group.

    A NaN batch poisons them during its forward pass, even though its step is skipped: save()
    copies the floating-point buffers with one grouped copy per dtype (no per-buffer ops), and
    restore() puts them back only when a group's loss was non-finite. (num_batches_tracked, an
    integer count of forward passes, cannot be poisoned.) enabled=False: holds nothing, does nothing.
    """

    def __init__(self, model, enabled=True):
        groups = {}
        for buffer in (b for b in model.buffers() if b.is_floating_point() and enabled):
            groups.setdefault((buffer.device, buffer.dtype), []).append(buffer)
        self.live = list(groups.values())
        self.saved = [[b.detach().clone() for b in group] for group in self.live]

    def save(self):
        for live, saved in zip(self.live, self.saved):
            torch._foreach_copy_(saved, live)

    def restore(self):
        for live, saved in zip(self.live, self.saved):
            torch._foreach_copy_(live, saved)


def rollback_point(run, cfg):
    """The state to roll back to when a precision goes non-finite (nan_guard): a CPU copy, once per epoch."""
    return to_cpu(run.state(cfg)) if cfg["nan_guard"] else None


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


def fall_back(run, bad, snapshot, hw, cfg, epoch):
    """nan_patience bad steps in a row: roll back and continue in a safer precision, or stop in fp32."""
    run.logger.flush_steps("rolled_back")  # the steps that went bad stay visible
    nxt = safer_precision(run.prec, hw)
    ckpt = Path(cfg["checkpoint_dir"]) / "last.pt"
    if nxt is None:
        where = diagnose_nonfinite(unwrap(run.model), bad.batch, run.loss_fn)
        kept = f"{ckpt} (epoch {run.epoch}) is intact" if run.epoch else "no checkpoint was written yet"
        causes = "" if "class_weights" in where else \
            f"; likely causes: learning_rate={cfg['learning_rate']} too high, or NaN/inf/garbage in the data"
        raise UserError(f"training went non-finite in fp32 at step {bad.step} (epoch {epoch}): {where}{causes}; {kept}")
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


def safer_precision(prec, hw):
    """fp16 -> bf16 where native, else fp32; bf16 -> fp32; fp32 -> None (nothing safer)."""
    if prec.dtype == torch.float16 and hw.bf16:
        return Precision.of(torch.bfloat16, "fallback from fp16 (non-finite)")
    if prec.amp:
        return Precision.of(torch.float32, f"fallback from {prec.name} (non-finite)")
    return None


def native_precisions(hw):
    """{precision: whether this hardware runs it natively}; fp32 always."""
    return {"fp16": hw.fp16, "bf16": hw.bf16, "fp32": True}


def precision_was_auto(config):
    """Whether a saved config left the precision to auto (use_amp=True, amp_dtype="auto"; a checkpoint from
    before either key counts as auto)."""
    return config.get("use_amp", True) and amp_dtype_name(config.get("amp_dtype", "auto")) == "auto"


def keep_safer_precision(prec, state, hw):
    """On resume, a run that fell back earlier keeps its safer precision, on the hardware it runs on now:
    where that precision is not native here (bf16 on a CPU without AVX512-BF16), one step safer still."""
    if not state.get("fallbacks") or SAFETY_ORDER.index(state["precision"]) <= SAFETY_ORDER.index(prec.name):
        return prec
    name = state["precision"]
    native = native_precisions(hw)
    safer = next(n for n in SAFETY_ORDER[SAFETY_ORDER.index(name):] if native[n])
    why = f"this run fell back to {name} ({state['fallbacks'][-1]['event']})"
    if safer != name:
        why += f"; {name} is not native on {hw.device}, so {safer}"
    return Precision.of(DTYPES[safer], f"kept from the checkpoint: {why}")


def keep_chosen_precision(prec, cfg, state, hw, explicit=()):
    """On resume with the precision left at auto (CONFIG's use_amp=True, amp_dtype="auto", neither given), a
    run whose precision was set (use_amp=False, preset=stable, amp_dtype=float16) goes on in it where it is
    native here: resumed without repeating preset=stable, an fp32 run went on in bf16, unsaid. Returns
    (precision, cfg with the checkpoint's use_amp and amp_dtype: config.json and the next resume see them).
    A precision given on resume is used as given (other_modes notes the change)."""
    was, saved = state["config"], state["precision"]
    chosen = not precision_was_auto(was)
    native = native_precisions(hw)[saved]
    given = set(explicit) | set(PRESETS.get(cfg.get("preset")) or ())  # a preset given now sets them too
    auto = cfg["use_amp"] and cfg["amp_dtype"] == "auto" and not {"use_amp", "amp_dtype"} & given
    if not (auto and chosen and native):
        return prec, cfg
    cfg = {**cfg, "use_amp": was.get("use_amp", True), "amp_dtype": was.get("amp_dtype", "auto")}
    if saved == prec.name == "fp32":  # auto's own choice: no half precision is native here
        return prec, cfg
    # a bf16 set is kept, and said so, even where auto's flag rule picks bf16 too: its "auto: native bf16" claimed
    # a choice auto had not made (the CPU probe can choose fp32; an auto run resumed keeps the probe's choice)
    setting = "use_amp=False" if not was.get("use_amp", True) else f"amp_dtype={was['amp_dtype']}"
    preset = f", from preset={was['preset']}" if was.get("preset") else ""
    # use_amp=True typed decides again as auto (float16 named alone misled: a CPU then trains in bf16); in a dict,
    # True is CONFIG's value and so not given: an amp_dtype is
    other = "use_amp=True on the command line, or an amp_dtype," if saved == "fp32" else \
        "use_amp=False or another amp_dtype"
    return Precision.of(DTYPES[saved], f"kept from the checkpoint: last.pt trained in {saved} as set ({setting}"
                                       f"{preset}); give {other} to change it"), cfg


def banner_line(text):
    rule = "!" * 78
    print(f"{rule}\n{text}\n{rule}", flush=True)


# Some zero gradients are normal in any precision: dead ReLUs (~5-7% for the default model), and every
# weight that only padding feeds (a 3x3 convolution on a 1x1 map: 8 of its 9 taps; resnet18's layer4 at
# image_size=32, half the model). Under fp16, a share this much above fp32's on the same batch is gradients
# underflowing below fp16's smallest values; the epoch's share only decides whether to compare.
FP16_UNDERFLOW_WARN_PCT = 5


def warn_fp16_underflow(run, stats, batch):
    """fp16 runs whose epoch had more than FP16_UNDERFLOW_WARN_PCT % of gradient entries exactly zero: the
    last batch's share in fp16 against fp32's, and a warning where fp16's is higher by as much."""
    if run.prec.name != "fp16" or stats.zero_grad_pct <= FP16_UNDERFLOW_WARN_PCT or batch is None:
        return
    x = batch[0]
    with torch.random.fork_rng(devices=[x.device] if x.device.type == "cuda" else []):  # the run's stream untouched
        model = copy.deepcopy(run.model).train()  # training's forward (batch statistics); the run's BN untouched
        half, full = (zero_grad_pct(run, model, batch, dtype) for dtype in (torch.float16, None))
    if half - full > FP16_UNDERFLOW_WARN_PCT:
        print(f"warning: {stats.zero_grad_pct:.1f}% of this epoch's gradient entries were exactly zero; on its last "
              f"batch {half:.1f}% in fp16 against {full:.1f}% in fp32: fp16 underflow; try amp_dtype=bfloat16 or a "
              f"larger init_scale")


def zero_grad_pct(run, model, batch, dtype):
    """The share of gradient entries exactly zero for one batch, under autocast in `dtype` (None: fp32), the
    loss scaled as the run's GradScaler scales it; `model`: a copy of the run's, whose gradients this leaves
    alone (torch.autograd.grad)."""
    x, y = batch
    with torch.autocast(x.device.type, dtype=dtype or torch.float32, enabled=dtype is not None):
        logits = model(x)
    scale = run.scaler.get_scale() if dtype is not None and run.scaler is not None else 1.0
    loss = run.loss_fn(logits, y) * scale  # the batch's loss (SegLoss.forward)
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [g for g in torch.autograd.grad(loss, params, allow_unused=True) if g is not None]
    return 100.0 * float(count_zero_grads(grads)) / max(1, sum(g.numel() for g in grads))


def overflowing_weights(loss_fn, pixels):
    """weights_overflow for the loss's class weights (auto's, or a checkpoint's from before that check)."""
    weights = getattr(loss_fn, "weights", None)
    return None if weights is None else weights_overflow(float(weights.max()), pixels)


def weights_overflow(largest, pixels):
    """'class_weights up to W ...' where they are large enough for the loss's sums over a batch's pixels to pass
    float32's range (a per-pixel loss of up to ~100); else None. class_weights=1e38,1e38 was blamed on the masks
    (or the model's outputs) and the learning rate, after an epoch."""
    if largest * pixels * 100 < torch.finfo(torch.float32).max:
        return None
    return (f"class_weights up to {largest:g} overflow the loss's sums over a batch's {pixels} pixels: use weights "
            f"nearer 1 (their ratios are what counts: 1,5 not 1e30,5e30)")


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
            found.append("the loss is non-finite while the model's outputs are finite: "
                         + (overflowing_weights(loss_fn, y.numel()) or "check the masks"))
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


# ----------------------------------------------------------------------------------------------------
# III.10 Checkpoints and history: atomic writes, weights_only loads, exact resume.
# ----------------------------------------------------------------------------------------------------
def check_writable(folder, key="output"):
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise UserError(f"{key} {folder} is a file, not a folder: choose another {key}=...")
    if folder.is_symlink() and not folder.exists():  # mkdir said 'not writable (File exists)'
        raise UserError(f"{key} {folder} is a broken link (it points to {os.readlink(folder)}, which is not there): "
                        f"create that folder, or remove the link")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".write_test_{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise UserError(f"{key} folder {folder} is not writable ({exc.strerror}): choose another "
                        f"{key}=...") from None


def hold_checkpoint_dir(folder):
    """Lock the run's checkpoint folder until train returns (run_folders_held). A second run into the
    same folder would move the first one's files aside, then both would write the same checkpoints, and
    the first run's results would be lost: it is refused."""
    hold_folder(folder, f"checkpoint_dir={folder}", "another training run, predict or benchmark", "checkpoint_dir")


def hold_folder(folder, given, users, option="output"):
    """A flock on the folder itself until the run_folders_held scope ends: no file is added, and the
    kernel drops it however the process ends. Taken already by another process, or by another thread of
    this one: a UserError saying `given` is in use by `users`, and to choose another `option`; by this thread,
    it is not taken twice. Where the system or file system has no flock, nothing is held."""
    in_use = (f"{given} is in use by {users} (it holds the folder's lock): let it finish, or choose another "
              f"{option}=...")
    key = os.path.realpath(folder)
    if key in HELD_FOLDERS:  # a run inside a run's scope (a benchmark's in-process predict) keeps it
        if HELD_FOLDERS[key][1] == threading.get_ident():
            return
        raise UserError(in_use)  # held by another thread of this process (a notebook's background run)
    fd = folder_lock(key)
    if fd is FOLDER_BUSY:
        raise UserError(in_use)
    if fd is not None:
        HELD_FOLDERS[key] = fd, threading.get_ident()


def held_by_another(folder):
    """Whether a process holds the folder's lock (hold_folder: a training run's checkpoint_dir, a running
    benchmark's output): the benchmark notebook tells a running benchmark from an interrupted one. False
    where that cannot be known (no flock here)."""
    fd = folder_lock(folder)
    if fd is FOLDER_BUSY:
        return True
    if fd is not None:
        os.close(fd)  # let go at once
    return False


FOLDER_BUSY = object()  # folder_lock's answer where another holds the lock


def folder_lock(folder):
    """A descriptor holding the folder's flock; FOLDER_BUSY where another descriptor holds it; None where
    it cannot be locked here: Windows, a file system without flock, a folder this user may write but not
    list."""
    try:
        import fcntl
        fd = os.open(folder, os.O_RDONLY)
    except (ImportError, OSError):
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        return FOLDER_BUSY if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN) else None
    return fd


def remove_stale_temps(folder):
    """Temporary files atomic_write left in the checkpoint folder when its process was killed mid-write (a
    half-written .last.pt.<8 characters>.tmp, as large as a checkpoint): the folder is this run's (locked)."""
    for path in folder.glob(".*.tmp"):
        if re.fullmatch(r"\..+\.[a-z0-9_]{8}\.tmp", path.name) and path.is_file():
            with contextlib.suppress(OSError):
                path.unlink()


HELD_FOLDERS = {}  # folders this process has locked (hold_folder): {real path: (descriptor, its thread)}
MADE_FOLDERS = {}  # checkpoint folders a run in this process made: the thread (run_folders_held removes them empty)


@contextlib.contextmanager
def run_folders_held():
    """The scope of a training run or benchmark: the folders locked inside it (hold_folder: the checkpoint
    folder, the benchmark's output) are let go at its end, so a notebook that trained can start the script
    on the same folder afterwards. A folder
    the run made (MADE_FOLDERS) and left empty, refused or stopped at start-up (a data error, Ctrl-C during
    the data check), is removed."""
    me = threading.get_ident()  # another thread's folders are its scope's: a notebook's background run
    before = {key for key, (_, thread) in HELD_FOLDERS.items() if thread == me}
    made = {folder for folder, thread in MADE_FOLDERS.items() if thread == me}
    try:
        yield
    except (UserError, KeyboardInterrupt):
        for folder in [f for f, thread in MADE_FOLDERS.items() if thread == me and f not in made]:
            with contextlib.suppress(OSError):  # not empty (or gone): it stays as it is
                folder.rmdir()
        raise
    finally:
        for folder in [f for f, thread in MADE_FOLDERS.items() if thread == me and f not in made]:
            del MADE_FOLDERS[folder]
        for key in [k for k, (_, thread) in HELD_FOLDERS.items() if thread == me and k not in before]:
            os.close(HELD_FOLDERS.pop(key)[0])


def atomic_write(path, write):
    """write(tmp_path), then rename over path: a crash never leaves a half-written file. The temporary
    file is created new (mkstemp: O_EXCL, an unpredictable name), so a file or symlink planted under its
    name cannot be written through; it gets the permissions a plain new file would (umask)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(name)
    try:
        tmp.chmod(0o666 & ~current_umask())  # mkstemp's 0600 would hide a shared cache from other users
        write(tmp)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


def current_umask():
    """The process's umask. Linux shows it in /proc; elsewhere the only way to read it is to set it and
    put it back, which races with other threads creating files meanwhile (TensorBoard's writer)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status") as status:
            return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def save_checkpoint(path, state):
    """torch.save under atomic_write. A failed write is a one-line UserError (torch's zip writer reports
    a full disk as a RuntimeError, "unexpected pos", not an OSError); the file it replaces stays intact. Its
    config is saved a plain dict: a TypedConfig (parse_overrides') is a class weights_only loading refuses (the
    benchmark's untrained inference model could not be loaded back)."""
    if isinstance(state.get("config"), dict) and type(state["config"]) is not dict:
        state = {**state, "config": dict(state["config"])}
    try:
        atomic_write(path, lambda tmp: torch.save(state, tmp))
    except (OSError, RuntimeError) as exc:
        # torch's zip writer's text ("[enforce fail at inline_container.cc:672] . unexpected pos") says no more
        short = "the write stopped short, as on a full disk"
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else short
        limit = file_size_limit()
        if getattr(exc, "errno", None) == errno.EFBIG or limit is not None and tensor_bytes(state) + ZIP_SLACK >= limit:
            raise UserError(f"cannot write {path}: about {size_text(tensor_bytes(state))}, "
                            f"{file_size_limit_words()}; the files written before it are intact") from None
        folder = Path(path).parent
        full = not isinstance(exc, OSError) or exc.errno in FULL_DISK
        if full and files_left(folder) != 0:  # where no file can be made (inodes), its size is not the cause
            why += f": it needs about {size_text(tensor_bytes(state))}, {size_text(free_bytes(folder))} free"
        raise UserError(f"cannot write {path} ({why}): {write_fix(exc, folder=folder)}; the files written before "
                        f"it are intact") from None


def tensor_bytes(value):
    """The bytes of the tensors in a (nested) checkpoint state."""
    if isinstance(value, torch.Tensor):
        return value.nbytes
    items = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
    return sum(tensor_bytes(v) for v in items)


def free_bytes(folder):
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return 0


def write_fix(exc, key=None, folder=None):
    """The fix in a failed write's message: room, for a full disk (and torch's RuntimeError, which is one
    in practice), else the folder (removed, or not writable); `key` names the option that chose it. `folder`:
    where it wrote (else the OSError's file's), whose file system may have bytes free but no inodes (room_fix)."""
    other = f"choose another {key}=..." if key else "choose another folder"
    if isinstance(exc, OSError) and exc.errno not in FULL_DISK:
        return f"check that the {key + ' ' if key else ''}folder still exists and is writable, or {other}"
    if folder is None and isinstance(exc, OSError) and isinstance(exc.filename, str):
        folder = os.path.dirname(exc.filename)
    return f"{room_fix(folder) if folder else 'free disk space there'} or {other}"


def load_checkpoint(path, map_location="cpu", fix="give a best.pt or last.pt as training wrote it"):
    path = Path(path)
    if path.is_dir():
        found = [p.name for p in (path / "best.pt", path / "last.pt") if p.is_file()]
        raise UserError(f"checkpoint {path} is a folder: give a .pt file" + (f" in it ({', '.join(found)})" if found else ""))
    if not path.is_file():
        raise UserError(f"checkpoint {path} not found")
    try:
        with warnings.catch_warnings():  # torch's own warnings about the pickle of a file that is no checkpoint
            warnings.simplefilter("ignore")
            state = torch.load(path, map_location=map_location, weights_only=True)
    except OSError as exc:  # not the file's content: it was called no checkpoint of this trainer
        if exc.errno in OPEN_FILES_LIMITS:
            raise
        raise UserError(f"cannot read checkpoint {path} ({os_error_words(exc)}): "
                        f"{os_error_fix(exc, other=fix)}") from None
    except Exception as exc:  # noqa: BLE001 - pickle, zip and weights_only errors all mean "not our checkpoint"
        # torch's text is not shown: for any other file it is advice on weights_only and PyTorch versions
        found = re.search(r"Unsupported global: GLOBAL ([\w.]+)", str(exc))  # whole, but of objects we never load
        what = (f"holds a pickled {found[1]} (a whole object saved with torch.save?), not a checkpoint of this "
                f"trainer" if found else "is not a readable checkpoint of this trainer, or was cut short in a copy")
        raise UserError(f"{path} {what}: {fix}") from None
    if not isinstance(state, dict) or not {"model", "config"} <= set(state):
        raise UserError(f"{path} is not a checkpoint of this trainer (no 'model'/'config' inside): {fix}")
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
        # A checkpoint may come from a machine with more (or fewer) GPUs: restore those both have.
        for index in range(min(len(state["cuda"]), torch.cuda.device_count())):
            torch.cuda.set_rng_state(state["cuda"][index], index)


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def process_state_kept():
    """A command called from Python (a notebook) leaves torch's TF32 and cuDNN settings and the RNGs as it found
    them: a run with tf32_matmul_precision=medium left it set, and the next run trained under it while its
    banner and checkpoint said 'not set'; the benchmark's strict fp32 turned later runs' TF32 convolutions off;
    the seed reset the notebook's own random draws. Restored however the command ends. (Threads cut to a CPU
    quota stay cut: fit_cpu_threads' is a correction for the machine, not a setting of the run.)"""
    try:
        precision = torch.get_float32_matmul_precision()
    except RuntimeError:  # torch's newer per-backend TF32 API in use: that one is the caller's to keep
        precision = None
    conv, benchmark = torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark
    rng, seed = (random.getstate(), np.random.get_state(), torch.get_rng_state()), torch.initial_seed()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        if precision is not None:
            torch.set_float32_matmul_precision(precision)  # the API apply_tf32 uses (mixing the two is an error)
        torch.backends.cudnn.allow_tf32, torch.backends.cudnn.benchmark = conv, benchmark
        random.setstate(rng[0])
        np.random.set_state(rng[1])
        torch.set_rng_state(rng[2])
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        elif torch.cuda.is_initialized():  # started by the run: as CUDA would have seeded itself from the CPU's seed
            torch.cuda.manual_seed_all(seed)


HISTORY_FIELDS = ("epoch", "train_loss", "val_loss", "train_iou", "train_dice", "val_iou", "val_dice", "lr",
                  "epoch_time_s", "val_time_s", "images_per_s", "peak_mem_mb", "peak_mem_kind", "precision",
                  "grad_norm", "grad_norm_max", "zero_grad_pct", "scaler_scale", "optimizer_steps",
                  "skipped_steps", "fallback")


def may_be_best(row):
    """An epoch that can become best.pt: its val loss is finite (nan_guard=False keeps the others, never as best)."""
    return math.isfinite(float(row["val_loss"]))


def best_epoch_row(history):
    """The row of the epoch best.pt holds, as finish_epoch chose it: the first of the highest val IoU among the
    epochs may_be_best takes; None where none is. Rows as the run keeps them or as history.csv reads them."""
    return max(filter(may_be_best, history), key=lambda row: float(row["val_iou"]), default=None)


def write_history(path, history):
    text = history_text(history)

    def write(tmp):
        with open(tmp, "w", newline="") as f:
            f.write(text)
    atomic_write(path, write)


def history_text(history):
    """history.csv's text: the fixed columns, then the per-class ones (val_iou_<class>, ...), which follow
    num_classes."""
    fields = list(HISTORY_FIELDS) + [k for k in (history[0] if history else {}) if k not in HISTORY_FIELDS]
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=fields, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(history)
    return out.getvalue()


def history_row(run, epoch, trained, validated, val_time, hw):
    """One epoch's row of history.csv (and of the checkpoint's history)."""
    mem, mem_kind = peak_memory_mb(hw)
    stats = trained["stats"]
    events = [f["event"] for f in run.fallbacks if f["epoch"] == epoch]
    return {"epoch": epoch, "train_loss": trained["loss"], "val_loss": validated["loss"],
            "train_iou": trained["iou"], "train_dice": trained["dice"], "val_iou": validated["iou"],
            "val_dice": validated["dice"], "lr": run.scheduler.get_last_lr()[0], "epoch_time_s": trained["time"],
            "val_time_s": val_time, "images_per_s": trained["images_per_s"], "peak_mem_mb": mem,
            "peak_mem_kind": mem_kind, "precision": run.prec.name, "grad_norm": stats.grad_norm,
            "grad_norm_max": stats.grad_norm_max, "zero_grad_pct": stats.zero_grad_pct,
            "scaler_scale": run.scaler.get_scale() if run.scaler else None,
            "optimizer_steps": stats.optimizer_steps, "skipped_steps": stats.skipped_steps,
            "fallback": "; ".join(events), **per_class_columns(validated, run.class_names or [])}


def write_json(path, data):
    atomic_write(path, lambda tmp: Path(tmp).write_text(json.dumps(data, indent=2, default=str) + "\n"))


RUN_FILES = ("last.pt", "best.pt", "history.csv", "config.json", "tensorboard",  # what a run writes
             "confusion_matrix.csv", "confusion_counts.csv")


# Earlier runs are kept, never deleted; past this size the banner says how much they hold (a debug run
# is about 330 MB: six of them filled 2 GB unseen in a review)
ARCHIVE_NOTE_BYTES = 2**30


def archive_size_note(previous):
    """'; previous/ holds N earlier runs, X GB: ...' where the archive is over ARCHIVE_NOTE_BYTES, else ''."""
    runs = [p for p in previous.iterdir() if p.is_dir()]
    size = sum(f.stat().st_size for run in runs for f in run.rglob("*") if f.is_file() and not f.is_symlink())
    if size <= ARCHIVE_NOTE_BYTES:
        return ""
    return (f" ({previous} now holds {len(runs)} earlier runs, {size_text(size)}: delete those you do not need; "
            f"nothing there is deleted for you)")


def archived_since(folder, since):
    """The folder under <folder>/previous/ that archive_previous_run made at or after `since` (a time.time())
    holding a run that can be resumed (its last.pt), or None: where an interrupted run's predecessor went
    (not the leftovers of a run itself stopped in epoch 1, which hold no last.pt)."""
    made = [p for p in (folder / "previous").glob("*")
            if p.is_dir() and p.stat().st_mtime >= since - 1 and (p / "last.pt").is_file()]
    return max(made, key=lambda p: p.stat().st_mtime, default=None)


def archive_previous_run(ckpt_dir, names=RUN_FILES):
    """A fresh run never overwrites an earlier one: its files (only `names`; anything else in ckpt_dir
    stays) move to <ckpt_dir>/previous/<time>/."""
    ckpt_dir = Path(ckpt_dir)
    old = [ckpt_dir / n for n in names if (ckpt_dir / n).exists()]
    if not old:
        return None
    kept = ckpt_dir / "previous"
    if (kept.exists() or kept.is_symlink()) and not kept.is_dir():
        raise UserError(f"{kept} is a file, but earlier results move into a folder of that name before they would "
                        f"be written over: move or rename it ({', '.join(p.name for p in old[:3])} stay as they are)")
    stamp, n = time.strftime("%Y%m%d-%H%M%S"), 1
    dest = ckpt_dir / "previous" / stamp
    while dest.exists():  # two runs in one second must not share (and overwrite) a folder
        n += 1
        dest = ckpt_dir / "previous" / f"{stamp}-{n}"
    made = not kept.exists()
    dest.mkdir(parents=True)
    moved = []
    try:
        for path in old:
            shutil.move(str(path), dest / path.name)
            moved.append(path)
    except OSError as exc:  # immutable, another user's in a sticky folder, a locked file on a share
        said = (f"cannot move {path} into {kept}/ ({exc.strerror or exc}), where earlier results go before anything "
                f"is written over them: fix its permissions (or its folder's), or choose another folder")
        try:
            put_back(moved, dest, path, kept if made else None)
        except OSError as undo:
            raise UserError(f"{said}; putting back what had moved failed too ({undo.strerror or undo}): the earlier "
                            f"results are in {ckpt_dir} and {dest}") from None
        raise UserError(f"{said}; nothing was moved") from None
    return dest


def put_back(moved, dest, failed, made):
    """archive_previous_run's undo: the files it moved go back; of the one it could not move, what a move across
    file systems copied goes (and a file its removal already took from the original comes back from the copy);
    the folders it made go where they are left empty."""
    for path in reversed(moved):
        shutil.move(str(dest / path.name), path)
    left = dest / failed.name
    if left.is_dir() and not left.is_symlink():  # copytree, then rmtree of the original: it failed in either
        for root, _, names in os.walk(left):
            for name in names:
                original = failed / Path(root).relative_to(left) / name
                if not (original.exists() or original.is_symlink()):  # removed after a whole copy: the copy is it
                    original.parent.mkdir(parents=True, exist_ok=True)
                    shutil.move(str(Path(root) / name), original)
        shutil.rmtree(left)
    elif left.exists() or left.is_symlink():
        if failed.exists() or failed.is_symlink():
            os.unlink(left)
        else:
            shutil.move(str(left), failed)
    for folder in (dest, made):
        if folder is not None and not any(folder.iterdir()):
            folder.rmdir()


# ----------------------------------------------------------------------------------------------------
# III.11 Logging: progress bars, peak memory, TensorBoard (rank 0, one host transfer per epoch).
# ----------------------------------------------------------------------------------------------------
PROGRESS_REFRESH_S = 0.5  # a progress bar's figures cost one device->host copy: at most 2 a second


class Progress:
    """A tqdm bar over `loader` showing loss, IoU so far and images/s; with progress=False it only
    iterates. refresh() reads the device at most every PROGRESS_REFRESH_S seconds."""

    def __init__(self, loader, desc, cfg):
        self.on = cfg["progress"]
        self.bar = tqdm(loader, desc=desc, leave=False, disable=not self.on, dynamic_ncols=True)
        self.start, self.last = time.perf_counter(), 0.0

    def __iter__(self):
        return iter(self.bar)

    def refresh(self, loss_pair, metric, seen):
        """loss_pair(): a device (loss sum, count) pair, called only when the bar is redrawn."""
        if not self.on or time.perf_counter() - self.last <= PROGRESS_REFRESH_S:
            return
        host = torch.cat([loss_pair().cpu().double(), metric.flat.cpu().double()])  # float64 on the host: MPS has none
        loss_sum, count = host[:2].tolist()
        self.last = time.perf_counter()
        iou = metric.with_counts(host[2:]).compute()["iou"]
        self.bar.set_postfix(loss=f"{loss_sum / max(1.0, count):.4f}", iou=f"{iou:.3f}",
                             img_s=f"{seen / (self.last - self.start):.1f}")

    def close(self):
        self.bar.close()


def reset_peak_memory():
    """The process's peak resident memory (VmHWM) set back to what it holds now (Linux: clear_refs 5), so
    that a run's peak is its own: a notebook's kernel kept the peak of all it had done before (a 2 GB
    array freed before a 1.4 GB run made it 3.3 GB). Elsewhere the peak stays the process's."""
    with contextlib.suppress(OSError):
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")


def peak_memory_mb(hw):
    """CUDA: peak allocated by tensors this epoch. CPU: peak resident memory of this process since the run
    began (reset_peak_memory): on Linux its VmHWM, not getrusage's ru_maxrss, which also holds the resident
    memory of the process that started it (a benchmark row's process counted the benchmark's 830 MB as its
    own: Linux keeps the old memory's peak across fork and exec)."""
    if hw.kind == "cuda":
        return torch.cuda.max_memory_allocated(hw.device) / 2**20, "cuda_max_allocated"
    try:
        with open("/proc/self/status") as status:
            kb = next((int(line.split()[1]) for line in status if line.startswith("VmHWM:")), None)
        if kb is not None:
            return kb / 2**10, "process_peak_rss"
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return rss / (2**20 if sys.platform == "darwin" else 2**10), "process_peak_rss"
    except ImportError:
        return float("nan"), "unavailable"


TENSORBOARD_DIR = "tensorboard"


def tensorboard_installed():
    import importlib.util
    return importlib.util.find_spec("tensorboard") is not None


class RunLogger:
    """log_step() per optimizer step, log_epoch(row) per epoch, close() at the end. A no-op when off."""

    def __init__(self, log_dir=None, cfg=None):
        self.writer, self.steps = None, []   # steps: (global step, lr, [device scalars])
        self.epochs = []  # the epochs tensorboard/ holds: this run's, and on resume the earlier runs' (gap_note);
        # None: not known (a run resumed from a checkpoint from before the record)
        if log_dir is not None:
            self.writer = LogWriter(log_dir)
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
        rows = torch.stack([torch.stack([v.to(values[0].dtype) for v in values])  # the loss sum's sum_dtype
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
        if self.epochs is not None:
            self.epochs.append(epoch)
        for key, value in row.items():
            if key == "epoch" or not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            group = "class" if key.startswith(("val_iou_", "val_dice_")) else "epoch"
            self.writer.add_scalar(f"{group}/{key}", value, epoch)
        self.writer.add_text("precision", f"epoch {epoch}: {row['precision']}", epoch)
        if row.get("fallback"):
            self.writer.add_text("fallback", row["fallback"], epoch)
        self.writer.flush()

    def log_confusion(self, counts, names, epoch):
        """Multi-class runs: the epoch's validation confusion matrix as a figure (confusion_figure)."""
        if self.writer is None or counts is None or len(names) < 2:
            return
        with warnings.catch_warnings():  # a name its font cannot draw (犬 in DejaVu Sans): a box, not two warnings
            warnings.filterwarnings("ignore", message="Glyph .* missing from", category=UserWarning)  # each epoch
            try:
                figure = confusion_figure(counts, names)
            except ImportError:  # matplotlib (requirements.txt) missing: the CSVs still hold the matrix
                return
            self.writer.add_figure("class/confusion_matrix", figure, epoch)
        self.writer.flush()

    def held_epochs(self, epoch):
        """For last.pt: the epochs tensorboard/ holds once the epoch being saved is logged (it is logged after
        the save: TensorBoard never holds an epoch that last.pt lacks)."""
        if self.epochs is None:
            return None
        return sorted(set(self.epochs) | ({epoch} if self.writer is not None and epoch else set()))

    def gap_note(self, state):
        """On resume: a note where tensorboard/ lacks epochs (a run or resume with logger=csv or none between):
        a run resumed with tensorboard on showed no gap, and my_run.ipynb counted the steps logged as the run's.
        Checkpoints from before the record say nothing."""
        if state is None:
            return None  # a new run: tensorboard/ starts empty
        held = state.get("tensorboard_epochs")
        if held is None:  # a checkpoint from before the record: not known, so nothing said, on any later resume
            self.epochs = None
            return None
        self.epochs = list(held)  # carried on with the logger off too: tensorboard/ still holds them
        missing = sorted(set(range(1, state["epoch"] + 1)) - set(held))
        if self.writer is not None and missing:
            return ("logger", f"tensorboard/ has no events for epoch(s) {epoch_ranges(missing)} (trained without "
                              f"TensorBoard: logger=csv or none, or tensorboard not installed); history.csv has every "
                              f"epoch")
        if self.writer is None and held:
            return ("logger", f"off in this run: tensorboard/ keeps epoch(s) {epoch_ranges(held)} and gets none from "
                              f"here (history.csv has every epoch)")
        return None

    def close(self):
        if self.writer is not None:
            self.flush_steps()
            self.writer.close()
            self.writer = None

    @contextlib.contextmanager
    def closed_if_stopped(self):
        """The writer closed (its thread ended) where the run stops on an error or an interrupt, without the
        steps of the epoch no checkpoint holds: a resume trains them again, and logs them then."""
        try:
            yield
        except BaseException:
            self.steps = []
            self.close()
            raise


def epoch_ranges(epochs):
    """[1, 2, 3, 5] -> '1-3, 5'."""
    runs = []
    for epoch in sorted(epochs):
        if runs and epoch == runs[-1][1] + 1:
            runs[-1][1] = epoch
        else:
            runs.append([epoch, epoch])
    return ", ".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


class LogWriter:
    """TensorBoard's SummaryWriter, whose write errors name its folder. They come from its writer thread,
    with no file name (a full disk at start-up read "cannot write a file"), and that thread printed its own
    traceback as it ended, cut short by the exit, around the one-line error: it is left out (quiet_log_writers),
    as tensorboard raises the error again in the run at its next call."""

    def __init__(self, log_dir):
        from torch.utils.tensorboard import SummaryWriter
        quiet_log_writers()
        self.log_dir = log_dir
        self.writer = self.named(SummaryWriter, str(log_dir))

    def named(self, call, *args, **kwargs):
        try:
            return call(*args, **kwargs)
        except OSError as exc:
            if exc.filename is None:
                raise OSError(exc.errno, exc.strerror, str(self.log_dir)) from exc
            raise

    def __getattr__(self, name):
        if name == "writer":  # not yet set: no recursion
            raise AttributeError(name)
        attr = getattr(self.writer, name)
        return functools.partial(self.named, attr) if callable(attr) else attr


def quiet_log_writers():
    """threading.excepthook, once, without the print for an OSError ending TensorBoard's writer thread."""
    previous = threading.excepthook
    if getattr(previous, "quiet_log_writers", False):
        return

    def hook(args):
        if type(args.thread).__name__ == "_AsyncWriterThread" and isinstance(args.exc_value, OSError):
            return  # raised again in the run's own thread, which says it in one line
        previous(args)
    hook.quiet_log_writers = True
    threading.excepthook = hook


# ====================================================================================================
# IV. Other commands
# ====================================================================================================


# ----------------------------------------------------------------------------------------------------
# IV.1 Predict: masks for new images from a checkpoint, at each image's original size.
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
    "cpu_probe": True,              # CPU: precision and layout confirmed by a timed probe (cached)
    "channels_last": "auto",        # NHWC layout: "auto" (the flag rule, or the CPU probe's answer), True, False
    "progress": True,
    "tile_overlap": None,           # patch-mode checkpoints: None = the checkpoint's (sliding window)
    "tile_batch_size": None,        # patch-mode checkpoints: None = the checkpoint's
    "tta": "none",                  # test-time augmentation: "none" | "flip" (4 views) | "d4" (8 views)
    "backend": "torch",             # "torch" | "onnxruntime": checkpoint= an exported model.onnx (`export`)
    "intensity_range": None,        # images wider than 8 bits: low,high mapped to 0 and 1; None = the checkpoint's
}

# What runs the model: the checkpoint's torch module, or an exported model in onnxruntime (IV.4) with the
# settings it fixes: its fp32 graph (torch's autocast and the CPU probe time torch), the contiguous layout.
PREDICT_BACKENDS = {"torch": {}, "onnxruntime": {"use_amp": False, "cpu_probe": False, "channels_last": False}}


def predict(opts):
    """The `predict` command: returns {'predicted', 'failed': [(path, reason)], 'seconds', ...}. Its output
    folder is locked while it writes (archive_earlier_predictions): a second predict into it is refused.
    Two at once had each moved the other's masks aside and written over them, silently: 25 of 80 masks
    were one model's, the rest the other's."""
    try:
        with run_folders_held(), process_state_kept():
            return predict_into_output(opts)
    except KeyboardInterrupt as exc:  # a notebook's interrupt before a mask was written was a bare KeyboardInterrupt()
        if exc.args:
            raise
        raise KeyboardInterrupt(INTERRUPTED["predict"]) from None


def predict_into_output(opts):
    """predict, its output folder held."""
    given, opts = predict_keys_given(opts), validate_predict(check_command_dict(opts, PREDICT_CONFIG))
    out_dir = hold_output(Path(opts["output"]), at_start=True)
    hw, threads = detect_hardware(opts["device"]), fit_cpu_threads()
    prec = decide_precision(hw, opts["use_amp"], opts["amp_dtype"], opts["force_amp_dtype"])
    model, cfg = load_predictor(opts, hw)
    apply_tf32(cfg.get("tf32_matmul_precision"), prec)  # fp32 as validated (apply_tf32's why)
    tiling = {k: opts[k] for k in TILE_RULES if opts[k] is not None}  # may change at predict time
    note_checkpoint_settings(cfg, opts, tiling, given)
    cfg, notes = {**cfg, **tiling, "tta": opts["tta"]}, []
    paths = list_images(opts["input"])
    cfg = predict_intensity_range(cfg, opts)
    prec, layout = predict_modes(cfg, opts, hw, prec, notes, paths)
    note_validated_precision(cfg, opts, prec, layout[0], getattr(model, "trained_precision", None))
    model, cfg = predict_layout(model, cfg, opts, hw, prec, layout)
    outputs = dict(zip(paths, output_paths(paths, out_dir, opts["overlay"])))
    moved = archive_earlier_predictions(paths, out_dir, opts["overlay"])
    print_predict_plan(len(paths), opts, cfg, (hw, prec), notes, (threads, moved))
    normalizer(cfg)  # built (albumentations imported, 1.3 s) before the clock: it was counted as reading an image
    failed, seen, start, waits = [], InputNotes(cfg, opts), time.perf_counter(), {"reading": 0.0, "writing": 0.0}
    bar = tqdm(total=len(paths), desc="predict", disable=not opts["progress"], dynamic_ncols=True)
    per_batch = 1 if cfg["data_mode"] == "patch" else opts["batch_size"]  # large images: one in memory at a time
    writer = MaskWriter(cfg["num_classes"], opts["overlay"], earlier=moved, threads=predict_host_threads(hw))
    with earlier_masks_back_if_none_written(moved, out_dir, writer, len(paths)), writer:
        budget = MemoryBudget(available_memory(), cfg, hw)
        reads = read_ahead(paths, per_batch, cfg, budget, writer.wait, seen.look, writer.threads)
        for batch, unreadable in waiting_for_reads(reads, writer, waits):
            failed = failed + unreadable
            images, inputs = [image for _, image, _ in batch], [x for _, _, x in batch]
            masks = masks_within_memory(model, [p for p, _, _ in batch], images, inputs, (cfg, prec, hw, opts))
            writer.write_all(batch, *on_host(masks, hw), outputs, out_dir)
            bar.update(len(batch) + len(unreadable))
            del batch, images, inputs, masks  # gone before a read that waited for this batch
        waits["writing"] = writer.waited  # not the last masks' writing: after the last forward, nothing to overlap
    bar.close()
    seen.print()
    done, seconds = writer.written, time.perf_counter() - start
    print_predict_summary(done, seconds, waits, failed, out_dir, writer.threads)
    return {"predicted": done, "failed": failed, "seconds": seconds, "precision": prec.name,
            "output": str(out_dir), "waited_s": waits}


def print_predict_plan(n_images, opts, cfg, hw_prec, notes, host):
    """predict's opening lines: what it reads, with which model, where, in what precision and layout."""
    (hw, prec), (threads, moved) = hw_prec, host
    tiled = (f"; sliding window of {cfg['image_size']} px at scale {cfg['patch_scale']:g}, overlap "
             f"{cfg['tile_overlap']:g}, {cfg['tile_batch_size']} tile(s) per forward" if cfg["data_mode"] == "patch" else "")
    print(f"predict: {n_images} image(s) with {opts['checkpoint']}{ema_words(cfg)} on {describe(hw)} in {prec.name}"
          + (f" ({prec.warning})" if prec.warning else "") + tiled + tta_summary(cfg["tta"]))
    for _, note in notes:  # the probe's measurement
        print(f"{'channels_last' if cfg['channels_last'] else 'contiguous'} layout, {prec.name} ({prec.reason}); "
              f"probe {note}")
    if threads:
        print(f"note: {threads}")
    if moved:
        print(f"an earlier predict's masks and overlays of these images moved to {moved}/")


def waiting_for_reads(batches, writer, waits):
    """read_ahead's batches, the seconds predict's main thread waited for each after the first (its images
    still being read and decoded) added to waits["reading"]: the first batch's reading has nothing to
    overlap with (and holds one-off costs: the first import of a decoder). A wait for the writer inside it
    (read_ahead's settle) is the writer's own (MaskWriter.waited), not counted twice. Without threads
    (predict_host_threads) every batch's reading is counted: the model waits for each."""
    first = writer.threads
    try:
        while True:
            start, writing = time.perf_counter(), writer.waited
            item = next(batches, None)
            if not first:
                waits["reading"] += time.perf_counter() - start - (writer.waited - writing)
            if item is None:
                return
            first = False
            yield item
            item = None  # the batch let go before the next read, which may wait for its room (read_ahead)
    finally:  # predict failed or stopped: the reader threads end now, not when a kept traceback goes
        batches.close()


# predict's last line says what the model waited for where the waits were at least this share of the run:
# then the disk, decoding or encoding set the pace, not the model.
PREDICT_WAIT_SHARE = 0.1


def print_predict_summary(done, seconds, waits, failed, out_dir, threads=True):
    """predict's last line (images, time, rate, folder; the waits where they count) and its failures. Without
    threads (predict_host_threads) the waits are the reading and writing, done between the forwards."""
    waited = done and sum(waits.values()) >= PREDICT_WAIT_SHARE * seconds  # none predicted: no model to wait
    words = (f"the model waited {waits['reading']:.2f}s for images to be read, {waits['writing']:.2f}s for masks to "
             f"be written" if threads else f"reading took {waits['reading']:.2f}s, writing {waits['writing']:.2f}s, "
             f"between the forwards: the model's threads use every core")
    print(f"predicted {done} image(s) in {seconds:.1f}s ({done / max(seconds, 1e-9):.1f} img/s) -> {out_dir}/"
          + (f" ({words})" if waited else "") + (f"; {len(failed)} failed:" if failed else ""))
    for path, reason in failed:
        print(f"  failed: {reason}")


def predict_keys_given(opts):
    """The keys given to predict: typed on the command line (parse_overrides); in a library call's dict, those
    whose value is away from PREDICT_CONFIG's (a dict copied from it gives none); not a dict: none (refused next)."""
    if not isinstance(opts, dict):
        return set()
    return getattr(opts, "typed", None) or {k for k, v in opts.items() if plain_value(v) != PREDICT_CONFIG.get(k)}


def note_checkpoint_settings(cfg, opts, tiling, given=()):
    """Notes where predict's options meet the checkpoint's settings: tiling options that a fit-mode
    checkpoint ignores, a batch_size given (`given`: the keys given) that a patch-mode one ignores (the
    window's tile_batch_size sets its forwards), and a checkpoint validated with test-time augmentation while
    predict runs other views (its IoU was measured on the average of those views, not on the masks predict writes)."""
    if tiling and cfg["data_mode"] == "fit":
        print(f"note: {', '.join(tiling)} ignored: {opts['checkpoint']} was trained with data_mode=fit "
              f"(each image resized to {cfg['image_size']} px, no sliding window)")
    if "batch_size" in given and cfg["data_mode"] == "patch":
        print(f"note: batch_size ignored: {opts['checkpoint']} was trained with data_mode=patch (each image through "
              f"a sliding window): tile_batch_size= sets the tiles per forward, "
              f"{tiling.get('tile_batch_size', cfg['tile_batch_size'])} here")
    overlap = tiling.get("tile_overlap", cfg["tile_overlap"])
    if cfg["data_mode"] == "patch" and overlap != cfg["tile_overlap"]:  # the val IoU scored the run's seams
        print(f"note: {opts['checkpoint']} was validated with tile_overlap={cfg['tile_overlap']:g}; predict blends "
              f"tiles at {overlap:g}: leave tile_overlap out for the masks its validation IoU describes (the seams "
              f"move a few pixels)")
    validated = cfg["tta"]  # None: an export from before its sidecar kept the validated tta; nothing to say
    if validated not in (None, "none") and opts["tta"] != validated:
        print(f"note: {opts['checkpoint']} was validated with tta={validated} (the average of "
              f"{len(TTA(validated))} views); predict runs tta={opts['tta']}: add tta={validated} for the masks "
              f"its validation IoU describes, at {len(TTA(validated))}x the forwards")


def note_validated_precision(cfg, opts, prec, nhwc, trained=None):
    """A note where predict runs autocast but the checkpoint was validated in fp32 (eval_amp=False, the
    default, or eval_amp=True in a run that trained in fp32: `trained`, the checkpoint's precision): its val
    IoU scored fp32's masks, and bf16/fp16 logits flip a few pixels at the edges. Where it was validated in
    autocast (eval_amp=True), the dtype and the layout count too: bf16 sums in another order in NHWC. (An
    eval_amp=True run that trained in fp32 was sent to channels_last=False, which kept bf16's masks.)"""
    if opts["backend"] != "torch" or not prec.amp:
        return
    if not (cfg["eval_amp"] and cfg["use_amp"]) or trained == "fp32":
        why = "use_amp=False" if not cfg["use_amp"] else "eval_amp=False" if not cfg["eval_amp"] else \
            "eval_amp=True, in a run that trained in fp32"
        print(f"note: masks in {prec.name}; {opts['checkpoint']} was validated in fp32 ({why}): "
              f"use_amp=False gives the masks its val IoU scored ({prec.name} may change a few edge pixels)")
    elif trained in AMP_DTYPE_NAMES and trained != prec.name:
        print(f"note: masks in {prec.name}; {opts['checkpoint']} was validated in {trained} (eval_amp=True): "
              f"amp_dtype={AMP_DTYPE_NAMES[trained]} gives the masks its val IoU scored")
    elif cfg["channels_last"] in (True, False) and nhwc != cfg["channels_last"]:
        names = {True: "NHWC", False: "NCHW"}
        print(f"note: masks in {prec.name} and {names[nhwc]}; {opts['checkpoint']} was validated in "
              f"{names[cfg['channels_last']]} (eval_amp=True): channels_last={cfg['channels_last']} gives the masks "
              f"its val IoU scored ({prec.name} sums in another order in the other layout: a few edge pixels)")


def masks_within_memory(model, paths, images, inputs, run):
    """predict_masks of a batch; running out of GPU memory (fit mode sizes its logits back to each image's
    own size on the device, which no budget counts) is a one-line error with the fixes, not torch's."""
    cfg, prec, hw, opts = run
    try:
        return predict_masks(model, images, cfg, prec, hw, inputs) if paths else []
    except torch.cuda.OutOfMemoryError:
        names = first_few([Path(p).name for p in paths])
        smaller = f"batch_size={opts['batch_size']} lower, or " if len(paths) > 1 else ""
        raise UserError(f"out of GPU memory predicting {names}: set {smaller}device=cpu (or predict large images "
                        f"with a data_mode=patch checkpoint); the masks of the images before them are written") from None


def read_ahead(paths, per_batch, cfg, budget=None, settle=lambda: None, look=None, threads=True):
    """([(path, image, model input)], [(path, why unreadable)]) per per_batch paths, read on threads: the
    next batch's images are decoded (OpenCV, tifffile and Pillow release the GIL) while the model works
    on this one. In fit mode the threads also resize and normalise each image (fit_input), so the main
    thread only stacks the batch and feeds the model; patch mode's tiles are cut later (input None).
    With a MemoryBudget, an image that cannot fit is unreadable, with the reason, undecoded; and the next
    batch is read after this one, not beside it, where the two would not fit together: once the caller
    has let this batch go and `settle` has returned (predict: its masks are written). look: read_image's.
    threads=False (predict_host_threads): each batch is read on the calling thread as it is taken."""
    budget = budget or MemoryBudget(None, cfg, None)

    def read(path):
        try:
            budget.check(path)
            image = read_image(path, cfg["in_channels"], cfg["intensity_range"], look)
        except UserError as exc:
            return path, None, str(exc)
        return path, (image, fit_input(image, cfg) if cfg["data_mode"] == "fit" else None), None

    with (ThreadPoolExecutor(max_workers=min(per_batch, PREDICT_READERS), thread_name_prefix="unet-amp-read")
          if threads else CallingThread()) as pool:
        batches = [paths[i:i + per_batch] for i in range(0, len(paths), per_batch)]
        current = pool.map(read, batches[0]) if batches else None
        for k, batch in enumerate(batches):
            following = batches[k + 1] if k + 1 < len(batches) else []
            ahead = bool(following) and budget.room_to_read_ahead(batch, following)
            reads = pool.map(read, following) if ahead else None  # starts before this batch is handed out
            budget.look_ahead(pool, batches[k + 2] if k + 2 < len(batches) else [])
            results = list(current)
            yield ([(p, *read) for p, read, why in results if why is None],
                   [(str(p), why) for p, _, why in results if why is not None])
            results = current = None
            if not ahead and following:  # after the last batch there is nothing to make room for
                settle()
            current = reads if ahead else pool.map(read, following)


PREDICT_READERS = 4  # threads decoding predict's next batch of images


def predict_host_threads(hw):
    """Whether predict reads and writes on threads beside the model: where the model leaves the host a core
    (on a GPU; torch on fewer threads than the cores it may use). Where torch's threads take every core, a
    reader or writer thread can only take a core from one of them, and the others wait for it at the next
    barrier: on a 2-core Xeon with AMX, fit predict took 1.07-1.32x its forwards alone reading and writing
    between the forwards, 1.09-1.44x on threads, faster in all 16 pairs timed side by side (BENCHMARKS.md
    "Reading and writing between the forwards")."""
    return hw.kind != "cpu" or torch.get_num_threads() < (usable_cores() or 1)


class CallingThread(Executor):
    """An executor with no threads: map's jobs run as their results are taken, submit's at once, on the
    calling thread (predict's reading and writing where predict_host_threads says no). A job's Exception
    is its future's, as on a thread; Ctrl-C goes straight up."""

    def submit(self, fn, /, *args, **kwargs):
        future = Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - held for result(), as a pool thread holds it
            future.set_exception(exc)
        return future

    def map(self, fn, *iterables, timeout=None, chunksize=1):
        return map(fn, *iterables)


class MemoryBudget:
    """What predict may hold at once: the memory free when it started (available_memory; None where
    unknown: then it checks nothing and reads ahead as ever). Image sizes come from the files' headers
    (image_header), each read once. In fit mode on a GPU the logits stay on the GPU: not counted here."""

    def __init__(self, memory, cfg, hw):
        self.memory, self.cfg, self.headers = memory, cfg, {}
        self.logits_on_host = cfg["data_mode"] == "patch" or hw is None or hw.kind != "cuda"  # TileBlend.result: .cpu()

    def header(self, path):
        if path not in self.headers:
            self.headers[path] = image_header(path)
        found = self.headers[path]
        return found.result() if isinstance(found, Future) else found

    def look_ahead(self, pool, paths):
        """Parse these paths' headers on the pool's threads (futures, kept in place of the headers): the
        next room_to_read_ahead finds them, and predict's main thread, which on a GPU launches the model's
        kernels, does not parse them (0.06 ms an image on a 2-core Xeon, 2026-11-26). Queued before these
        images' reads, so a reader that asks for one waits for a job already taken, never a queued one."""
        if self.memory is not None:
            for path in paths:
                if path not in self.headers:
                    self.headers[path] = pool.submit(image_header, path)

    def check(self, path):
        """Refuse, before decoding it, an image whose prediction cannot fit. The need counted is a lower
        bound (predict_memory), so an image refused here would have failed or been killed later."""
        size = None if self.memory is None else self.header(path)
        if size is None:
            return
        need = predict_memory(*size, self.cfg, self.logits_on_host)
        if need > self.memory:
            h, w = size[:2]
            raise UserError(f"image {path} ({w}x{h}) needs at least {size_text(need)} of memory to predict, "
                            f"{size_text(self.memory)} is free: cut it into parts, or predict it on a machine "
                            f"with more memory")

    def room_to_read_ahead(self, batch, following):
        """Whether the following batch's images, as read, fit beside what predicting this batch needs."""
        if self.memory is None:
            return True
        need = sum(predict_memory(*size, self.cfg, self.logits_on_host) for size in map(self.header, batch) if size)
        images = sum(h * w * image_bytes(depth, self.cfg) for h, w, depth in filter(None, map(self.header, following)))
        return need + images <= self.memory


def predict_memory(height, width, depth, cfg, logits_on_host=True):
    """At least what predicting one image holds at once: the image as read_image returns it, its fp32
    logits (one plane per class) at its own size where they come to the host, and the mask. Decoding
    buffers, scaling copies, tiles and the model come on top."""
    logits = 4 * cfg["num_classes"] if logits_on_host else 0
    return height * width * (image_bytes(depth, cfg) + logits + 1)


def image_bytes(depth, cfg):
    """Bytes a pixel of read_image's image, from the file's bytes a sample: in_channels of them, 8-bit
    kept as uint8, anything wider as float32 (scale_image)."""
    return (1 if cfg.get("in_channels", 3) == 1 else 3) * (1 if depth == 1 else 4)


def image_header(path):
    """(height, width, bytes a sample) from an image file's header, without decoding it; None where its
    header cannot be read here (the decoder then says what is wrong; a named pipe is not opened)."""
    if special_file(path):
        return None
    if is_tiff(path):
        return tiff_header(path)
    reader = pillow_reader(path)
    if reader is None:
        return None
    try:
        with reader(path) as image:
            # 16-bit colour PNGs have the mode "RGB"; their raw mode ("RGB;16B") tells
            wide = image.mode.startswith("I;16") or (image.format == "PNG" and "16" in str(image.tile[0][3]))
            height, width = image.height, image.width
            if image.format == "JPEG" and image.getexif().get(EXIF_ORIENTATION, 1) in QUARTER_TURNS:
                height, width = width, height  # OpenCV decodes it upright, as a viewer shows it
            return height, width, 4 if image.mode in ("I", "F") else 2 if wide else 1
    except (OSError, SyntaxError, ValueError):
        return None


EXIF_ORIENTATION, QUARTER_TURNS = 0x0112, (5, 6, 7, 8)  # the tag; its values that turn the image by 90°


def tiff_header(path):
    """image_header of a TIFF: level 0 of its first image (read_tiff's). Only advice: any file tifffile
    cannot make sense of gives None, and read_image then says what is wrong."""
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            hw = plane_of(series)  # a damaged file's 1-tuple header (shape ()) took predict down
            return None if hw is None else (*hw, series.dtype.itemsize)
    except Exception:  # noqa: BLE001 - truncated and mutated files raise struct.error, TypeError, ...
        return None


def available_memory():
    """Bytes of memory free for this process, or None where that is unknown (not Linux): the kernel's
    MemAvailable, and no more than the room under the memory limit of its control group (a container's
    --memory, a Slurm or Kubernetes job's), where the page cache counts as free, as the kernel frees it; and no
    more than ulimit -v leaves it to map (a large image failed in numpy, unnamed, before any mask was written)."""
    try:
        free = int(re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)[1]) * 1024
    except (OSError, TypeError):
        return None
    return max(0, min(free, cgroup_room(), address_space_room()))


def address_space_room():
    """Bytes this process may still map under ulimit -v (its limit less its VmSize); inf where none is set."""
    limit = address_space_limit()
    if limit is None:
        return math.inf
    try:
        mapped = int(re.search(r"^VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1]) * 1024
    except (OSError, TypeError):
        return math.inf
    return limit - mapped


def cgroup_room(proc="/proc/self/cgroup", sys_root="/sys/fs/cgroup"):
    """Bytes left under the tightest memory limit of this process's cgroup and its parents (a Slurm
    job's limit sits above its task's): v2, or v1's memory controller; inf where none is set."""
    names = {2: ("memory.max", "memory.current", "file"),
             1: ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")}
    return min((cgroup_level_room(level, *names[version])
                for level, version in cgroup_levels("memory", proc, sys_root)), default=math.inf)


def cgroup_levels(controller, proc="/proc/self/cgroup", sys_root="/sys/fs/cgroup"):
    """(folder, cgroup version) of each level of this process's cgroups that may hold the controller's
    limits: its own, then its parents up to the mount (a Slurm job's limit sits above its task's);
    v2's unified tree, and v1's tree of that controller. None where /proc does not say (not Linux)."""
    try:
        lines = Path(proc).read_text().splitlines()
    except OSError:
        return
    for number, controllers, where in (line.split(":", 2) for line in lines if line.count(":") >= 2):
        if number == "0" and not controllers:
            root, version = Path(sys_root), 2
        elif controller in controllers.split(","):
            root, version = Path(sys_root) / controller, 1
        else:
            continue
        where = where.strip("/")
        folder = root / where if where and (root / where).is_dir() else root  # a namespace's own is the root
        for level in [folder, *(p for p in folder.parents if p.is_relative_to(root))]:
            yield level, version


def cgroup_level_room(folder, limit_name, usage_name, cache_name):
    """limit - usage + page cache (the kernel frees it first) of one cgroup folder; inf without a limit."""
    try:
        limit = (folder / limit_name).read_text().strip()
        if limit == "max" or int(limit) >= 1 << 60:  # v1 writes "no limit" as about 2**63
            return math.inf
        stat = dict(line.split()[:2] for line in (folder / "memory.stat").read_text().splitlines() if line.strip())
        return int(limit) - int((folder / usage_name).read_text()) + int(stat.get(cache_name, 0))
    except (OSError, ValueError):
        return math.inf


class MaskWriter:
    """Writes predict's masks (and overlays) on a thread, in order, while the model works on the next
    batch: the mask's copy to the host, the PNG encoding and the write are off the model's path. A
    failed write stops predict with save_prediction's one-line error at the next write or at the end;
    the masks written before it stay. At most MAX_PENDING_MASKS wait, so memory stays bounded."""

    def __init__(self, num_classes, overlay, earlier=None, threads=True):
        self.num_classes, self.overlay, self.written, self.pending, self.failed = num_classes, overlay, 0, [], False
        self.earlier = earlier  # where earlier masks moved: put back over the first mask if its overlay fails
        # threads=False (predict_host_threads): each mask is written as it is handed over, on the caller's thread
        self.threads = threads
        self.pool = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="unet-amp-write") if threads
                     else CallingThread())
        self.waited = 0.0  # seconds the caller waited for writes to finish, or wrote (predict's summary)

    def __enter__(self):
        return self

    def write_all(self, batch, masks, ready, outputs, out_dir):
        """Hand over a batch's masks (on_host's, with its `ready` event): predict's (path, image, input)
        items, outputs[path] the mask's file."""
        for (path, image, _), mask in zip(batch, masks):
            self.write(outputs[path], out_dir / prediction_names(path)[1], image, mask, ready)

    def write(self, path, overlay_path, image, mask, ready=None):
        start = time.perf_counter()  # on threads a wait for the writer; without, the write itself
        try:
            self.pending.append(self.pool.submit(self.save, [path, overlay_path, image, mask, ready]))
            while self.pending and (self.pending[0].done() or len(self.pending) > MAX_PENDING_MASKS):
                self.pending.pop(0).result()  # raises a failed write's UserError here, in predict
        finally:
            self.waited += time.perf_counter() - start

    def save(self, job):
        # The job's list is emptied here, so the image and mask are let go when save returns, before its
        # future is done: the pool's worker thread keeps its work item (this list) a moment longer, and
        # a large image must be gone once wait() returns (read_ahead then decodes the next one).
        path, overlay_path, image, mask, ready = job
        job.clear()
        if self.failed:  # after a failed write nothing more is written: the error names what stands
            return
        if ready is not None:  # on a GPU: this batch's copies to the host done, in this thread
            ready.synchronize()
        mask = mask.cpu().numpy()
        try:
            save_prediction(path, mask_to_png(mask, self.num_classes), self.written)
            if self.overlay:
                self.save_overlay(path, overlay_path, image, mask)
        except BaseException:
            self.failed = True
            raise
        self.written += 1

    def save_overlay(self, mask_path, overlay_path, image, mask):
        """The overlay, after its mask: a failed write's error also names that mask, which stands, but for the
        first image where earlier masks were moved aside: they are put back over it (its error said 'this
        image's mask ... kept' below 'the earlier masks are back')."""
        try:
            save_prediction(overlay_path, overlay_image(image, mask), self.written)
        except UserError as exc:
            if self.written == 0 and self.earlier is not None and (Path(self.earlier) / Path(mask_path).name).exists():
                raise
            raise UserError(f"{exc}, and this image's mask {mask_path}") from None

    def wait(self):
        """Until every mask handed over is written (a failed write raises its error here; the wait counted)."""
        start = time.perf_counter()
        try:
            while self.pending:
                self.pending.pop(0).result()
        finally:
            self.waited += time.perf_counter() - start

    def __exit__(self, kind, *exc):
        try:
            if kind is None:
                self.wait()
            elif issubclass(kind, UserError):  # a batch could not be predicted: those before it are written;
                with contextlib.suppress(UserError):  # its error stands (Ctrl-C: the pending writes are dropped)
                    self.wait()
        finally:
            self.pool.shutdown(wait=True, cancel_futures=True)


def on_host(masks, hw):
    """(predict's masks on their way to the host, an event marking them there, or None). On CUDA each mask
    is copied without blocking into page-locked memory right after the kernels that made it, and one event
    recorded after the batch's copies: the writer thread waits on it (MaskWriter.save), and the model's
    thread never waits. A .cpu() on the writer thread would have waited, mask by mask, for every kernel
    queued by then, the next batch's forward included. Elsewhere the masks are already on the host."""
    if hw.kind != "cuda" or not masks or masks[0].device.type != "cuda":
        return masks, None
    host = [page_locked(mask.shape, mask.dtype) for mask in masks]
    for to, mask in zip(host, masks):
        to.copy_(mask, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(masks[0].device))  # the copies' stream: cuda:1's on cuda:1
    return host, ready


MAX_PENDING_MASKS = 16


def load_predictor(opts, hw):
    """(model, cfg) for predict's backend: the torch module of a checkpoint, or an exported model in
    onnxruntime (load_exported, IV.4), called alike by the same predict code."""
    if opts["backend"] == "onnxruntime":
        return load_exported(opts["checkpoint"], hw)
    check_not_exported(opts["checkpoint"], "add backend=onnxruntime, or give the PyTorch checkpoint (.pt) it was "
                                           "exported from")
    return load_model(opts["checkpoint"], hw)


def load_model(checkpoint, hw):
    """Rebuild the model from the config stored in a checkpoint; returns (model in eval mode, cfg).
    The weights are the EMA's where the checkpoint has them (cfg["ema_decay"] then says its decay; else
    None), as validation judged them. `hw`: detect_hardware's, or a device name for it ("cpu", "auto")."""
    hw = as_hardware(hw)
    state = load_checkpoint(checkpoint)
    # intensity_range, class_weights: a checkpoint from before them trained on the dtype's range and
    # without weights (None), whatever the edited CONFIG says now.
    saved = {"intensity_range": None, "class_weights": None,
             **{k: v for k, v in state["config"].items() if k in CONFIG}}
    ema = state.get("ema")
    cfg = validate_config({**CONFIG, **saved, "ema_decay": ema["decay"] if ema else None})
    try:
        model = model_with_weights({**cfg, "encoder_weights": None}, ema["model"] if ema else state["model"])
    except RuntimeError as exc:
        raise UserError(f"{checkpoint} does not match the model its config describes ({state_dict_mismatch(exc)}): "
                        f"it was changed after training; use the checkpoint as training wrote it") from None
    model.trained_config = {key: cfg[key] for key in MODEL_INPUT_KEYS}  # check_model_config
    model.class_names = state.get("class_names")  # the run's, as it trained (export's sidecar)
    model.trained_precision = state.get("precision")  # what eval_amp=True validated in (predict's note)
    return model.to(hw.device).eval(), cfg


def model_with_weights(cfg, weights):
    """build_model's model holding a checkpoint's weights, as copying them into a fresh model gives them (in
    the model's dtypes, NCHW). Built on the meta device, with the checkpoint's tensors taken as its own
    (assign): no memory and no random initialisation for weights replaced at once (resnet18: 146 -> 31 ms
    on a 2-core Xeon). A checkpoint saved from a channels_last model keeps that layout: put back to NCHW,
    which predict_layout changes where it chooses NHWC. Where an encoder cannot be built there (mit_b* reads
    a value while built), keeps a tensor the checkpoint does not hold, or the checkpoint holds weights in
    another dtype than the model's (assign would keep it), built as usual and the weights copied (cast) in."""
    try:
        with torch.device("meta"):
            model = build_model(cfg)
    except Exception:  # noqa: BLE001 - the usual build below reports a real error as its own
        model = None
    if model is not None:
        dtypes = {name: t.dtype for name, t in model.state_dict().items()}
        model.load_state_dict(weights, assign=True)
        if not holds_meta_tensors(model) and all(t.dtype == dtypes[k] for k, t in model.state_dict().items()):
            return model.to(memory_format=torch.contiguous_format)
    model = build_model(cfg)
    model.load_state_dict(weights)
    return model


def holds_meta_tensors(model):
    """Whether a tensor of the model is still on the meta device after its weights were assigned: a buffer
    the checkpoint does not hold (non-persistent), or a plain tensor attribute an encoder made when built."""
    return any(isinstance(value, torch.Tensor) and value.is_meta
               for module in model.modules() for value in itertools.chain(module.__dict__.values(), module.buffers()))


def trained_data_dir(checkpoint):
    """The data_dir a checkpoint's run trained on, as a path that leads there from here: the folder the run
    recorded (split_record, resolved as it started), so a relative data_dir given in another working
    directory is found (the notebooks run in the repository: "data" was looked for there). Where the
    checkpoint has no record, or that folder is gone, its data_dir as given."""
    return run_data_dir(load_checkpoint(checkpoint))


def run_data_dir(state):
    """trained_data_dir of a checkpoint's state: its recorded folder where that still holds files (emptied,
    the embedded set is written again as given), else its data_dir as given (None where it has none)."""
    folder = (state.get("data_split") or {}).get("folder")
    return folder if folder and has_files(Path(folder)) else state["config"].get("data_dir")


def state_dict_mismatch(exc):
    """load_state_dict's first specific complaint (its first line only says that there are some), shortened
    whole: a shape mismatch as the two shapes, a list of keys as its first and how many more."""
    lines = [line.strip() for line in str(exc).splitlines()[1:] if line.strip()]
    if not lines:
        return first_line(exc)
    size = re.match(r"size mismatch for (\S+): copying a param with shape torch\.Size\((\[.*?\])\) from checkpoint, "
                    r"the shape in current model is torch\.Size\((\[.*?\])\)", lines[0])
    if size:
        return f"{size[1]} is {size[2]} in the checkpoint, {size[3]} in the model"
    keys = re.match(r"(Missing|Unexpected) key\(s\) in state_dict: (.*)", lines[0])
    if keys:
        names = re.findall(r'"([^"]+)"', keys[2])
        return (f"{keys[1].lower()} weights: {', '.join(names[:2])}" + (f" and {len(names) - 2} more" if len(names) > 2
                                                                       else ""))
    return first_line(lines[0])


def list_images(path):
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() not in IMAGE_EXTS:  # the rule a folder's files are read by
            raise UserError(f"input {path} is not one of the image types predict reads ({', '.join(IMAGE_EXTS)}): "
                            f"convert it to one of them")
        return [path]
    if not path.is_dir() and any(c in path.name for c in "*?") and path.parent.is_dir():
        # input=dir/*.tif: a pattern, which the shell leaves as it is (no file is named input=dir/...)
        raise UserError(f"input {path} not found: a pattern is not expanded here; give the folder, "
                        f"input={cli_value(path.parent)}, whose images are all predicted (or one file)")
    if not path.is_dir():
        special = special_file(path)
        raise UserError(f"input {path} {f'is {special}, not a file' if special else 'not found'}: give an image "
                        f"file or a folder of images")
    with os.scandir(path) as scan:  # each entry's type without a stat per file (a large folder)
        found = list(scan)
    entries = [e for e in found if not e.name.startswith(".")]
    # Hidden files are not read; those named like images (not macOS's ._ metadata files) are said to be skipped
    hidden = sorted(e.name for e in found if hidden_image(e.name, e.is_dir()))
    # A folder is never an image, whatever its name (x.png/); a broken link a.png stays one, so that
    # predict names it among the unreadable
    folders = sorted(e.name + "/" for e in entries if e.is_dir())
    images = sorted(Path(e.path) for e in entries if not e.is_dir() and Path(e.name).suffix.lower() in IMAGE_EXTS)
    others = sorted(e.name for e in entries if e.is_file() and Path(e.name).suffix.lower() not in IMAGE_EXTS)
    skipped = f"{len(hidden)} hidden file(s) skipped (e.g. {hidden[0]}): names starting with '.' are not read" \
        if hidden else ""
    if not images:
        raise nothing_to_predict(path, folders, skipped, others)
    if hidden:
        print(f"note: {skipped}")
    if others:
        print(f"note: {len(others)} other file(s) in {path} skipped (e.g. {others[0]}): only "
              f"{', '.join(IMAGE_EXTS)} are read")
    if folders:
        print(f"note: {len(folders)} folder(s) in {path} skipped (e.g. {folders[0]}): predict reads the images "
              f"directly in it; give each folder as its own input=")
    return images


def nothing_to_predict(path, folders, skipped, others):
    """list_images' UserError for a folder with no image to predict, with what to do: a data set's images/
    given, a subfolder that holds images given, files of other types converted, hidden ones renamed."""
    inside = [f"its subfolders are not read: {', '.join(folders[:3])}"] * bool(folders) + [skipped] * bool(skipped)
    inside += [f"{len(others)} file(s) of other types, e.g. {others[0]}"] if others else []
    with_images = [path / f[:-1] for f in folders if holds_images(path / f[:-1])]
    fix = (f"give input={cli_value(path / 'images')}" if "images/" in folders else  # a data set: one level down
           f"give a subfolder as input= (input={cli_value(with_images[0])})" if with_images else
           "rename them without the leading '.' to predict them" if skipped else
           "convert them to one of these types" if others else "give input= a folder of images, or one image file")
    return UserError(f"no images ({', '.join(IMAGE_EXTS)}) in {path}" + (f" ({'; '.join(inside)})" if inside else "")
                     + f": {fix}")


@functools.lru_cache(maxsize=4096)
def fit_region(size, height, width):
    """(rows, cols) where a height x width image lands in fit mode's padded square of `size` (fit_transforms:
    padding at the bottom/right): the size albumentations' LongestMaxSize resizes it to, by its own rule
    (each side times size / the longer side, rounded, at least 1; tested against the pipeline). Worked out,
    not found by running the pipeline on a stand-in image as large as the image: a 20,000 x 30,000 scene's
    took 2.4 GB (1.4 GB resident) and 1.9 s. Remembered: validation asks for every image every epoch."""
    scale = size / max(height, width)
    return max(1, round(height * scale)), max(1, round(width * scale))


def original_size(logits, h, w, cfg):
    """N x classes x H x W fp32 logits of images that were all h x w -> N x classes x h x w: their area
    cropped out of the padded square, resized back bilinearly. The one way from the model's output to
    predict's masks (fit_masks); validation scores the same logits (original_size_scores), so the val IoU
    is the IoU of what predict writes."""
    vh, vw = fit_region(cfg["image_size"], h, w)
    logits = logits[:, :, :vh, :vw]
    if (vh, vw) != (h, w):
        logits = nn.functional.interpolate(logits, size=(h, w), mode="bilinear", align_corners=False)
    return logits


def fit_masks(logits, sizes, cfg):
    """Fit mode's masks (uint8 tensors on the logits' device), in order: each image's logits at its original
    size (original_size, as validation scores them), thresholded (mask_rule). The images of one size go
    through together, up to SCORE_BAND_PIXELS pixels a group: a handful of ops a batch instead of seven an
    image, on a GPU each a kernel launch or a view beside the forward's ~110 (BENCHMARKS.md "Predict
    speed"). An image over that limit goes alone, its mask made in bands (mask_tensor)."""
    masks, logits = [None] * len(sizes), logits.float()
    for (h, w), indices in same_size_groups(sizes):
        full = original_size(rows_of(logits, indices), h, w, cfg)
        found = [mask_tensor(full[0], cfg["num_classes"])] if len(indices) == 1 else \
            mask_rule(full, cfg["num_classes"]).unbind(0)
        for i, mask in zip(indices, found):
            masks[i] = mask
    return masks


def rows_of(batch, indices):
    """batch[indices]: a view when the indices are a run of the batch (no copy, no op on a GPU)."""
    if indices == list(range(indices[0], indices[-1] + 1)):
        return batch[indices[0]:indices[-1] + 1]
    return batch[indices]


def same_size_groups(sizes):
    """((h, w), indices) of the images of each size, at most SCORE_BAND_PIXELS pixels a group (at least
    one image): the argmax's int64 and the resized logits stay a band's size, as for one image."""
    by_size = {}
    for i, size in enumerate(sizes):
        by_size.setdefault(tuple(size), []).append(i)
    for (h, w), indices in by_size.items():
        per = max(1, SCORE_BAND_PIXELS // (h * w))
        for k in range(0, len(indices), per):
            yield (h, w), indices[k:k + per]


@torch.inference_mode()
def predict_batch(model, images, cfg, prec, hw):
    """Images from read_image (HxW or HxWx3; uint8, or float32 in [0, 1]; any sizes; a list, or any iterable)
    -> masks of class indices (uint8 arrays, 0/1 when binary) at the same sizes, the way the checkpoint's
    data_mode validated. The model runs in eval mode (put back as it was after): one left in training mode
    (a notebook's fine-tuning) normalised each batch by its own statistics: 2-38% of pixels changed."""
    hw = as_hardware(hw)
    if not isinstance(prec, Precision):
        raise UserError(f"prec is {prec!r}: pass decide_precision(hw) (the capability check's choice), or "
                        f"decide_precision(hw, use_amp=False) for fp32")
    check_model_config(model, cfg)
    images = images if isinstance(images, (list, tuple, np.ndarray, torch.Tensor)) else list(images)  # a generator
    note_dark_floats(check_model_images(images, cfg), cfg)
    per = PREDICT_CONFIG["batch_size"]  # predict's batches: a whole test set in one forward took ~2 MB per 64² image
    with eval_mode(model):
        return [mask.cpu().numpy() for start in range(0, len(images), per)
                for mask in predict_masks(model, images[start:start + per], cfg, prec, hw)]


def note_dark_floats(dark, cfg):
    """A note where the checkpoint has an intensity_range and float images (their indices, `dark`) reach under
    1/16 of 0-1: read_image without the range scales a 16-bit file from 0-65535, so 12-bit data come out 16
    times too dark, and the masks all background, silently (predict's own reading uses the range)."""
    if cfg.get("intensity_range") is not None and dark:
        print(f"note: {len(dark)} float image(s) (e.g. image {dark[0]}) reach under 1/16 of the 0-1 the model "
              f"takes: read by read_image without cfg['intensity_range']? A 16-bit file is then scaled from 0-65535: "
              f"read it with read_image(path, {cfg['in_channels']}, cfg['intensity_range'])", flush=True)


@contextlib.contextmanager
def eval_mode(model):
    """The model in eval mode for the block, then in the mode it was in."""
    training = getattr(model, "training", False)  # an exported model (OnnxModel) has no mode
    if training:
        model.eval()
    try:
        yield model
    finally:
        if training:
            model.train()


# What a model trained on decides what it must be given: predict_batch's cfg must say the same (patch_scale
# in patch mode alone; intensity_range is read_image's, which predict may be given anew).
MODEL_INPUT_KEYS = ("in_channels", "num_classes", "image_size", "data_mode", "patch_scale")


def check_model_config(model, cfg):
    """predict_batch's cfg describes the model: its first convolution's input channels and its last one's
    classes, and where load_model made it, the config it trained with (MODEL_INPUT_KEYS). A library caller
    who passed CONFIG, or their own dict, got masks silently wrong: num_classes=3 for a binary model was all
    background; image_size=32 for a 64 px one, 12% of pixels changed. A model cast to another dtype
    (model.half()) was torch's 'Input type ... and weight type ... should be the same'."""
    if not callable(model):
        raise UserError(f"model is {type(model).__name__}: pass the model load_model returned")
    dtypes = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()} - {"float32"}) \
        if isinstance(model, nn.Module) else []
    if dtypes:
        raise UserError(f"the model's weights are {', '.join(dtypes)}: pass it in float32, as load_model returns it "
                        f"(model.float()); decide_precision(hw) chooses the precision its forwards run in")
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)] if isinstance(model, nn.Module) else []
    found = {"in_channels": convs[0].in_channels, "num_classes": convs[-1].out_channels} if convs else {}
    found.update(getattr(model, "trained_config", None) or {})  # an exported model (OnnxModel): none
    if found.get("data_mode") != "patch":
        found.pop("patch_scale", None)
    same = lambda a, b: (list(a) if isinstance(a, tuple) else a) == (list(b) if isinstance(b, tuple) else b)  # noqa: E731
    wrong = [f"{key}={cfg.get(key)!r}, trained with {value!r}" for key, value in found.items()
             if not same(cfg.get(key), value)]
    if wrong:
        raise UserError(f"cfg does not describe this model ({'; '.join(wrong)}): pass the config load_model "
                        f"returned with it")


def check_model_images(images, cfg):
    """predict_batch's images as read_image makes them for this model (a library caller may pass its own
    arrays): one channel (HxW) or three (HxWx3) as the model takes, else a UserError naming the fix, not a
    convolution's shape error. Returns the indices of float images under 1/16 of 0-1 (note_dark_floats)."""
    want, dark = cfg["in_channels"], []
    if isinstance(images, (np.ndarray, torch.Tensor)):  # iterated, its rows were taken for images
        raise UserError(f"images is one {type(images).__name__} of shape {tuple(images.shape)}: pass a list of "
                        f"images ([image] for one)")
    for i, image in enumerate(images):
        if not isinstance(image, np.ndarray) or image.dtype not in (np.uint8, np.float32):
            what = f"a {image.dtype} array" if isinstance(image, np.ndarray) else f"a {type(image).__name__}"
            raise UserError(f"image {i} is {what}: pass numpy arrays as read_image(path, {want}, "
                            f"cfg['intensity_range']) returns them (uint8, or float32 in [0, 1])")
        channels = 1 if image.ndim == 2 else image.shape[-1] if image.ndim == 3 else None
        if image.ndim in (2, 3) and 0 in image.shape[:2]:
            raise UserError(f"image {i} has shape {image.shape}: no pixels to predict")
        if channels != want:
            raise UserError(f"image {i} has shape {image.shape}, but the model takes {want} channel(s) "
                            f"({'HxW' if want == 1 else 'HxWx3'}): read it with read_image(path, {want}, "
                            f"cfg['intensity_range']), which converts it")
        extremes = check_scaled_floats(image, i, want, cfg.get("intensity_range"))
        if extremes is not None and 0 <= extremes[0] and extremes[1] < 1 / 16:
            dark.append(i)
    return dark


# How far past [0, 1] predict_batch takes float pixels from a model trained with no intensity_range, whose
# read_image gives [0, 1] exactly: a caller's own resize (cubic overshoot) stays well inside it.
FLOAT_INPUT_SLACK = 0.5


def check_scaled_floats(image, i, want, intensity_range=None):
    """A float32 image as read_image scales it: finite (one NaN pixel made the whole mask background), and not
    8- or 16-bit values cast to float unscaled (cv2.imread(...).astype(np.float32): half the pixels wrong).
    Scaled values may leave [0, 1] (an intensity_range narrower than an image, far at times): with an
    intensity_range, whole numbers above 1, or most pixels more than FLOAT_INPUT_SLACK outside [0, 1] yet inside
    the raw range itself, are taken as unscaled (raw 12-bit data resized as float: 90% of the mask foreground);
    without one (read_image's floats are then in [0, 1]), any value more than FLOAT_INPUT_SLACK outside is
    (unscaled pixels resized: 20% of the mask wrong). Returns a float image's (min, max), else None."""
    if image.dtype != np.float32:
        return None
    check_pixels(image, i)  # scale_image's NaN/inf refusal, naming the image by its index
    low, top = float(image.min()), float(image.max())
    fix = (f"pass the uint8 array, or read it with read_image(path, {want}, cfg['intensity_range']), which "
           f"scales it")
    if top > 1 and np.array_equal(image, np.round(image)):
        raise UserError(f"image {i} is float32 with whole-number values up to {top:g}: unscaled pixels, where the "
                        f"model takes them in [0, 1]: {fix}")
    if intensity_range is None and (top > 1 + FLOAT_INPUT_SLACK or low < -FLOAT_INPUT_SLACK):
        raise UserError(f"image {i} is float32 with values from {low:.4g} to {top:.4g}, where the model takes them in "
                        f"[0, 1] (it was trained with no intensity_range): scale them (8-bit: / 255), or {fix}")
    beyond = 0.0 if intensity_range is None else np.count_nonzero(
        (image >= intensity_range[0]) & (image <= intensity_range[1])
        & ((image < -FLOAT_INPUT_SLACK) | (image > 1 + FLOAT_INPUT_SLACK))) / image.size
    if beyond > 0.5:  # most pixels far outside 0-1 yet within the raw range itself: never read_image's own output
        raise UserError(f"image {i} is float32 with {beyond:.0%} of its pixels beyond 0-1 by over "
                        f"{FLOAT_INPUT_SLACK:g} but within intensity_range={intensity_range[0]:g},"
                        f"{intensity_range[1]:g} (values from {low:.4g} to {top:.4g}), which maps the training images "
                        f"to 0-1: unscaled pixels? {fix}")
    return low, top


@torch.inference_mode()
def predict_masks(model, images, cfg, prec, hw, inputs=None):
    """predict_batch's masks as uint8 tensors on the device (predict copies them back on its writer thread).

    fit: same preprocessing as validation (fit_input; `inputs`: theirs, made beforehand, as predict's
    reader threads do); logits are cropped to the image's area and resized back (fit_masks, by
    original_size: validation scores these same logits).
    patch: each image through the sliding window (predict_logits).
    """
    if cfg["data_mode"] == "patch":
        return [mask_tensor(predict_logits(model, image, cfg, prec, hw), cfg["num_classes"]) for image in images]
    x = stacked_inputs(inputs or [fit_input(image, cfg) for image in images], hw)
    logits = eval_forward(model, x, cfg, prec, hw)  # channels_last: predict() converts the model to match
    return fit_masks(logits, [image.shape[:2] for image in images], cfg)


def stacked_inputs(inputs, hw):
    """fit_input's tensors as one batch, copied by numpy on this thread into host memory that is page-locked
    for CUDA, so that the copy to the GPU waits for nothing (from pageable memory it waits for the kernels
    queued before it). torch.stack copies in parallel on torch's threads: on an H100's 16-core host, beside
    predict's reader threads decoding, its thread team took 9 ms a batch of 8 images of 128², a third to a half
    of a fit predict's time (BENCHMARKS.md "GPU: H100")."""
    arrays = [x.numpy() for x in inputs]
    tensor, memory = host_memory((len(arrays), *arrays[0].shape), arrays[0].dtype, hw.kind == "cuda")
    np.stack(arrays, out=memory)
    return tensor


def logits_to_mask(logits, num_classes):
    """classes x H x W logits -> H x W class indices (a uint8 array): binary at logit 0, else the argmax."""
    return mask_tensor(logits, num_classes).cpu().numpy()


def mask_tensor(logits, num_classes):
    """logits_to_mask's mask as a uint8 tensor on the logits' device. A large image's is made in bands of
    rows (score_bands), so the argmax's int64 (8 bytes a pixel) never covers the whole image."""
    bands = score_bands(*logits.shape[1:])
    if len(bands) == 1:  # two ops, as ever: fit mode's images and a sliding window's smaller ones
        return mask_rule(logits, num_classes)
    mask = torch.empty(logits.shape[1:], dtype=torch.uint8, device=logits.device)
    for band in bands:
        mask[band] = mask_rule(logits[:, band], num_classes)
    return mask


def mask_rule(logits, num_classes):
    """[N x] classes x H x W logits -> [N x] H x W uint8 class indices: binary at logit 0, else the argmax."""
    return ((logits.select(-3, 0) > 0) if num_classes == 1 else logits.argmax(-3)).to(torch.uint8)


def mask_to_png(mask, num_classes):
    return mask * 255 if num_classes == 1 else mask


def overlay_image(image, mask, alpha=0.45):
    """RGB/gray image with each class > 0 tinted by a fixed palette (returned as BGR for cv2).

    16-bit and float images (read_image's [0, 1] floats) are shown on the same scale, as 8-bit. Made in
    bands of rows (score_bands): the blend's float temporaries (~60 bytes a pixel) stay a band's size."""
    image, overlay = to_uint8_view(image), np.empty((*mask.shape, 3), np.uint8)
    for band in score_bands(*mask.shape):
        overlay[band] = tinted(image[band], mask[band], alpha)
    return cv2.cvtColor(overlay, cv2.COLOR_RGB2BGR, dst=overlay)


# Background, then one colour a class: 12 apart (class 7 was drawn in class 1's colour with 6), repeating after
OVERLAY_PALETTE = np.array([[0, 0, 0], [255, 60, 60], [60, 200, 60], [60, 90, 255], [240, 200, 40],
                            [200, 60, 220], [40, 210, 220], [255, 140, 0], [140, 80, 20], [255, 120, 190],
                            [130, 130, 0], [0, 128, 128], [170, 170, 255]], np.float32)


def tinted(image, mask, alpha):
    """overlay_image's blend of 8-bit RGB or gray pixels with their classes' colours, as uint8 RGB."""
    rgb = np.repeat(image[..., None], 3, axis=2) if image.ndim == 2 else image
    colour = OVERLAY_PALETTE[1:][(mask.astype(np.int64) - 1) % (len(OVERLAY_PALETTE) - 1)]
    return np.where(mask[..., None] > 0, (1 - alpha) * rgb + alpha * colour, rgb).astype(np.uint8)


def validate_predict(opts):
    check_edited_keys(PREDICT_CONFIG)
    check_types(opts, PREDICT_CONFIG)
    check_paths_given(opts, ("checkpoint", "input", "output"))
    if opts["batch_size"] < 1:
        raise UserError(f"batch_size={opts['batch_size']} must be a whole number >= 1")
    if not valid_device(opts["device"]):
        raise UserError(f"device={opts['device']!r} must be auto, cpu, cuda, cuda:N or mps")
    if opts["channels_last"] not in ("auto", True, False):
        raise UserError(f"channels_last={opts['channels_last']!r} is not allowed: use auto, True or False")
    opts = {**opts, "amp_dtype": amp_dtype_name(opts["amp_dtype"])}
    for key in ("amp_dtype", "tta"):
        check_choice(key, opts[key])
    for key, (ok, rule) in TILE_RULES.items():
        if opts[key] is not None and not ok(opts[key]):
            raise UserError(f"{key}={opts[key]!r} {rule}")
    if opts["backend"] not in PREDICT_BACKENDS:
        raise UserError(f"backend={opts['backend']!r} is not allowed: use one of {', '.join(PREDICT_BACKENDS)}")
    out = Path(opts["output"])
    if out.suffix.lower() in IMAGE_EXTS and not out.is_dir():
        raise UserError(f"output={out} names a file, but predict writes one <stem>.png mask per image into the "
                        f"folder output= names: give a folder, e.g. output={out.parent / out.stem}")
    if opts["intensity_range"] is not None and not valid_range(opts["intensity_range"]):
        raise UserError(f"intensity_range={opts['intensity_range']!r} must be two numbers low,high with low < high "
                        f"(e.g. 0,4095), or None for the checkpoint's")
    note_backend_fixes(opts)
    return {**opts, **PREDICT_BACKENDS[opts["backend"]]}


def note_backend_fixes(opts):
    """A note where predict's backend fixes a setting the user changed from its default (onnxruntime runs
    its exported fp32 graph in the contiguous layout: amp_dtype=bfloat16 or channels_last=True would do
    nothing, silently)."""
    fixed = PREDICT_BACKENDS[opts["backend"]]
    precision = ("amp_dtype", "force_amp_dtype") if fixed.get("use_amp") is False else ()
    ignored = [k for k in ("amp_dtype", "force_amp_dtype", "channels_last")
               if opts[k] != PREDICT_CONFIG[k] and (k in precision or (k in fixed and opts[k] != fixed[k]))]
    if ignored:
        print(f"note: {', '.join(ignored)} ignored: backend={opts['backend']} runs the exported fp32 graph in the "
              f"contiguous layout")


def predict_intensity_range(cfg, opts):
    """The checkpoint's cfg with predict's intensity_range where one is given."""
    if opts["intensity_range"] is None:
        return cfg
    return {**cfg, "intensity_range": [float(v) for v in opts["intensity_range"]]}


class InputNotes:
    """Notes on predict's images, each said once, at the end, with how many images it concerns: a 16-bit
    image scaled from 0-65535 for want of a range, an 8-bit or float image that a given intensity_range= does
    not touch (divided by 255, or mapped by its own min and max, whatever the range, as in training:
    scale_image), and an image whose pixels lie outside the range, given or the checkpoint's (outside_range,
    as range_leaves_out notes in training); as the data check notes in training, colour
    read as grey (of the first PREDICT_COLOUR_LOOKS images: one not grey by its header is decoded again to look)
    and a TIFF channel dropped that is not alpha (extra_channel_not_alpha). Each image is looked at on the
    reader thread that decoded it (read_image's look), by its decoded type, which decides its scaling: no
    header is read or pixel counted on predict's main thread, which on a GPU launches the model's kernels."""

    def __init__(self, cfg, opts):
        self.cfg, self.opts, self.sixteen_bit, self.eight_bit, self.outside = cfg, opts, [], None, None
        self.colour, self.extra, self.thin, self.looked, self.lock = None, None, None, 0, threading.Lock()
        self.counts = collections.Counter()  # images found of each kind; colour: of those looked at for it

    def look(self, path, decoded, scaled):
        """An image as decoded and as scale_image mapped it, on a reader thread: of each kind the first by name
        is kept, whatever order the readers finish in (each look's findings are recorded under a lock)."""
        with self.lock:
            self.looked += 1
            colour_turn = self.looked <= PREDICT_COLOUR_LOOKS
        kind, wide = decoded.dtype.kind, decoded.dtype.kind in "iu" and decoded.dtype != np.uint8
        values = without_alpha(decoded)  # what the network sees: an opaque 16-bit alpha is not data
        ranged = self.cfg["intensity_range"] is not None
        found = {"eight_bit": self.opts["intensity_range"] is not None and not wide and kind in "uf" and path,
                 "outside": ranged and wide and outside_range(path, without_alpha(scaled)),
                 "colour": self.cfg["in_channels"] == 1 and colour_turn and looks_colour(path, values) and path,
                 "extra": extra_channel_not_alpha(path, decoded) and path}
        fitted = fitted_thin(decoded.shape[:2], self.cfg["image_size"]) if self.cfg["data_mode"] == "fit" else \
            scaled_thin(decoded.shape[:2], self.cfg["patch_scale"])
        found["thin"] = fitted and (path, decoded.shape[:2], fitted)
        with self.lock:
            if not ranged and wide and decoded.dtype.itemsize == 2:  # scaled by the type's range
                self.sixteen_bit.append((path, kind == "i", int(values.max())))  # its top: 12-bit data?
            self.counts.update(key for key, value in found.items() if value)
            for key, value in found.items():
                kept = getattr(self, key)
                if value and (kept is None or str(path) < str(kept[0] if isinstance(kept, tuple) else kept)):
                    setattr(self, key, value)

    def print(self):
        """The notes, after the last batch."""
        self.print_as_read()
        self.print_sixteen_bit()
        if self.eight_bit is not None:
            low, high = self.opts["intensity_range"]
            print(f"note: intensity_range={low:g},{high:g} was not used for {Path(self.eight_bit).name} and any other "
                  f"8-bit or float image: the range maps integer images wider than 8 bits; as in training, 8-bit "
                  f"images are divided by 255 and float images mapped by their own min and max")
        if self.outside is not None:
            (path, share, least, most), (low, high) = self.outside, self.cfg["intensity_range"]
            raw = [round(low + v * (high - low)) for v in (least, most)]  # integers: '-0' was said for a 0
            whose = "" if self.opts["intensity_range"] is not None else \
                f" ({self.opts['checkpoint']}'s, learnt from its training images)"
            print(f"note: {self.of_looked('outside')} have over {OUTSIDE_RANGE_SHARE:.0%} of their pixels outside "
                  f"intensity_range={low:g},{high:g}{whose} (e.g. {share:.0%} of {Path(path).name}'s, whose values "
                  f"span {raw[0]}-{raw[1]}): the model sees them outside the 0-1 its training images were mapped to; "
                  f"check the range" + (", or predict with intensity_range=low,high" if whose else ""))

    def print_sixteen_bit(self):
        """The note on 16-bit images scaled from their type's range for want of one: each image's top value
        says where it holds narrower data (12-bit in a 16-bit file: 16 times too dark), the first such named."""
        seen = sorted(self.sixteen_bit, key=lambda entry: str(entry[0]))  # the readers' order varies; names do not
        checkpoint, signed = self.opts["checkpoint"], [p for p, is_signed, _ in seen if is_signed]
        unsigned = [(p, top) for p, is_signed, top in seen if not is_signed]
        if signed:
            print(f"note: {Path(signed[0]).name} has signed 16-bit pixels and {checkpoint} has no intensity_range: "
                  f"they were scaled from -32768-32767, so 0 is mid-grey and the data's own span is a sliver of it: "
                  f"predict again with intensity_range=low,high, that span (CT in Hounsfield units: e.g. -1000,1000)")
        narrow = [(p, top) for p, top in unsigned if narrow_bits(top)]
        if narrow:
            (path, top), n = narrow[0], len(unsigned)
            bits = narrow_bits(top)
            print(f"note: {Path(path).name} has 16-bit pixels and {checkpoint} has no intensity_range: they were "
                  f"scaled from 0-65535, but its values reach only {top}: if it holds {bits}-bit data, the model saw "
                  f"it {2 ** (16 - bits)} times too dark: predict again with intensity_range=0,{2 ** bits - 1}"
                  + (f" ({len(narrow)} of the {n} 16-bit images stay below {2 ** max(NARROW_DEPTHS)})" if n > 1
                     else ""))
        elif unsigned:
            print(f"note: {len(unsigned)} image(s) have 16-bit pixels (e.g. {Path(unsigned[0][0]).name}) and "
                  f"{checkpoint} has no intensity_range: they were scaled from 0-65535 (their values reach up to "
                  f"{max(top for _, top in unsigned)})")

    def print_as_read(self):
        checkpoint = self.opts["checkpoint"]
        if self.colour is not None:
            looked = min(self.looked, PREDICT_COLOUR_LOOKS)  # not every image: a second decode each
            shown = f"{'the first ' if self.looked > looked else ''}{looked}"
            print(f"note: {self.counts['colour']} of {shown} image(s) hold "
                  f"colour (e.g. {Path(self.colour).name}), read as grey (their luminance): {checkpoint} takes "
                  f"in_channels=1; if colour tells the classes apart, train with in_channels=3")
        if self.extra is not None:
            print(f"note: {self.of_looked('extra')} hold a channel that is not alpha beside their grey or RGB (e.g. "
                  f"{Path(self.extra).name}: a TIFF extra sample such as near-infrared), and it is dropped: "
                  f"{checkpoint} takes in_channels={self.cfg['in_channels']}")
        if self.thin is not None and self.cfg["data_mode"] == "fit":
            path, (h, w), (fh, fw) = self.thin
            print(f"note: {self.of_looked('thin')} went to the model under {FIT_THIN_SIDE} px across (fit mode: "
                  f"longest side to {self.cfg['image_size']} px; e.g. {Path(path).name}: {w}x{h} -> {fw}x{fh}): their "
                  f"detail across is lost; a model trained with data_mode=patch predicts such images at full resolution")
        elif self.thin is not None:  # training refuses such images (check_scaled_sides); their masks came out blank
            path, (h, w), (fh, fw) = self.thin
            print(f"note: {self.of_looked('thin')} went to the model under {MIN_SCALED_SIDE} px across (patch_scale="
                  f"{self.cfg['patch_scale']:g}; e.g. {Path(path).name}: {w}x{h} -> {fw}x{fh}), too small to hold a "
                  f"shape: their masks are not to be trusted; a model trained at a larger patch_scale predicts them")

    def of_looked(self, key):
        """'2 of 5 image(s)': how many of the images predicted were found of a kind, as training's notes count."""
        return f"{self.counts[key]} of {self.looked} image(s)"


# A given intensity_range that leaves more than this share of an image's pixels outside it gets a note.
OUTSIDE_RANGE_SHARE = 0.01

# The bit depths cameras and scanners store in 16-bit files: a 16-bit image whose values stay below 2**14
# gets the narrowest of these that holds them as its likely depth (InputNotes.print_sixteen_bit).
NARROW_DEPTHS = (8, 10, 12, 14)


def narrow_bits(top):
    """The bit depth a 16-bit image's top value suggests it holds (12 for 3152), or None where it reaches past
    14 bits (or is 0): training's note and predict's guess alike."""
    return next((bits for bits in NARROW_DEPTHS if 0 < top < 2 ** bits), None)

# predict looks for colour that in_channels=1 drops in this many images (InputNotes.look): beyond, a file
# whose header does not say grey would be decoded twice, and one such image in a folder is enough to say it.
# Nor in one over PREDICT_COLOUR_LOOK_PIXELS: its decoding in colour, 3 bytes a pixel, is outside MemoryBudget's.
PREDICT_COLOUR_LOOKS = 8
PREDICT_COLOUR_LOOK_PIXELS = 2 ** 24


def looks_colour(path, values):
    """holds_colour for predict's note: False for an image over PREDICT_COLOUR_LOOK_PIXELS, or one whose second
    decoding fails (the image itself was read: predicting it goes on)."""
    if values.shape[0] * values.shape[1] > PREDICT_COLOUR_LOOK_PIXELS:
        return False
    try:
        return holds_colour(path, values)
    except UserError:
        return False


def outside_range(path, image):
    """(path, share of pixels outside [0, 1], the least and largest value) of an image scale_image mapped by a
    given range (float32; a float file is mapped by its own min and max, so never outside), else None."""
    if image.dtype != np.float32:
        return None
    share = float(np.count_nonzero((image < 0) | (image > 1))) / image.size
    return (path, share, float(image.min()), float(image.max())) if share > OUTSIDE_RANGE_SHARE else None


def check_no_unpaired_masks(paths, out_dir, overlay):
    """output= what looks like a data set's masks folder (masks/ beside images/, through links too): a mask
    there of an image not in images/, or an overlay, is a mask without a partner, and one beside a ground
    truth of another format (a.bmp) shares its stem; either stopped the next training run. Masks of the
    images' own, where none is there yet (pseudo-labels), may go there; archive_earlier_predictions refuses
    those that would replace a ground-truth PNG. A data set's images folder (masks/ beside it) takes no masks:
    the next training run would find them without a partner, or, once masks of them went to masks/, train on
    masks of masks."""
    out_dir = out_dir.resolve()
    if data_set_part(out_dir) == "images":
        raise UserError(f"output={out_dir} is a data set's images folder (masks/ beside it): masks written there "
                        f"would be taken for images by the next training run; choose another output=... folder")
    if data_set_part(out_dir) != "masks":
        return
    images = out_dir.parent / "images"
    stems = {p.stem for p in images.iterdir() if p.suffix.lower() in IMAGE_EXTS}
    truth = {p.stem: p.name for p in out_dir.iterdir() if p.suffix.lower() in IMAGE_EXTS and p.suffix.lower() != ".png"}
    stray = next((p for p in paths if p.stem not in stems or p.stem in truth), None)
    if stray is not None or overlay:
        what = ("overlay=True writes <name>_overlay.png there" if stray is None else
                f"{truth[stray.stem]} is the mask of {stray.name} there" if stray.stem in truth else
                f"{stray.name} is not one of its images")
        raise UserError(f"output={out_dir} looks like a data set's masks folder (beside {images}), and {what}: a "
                        f"second mask, or one without an image, there stops the next training run; choose another "
                        f"output=... folder")


def hold_output(out_dir, at_start=False):
    """predict's output folder locked (hold_folder) for as long as it writes there; returns it. Taken at the
    start where the folder exists (before the model loads and the CPU probe times it: a refusal after those
    had cost seconds to minutes), else once archive_earlier_predictions has made it."""
    if not at_start or out_dir.is_dir():
        hold_folder(out_dir, f"output={out_dir}", "another predict, training run or benchmark")
    return out_dir


def archive_earlier_predictions(paths, out_dir, overlay=False):
    """An earlier predict's mask and overlay of any of these images move to <out_dir>/previous/<time>/
    (archive_previous_run), so no result is lost, and a mask never stands beside an older run's overlay
    of the same image. Masks of other images stay. A file of such a name that predict did not write is
    refused before anything moves: output=data/masks would otherwise move the ground truth aside and put
    predictions in its place, which the next training run learns from. Returns the folder, or None. The
    folder is checked writable first, and checked not to be a data set's masks folder it would spoil."""
    check_writable(out_dir)
    hold_output(out_dir)
    check_no_unpaired_masks(paths, out_dir, overlay)
    # one name once: a.png's overlay is also the mask of an input named a_overlay.png (moved twice, it failed)
    names = list(dict.fromkeys(name for p in paths for name in prediction_names(p)))
    there = [name for name in names if (out_dir / name).exists() or (out_dir / name).is_symlink()]
    foreign = [name for name in there if not ((out_dir / name).is_file() and written_by_predict(out_dir / name))]
    if foreign:
        kind = " (a folder)" if (out_dir / foreign[0]).is_dir() else ""
        raise UserError(f"output={out_dir} holds {foreign[0]}{kind}" + (f" and {len(foreign) - 1} more" if
                        len(foreign) > 1 else "") + " of the names predict writes, not written by predict (a "
                        "ground-truth mask? an image?): choose another output=... folder, or move them away (masks "
                        "of older versions of this script have no mark either)")
    return archive_previous_run(out_dir, names)


@contextlib.contextmanager
def earlier_masks_back_if_none_written(moved, out_dir, writer, total=0):
    """A predict that fails, is stopped or ends before its first mask is written (a full disk, Ctrl-C, a model
    that cannot take the images, every image unreadable) puts the earlier masks it moved to `moved`
    (previous/<time>/) back: the folder is as it was found. Each retry on a full disk had moved them one folder
    further and written
    nothing, until the output folder held only previous/. Once a mask is written, the moved ones stay there
    (a mask never stands beside an older run's masks of the same images); a stop then says how many of the
    `total` were written and where the others' earlier masks are (24 of 240 written, 216 earlier masks in
    previous/, unsaid)."""
    try:
        yield
    except BaseException as exc:
        if moved is not None and writer.written == 0:
            put_back_predictions(moved, out_dir)
        elif isinstance(exc, KeyboardInterrupt) and total:
            raise KeyboardInterrupt(f"{INTERRUPTED['predict']}; {writer.written} of {total} image(s) written"
                                    + (f"; the earlier masks of the others are in {moved}/"
                                       if moved and writer.written < total else "")) from None
        raise
    if moved is not None and writer.written == 0:  # every image failed (each named): none replaced them
        put_back_predictions(moved, out_dir)


def put_back_predictions(moved, out_dir):
    """earlier_masks_back_if_none_written's undo, said in a note; where a move back fails, the note says
    where the earlier masks are."""
    try:
        for path in sorted(moved.iterdir()):
            os.replace(path, out_dir / path.name)  # over a mask this run wrote before its overlay failed
        moved.rmdir()
        with contextlib.suppress(OSError):
            moved.parent.rmdir()  # previous/, where it holds nothing else
    except OSError as exc:
        print(f"note: no mask was written, and the earlier masks could not all move back ({exc.strerror or exc}): "
              f"they are in {moved}/ and {out_dir}/", flush=True)
        return
    print(f"note: no mask was written: the earlier masks are back in {out_dir}/", flush=True)


def png_text_chunk(keyword, text):
    import zlib

    data = f"{keyword}\0{text}".encode("latin-1")
    return struct.pack(">I", len(data)) + b"tEXt" + data + struct.pack(">I", zlib.crc32(b"tEXt" + data))


# The PNG text chunk predict writes into its masks and overlays: it moves aside (archives) only files
# that carry it, never a ground-truth mask or an image that merely has the same name.
PREDICT_MARK = png_text_chunk("Software", "unet-amp predict")

PNG_IHDR_END = 8 + 25  # the signature, then IHDR (length, type, 13 bytes, CRC): PNG's first chunk


def written_by_predict(path):
    """Whether a PNG carries predict's mark, right after its header where predict puts it."""
    try:
        with open(path, "rb") as f:
            return f.read(PNG_IHDR_END + len(PREDICT_MARK))[PNG_IHDR_END:] == PREDICT_MARK
    except OSError:
        return False


def prediction_names(path):
    """(mask, overlay): the file names predict writes for the input image at `path`."""
    return f"{path.stem}.png", f"{path.stem}_overlay.png"


def check_paths_given(opts, keys):
    """An empty path (an unset shell variable: output=$OUT) would mean the current folder: refused. A leading ~
    is the home folder, in place: the shell expands it only at a word's start (not in key=~/x under make's sh),
    and `~/tinydata` was 'not found', and checkpoint_dir=~/runs wrote into a folder named ~ here."""
    for key in keys:
        if not str(opts[key]).strip():
            raise UserError(f"{key}= is empty: give a path (an unset shell variable?)")
        if isinstance(opts[key], (str, Path)) and str(opts[key]).startswith("~"):
            opts[key] = type(opts[key])(os.path.expanduser(str(opts[key])))


def output_paths(paths, out_dir, overlay=False):
    """<out_dir>/<stem>.png per input. Refuses an output folder that holds input images (masks among
    them would overwrite other images of the same stem, and be read as images next time), to overwrite
    an input, or to write one name twice (two inputs of one stem; with overlay, a.png's <stem>_overlay.png
    and the mask of an input named a_overlay.*)."""
    outputs = [out_dir / prediction_names(p)[0] for p in paths]
    inputs = {p.resolve() for p in paths}
    # the folders that list the inputs (a link's own, where it points elsewhere) and hold the files
    folders = {p.absolute().parent.resolve() for p in paths} | {p.parent for p in inputs}
    if out_dir.resolve() in folders:
        raise UserError(f"output={out_dir} holds the input images: masks would be written among them (over "
                        f"any image named like one); choose another output=... folder")
    clash = next((o for o in outputs if o.resolve() in inputs), None)
    if clash is not None:
        raise UserError(f"predicting would overwrite the input {clash}: choose another output=... folder")
    names, clashes = {}, []
    for p in paths:
        for name in prediction_names(p)[:2 if overlay else 1]:
            if name in names:
                clashes.append((names[name], p, name))
            names[name] = p
    if clashes:  # all counted: a folder of a.png beside a.jpg, b.png beside b.tif... took a run per pair
        (a, b, name), more = clashes[0], [f"{x.name}/{y.name}" for x, y, _ in clashes[1:]]
        raise UserError(f"inputs {a.name} and {b.name} would both write {out_dir / name}: rename one"
                        + (f" ({len(more)} more such pair(s): {first_few(more)})" if more else ""))
    return outputs


def write_png(path, image, mark=None):
    """cv2.imwrite that cannot fail silently (imwrite only returns False, with no reason): encoded in
    memory, written under a temporary name and renamed, so a failed write (a removed folder, a full
    disk) raises OSError with its cause and leaves no partial file. The folder is not re-created: a
    folder removed mid-run is an error, not a fresh start that hides the loss. `mark`: a chunk
    (png_text_chunk) put right after the header (predict's PREDICT_MARK)."""
    ok, data = cv2.imencode(".png", image)
    if not ok:
        raise RuntimeError(f"OpenCV could not encode a {image.dtype} {image.shape} array as PNG for {path}")
    data = data.tobytes()
    if mark is not None:
        data = data[:PNG_IHDR_END] + mark + data[PNG_IHDR_END:]
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.unlink(missing_ok=True)  # a killed run's leftover; O_EXCL below never follows a planted link
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise


def save_prediction(path, image, done):
    """write_png for predict: a failed write stops the run with a one-line UserError (every later write
    would fail the same way); the `done` images written before it stay."""
    try:
        write_png(path, image, PREDICT_MARK)
    except OSError as exc:
        raise UserError(f"cannot write {path} ({exc.strerror or exc}): {write_fix(exc, 'output')}; the {done} "
                        f"image(s) predicted before it are kept") from None


def predict_setting(cfg, opts):
    """The checkpoint's cfg as predict runs it: its batch of images, or of tiles in patch mode, times
    the views of test-time augmentation (what one forward holds), layout "auto" (the checkpoint's layout
    was a speed choice of the machine that trained it), predict's precision options and what its backend
    fixes (PREDICT_BACKENDS)."""
    batch = cfg["tile_batch_size"] if cfg["data_mode"] == "patch" else opts["batch_size"]
    return {**cfg, "channels_last": "auto", "batch_size": batch * len(TTA(cfg["tta"])),
            **{k: opts[k] for k in ("use_amp", "amp_dtype", "cpu_probe", "channels_last") if k in opts}}


def predict_modes(cfg, opts, hw, prec, notes, paths=None):
    """Predict's precision and layout: the flag rule, confirmed on a CPU by the probe's inference
    forwards at predict's batch (cpu_probe_decision, kind "predict", cached like training's). A job over
    `paths` that is fewer forwards than the probe is not probed."""
    setting = predict_setting(cfg, opts)
    forwards = None if paths is None else predict_forwards(paths, cfg, opts)
    return cpu_probe_decision(setting, hw, prec, notes, kind="predict", job_forwards=forwards)


def predict_forwards(paths, cfg, opts, enough=len(CPU_PROBE_MODES) * (1 + CPU_PROBE_ROUNDS)):
    """The forwards predict makes over these images: a batch of images to a forward in fit mode; in
    patch mode the sliding window's tiles (tile_grid's, from each image's header, patch_scale applied),
    tile_batch_size to a forward, counted only until `enough` (the longest probe: a folder of thousands
    is not opened for a count); an image whose header cannot be read counts one."""
    if cfg["data_mode"] != "patch":
        return -(-len(paths) // opts["batch_size"])
    total, size = 0, cfg["image_size"]
    for path in paths:
        header = image_header(path)
        if header is None:
            total += 1
        else:
            tiles = math.prod(len(tile_starts(n, size, cfg["tile_overlap"]))
                              for n in scaled_size(header[:2], cfg["patch_scale"]))
            total += -(-tiles // cfg["tile_batch_size"])
        if total >= enough:
            break
    return total


def predict_layout(model, cfg, opts, hw, prec, layout=None):
    """Layout for this machine and predict's batch (`layout`: predict_modes' answer; None = the flag
    rule's, decide_channels_last); the model is converted with its inputs."""
    channels_last, _ = layout or decide_channels_last(predict_setting(cfg, opts), hw, prec)
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    return model, {**cfg, "channels_last": channels_last}


# ----------------------------------------------------------------------------------------------------
# IV.2 batch_size=auto: the largest batch that fits on the GPU (real steps, OOM caught), minus headroom.
# ----------------------------------------------------------------------------------------------------
AUTO_BATCH_FALLBACK = 8      # batch_size=auto where no search is possible (CPU, MPS): CONFIG's default

AUTO_BATCH_HEADROOM = 0.15   # room for fragmentation, validation and other processes on the GPU

AUTO_BATCH_CAP = 1024


def resolve_batch_size(cfg, hw, prec, state, n_train, notes):
    """Replace batch_size='auto' by a number; returns (cfg, what to record in config.json or None)."""
    if cfg["batch_size"] != "auto":
        return cfg, None
    cap = max(1, min(AUTO_BATCH_CAP, n_train // DIST.world))
    unit = "patches" if cfg["data_mode"] == "patch" else "images"
    if state is None and one_value_per_channel(cap, cfg["image_size"]):  # a search's batch of 1 raised in BatchNorm
        ranks = f" over {DIST.world} processes" if DIST.enabled else ""
        raise UserError(f"batch_size=auto: a batch of at most {cap} (training {unit}: {n_train}{ranks}), and at "
                        f"image_size={cfg['image_size']} a batch of {cap} leaves BatchNorm one value per channel at "
                        f"the U-Net's bottleneck: add training images, or use image_size >= 64")
    if state is not None:
        use, info = state["config"]["batch_size"], "kept the resumed run's batch size"
    elif hw.kind != "cuda":
        use = min(AUTO_BATCH_FALLBACK, cap)
        capped = f" (the {cap} training {unit} {'per process' if DIST.enabled else 'there are'})" if use < \
            AUTO_BATCH_FALLBACK else ""
        info = f"needs a CUDA GPU (this run is on {hw.kind}): using batch_size={use}{capped}"
    else:
        start = time.perf_counter()
        # The trials run in the run's layout: on CUDA it does not depend on the batch size.
        trial = {**cfg, "channels_last": decide_channels_last(cfg, hw, prec)[0]}
        largest, use = find_batch_size(trial, hw, prec, cap)
        if largest == 0:
            raise UserError(f"batch_size=auto: not even a batch of {min(2, cap)} fits in {describe(hw)}'s "
                            f"memory at image_size={cfg['image_size']}: lower image_size, use a smaller "
                            f"encoder_name or use_amp=True")
        use = int(all_reduce_(torch.tensor(use, device=hw.device), "min").item())  # same on every rank
        limit = "the training set" if largest == cap else f"{AUTO_BATCH_HEADROOM:.0%} headroom"
        info = (f"largest that fit {largest}, using {use} ({limit}; {prec.name}"
                f"{', channels_last' if trial['channels_last'] else ''}; {time.perf_counter() - start:.1f}s)")
        seed_everything(cfg["seed"])  # the trials used the RNG: the run starts as with a fixed batch
    notes.append(("batch", f"auto -> {use}: {info}"))
    return validate_config({**cfg, "batch_size": use}), {"requested": "auto", "batch_size": use, "how": info}


def find_batch_size(cfg, hw, prec, cap):
    """Search on a throw-away model; returns (largest batch that fit, batch to use)."""
    model = prepare_model({**cfg, "encoder_weights": None}, hw).train()
    optimizer = build_optimizer(model, cfg)
    loss_fn = SegLoss(cfg["num_classes"], cfg["loss"])

    def fits(n):
        try:
            # A fresh GradScaler (fp16) per trial: an OOM after unscale_() leaves a scaler mid-step,
            # and the next trial's unscale_() would raise instead of measuring.
            batch_trial(model, optimizer, loss_fn, build_scaler(prec, hw, cfg), prec, hw, cfg, n)
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


def batch_trial(model, optimizer, loss_fn, scaler, prec, hw, cfg, n):
    """One real training step at batch n on random data, in the run's precision and layout."""
    size = cfg["image_size"]
    x = torch.randn(n, cfg["in_channels"], size, size, device=hw.device)
    y = torch.randint(0, max(2, cfg["num_classes"]), (n, size, size), device=hw.device)
    if cfg["channels_last"]:
        x = x.contiguous(memory_format=torch.channels_last)
    run = Run(model, model, optimizer, None, scaler, prec, loss_fn=loss_fn)
    forward_backward(run, x, y, hw, 1)  # a group of one micro-batch
    optimizer_step(run, cfg, torch.ones((), dtype=torch.bool, device=hw.device))
    synchronize(hw)


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


# ----------------------------------------------------------------------------------------------------
# IV.3 Benchmark: the same data, seed and model under several precision settings, one process each.
# ----------------------------------------------------------------------------------------------------
BENCHMARK_CONFIG = {
    "configs": "default,fp32,tf32,fp32_cl,bf16,bf16_cl,bf16_compile,bf16_2x,fp16",  # BENCHMARK_SETTINGS names
    "output": "checkpoints/benchmark",
    "bare_steps": 6,        # timed steps of the bare reference loops (0 = skip them)
    "probe_steps": 2,       # timed steps of the short probe for bf16 where it is not native (emulated)
    "inference": "fp32,fp32_cl,bf16,bf16_cl",  # the inference table's modes (CPU_PROBE_MODES names); "" = none
    "inference_images": 32, # fit mode: a folder of this many of the data set's images, predicted
    "inference_size": 1024, # patch mode: one generated image of this side, through the sliding window
    "inference_format": "png",  # that image's file: png, or tif (uncompressed: next to nothing to decode)
    "inference_rounds": 2,  # predict and the forward passes alone, timed in alternating rounds
}


# Each benchmark configuration: CONFIG overrides. "2x" doubles batch_size. The layout is pinned (NCHW
# unless named _cl) and fp32 is strict (TF32 off) except in `tf32`; `default` is the config as given.
STRICT_FP32 = {"tf32_matmul_precision": "highest"}  # also turns cuDNN's TF32 convolutions off

BENCHMARK_SETTINGS = {
    "default": {},
    "fp32": {"use_amp": False, "amp_dtype": "auto", "channels_last": False, "compile_model": False, **STRICT_FP32},
    "tf32": {"use_amp": False, "amp_dtype": "auto", "channels_last": False, "compile_model": False,
             "tf32_matmul_precision": "high"},
    "fp32_cl": {"use_amp": False, "amp_dtype": "auto", "channels_last": True, "compile_model": False, **STRICT_FP32},
    "bf16": {"use_amp": True, "amp_dtype": "bfloat16", "channels_last": False, "compile_model": False},
    "bf16_cl": {"use_amp": True, "amp_dtype": "bfloat16", "channels_last": True, "compile_model": False},
    "bf16_compile": {"use_amp": True, "amp_dtype": "bfloat16", "channels_last": False, "compile_model": True},
    "bf16_2x": {"use_amp": True, "amp_dtype": "bfloat16", "channels_last": False, "compile_model": False,
                "batch_size": "2x"},
    "fp16": {"use_amp": True, "amp_dtype": "float16", "channels_last": False, "compile_model": False},
}  # use_amp=True set: a use_amp=False given to the benchmark made its bf16 rows fp32; compile_model=False set:
# a compile_model=True given compiled every row (bf16 was bf16_compile, each row paid its minute of compiling)


# Training keys every benchmark run sets itself.
BENCHMARK_FIXED = {"checkpoint_dir": "each run writes to output=<folder>/<config>",
                   "resume": "each run starts afresh, so the runs compare",
                   "progress": "each run logs to <config>.log in output=, without a progress bar",
                   "early_stopping_patience": "each run trains all its epochs, so the runs compare",
                   # a preset's precision, layout and compile are each row's own (configs=); its other keys
                   # (debug's batch 2, 8 images, anomaly detection) ran unsaid, the header stating CONFIG's
                   "preset": "each row sets its own precision, layout and compile; give the preset's other keys, "
                             "such as batch_size= or epochs=, directly",
                   "detect_anomaly": "anomaly detection slows every step several-fold: the times would measure it"}
BENCHMARK_FIXED_VALUES = {"progress": False, "resume": False, "early_stopping_patience": None}  # each run's
BENCHMARK_UNUSED_VALUES = {"preset": None, "detect_anomaly": False}  # taken only as CONFIG's, which they are

BENCHMARK_FIELDS = ("config", "device", "precision", "batch", "channels_last", "compile",
                    "time_per_epoch_s", "first_epoch_s", "timed_epochs", "epoch_spread", "images_per_s",
                    "speedup_vs_fp32", "peak_mem_mb", "peak_mem_kind", "final_val_iou", "final_val_dice",
                    "nonfinite_steps", "scaler_skipped_steps", "epochs", "status", "slowdown_vs_fp32", "step_spread")


def run_benchmark(args=()):
    """The `benchmark` command: returns {'rows', 'histories', 'bare_loop', ...} and writes CSV/JSON."""
    check_argument_list(args)
    # no other benchmark moves this one's files aside, or writes among them
    with run_folders_held(), process_state_kept():
        return benchmark_in(*parse_benchmark_args(list(args)), args)


def benchmark_in(opts, base, train_args, names, args):
    """run_benchmark, its arguments parsed: the output folder is locked for it, then written."""
    hw = detect_hardware(base["device"])
    check_inference_memory(opts, base, hw, available_memory())
    out_dir = Path(opts["output"])
    check_not_in_a_data_set(out_dir, "output")
    check_not_a_training_run(out_dir)
    check_writable(out_dir)
    train_pairs, _ = data_pairs(base)  # the data checked (the embedded set written) before earlier files move
    check_doubled_batch(names, base, train_pairs, hw)
    claim_output_folder(out_dir, [*names, INFERENCE_DIR] if inference_modes(opts) else names)
    threads = fit_cpu_threads()  # each training row's own process fits its threads the same way (train)
    result = started_benchmark(hw, base, args)
    write_json(out_dir / "benchmark.json", result)
    setup_cudnn(hw)
    # The bare loop's and the probes' fp32 is strict, as in the fp32 row (TF32 off on CUDA Ampere+);
    # every training row runs in its own process with its own setting.
    apply_tf32(STRICT_FP32["tf32_matmul_precision"], Precision.of(torch.float32, "benchmark"))
    print(f"[benchmark] {describe(hw)}, {thread_words()}; {base['arch']}({base['encoder_name']}) at "
          f"{base['image_size']}px, batch {base['batch_size']}, {base['epochs']} epoch{'s' * (base['epochs'] != 1)}; "
          f"results in {out_dir}/",
          flush=True)
    if threads:
        print(f"[benchmark] note: {threads}", flush=True)
    bare, bare_spread = bare_loop_speedups(base, hw, opts["bare_steps"], opts["probe_steps"])
    result.update(bare_loop_s_per_step=bare, bare_loop_step_spread=bare_spread)
    rows = benchmark_rows(names, base, hw, opts, train_args, out_dir, result)
    atomic_write(out_dir / "benchmark.csv", lambda tmp: write_rows_csv(tmp, rows))
    print_benchmark_summary(rows, bare, hw, bare_spread, base["eval_amp"])
    try:
        result["inference"] = inference_table(base, hw, opts, out_dir)
    except KeyboardInterrupt:  # its predicts' own stop line ('2 of 6 image(s) written') is not the benchmark's
        raise KeyboardInterrupt(rows_kept_words(result["rows"])) from None
    result["complete"] = True
    write_json(out_dir / "benchmark.json", result)
    return result


def started_benchmark(hw, base, args):
    """benchmark.json as a benchmark starts: where and how it runs, no rows yet, and "complete": false until
    its inference table is written. An interrupted benchmark's record keeps the command that started it: the
    notebook, which refuses it, names it to run again (it suggested output= alone, dropping the user's keys)."""
    return {"device": describe(hw), "machine": benchmark_machine(hw, args),
            "settings": {k: base[k] for k in ("arch", "encoder_name", "image_size", "batch_size", "epochs",
                                              "data_dir", "max_train_images", "seed", "eval_amp")},
            "rows": [], "histories": {}, "complete": False}


def check_not_a_training_run(out_dir):
    """output= a training run's folder (its best.pt or last.pt there): the benchmark's rows, logs and table
    went among the run's files, as training refuses a data set's folders (check_not_in_a_data_set)."""
    held = [name for name in ("best.pt", "last.pt") if (out_dir / name).is_file()]
    if held:
        raise UserError(f"output={out_dir} holds a training run ({', '.join(held)}): the benchmark's runs, logs "
                        f"and table would go among its files; choose another output (e.g. "
                        f"{cli_value(out_dir / 'benchmark')})")


def claim_output_folder(out_dir, writes):
    """The benchmark's output folder made and locked for this benchmark, an earlier one's results in it
    moved aside (benchmark_outputs: those this one would write, `writes`, refused where not a benchmark's)."""
    hold_folder(out_dir, f"output={out_dir}", "another benchmark or training run")
    earlier = benchmark_outputs(out_dir, writes)
    for name in (n for n in earlier if n in BENCHMARK_SETTINGS):  # a run still training there is not moved away
        hold_folder(out_dir / name, f"{out_dir / name}", "a training run")
    moved = archive_previous_run(out_dir, earlier)
    if moved:  # with the archive's size past ARCHIVE_NOTE_BYTES, as training says it: ~1.5 GB a default benchmark
        print(f"[benchmark] earlier results in {out_dir} were moved to {moved}" + archive_size_note(Path(moved).parent))


def csv_number(text):
    """A CSV cell as an int or a finite float where it reads as one, else as it is (a precision's name, an empty
    cell, "nan": JSON has no NaN)."""
    if not isinstance(text, str):
        return text
    for kind in (int, float):
        try:
            value = kind(text)
        except ValueError:
            continue
        return value if math.isfinite(value) else text
    return text


def benchmark_rows(names, base, hw, opts, train_args, out_dir, result):
    """The table's rows, each into `result` and benchmark.json as it ends (with its per-epoch history where it
    trained): an interrupted benchmark keeps the rows before."""
    fp32_times = {}
    for name in names:
        try:
            row, history = benchmark_row(name, base, hw, opts, train_args, out_dir, fp32_times)
        except KeyboardInterrupt:
            finished = finished_before_the_stop(name, base, out_dir)  # a stop in the seconds its process exits
            if finished:
                record_row(result, name, *finished, out_dir)
            raise KeyboardInterrupt(rows_kept_words(result["rows"])) from None
        record_row(result, name, row, history, out_dir)
    return result["rows"]


def record_row(result, name, row, history, out_dir):
    """A row into `result` and benchmark.json, with its per-epoch history where it trained."""
    result["rows"].append(row)
    if history is not None:  # history.csv's cells as numbers where they are ("1", "0.57": strings before)
        result["histories"][name] = [{key: csv_number(value) for key, value in r.items()} for r in history]
    add_speedups(result["rows"])
    write_json(out_dir / "benchmark.json", result)


def finished_before_the_stop(name, base, out_dir):
    """(row, history) of a configuration whose run had trained all its epochs when the benchmark was stopped (a
    trained process takes seconds to exit after its 'done' line: the row was lost, benchmark.json's rows
    empty beside a complete history.csv), else None."""
    try:
        history, info = run_records(out_dir / name)
    except (OSError, ValueError):  # not there, or cut short
        return None
    return (summarize_history(name, history, info), history) if len(history) == base["epochs"] else None


def rows_kept_words(rows):
    """The line a stopped benchmark ends with: which rows its benchmark.json keeps."""
    kept = [r["config"] for r in rows]
    return INTERRUPTED["benchmark"] + (f"; benchmark.json keeps the {len(kept)} row(s) that ended: {', '.join(kept)}"
                                       if kept else "; no row had ended")


def benchmark_row(name, base, hw, opts, train_args, out_dir, fp32_times):
    """(row, per-epoch history or None): the configuration trained in its own process, probed where training
    it would take far too long (probe_instead), or skipped where this machine cannot run it."""
    if probe_instead(name, base, hw):
        return probe_row(name, base, hw, opts["probe_steps"], fp32_times), None
    reason = skip_reason(name, base, hw)
    if reason:
        print(f"[benchmark] {name}: skipped: {reason}", flush=True)
        return {"config": name, "status": f"skipped: {reason}"}, None
    return run_benchmark_config(name, base, train_args, out_dir)


def benchmark_machine(hw, args):
    """What a figure needs beside it to be compared later (BENCHMARKS.md gives each its machine, date and
    command): when and where it ran, with which torch and how many of its threads (this process's, fitted
    as each row's process fits its own: fit_cpu_threads), and how it was called."""
    return {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "cores": os.cpu_count(), "cpu": cpu_name(),
            "torch_threads": torch.get_num_threads(), "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
            "cpu_bf16": hw.bf16_feature, "command": shlex.join(["python", "train_unet.py", "benchmark", *args])}


def thread_words():
    """'2 cores, 1 torch thread (OMP_NUM_THREADS=1)': a figure from one thread does not read as the machine's."""
    threads, omp = torch.get_num_threads(), os.environ.get("OMP_NUM_THREADS")
    return (f"{os.cpu_count()} cores, {threads} torch thread{'s' * (threads != 1)}"
            + (f" (OMP_NUM_THREADS={omp})" if omp else ""))


def print_benchmark_summary(rows, bare, hw, bare_spread=None, eval_amp=False):
    """The table, the bare loop's speeds (noted as noisy where a mode's steps were NOISY_SPREAD apart, as
    the rows are: on a 2-core Xeon one run's bare loop read bf16_cl 1.40x fp32, its trained rows 2.37x and a
    rerun 2.27x), and what each column means (eval_amp=True validated each row at its own precision)."""
    print(format_benchmark_table(rows))
    if bare:
        known = {k: v for k, v in (bare_spread or {}).items() if v is not None} or {"fp32": 1.0}
        label, worst = max(known.items(), key=lambda item: item[1])
        noisy = (f"; noisy: {label}'s steps {worst:.2f}x apart, so these ratios are not the machine's: run "
                 f"again on a quiet machine, or compare the rows above" if worst > NOISY_SPREAD else "")
        single = [k for k, v in (bare_spread or {}).items() if v is None]
        noisy += (f"; {', '.join(single)}: 1 timed step, no spread to judge its noise by (bare_steps=6, or "
                  f"probe_steps= for bf16 not native)" if single else "")
        print(f"bare loop (s/step, median): fp32 {bare['fp32']:.3f}, bf16{'' if hw.bf16 else ' (not native)'} "
              f"{bare['bf16']:.3f} "
              f"({bare['fp32'] / bare['bf16']:.2f}x), bf16+channels_last {bare['bf16_cl']:.3f} "
              f"({bare['fp32'] / bare['bf16_cl']:.2f}x){noisy}")
    trained = [r for r in rows if r.get("status") == "ok"]
    timed = ("its one epoch, start-up included (epochs=1)" if trained and all(r.get("epochs") == 1 for r in trained)
             else "median training pass over epochs 2..N (epoch 1, with any compile time, is first_epoch_s in the CSV)")
    print(f"Time/Epoch: {timed}; Speedup: images/s of that epoch vs fp32's; Final IoU: last epoch, "
          f"evaluated {'at its own precision (eval_amp=True)' if eval_amp else 'in fp32'}.\n"
          f"Precision fp32 = strict fp32 (TF32 off); tf32 = fp32 with TF32 convolutions/matmuls (CUDA Ampere+); "
          f"default = the config as given (layout auto). Plain fp32 on {hw.device} runs as {fp32_math(hw)}.")


def parse_benchmark_args(args):
    """Benchmark keys (BENCHMARK_CONFIG) and training keys (CONFIG) in one key=value list."""
    bench_args = [a for a in args if normalize_key(a.partition("=")[0]) in BENCHMARK_CONFIG]
    opts = parse_overrides(bench_args, defaults=BENCHMARK_CONFIG)
    train_args = [a for a in args if a not in bench_args]
    for arg in train_args:  # a misspelt benchmark key was matched against the training keys alone
        key = normalize_key(arg.partition("=")[0])
        if "=" in arg and key not in TRAINING_KEYS:
            known = (*BENCHMARK_CONFIG, *TRAINING_KEYS)
            owners = [command for command in ("predict", "export") if key in COMMAND_KEYS[command]()]
            if owners:  # overlay=True read "did you mean 'tile_overlap'?", checkpoint= "'checkpoint_dir'?"
                raise UserError(f"{key} is a key of {' and '.join(owners)}, not of the benchmark: python train_unet.py "
                                f"{owners[0]} {key}=...")
            raise UserError(f"unknown key {key!r}: {near_key(key, known)}the benchmark's keys: "
                            f"{', '.join(BENCHMARK_CONFIG)}; and any training key ({', '.join(TRAINING_KEYS)})")
    base = parse_overrides(train_args)
    check_paths_given(opts, ("output",))  # empty: results, runs and logs in the current folder
    check_benchmark_fixed(train_args, base)
    if base["batch_size"] == "auto":  # a traceback from the data check ('<' between int and str)
        raise UserError("batch_size=auto is not for the benchmark: auto searches each precision's own largest "
                        "batch, and the rows compare at one batch size; give batch_size= a number (auto trains 8 on "
                        "a CPU)")
    for key, least in (("probe_steps", 1), ("bare_steps", 0)):
        if opts[key] < least:
            raise UserError(f"{key}={opts[key]} must be >= {least}")
    if opts["inference_format"] not in ("png", "tif"):
        raise UserError(f"inference_format={opts['inference_format']!r} is not allowed: use png or tif")
    opts["configs"], opts["inference"] = opts["configs"].lower(), opts["inference"].lower()  # FP32 as fp32
    names = [n.strip() for n in opts["configs"].split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARK_SETTINGS]
    if unknown or not names:
        raise UserError(f"configs={opts['configs']!r}: unknown {', '.join(unknown) or '(empty)'}; use a "
                        f"comma-separated list of {', '.join(BENCHMARK_SETTINGS)}")
    check_once_each("configs", opts["configs"], names)  # two runs of one name would share its output folder
    check_inference_keys(opts)
    if inference_modes(opts) and opts["inference_size"] < base["image_size"]:  # it timed one 10x10 image
        raise UserError(f"inference_size={opts['inference_size']} is below image_size={base['image_size']}: the "
                        f"sliding window's image must hold at least one window; give inference_size="
                        f"{base['image_size']} or more (the default is {BENCHMARK_CONFIG['inference_size']})")
    return opts, base, train_args, names


def check_doubled_batch(names, base, train_pairs, hw):
    """bf16_2x's batch, twice batch_size, fills from the training set where the row trains: checked before any
    row trains (it failed after the rows before it had trained, naming a batch_size=12 never given). A probe
    row (bf16 not native) times random batches: no check."""
    samples, doubled = training_samples(train_pairs, base), 2 * base["batch_size"]
    trains = "bf16_2x" in names and not probe_instead("bf16_2x", base, hw) and not skip_reason("bf16_2x", base, hw)
    if trains and samples < doubled:
        what = "image(s)" if base["data_mode"] == "fit" else "patch(es) per epoch"
        raise UserError(f"bf16_2x trains at twice batch_size={base['batch_size']}, {doubled}, more than the training "
                        f"set's {samples} {what}: " + (f"give batch_size={samples // 2} or less, or " if samples > 1
                                                         else "add images, or ") + "leave bf16_2x out")


def check_benchmark_fixed(train_args, base):
    """The keys the benchmark sets for each run (BENCHMARK_FIXED) are left out, or given as it sets them:
    progress=False, copied from a training command, was refused though it is the benchmark's own."""
    for key in BENCHMARK_FIXED:
        given = any(normalize_key(a.partition("=")[0]) == key for a in train_args)
        allowed = {**BENCHMARK_FIXED_VALUES, **BENCHMARK_UNUSED_VALUES}
        if given and (key not in allowed or base[key] != allowed[key]):
            what = "is not for the benchmark" if key in BENCHMARK_UNUSED_VALUES else "is set by the benchmark itself"
            raise UserError(f"{key} {what} ({BENCHMARK_FIXED[key]}): leave it out")


def check_once_each(key, given, names):
    """A list key (configs=, inference=) names each entry once."""
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise UserError(f"{key}={given!r} names {', '.join(twice)} more than once: name each once")


def inference_modes(opts):
    """The inference table's modes (CPU_PROBE_MODES names), in the order given; [] = no table."""
    return [m.strip() for m in opts["inference"].split(",") if m.strip()]


def check_inference_keys(opts):
    """The inference table's keys, checked before any training: they are used only after it."""
    unknown = [m for m in inference_modes(opts) if m not in CPU_PROBE_MODES]
    if unknown:
        raise UserError(f"inference={opts['inference']!r}: unknown {', '.join(unknown)}; use a comma-separated "
                        f"list of {', '.join(CPU_PROBE_MODES)}, or inference= (empty) for no inference table")
    check_once_each("inference", opts["inference"], inference_modes(opts))
    for key in ("inference_images", "inference_size", "inference_rounds"):
        if inference_modes(opts) and opts[key] < 1:
            raise UserError(f"{key}={opts[key]} must be >= 1 (or inference= for no inference table)")


def check_inference_memory(opts, base, hw, free):
    """The inference table's large image (inference_size²) must fit in the memory `free` (bytes; None:
    unknown) beside what it holds: checked before any training, as it was met only after all the rows had
    trained, as numpy's 30-line out-of-memory traceback. A lower bound (inference_bytes_per_pixel)."""
    per_pixel, side = inference_bytes_per_pixel(opts, base, hw), opts["inference_size"]
    if not inference_modes(opts) or free is None or side * side * per_pixel <= free:
        return
    fits = math.isqrt(int(free // per_pixel))
    smaller = f"use a smaller inference_size (at most {fits}), or " if fits >= 1 else "use "
    raise UserError(f"inference_size={side} needs at least {size_text(side * side * per_pixel)} of memory for the "
                    f"inference table's {side}x{side} image, and {size_text(free)} is free: {smaller}inference= "
                    f"for no inference table")


def inference_mode_runs(mode, hw):
    """Whether an inference table's mode runs here: its bf16 rows are skipped where bf16 is not native."""
    return CPU_PROBE_MODES[mode][0] == "fp32" or hw.bf16


def inference_bytes_per_pixel(opts, base, hw):
    """Host bytes a pixel of the inference table's patch-mode image needs at least: made, its noise and its
    blurred copy (inference_inputs); while a row runs (none where bf16 is not native and every mode is
    bf16's), the image as read for the forward alone, its tiles held for it (float32 on the host,
    (1 / (1 - tile_overlap))² as many pixels as the image where it is large; on CUDA on the device), and
    predict's own need (predict_memory). Decoding and encoding buffers come on top."""
    made = 2 * 3
    if not any(inference_mode_runs(mode, hw) for mode in inference_modes(opts)):
        return made
    channels = image_bytes(1, base)
    tiles = 0 if hw.kind == "cuda" else 4 * channels * (base["patch_scale"] / (1 - base["tile_overlap"])) ** 2
    return max(made, channels + tiles + predict_memory(1, 1, 1, base))


def benchmark_overrides(name, base):
    """CONFIG overrides (as key=value strings) for one named benchmark configuration."""
    out = []
    for key, value in BENCHMARK_SETTINGS[name].items():
        value = base["batch_size"] * 2 if value == "2x" else value
        out.append(f"{key}={value}")
    return out


def skip_reason(name, base, hw):
    """Why a configuration cannot run as named on this hardware (None = it can). `default` runs as training
    would, falling back where its precision is not native here (it was skipped, though training ran)."""
    if name == "default":
        return None
    cfg = parse_overrides(benchmark_overrides(name, base), base=base)
    if name == "tf32" and (hw.kind != "cuda" or hw.capability < AMPERE):
        return f"TF32 needs a CUDA GPU of compute capability >= {capability_text(AMPERE)}"
    prec = decide_precision(hw, cfg["use_amp"], cfg["amp_dtype"], cfg["force_amp_dtype"])
    return prec.warning and f"amp_dtype={cfg['amp_dtype']} {missing_support(hw, cfg['amp_dtype'])}"


def probe_instead(name, base, hw):
    """bf16 where it is not native: a short timed probe answers "how much slower?" (a full run would take
    2.3-33x as long as fp32's: measured, see III.3's note). Compiled runs are not probed: their first
    epoch is the compile. `default`, the config as given, trains as it would, in the precision it falls
    back to (amp_dtype=bfloat16 where bf16 is not native: fp32; it was probed as bf16, and labelled so)."""
    cfg = parse_overrides(benchmark_overrides(name, base), base=base)
    if name == "default" and decide_precision(hw, cfg["use_amp"], cfg["amp_dtype"], cfg["force_amp_dtype"]).warning:
        return False
    return (cfg["use_amp"] and cfg["amp_dtype"] == "bfloat16" and not hw.bf16 and not cfg["compile_model"]
            and hw.kind == "cpu")


def probe_row(name, base, hw, steps, fp32_times):
    """A bf16 configuration timed for a few bare steps against fp32 at the same batch (emulated bf16)."""
    cfg = parse_overrides(benchmark_overrides(name, base), base=base)
    layout, _ = decide_channels_last(cfg, hw, Precision.of(torch.bfloat16, "probe"))
    if cfg["batch_size"] not in fp32_times:
        fp32_times[cfg["batch_size"]] = train_step_times(cfg, hw, torch.float32, False, steps)
    times = {"bf16": train_step_times(cfg, hw, torch.bfloat16, layout, steps), "fp32": fp32_times[cfg["batch_size"]]}
    bf16, ref = (float(np.median(times[k])) for k in ("bf16", "fp32"))
    print(f"[benchmark] {name}: probe, {steps} steps: bf16 (not native) {bf16:.3f} s/step, fp32 {ref:.3f} s/step: "
          f"{slower_than_fp32(bf16 / ref)}", flush=True)
    return {"config": name, "device": describe(hw), "precision": "bf16 (not native)", "batch": cfg["batch_size"],
            "channels_last": layout, "compile": False, "speedup_vs_fp32": ref / bf16,
            "slowdown_vs_fp32": bf16 / ref,
            "step_spread": None if steps == 1 else max(map(spread, times.values())),
            "status": f"probe: {steps} bare steps, {hw.bf16_feature}"}


def slower_than_fp32(slowdown):
    """A probe row's Note: two decimals as the Speedup column beside it has ('1.0x slower' beside 0.99x)."""
    if slowdown < 1:
        return f"{1 / slowdown:.2f}x faster than fp32"
    return f"{slowdown:.2f}x slower than fp32" if slowdown < 10 else f"{slowdown:.1f}x slower than fp32"


def run_benchmark_config(name, base, train_args, out_dir):
    """Train one configuration in a fresh process; returns (row, per-epoch history)."""
    run_dir = out_dir / name
    fixed = [*(f"{key}={value}" for key, value in BENCHMARK_FIXED_VALUES.items()), f"checkpoint_dir={run_dir}"]
    cmd = [sys.executable, str(Path(__file__).resolve()),
           *merge_args(train_args, benchmark_overrides(name, base), fixed)]
    print(f"[benchmark] {name}: {' '.join(cmd[2:])}", flush=True)
    log_path = out_dir / f"{name}.log"
    with open(log_path, "w") as log:
        returncode = run_child(cmd, log, log)
    history_path = run_dir / "history.csv"
    if returncode != 0 or not history_path.is_file():
        tail = log_path.read_text().strip().splitlines()[-1:] or ["no output"]  # whole: the fix ends the line
        return {"config": name, "status": f"failed (exit {returncode}): {tail[0]} (log: {log_path})"}, []
    history, info = run_records(run_dir)
    return summarize_history(name, history, info), history


def run_records(run_dir):
    """(per-epoch history, config.json's record) of a configuration trained in run_dir."""
    with open(run_dir / "history.csv") as f:
        history = list(csv.DictReader(f))
    return history, json.loads((run_dir / "config.json").read_text())


def run_child(cmd, stdout, stderr):
    """The exit code of a benchmark's child process (a row's training, a predict measured alone), run to its
    end. On POSIX it runs in a session of its own, so a stop (Ctrl-C in a terminal, Jupyter's interrupt,
    SIGTERM) reaches this process alone, which passes it on once as a Ctrl-C and waits while the child stops
    as train and predict stop at one (files intact, none half-written, "stopped: ..." in its log). It was
    killed 0.25 s after the stop (subprocess.run), mid-write. Where this process is killed instead, the
    child is told by the kernel (stop_with_benchmark)."""
    import subprocess

    own_session = {"start_new_session": True} if os.name == "posix" else {}  # process_group= needs Python 3.11
    env = {**os.environ, BENCHMARK_PARENT_ENV: str(os.getpid())}  # stop_with_benchmark
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=stdout, stderr=stderr, env=env, **own_session)
    try:
        return proc.wait()
    finally:
        if proc.poll() is None:  # a stop (KeyboardInterrupt: Ctrl-C, SIGTERM) while it runs
            stop_child(proc)


def stop_child(proc):
    """A benchmark's running child stopped as a Ctrl-C stops it, and waited for; a second Ctrl-C meanwhile
    ends it and its loader workers at once. On Windows (no session of its own) the console's Ctrl-C has
    reached it already: it is waited for."""
    try:
        if os.name == "posix":
            proc.send_signal(signal.SIGINT)
        proc.wait()
    except KeyboardInterrupt:
        with contextlib.suppress(OSError):  # ended meanwhile
            os.killpg(proc.pid, signal.SIGKILL) if os.name == "posix" else proc.kill()
        proc.wait()
        raise


BENCHMARK_PARENT_ENV = "UNET_BENCHMARK_PARENT"  # the pid of the benchmark that started this process (run_child)
STARTED_BY_BENCHMARK = False  # this process is a benchmark's child (stop_with_benchmark)
PR_SET_PDEATHSIG = 1  # Linux's prctl option: a signal for this process when the thread that started it ends


def stop_with_benchmark():
    """In a benchmark's child (run_child): its own process group keeps a terminal's hang-up (ssh dropped)
    from it, and nothing tells it when the benchmark is killed (the out-of-memory killer): it trained on,
    untold, through its remaining epochs, holding the GPU. On Linux the kernel now sends it SIGTERM when
    the benchmark ends, which stops it as a SIGTERM does (sigterm_as_exit); elsewhere nothing changes."""
    global STARTED_BY_BENCHMARK
    parent = os.environ.pop(BENCHMARK_PARENT_ENV, None)
    STARTED_BY_BENCHMARK = parent is not None
    if parent is not None and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # started by a benchmark that was started in the background (`... benchmark &` in a script): SIGINT
        # ignored is inherited, and the row trained on through the benchmark's Ctrl-C (stop_child)
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if parent is None or not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    except (OSError, AttributeError):  # no prctl in this C library
        return
    if os.getppid() != int(parent) and not process_alive(int(parent)):  # it ended before the kernel was told
        os.kill(os.getpid(), signal.SIGTERM)  # (a launcher between the two, a shell, is a parent of another pid)


def process_alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # alive, another user's
        return True
    return True


def merge_args(*lists):
    """key=value lists merged left to right, one entry per key (a later list wins)."""
    merged = {}
    for arg in (a for lst in lists for a in lst):
        key, _, value = arg.partition("=")
        merged[normalize_key(key)] = value
    return [f"{k}={v}" for k, v in merged.items()]


def summarize_history(name, history, info):
    """One benchmark row from a run's per-epoch history (first epoch reported apart). Time/Epoch and
    images/s come from one epoch, the median one (the faster middle one of an even count): the median of
    each apart disagrees between two epochs, and the table's Speedup would contradict its Time/Epoch."""
    times = [float(r["epoch_time_s"]) for r in history]
    rates = [float(r["images_per_s"]) for r in history]
    steady = list(range(1, len(history))) if len(history) > 1 else [0]
    middle = sorted(steady, key=lambda i: times[i])[(len(steady) - 1) // 2]
    skipped = sum(int(r["skipped_steps"]) for r in history)
    fp16 = history[-1]["precision"] == "fp16"
    precision = history[-1]["precision"]
    if precision == "fp32" and info.get("fp32_math") == "tf32":
        precision = "tf32"  # fp32 whose convolutions/matmuls ran in TF32 (CUDA Ampere+)
    return {"config": name, "device": info["device"], "precision": precision,
            "batch": info["config"]["batch_size"], "channels_last": info["config"]["channels_last"],
            "compile": info["config"]["compile_model"],
            "time_per_epoch_s": times[middle], "first_epoch_s": times[0], "timed_epochs": len(steady),
            "epoch_spread": spread([times[i] for i in steady]),
            "images_per_s": rates[middle], "speedup_vs_fp32": None,
            "peak_mem_mb": max(float(r["peak_mem_mb"]) for r in history),
            "peak_mem_kind": history[-1]["peak_mem_kind"],
            "final_val_iou": float(history[-1]["val_iou"]), "final_val_dice": float(history[-1]["val_dice"]),
            "nonfinite_steps": 0 if fp16 else skipped, "scaler_skipped_steps": skipped if fp16 else 0,
            "epochs": len(history), "status": "ok", "optimizer_steps": csv_number(history[-1].get("optimizer_steps")),
            "accumulation_steps": info["config"].get("accumulation_steps", 1),
            "data_mode": info["config"].get("data_mode", "fit")}


def spread(seconds):
    """The slowest of some timed rounds over the fastest."""
    return max(seconds) / min(seconds)


def bare_loop_speedups(base, hw, steps, probe_steps=2):
    """Reference: a bare forward/backward/step loop on random data, no loader, metrics or bars.

    Returns ({"fp32": s/step, "bf16": ..., "bf16_cl": ...}, {label: its slowest step over its fastest}):
    medians after a warm-up step, and the spread that tells a busy machine (print_benchmark_summary).
    Where bf16 is emulated (no native kernels) it runs min(steps, probe_steps) steps: the answer, not a
    long wait.
    """
    if steps < 1:
        return {}, {}
    bf16_steps = steps if hw.bf16 else max(1, min(steps, probe_steps))
    times = {label: train_step_times(base, hw, dtype, channels_last, steps if dtype == torch.float32 else bf16_steps)
             for label, dtype, channels_last in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, False),
                                                 ("bf16_cl", torch.bfloat16, True))}
    return {k: float(np.median(v)) for k, v in times.items()}, {k: step_spread(v) for k, v in times.items()}


def step_spread(seconds):
    """spread, or None for one timed step: it has none to judge its noise by (1.00 read as steady)."""
    return spread(seconds) if len(seconds) > 1 else None


def time_train_steps(base, hw, dtype, channels_last, steps):
    """Median seconds per bare training step (train_step_times)."""
    return float(np.median(train_step_times(base, hw, dtype, channels_last, steps)))


def train_step_times(base, hw, dtype, channels_last, steps):
    """Seconds of each of `steps` bare training steps (bare_training_step, after one warm-up step) at
    base's batch and image size."""
    step, times = bare_step_runner(base, hw, dtype, channels_last), []
    for _ in range(steps + 1):
        synchronize(hw)
        t0 = time.perf_counter()
        step()
        synchronize(hw)
        times.append(time.perf_counter() - t0)
    return times[1:]


def bare_step_runner(base, hw, dtype, channels_last):
    """A function that runs one bare training step (bare_training_step) of a fresh model on a random
    batch at base's batch and image size, in `dtype` autocast and the given layout."""
    return bare_step_runners(base, hw, [dtype], channels_last)[dtype]


def add_speedups(rows):
    """Speed-up = training images/s over fp32's (same images per epoch, so batch size is fair)."""
    ref = next((r for r in rows if r["config"] == "fp32" and r.get("status") == "ok"), None)
    for r in rows:
        if ref and r.get("status") == "ok":
            r["speedup_vs_fp32"] = r["images_per_s"] / ref["images_per_s"]
    return rows


def format_benchmark_table(rows):
    header = ("Config", "Batch", "Precision", "Time/Epoch", "Speedup vs FP32", "Peak memory", "Final IoU", "Note")
    lines, ref = [header], next((r for r in rows if r.get("config") == "fp32" and r.get("status") == "ok"), None)
    for r in rows:
        if r.get("status", "").startswith("probe"):
            noisy = (r.get("step_spread") or 1) > NOISY_SPREAD
            lines.append((r["config"], str(r["batch"]), r["precision"], "-", f"{r['speedup_vs_fp32']:.2f}x", "-",
                          "-", f"{slower_than_fp32(r['slowdown_vs_fp32'])} ({r['status']})"
                          + ("; 1 timed step: no spread to judge its noise by; more probe_steps"
                             if "step_spread" in r and r["step_spread"] is None else "")
                          + (f"; noisy: steps {r['step_spread']:.2f}x apart; more probe_steps, a quiet machine"
                             if noisy else "")))
            continue
        if r.get("status") != "ok":
            lines.append((r["config"], "-", "-", "-", "-", "-", "-", r.get("status", "")))
            continue
        speed = f"{r['speedup_vs_fp32']:.2f}x" if r["speedup_vs_fp32"] else "-"
        lines.append((r["config"], str(r["batch"]), r["precision"], seconds_text(r["time_per_epoch_s"]),
                      speed, f"{r['peak_mem_mb']:.0f} MB", f"{r['final_val_iou']:.4f}", benchmark_note(r, ref)))
    return markdown_table(lines)


def seconds_text(seconds):
    """Three significant digits up to 100 s: epochs of 0.25 s and 0.27 s read 0.2s and 0.3s beside a Speedup of
    1.10x, or 0.4s three times beside 1.00x, 1.04x and 0.86x (user test)."""
    return f"{seconds:.3g}s" if seconds < 100 else f"{seconds:.0f}s"


NOISY_SPREAD = 1.25  # the slowest timed epoch over the fastest above which a row's figures are called noisy


def benchmark_note(row, ref=None):
    """The Note column of a trained row: compile time, and whether its time can be trusted: one epoch
    only (start-up included), timed epochs far apart (a busy machine, or a warm-up still going: on a
    CPU, epochs of a second or two ran epoch 2 1.35x slower than 3 and 4, 11-25), or timed epochs far
    slower than the untimed first one, warm-up and all (the machine got busy: 0.85 s, then 29 s and 29 s
    in a review); and, for the others, whether the fp32 row their speed-up divides by has such a note. A
    row of an older benchmark.json (the notebook reads them) may lack the counts: then nothing is said."""
    notes = [f"compiled: epoch 1 took {row['first_epoch_s']:.0f}s"] if row.get("compile") else []
    if row.get("epochs") == 1:
        notes.append("1 epoch: its time includes start-up; use epochs=4 or more")
    elif row.get("timed_epochs") == 1:
        notes.append("1 timed epoch: no spread to judge its noise by; use epochs=4 or more")
    elif (row.get("epoch_spread") or 1) > NOISY_SPREAD:
        notes.append(f"noisy: epoch times {row['epoch_spread']:.2f}x apart; more epochs, a quiet machine")
    if row.get("epochs") != 1 and not row.get("compile") and row.get("first_epoch_s") and \
            row["time_per_epoch_s"] > NOISY_SPREAD * row["first_epoch_s"]:  # one timed epoch too
        notes.append(f"noisy: timed epochs {row['time_per_epoch_s'] / row['first_epoch_s']:.1f}x slower than the "
                     f"first, warm-up and all (the machine got busy); a quiet machine")
    if ref is not None and ref is not row and row.get("speedup_vs_fp32") and benchmark_note(ref):
        notes.append("speed-up against the fp32 row's time, which has a note")
    if ref is not None and ref is not row and row.get("batch") and ref.get("batch") and row["batch"] != ref["batch"]:
        notes.append(other_batch_note(row, ref))
    return "; ".join(notes)


def other_batch_note(row, ref):
    """bf16_2x's note: its optimizer steps per epoch against fp32's (its lower IoU read as bf16's), as counted
    (where full batches leave images out, 12 images in batches of 8 made 1 step to fp32's 3 at batch 4, not
    the half the batch sizes say), and, where its epoch trained other images than fp32's, that its Time/Epoch
    does not compare (Speedup counts images/s). A row of an older benchmark.json: by the batch sizes."""
    steps, ref_steps = row.get("optimizer_steps"), ref.get("optimizer_steps")
    if not steps or not ref_steps:
        return (f"batch {row['batch']}: {ref['batch'] / row['batch']:.3g}x fp32's optimizer steps per epoch, so its "
                f"Final IoU does not compare with fp32's")
    note = f"batch {row['batch']}: {steps} optimizer step(s) per epoch to fp32's {ref_steps}, so its Final IoU does " \
           f"not compare with fp32's"
    images = [r["optimizer_steps"] * r["batch"] for r in (row, ref)]
    if row.get("accumulation_steps", 1) == ref.get("accumulation_steps", 1) == 1 and images[0] != images[1]:
        what = "patches" if row.get("data_mode") == "patch" else "images"
        note += (f"; its epoch trains {images[0]} {what} to fp32's {images[1]} (full batches only), so compare its "
                 f"Speedup (images/s), not its Time/Epoch")
    return note


def markdown_table(lines):
    """Rows of strings (the first is the header) as a Markdown table with aligned columns."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    cells = lambda line: "| " + " | ".join(c.ljust(w) for c, w in zip(line, widths)) + " |"  # noqa: E731
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([cells(lines[0]), rule] + [cells(line) for line in lines[1:]])


def inference_table(base, hw, opts, out_dir):
    """Predict, timed against the forward passes alone over the same batches, per precision and layout:
    fit mode over a folder of the data set's images, patch mode on one large generated image, each the
    whole `predict` command (reading, writing, everything). The fp32 run's trained model if this benchmark
    trained one, else a fresh one. Masks are compared with fp32's. Returns the rows (printed as a table)."""
    modes = inference_modes(opts)
    if not modes:
        return []
    folder = out_dir / INFERENCE_DIR
    inputs = inference_inputs(base, opts, folder)
    rows, masks = [], {}
    for mode in modes:
        for data_mode in ("fit", "patch"):
            rows.append(inference_row(mode, data_mode, base, hw, opts, folder, inputs))
            masks[mode, data_mode] = read_masks(folder / f"{data_mode}_{mode}")
    add_mask_agreement(rows, masks)
    write_json(folder / "inference.json", rows)
    print(format_inference_table(rows))
    return rows


def add_mask_agreement(rows, masks):
    """Each predicted row's share of mask pixels equal to fp32's in its data mode: the fp32 row's, else
    fp32_cl's (mask_reference); None where neither ran (never a bf16 row standing in for fp32)."""
    ran = {(r["mode"], r["data_mode"]) for r in rows if r["status"] == "ok"}
    for r in rows:
        ref = next((m for m in ("fp32", "fp32_cl") if (m, r["data_mode"]) in ran), None)
        r["mask_reference"] = ref
        ok = ref is not None and r["status"] == "ok"
        r["mask_agreement_vs_fp32"] = (mask_agreement(masks[r["mode"], r["data_mode"]], masks[ref, r["data_mode"]])
                                       if ok else None)


def inference_inputs(base, opts, folder):
    """(fit images folder, patch image folder, the model's checkpoint): the data set's first images, one
    generated large image (inference_format: PNG, or an uncompressed TIFF of the same pixels), and the fp32
    run's best.pt (else a fresh model's weights)."""
    fit_dir, patch_dir = folder / "fit_images", folder / "patch_images"
    for sub in (fit_dir, patch_dir):
        sub.mkdir(parents=True, exist_ok=True)
    train, val = split_pairs({**base, "max_train_images": None})  # all of them: inference trains nothing
    if len(val + train) < opts["inference_images"]:
        print(f"note: inference_images={opts['inference_images']}: {base['data_dir']} has {len(val + train)} "
              f"images; fit mode predicts them all")
    for image, _ in (val + train)[:opts["inference_images"]]:
        shutil.copy(image, fit_dir / Path(image).name)
    rng, side = np.random.default_rng(0), opts["inference_size"]
    big = cv2.GaussianBlur(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), (0, 0), 3)
    if opts["inference_format"] == "tif":  # the same pixels as the PNG once read (RGB order)
        import tifffile

        tifffile.imwrite(patch_dir / "large.tif", np.ascontiguousarray(big[..., ::-1]))
    else:
        write_png(patch_dir / "large.png", big)
    trained = folder.parent / "fp32" / "best.pt"
    if trained.is_file():
        return fit_dir, patch_dir, trained
    torch.manual_seed(base["seed"])
    model = build_model({**base, "encoder_weights": None})
    save_checkpoint(folder / "fresh.pt", {"model": model.state_dict(), "config": base})
    return fit_dir, patch_dir, folder / "fresh.pt"


def inference_row(mode, data_mode, base, hw, opts, folder, inputs):
    """One mode's predict in one data_mode, against the forward passes alone over the same batches."""
    dtype, nhwc = CPU_PROBE_MODES[mode]
    fit_dir, patch_dir, checkpoint = inputs
    model, trained = load_model(checkpoint, hw)
    cfg = {**trained, "data_mode": data_mode, "channels_last": nhwc, "tta": "none"}
    prec = Precision.of(DTYPES[dtype], "benchmark")
    if not inference_mode_runs(mode, hw):
        return {"mode": mode, "data_mode": data_mode, "precision": None, "status": "skipped: bf16 not native here"}
    if trained["data_mode"] != data_mode:  # saved in the row's data_mode, which predict runs (a patch-mode
        checkpoint = folder / f"{data_mode}.pt"  # benchmark's fit rows ran its sliding window, unsaid)
        save_checkpoint(checkpoint, {"model": model.state_dict(), "config": cfg})
    out = folder / f"{data_mode}_{mode}"
    args = {"checkpoint": str(checkpoint), "input": str(fit_dir if data_mode == "fit" else patch_dir),
            "output": str(out), "device": base["device"], "use_amp": prec.amp, "amp_dtype": "bfloat16",
            "channels_last": nhwc, "cpu_probe": False, "progress": False, "batch_size": base["batch_size"]}
    images = [read_image(p, cfg["in_channels"], cfg["intensity_range"]) for p in list_images(args["input"])]
    sizes, inputs = [image.shape[:2] for image in images], model_inputs(images, cfg, hw, base["batch_size"])
    model = model.to(hw.device).to(memory_format=torch.channels_last if nhwc else torch.contiguous_format)

    def forward_only():
        with torch.inference_mode():
            for x in inputs:
                eval_forward(model, x, cfg, prec, hw).float().cpu()
    predicted = []  # predict's own timer: reading, predicting and writing, not loading the checkpoint
    with contextlib.redirect_stdout(io.StringIO()):
        times = alternate_timings({"forward": forward_only, "predict": lambda: predicted.append(fresh_predict(args))},
                                  opts["inference_rounds"], hw)
    predict_times = [r["seconds"] for r in predicted[1:]]  # after the untimed first round
    predict_s, forward_s = float(np.median(predict_times)), float(np.median(times["forward"]))
    pixels = sum(h * w for h, w in sizes)
    row = {"mode": mode, "data_mode": data_mode, "precision": prec.name, "channels_last": nhwc,
           "images": len(sizes), "predict_s": predict_s, "forward_only_s": forward_s,
           "vs_forward_only": predict_s / forward_s, "images_per_s": len(sizes) / predict_s,
           "megapixels_per_s": pixels / 1e6 / predict_s, "rounds": len(predict_times),
           "round_spread": max(spread(predict_times), spread(times["forward"])), "status": "ok",
           **{f"{what}_wait_s": float(np.median([r["waited_s"][what] for r in predicted[1:]]))
              for what in ("reading", "writing")}}
    row["peak_mem_mb"], row["peak_mem_kind"] = predict_peak_memory(args)
    return row


def predict_peak_memory(args):
    """(peak memory in MB, its kind) of one predict with these args in a fresh process, as each trained
    row's is measured (in this process the rows before it, and the forward alone's inputs held in memory,
    would count): CPU, the process's peak resident memory; CUDA, the peak allocated by tensors.
    (None, why) where that process failed."""
    shutil.rmtree(args["output"], ignore_errors=True)  # as fresh_predict: no earlier masks moved to previous/
    code = ("import json, sys; sys.path.insert(0, sys.argv[1]); import train_unet as T; T.keep_freed_memory(); "
            "a = json.loads(sys.argv[2])\nwith T.sigterm_as_exit(): T.stop_with_benchmark(); T.predict(a)\n"
            "print(json.dumps(T.peak_memory_mb(T.detect_hardware(a['device']))))")
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        returncode = run_child([sys.executable, "-c", code, str(Path(__file__).resolve().parent), json.dumps(args)],
                               out, err)
        stdout, stderr = (f.seek(0) or f.read() for f in (out, err))
    lines = (stdout + stderr).strip().splitlines() or ["no output"]
    if returncode != 0:
        return None, f"not measured: its predict process exited {returncode}: {lines[-1]}"
    return tuple(json.loads(stdout.strip().splitlines()[-1]))


def fresh_predict(args):
    """predict into an emptied output folder, as a first predict writes: the last round's masks are
    neither archived (archive_earlier_predictions) nor written over (on ext4 a mask written over an old
    file cost 0.15 ms more than a new one, BENCHMARKS.md "Predict speed")."""
    shutil.rmtree(args["output"], ignore_errors=True)
    return predict(args)


def model_inputs(images, cfg, hw, batch_size):
    """The inputs of the forwards predict makes for these images (read_image's), made beforehand: fit
    mode's batches of fit_input, patch mode's tile batches (tile_batches), all held in memory (float32:
    a large image's tiles take ~1.8x its pixels x channels x 4 bytes at overlap 0.25; on CUDA an 8-bit
    image's tiles are normalised on the device, and held there). The forward alone
    runs on these, not on random numbers: on a CPU fp32's forward over random numbers ran up to 8% slower
    than over the real tiles (BENCHMARKS.md "Predict speed"), which flattered predict's ratio."""
    if cfg["data_mode"] == "fit":
        return [stacked_inputs([fit_input(image, cfg) for image in images[i:i + batch_size]], hw)
                for i in range(0, len(images), batch_size)]
    grids = (tile_grid(rescale(image, None, cfg["patch_scale"])[0], cfg) for image in images)
    return [x for padded, ys, xs in grids for _, x in tile_batches(padded, ys, xs, cfg, hw)]


def read_masks(folder):
    return {p.name: cv2.imread(str(p), cv2.IMREAD_UNCHANGED) for p in sorted(Path(folder).glob("*.png"))}


def mask_agreement(masks, reference):
    """Share of mask pixels equal to the reference's (the same image names)."""
    same = sum(int((masks[name] == reference[name]).sum()) for name in reference)
    return same / max(1, sum(m.size for m in reference.values()))


def format_inference_table(rows):
    lines = [("Mode", "Data mode", "Images", "Predict", "vs forward alone", "Waited: read / write", "img/s",
              "Mpx/s", "Peak memory", "Masks = fp32's", "Note")]
    for r in rows:
        if r["status"] != "ok":
            lines.append((r["mode"], r["data_mode"], "-", "-", "-", "-", "-", "-", "-", "-", r["status"]))
            continue
        agree, peak = r.get("mask_agreement_vs_fp32"), r.get("peak_mem_mb")
        waited = (f"{r['reading_wait_s']:.2f}s / {r['writing_wait_s']:.2f}s" if "reading_wait_s" in r else "-")
        lines.append((r["mode"], r["data_mode"], str(r["images"]), f"{r['predict_s']:.2f}s",
                      f"{r['vs_forward_only']:.3f}x", waited, f"{r['images_per_s']:.3g}",
                      f"{r['megapixels_per_s']:.2f}", "-" if peak is None else f"{peak:.0f} MB",
                      "-" if agree is None else f"{100 * agree:.3f}%", inference_note(r)))
    return ("Inference: the whole predict command (reading, writing) against the forward passes alone over the "
            "same batches, medians of alternating rounds; Waited: predict's main thread waiting for its reader "
            "and writer threads, or, where torch's threads take every core (a CPU), reading and writing between "
            "the forwards\n" + markdown_table(lines))


def inference_note(row):
    """The Note column of an inference row: whether its ratio can be trusted (as benchmark_note says of
    a trained row), no fp32 masks to compare with, a peak not measured. Older inference.json rows may
    lack the newer fields: nothing is said of them."""
    notes = []
    if row.get("rounds") == 1:
        notes.append("1 round: no spread to judge its noise by; use inference_rounds=3 or more")
    elif (row.get("round_spread") or 1) > NOISY_SPREAD:
        notes.append(f"noisy: rounds {row['round_spread']:.2f}x apart; more inference_rounds, a quiet machine")
    if row["vs_forward_only"] < 1 / INFERENCE_FASTER_LIMIT:
        notes.append("predict timed faster than its forwards alone: noise; a quiet machine")
    if "mask_reference" in row and row["mask_reference"] is None:
        notes.append("no fp32 row to compare masks with")
    elif row.get("mask_reference") == "fp32_cl":  # no fp32 row ran: the column's fp32 is fp32_cl's
        notes.append("masks compared with fp32_cl's (no fp32 row)")
    if row.get("peak_mem_mb", 0) is None:
        notes.append(f"peak memory {row['peak_mem_kind']}")
    return "; ".join(notes)


# predict does the forwards and more: timed below its forwards alone by more than this, the row is noise
# (the quiet runs in BENCHMARKS.md "Predict speed" came within 0.99x)
INFERENCE_FASTER_LIMIT = 1.03

BENCHMARK_RESULTS = ("benchmark.json", "benchmark.csv")
INFERENCE_DIR = "inference"  # the inference table's inputs, masks and inference.json (inference_table)


def benchmark_outputs(out_dir, writes):
    """The names an earlier benchmark wrote in out_dir: its results, each configuration's log and run
    folder, and its inference folder. Only these are archived; anything else there (output=. holds the
    user's files and train_unet.py itself) is not the benchmark's and stays, as does a folder of such a
    name that holds no run or inference table. One that this benchmark would write in (`writes`: its
    configurations, and INFERENCE_DIR where it predicts) is refused instead: the run would write into it,
    and the next benchmark would archive it."""
    names = [*BENCHMARK_RESULTS, INFERENCE_DIR,
             *(n for config in BENCHMARK_SETTINGS for n in (config, f"{config}.log"))]
    found = [n for n in names if (out_dir / n).exists() or (out_dir / n).is_symlink()]
    foreign = [n for n in found if (n in BENCHMARK_SETTINGS and not is_run_folder(out_dir / n))
               or (n == INFERENCE_DIR and not is_inference_folder(out_dir / n))]
    clash = next((n for n in foreign if n in writes), None)
    if clash is not None:
        what = (("an inference table", "the inference table") if clash == INFERENCE_DIR else
                ("a benchmark run (no checkpoint or history inside)", f"the benchmark's {clash} run"))
        raise UserError(f"{out_dir / clash} is not {what[0]}, but {what[1]} writes there: move it or choose "
                        f"another output=...")
    return [n for n in found if n not in foreign]


def is_inference_folder(path):
    """An earlier benchmark's INFERENCE_DIR: the inputs inference_inputs makes, or an empty folder."""
    if path.is_symlink() or not path.is_dir():
        return False
    entries = {p.name for p in path.iterdir()}
    return not entries or bool(entries & {"fit_images", "patch_images", "inference.json"})


def is_run_folder(path):
    """A training run's checkpoint_dir (RUN_FILES, or an archive of them), or an empty folder."""
    if path.is_symlink() or not path.is_dir():
        return False
    entries = {p.name for p in path.iterdir()}
    # A run that stopped before its first checkpoint has the data check's cache alone (read-only data_dir);
    # a user's data folder has it among its images.
    return not entries or bool(entries & {*RUN_FILES, "previous"}) or entries == {CHECK_CACHE_NAME}


def write_rows_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=BENCHMARK_FIELDS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)


# ----------------------------------------------------------------------------------------------------
# IV.4 Export: the model as ONNX, what predict needs beside it in a sidecar JSON, checked in onnxruntime.
# ----------------------------------------------------------------------------------------------------
EXPORT_CONFIG = {
    "checkpoint": "checkpoints/best.pt",
    "output": "model.onnx",         # the ONNX file; its sidecar is <name>.json beside it. A folder: <folder>/model.onnx
}

ONNX_OPSET = 17  # opset of the graph: run by onnxruntime >= 1.14, TensorRT >= 8.6, OpenVINO >= 2023.0

EXPORT_FORMAT = ("unet-amp export", 1)  # the sidecar's "format" and "version": predict reads these (or older)

# The run's config keys the sidecar carries: all that predict reads to prepare, tile and decide (and,
# not required of older sidecars, the tta its validation averaged: predict's note_checkpoint_settings).
EXPORT_KEYS = ("arch", "encoder_name", "in_channels", "num_classes", "image_size", "intensity_range",
               "data_mode", "patch_scale", "tile_overlap", "tile_batch_size")

CHECK_IMAGES = 4                 # the export check's batch: the run's first val images (else synthetic)
CHECK_SIZES = ((3, 5), (7, 2))   # its odd sizes in MODEL_STRIDE units (96x160, 224x64), beside image_size²

# The check's tolerance, fp32 on both sides: |onnxruntime - PyTorch| <= ATOL + RTOL * max |PyTorch logit|.
# Two correct fp32 runs differ by rounding (other convolution algorithms, other summation orders): about
# 1e-5 on Unet/resnet18. A wrong export (a weight lost, a size-dependent step traced as a constant)
# differs by 0.1 to 1. The bound sits two orders of magnitude from each.
LOGIT_ATOL = 1e-3
LOGIT_RTOL = 1e-4


def export(opts):
    """The `export` command: a checkpoint -> <output>.onnx and its sidecar <output>.json, written only
    if onnxruntime's logits match PyTorch's (check_export). Returns {'onnx', 'sidecar', 'check'}."""
    opts = check_command_dict(opts, EXPORT_CONFIG)
    check_types(opts, EXPORT_CONFIG)
    check_paths_given(opts, EXPORT_CONFIG)
    onnx_modules("onnxruntime", "onnx")
    hw = detect_hardware("cpu")  # the check compares strict fp32 on the CPU, both sides
    check_not_exported(opts["checkpoint"], "give the PyTorch checkpoint (.pt) to export", "already ")
    model, cfg = load_model(opts["checkpoint"], hw)
    path = export_path(opts["output"])
    check_not_in_a_data_set(path.parent, "output", f"{path.name} and {path.stem}.json", "deploy")
    check_writable(path.parent)
    print(f"export: {opts['checkpoint']}{ema_words(cfg)} ({cfg['arch']}/{cfg['encoder_name']}, {cfg['in_channels']} "
          f"channel(s), {cfg['num_classes']} class(es), data_mode={cfg['data_mode']}) -> {path}: fp32, opset "
          f"{ONNX_OPSET}, dynamic batch, height and width ({input_sides(cfg).removeprefix('any ')})")
    tmp, side_tmp = (path.with_name(f".{name}.tmp{os.getpid()}") for name in (path.name, f"{path.stem}.json"))
    try:
        export_onnx(model, cfg, tmp)
        check = check_export(model, onnx_session(tmp, hw), cfg)
        try:
            write_json(side_tmp, sidecar(cfg, tmp, path.name, opts["checkpoint"], check, model.class_names))
        except OSError as exc:
            raise UserError(f"cannot write {path.with_suffix('.json')} ({exc.strerror or exc}): "
                            f"{write_fix(exc, 'output')}; nothing written or moved") from None
        there = [p.name for p in (path, path.with_suffix(".json")) if p.exists()] + earlier_partner(path)
        with interrupts_held():  # a Ctrl-C between the move and the renames would leave neither export there
            moved = archive_previous_run(path.parent, there)  # after the check and writes: a failed export moves none
            os.replace(side_tmp, path.with_suffix(".json"))
            os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
        side_tmp.unlink(missing_ok=True)
    if moved:
        print(f"the earlier {' and '.join(there)} moved to {moved}/")
    print(f"wrote {path} ({size_text(path.stat().st_size)}) and {path.with_suffix('.json')}; predict with it: "
          f"python train_unet.py predict backend=onnxruntime checkpoint={cli_value(path)} input=...")
    return {"onnx": path, "sidecar": path.with_suffix(".json"), "check": check}


def ema_words(cfg):
    """' (its EMA weights, ema_decay=...)' where load_model took a checkpoint's EMA weights, else ''."""
    return f" (its EMA weights, ema_decay={cfg['ema_decay']})" if cfg.get("ema_decay") is not None else ""


def earlier_partner(path):
    """[the .onnx an earlier sidecar of this name belongs to], where it is not `path` (m.onnx, for an export
    to m.ONNX: both write m.json, and the move of m.json alone left m.onnx without its sidecar), else []."""
    try:
        name = json.loads(path.with_suffix(".json").read_text()).get("onnx")
    except (OSError, ValueError, AttributeError):
        return []
    partner = path.with_name(name) if isinstance(name, str) and name and Path(name).name == name else None
    if partner is None or name == path.name or not partner.is_file():
        return []
    return [] if path.exists() and os.path.samefile(partner, path) else [name]  # one file where case is ignored


# Suffixes of files, not folders: export's output=x/model.pt made a folder of that name and put model.onnx in it
NOT_FOLDER_SUFFIXES = (".json", ".txt", ".pt", ".pth", ".ckpt", ".pb", ".ort", ".tflite", ".engine", ".bin", ".onx")


def export_path(output):
    """The .onnx file export's output= names (a folder: <folder>/model.onnx). Refused: a file name that is all
    suffix ('.onnx': predict would not take it as an .onnx), and one whose sidecar would be config.json, the
    record a training run keeps in its folder (a resume there would write over the sidecar), and a folder
    named like an .onnx file that is not there yet (output=x/model.onnx/ made x/model.onnx/model.onnx). A folder
    named so that is there is a folder, slash or not: output=x.onnx had moved it, and what it held, to previous/."""
    named_file = output.lower().endswith(".onnx") and not Path(output).is_dir()
    path = Path(output) if named_file else Path(output) / "model.onnx"
    file = output.rstrip("/" + os.sep)
    if file != output and file.lower().endswith(".onnx") and not Path(file).is_dir():
        raise UserError(f"output={output} names a folder {Path(file).name}/, where export would write {path}: give "
                        f"output={file} for the file, or a folder name without .onnx")
    if Path(output).suffix.lower() in NOT_FOLDER_SUFFIXES and not Path(output).is_dir():
        raise UserError(f"output={output} names a {Path(output).suffix} file, where export writes an .onnx file and "
                        f"its .json: give {Path(output).with_suffix('.onnx')}, or a folder")
    if path.suffix.lower() != ".onnx":
        raise UserError(f"output={output} names no file before .onnx: give {path.parent / 'model.onnx'}, or the "
                        f"folder {path.parent}")
    if path.with_suffix(".json").name in RUN_FILES:
        raise UserError(f"output={output} would write its sidecar as {path.with_suffix('.json')}, the name of a "
                        f"training run's record: choose another name ({path.parent / 'model.onnx'})")
    return path


def onnx_modules(*names):
    """onnxruntime (and onnx): imported here only, so training never needs them."""
    import importlib

    missing = [name for name in names if not module_found(name)]
    if missing:  # onnx builds the graph (export); onnxruntime runs it (export's check, backend=onnxruntime)
        who = "export and backend=onnxruntime need it" if missing == ["onnxruntime"] else \
            "export needs it" if missing == ["onnx"] else "export needs them"
        raise UserError(f"{' and '.join(missing)} not installed ({who}, training does not): pip install "
                        f"{' '.join(missing)}")
    return [importlib.import_module(name) for name in names]


def module_found(name):
    """Whether `name` imports (an import that fails, as a stand-in set to None in sys.modules does: not)."""
    import importlib

    try:
        importlib.import_module(name)
    except ImportError:
        return False
    return True


def export_onnx(model, cfg, path):
    """torch.onnx's TorchScript exporter (dynamo=False), fp32: it traces Unet at image_size and marks
    batch, height and width dynamic (any multiple of MODEL_STRIDE runs). Where it cannot export an
    architecture it says so here; where it traces one wrongly, check_export says so."""
    import onnx

    x = torch.zeros(2, cfg["in_channels"], cfg["image_size"], cfg["image_size"])
    dims = {0: "batch", 2: "height", 3: "width"}
    try:
        with warnings.catch_warnings(), native_stdout_silenced():
            warnings.simplefilter("ignore")  # its deprecation notice and tracer warnings: the check judges
            torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=ONNX_OPSET,
                              input_names=["image"], output_names=["logits"],
                              dynamic_axes={"image": dims, "logits": dims})
        onnx.checker.check_model(str(path), full_check=True)  # valid ONNX for other runtimes too
    except Exception as exc:  # the exporter's and the checker's errors share no base class
        if isinstance(exc, OSError) and exc.errno == errno.EFBIG:
            raise UserError(f"cannot write the ONNX model into {path.parent}: {file_size_limit_words()}; nothing "
                            f"written or moved") from None
        if isinstance(exc, OSError) and exc.errno in FULL_DISK:  # a disk, not the architecture
            raise UserError(f"cannot write the ONNX model into {path.parent} ({exc.strerror}): "
                            f"{write_fix(exc, 'output')}; nothing written or moved") from None
        raise UserError(f"torch.onnx cannot export arch={cfg['arch']} with encoder {cfg['encoder_name']} for "
                        f"any height and width ({type(exc).__name__}: {first_line(exc)}): Unet, UnetPlusPlus, "
                        f"FPN, Linknet, MAnet, DeepLabV3(Plus) and Segformer export") from None


@contextlib.contextmanager
def native_stdout_silenced():
    """File descriptor 1 to /dev/null meanwhile: the TorchScript exporter's C++ logging is on whatever
    verbose says (torch 2.14) and writes its whole graph to stdout when an export fails; the failure
    is then said in one line."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


@torch.inference_mode()
def check_export(model, session, cfg):
    """The exported model in onnxruntime against the checkpoint's in PyTorch, both fp32 on the CPU, on
    check_batches: the max |logit difference| and the share of pixels whose mask agrees. Raises a
    UserError past the tolerance (LOGIT_ATOL, LOGIT_RTOL); NaN fails too."""
    batches, source = check_batches(cfg)
    exported, diffs, scale, same, pixels = OnnxModel(session), [], 0.0, 0, 0
    for x in batches:
        want = model(x).float()
        try:
            got = exported(x)
        except Exception as exc:  # onnxruntime's run errors (InvalidArgument, Fail, ...) share no base class
            raise UserError(f"onnxruntime cannot run the exported model on a {tuple(x.shape)} batch "
                            f"({type(exc).__name__}: {first_line(exc)}): nothing written") from None
        if got.shape != want.shape:
            raise UserError(f"the exported model gives logits of shape {tuple(got.shape)} for input "
                            f"{tuple(x.shape)}, PyTorch {tuple(want.shape)}: this architecture does not export")
        diffs.append((got - want).abs().max().item())
        scale = max(scale, want.abs().max().item())
        for a, b in zip(want, got):
            same += int((logits_to_mask(a, cfg["num_classes"]) == logits_to_mask(b, cfg["num_classes"])).sum())
            pixels += a[0].numel()
    worst, tolerance = float(np.max(diffs)), LOGIT_ATOL + LOGIT_RTOL * scale
    sizes = ", ".join(f"{x.shape[2]}x{x.shape[3]}" for x in batches)
    check = {"inputs": f"{len(batches[0])} {source} at {sizes}", "max_abs_logit_difference": worst,
             "tolerance": tolerance, "mask_agreement": same / pixels, "pixels": pixels}
    print(f"check: onnxruntime vs PyTorch, fp32 on the CPU, {check['inputs']}: max |logit difference| "
          f"{worst:.2e} (tolerance {tolerance:.1e}), masks agree on {same / pixels:.4%} of {pixels:,} pixels")
    if not worst <= tolerance:
        raise UserError(f"the exported model does not match {cfg['arch']}/{cfg['encoder_name']} in PyTorch: max "
                        f"|logit difference| {worst:.3g} > {tolerance:.1e} (masks agree on {same / pixels:.2%}); "
                        f"nothing written: torch.onnx does not export this model faithfully (Unet/resnet18 "
                        f"differs by about 1e-5)")
    return check


def check_batches(cfg):
    """The check's inputs, as predict prepares them (read_image, normalizer): up to CHECK_IMAGES images
    resized to image_size² and to each of CHECK_SIZES, one batch per size; and where they came from."""
    images, source = check_images(cfg)
    normalize = normalizer(cfg)
    least = smallest_model_side(cfg) or MODEL_STRIDE  # PAN: 128, so 224x64 becomes 224x128
    sizes = [(cfg["image_size"],) * 2] + [(max(least, h * MODEL_STRIDE), max(least, w * MODEL_STRIDE))
                                          for h, w in CHECK_SIZES]
    return [torch.stack([image_tensor(normalize(cv2.resize(image, (w, h), interpolation=cv2.INTER_AREA)))
                         for image in images]) for h, w in sizes], source


def check_images(cfg):
    """The run's first val images (split_pairs), read as predict reads them; synthetic shapes where its
    data_dir cannot be read from here."""
    try:
        pairs = split_pairs(cfg)[1][:CHECK_IMAGES]
        images = [read_image(image, cfg["in_channels"], cfg["intensity_range"]) for image, _ in pairs]
        return images, f"val image(s) of {cfg['data_dir']}"
    except (UserError, OSError):
        rng = np.random.default_rng(cfg["seed"])
        images = [draw_shapes(rng, cfg["image_size"], cfg["num_classes"])[0] for _ in range(CHECK_IMAGES)]
        return [to_channels(image, cfg["in_channels"], "synthetic") for image in images], \
            f"synthetic image(s) ({cfg['data_dir']} not readable here)"


def sidecar(cfg, onnx_file, name, checkpoint, check, class_names=None):
    """The sidecar JSON: what predict needs beside the graph (the run's EXPORT_KEYS, the preprocessing,
    the mask rule, class names), which .onnx it belongs to (SHA-256), and how the export was checked. The
    class names are the checkpoint's: read from the data folder's class_names.txt at export, they were
    indices where the data had moved (a deploy machine), an edit made since, or a refusal of a broken file
    the model never read; a checkpoint from before they were saved: the data folder's."""
    import onnxruntime

    return {"format": EXPORT_FORMAT[0], "version": EXPORT_FORMAT[1], "onnx": name,
            "onnx_sha256": file_sha256(onnx_file), "onnx_bytes": Path(onnx_file).stat().st_size,
            "input": {"name": "image", "dtype": "float32", "shape": ["batch", cfg["in_channels"], "height", "width"],
                      "height_width": input_sides(cfg)},
            "output": {"name": "logits", "dtype": "float32", "shape": ["batch", cfg["num_classes"], "height", "width"]},
            "mask": mask_rule_words(cfg), "class_names": class_names or load_class_names(cfg),
            "preprocessing": preprocessing(cfg),
            "config": {**{key: cfg[key] for key in EXPORT_KEYS}, "tta": cfg["tta"]}, "check": check,
            "exported_from": str(checkpoint), "exported_from_file": file_identity(checkpoint),
            "exported": datetime.datetime.now().isoformat(timespec="seconds"),
            "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "opset": ONNX_OPSET}}


def mask_rule_words(cfg):
    """The sidecar's word on how logits become a mask (mask_rule: logit > 0, else argmax)."""
    if cfg["num_classes"] == 1:
        return {"rule": "threshold", "logit": 0.0, "values": [0, 255]}
    return {"rule": "argmax", "axis": 1, "values": "class indices"}


def edited_sidecar_numbers(meta, cfg):
    """The sidecar's entries, of those predict does not read (the preprocessing's numbers, the mask rule),
    whose values differ from what its config gives: edited by hand, and ignored. Only the keys the sidecar
    holds are compared, so an older export's fewer keys are not taken for an edit."""
    made = json.loads(json.dumps({"mask": mask_rule_words(cfg), **preprocessing(cfg)}))  # as JSON keeps them
    given = meta.get("preprocessing") if isinstance(meta.get("preprocessing"), dict) else {}
    held = {"mask": meta.get("mask"), **{k: given.get(k) for k in ("to_unit_range", "normalize")}}
    edited = []
    for key, section in held.items():
        for inner, value in (section.items() if isinstance(section, dict) else ()):
            if made[key].get(inner, value) != value:
                edited.append(f"{'' if key == 'mask' else 'preprocessing.'}{key}.{inner}")
    return edited


def input_sides(cfg):
    """The heights and widths the exported graph takes, in words: multiples of MODEL_STRIDE, from the
    smallest the model takes (smallest_model_side: PAN's 32 px failed in onnxruntime, unsaid)."""
    least = smallest_model_side(cfg) or MODEL_STRIDE
    return f"any multiples of {MODEL_STRIDE}" + (f", each at least {least}" if least > MODEL_STRIDE else "")


# What pads an image (fit_transforms, pad_to, on scale_image's output): 0 in the [0, 1] range to_unit_range
# gives (an 8-bit pixel of 0; a wider image's range low end), before normalize
PAD_WORDS = "0 after to_unit_range, before normalize (not 0 after normalize)"


def preprocessing(cfg):
    """How predict turns an image file into the model's input, for other runtimes: the numbers are those
    of the functions predict calls (normalizer's, the run's intensity_range); tests check them against
    read_image and normalizer."""
    normalize = normalizer(cfg).by_dtype[np.dtype(np.uint8)]
    size = cfg["image_size"]
    geometry = ({"mode": "fit", "resize": f"longest side to {size} (bilinear; an 8-bit image as uint8, rounded, "
                                          f"and to_unit_range after; a wider or float one after to_unit_range, in "
                                          f"float32), then pad bottom and right with {PAD_WORDS} to {size}x{size}",
                 "back": "crop the image's area from the logits, resize them bilinearly to the image's size"}
                if cfg["data_mode"] == "fit" else
                {"mode": "patch", "resize": f"by patch_scale ({cfg['patch_scale']:g})",
                 "tiles": f"{size}x{size}, overlap tile_overlap ({cfg['tile_overlap']:g}), blended with Gaussian "
                          f"weights (sigma = tile / 8); an image smaller than a tile is padded bottom/right "
                          f"with {PAD_WORDS}",
                 "back": "resize the logits bilinearly to the image's size"})
    return {"channels": "RGB" if cfg["in_channels"] == 3 else "gray (RGB averaged by luminance)",
            "to_unit_range": {"uint8": [0, normalize.max_pixel_value],
                              "wider integers": cfg["intensity_range"] or "the dtype's [min, max]",
                              "float": "each image's own [min, max]"},
            "normalize": {"mean": list(normalize.mean), "std": list(normalize.std)}, "geometry": geometry}


def file_sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def check_not_exported(checkpoint, fix, already=""):
    """checkpoint= a PyTorch checkpoint, not a training run's config.json (check_not_run_record) nor an
    exported .onnx or its .json sidecar, which load_checkpoint called cut short in a copy."""
    check_not_run_record(checkpoint)
    if Path(checkpoint).suffix.lower() in (".onnx", ".json"):
        raise UserError(f"checkpoint={checkpoint} is {already}an exported model: {fix}")


def check_not_run_record(path, exported=False):
    """checkpoint= naming the config.json a training run writes (a .json, as an export's sidecar is) gets
    the checkpoint beside it: predict called it an exported model, and with backend=onnxruntime added, as
    told, 'not a sidecar... export again'. `exported`: backend=onnxruntime, which needs that checkpoint's
    export."""
    path = Path(path)
    if path.suffix.lower() != ".json" or not path.is_file() or path.stat().st_size > 2**20:  # a record is a few kB
        return
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return  # not a run's record: the sidecar check says what it is
    if isinstance(record, dict) and "format" not in record and isinstance(record.get("config"), dict) \
            and "world_size" in record:
        model = next((path.parent / n for n in ("best.pt", "last.pt") if (path.parent / n).is_file()), None)
        given = f"checkpoint={cli_value(model)}" if model else "the run's best.pt or last.pt"
        raise UserError(f"checkpoint={path} is the config.json a training run writes, not a model: give "
                        + (f"the model.onnx that python train_unet.py export {given if model else 'checkpoint=...'} "
                           f"writes" if exported else given))


def load_exported(path, hw):
    """predict backend=onnxruntime: (OnnxModel, the run's cfg from the sidecar). Neither the .pt nor
    segmentation_models_pytorch is needed."""
    ort, = onnx_modules("onnxruntime")
    onnx_path, meta = read_sidecar(Path(path))
    saved = {key: value for key, value in meta["config"].items() if key in CONFIG}
    missing = [key for key in EXPORT_KEYS if key not in saved]
    if missing:
        raise UserError(f"{onnx_path.with_suffix('.json').name} lacks {', '.join(missing)}, which predict needs: "
                        f"export again")
    try:
        cfg = validate_config({**CONFIG, **saved}, model_names=False)
    except UserError as exc:  # an edited sidecar: its key is not one of predict's options to change
        raise UserError(f"{onnx_path.with_suffix('.json')} holds settings predict refuses ({exc}): export again "
                        f"rather than edit it") from None
    cfg["tta"] = saved.get("tta")  # the views its validation averaged (note_checkpoint_settings); None: not kept
    edited = edited_sidecar_numbers(meta, cfg)
    if edited:
        print(f"note: {onnx_path.with_suffix('.json').name}'s {', '.join(edited)} differ from what its config gives "
              f"(edited by hand?): predict goes by its config, as the model was trained, not by those, so the masks "
              f"are as without the edit; export again to make them agree")
    model = OnnxModel(onnx_session(onnx_path, hw))
    check_sidecar_matches(model.session, cfg, onnx_path)
    where = ", ".join(model.session.get_providers())
    if hw.kind == "cuda" and "CUDAExecutionProvider" not in where:
        where += " (this onnxruntime has no CUDA provider: pip install onnxruntime-gpu for the GPU)"
    print(f"onnxruntime {ort.__version__} on {where}: {onnx_path}, exported from {meta.get('exported_from')}"
          + source_since(meta.get("exported_from_file")))
    return model, cfg


def file_identity(path):
    """{'path': absolute, 'size', 'mtime_ns'} of an export's checkpoint: the sidecar's way to tell, later,
    whether that file is still the one exported (a new run in its folder writes another best.pt there)."""
    stat = os.stat(path)
    return {"path": os.path.abspath(path), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def source_since(identity):
    """'' where the exported checkpoint is as it was, or not here (or the sidecar, from before file_identity,
    cannot tell), else that it has changed: the export keeps the model it had, whatever the file holds now."""
    if not isinstance(identity, dict) or not isinstance(identity.get("path"), str):
        return ""
    try:
        stat = os.stat(identity["path"])
    except OSError:  # not here: an export copied to the machine it serves on, as export is for
        return ""
    if [stat.st_size, stat.st_mtime_ns] != [identity.get("size"), identity.get("mtime_ns")]:
        return " (changed since the export, as by a later run in its folder: this export keeps the model it held then)"
    return ""


def check_sidecar_matches(session, cfg, onnx_path):
    """The sidecar's in_channels and num_classes against the .onnx's own input and output channels (a
    sidecar edited by hand, num_classes=3 for a binary model, gave all-0 masks, exit 0)."""
    pairs = (("in_channels", session.get_inputs()[0].shape, cfg["in_channels"]),
             ("num_classes", session.get_outputs()[0].shape, max(1, cfg["num_classes"])))
    for key, shape, said in pairs:
        held = shape[1] if len(shape) == 4 else None
        if isinstance(held, int) and held != said:
            raise UserError(f"{onnx_path.with_suffix('.json').name} says {key}={cfg[key]} but {onnx_path.name} has "
                            f"{held} {'input' if key == 'in_channels' else 'output'} channel(s): the two files are "
                            f"of different exports, or the .json was edited: export again")


def read_sidecar(path):
    """(the .onnx file, its sidecar) from either path, or from export's folder (its model.json, which names
    the .onnx: output=folder/model.ONNX was looked for as model.onnx; else its model.onnx); refuses a
    sidecar of another model."""
    if path.is_dir():  # export output=folder/ writes folder/model.onnx and folder/model.json
        path = path / "model.json" if (path / "model.json").is_file() else path / "model.onnx"
    if path.suffix.lower() not in (".onnx", ".json"):
        if not path.exists():  # the export's advice would name a file that is not there
            raise UserError(f"checkpoint={path} not found: give the .onnx file (or the folder) export wrote")
        raise UserError(f"backend=onnxruntime runs an exported model: give checkpoint=model.onnx (python "
                        f"train_unet.py export checkpoint={path} writes it)")
    check_not_run_record(path, exported=True)
    sidecar_path = path.with_suffix(".json")
    if not path.exists() and not sidecar_path.exists():  # a typo in the path, not a lost sidecar
        raise UserError(f"checkpoint={path} not found: give the .onnx file (or the folder) export wrote")
    if not sidecar_path.is_file():
        raise UserError(f"{sidecar_path} not found: export writes it beside {path.with_suffix('.onnx').name}, "
                        f"and predict needs the preprocessing it holds; export again")
    try:
        meta = json.loads(sidecar_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise UserError(f"{sidecar_path} is not readable JSON ({type(exc).__name__}): export again") from None
    meta = meta if isinstance(meta, dict) else {}
    version = meta.get("version")
    if meta.get("format") != EXPORT_FORMAT[0] or not isinstance(version, int) or version > EXPORT_FORMAT[1] \
            or not isinstance(meta.get("config"), dict):
        raise UserError(f"{sidecar_path} is not a sidecar this version of train_unet.py reads: export again")
    onnx_path = path if path.suffix.lower() == ".onnx" else sidecar_path.parent / str(meta.get("onnx"))
    if not onnx_path.is_file():
        twin = path.with_suffix(".onnx")  # a pair renamed: its sidecar still names the .onnx export wrote
        raise UserError(f"exported model {onnx_path} not found (its name in {sidecar_path.name})"
                        + (f": give checkpoint={twin}" if path != twin and twin.is_file() else ""))
    if file_sha256(onnx_path) != meta.get("onnx_sha256"):
        raise onnx_not_its_sidecars(onnx_path, sidecar_path, meta)
    return onnx_path, meta


def onnx_not_its_sidecars(onnx_path, sidecar_path, meta):
    """The UserError for an .onnx whose SHA-256 is not the one its sidecar records: another export's .onnx
    beside this sidecar where onnxruntime loads it (a smaller one, a patch-mode model's beside a fit-mode
    sidecar, was called cut short), else cut short (fewer bytes than export wrote: an interrupted copy), else
    damaged (a sidecar from before onnx_bytes)."""
    size, wrote = onnx_path.stat().st_size, meta.get("onnx_bytes")
    ort, = onnx_modules("onnxruntime")
    quiet = ort.SessionOptions()
    quiet.log_severity_level = 3  # errors only: a damaged graph's warnings would come before the one line
    try:
        ort.InferenceSession(str(onnx_path), quiet, providers=["CPUExecutionProvider"])
    except Exception as exc:  # noqa: BLE001 - onnxruntime's load errors share no base class (onnx_session)
        if isinstance(wrote, int) and size < wrote:
            return UserError(f"{onnx_path} is cut short: {size} of the {wrote} bytes export wrote (an interrupted "
                             f"copy?): copy it again from where it was exported, or export again")
        return UserError(f"{onnx_path} is damaged ({type(exc).__name__}: {first_line(exc)}), and its SHA-256 is not "
                         f"the one {sidecar_path.name} records: copy it again from where it was exported, or export "
                         f"again")
    return UserError(f"{sidecar_path} belongs to another {onnx_path.name} (its SHA-256 differs): keep the two files "
                     f"of one export together, or export again")


def onnx_session(path, hw):
    """An onnxruntime session of an .onnx file: the CUDA provider where hw is a GPU and this onnxruntime
    has one (the onnxruntime-gpu package), else the CPU; as many threads as torch uses."""
    ort, = onnx_modules("onnxruntime")
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    cuda = hw.kind == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers()
    gpu = ("CUDAExecutionProvider", {"device_id": torch.device(hw.device).index or 0})  # device=cuda:1: GPU 1
    try:
        return ort.InferenceSession(str(path), options, providers=[gpu] * cuda + ["CPUExecutionProvider"])
    except Exception as exc:  # onnxruntime's load errors (InvalidProtobuf, Fail, ...) share no base class
        raise UserError(f"onnxruntime cannot load {path} ({type(exc).__name__}: {first_line(exc)}): "
                        f"export it again") from None


class OnnxModel:
    """An exported model, called where predict calls the torch module: a float32 NCHW batch in, its
    fp32 logits out, on the batch's device (the same predict code runs either backend)."""

    def __init__(self, session):
        self.session = session
        self.input, self.output = session.get_inputs()[0].name, session.get_outputs()[0].name

    def __call__(self, x):
        logits = self.session.run([self.output], {self.input: x.detach().float().cpu().numpy()})[0]
        return torch.from_numpy(logits).to(x.device)


if __name__ == "__main__":
    try:
        code = main()
        exit_at_next_interrupt(code)
        sys.exit(code)
    except BrokenPipeError:  # output piped into `head` or `less` that stopped reading: no traceback for it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit would fail too
        sys.exit(1)
