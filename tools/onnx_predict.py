"""Masks from an export (model.onnx + model.json) with onnxruntime, numpy and OpenCV only: no torch, no unet_amp.
An example to port to another runtime; every number comes from model.json.

    python tools/onnx_predict.py model.json photos/ masks/     # or one image instead of photos/
"""
import json
import os
import sys
from pathlib import Path

import cv2
import numpy as np
import onnxruntime as ort

IMAGE_EXTS = (".png", ".jpg", ".jpeg", ".tif", ".tiff", ".bmp")
MANIFEST = "predict.json"  # what predict and this tool wrote into an output folder: only those are overwritten


def prepare(image, meta):
    """HxWxC as stored -> float32 HxWxC as the model takes it: to [0, 1], channels matched, normalised."""
    if image.dtype == np.uint8:
        unit = image.astype(np.float32) / np.float32(255)
    else:  # wider: [lo, hi] to [0, 1], clipped; lo, hi learnt in training, else the image's own percentiles
        if meta["intensity_range"] is not None:
            lo, hi = meta["intensity_range"]
        else:
            lo, hi = np.percentile(image, meta.get("own_range_percentiles", [0.1, 99.9]))  # [..]: before version 2
            if hi <= lo:
                lo, hi = image.min(), image.max()
            hi = hi if hi > lo else lo + 1
        unit = (image.astype(np.float32) - np.float32(lo)) / np.float32(hi - lo)
        median = np.stack([cv2.medianBlur(np.ascontiguousarray(unit[..., c]), 3) for c in range(unit.shape[2])], 2)
        isolated = ((unit < 0) | (unit > 1)) & (median >= 0) & (median <= 1)  # hot or dead pixels
        unit = np.clip(np.where(isolated, median, unit), 0, 1)
    if unit.shape[2] in (2, 4):
        unit = unit[..., :-1]  # alpha dropped
    if unit.shape[2] == 1 and meta["in_channels"] == 3:
        unit = np.repeat(unit, 3, axis=2)
    elif unit.shape[2] == 3 and meta["in_channels"] == 1:
        unit = cv2.cvtColor(np.ascontiguousarray(unit), cv2.COLOR_RGB2GRAY)[..., None]
    return (unit - np.float32(meta["mean"])) / np.float32(meta["std"])


def resize(x, h, w, interpolation=cv2.INTER_LINEAR):
    """cv2.resize of an HxWxC array that keeps C (OpenCV drops a single channel)."""
    return cv2.resize(x, (w, h), interpolation=interpolation).reshape(h, w, -1)


def pad(x, size):
    return np.pad(x, ((0, max(0, size - x.shape[0])), (0, max(0, size - x.shape[1])), (0, 0)))


def run(session, batch):
    """NxHxWxC float32 -> NxKxHxW logits."""
    x = np.ascontiguousarray(batch.transpose(0, 3, 1, 2), dtype=np.float32)
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def fit_logits(session, x, meta):
    """Longest side to image_size, padded bottom/right; the logits cropped and resized back."""
    size, (h, w) = meta["image_size"], x.shape[:2]
    rh, rw = max(1, round(h * size / max(h, w))), max(1, round(w * size / max(h, w)))
    y = run(session, pad(resize(x, rh, rw), size)[None])[0][:, :rh, :rw].transpose(1, 2, 0)
    return resize(np.ascontiguousarray(y), h, w)


def ramp(n):
    t = np.arange(n, dtype=np.float64) + 0.5 - n / 2
    return np.exp(-t ** 2 / (2 * (n / 8) ** 2)).astype(np.float32)


def starts(length, size, overlap):
    if length <= size:
        return [0]
    return sorted(set(range(0, length - size, max(1, int(size * (1 - overlap))))) | {length - size})


