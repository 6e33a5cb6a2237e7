"""Test-time augmentation's IoU gain and time cost for a trained checkpoint, side by side.

    python tools/tta_measure.py checkpoint=checkpoints/best.pt rounds=5

For each tta (none, flip, d4), in fp32 on the checkpoint's device:
- val IoU / Dice / loss: evaluate() over the checkpoint's validation set with cfg["tta"] set, i.e. what
  validation with tta= reports (and, by construction, the IoU of predict's masks);
- predict ms/image: predict_batch over every image of the data set (train and val, read once into memory,
  `batch_size` per call), timed in alternating rounds after an untimed one (the order flips each round, as
  alternate_timings does), median of `rounds`: side by side, so a shared machine's drift falls on all
  alike. Two clocks: wall time, and this process's CPU time (time.process_time), which on a shared
  machine counts the work done rather than the time spent waiting for a core. `threads` intra-op
  threads (1 by default: on a shared machine a second thread mostly waits for the first);
- validation s: one evaluate() pass (wall), median of the same rounds.
"""
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_unet  # noqa: E402
from train_unet import (TTA_VIEWS, SegLoss, UserError, build_loaders, decide_precision,  # noqa: E402
                        describe, detect_hardware, evaluate, find_pairs, load_model, markdown_table,
                        normalize_key, prepare_data, predict_batch, read_image, user_message)

MEASURE_CONFIG = {
    "checkpoint": "checkpoints/best.pt",
    "device": "cpu",
    "batch_size": 8,   # predict's images per call (x the views per forward)
    "rounds": 5,       # timed rounds per setting
    "threads": 1,      # torch intra-op threads
}


def parse(args):
    opts = dict(MEASURE_CONFIG)
    for arg in args:
        key, _, value = arg.partition("=")
        key = normalize_key(key)
        if key not in opts:
            raise UserError(f"unknown key {key!r}: known keys: {', '.join(opts)}")
        opts[key] = type(MEASURE_CONFIG[key])(value)
    return opts


def all_images(cfg):
    """Every image of the checkpoint's data set, read as predict reads it."""
    root = Path(cfg["data_dir"])
    folders = [root / "train", root / "val"] if (root / "train").is_dir() else [root]
    pairs = [pair for folder in folders for pair in find_pairs(folder)]
    return [read_image(image, cfg["in_channels"], cfg["intensity_range"]) for image, _ in pairs]


def timed_rounds(runs, rounds):
    """{name: [(wall s, CPU s) per round]}: each function once untimed, then `rounds` rounds in turn, the
    order flipped every round (A B C, C B A, ...)."""
    names, times = list(runs), {name: [] for name in runs}
    for name in names:
        runs[name]()
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            runs[name]()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
    return times


def measure(opts):
    torch.set_num_threads(opts["threads"])
    hw = detect_hardware(opts["device"])
    prec = decide_precision(hw, use_amp=False)
    model, cfg = load_model(opts["checkpoint"], hw)
    cfg = {**cfg, "num_workers": 0, "progress": False, "channels_last": False, "batch_size": opts["batch_size"]}
    train_pairs, val_pairs = prepare_data(cfg)
    _, val_loader = build_loaders(train_pairs, val_pairs, cfg, hw)
    images, loss_fn, b = all_images(cfg), SegLoss(cfg["num_classes"], cfg["loss"]), opts["batch_size"]
    scores = {}

    def predict_all(name):
        with torch.inference_mode():
            for i in range(0, len(images), b):
                predict_batch(model, images[i:i + b], {**cfg, "tta": name}, prec, hw)

    def validate(name):
        scores[name] = evaluate(model, val_loader, loss_fn, prec, hw, {**cfg, "tta": name})

    predict_s = timed_rounds({name: lambda n=name: predict_all(n) for name in TTA_VIEWS}, opts["rounds"])
    val_s = timed_rounds({name: lambda n=name: validate(n) for name in TTA_VIEWS}, opts["rounds"])
    return hw, cfg, len(images), len(val_pairs), scores, predict_s, val_s


def per_image_ms(rounds, images, clock):
    return float(np.median([t[clock] for t in rounds])) / images * 1e3


def table(images, scores, predict_s, val_s):
    base_iou, rows = scores["none"]["iou"], []
    base = [per_image_ms(predict_s["none"], images, clock) for clock in (0, 1)]
    for name, views in TTA_VIEWS.items():
        wall, cpu = (per_image_ms(predict_s[name], images, clock) for clock in (0, 1))
        rows.append([f"`{name}`", str(len(views)), f"{scores[name]['iou']:.4f}", f"{scores[name]['iou'] - base_iou:+.4f}",
                     f"{scores[name]['dice']:.4f}", f"{cpu:.1f}", f"{cpu / base[1]:.2f}x", f"{wall:.1f}",
                     f"{wall / base[0]:.2f}x", f"{np.median([t[0] for t in val_s[name]]):.2f}"])
    return markdown_table([["tta", "views", "val IoU", "vs none", "val Dice", "predict CPU ms/image", "vs none",
                            "predict wall ms/image", "vs none", "validation wall s"], *rows])


def main(argv):
    train_unet.keep_freed_memory()  # freed memory kept for reuse, as the script's commands run
    try:
        opts = parse(argv)
        start = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        hw, cfg, images, val_images, scores, predict_s, val_s = measure(opts)
    except UserError as exc:
        print(f"error: {user_message(exc)}", file=sys.stderr)
        return 2
    print(f"{opts['checkpoint']} ({cfg['arch']} {cfg['encoder_name']}, {cfg['image_size']} px, seed {cfg['seed']}); "
          f"{describe(hw)}, fp32, {torch.get_num_threads()} thread(s); {start}")
    print(f"val IoU over {val_images} val image(s); predict over {images} image(s), batch {opts['batch_size']}; "
          f"median of {opts['rounds']} alternating rounds")
    print(table(images, scores, predict_s, val_s))
    print("raw predict (wall s, CPU s) per round: " + "; ".join(
        f"{k} {', '.join(f'({w:.2f}, {c:.2f})' for w, c in v)}" for k, v in predict_s.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
