"""Where fit-mode predict's main thread spends its time while predict runs as it does (reader and writer
threads beside it, or, where torch's threads take every core, reading and writing between the forwards),
against the forwards alone over the same batches.

    python tools/predict_profile.py                                  # 200 shapes images, bf16_cl (else fp32)
    python tools/predict_profile.py input=data/cells/images mode=fp32 device=cuda top=15

tools/predict_phases.py times each step alone, one after another; this tool looks at the whole run. The
main thread's wall time in predict's loop over the images (not the checkpoint's loading before it) is split
by the kernel's own accounting (Linux /proc/thread-self/schedstat) into the time it ran, the time it waited
for a free core, and the time it slept: waiting for images to be read or masks written (predict's own
"waited" figures), and the rest (the GIL held by a reader or the writer; the first batch's reading, which
nothing overlaps; a CUDA wait in blocking-sync mode: by default CUDA spins, so a sync counts as run, and
shows in the profiler's rows below). A second run under
torch.profiler lists the main thread's busiest calls over the same span by their own CPU time (on CUDA the
runtime's: cudaLaunchKernel, cudaMemcpyAsync, cudaStreamSynchronize, cudaHostAlloc...), with how often each
ran: a copy or a sync per image shows there. Each predict writes into a fresh folder; one predict before them
is untimed (first-call costs).
Keys: input (a folder of images; default: 200 of the embedded shapes set), checkpoint (default: a fresh
resnet18, CONFIG's), mode (fp32, fp32_cl, bf16, bf16_cl; default: bf16_cl where bf16 is native, else fp32),
batch_size, device (cpu, cuda), top (rows of calls listed). tools/gpu_check.py runs it on a GPU.
"""
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import predict_phases  # noqa: E402
import train_unet as T  # noqa: E402

TOOL_CONFIG = {"input": "", "checkpoint": "", "mode": "auto", "batch_size": 8, "device": "cpu", "top": 12}


def main(argv=None):
    T.keep_freed_memory()
    try:
        opts = T.parse_overrides(sys.argv[1:] if argv is None else argv, defaults=TOOL_CONFIG)
        with tempfile.TemporaryDirectory(prefix="predict_profile_") as tmp:
            found = measure(opts, Path(tmp))
    except T.UserError as exc:
        print(f"error: {T.user_message(exc)}", file=sys.stderr)
        return 2
    print(report(found))
    return 0


def measure(opts, tmp):
    """{'mode', 'images', 'forward_s', 'wall_s', 'ran_s', 'queued_s', 'slept_s', 'waited_s', 'calls'}."""
    hw = T.detect_hardware(opts["device"])
    mode = predict_phases.tool_mode(opts["mode"], hw)
    tmp.mkdir(parents=True, exist_ok=True)
    images = Path(opts["input"]) if opts["input"] else shapes_images(tmp)
    run = predict_options(opts, mode, opts["checkpoint"] or predict_phases.fresh_checkpoint(tmp), images)
    quietly(T.predict, {**run, "output": str(tmp / "warm-up")})
    found = {"mode": mode, "forward_s": forwards_alone(run, mode, hw)}
    result, wall, ran, queued = watched_predict({**run, "output": str(tmp / "timed")})
    found.update(images=result["predicted"], wall_s=wall, ran_s=ran, queued_s=queued,
                 slept_s=max(0.0, wall - ran - queued), waited_s=sum(result["waited_s"].values()))
    found["calls"] = busiest_calls(run, tmp / "profiled", hw, opts["top"])
    return found


def watched_predict(run, profiler=None):
    """(predict's result, seconds, seconds the main thread ran, seconds it waited for a core) of predict's
    loop over the images, from its writer's start to the last batch handed to it (MaskWriter's with: not the
    checkpoint's loading before it, nor the last masks' writing after); a torch profiler runs over it too."""
    marks = []

    class Watched(T.MaskWriter):
        def __enter__(self):
            marks.append((time.perf_counter(), *schedstat()))
            if profiler is not None:
                profiler.start()
            return super().__enter__()

        def __exit__(self, *exc):
            marks.append((time.perf_counter(), *schedstat()))  # before the last writes, which predict's own
            try:                                                # waits leave out (nothing to overlap)
                return super().__exit__(*exc)
            finally:
                if profiler is not None:
                    profiler.stop()

    writer, T.MaskWriter = T.MaskWriter, Watched
    try:
        result = quietly(T.predict, run)
    finally:
        T.MaskWriter = writer
    (t0, ran0, queued0), (t1, ran1, queued1) = marks
    return result, t1 - t0, ran1 - ran0, queued1 - queued0