def patch_logits(session, x, meta):
    """Sliding window at patch_scale: image_size tiles blended with Gaussian weights, resized back."""
    size, scale, (h, w) = meta["image_size"], meta["patch_scale"], x.shape[:2]
    if scale != 1.0:
        sh, sw = max(1, round(h * scale)), max(1, round(w * scale))
        x = resize(x, sh, sw, cv2.INTER_AREA if scale < 1 else cv2.INTER_LINEAR)
    sh, sw = x.shape[:2]
    x = pad(x, size)
    overlap, r = meta["tile_overlap"], ramp(size)
    ys, xs = starts(x.shape[0], size, overlap), starts(x.shape[1], size, overlap)
    total, weight = 0, np.zeros(x.shape[:2], np.float32)
    tiles = [(y, x0) for y in ys for x0 in xs]
    for i in range(0, len(tiles), 8):
        batch = tiles[i:i + 8]
        logits = run(session, np.stack([x[y:y + size, x0:x0 + size] for y, x0 in batch]))
        if isinstance(total, int):
            total = np.zeros((*x.shape[:2], logits.shape[1]), np.float32)
        for (y, x0), tile in zip(batch, logits):
            total[y:y + size, x0:x0 + size] += tile.transpose(1, 2, 0) * np.outer(r, r)[..., None]
            weight[y:y + size, x0:x0 + size] += np.outer(r, r)
    y = (total / weight[..., None])[:sh, :sw]
    return y if (sh, sw) == (h, w) else resize(np.ascontiguousarray(y), h, w)


def read(path):
    jpeg = path.suffix.lower() in (".jpg", ".jpeg")  # ANYCOLOR applies a JPEG's EXIF orientation, as training read it
    image = cv2.imread(str(path), cv2.IMREAD_ANYCOLOR | cv2.IMREAD_ANYDEPTH if jpeg else cv2.IMREAD_UNCHANGED)
    if image is None:
        raise ValueError("OpenCV cannot read it")
    if image.ndim == 3 and image.shape[2] in (3, 4):
        image = cv2.cvtColor(image, cv2.COLOR_BGR2RGB if image.shape[2] == 3 else cv2.COLOR_BGRA2RGBA)
    return image[..., None] if image.ndim == 2 else image


def mask_of(session, meta, path):
    x = prepare(read(path), meta)
    y = (patch_logits if meta["data_mode"] == "patch" else fit_logits)(session, x, meta)
    return ((y[..., 0] > 0) * 255).astype(np.uint8) if meta["num_classes"] == 1 else y.argmax(2).astype(np.uint8)


def write_png(path, mask):
    """Whole or not at all: a temporary file renamed over the mask."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(cv2.imencode(".png", mask)[1].tobytes())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def written_before(output):
    try:
        return set(json.loads((output / MANIFEST).read_text())["written"])
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def check_output(output, paths):
    """predict's rule: never the input folder, a data set's masks/, or a folder with files this did not write."""
    if output.resolve() in {p.parent.resolve() for p in paths}:
        raise SystemExit(f"error: output={output} holds the input images; give another folder")
    if output.name.lower() == "masks" and (output.parent / "images").is_dir():
        raise SystemExit(f"error: output={output} is a data set's masks (ground truth); give another folder")
    ours = written_before(output) | {MANIFEST}
    if output.is_dir() and any(p.name not in ours and not p.name.startswith(".") for p in output.iterdir()):
        raise SystemExit(f"error: output={output} holds files a prediction did not write; give a new folder")


def main(sidecar, source, output):
    sidecar, source, output = Path(sidecar), Path(source), Path(output)
    sidecar = sidecar / "model.json" if sidecar.is_dir() else sidecar.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    session = ort.InferenceSession(str(sidecar.parent / meta["onnx"]), providers=["CPUExecutionProvider"])
    paths = [source] if source.is_file() else sorted(p for p in source.iterdir() if p.suffix.lower() in IMAGE_EXTS
                                                     and not p.name.startswith("."))
    check_output(output, paths)
    if meta.get("tta", "none") != "none":
        print(f"note: model.json's tta={meta['tta']} is not applied here (predict backend=onnxruntime applies it)")
    output.mkdir(parents=True, exist_ok=True)
    failed, written = 0, []
    for path in paths:
        try:
            write_png(output / f"{path.stem}.png", mask_of(session, meta, path))
            written.append(f"{path.stem}.png")
        except (ValueError, cv2.error) as exc:
            failed += 1
            print(f"error: {path}: unreadable file ({exc})", file=sys.stderr)
    (output / MANIFEST).write_text(json.dumps({"written": sorted(set(written) | written_before(output))}))
    print(f"wrote {len(paths) - failed} mask(s) to {output}" + (f"; {failed} unreadable" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    sys.exit(main(*sys.argv[1:]))
