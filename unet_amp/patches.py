"""Large images (data_mode="patch"): training patches, whole-image validation, the blended sliding window, TTA."""
from __future__ import annotations

import math
import os
import random
from multiprocessing import RawValue

import cv2
import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.data import Dataset

from unet_amp.common import IGNORE_INDEX
from unet_amp.images import mask_to_classes, match_channels, mean_std, normalize, read_image, read_mask, to_unit_range
from unet_amp.precision import autocast

TILE_BATCH = 8            # tiles per forward in the sliding window
FOREGROUND_SHARE = 1 / 3  # share of training patches centred on a foreground pixel
CACHE_BYTES = 1 << 30     # training images ([0, 1], float16) kept in memory while they fit in this


def rescale(array, scale, nearest=False):
    """Resize by patch_scale: area averaging when shrinking, bilinear when enlarging, nearest for masks."""
    if scale == 1.0:
        return array
    h, w = (max(1, round(n * scale)) for n in array.shape[:2])
    mode = cv2.INTER_NEAREST if nearest else cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR
    out = cv2.resize(array, (w, h), interpolation=mode)
    return out.reshape(h, w, *array.shape[2:])  # cv2 drops a single channel


def pad_to(array, height, width, fill):
    """Pad at the bottom/right up to height x width (images with 0, masks with IGNORE_INDEX)."""
    rows, cols = max(0, height - array.shape[0]), max(0, width - array.shape[1])
    if not rows and not cols:
        return array
    return np.pad(array, ((0, rows), (0, cols)) + ((0, 0),) * (array.ndim - 2), constant_values=fill)


def pad_image(unit, size):
    """A [0, 1] image padded bottom/right to size x size with its channel means (0 once normalised, as predict
    pads), as float32."""
    padded = np.empty((size, size, unit.shape[2]), np.float32)
    padded[:] = mean_std(unit.shape[2])[0]
    padded[:unit.shape[0], :unit.shape[1]] = unit
    return padded


def read_pair(pair, cfg, info):
    """(image in [0, 1] HxWxC float32 with in_channels, mask HxW uint8 of class indices) of an (image, mask) pair."""
    unit = to_unit_range(read_image(pair[0]), info.get("intensity_range"))
    unit = match_channels(unit, cfg["in_channels"], pair[0])
    return unit, mask_to_classes(read_mask(pair[1]), cfg["num_classes"], pair[1], info.get("void_255", False))


def foreground_rows(mask):
    """Cumulative count of foreground pixels per row: draws a centre among all of them without listing them."""
    return np.cumsum(((mask > 0) & (mask != IGNORE_INDEX)).sum(axis=1))


def cut_patch(image, mask, rows, size, rng, centred):
    """One size x size patch, centred on a random foreground pixel when `centred` (and the mask has one)."""
    h, w = mask.shape
    if centred and rows[-1]:
        k = int(rng.integers(rows[-1]))
        cy = int(np.searchsorted(rows, k, side="right"))
        cols = np.flatnonzero((mask[cy] > 0) & (mask[cy] != IGNORE_INDEX))
        cx = int(cols[k - (rows[cy - 1] if cy else 0)])
        top, left = cy - size // 2, cx - size // 2
    else:
        top, left = rng.integers(max(h - size, 0) + 1), rng.integers(max(w - size, 0) + 1)
    top, left = int(np.clip(top, 0, max(h - size, 0))), int(np.clip(left, 0, max(w - size, 0)))
    window = (slice(top, top + size), slice(left, left + size))
    return pad_image(image[window], size), pad_to(mask[window], size, size, IGNORE_INDEX)


def augmentation():
    """Training augmentation (fit and patch mode): flips, quarter turns, a light affine, brightness/contrast."""
    os.environ.setdefault("NO_ALBUMENTATIONS_UPDATE", "1")  # its import checks PyPI for updates otherwise
    import albumentations as A

    return A.Compose([A.HorizontalFlip(p=0.5), A.VerticalFlip(p=0.5), A.RandomRotate90(p=0.5),
                      A.Affine(scale=(0.9, 1.1), translate_percent=(-0.05, 0.05), rotate=(-15, 15),
                               fill=0, fill_mask=IGNORE_INDEX, p=0.5),
                      A.RandomBrightnessContrast(0.2, 0.2, p=0.5)])