def shapes_images(tmp):
    """200 images of the embedded shapes set (the inference table's fit rows use as many)."""
    return T.generate_shapes_dataset(tmp / "shapes", count=200) / "images"


def predict_options(opts, mode, checkpoint, images):
    dtype, nhwc = T.CPU_PROBE_MODES[mode]
    amp = dtype != "fp32"
    return {"checkpoint": str(checkpoint), "input": str(images), "batch_size": opts["batch_size"],
            "device": opts["device"], "use_amp": amp, "force_amp_dtype": amp,
            "amp_dtype": str(T.DTYPES[dtype]).removeprefix("torch.") if amp else "auto",
            "channels_last": nhwc, "cpu_probe": False, "progress": False}


def forwards_alone(run, mode, hw):
    """Seconds of the forwards alone over predict's batches (inputs made beforehand, each timed to its end)."""
    model, cfg = T.load_model(run["checkpoint"], hw)
    dtype, nhwc = T.CPU_PROBE_MODES[mode]
    cfg = {**cfg, "channels_last": nhwc, "tta": "none"}
    model = model.to(memory_format=torch.channels_last if nhwc else torch.contiguous_format)
    prec = T.Precision.of(T.DTYPES[dtype], "predict_profile")
    paths = T.list_images(run["input"])
    size = run["batch_size"]
    batches = [T.stacked_inputs([T.fit_input(T.read_image(p, cfg["in_channels"], cfg["intensity_range"]), cfg)
                                 for p in paths[i:i + size]], hw) for i in range(0, len(paths), size)]
    with torch.inference_mode():
        T.eval_forward(model, batches[0], cfg, prec, hw)  # first-call costs
        T.synchronize(hw)
        start = time.perf_counter()
        for x in batches:
            T.eval_forward(model, x, cfg, prec, hw)
        T.synchronize(hw)
    return time.perf_counter() - start


def schedstat():
    """(seconds run, seconds waited on a run queue) of this thread so far (Linux; zeros elsewhere)."""
    try:
        ran, queued = Path("/proc/thread-self/schedstat").read_text().split()[:2]
    except (OSError, ValueError):
        return 0.0, 0.0
    return int(ran) / 1e9, int(queued) / 1e9


def busiest_calls(run, out, hw, top):
    """[(name, count, self CPU seconds)] of the calls torch.profiler saw in predict's loop, busiest first (the
    threads torch's profiler follows: predict's main thread; not its reader and writer threads)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if hw.kind == "cuda" else [])
    prof = profile(activities=activities)
    watched_predict({**run, "output": str(out)}, prof)
    rows = [(e.key, e.count, e.self_cpu_time_total / 1e6) for e in prof.key_averages()]
    return sorted(rows, key=lambda row: -row[2])[:top]


def quietly(fn, *args):
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        return fn(*args)


def report(found):
    """The tool's lines (gpu_check prints them too)."""
    per = 1e3 / max(found["images"], 1)
    other = max(0.0, found["slept_s"] - found["waited_s"])
    lines = [f"{found['mode']}, {found['images']} images: predict {found['wall_s']:.3f} s ({found['wall_s'] * per:.2f} "
             f"ms an image), the forwards alone {found['forward_s']:.3f} s "
             f"({found['wall_s'] / found['forward_s']:.2f}x)",
             f"main thread: ran {found['ran_s']:.3f} s, waited for a core {found['queued_s']:.3f} s, slept "
             f"{found['slept_s']:.3f} s ({found['waited_s']:.3f} s for reads and writes, {other:.3f} s for the GIL, "
             f"the first batch's reading or a blocking call)",
             "busiest calls under torch.profiler (self CPU ms, calls): " + "; ".join(
                 f"{name} {seconds * 1e3:.1f} ({count})" for name, count, seconds in found["calls"])]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
