"""Large generated scenes with small objects: the kind of data `data_mode=patch` is for.

    python tools/make_scenes.py data/scenes                  # 60 scenes of 1024x1024, objects 3-9 px in radius
    python tools/make_scenes.py data/scenes 60 1024 1024     # count, height, width
    python tools/make_scenes.py data/big 1 8000 8000         # one 8000x8000 scene (predict timing)

Grainy, unevenly lit backgrounds with darker speckles; the objects are small smooth discs and
squares a little brighter than their surroundings, as cells in a microscopy frame or cars in an
aerial scene. Shrinking a 1024 px scene to 256 px (data_mode=fit) leaves them 1-2 px across.
Masks are 0/255 PNGs. Deterministic for a given seed.
"""
import sys
from pathlib import Path

import cv2
import numpy as np


def draw_scene(rng, height, width, density=1 / 6000):
    """One scene: (RGB uint8 image, 0/255 mask). `density`: objects per pixel. Objects are drawn
    straight into the image and the mask (no full-size layer each), so an 8000x8000 scene takes seconds."""
    yy, xx = np.ogrid[0:height, 0:width]
    a, b, c = rng.uniform(1, 4), rng.uniform(0, 6), rng.uniform(1, 4)
    light = (60 + 25 * np.sin(xx / width * a + b) * np.cos(yy / height * c)).astype(np.float32)
    image = np.repeat(light[..., None], 3, axis=2)
    mask = np.zeros((height, width), np.uint8)
    for _ in range(int(height * width * density)):
        cy, cx, r = int(rng.integers(0, height)), int(rng.integers(0, width)), int(rng.integers(3, 10))
        colour = tuple(float(light[cy, cx] + d) for d in rng.uniform(35, 70, 3))
        if rng.random() < 0.5:
            for canvas, value in ((image, colour), (mask, 255)):
                cv2.circle(canvas, (cx, cy), r, value, -1)
        else:
            for canvas, value in ((image, colour), (mask, 255)):
                cv2.rectangle(canvas, (cx - r, cy - r), (cx + r, cy + r), value, -1)
    grain = rng.normal(0, 14, image.shape).astype(np.float32)
    grain[mask > 0] *= 0.25  # grainy background, smooth objects
    image += grain
    return image.clip(0, 255).astype(np.uint8), mask


def make_scenes(root, count=60, height=1024, width=1024, seed=0):
    root = Path(root)
    (root / "images").mkdir(parents=True, exist_ok=True)
    (root / "masks").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i in range(count):
        image, mask = draw_scene(rng, height, width)
        cv2.imwrite(str(root / "images" / f"scene_{i:03d}.png"), cv2.cvtColor(image, cv2.COLOR_RGB2BGR))
        cv2.imwrite(str(root / "masks" / f"scene_{i:03d}.png"), mask)
    return root


if __name__ == "__main__":
    args = sys.argv[1:]
    if not args:
        sys.exit(__doc__)
    count, height, width = (int(a) for a in (args[1:] + ["60", "1024", "1024"][len(args) - 1:])[:3])
    print(f"{count} scene(s) of {width}x{height} in {make_scenes(args[0], count, height, width)}")
