"""
unet-amp: train a U-Net segmentation model with mixed precision done right.

    python train_unet.py                              # train with CONFIG below
    python train_unet.py batch_size=2 epochs=3        # override any CONFIG key
    python train_unet.py preset=debug                 # a named set of overrides (PRESETS below)
    python train_unet.py resume=True epochs=20        # continue checkpoints/last.pt exactly (or extend it)
    python train_unet.py predict checkpoint=checkpoints/best.pt input=photos/ output=masks_out/
    python train_unet.py export checkpoint=checkpoints/best.pt    # model.onnx + model.json
    python train_unet.py benchmark                    # FP32 vs BF16 (and more), one process each
    torchrun --nproc_per_node=8 train_unet.py         # several GPUs

The file reads in the order it runs: CONFIG and PRESETS, the precision decision, main, the set-up in
numbered steps, the epoch loop, the training step, evaluate. The machinery lives in unet_amp/.
"""
from __future__ import annotations

import importlib
import math
import os
import random
import shlex
import signal
import sys
import time
import warnings

import numpy as np
import torch

from unet_amp import checkpoint, config, data, distributed, images, metrics, patches, precision, report, safety
from unet_amp import model as models
from unet_amp.common import atomic_write_json, run_guarded, say
from unet_amp.distributed import DIST

# The schedule counts attempted optimizer steps, skipped ones too (GradScaler, the guard): expected, not a bug.
warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")

# -----------------------------------------------------------------------------------------------------
# CONFIG: the defaults. Edit here, or override any key on the command line as key=value.
# -----------------------------------------------------------------------------------------------------
CONFIG = {
    "preset": None,                # None | "fast" | "stable" | "low_memory" | "debug" (PRESETS below)
    # data
    "data_dir": "data/shapes",     # <data_dir>/images + /masks (or train/ and val/ inside); shapes is embedded
    "image_size": 128,             # training side length, a multiple of 32 (the U-Net halves it 5 times)
    "in_channels": 3,              # 3 = RGB (grayscale images are repeated), 1 = grayscale
    "num_classes": 1,              # 1 = binary (masks 0/1 or 0/255); N > 1 = class indices, 255 = void
    "val_fraction": 0.2,           # used when <data_dir> has no train/ and val/ folders
    "max_train_images": None,      # None = all; N = a quick run on the first N
    "num_workers": None,           # data loader processes; None = auto
    "intensity_range": None,       # images wider than 8 bits: low,high mapped to 0..1; None = learnt from training
    # large images: "fit" resizes each image to image_size; "patch" trains on patches, validates whole images
    "data_mode": "fit",            # "fit" | "patch"
    "patch_scale": 1.0,            # patch mode: resize images by this factor first (1.0 = native resolution)
    "tile_overlap": 0.25,          # sliding window (patch mode): overlap of neighbouring tiles
    # model
    "arch": "Unet",                # any segmentation_models_pytorch architecture
    "encoder_name": "resnet18",
    "encoder_weights": None,       # None = random init, offline; "imagenet" downloads weights
    "loss": "dice+ce",             # terms joined by +: ce (BCE when binary), dice, focal, lovasz, tversky
    "class_weights": None,         # CE/focal weights: None, "auto" (inverse class frequency) or one per class
    # optimisation
    "epochs": 10,
    "batch_size": 8,               # or "auto": on CUDA the largest batch that fits, minus headroom
    "accumulation_steps": 1,       # effective batch = batch_size * accumulation_steps
    "learning_rate": 2e-3,
    "weight_decay": 1e-4,
    "warmup_fraction": 0.05,       # linear warm-up, then cosine decay, per optimizer step
    "grad_clip_norm": 1.0,         # None = no clipping (the norm is still measured)
    "ema_decay": None,             # None = off; e.g. 0.99: validation, best.pt and predict use the EMA weights
    "early_stopping_patience": 5,  # epochs without a better val IoU; None = off
    "seed": 42,
    # precision and speed
    "device": "auto",              # "auto", "cpu", "cuda", "cuda:1", "mps"
    "use_amp": True,               # False = plain fp32
    "amp_dtype": "auto",           # "auto" | "bfloat16" | "float16" (fp16 gets a GradScaler)
    "channels_last": "auto",       # NHWC memory layout: "auto" (where it is faster), True, False
    "cpu_probe": True,             # CPU: confirm bf16 and the layout by a short timed probe (cached)
    "compile_model": False,        # torch.compile: for GPUs; a CPU pays a minute for little gain
    "tf32_matmul_precision": None, # None | "highest" | "high" | "medium": TF32 for fp32 matmuls/convolutions
                                   # on Ampere+ (None = PyTorch's default); nothing under autocast
    "tta": "none",                 # validation and predict: "none" | "flip" (4 views) | "d4" (8 views)
    # numerical safety
    "nan_guard": True,             # skip non-finite steps; nan_patience in a row: fp16 -> bf16 -> fp32, rolled back
    "nan_patience": 3,
    "detect_anomaly": False,       # names the op whose backward made NaN/inf (slow; debugging)
    # output
    "checkpoint_dir": "checkpoints",
    "resume": False,               # continue from <checkpoint_dir>/last.pt
    "progress": True,              # tqdm bars
    "logger": "auto",              # "auto" (TensorBoard when installed) | "tensorboard" | "csv" | "none"
}

