"""Image and mask readers (one per family of formats) and THE scaling rule every model input goes through."""
from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np

from unet_amp.common import IGNORE_INDEX, UserError, atomic_write

TIFF_EXTS = (".tif", ".tiff")
JPEG_EXTS = (".jpg", ".jpeg")
IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
GREY_MEAN, GREY_STD = (0.5,), (0.25,)
LOW_PERCENTILE, HIGH_PERCENTILE = 0.1, 99.9  # the learnt intensity range (BENCHMARKS.md "Bit depths")
SKETCH = np.linspace(0, 100, 2001)           # percentiles kept per image: the pooled histogram, to 0.05 %
SKETCH_PIXELS = 1 << 22                      # larger images are sampled down to about this many pixels
CLIP_NOTE = 0.01                             # a note where clipping touches more than this share of an image


def write_png(path, array):
    """An image or mask as PNG, written atomically."""
    ok, data = cv2.imencode(".png", array)
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data.tobytes()))


def unreadable(path, cause):
    """The one error for a file that cannot be read."""
    return UserError(f"{path}: cannot read it ({cause}); fix, convert (e.g. to PNG) or remove the file")


def nonfinite(path):
    """The one error for an image holding NaN or inf pixels."""
    return UserError(f"{path}: holds NaN or inf pixels; replace them (e.g. by 0) first")


def _channels_last(array):
    """HxW -> HxWx1; HxWxC kept."""
    return array[..., None] if array.ndim == 2 else array


def read_with_opencv(path, flags=None):
    """PNG/JPEG/BMP at their stored depth, RGB(A) order; JPEG turned upright by its EXIF orientation."""
    if flags is None:  # IMREAD_UNCHANGED ignores EXIF orientation; ANYCOLOR applies it and keeps grey grey
        flags = cv2.IMREAD_ANYCOLOR if Path(path).suffix.lower() in JPEG_EXTS else cv2.IMREAD_UNCHANGED
    try:
        data = np.fromfile(path, np.uint8)  # bytes, not cv2.imread: any file name works
        image = cv2.imdecode(data, flags) if data.size else None
    except (OSError, cv2.error) as exc:
        raise unreadable(path, exc) from None
    if image is None:
        raise unreadable(path, "empty, damaged or not an image")
    if image.ndim == 3 and image.shape[2] in (3, 4):
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB if image.shape[2] == 3 else cv2.COLOR_BGRA2RGBA)
    return np.ascontiguousarray(_channels_last(image))


def _squeezed(series):
    """(shape, axes) of a tifffile series without length-1 axes other than Y, X, S."""
    kept = [(n, a) for n, a in zip(series.shape, series.axes) if n != 1 or a in "YXS"]
    return tuple(n for n, _ in kept), "".join(a for _, a in kept)


def read_tiff(path):
    """A TIFF's first series at full resolution (level 0 of a pyramid), as HxWxC; planar CxHxW moved last."""
    import tifffile

    try:
        with tifffile.TiffFile(path) as tif:
            series = tif.series[0]
            shape, axes = _squeezed(series)
            image = series.asarray(level=0).reshape(shape)
    except Exception as exc:  # noqa: BLE001 - tifffile and imagecodecs raise many kinds for damaged files
        raise unreadable(path, f"{type(exc).__name__}: {(str(exc) or 'damaged').splitlines()[0]}") from None
    if image.dtype == bool:  # 1-bit: 0/255 as for a 1-bit PNG
        image = image.astype(np.uint8) * np.uint8(255)
    if image.ndim == 3 and axes[0] in "SC" and image.shape[0] <= 4:
        image, axes = np.moveaxis(image, 0, -1), axes[1:] + "S"  # planar: one plane per channel
    if image.ndim not in (2, 3) or (image.ndim == 3 and not axes.endswith("S")):
        raise unreadable(path, f"a stack of shape {series.shape} ({series.axes}); save one image per file")
    return np.ascontiguousarray(_channels_last(image))


