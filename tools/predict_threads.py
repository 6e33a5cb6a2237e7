"""Fit predict against the forwards alone as its threads are set: Python's GIL switch interval, the number
of reader threads and torch's own threads, side by side in one process, alternating rounds, medians.

    python tools/predict_threads.py                                   # 200 shapes images, bf16_cl (else fp32)
    python tools/predict_threads.py device=cuda switch_ms=5 readers=4,1 torch_threads=0,1 rounds=3
    python tools/predict_threads.py device=cuda switch_ms=5 readers=4 read_in=threads,processes
    python tools/predict_threads.py switch_ms=5 readers=4 read_in=threads,between rounds=9   # a CPU

Why: on an H100 (BENCHMARKS.md "GPU: H100") fit predict took 5-8x its forwards alone. predict's main
thread launches the model's kernels and needs the GIL for each op; its reader threads (read_image,
fit_input) and its writer hold the GIL for their Python work, and a thread waiting for the GIL waits up to
the switch interval (sys.getswitchinterval(), 5 ms by default) before the holder is asked to let it go.
Measured there (2026-11-28): 0.2 and 0.05 ms were no faster than 5 ms, and 1 reader was slower than 4, so
predict keeps Python's interval. A third to a half of the time went to torch.stack's thread team (see
stacked_inputs), as torch on 1 thread (torch_threads=1) showed: after stacked_inputs the two should tie.
read_in=processes reads in that many forked processes instead (ReaderProcesses; Linux): read_image's and
fit_input's Python work then runs under their own GILs, and predict's process only sends each path and
unpickles what comes back (on the executor's threads). An experiment, not how predict runs: the question
for a GPU host. The processes start before the timed rounds (a product would start them once a run).
read_in=between reads and writes on predict's own thread, between the forwards, as predict does where
torch's threads take every core (predict_host_threads); read_in=threads keeps the threads there too.
Each setting's predict writes into a fresh folder; one predict before the rounds is untimed.
Keys: input (a folder of images; default: 200 of the embedded shapes set), checkpoint (default: a fresh
resnet18, CONFIG's), mode (fp32, fp32_cl, bf16, bf16_cl; default: bf16_cl where bf16 is native, else fp32),
batch_size, device (cpu, cuda), rounds, and comma-separated values to try: switch_ms, readers, torch_threads
(0: torch's own count, as predict runs), read_in (threads, between, processes).
"""
import itertools
import multiprocessing
import os
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
READ_IN = ("threads", "between", "processes")


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
        raise T.UserError(f"read_in={opts['read_in']!r}: give {', '.join(READ_IN)}, or several: "
                          f"read_in=threads,between")
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
    pools = {n: ReaderProcesses(n) for _, n, _, read_in in settings if read_in == "processes"}
    try:
        for r in range(opts["rounds"]):
            forwards.append(predict_profile.forwards_alone(run, mode, hw))
            for k, (switch_ms, readers, threads, read_in) in enumerate(settings):
                times[switch_ms, readers, threads, read_in].append(one_predict(
                    run, tmp / f"out_{r}_{k}", switch_ms, readers, threads, pools.get(readers) if read_in ==
                    "processes" else None, between=read_in == "between"))
    finally:
        for pool in pools.values():
            pool.close()
    rows = [(*setting, *(float(np.median(column)) for column in zip(*times[setting]))) for setting in settings]
    return {"mode": mode, "images": len(T.list_images(images)), "forward_s": float(np.median(forwards)),
            "rounds": opts["rounds"], "rows": rows}


def one_predict(run, out, switch_ms, readers, threads, processes=None, results=None, between=False):
    """(seconds of predict's loop, seconds it waited for reads and writes) at this setting, its reads on
    `readers` threads or, given ReaderProcesses, in those, or (between) on predict's thread between the
    forwards; predict's result appended to `results`."""
    before = sys.getswitchinterval(), T.PREDICT_READERS, torch.get_num_threads(), T.read_ahead, T.predict_host_threads
    sys.setswitchinterval(switch_ms / 1e3)
    T.PREDICT_READERS = readers
    torch.set_num_threads(threads or before[2])
    T.predict_host_threads = lambda hw: not between  # threads (or processes) even where predict would not
    if processes is not None:
        T.read_ahead = processes.read_ahead
    try:
        result, wall, _, _ = predict_profile.watched_predict({**run, "output": str(out)})
    finally:
        sys.setswitchinterval(before[0])
        T.PREDICT_READERS = before[1]
        torch.set_num_threads(before[2])
        T.read_ahead, T.predict_host_threads = before[3], before[4]
    if results is not None:
        results.append(result)
    return wall, sum(result["waited_s"].values())


# ------------------------------------------------------------------------------------------------
# read_in=processes: predict's reads in processes (the experiment, not predict's own way)
# ------------------------------------------------------------------------------------------------
class ReaderProcesses:
    """`readers` forked processes that read predict's fit-mode images (read_image, fit_input), started here
    and warmed, so that a timed predict pays for its reads, not for the processes' start. read_ahead is
    train_unet.read_ahead's stand-in: its batches, one batch read ahead as there, without its MemoryBudget
    and InputNotes' look (0.01 ms an image; small images, the timing's question). Forked: the children have
    this process's imports (torch, OpenCV) and never touch CUDA. `pids`: the processes that read."""

    def __init__(self, readers):
        if "fork" not in multiprocessing.get_all_start_methods():
            raise T.UserError("read_in=processes forks its readers (Linux): use read_in=threads here")
        self.pool = ProcessPoolExecutor(readers, mp_context=multiprocessing.get_context("fork"),
                                        initializer=_start_reader)
        self.pids = set()
        list(self.pool.map(_pid, range(readers)))  # forked (all at once) and started

    def read_ahead(self, paths, per_batch, cfg, budget=None, settle=lambda: None, look=None, threads=True):
        assert cfg["data_mode"] == "fit", "ReaderProcesses reads fit-mode images"
        needs = {key: cfg[key] for key in ("in_channels", "intensity_range", "image_size")}  # what a read uses
        batches = [paths[i:i + per_batch] for i in range(0, len(paths), per_batch)]
        current = [self.pool.submit(_read_fit, p, needs) for p in batches[0]] if batches else []
        for k in range(len(batches)):
            reads = [self.pool.submit(_read_fit, p, needs) for p in (batches[k + 1] if k + 1 < len(batches) else [])]
            results = [future.result() for future in current]
            self.pids.update(pid for *_, pid in results)
            yield ([(p, image, torch.from_numpy(x)) for p, image, x, why, _ in results if why is None],
                   [(str(p), why) for p, _, _, why, _ in results if why is not None])
            current = reads

    def close(self):
        self.pool.shutdown(wait=True, cancel_futures=True)


def _start_reader():
    """A reader process's start, as the script's DataLoader workers: torch on one thread (a forked child
    must not use the parent's OpenMP team) and OpenCV on the calling thread (one_opencv_thread)."""
    torch.set_num_threads(1)
    T.one_opencv_thread(None)


def _pid(_):
    return os.getpid()


def _read_fit(path, cfg):
    """(path, image, fit_input as an array, None, pid), or (path, None, None, why, pid) for an unreadable image."""
    try:
        image = T.read_image(path, cfg["in_channels"], cfg["intensity_range"])
    except T.UserError as exc:
        return path, None, None, str(exc), os.getpid()
    return path, image, T.fit_input(image, cfg).numpy(), None, os.getpid()


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
