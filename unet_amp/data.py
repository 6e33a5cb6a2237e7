"""Data: the embedded shapes data set, pairing and splitting, the start-up check, datasets and loaders."""
from __future__ import annotations

import os
import random
import shutil
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import RawValue
from pathlib import Path

import cv2
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from unet_amp.common import IGNORE_INDEX, IMAGE_EXTS, UserError
from unet_amp.distributed import DIST
from unet_amp.patches import CACHE_BYTES, augmentation, fit_region, pad_image, pad_to
from unet_amp.images import (CLIP_NOTE, check_range, clipped_share, image_sketch, mask_to_classes, match_channels,
                             normalize, read_image, read_mask, robust_range, to_unit_range, write_png)

SHAPES_DIR = "data/shapes"  # where the embedded data set is written, the first time it is used


# ---------------------------------------------------------------------------------------------------
# The embedded shapes data set
# ---------------------------------------------------------------------------------------------------
def draw_shapes(rng, size, num_classes=1):
    """One image (HxWx3 uint8, BGR as cv2 writes it) and its mask: brighter smooth shapes on a grainy gradient."""
    yy, xx = np.mgrid[0:size, 0:size] / size
    base, tilt = rng.uniform(20, 110, 3), rng.uniform(-25, 25, (2, 3))
    image = base + xx[..., None] * tilt[0] + yy[..., None] * tilt[1]
    mask = np.zeros((size, size), np.uint8)
    for _ in range(rng.integers(1, 4)):
        shape, layer = int(rng.integers(0, 3)), np.zeros((size, size), np.uint8)
        cx, cy = rng.integers(size // 6, size - size // 6, 2)
        r = int(rng.integers(size // 10, size // 4))
        if shape == 0:
            cv2.circle(layer, (int(cx), int(cy)), r, 1, -1)
        elif shape == 1:
            box = ((float(cx), float(cy)), (2.0 * r, 1.3 * r), float(rng.uniform(0, 180)))
            cv2.fillPoly(layer, [cv2.boxPoints(box).astype(np.int32)], 1)
        else:
            cv2.fillPoly(layer, [np.array([[cx, cy - r], [cx - r, cy + r], [cx + r, cy + r]], np.int32)], 1)
        image[layer == 1] = rng.uniform(120, 255, 3)
        mask[layer == 1] = 255 if num_classes == 1 else min(shape + 1, num_classes - 1)
    grain = np.where(mask[..., None] > 0, 5.0, 20.0)  # texture and brightness both tell shapes apart
    image = image + rng.normal(0, 1, image.shape) * grain
    return image.clip(0, 255).astype(np.uint8), mask


def ensure_shapes_dataset(root, count=300, size=128, seed=0):
    """Write the embedded data set (count PNG pairs, deterministic) unless `root` holds files; atomic rename."""
    root = Path(root)
    if root.is_dir() and any(root.iterdir()):
        return root
    tmp = root.with_name(f".{root.name}.tmp{os.getpid()}")
    try:
        rng = np.random.default_rng(seed)
        for i in range(count):
            image, mask = draw_shapes(rng, size)
            write_png(tmp / "images" / f"shape_{i:04d}.png", image)
            write_png(tmp / "masks" / f"shape_{i:04d}.png", mask)
        if root.is_dir():
            root.rmdir()  # empty (checked above)
        try:
            os.replace(tmp, root)
        except OSError:  # another process wrote it first
            if not (root.is_dir() and any(root.iterdir())):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


# ---------------------------------------------------------------------------------------------------
# Pairing, splitting, the start-up check
# ---------------------------------------------------------------------------------------------------
def _by_stem(folder):
    """{stem: path} of the image files directly in `folder` (hidden files skipped); a stem twice -> UserError."""
    found = {}
    for path in sorted(folder.iterdir()):
        if path.name.startswith(".") or not path.is_file() or path.suffix.lower() not in IMAGE_EXTS:
            continue
        if path.stem in found:
            raise UserError(f"{path}: same name as {found[path.stem].name}, so its partner is ambiguous; "
                            f"keep one of the two")
        found[path.stem] = path
    return found


def find_pairs(folder):
    """[(image, mask)] of <folder>/images and <folder>/masks matched by file stem, sorted by stem."""
    folder = Path(folder)
    for sub in ("images", "masks"):
        if not (folder / sub).is_dir():
            raise UserError(f"{folder / sub}: not found; put images in {folder}/images and masks with the same "
                            f"names in {folder}/masks")
    images, masks = _by_stem(folder / "images"), _by_stem(folder / "masks")
    if not images:
        raise UserError(f"{folder / 'images'}: no images ({', '.join(IMAGE_EXTS)}); put the images there")
    for have, other, where in ((images, masks, "masks"), (masks, images, "images")):
        missing = sorted(set(have) - set(other))
        if missing:
            raise UserError(f"{have[missing[0]]}: no file with the same name in {folder / where} "
                            f"({len(missing)} unpaired in all); add its partner or remove it")
    return [(images[s], masks[s]) for s in sorted(images)]


def split_pairs(cfg):
    """(train, val): <data_dir>/train and /val when both exist, else a split of data_dir seeded by cfg's seed."""
    root = Path(cfg["data_dir"])
    if not root.is_dir():
        raise UserError(f"data_dir={root}: not found; create {root}/images and {root}/masks (or train/ and val/)")
    halves = [(root / half).is_dir() for half in ("train", "val")]
    if any(halves) and not all(halves):
        have, lack = ("train", "val") if halves[0] else ("val", "train")
        raise UserError(f"data_dir={root}: has {have}/ but no {lack}/; add {lack}/images and {lack}/masks, or put "
                        f"every pair in images/ and masks/ for a val_fraction split")
    if all(halves):
        train, val = find_pairs(root / "train"), find_pairs(root / "val")
    else:
        pairs = find_pairs(root)
        n_val = max(1, round(len(pairs) * cfg["val_fraction"]))
        if len(pairs) - n_val < 1:
            raise UserError(f"data_dir={root}: {len(pairs)} pair(s) leave none for training at val_fraction="
                            f"{cfg['val_fraction']}; add images or lower val_fraction")
        order = np.random.default_rng(cfg["seed"]).permutation(len(pairs))
        val = [pairs[i] for i in sorted(order[:n_val])]
        train = [pairs[i] for i in sorted(order[n_val:])]
    if cfg.get("max_train_images") is not None:
        train = train[:cfg["max_train_images"]]
    return train, val


def _check_pair(pair, cfg):
    """(the image's sketch, None for 8-bit; class pixel counts) of one pair, after its checks."""
    image_path, mask_path = pair
    image, mask = read_image(image_path), read_mask(mask_path)
    if image.shape[:2] != mask.shape:
        raise UserError(f"{mask_path}: size {mask.shape[1]}x{mask.shape[0]} but its image is "
                        f"{image.shape[1]}x{image.shape[0]}; masks must match their images pixel for pixel")
    match_channels(image[:1, :1], cfg["in_channels"], image_path)  # the channel check, on one pixel
    sketch = image_sketch(image, image_path)
    mask_to_classes(mask, cfg["num_classes"], mask_path)  # the values check
    return sketch, np.bincount(mask.ravel(), minlength=256)[:256]


def check_data(train_pairs, val_pairs, cfg):
    """Read every pair once: sizes, channels and mask values checked; the intensity range (learnt from the training
    images wider than 8 bits, unless given) and the images it clips noticeably, class counts, and whether a binary
    set's 255 is void (any of its masks holds a 1) or the foreground (0/255 masks)."""
    pairs = list(train_pairs) + list(val_pairs)
    with ThreadPoolExecutor(_threads()) as pool:
        results = list(pool.map(lambda pair: _check_pair(pair, cfg), pairs))
    void_255 = cfg["num_classes"] > 1 or any(c[1] for _, c in results)
    given = cfg.get("intensity_range")
    train = results[:len(train_pairs)]
    learnt = robust_range(sketch for sketch, _ in train) if given is None else list(check_range(given))
    clipped = [str(pair[0]) for pair, (sketch, _) in zip(pairs, results)
               if clipped_share(sketch, learnt) > CLIP_NOTE]
    raw = np.sum([c for _, c in train], axis=0) if train else np.zeros(256, np.int64)
    counts = raw[:max(2, cfg["num_classes"])].copy()
    if not void_255:  # 0/255 masks: 255 is the foreground
        counts[1] += raw[255]
    if train and not counts[1:].any():  # would train, silently, to predict background everywhere
        hint = "; 255 is void in multi-class masks: 0/255 masks want num_classes=1" if raw[255] else ""
        raise UserError(f"data_dir={cfg['data_dir']}: the training masks hold no foreground class "
                        f"(1..{max(1, cfg['num_classes'] - 1)}){hint}")
    return {"intensity_range": learnt, "clipped": clipped, "class_counts": [int(c) for c in counts],
            "void_255": bool(void_255)}


def class_weights_from(counts):
    """class_weights=auto: 1 / (K f_c) for the K classes present with pixel shares f_c (absent classes 1):
    the average training pixel weighs 1, so weighted CE keeps its size next to the region terms."""
    shares = np.asarray(counts, np.float64) / max(1, int(np.sum(counts)))
    present = int(np.count_nonzero(shares))
    return [float(f"{1 / (present * f):.4g}") if f > 0 else 1.0 for f in shares]


def _threads():
    return max(1, min(8, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()))


# ---------------------------------------------------------------------------------------------------
# Fit mode: each image resized to image_size (longest side), padded
# ---------------------------------------------------------------------------------------------------
def fit_resize(unit, mask, size):
    """A [0, 1] image (bilinear) and its mask (nearest) resized so the longest side is `size`; not padded."""
    rows, cols = fit_region(size, *mask.shape)
    if (rows, cols) != mask.shape:
        unit = cv2.resize(unit, (cols, rows), interpolation=cv2.INTER_LINEAR).reshape(rows, cols, -1)
        mask = cv2.resize(mask, (cols, rows), interpolation=cv2.INTER_NEAREST)
    return unit, mask


def fit_pad(unit, mask, size):
    """Pad bottom/right to size x size: the image with the channel means (0 once normalised, as predict pads),
    the mask with IGNORE_INDEX."""
    if mask.shape == (size, size):
        return unit, mask
    return pad_image(unit, size), pad_to(mask, size, size, IGNORE_INDEX)


class FitDataset(Dataset):
    """Fit mode: (image float32 CxSxS normalised, mask int64 SxS), validation also the original mask (int64 HxW)."""

    def __init__(self, pairs, cfg, train):
        self.pairs, self.cfg, self.train = list(pairs), cfg, train
        self.size = cfg["image_size"]
        self._epoch = RawValue("q", 0)  # shared: persistent loader workers see the epoch set here
        self.transform = augmentation() if train else None
        self.cache = self._preload()

    def set_epoch(self, epoch):
        self._epoch.value = epoch

    def __len__(self):
        return len(self.pairs)

    def _load(self, index):
        """(resized image: uint8 for 8-bit files else float16, resized mask, original mask or None)."""
        image_path, mask_path = self.pairs[index]
        image, cfg = read_image(image_path), self.cfg
        mask = mask_to_classes(read_mask(mask_path), cfg["num_classes"], mask_path, cfg.get("void_255", False))
        unit = match_channels(to_unit_range(image, cfg["intensity_range"]), cfg["in_channels"], image_path)
        small, small_mask = fit_resize(unit, mask, self.size)
        small = np.rint(small * 255).astype(np.uint8) if image.dtype == np.uint8 else small.astype(np.float16)
        return small, small_mask, (None if self.train else mask)

    def _preload(self):
        """Every item in memory (read with threads, before loader workers fork) when they fit CACHE_BYTES."""
        estimate = len(self.pairs) * self.size ** 2 * (self.cfg["in_channels"] + 1)
        if not self.pairs or estimate > CACHE_BYTES:
            return None
        cache, total = [], 0
        with ThreadPoolExecutor(_threads()) as pool:
            for start in range(0, len(self.pairs), 64):
                for item in pool.map(self._load, range(start, min(start + 64, len(self.pairs)))):
                    total += sum(a.nbytes for a in item if a is not None)
                    if total > CACHE_BYTES:
                        return None
                    cache.append(item)
        return cache

    def __getitem__(self, index):
        small, mask, original = self.cache[index] if self.cache is not None else self._load(index)
        unit = small.astype(np.float32) / np.float32(255) if small.dtype == np.uint8 else small.astype(np.float32)
        unit, mask = fit_pad(unit, mask, self.size)
        if self.transform is not None:
            sequence = np.random.SeedSequence([self.cfg["seed"], self._epoch.value, index])
            self.transform.set_random_state(np.random.default_rng(sequence),
                                            random.Random(int(sequence.generate_state(1)[0])))
            out = self.transform(image=unit, mask=mask)
            unit, mask = out["image"], out["mask"]
        x = torch.from_numpy(np.ascontiguousarray(normalize(unit).transpose(2, 0, 1)))
        y = torch.from_numpy(np.ascontiguousarray(mask)).long()
        return (x, y) if original is None else (x, y, torch.from_numpy(original).long())


def collate_val(items):
    """Fit-mode validation batch: images and resized masks stacked, original masks (sizes differ) as a list."""
    images, masks, originals = zip(*items)
    return torch.stack(images), torch.stack(masks), list(originals)


# ---------------------------------------------------------------------------------------------------
# Loaders
# ---------------------------------------------------------------------------------------------------
class EpochShuffle(torch.utils.data.Sampler):
    """A shuffle drawn from (seed, epoch): the same order for an epoch whether or not the run was resumed."""

    def __init__(self, length, seed):
        self.length, self.seed, self.epoch = length, seed, 0

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return self.length

    def __iter__(self):
        seed = int(np.random.SeedSequence([self.seed, self.epoch]).generate_state(1)[0])
        return iter(torch.randperm(self.length, generator=torch.Generator().manual_seed(seed)).tolist())


def _worker_start(worker_id):
    cv2.setNumThreads(0)  # OpenCV's own pool in every worker would take the model's cores


def loader_options(cfg, hw):
    """DataLoader keywords shared by both loaders: workers (None -> 0 on CPU/MPS, min(4, cores) on CUDA)."""
    workers = cfg.get("num_workers")
    if workers is None:
        workers = min(4, _threads()) if hw.kind == "cuda" else 0
    return dict(num_workers=workers, pin_memory=hw.kind == "cuda", persistent_workers=workers > 0,
                worker_init_fn=_worker_start if workers else None)


def make_loaders(train_pairs, val_pairs, cfg, hw, info):
    """(train_loader, val_loader) for fit or patch mode; DDP: DistributedSampler for training, val sharded."""
    cfg = {**cfg, "intensity_range": info.get("intensity_range"), "void_255": info.get("void_255", False)}
    if cfg["data_mode"] == "patch":
        from unet_amp.patches import PatchDataset, WholeImageDataset

        train_set, val_set = PatchDataset(train_pairs, cfg, info), WholeImageDataset(val_pairs, cfg, info)
    else:
        train_set, val_set = FitDataset(train_pairs, cfg, True), FitDataset(val_pairs, cfg, False)
    dist, options = (DIST if DIST.enabled else None), loader_options(cfg, hw)
    if dist is not None:
        sampler = torch.utils.data.DistributedSampler(train_set, dist.world, dist.rank, shuffle=True, seed=cfg["seed"])
    else:
        sampler = EpochShuffle(len(train_set), cfg["seed"])
    train_loader = DataLoader(train_set, int(cfg["batch_size"]), sampler=sampler,
                              drop_last=len(sampler) > int(cfg["batch_size"]),  # no BatchNorm batch of one
                              generator=torch.Generator().manual_seed(cfg["seed"]), **options)
    shard = list(range(len(val_set)))[dist.rank::dist.world] if dist is not None else None  # each image once
    if cfg["data_mode"] == "patch":
        val_loader = DataLoader(val_set, batch_size=None, sampler=shard, **options)
    else:
        val_loader = DataLoader(val_set, int(cfg["batch_size"]), sampler=shard, collate_fn=collate_val, **options)
    return train_loader, val_loader


def set_epoch(loader, epoch):
    """Same shuffle and augmentation for `epoch` whether or not the run was resumed."""
    for part in (loader.sampler, loader.dataset):
        if hasattr(part, "set_epoch"):
            part.set_epoch(epoch)