# Presets: named overrides. CONFIG < preset < key=value on the command line.
PRESETS = {
    # daily experiments on a GPU: bf16 (or fp16 + GradScaler), NHWC, torch.compile
    "fast": {"use_amp": True, "amp_dtype": "auto", "channels_last": True, "compile_model": True},
    # the final model, or after NaN trouble: fp32, no compile, clipping and the guard
    "stable": {"use_amp": False, "compile_model": False, "grad_clip_norm": 1.0, "nan_guard": True},
    # small GPUs: AMP halves activation memory; 4 x 2 accumulation keeps the effective batch of 8
    "low_memory": {"use_amp": True, "batch_size": 4, "accumulation_steps": 2, "compile_model": False},
    # find a bug in seconds: tiny fp32 run in the main process, anomaly detection, the first NaN stops
    "debug": {"batch_size": 2, "use_amp": False, "compile_model": False, "channels_last": False,
              "max_train_images": 8, "epochs": 2, "num_workers": 0, "detect_anomaly": True, "nan_patience": 1,
              "early_stopping_patience": None},
}


# -----------------------------------------------------------------------------------------------------
# The capability check: which precision this hardware trains in. Detection lives in unet_amp/precision.py.
# -----------------------------------------------------------------------------------------------------
def choose_dtype(cfg, hw):
    """(dtype, why): bf16 where it is native (fp32's range, no loss scaling), fp16 + GradScaler where only fp16
    is (CUDA 7.x), else fp32. A dtype asked for by name runs where the hardware can run it at all."""
    if not cfg["use_amp"]:
        return "float32", "use_amp=False"
    wanted = cfg["amp_dtype"]
    if wanted == "auto":
        if hw.bf16_native:
            return "bfloat16", "auto: native bf16"
        if hw.fp16_native and hw.kind == "cuda":
            return "float16", f"auto: bf16 needs compute capability 8.0, this GPU has {hw.capability}"
        return "float32", "auto: no native bf16 or fp16 here"
    if hw.kind == "cuda" and not precision.capability_ok(hw.capability, getattr(torch, wanted)):
        return "float32", f"amp_dtype={wanted} needs a newer GPU than compute capability {hw.capability}"
    slow = "" if (wanted == "bfloat16" and hw.bf16_native) or (wanted == "float16" and hw.fp16_native) else \
        " (no native kernels here: slow)"
    return wanted, f"amp_dtype={wanted}{slow}"


def choose_precision(cfg, hw, probe):
    """The Precision: the dtype rule above, confirmed on a CPU by the timed probe; NHWC on CUDA with AMP."""
    dtype, why = choose_dtype(cfg, hw)
    layout = cfg["channels_last"]
    if probe is not None:  # a CPU's "native" is not always faster: the probe's measured answer decides
        if dtype == "bfloat16" and cfg["amp_dtype"] == "auto" and probe["dtype"] == "float32":
            dtype, why = "float32", "auto: bf16 measured slower than needed here (CPU probe)"
        if layout == "auto":
            layout = probe["channels_last"] if probe["dtype"] == dtype else False
    if layout == "auto":
        layout = hw.kind == "cuda" and dtype != "float32"  # tensor cores prefer NHWC
    return precision.precision_for(dtype, bool(layout), why)