class PatchDataset(Dataset):
    """Random image_size patches of images scaled by patch_scale, augmented as fit mode's training items; per
    epoch, as many patches per image as tile it once. Patch positions are drawn from (seed, epoch, index)."""

    def __init__(self, pairs, cfg, info):
        self.pairs, self.cfg, self.info = list(pairs), cfg, info
        self._epoch, self.cache, self.cached_bytes = RawValue("q", 0), {}, 0  # shared with persistent workers
        self.transform, size = augmentation(), cfg["image_size"]
        sizes = [self.load(j)[1].shape for j in range(len(self.pairs))]
        self.starts = np.cumsum([0, *(math.ceil(h / size) * math.ceil(w / size) for h, w in sizes)])

    def set_epoch(self, epoch):
        self._epoch.value = epoch

    def __len__(self):
        return int(self.starts[-1])

    def load(self, j):
        """(image float16 in [0, 1], mask, foreground rows) of pair j at patch_scale; kept while there is room."""
        if j in self.cache:
            return self.cache[j]
        image, mask = read_pair(self.pairs[j], self.cfg, self.info)
        scale = self.cfg["patch_scale"]
        image, mask = rescale(image, scale).astype(np.float16), rescale(mask, scale, nearest=True)
        item = image, mask, foreground_rows(mask)
        if self.cached_bytes + image.nbytes + mask.nbytes <= CACHE_BYTES:
            self.cache[j], self.cached_bytes = item, self.cached_bytes + image.nbytes + mask.nbytes
        return item

    def __getitem__(self, index):
        image, mask, rows = self.load(int(np.searchsorted(self.starts, index, side="right")) - 1)
        sequence = np.random.SeedSequence([self.cfg["seed"], self._epoch.value, index])
        rng = np.random.default_rng(sequence)
        image, mask = cut_patch(image, mask, rows, self.cfg["image_size"], rng, rng.random() < FOREGROUND_SHARE)
        self.transform.set_random_state(rng, random.Random(int(sequence.generate_state(1)[0])))
        out = self.transform(image=image, mask=mask)
        x = torch.from_numpy(np.ascontiguousarray(normalize(out["image"]).transpose(2, 0, 1)))
        return x, torch.from_numpy(np.ascontiguousarray(out["mask"])).long()


class WholeImageDataset(Dataset):
    """Patch-mode validation: (prepared image HxWxC float32, mask int64 HxW), whole and unbatched."""

    def __init__(self, pairs, cfg, info):
        self.pairs, self.cfg, self.info = list(pairs), cfg, info

    def __len__(self):
        return len(self.pairs)

    def __getitem__(self, index):
        unit, mask = read_pair(self.pairs[index], self.cfg, self.info)
        return torch.from_numpy(normalize(unit)), torch.from_numpy(mask).long()


# ---------------------------------------------------------------------------------------------------
# Inference: one forward (device, layout, autocast, TTA), fit mode and the sliding window over it
# ---------------------------------------------------------------------------------------------------
TTA_VIEWS = {
    "none": ((0, False),),
    "flip": ((0, False), (0, True), (2, True), (2, False)),  # none, left-right, both (half turn), up-down
    "d4": tuple((turns, mirrored) for mirrored in (False, True) for turns in range(4)),
}


def to_view(x, turns, mirrored):
    x = x.flip(-1) if mirrored else x
    return x.rot90(turns, dims=(-2, -1)) if turns else x


def from_view(y, turns, mirrored):
    y = y.rot90(-turns, dims=(-2, -1)) if turns else y
    return y.flip(-1) if mirrored else y


def tta_logits(model, x, tta, forward=None):
    """Mean fp32 logits of `forward(model, view)` over the TTA views of x, all views in one batch."""
    forward = forward or (lambda m, v: m(v))
    views = TTA_VIEWS[tta or "none"]
    if len(views) == 1:
        return forward(model, x).float()
    square = x.shape[-1] == x.shape[-2]
    if not square:  # quarter turns of a non-square batch cannot be stacked with the others
        return torch.stack([from_view(forward(model, to_view(x, *v)).float(), *v) for v in views]).mean(0)
    logits = forward(model, torch.cat([to_view(x, *v) for v in views])).float().chunk(len(views))
    return torch.stack([from_view(part, *v) for part, v in zip(logits, views)]).mean(0)


