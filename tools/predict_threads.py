"""Fit predict against the forwards alone as its threads are set: Python's GIL switch interval, the number
of reader threads and torch's own threads, side by side in one process, alternating rounds, medians.

    python tools/predict_threads.py                                   # 200 shapes images, bf16_cl (else fp32)
    python tools/predict_threads.py device=cuda switch_ms=5 readers=4,1 torch_threads=0,1 rounds=3

Why: on an H100 (BENCHMARKS.md "GPU: H100") fit predict took 5-8x its forwards alone. predict's main
thread launches the model's kernels and needs the GIL for each op; its reader threads (read_image,
fit_input) and its writer hold the GIL for their Python work, and a thread waiting for the GIL waits up to
the switch interval (sys.getswitchinterval(), 5 ms by default) before the holder is asked to let it go.
Measured there (2026-11-28): 0.2 and 0.05 ms were no faster than 5 ms, and 1 reader was slower than 4, so
predict keeps Python's interval. A third to a half of the time went to torch.stack's thread team (see
stacked_inputs), as torch on 1 thread (torch_threads=1) showed: after stacked_inputs the two should tie.
Each setting's predict writes into a fresh folder; one predict before the rounds is untimed.
Keys: input (a folder of images; default: 200 of the embedded shapes set), checkpoint (default: a fresh
resnet18, CONFIG's), mode (fp32, fp32_cl, bf16, bf16_cl; default: bf16_cl where bf16 is native, else fp32),
batch_size, device (cpu, cuda), rounds, and comma-separated values to try: switch_ms, readers, torch_threads
(0: torch's own count, as predict runs).
"""
import itertools
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import predict_phases  # noqa: E402
import predict_profile  # noqa: E402
import train_unet as T  # noqa: E402

TOOL_CONFIG = {"input": "", "checkpoint": "", "mode": "auto", "batch_size": 8, "device": "cpu", "rounds": 3,
               "switch_ms": "5,1,0.2,0.05", "readers": "4,1", "torch_threads": "0"}


def main(argv=None):
    T.keep_freed_memory()
    try:
        opts = T.parse_overrides(sys.argv[1:] if argv is None else argv, defaults=TOOL_CONFIG)
        with tempfile.TemporaryDirectory(prefix="predict_threads_") as tmp:
            found = measure(opts, settings_of(opts), Path(tmp))
    except T.UserError as exc:
        print(f"error: {T.user_message(exc)}", file=sys.stderr)
        return 2
    print(report(found))
    return 0


def settings_of(opts):
    """[(switch interval in ms, readers, torch threads)] of switch_ms, readers and torch_threads, each a
    comma-separated list."""
    try:
        switches = [float(v) for v in str(opts["switch_ms"]).split(",") if v.strip()]
        readers, threads = ([int(v) for v in str(opts[key]).split(",") if v.strip()]
                            for key in ("readers", "torch_threads"))
    except ValueError:
        raise T.UserError(f"switch_ms={opts['switch_ms']!r}, readers={opts['readers']!r}, torch_threads="
                          f"{opts['torch_threads']!r}: give comma-separated numbers, e.g. switch_ms=5,0.2 readers=4,1 "
                          f"torch_threads=0,1") from None
    if int(opts["rounds"]) < 1:
        raise T.UserError(f"rounds={opts['rounds']} must be 1 or more")
    if not (switches and readers and threads) or min(switches) <= 0 or min(readers) < 1 or min(threads) < 0:
        raise T.UserError("switch_ms takes intervals above 0, readers counts of 1 or more, torch_threads 0 (torch's "
                          "own count) or more, e.g. switch_ms=5,0.2 readers=4,1 torch_threads=0,1")
    return list(itertools.product(switches, readers, threads))


def measure(opts, settings, tmp):
    """{'mode', 'images', 'forward_s', 'rows': [(switch ms, readers, torch threads, median s, median s waited)]}."""
    hw = T.detect_hardware(opts["device"])
    mode = predict_phases.tool_mode(opts["mode"], hw)
    images = Path(opts["input"]) if opts["input"] else predict_profile.shapes_images(tmp)
    run = predict_profile.predict_options(opts, mode, opts["checkpoint"] or predict_phases.fresh_checkpoint(tmp), images)
    predict_profile.quietly(T.predict, {**run, "output": str(tmp / "warm-up")})
    forwards, times = [], {s: [] for s in settings}
    for r in range(opts["rounds"]):
        forwards.append(predict_profile.forwards_alone(run, mode, hw))
        for k, setting in enumerate(settings):
            times[setting].append(one_predict(run, tmp / f"out_{r}_{k}", *setting))
    rows = [(*setting, *(float(np.median(column)) for column in zip(*times[setting]))) for setting in settings]
    return {"mode": mode, "images": len(T.list_images(images)), "forward_s": float(np.median(forwards)),
            "rounds": opts["rounds"], "rows": rows}


def one_predict(run, out, switch_ms, readers, threads):
    """(seconds of predict's loop, seconds it waited for reads and writes) at this setting."""
    before = sys.getswitchinterval(), T.PREDICT_READERS, torch.get_num_threads()
    sys.setswitchinterval(switch_ms / 1e3)
    T.PREDICT_READERS = readers
    torch.set_num_threads(threads or before[2])
    try:
        result, wall, _, _ = predict_profile.watched_predict({**run, "output": str(out)})
    finally:
        sys.setswitchinterval(before[0])
        T.PREDICT_READERS = before[1]
        torch.set_num_threads(before[2])
    return wall, sum(result["waited_s"].values())


def report(found):
    head = (f"{found['mode']}, {found['images']} images, {found['rounds']} alternating rounds, medians; the "
            f"forwards alone {found['forward_s']:.3f} s")
    table = [("switch interval", "readers", "torch threads", "predict", "vs forwards alone", "waited for reads/writes")]
    table += [(f"{s:g} ms", str(n), str(k or f"{torch.get_num_threads()} (its own)"), f"{t:.3f} s",
               f"{t / found['forward_s']:.2f}x", f"{w:.3f} s") for s, n, k, t, w in found["rows"]]
    return head + "\n" + T.markdown_table(table)


if __name__ == "__main__":
    sys.exit(main())