def main(argv=None):
    """`python train_unet.py [command] key=value ...`: the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    command = argv.pop(0) if argv and "=" not in argv[0] and not argv[0].startswith("-") else "train"
    wants_help = bool({"-h", "--help", "help"} & {command, *argv})
    command = "train" if command == "help" else command
    if command not in ("train", *COMMANDS):
        print(f"error: {command}: unknown command; use train (the default), {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, stop_as_interrupt)  # a scheduler's SIGTERM stops the run as Ctrl-C does
    if command == "train":
        if wants_help:
            print(__doc__.strip() + "\n\nkeys and defaults (CONFIG):\n" + config.format_config(CONFIG))
            return 0
        return run_guarded(lambda: train(argv) and 0)
    module = importlib.import_module(f"unet_amp.{command}")  # loaded only when asked for
    if wants_help:
        print(f"python train_unet.py {command} key=value ...\n\nkeys and defaults:\n"
              + config.format_config(getattr(module, COMMANDS[command])))
        return 0
    return run_guarded(lambda: module.main(argv))


COMMANDS = {"predict": "PREDICT_CONFIG", "export": "EXPORT_CONFIG", "benchmark": "BENCHMARK_CONFIG"}  # their keys


def stop_as_interrupt(signum, frame):
    raise KeyboardInterrupt


# -----------------------------------------------------------------------------------------------------
# Train: set-up in numbered steps, then the epoch loop.
# -----------------------------------------------------------------------------------------------------
def train(overrides=()):
    """Train with CONFIG and `overrides` (key=value texts, or a dict in a notebook); returns the summary."""
    started = time.time()
    # 1. The effective config: CONFIG < preset < command line; a resumed run's own settings; the device.
    cfg, typed = config.train_config(CONFIG, PRESETS, overrides)
    state = checkpoint.resume_state(cfg)
    cfg = checkpoint.resumed_config(cfg, typed, state)
    hw = precision.detect_hardware(precision.resolve_device(cfg["device"]))
    distributed.setup(hw.kind)
    try:
        return train_in_process(cfg, hw, state, typed, started)
    except KeyboardInterrupt:
        raise KeyboardInterrupt(stopped_words(cfg)) from None
    finally:
        distributed.cleanup()


def stopped_words(cfg):
    """What a stopped run leaves, and the command that continues it."""
    if not os.path.exists(f"{cfg['checkpoint_dir']}/last.pt"):
        return "no epoch had finished, so there is nothing to resume: train again"
    folder = cfg["checkpoint_dir"]
    where = "" if folder == CONFIG["checkpoint_dir"] else f" checkpoint_dir={shlex.quote(folder)}"
    return f"last.pt is intact: resume=True{where} continues the run"


def train_in_process(cfg, hw, state, typed, started):
    """Steps 2-6 of the set-up, then the epoch loop, in this process (one of several under torchrun)."""
    precision.set_tf32(cfg["tf32_matmul_precision"])
    seed_everything(cfg["seed"])
    # 2. The data: found, paired, split and checked once; its intensity range and class weights are the run's.
    if cfg["data_dir"] == data.SHAPES_DIR:  # the embedded data set, written the first time it is used
        data.ensure_shapes_dataset(cfg["data_dir"])
    train_pairs, val_pairs = data.split_pairs(cfg)
    info = data.check_data(train_pairs, val_pairs, cfg)
    weights = data.class_weights_from(info["class_counts"]) if cfg["class_weights"] == "auto" else cfg["class_weights"]
    cfg = {**cfg, "intensity_range": info["intensity_range"], "class_weights": weights}
    # 3. Batch size, loaders, then the precision, decided from the whole config (a resumed run keeps its own).
    cfg = {**cfg, "batch_size": resolve_batch_size(cfg, hw, len(train_pairs))}
    train_loader, val_loader = data.make_loaders(train_pairs, val_pairs, cfg, hw, info)
    job_steps = (cfg["epochs"] - (state["epoch"] if state else 0)) * len(train_loader)
    prec = resumed_precision(state, typed)
    probe = cpu_probe(cfg, hw, job_steps) if prec is None else None
    prec = prec or choose_precision(cfg, hw, probe)
    # 4. Model, optimizer, schedule, GradScaler (fp16 only), EMA: new, or resumed exactly; the loss.
    run = build_run(cfg, hw, prec, math.ceil(len(train_loader) / cfg["accumulation_steps"]))
    if state is not None:
        run.load(state)
    elif DIST.is_main:
        checkpoint.archive_previous_run(cfg["checkpoint_dir"])  # a new run never overwrites an earlier one
    if DIST.is_main:
        atomic_write_json(f"{cfg['checkpoint_dir']}/config.json", cfg)
    loss_fn = models.build_loss(cfg, cfg["class_weights"], hw.device)
    # 5. Say what was decided, and why.
    say(report.banner(cfg, hw, prec, notes(cfg, state, probe, info, len(train_pairs), len(val_pairs))))
    # 6. The epoch loop.
    log = report.RunLog(cfg, run.history)
    try:
        epoch_loop(run, loss_fn, (train_loader, val_loader), hw, log)
    finally:
        log.close()
    summary = report.write_summary(run, hw, time.time() - started)
    say(f"done: best val IoU {run.best_iou:.4f} (epoch {run.best_epoch}); checkpoints in {cfg['checkpoint_dir']}/")
    return summary


def seed_everything(seed):
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_batch_size(cfg, hw, train_images):
    """batch_size=auto: the largest that fits on a CUDA GPU (autobatch); elsewhere CONFIG's 8, capped at the set."""
    if cfg["batch_size"] != "auto":
        return cfg["batch_size"]
    if hw.kind != "cuda":
        return max(2, min(8, train_images))
    from unet_amp import autobatch
    return autobatch.find_batch_size(cfg, hw, lambda batch: probe_step(cfg, hw, batch), cap=train_images)


