"""Copy an image/mask data set with its images re-saved as 16-bit PNGs (or 12-bit data in 16-bit PNGs).

    python tools/convert_depth.py data/shapes data/shapes16 16   # uint8 * 257: the full 16-bit range
    python tools/convert_depth.py data/shapes data/shapes12 12   # 0..4095 in a 16-bit PNG (a 12-bit camera)

Masks are copied unchanged. Used to check that 8- and 16-bit forms of the same data train alike.
"""
import shutil
import sys
from pathlib import Path

import cv2
import numpy as np


def convert(src, dst, bits):
    """Write <dst>/images (16-bit PNG, value * (2**bits - 1) / 255, rounded) and <dst>/masks (copied)."""
    src, dst = Path(src), Path(dst)
    top = 2 ** int(bits) - 1
    if not 8 < top < 2 ** 16:
        raise SystemExit(f"bits={bits}: use 9..16")
    (dst / "images").mkdir(parents=True, exist_ok=True)
    for path in sorted((src / "images").iterdir()):
        image = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
        if image is None or image.dtype != np.uint8:
            raise SystemExit(f"{path} is not an 8-bit image")
        wide = np.round(image.astype(np.float64) * top / 255).astype(np.uint16)
        cv2.imwrite(str(dst / "images" / f"{path.stem}.png"), wide)
    shutil.copytree(src / "masks", dst / "masks", dirs_exist_ok=True)
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 4:
        raise SystemExit(__doc__)
    print(convert(*sys.argv[1:]))
