"""Freed memory kept for reuse (train_unet.keep_freed_memory) against glibc's default, side by side.

    python tools/memory_reuse.py                       # sliding window fp32 + a 2-epoch training run, 3 rounds
    python tools/memory_reuse.py work=window rounds=5 size=2048 use_amp=False channels_last=False

The setting is process-wide, so each run is a fresh process (with or without the call), the two
alternating every round; medians. Per run: wall time of the timed part, the minor page faults and the
kernel (system) CPU time it took, and the process's peak resident memory.
- window: the sliding window (predict_logits, as predict runs it) over a generated size x size scene,
  Unet(resnet18), 128 px tiles, 8 per forward; one untimed pass first, then one timed.
- train: `python train_unet.py epochs=2` on the embedded shapes set (the whole command, its first epoch too).
Any other key=value is a training config key, as for train_unet.py (cpu_probe=False is set here).
"""
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
import train_unet as T  # noqa: E402

TOOL_CONFIG = {"work": "window,train", "rounds": 3, "size": 2048}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(*argv[1:4], argv[4:])
    tool_args = [a for a in argv if T.normalize_key(a.partition("=")[0]) in TOOL_CONFIG]
    try:
        opts = T.parse_overrides(tool_args, defaults=TOOL_CONFIG)
    except T.UserError as exc:
        print(f"error: {T.user_message(exc)}", file=sys.stderr)
        return 2
    rest = [a for a in argv if a not in tool_args]
    lines = [("work", "memory", "median s", "minor faults", "kernel CPU s", "peak memory", "vs glibc default")]
    for work in [w.strip() for w in opts["work"].split(",") if w.strip()]:
        runs = {"glibc default": [], "kept for reuse": []}
        for r in range(opts["rounds"]):
            for name in list(runs) if r % 2 == 0 else list(runs)[::-1]:
                runs[name].append(run_child(work, name == "kept for reuse", opts["size"], rest))
        base = np.median([r["seconds"] for r in runs["glibc default"]])
        for name, results in runs.items():
            med = {k: float(np.median([r[k] for r in results])) for k in results[0]}
            lines.append((work, name, f"{med['seconds']:.2f}", f"{med['faults']:,.0f}", f"{med['system_s']:.2f}",
                          f"{med['peak_mb']:.0f} MB", f"{med['seconds'] / base:.3f}x"))
    print(f"{T.describe(T.detect_hardware('cpu'))}; {opts['rounds']} rounds, alternating, medians")
    print(T.markdown_table(lines))
    return 0


def run_child(work, keep, size, args):
    out = subprocess.run([sys.executable, __file__, "--child", work, "keep" if keep else "default", str(size), *args],
                         check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def child(work, memory, size, args):
    kept = T.keep_freed_memory() if memory == "keep" else False
    assert kept == (memory == "keep"), "keep_freed_memory did not apply here (not glibc, or MALLOC_* set)"
    T.keep_freed_memory = lambda: False  # the default side stays glibc's default when the run calls T.main
    timed = window(int(size), args) if work == "window" else training(args)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    before = timed.pop("usage")
    print(json.dumps({**timed, "faults": usage.ru_minflt - before.ru_minflt, "system_s": usage.ru_stime - before.ru_stime,
                      "peak_mb": usage.ru_maxrss / 1024}))
    return 0


def window(size, args):
    import torch
    from make_scenes import draw_scene
    from predict_vs_monai import load  # the peer tool's model, precision and layout (flag rule)
    model, cfg, hw, prec = load({"checkpoint": "", "trivial": False}, ["cpu_probe=False", *args])
    image = draw_scene(np.random.default_rng(0), size, size)[0]
    with torch.inference_mode():
        T.predict_logits(model, image, cfg, prec, hw)  # untimed: first passes are slower
        usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        T.predict_logits(model, image, cfg, prec, hw)
    return {"seconds": time.perf_counter() - start, "usage": usage}


def training(args):
    import tempfile
    with tempfile.TemporaryDirectory() as tmp:
        usage, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        code = T.main(["epochs=2", "progress=False", "cpu_probe=False", f"checkpoint_dir={tmp}", *args])
        assert code == 0, code
        return {"seconds": time.perf_counter() - start, "usage": usage}


if __name__ == "__main__":
    sys.exit(main())