def resumed_precision(state, typed):
    """A resumed run keeps the precision it was saved in (a fallback stays fallen back), unless typed anew."""
    if state is None or typed & {"use_amp", "amp_dtype", "channels_last"}:
        return None
    saved = state["precision"]
    return precision.precision_for(saved["dtype"], saved["channels_last"], "resumed run's precision")


def cpu_probe(cfg, hw, job_steps):
    """The probe's measured answer on a CPU where a setting is left to auto (the flag rule's for a job shorter
    than the probe); None elsewhere."""
    auto = (cfg["use_amp"] and cfg["amp_dtype"] == "auto" and hw.bf16_native) or cfg["channels_last"] == "auto"
    if hw.kind != "cpu" or not cfg["cpu_probe"] or not auto:
        return None
    step = lambda dtype, channels_last: probe_step(cfg, hw, None, dtype, channels_last)  # noqa: E731
    return distributed.broadcast_object(precision.probe_cpu(cfg, step, job_steps) if DIST.is_main else None)


def probe_step(cfg, hw, batch=None, dtype=torch.float32, channels_last=False):
    """One real training step of this config's model on random data (the CPU probe and batch_size=auto)."""
    n, size = batch or cfg["batch_size"], cfg["image_size"]
    layout = torch.channels_last if channels_last else torch.contiguous_format
    model = models.build_model(cfg).to(hw.device, memory_format=layout)
    loss_fn, optimizer = models.build_loss(cfg, None, hw.device), torch.optim.AdamW(model.parameters())
    x = torch.randn(n, cfg["in_channels"], size, size, device=hw.device).contiguous(memory_format=layout)
    y = torch.randint(0, max(2, cfg["num_classes"]), (n, size, size), device=hw.device)
    prec = precision.precision_for(str(dtype).replace("torch.", ""), channels_last, "probe")

    def step():
        with precision.autocast(prec, hw):
            logits = model(x)
        loss_fn(logits, y).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


def build_run(cfg, hw, prec, steps_per_epoch):
    """The model on its device (NHWC, compiled, DDP as decided) with its optimizer, schedule, scaler and EMA."""
    model = models.build_model(cfg).to(hw.device)
    if prec.channels_last:
        model = model.to(memory_format=torch.channels_last)
    if DIST.enabled:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[hw.device.index] if hw.kind == "cuda"
                                                          else None)
    if cfg["compile_model"]:
        model = torch.compile(model)
    optimizer = models.build_optimizer(model, cfg)
    scheduler = models.build_scheduler(optimizer, cfg, steps_per_epoch)
    return checkpoint.Run(model, optimizer, scheduler, precision.make_scaler(prec, hw),
                          models.EMA(model, cfg["ema_decay"]), prec, cfg)