def model_forward(model, x, cfg, prec, hw):
    """fp32 logits on the CPU of a NCHW float32 batch: on the device, in the layout and autocast of prec, with TTA."""
    x = x.to(hw.device, non_blocking=True)
    if prec.channels_last:
        x = x.contiguous(memory_format=torch.channels_last)

    def forward(m, v):
        with torch.no_grad(), autocast(prec, hw):
            return m(v)
    return tta_logits(model, x, cfg.get("tta", "none"), forward).float().cpu()


def fit_region(size, h, w):
    """(rows, cols) an h x w image takes in fit mode's square: longest side resized to `size`, aspect kept."""
    scale = size / max(h, w)
    return max(1, round(h * scale)), max(1, round(w * scale))


def fit_input(image, size):
    """A prepared HxWxC image resized (longest side to size) and padded bottom/right to size x size, CxHxW."""
    rh, rw = fit_region(size, *image.shape[:2])
    resized = cv2.resize(np.asarray(image, np.float32), (rw, rh), interpolation=cv2.INTER_LINEAR)
    return pad_to(resized.reshape(rh, rw, -1), size, size, 0).transpose(2, 0, 1)


def fit_logits(model, images_nhwc_list, cfg, prec, hw):
    """Fit mode: fp32 logits (CxHxW, CPU) of each prepared image at its own size, from one batched forward."""
    size = cfg["image_size"]
    x = torch.from_numpy(np.stack([fit_input(image, size) for image in images_nhwc_list]))
    logits = model_forward(model, x, cfg, prec, hw)
    return [unfit(y, *image.shape[:2], size) for image, y in zip(images_nhwc_list, logits)]


def unfit(logits, h, w, size):
    """Fit-mode logits (CxSxS) back at their image's h x w: the padding cropped, the rest resized (bilinear)."""
    rh, rw = fit_region(size, h, w)
    y = logits[None, :, :rh, :rw]
    return y[0] if (rh, rw) == (h, w) else F.interpolate(y, (h, w), mode="bilinear", align_corners=False)[0]


def tile_starts(length, window, overlap):
    """Tile offsets along one axis: one every window * (1 - overlap) pixels, the last flush with the end."""
    if length <= window:
        return [0]
    stride = max(1, int(window * (1 - overlap)))
    return sorted(set(range(0, length - window, stride)) | {length - window})


def gaussian_ramp(window):
    """1-D blend weights, sigma = window / 8: a tile's centre counts most, its border (seams) least."""
    t = torch.arange(window, dtype=torch.float64) + 0.5 - window / 2
    return torch.exp(-t ** 2 / (2 * (window / 8) ** 2)).float()


def coverage(starts, length, ramp):
    """The sum of every tile's ramp along one axis (the 2-D weight sum is the outer product of two)."""
    total = torch.zeros(length)
    for start in starts:
        total[start:start + len(ramp)] += ramp
    return total


@torch.no_grad()
def sliding_window_logits(model, image, cfg, prec, hw, forward=model_forward):
    """Patch mode: fp32 logits CxHxW (CPU) of a prepared HxWxC image, by Gaussian-blended image_size tiles
    at patch_scale, resized back to the image's size."""
    h, w = image.shape[:2]
    size = cfg["image_size"]
    scaled = rescale(np.asarray(image, np.float32), cfg["patch_scale"])
    sh, sw = scaled.shape[:2]
    padded = torch.from_numpy(pad_to(scaled, size, size, 0).transpose(2, 0, 1).copy())
    ys, xs = (tile_starts(n, size, cfg["tile_overlap"]) for n in padded.shape[1:])
    ramp = gaussian_ramp(size)
    weight, total, tiles = ramp[:, None] * ramp[None, :], None, [(y, x) for y in ys for x in xs]
    for i in range(0, len(tiles), TILE_BATCH):
        batch = tiles[i:i + TILE_BATCH]
        logits = forward(model, torch.stack([padded[:, y:y + size, x:x + size] for y, x in batch]), cfg, prec, hw)
        if total is None:
            total = torch.zeros(logits.shape[1], *padded.shape[1:])
        for (y, x), tile in zip(batch, logits):
            total[:, y:y + size, x:x + size].add_(tile.float() * weight)
    rows, cols = coverage(ys, padded.shape[1], ramp), coverage(xs, padded.shape[2], ramp)
    logits = (total / rows[None, :, None] / cols[None, None, :])[:, :sh, :sw]
    if (sh, sw) != (h, w):
        logits = F.interpolate(logits[None], (h, w), mode="bilinear", align_corners=False)[0]
    return logits
