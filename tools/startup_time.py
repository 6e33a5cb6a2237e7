"""Time the data check at start-up: first run (every file decoded) and second run (cache hits only).

    python tools/startup_time.py 1000            # generates 1,000 pairs of 128x128 PNGs (once)
    python tools/startup_time.py 10000 /tmp/st   # 10,000 pairs in /tmp/st/data10000

Prints one line per run: pairs, first and second start-up in seconds (prepare_data: find the pairs,
split, check; the same call train() makes before building the loaders).
"""
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_unet  # noqa: E402


def startup_times(count, workdir):
    data = Path(workdir) / f"data{count}"
    if not (data / "masks").is_dir() or len(list((data / "masks").iterdir())) != count:
        shutil.rmtree(data, ignore_errors=True)
        train_unet.generate_shapes_dataset(data, count=count, size=128)
    (data / train_unet.CHECK_CACHE_NAME).unlink(missing_ok=True)  # a cold first run
    cfg = train_unet.validate_config({"data_dir": str(data), "checkpoint_dir": str(Path(workdir) / "ckpt")})
    times = []
    for _ in range(2):
        start = time.perf_counter()
        train_unet.prepare_data(cfg)
        times.append(time.perf_counter() - start)
    return times


if __name__ == "__main__":
    count = int(sys.argv[1]) if len(sys.argv) > 1 else 1000
    workdir = sys.argv[2] if len(sys.argv) > 2 else tempfile.mkdtemp(prefix="startup_")
    first, second = startup_times(count, workdir)
    print(f"{count} pairs: first start-up {first:.2f} s, second {second:.2f} s (data in {workdir})")
