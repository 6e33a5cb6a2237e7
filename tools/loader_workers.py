"""Which loading settings keep the model fed on this machine? The trainer's training pass with 0, 1 and 2
DataLoader workers, each with cache_images on (images decoded and resized once, read back after the
untimed first round: every epoch after a run's first) and off (decoded every epoch), and a bare loop on
a batch held in memory (no loading at all), side by side. First it prints the CPU time a worker spends
per training sample, with and without the cache.

    python tools/loader_workers.py                               # 32 synthetic 1100x700 frames (made once)
    python tools/loader_workers.py data_dir=data/mine amp_dtype=bfloat16 encoder_name=resnet34

Any key=value is a training config override (defaults here: resnet34, 256 px, batch 8). The runs
alternate in rounds (the order flipping each round) after one untimed round, so a shared machine's
drift falls on all alike; prints the median images/s of each, the median over rounds of its speed over
the held batch's in the same round, and every round's figure.
"""
import sys
import time
from functools import partial
from pathlib import Path

import cv2
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import overhead  # noqa: E402  (tools/overhead.py: the trainer's and the bare loop's runners)
import train_unet  # noqa: E402

FRAMES = Path(__file__).resolve().parents[1] / "data" / "frames_1100x700"
STEPS, ROUNDS = 6, 5


def make_frames(root, count=32, width=1100, height=700, seed=0):
    """Microscopy-like RGB frames: a blurred background, bright elliptic cells, and pixel noise that
    PNG cannot compress away (so decoding costs what a real frame's does)."""
    rng = np.random.default_rng(seed)
    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for i in range(count):
        mask = np.zeros((height, width), np.uint8)
        for _ in range(rng.integers(20, 60)):
            centre = (int(rng.integers(0, width)), int(rng.integers(0, height)))
            axes = (int(rng.integers(8, 30)), int(rng.integers(8, 30)))
            cv2.ellipse(mask, centre, axes, float(rng.uniform(0, 180)), 0, 360, 255, -1)
        background = cv2.GaussianBlur(rng.normal(90, 25, (height, width)).astype(np.float32), (0, 0), 8)
        grey = np.clip(background + (mask > 0) * 70 + rng.normal(0, 12, (height, width)), 0, 255).astype(np.uint8)
        rgb = np.stack([grey, (grey * 0.8).astype(np.uint8), (grey * 0.6).astype(np.uint8)], -1)
        cv2.imwrite(str(root / "images" / f"f{i:03d}.png"), rgb)
        cv2.imwrite(str(root / "masks" / f"f{i:03d}.png"), mask)


def sample_cpu_ms(cfg, pairs, count=32, rounds=7):
    """Median CPU time per training sample (read, resize, augment, to tensor), as a loader worker spends
    it (OpenCV on the calling thread, one torch thread): decoded every epoch, read back from
    cache_images' files, and in the first epoch, which also writes them (a fresh cache each time)."""
    train = pairs[0][:count]

    def per_sample(cache, epoch, dataset=None):
        if dataset is None:  # a fresh one (a Dataset's truth value would be its length)
            dataset = train_unet.SegDataset(train, {**cfg, "cache_images": cache}, True)
        dataset.epoch = epoch
        start = time.process_time()
        for i in range(len(train)):
            dataset[i]
        return (time.process_time() - start) * 1e3 / len(train)

    threads = cv2.getNumThreads(), train_unet.torch.get_num_threads()
    cv2.setNumThreads(0)
    train_unet.torch.set_num_threads(1)  # as in a worker; idle OpenMP threads would count their spinning
    per_sample(False, 0)  # warm-up: the transforms' first calls, the page cache
    ms = {"first epoch (decode, write)": [per_sample(True, 0) for _ in range(3)]}
    kept = {False: train_unet.SegDataset(train, {**cfg, "cache_images": False}, True),
            True: train_unet.SegDataset(train, {**cfg, "cache_images": True}, True)}
    per_sample(True, 0, kept[True])  # fills the cache
    for r in range(rounds):
        for cache in (True, False) if r % 2 == 0 else (False, True):
            ms.setdefault(f"cache_images={cache}", []).append(per_sample(cache, r + 1, kept[cache]))
    cv2.setNumThreads(threads[0])
    train_unet.torch.set_num_threads(threads[1])
    return {name: float(np.median(values)) for name, values in ms.items()}


def main(args):
    train_unet.keep_freed_memory()  # freed memory kept for reuse, as the script's commands run
    defaults = train_unet.parse_overrides([f"data_dir={FRAMES}", "image_size=256", "encoder_name=resnet34",
                                           "batch_size=8", "val_fraction=0.1", "progress=False"])
    cfg = train_unet.parse_overrides(args, base=defaults)  # the user's keys win
    if not isinstance(cfg["batch_size"], int):
        raise train_unet.UserError(f"batch_size={cfg['batch_size']}: give a number of images here")
    if Path(cfg["data_dir"]) == FRAMES and not (FRAMES / "masks").is_dir():
        make_frames(FRAMES)
    hw = train_unet.detect_hardware(cfg["device"])
    prec = train_unet.decide_precision(hw, cfg["use_amp"], cfg["amp_dtype"], cfg["force_amp_dtype"])
    if cfg["channels_last"] == "auto":
        cfg["channels_last"] = train_unet.decide_channels_last(cfg, hw, prec)[0]
    train_unet.apply_tf32(cfg["tf32_matmul_precision"], prec)
    pairs = train_unet.prepare_data(cfg)
    print("CPU ms per training sample, one thread: " + ", ".join(
        f"{name} {value:.2f}" for name, value in sample_cpu_ms(cfg, pairs).items()), flush=True)
    trainer, bare = overhead.step_runners(cfg, hw, prec)
    runs = {}
    for cache in (True, False):
        for w in (0, 1, 2):
            loader = overhead.timing_loader({**cfg, "num_workers": w, "cache_images": cache}, hw, STEPS, pairs)
            runs[f"num_workers={w} cache_images={cache}"] = partial(trainer, STEPS, loader)
    runs["held batch (no loading)"] = partial(bare, STEPS)
    print(f"{train_unet.describe(hw)}; {prec.dtype}, channels_last={cfg['channels_last']}, "
          f"{ROUNDS} rounds of {STEPS} steps of batch {cfg['batch_size']}", flush=True)
    times = train_unet.alternate_timings(runs, ROUNDS, hw)
    images = STEPS * cfg["batch_size"] * cfg["accumulation_steps"]
    held = times["held batch (no loading)"]
    for name, seconds in times.items():
        vs_held = np.median([h / s for h, s in zip(held, seconds)])  # per round: side by side
        print(f"{name:40s} {images / np.median(seconds):7.2f} img/s  {vs_held:5.2f}x held   rounds: "
              + " ".join(f"{images / s:.2f}" for s in seconds))


if __name__ == "__main__":
    try:
        main(sys.argv[1:])
    except train_unet.UserError as exc:  # a message, not a traceback
        sys.exit(f"error: {exc}")
