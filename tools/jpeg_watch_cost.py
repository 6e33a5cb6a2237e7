"""What watching libjpeg's warnings costs a JPEG decode: cv2.imdecode alone against train_unet.jpeg_decode (the
decode inside WATCHED_DECODES' rounds, fd 2 caught), on 1 and 4 threads as predict's readers and the data check
decode, medians of alternating rounds. Prints a Markdown table.

    python tools/jpeg_watch_cost.py [images=200] [side=256] [rounds=7]
"""
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import cv2
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_unet  # noqa: E402


def main(images=200, side=256, rounds=7):
    rng = np.random.default_rng(0)
    datas = [cv2.imencode(".jpg", cv2.GaussianBlur(rng.integers(0, 256, (side, side, 3), dtype=np.uint8), (0, 0), 2)
                          )[1].tobytes() for _ in range(images)]
    ways = {"cv2.imdecode alone": lambda d: cv2.imdecode(np.frombuffer(d, np.uint8), cv2.IMREAD_COLOR),
            "jpeg_decode (watched)": lambda d: train_unet.jpeg_decode(d, cv2.IMREAD_COLOR, "x.jpg", "image")}
    times = {}
    for _ in range(rounds):
        for name, decode in ways.items():
            for threads in (1, 4):
                start = time.perf_counter()
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(decode, datas))
                times.setdefault((name, threads), []).append((time.perf_counter() - start) / images * 1e3)
    print(f"{images} JPEGs of {side}x{side}, {rounds} rounds, medians (ms per image)\n")
    print("| decode | 1 thread | 4 threads |\n|---|---|---|")
    for name in ways:
        print(f"| {name} | " + " | ".join(f"{statistics.median(times[name, t]):.3f}" for t in (1, 4)) + " |")


if __name__ == "__main__":
    main(**{key: int(value) for key, value in (arg.split("=", 1) for arg in sys.argv[1:])})
