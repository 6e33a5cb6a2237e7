"""Fit predict against the forwards alone as its threads are set: Python's GIL switch interval, the number
of reader threads and torch's own threads, side by side in one process, alternating rounds, medians.

    python tools/predict_threads.py                                   # 200 shapes images, bf16_cl (else fp32)
    python tools/predict_threads.py device=cuda switch_ms=5 readers=4,1 torch_threads=0,1 rounds=3
    python tools/predict_threads.py device=cuda switch_ms=5 readers=4 read_in=threads,processes

Why: on an H100 (BENCHMARKS.md "GPU: H100") fit predict took 5-8x its forwards alone. predict's main
thread launches the model's kernels and needs the GIL for each op; its reader threads (read_image,
fit_input) and its writer hold the GIL for their Python work, and a thread waiting for the GIL waits up to
the switch interval (sys.getswitchinterval(), 5 ms by default) before the holder is asked to let it go.
Measured there (2026-11-28): 0.2 and 0.05 ms were no faster than 5 ms, and 1 reader was slower than 4, so
predict keeps Python's interval. A third to a half of the time went to torch.stack's thread team (see
stacked_inputs), as torch on 1 thread (torch_threads=1) showed: after stacked_inputs the two should tie.
read_in=processes reads in that many forked processes instead (process_read_ahead): their Python work
then holds no GIL the main thread needs. An experiment, not how predict runs: the question for a GPU host.
Each setting's predict writes into a fresh folder; one predict before the rounds is untimed.
Keys: input (a folder of images; default: 200 of the embedded shapes set), checkpoint (default: a fresh
resnet18, CONFIG's), mode (fp32, fp32_cl, bf16, bf16_cl; default: bf16_cl where bf16 is native, else fp32),
batch_size, device (cpu, cuda), rounds, and comma-separated values to try: switch_ms, readers, torch_threads
(0: torch's own count, as predict runs), read_in (threads, processes).
"""
import itertools
import multiprocessing
import sys
import tempfile
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import predict_phases  # noqa: E402
import predict_profile  # noqa: E402
import train_unet as T  # noqa: E402

TOOL_CONFIG = {"input": "", "checkpoint": "", "mode": "auto", "batch_size": 8, "device": "cpu", "rounds": 3,
               "switch_ms": "5,1,0.2,0.05", "readers": "4,1", "torch_threads": "0", "read_in": "threads"}
READ_IN = ("threads", "processes")


def main(argv):
    T.keep_freed_memory()
    try:
        opts = T.parse_overrides(argv, defaults=TOOL_CONFIG)
        with tempfile.TemporaryDirectory(prefix="predict_threads_") as tmp:
            found = measure(opts, settings_of(opts), Path(tmp))
    except T.UserError as exc:
        print(f"error: {T.user_message(exc)}", file=sys.stderr)
        return 2
    print(report(found))
    return 0


def settings_of(opts):
    """[(switch interval in ms, readers, torch threads, read in)] of switch_ms, readers, torch_threads and
    read_in, each a comma-separated list."""
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
    read_in = [v.strip() for v in str(opts["read_in"]).split(",") if v.strip()]
    if not read_in or set(read_in) - set(READ_IN):
        raise T.UserError(f"read_in={opts['read_in']!r}: give {' or '.join(READ_IN)}, or both: "
                          f"read_in=threads,processes")
    return list(itertools.product(switches, readers, threads, read_in))


def measure(opts, settings, tmp):
    """{'mode', 'images', 'forward_s', 'rows': [(switch ms, readers, torch threads, read in, median s, median s
    waited)]}."""
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


def one_predict(run, out, switch_ms, readers, threads, read_in="threads"):
    """(seconds of predict's loop, seconds it waited for reads and writes) at this setting."""
    before = sys.getswitchinterval(), T.PREDICT_READERS, torch.get_num_threads(), T.read_ahead
    sys.setswitchinterval(switch_ms / 1e3)
    T.PREDICT_READERS = readers
    torch.set_num_threads(threads or before[2])
    if read_in == "processes":
        T.read_ahead = process_read_ahead(readers)
    try:
        result, wall, _, _ = predict_profile.watched_predict({**run, "output": str(out)})
    finally:
        sys.setswitchinterval(before[0])
        T.PREDICT_READERS = before[1]
        torch.set_num_threads(before[2])
        T.read_ahead = before[3]
    return wall, sum(result["waited_s"].values())


# ------------------------------------------------------------------------------------------------
# read_in=processes: predict's reads in processes (the experiment, not predict's own way)
# ------------------------------------------------------------------------------------------------
def process_read_ahead(readers):
    """A read_ahead for predict with read_ahead's batches, read (read_image, fit_input) in `readers` forked
    processes instead of threads, one batch ahead as there. Fit mode only, and without its MemoryBudget and
    InputNotes' look (0.01 ms an image): small images, the timing's question. Forked, not spawned: the
    children start with this process's imports (torch, OpenCV) and never touch CUDA."""
    context = multiprocessing.get_context("fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn")

    def read_ahead(paths, per_batch, cfg, budget=None, settle=lambda: None, look=None):
        assert cfg["data_mode"] == "fit", "process_read_ahead reads fit-mode images"
        batches = [paths[i:i + per_batch] for i in range(0, len(paths), per_batch)]
        with ProcessPoolExecutor(min(per_batch, readers), mp_context=context, initializer=_set_config,
                                 initargs=(cfg,)) as pool:
            current = [pool.submit(_read_fit, p) for p in batches[0]] if batches else []
            for k in range(len(batches)):
                reads = [pool.submit(_read_fit, p) for p in (batches[k + 1] if k + 1 < len(batches) else [])]
                results = [future.result() for future in current]
                yield ([(p, image, torch.from_numpy(x)) for p, image, x, why in results if why is None],
                       [(str(p), why) for p, _, _, why in results if why is not None])
                current = reads

    return read_ahead


_CONFIG = {}


def _set_config(cfg):
    """A reader process's start: its config, and torch on one thread, as DataLoader's workers set it (a
    forked child must not use the parent's OpenMP thread team)."""
    torch.set_num_threads(1)
    _CONFIG.update(cfg)


def _read_fit(path):
    """(path, image, fit_input as an array, None), or (path, None, None, why) for an unreadable image."""
    try:
        image = T.read_image(path, _CONFIG["in_channels"], _CONFIG["intensity_range"])
    except T.UserError as exc:
        return path, None, None, str(exc)
    return path, image, T.fit_input(image, _CONFIG).numpy(), None


def report(found):
    head = (f"{found['mode']}, {found['images']} images, {found['rounds']} alternating rounds, medians; the "
            f"forwards alone {found['forward_s']:.3f} s")
    table = [("switch interval", "readers", "torch threads", "read in", "predict", "vs forwards alone",
              "waited for reads/writes")]
    table += [(f"{s:g} ms", str(n), str(k or f"{torch.get_num_threads()} (its own)"), r, f"{t:.3f} s",
               f"{t / found['forward_s']:.2f}x", f"{w:.3f} s") for s, n, k, r, t, w in found["rows"]]
    return head + "\n" + T.markdown_table(table)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
