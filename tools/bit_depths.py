"""BENCHMARKS.md "Bit depths": best val IoU of each scaling rule on tools/depth_sets.py's clean and defective copies.

    python tools/bit_depths.py DEPTHS_DIR OLD_CHECKOUT [variants=b12,b12_hot] [rules=old,learnt,0.01] [seeds=42,7]

Rules: "old" trains with the code in OLD_CHECKOUT (a `git worktree` of an earlier commit); "learnt" with this
checkout's learnt range; a number p with this checkout and intensity_range= the p / (100 - p) percentiles of the
training images' pooled sketches (images.robust_range with other percentiles). One process per run, fp32.
"""
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from unet_amp import images  # noqa: E402

RUN = ["image_size=128", "epochs=15", "early_stopping_patience=None", "use_amp=False", "channels_last=False",
       "progress=False", "num_workers=0"]


def percentile_range(folder, p):
    """intensity_range at the p / 100-p percentiles of the training images' pooled sketches."""
    sketches = [images.image_sketch(images.read_image(f)) for f in sorted((Path(folder) / "train/images").iterdir())]
    lo, hi = np.percentile(np.concatenate(sketches), [p, 100 - p])
    return f"intensity_range={lo:.6g},{hi:.6g}"


def best_iou(root, folder, rule, seed):
    with tempfile.TemporaryDirectory() as out:
        extra = [] if rule in ("old", "learnt") else [percentile_range(folder, float(rule))]
        command = [sys.executable, f"{root}/train_unet.py", f"data_dir={folder}", f"seed={seed}",
                   f"checkpoint_dir={out}", *RUN, *extra]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, cwd=root)
        return json.loads((Path(out) / "summary.json").read_text())["best_iou"]


def main(depths, old, variants="b12,b12_hot,b12_saturated,b12_dim,b12_offset,b12_float", rules="old,learnt",
         seeds="42,7,1"):
    here = Path(__file__).resolve().parents[1]
    rules, seeds = rules.split(","), [int(s) for s in seeds.split(",")]
    print("| copy | " + " | ".join(rules) + " |\n|---|" + "---|" * len(rules), flush=True)
    for variant in variants.split(","):
        cells = []
        for rule in rules:
            scores = [best_iou(old if rule == "old" else here, Path(depths) / variant, rule, s) for s in seeds]
            cells.append(f"{statistics.mean(scores):.3f} ({', '.join(f'{v:.3f}' for v in scores)})")
        print(f"| {variant} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main(*sys.argv[1:3], **dict(a.split("=", 1) for a in sys.argv[3:]))
