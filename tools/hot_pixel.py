"""BENCHMARKS.md "Bit depths": what one hot pixel in a new image does to predict's mask.

    python tools/hot_pixel.py CHECKPOINT IMAGES_DIR [value=65535] [step=16]

Each image is predicted clean and then once per placement of a single pixel set to `value` (or, for value=+N, moved
up by N: the model's own sensitivity to one pixel, for comparison), on a grid of `step` pixels. The table counts
the mask pixels that changed and how far from the placed pixel they lie (Chebyshev distance: 1 = a neighbour).
"""
import sys
import tempfile
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from unet_amp.predict import PREDICT_CONFIG, predict  # noqa: E402


def masks(checkpoint, images):
    """{name: mask} predicted for a list of (name, image array)."""
    with tempfile.TemporaryDirectory() as tmp:
        for name, image in images:
            cv2.imwrite(f"{tmp}/{name}.png", image)
        predict({**PREDICT_CONFIG, "checkpoint": str(checkpoint), "input": tmp, "output": f"{tmp}/out",
                 "device": "cpu", "progress": False, "amp": "fp32"})
        return {name: cv2.imread(f"{tmp}/out/{name}.png", cv2.IMREAD_UNCHANGED) for name, _ in images}


def main(checkpoint, folder, value="65535", step="16"):
    step, rows = int(step), []
    for path in sorted(Path(folder).glob("*.png")):
        clean = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
        spots = [(y, x) for y in range(step // 2, clean.shape[0], step) for x in range(step // 2, clean.shape[1], step)]
        hot = []
        for y, x in spots:
            image = clean.copy()
            image[y, x] = min(int(image[y, x]) + int(value), 65535) if value.startswith("+") else int(value)
            hot.append((f"h{y}_{x}", image))
        out = masks(checkpoint, [("clean", clean), *hot])
        for (y, x), (name, _) in zip(spots, hot):
            ys, xs = np.nonzero(out[name] != out["clean"])
            distance = int(np.maximum(abs(ys - y), abs(xs - x)).max()) if len(ys) else 0
            rows.append((len(ys), distance))
    changed = [n for n, _ in rows]
    print(f"| {len(rows)} placements | changed pixels: median {int(np.median(changed))}, max {max(changed)} | "
          f"placements changing any pixel: {sum(1 for n in changed if n)} | farthest change: "
          f"{max(d for _, d in rows)} px | placements changing a pixel beyond its neighbours: "
          f"{sum(1 for _, d in rows if d > 1)} |")


if __name__ == "__main__":
    main(*sys.argv[1:3], **dict(a.split("=", 1) for a in sys.argv[3:]))