def notes(cfg, state, probe, info, n_train, n_val):
    """The banner's notes: the data, the CPU probe's times, and what a resume kept or changed."""
    lines = [f"data: {n_train} train / {n_val} val images from {cfg['data_dir']}"]
    if probe is not None and probe.get("skipped"):
        lines.append(f"CPU probe skipped: {probe['skipped']}; the CPU flags decide")
    elif probe is not None:
        times = ", ".join(f"{mode} {seconds:.3f}" for mode, seconds in probe["times"].items())
        lines.append(f"CPU probe, s/step at batch {cfg['batch_size']}: {times}"
                     f" ({'cached' if probe['cached'] else 'measured now'})")
    if cfg["intensity_range"] is not None:
        lo, hi = (f"{v:.6g}" for v in cfg["intensity_range"])
        lines.append(f"intensity_range [{lo}, {hi}] maps images wider than 8 bits to 0..1, clipped")
    if info["clipped"]:
        lines.append(f"clipped: {len(info['clipped'])} image(s) have over {images.CLIP_NOTE:.0%} of their pixels "
                     f"outside intensity_range, e.g. {info['clipped'][0]}")
    if state is not None:
        lines.append(f"resumed after epoch {state['epoch']} of {state['config']['epochs']}; "
                     f"training to {cfg['epochs']}")
    return lines


# -----------------------------------------------------------------------------------------------------
# The epoch loop: train, validate, checkpoint; a non-finite streak rolls back to a safer precision.
# -----------------------------------------------------------------------------------------------------
def epoch_loop(run, loss_fn, loaders, hw, log):
    cfg, epoch = run.cfg, run.epoch + 1
    while epoch <= cfg["epochs"]:
        good = safety.rollback_point(run.state(), cfg["nan_guard"])  # the last known-good state, on the host
        try:
            row = run_epoch(run, epoch, loss_fn, loaders, hw)
        except safety.NonFiniteStreak as bad:
            diagnose = lambda batch: safety.diagnose(run.model, loss_fn, batch)  # noqa: E731
            safer, scaler = safety.fall_back(run.prec, hw, bad, cfg, epoch, diagnose)
            say(f"note: {run.prec.name} went non-finite at step {bad.step} of epoch {epoch}: rolled back, "
                f"continuing in {safer.name}")
            run.load(good)
            run.optimizer.zero_grad(set_to_none=True)  # the streak's non-finite gradients go with it
            run.fallbacks.append({"epoch": epoch, "step": bad.step, "from": run.prec.name, "to": safer.name})
            run.prec, run.scaler, run.streak = safer, scaler, 0
            continue  # the same epoch again: same data order, safer precision
        is_best = row["val_iou"] > run.best_iou
        run.epoch, run.history = epoch, [*run.history, row]
        if is_best:
            run.best_iou, run.best_epoch = row["val_iou"], epoch
        if DIST.is_main:
            checkpoint.save_epoch(run, cfg["checkpoint_dir"], is_best)
        log.epoch(row, cfg["epochs"], is_best)
        patience = cfg["early_stopping_patience"]
        if patience is not None and epoch - run.best_epoch >= patience and epoch < cfg["epochs"]:
            say(f"early stop: no better val IoU for {patience} epochs")
            break
        epoch += 1


def run_epoch(run, epoch, loss_fn, loaders, hw):
    """Train and validate one epoch; its history row. The epoch's seed makes it replay exactly on resume."""
    train_loader, val_loader = loaders
    seed_everything(run.cfg["seed"] + epoch)
    data.set_epoch(train_loader, epoch)
    report.reset_peak_memory(hw)
    start = time.perf_counter()
    trained = train_one_epoch(run, loss_fn, train_loader, hw, f"epoch {epoch} train")
    train_s = time.perf_counter() - start
    with run.ema.swapped():
        scores = evaluate(run.model, loss_fn, val_loader, run.cfg, hw, f"epoch {epoch} val")
    return {"epoch": epoch, "precision": run.prec.name, "train_loss": trained["loss"], "val_loss": scores["loss"],
            "val_iou": scores["iou"], "val_dice": scores["dice"], "lr": run.scheduler.get_last_lr()[0],
            "epoch_s": time.perf_counter() - start, "train_s": train_s,
            "images_per_s": trained["images"] * DIST.world / train_s, "peak_memory_mb": report.peak_memory_mb(hw),
            "skipped_steps": trained["skipped"], "grad_norm": trained["grad_norm"]}


