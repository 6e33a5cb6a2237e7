"""The bit-depth measurement's data (BENCHMARKS.md "Bit depths"): one real labelled image at several depths.

    pip download --no-deps stardist -d /tmp/sd && unzip -q /tmp/sd/stardist-*.whl -d /tmp/sd
    python tools/depth_sets.py /tmp/sd/stardist/data/images data/depths
    python train_unet.py data_dir=data/depths/b12 image_size=128 epochs=10 early_stopping_patience=None use_amp=False seed=42

The stardist wheel ships a real nuclei image (DSB 2018, 512x512, 8-bit values in a 16-bit TIFF) and its
labels. It is cut into 128x128 tiles: training tiles from the left 320 columns, validation tiles from
the right 128, and written once per variant as PNG pairs under OUT/<variant>/{train,val}/.
"""
import sys
from pathlib import Path

import cv2
import numpy as np
import tifffile

TILE = 128
VARIANTS = {
    "u8": lambda a: a,
    "u16_as_shipped": lambda a: a.astype(np.uint16),                    # 8-bit values in a 16-bit file
    "b12": lambda a: np.round(a.astype(np.float64) * 4095 / 255).astype(np.uint16),
    "b16": lambda a: a.astype(np.uint16) * 257,
    "b12_offset": lambda a: a.astype(np.uint16) * 12 + 300,             # a camera's dark offset, max 3120
}


def tiles():
    return {"train": [(y, x) for y in range(0, 512 - TILE + 1, 64) for x in range(0, 320 - TILE + 1, 48)],
            "val": [(y, 384) for y in range(0, 512, TILE)]}


def main(source, out):
    image = tifffile.imread(Path(source) / "img2d.tif").astype(np.uint8)  # values 0..235
    mask = (tifffile.imread(Path(source) / "mask2d.tif") > 0).astype(np.uint8) * 255
    for name, convert in VARIANTS.items():
        for split, corners in tiles().items():
            for sub in ("images", "masks"):
                (Path(out) / name / split / sub).mkdir(parents=True, exist_ok=True)
            for i, (y, x) in enumerate(corners):
                window = np.s_[y:y + TILE, x:x + TILE]
                cv2.imwrite(str(Path(out) / name / split / "images" / f"t{i:03d}.png"), convert(image[window]))
                cv2.imwrite(str(Path(out) / name / split / "masks" / f"t{i:03d}.png"), mask[window])
    print({split: len(corners) for split, corners in tiles().items()}, "tiles per variant in", out)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python tools/depth_sets.py STARDIST_IMAGES_DIR OUT_DIR")
    main(*sys.argv[1:])
