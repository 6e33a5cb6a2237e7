"""The bit-depth measurement's data (BENCHMARKS.md "Bit depths"): one real labelled image, clean and with sensor defects.

    pip download --no-deps stardist -d /tmp/sd && unzip -q /tmp/sd/stardist-*.whl -d /tmp/sd
    python tools/depth_sets.py /tmp/sd/stardist/data/images data/depths

The stardist wheel ships a real nuclei image (DSB 2018, 512x512, 8-bit values 0-235 in a 16-bit TIFF) and its
labels. It is cut into 128x128 tiles (35 training tiles from the left 320 columns, 4 validation tiles from the right
128) and written once per variant as pairs under OUT/<variant>/{train,val}/{images,masks}/.
"""
import sys
from pathlib import Path

import cv2
import numpy as np
import tifffile

TILE = 128
HOT = ((17, 40), (90, 101))  # two hot pixels, the same place in every tile (65535: a stuck sensor element)


def b12(a):
    return np.round(a.astype(np.float64) * 4095 / 255).astype(np.uint16)


def hot(a):
    a = b12(a)
    for y, x in HOT:
        a[y, x] = 65535
    return a


def scaled(a, gain):
    return np.clip(np.round(b12(a) * gain), 0, 4095).astype(np.uint16)


# name -> (convert(tile, split, index), file suffix); the first training tile is the odd frame where there is one
VARIANTS = {
    "u8": (lambda a, s, i: a.astype(np.uint8), ".png"),
    "b12": (lambda a, s, i: b12(a), ".png"),
    "b12_float": (lambda a, s, i: b12(a).astype(np.float32), ".tif"),       # the same values, as Fiji's 32-bit
    "b12_hot": (lambda a, s, i: hot(a), ".png"),                            # two hot pixels in every frame
    "b12_saturated": (lambda a, s, i: scaled(a, 4.0 if (s, i) == ("train", 0) else 1.0), ".png"),  # one frame x4
    "b12_dim": (lambda a, s, i: scaled(a, 0.125 if i == 0 else 1.0), ".png"),  # a training and a val frame /8
    "b12_offset": (lambda a, s, i: a.astype(np.uint16) * 12 + 300, ".png"),    # a camera's dark offset, max 3120
}


def tiles():
    return {"train": [(y, x) for y in range(0, 512 - TILE + 1, 64) for x in range(0, 320 - TILE + 1, 48)],
            "val": [(y, 384) for y in range(0, 512, TILE)]}


def write(path, array):
    if path.suffix == ".tif":
        tifffile.imwrite(path, array)
    else:
        cv2.imwrite(str(path), array)


def main(source, out):
    image = tifffile.imread(Path(source) / "img2d.tif")
    mask = (tifffile.imread(Path(source) / "mask2d.tif") > 0).astype(np.uint8) * 255
    for name, (convert, suffix) in VARIANTS.items():
        for split, corners in tiles().items():
            for sub in ("images", "masks"):
                (Path(out) / name / split / sub).mkdir(parents=True, exist_ok=True)
            for i, (y, x) in enumerate(corners):
                window = np.s_[y:y + TILE, x:x + TILE]
                write(Path(out) / name / split / "images" / f"t{i:03d}{suffix}", convert(image[window], split, i))
                write(Path(out) / name / split / "masks" / f"t{i:03d}.png", mask[window])
    print({split: len(corners) for split, corners in tiles().items()}, "tiles per variant in", out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tools/depth_sets.py STARDIST_IMAGES_DIR OUT_DIR")
    main(*sys.argv[1:])