def read_image(path):
    """Any supported image as HxWxC (C >= 1) in its stored dtype; unreadable -> UserError naming it."""
    if not Path(path).is_file():
        raise unreadable(path, "not found or not a file")
    return read_tiff(path) if Path(path).suffix.lower() in TIFF_EXTS else read_with_opencv(path)


def _palette_indices(path):
    """A palette PNG/BMP's indices (what VOC and labelme masks store), or None for any other file."""
    from PIL import BmpImagePlugin, PngImagePlugin

    reader = {".png": PngImagePlugin.PngImageFile, ".bmp": BmpImagePlugin.BmpImageFile}.get(Path(path).suffix.lower())
    try:  # the format's own reader: no decompression-bomb limit on a user's large masks
        with reader(path) as image:
            return np.asarray(image) if image.mode == "P" else None
    except (TypeError, OSError, SyntaxError, ValueError):
        return None  # not what its name says, or damaged: the general reader names the problem


def read_mask(path):
    """A mask as HxW class indices (uint8 or wider): palette -> indices, equal RGB channels -> one."""
    if Path(path).suffix.lower() in JPEG_EXTS:
        raise UserError(f"{path}: a JPEG mask (lossy: its edges hold values between the classes); "
                        f"save masks as PNG or TIFF")
    if not Path(path).is_file():
        raise unreadable(path, "not found or not a file")
    mask = _palette_indices(path) if Path(path).suffix.lower() in (".png", ".bmp") else None
    if mask is None:
        mask = read_image(path)
    if mask.ndim == 3:
        mask = mask[..., :mask.shape[2] - 1] if mask.shape[2] in (2, 4) else mask  # alpha dropped
        if not (mask == mask[..., :1]).all():
            raise UserError(f"{path}: a colour mask; save masks as one channel of class indices (or a palette PNG)")
        mask = mask[..., 0]
    return np.ascontiguousarray(mask)


def mask_values(mask):
    """The distinct values of a mask (bincount for uint8: much faster than np.unique on large masks)."""
    if mask.dtype == np.uint8:
        return np.flatnonzero(np.bincount(mask.ravel(), minlength=256))
    return np.unique(mask)


def mask_to_classes(mask, num_classes, path, void_255=False):
    """Class indices (uint8) with IGNORE_INDEX for void; else UserError. Binary: 0/1, or 0/255 with 255 as the
    foreground unless the data set's masks hold 1s (void_255: check_data decides once, for every mask)."""
    values = set(mask_values(mask).tolist())
    if num_classes == 1:
        if values <= {0, 1} or (values <= {0, 255} and not void_255):
            return (mask > 0).astype(np.uint8)
        allowed, what = {0, 1, IGNORE_INDEX}, "0/1, 0/255, or 0/1 with 255 as void"
    else:
        allowed, what = set(range(num_classes)) | {IGNORE_INDEX}, f"0..{num_classes - 1}, or 255 as void"
    bad = sorted(values - allowed)
    if bad:
        shown = ", ".join(str(v) for v in bad[:8]) + (", ..." if len(bad) > 8 else "")
        raise UserError(f"{path}: mask values {shown} are not class indices (num_classes={num_classes} takes "
                        f"{what}); set num_classes or fix the mask")
    return mask.astype(np.uint8)


def check_range(intensity_range):
    """[lo, hi] with lo < hi, else UserError naming the key."""
    lo, hi = (float(v) for v in intensity_range)
    if not (np.isfinite(lo) and np.isfinite(hi) and lo < hi):
        raise UserError(f"intensity_range={list(intensity_range)}: needs low < high (the values mapped to 0 and 1); "
                        f"fix it or give None to learn it from the training images")
    return lo, hi