# -----------------------------------------------------------------------------------------------------
# The training step: autocast forward, fp32 loss, backward (scaled for fp16), one update per accumulation group.
# -----------------------------------------------------------------------------------------------------
def train_one_epoch(run, loss_fn, loader, hw, desc):
    model, k, n = run.model, run.cfg["accumulation_steps"], len(loader)
    model.train()
    guard = safety.StepGuard(model, run.cfg, run.streak)  # numerical safety; nan_guard=False: plain PyTorch
    loss_sum = torch.zeros((), device=hw.device, dtype=torch.float32)
    finite_count, images = torch.zeros((), device=hw.device, dtype=torch.float32), 0
    with torch.autograd.set_detect_anomaly(run.cfg["detect_anomaly"]):
        for i, (x, y) in enumerate(report.progress(loader, desc, run.cfg["progress"])):
            if i % k == 0:
                guard.start_group()  # BatchNorm statistics before this group's forwards
                group, group_ok = min(k, n - i), torch.ones((), dtype=torch.bool, device=hw.device)
            x, y = to_device(x, y, hw, run.prec.channels_last)
            last = (i + 1) % k == 0 or i + 1 == n
            with distributed.gradient_sync(model, last):  # DDP all-reduces on the group's last micro-batch only
                with precision.autocast(run.prec, hw):
                    logits = model(x)
                loss = loss_fn(logits, y)  # fp32, outside autocast
                (run.scaler.scale(loss / group) if run.scaler is not None else loss / group).backward()
            finite = torch.isfinite(loss.detach())  # a device bool: no sync per micro-batch
            group_ok &= finite
            loss_sum += torch.where(finite, loss.detach(), 0.0)  # a skipped step's NaN stays out of the mean
            finite_count += finite
            images += x.shape[0]
            if last:  # ---- the update: the one host sync per optimizer step (nan_guard) ----
                guard.step(model, run.optimizer, run.scaler, group_ok, (x, y))
                run.optimizer.zero_grad(set_to_none=True)
                run.ema.update()
                run.scheduler.step()
    run.streak = guard.streak
    loss_sum, finite_count = torch.stack([loss_sum, finite_count]).tolist()  # the epoch's one read of them
    return {"loss": loss_sum / max(1, finite_count), "images": images, "skipped": guard.skipped,
            "grad_norm": guard.grad_norm}


def to_device(x, y, hw, channels_last):
    x = x.to(hw.device, non_blocking=True)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    return x, y.to(hw.device, non_blocking=True)


# -----------------------------------------------------------------------------------------------------
# Evaluate: loss and dataset-level IoU/Dice, in fp32, at each image's original size (what predict would make).
# -----------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model, loss_fn, loader, cfg, hw, desc="val"):
    model.eval()
    fp32 = precision.precision_for("float32", False, "validation in fp32: fp32 and bf16 runs judged alike")
    confusion = metrics.ConfusionMatrix(cfg["num_classes"], hw.device)
    totals = torch.zeros(2, device=hw.device)  # loss sum, images
    for batch in report.progress(loader, desc, cfg["progress"]):
        for logits, target in scored_logits(model, batch, cfg, fp32, hw):
            totals += torch.stack([loss_fn(logits, target).detach(), torch.ones((), device=hw.device)])
            confusion.update(logits, target)
    loss_sum, count = distributed.all_reduce_(totals).tolist()
    return {"loss": loss_sum / max(1, count), **confusion.all_reduce().compute()}


def scored_logits(model, batch, cfg, prec, hw):
    """(1 x C x H x W logits, 1 x H x W mask) per image at its original size: fit mode resizes the logits
    back, patch mode runs the sliding window over the whole image."""
    if cfg["data_mode"] == "patch":
        image, mask = batch
        logits = patches.sliding_window_logits(model, image, cfg, prec, hw).to(hw.device)
        yield logits[None], mask[None].to(hw.device)
        return
    x, _, masks = batch  # images at image_size, masks at their original sizes
    logits = patches.tta_logits(model, x.to(hw.device), cfg["tta"])
    for one, mask in zip(logits, masks):
        yield patches.unfit(one, *mask.shape, cfg["image_size"])[None], mask[None].to(hw.device)


if __name__ == "__main__":
    sys.exit(main())
