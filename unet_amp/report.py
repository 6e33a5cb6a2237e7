"""What a run shows and writes: progress bars, the banner, one line per epoch, history.csv, TensorBoard,
summary.json. Only rank 0 reports; the device's figures reach the host once per epoch."""
from __future__ import annotations

import csv
import io
import statistics
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from unet_amp.common import atomic_write_json, atomic_write_text, say
from unet_amp.config import format_config
from unet_amp.distributed import DIST

HISTORY_COLUMNS = ("epoch", "precision", "train_loss", "val_loss", "val_iou", "val_dice", "lr", "epoch_s",
                   "train_s", "images_per_s", "peak_memory_mb", "skipped_steps", "grad_norm")


def progress(iterable, desc, enabled):
    """A tqdm bar on rank 0 when progress=True; the plain iterable otherwise."""
    if not enabled or not DIST.is_main:
        return iterable
    return tqdm(iterable, desc=desc, leave=False, dynamic_ncols=True, file=sys.stderr)


def peak_memory_mb(hw):
    """The epoch's peak: the GPU's allocator on CUDA, the process's resident set elsewhere."""
    if hw.kind == "cuda":
        return torch.cuda.max_memory_allocated(hw.device) / 2**20
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    except ImportError:
        return float("nan")


def reset_peak_memory(hw):
    if hw.kind == "cuda":
        torch.cuda.reset_peak_memory_stats(hw.device)


def banner(cfg, hw, prec, notes):
    """What was decided, and why: the device, the precision and layout, then the whole effective config."""
    native = f"native bf16: {'yes' if hw.bf16_native else 'no'}, native fp16: {'yes' if hw.fp16_native else 'no'}"
    lines = ["=" * 78, f"device     {hw.kind} ({hw.name})  {native}",
             f"precision  {prec.name} ({prec.reason}); GradScaler {'on' if prec.needs_scaler else 'off'}",
             f"layout     {'channels_last (NHWC)' if prec.channels_last else 'NCHW'}; "
             f"compile {'on' if cfg['compile_model'] else 'off'}"]
    lines += [f"note       {n}" for n in notes if n]
    return "\n".join(lines + ["=" * 78, "config:", format_config(cfg)])


class RunLog:
    """history.csv (rewritten whole each epoch, atomically), TensorBoard scalars and the epoch line."""

    def __init__(self, cfg, history):
        self.folder, self.rows = Path(cfg["checkpoint_dir"]), list(history)
        self.tb = tensorboard_writer(cfg, self.folder) if DIST.is_main else None

    def epoch(self, row, epochs, best):
        self.rows.append(row)
        if not DIST.is_main:
            return
        text = io.StringIO()
        writer = csv.DictWriter(text, HISTORY_COLUMNS, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(self.rows)
        atomic_write_text(self.folder / "history.csv", text.getvalue())
        if self.tb is not None:
            for key in HISTORY_COLUMNS[2:]:
                self.tb.add_scalar(key, row[key], row["epoch"])
            self.tb.flush()
        say(epoch_line(row, epochs, best))

    def close(self):
        if self.tb is not None:
            self.tb.close()


def tensorboard_writer(cfg, folder):
    """A SummaryWriter under <checkpoint_dir>/tb, or None (logger=csv|none, or TensorBoard not installed)."""
    if cfg["logger"] in ("csv", "none"):
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        if cfg["logger"] == "tensorboard":
            raise
        return None
    return SummaryWriter(str(folder / "tb"))


def epoch_line(row, epochs, best):
    return (f"epoch {row['epoch']:>3}/{epochs} | train loss {row['train_loss']:.4f} | val loss {row['val_loss']:.4f} "
            f"IoU {row['val_iou']:.4f} Dice {row['val_dice']:.4f} | lr {row['lr']:.2e} | {row['epoch_s']:.1f}s "
            f"{row['images_per_s']:.1f} img/s | peak {row['peak_memory_mb']:.0f} MB | {row['precision']}"
            f"{' | skipped ' + str(row['skipped_steps']) if row['skipped_steps'] else ''}{' | best' if best else ''}")


def write_summary(run, hw, seconds):
    """summary.json: the run in one record (the benchmark and the notebooks read it)."""
    rows = run.history
    summary = {"best_iou": run.best_iou, "best_epoch": run.best_epoch, "epochs_run": len(rows),
               "precision": run.prec.name, "channels_last": run.prec.channels_last, "device": hw.kind,
               "device_name": hw.name, "total_s": seconds,
               "median_epoch_s": statistics.median(r["epoch_s"] for r in rows) if rows else None,
               "median_images_per_s": statistics.median(r["images_per_s"] for r in rows) if rows else None,
               "peak_memory_mb": max((r["peak_memory_mb"] for r in rows), default=None),
               "fallbacks": run.fallbacks, "config": run.cfg}
    if DIST.is_main:
        atomic_write_json(Path(run.cfg["checkpoint_dir"]) / "summary.json", summary)
    return summary