def to_unit_range(image, intensity_range):
    """THE scaling rule: uint8 /255; any wider image, integer or float, mapped from [lo, hi] to [0, 1]. A pixel
    outside it whose 3x3 median is inside (a hot or dead pixel) takes that median; the rest is clipped. [lo, hi]
    is the learnt (or given) range; without one (a model that saw only 8-bit images), the image's own."""
    if image.dtype == np.uint8:
        return image.astype(np.float32) / np.float32(255)
    lo, hi = check_range(intensity_range) if intensity_range is not None else percentile_range(image)
    unit = image.astype(np.float32)
    unit -= np.float32(lo)
    unit /= np.float32(hi - lo)
    outside = (unit < 0) | (unit > 1)
    if outside.any():
        median = np.stack([cv2.medianBlur(np.ascontiguousarray(unit[..., c]), 3) for c in range(unit.shape[2])], 2)
        isolated = outside & (median >= 0) & (median <= 1)
        unit[isolated] = median[isolated]
    return np.clip(unit, 0, 1, out=unit)


def percentile_range(values, path="image"):
    """[lo, hi]: the LOW/HIGH_PERCENTILE of the values, so a few defective pixels do not set it; their min/max
    where those two coincide (mostly one value)."""
    lo, hi = np.percentile(values, [LOW_PERCENTILE, HIGH_PERCENTILE])
    if hi <= lo:
        lo, hi = np.min(values), np.max(values)
    if not (np.isfinite(lo) and np.isfinite(hi)):
        raise nonfinite(path)
    return [float(lo), float(hi if hi > lo else lo + 1)]


def image_sketch(image, path="image"):
    """SKETCH's percentiles of an image wider than 8 bits (None for 8-bit): what the learnt range pools. Very large
    images are sampled on a regular grid of pixels; the min and max are exact (and show NaN anywhere)."""
    if image.dtype == np.uint8:
        return None
    values = image.reshape(-1)
    sketch = np.percentile(values[::-(-values.size // SKETCH_PIXELS)], SKETCH)
    sketch[[0, -1]] = values.min(), values.max()
    if not np.isfinite(sketch).all():
        raise nonfinite(path)
    return sketch


def robust_range(sketches):
    """The learnt intensity range: percentile_range of the training images' pooled sketches (each image weighs the
    same), or None when every image is 8-bit."""
    sketches = [s for s in sketches if s is not None]
    return percentile_range(np.concatenate(sketches)) if sketches else None


def clipped_share(values, intensity_range):
    """The share of an image's values (or of its sketch: about the same) that the scaling rule clips."""
    if values is None or intensity_range is None or values.dtype == np.uint8:
        return 0.0
    lo, hi = check_range(intensity_range)
    return float(np.mean((values < lo) | (values > hi)))


def match_channels(image, in_channels, path):
    """HxWxC -> HxWx in_channels: alpha dropped, grey repeated to RGB, RGB to grey by luminance."""
    channels = image.shape[2]
    if channels in (2, 4):
        image, channels = image[..., :channels - 1], channels - 1
    if channels == in_channels:
        return image
    if channels == 1 and in_channels == 3:
        return np.repeat(image, 3, axis=2)
    if channels == 3 and in_channels == 1:
        return cv2.cvtColor(np.ascontiguousarray(image), cv2.COLOR_RGB2GRAY)[..., None]
    raise UserError(f"{path}: {image.shape[2]} channel(s), in_channels={in_channels} takes grey, RGB or RGBA "
                    f"images; convert it or set in_channels")


def mean_std(channels):
    """Normalisation constants: ImageNet's for RGB, 0.5/0.25 otherwise."""
    return (IMAGENET_MEAN, IMAGENET_STD) if channels == 3 else (GREY_MEAN * channels, GREY_STD * channels)


def normalize(unit_image):
    """(x - mean) / std per channel of a [0, 1] HxWxC image, float32."""
    mean, std = (np.asarray(v, np.float32) for v in mean_std(unit_image.shape[2]))
    return (unit_image - mean) / std


def prepare_image(image, cfg_like, path="image"):
    """A read image as the model takes it (HxWxC float32): scaled, channels matched, normalised."""
    unit = to_unit_range(image, cfg_like["intensity_range"])
    return normalize(match_channels(unit, cfg_like["in_channels"], path))
