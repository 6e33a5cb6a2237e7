"""GPU check: run every CUDA path of train_unet.py on this machine's GPU(s); print a short report.

    make gpu-check                     # or: python tools/gpu_check.py

Checks: the capability check on the real device, bf16 autocast, fp16 + GradScaler, channels_last,
max_memory_allocated, predict, the sliding window's device memory (1,000² vs 8,000²), fit predict's
steps timed one by one (tools/predict_phases.py), its main thread's time in a whole run
(tools/predict_profile.py), the whole run with torch's threads, with 1 and with its reads in processes
(tools/predict_threads.py), the benchmark's inference table (predict against the forwards alone per
precision and layout, as BENCHMARKS.md gives it for CPUs), a bare-loop timing (strict fp32, TF32, bf16,
NCHW/NHWC), torch.compile and, with 2+ GPUs visible, DDP over nccl under torchrun. Tiny synthetic data, but
for the inference table (the shapes set and one 4000² image).
On an H100 the checks but the inference table took 2.6-3.1 minutes (torch.compile 68-80 s of it); the
table's rows, run apart at 3 rounds, took 2.8 minutes, so with its 5 rounds and its training run expect 4
or more: give it 10 minutes. Each check's line is printed as it ends.
`make gpu-check ARGS="skip=compile,bare"` leaves out the checks whose names hold those words.
Exit status: 0 all passed, 1 a check failed or no CUDA GPU is visible, 2 a wrong argument.
"""
import contextlib
import io
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]

import numpy as np  # noqa: E402
import torch  # noqa: E402

import train_unet as T  # noqa: E402


def tiny_cfg(tmp, name, **overrides):
    return {**T.CONFIG, "data_dir": str(tmp / "data"), "checkpoint_dir": str(tmp / name), "image_size": 64,
            "batch_size": 4, "epochs": 2, "max_train_images": 16, "progress": False, "device": "cuda",
            "early_stopping_patience": None, **overrides}


def quiet_train(cfg):
    with contextlib.redirect_stdout(io.StringIO()) as log:
        result = T.train(cfg)
    return result, log.getvalue()


def check_capability(hw, tmp):
    prec = T.decide_precision(hw)
    layout, why = T.decide_channels_last(T.CONFIG, hw, prec)
    return (f"{hw.name}, capability {hw.capability[0]}.{hw.capability[1]}: native bf16 {hw.bf16}, fp16 "
            f"{hw.fp16}; auto -> {prec.name}; plain fp32 runs as {T.fp32_math(hw)}; layout auto -> "
            f"{'NHWC' if layout else 'NCHW'}")


def check_train(hw, tmp, amp_dtype, expect, **overrides):
    if not {"bf16": hw.bf16, "fp16": hw.fp16}.get(expect, True):  # fp32 runs anywhere (a Pascal GPU too)
        return f"skipped: {expect} is not native on {hw.device} ({hw.bf16_feature})"
    result, _ = quiet_train(tiny_cfg(tmp, expect + "_" + "_".join(overrides), amp_dtype=amp_dtype, **overrides))
    last = result["history"][-1]
    assert result["precision"] == expect, f"ran in {result['precision']}, not {expect}"
    assert all(r["train_loss"] == r["train_loss"] for r in result["history"]), "non-finite loss"
    assert last["peak_mem_kind"] == "cuda_max_allocated"
    scaler = last["scaler_scale"]
    assert (scaler is not None) == (expect == "fp16"), f"GradScaler scale {scaler} under {expect}"
    return (f"{last['images_per_s']:.0f} img/s, val IoU {last['val_iou']:.3f}, max_memory_allocated "
            f"{last['peak_mem_mb']:.0f} MB" + (f", scale {scaler:.0f}, skipped {last['skipped_steps']}"
                                               if scaler is not None else ""))


def check_predict(hw, tmp):
    ckpt = next(tmp.glob("*/best.pt"), None)
    assert ckpt is not None, "no best.pt from the training checks"
    with contextlib.redirect_stdout(io.StringIO()):
        out = T.predict({"checkpoint": str(ckpt), "input": str(tmp / "data" / "images"),
                         "output": str(tmp / "pred"), "device": "cuda", "progress": False})
    assert out["predicted"] > 0 and not out["failed"]
    return f"{out['predicted']} masks in {out['seconds']:.1f}s ({out['precision']}) from {ckpt.parent.name}"


def check_sliding_window(hw, tmp):
    """Patch mode's sliding window: the blended sum on the GPU where it fits (TileBlend), else on the host
    from page-locked buffers; both give the same logits, and with the host sum device memory does not
    grow with the image (a 1,000² and an 8,000² image need the same)."""
    ckpt = next(tmp.glob("*/best.pt"), None)
    assert ckpt is not None, "no best.pt from the training checks"
    model, cfg = T.load_model(ckpt, hw)
    cfg = {**cfg, "data_mode": "patch", "image_size": 256, "tile_batch_size": 8, "channels_last": False}
    prec, share, peaks, seconds, logits = T.decide_precision(hw), T.DEVICE_BLEND_SHARE, {}, {}, {}
    image = np.random.default_rng(0).integers(0, 256, (8000, 8000, 3), dtype=np.uint8)
    try:
        for where, T.DEVICE_BLEND_SHARE in (("device", share), ("host", 0.0)):
            for side in (1000, 8000):
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
                base, start = torch.cuda.memory_allocated(), time.perf_counter()
                out = T.predict_logits(model, image[:side, :side], cfg, prec, hw)
                seconds[where, side] = time.perf_counter() - start
                peaks[where, side] = (torch.cuda.max_memory_allocated() - base) / 2**20
                assert out.shape[1:] == (side, side) and out.device.type == "cpu"
            logits[where] = out
    finally:
        T.DEVICE_BLEND_SHARE = share
    assert torch.equal(logits["device"], logits["host"]), "device and host blending gave different logits"
    assert peaks["host", 8000] <= peaks["host", 1000] * 1.05 + 1, \
        f"device memory grew with the image: {peaks['host', 1000]:.0f} -> {peaks['host', 8000]:.0f} MB"
    tiles = len(T.tile_starts(8000, 256, cfg["tile_overlap"])) ** 2
    return (f"8000² ({tiles} tiles, {prec.name}): sum on the device {seconds['device', 8000]:.1f}s, peak "
            f"{peaks['device', 8000]:.0f} MB; on the host {seconds['host', 8000]:.1f}s, peak {peaks['host', 8000]:.0f} MB "
            f"(1000²: {peaks['host', 1000]:.0f} MB); the same logits")


def check_bare_loop(hw, tmp):
    base = T.validate_config({**T.CONFIG, "device": "cuda"})  # the default 128 px, batch 8
    strict, tf32 = T.STRICT_FP32["tf32_matmul_precision"], "high"
    before = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32)
    times = {}
    try:
        for label, setting, dtype, nhwc in (("fp32 strict", strict, torch.float32, False),
                                            ("tf32", tf32, torch.float32, False),
                                            # channels_last=auto's judgement call for fp32 before Ampere
                                            ("fp32 strict NHWC", strict, torch.float32, True),
                                            ("bf16", strict, torch.bfloat16, False),
                                            ("bf16 NHWC", strict, torch.bfloat16, True)):
            if dtype == torch.bfloat16 and not hw.bf16:
                continue
            T.apply_tf32(setting, T.Precision.of(torch.float32, "gpu-check"))
            times[label] = T.time_train_steps(base, hw, dtype, nhwc, steps=10)
    finally:
        torch.set_float32_matmul_precision(before[0])
        torch.backends.cudnn.allow_tf32 = before[1]
    ref = times["fp32 strict"]
    return "s/step at 128 px, batch 8: " + ", ".join(f"{k} {v * 1000:.1f} ms ({ref / v:.2f}x)" for k, v in times.items())


# The benchmark's inference table as BENCHMARKS.md "Predict speed" took it on CPUs: the same command on the
# GPU, so the GPU's rows read beside the CPUs' (a fresh copy of the shapes set stands in for data/shapes).
INFERENCE_ARGS = ("configs=fp32", "epochs=2", "bare_steps=0", "inference=fp32,fp32_cl,bf16,bf16_cl",
                  "inference_size=4000", "inference_images=200", "inference_rounds=5")


def shapes_set(tmp):
    """The embedded set's images (300 of 128²), made once: the inference table's and the phases' input."""
    data = tmp / "shapes"
    if not data.is_dir():
        T.generate_shapes_dataset(data)
    return data


def check_phases(hw, tmp):
    """Fit predict's steps on this GPU, each timed alone to its end (tools/predict_phases.py): what the
    inference table's fit rows spend beside the forward (reading, encoding, writing) in ms per image."""
    import predict_phases

    mode, out = predict_phases.tool_mode("auto", hw), tmp / "phases"
    out.mkdir()
    ms, count, _ = predict_phases.measure({**predict_phases.TOOL_CONFIG, "input": str(shapes_set(tmp) / "images"),
                                           "mode": mode, "device": hw.device}, out)
    return (f"{mode}, {count} images of the shapes set, batch {predict_phases.TOOL_CONFIG['batch_size']}, "
            "ms per image: " + ", ".join(f"{step} {value:.3f}" for step, value in ms.items()))


def check_profile(hw, tmp):
    """Fit predict as it runs, reader and writer threads beside it (tools/predict_profile.py): its time against
    the forwards alone, where the main thread's time went (ran, waited for a core, slept), its busiest calls."""
    import predict_profile

    found = predict_profile.measure({**predict_profile.TOOL_CONFIG, "input": str(shapes_set(tmp) / "images"),
                                     "device": hw.device}, tmp / "profile")
    return predict_profile.report(found).replace("\n", "\n      ")


def check_threads(hw, tmp):
    """Fit predict against its forwards with torch's own thread count and with 1, and with its reads in
    processes (tools/predict_threads.py): on an H100, 1 thread was 1.5x faster while torch.stack's thread team
    stacked each batch (2026-11-28); with stacked_inputs the two should tie, and what is left of the gap is not
    torch's threads. The processes row asks whether the reader threads' Python work (the GIL) is the rest."""
    import predict_threads

    opts = {**predict_threads.TOOL_CONFIG, "input": str(shapes_set(tmp) / "images"), "device": hw.device}
    settings = [(5.0, T.PREDICT_READERS, threads, read_in) for threads, read_in in ((0, "threads"), (1, "threads"),
                                                                                   (0, "processes"))]
    found = predict_threads.measure(opts, settings, tmp / "threads")
    return predict_threads.report(found).replace("\n", "\n      ")


def check_inference(hw, tmp, args=INFERENCE_ARGS):
    """Predict (reading and writing included) per precision and layout against the forward passes alone
    over the same batches: fit mode over 200 images of 128², patch mode on one 4000² image, with peak
    memory and mask agreement with fp32. The table follows the line: what a GPU section of BENCHMARKS.md
    needs. A row that fails fails the check; bf16 rows are skipped where bf16 is not native."""
    run = [*args, f"data_dir={shapes_set(tmp)}", f"output={tmp / 'benchmark'}", f"device={hw.device}"]
    with contextlib.redirect_stdout(io.StringIO()):
        rows = T.run_benchmark(run)["inference"]
    failed = [f"{r['mode']} {r['data_mode']}: {r['status']}" for r in rows
              if r["status"] != "ok" and not r["status"].startswith("skipped")]
    assert rows and not failed, "; ".join(failed) or "no inference rows"
    ratios = ", ".join(f"{r['mode']} {r['data_mode']} {r['vs_forward_only']:.3f}x" for r in rows if r["status"] == "ok")
    table = "\n".join("      " + line for line in T.format_inference_table(rows).splitlines())
    return (f"predict vs the forwards alone: {ratios}\n{table}\n"
            f"      command: python train_unet.py benchmark {' '.join(args)} device={hw.device}")


def check_ddp(hw, tmp):
    if torch.cuda.device_count() < 2:
        return f"skipped: {torch.cuda.device_count()} GPU visible (needs 2+)"
    cfg = tiny_cfg(tmp, "ddp", epochs=1)
    args = [f"{k}={cfg[k]}" for k in ("data_dir", "checkpoint_dir", "image_size", "batch_size", "epochs",
                                       "max_train_images", "progress", "device")]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "train_unet.py"), *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"torchrun exit {proc.returncode}: {(proc.stderr.strip().splitlines() or [''])[-1]}"
    assert "nccl" in proc.stdout, "no nccl process group in the output"
    return "2 processes over nccl: " + next(l for l in proc.stdout.splitlines() if l.startswith("done"))


# In this order: torch.compile's run trains at auto's precision, which runs on any GPU, so predict and the
# window have a best.pt where bf16 and fp16 are not native (a Pascal GPU skips both runs before it).
CHECKS = [("capability check", check_capability),
          ("bf16 autocast + channels_last", lambda h, t: check_train(h, t, "bfloat16", "bf16", channels_last=True)),
          ("fp16 + GradScaler", lambda h, t: check_train(h, t, "float16", "fp16", channels_last=False)),
          ("torch.compile (bf16/auto)", lambda h, t: check_train(h, t, "auto", T.decide_precision(h).name,
                                                                  compile_model=True)),
          ("predict", check_predict), ("sliding window (patch mode)", check_sliding_window),
          ("predict phases (fit)", check_phases), ("predict profile (fit)", check_profile),
          ("predict threads (fit)", check_threads),
          ("inference table", check_inference),
          ("bare loop", check_bare_loop), ("DDP (nccl)", check_ddp)]


def selected_checks(skip):
    """CHECKS but those whose names hold a word of skip ('compile,bare'); a word that names none is an error."""
    words = [w.strip() for w in str(skip).split(",") if w.strip()]
    unknown = [w for w in words if not any(w in name for name, _ in CHECKS)]
    if unknown:
        raise T.UserError(f"skip={skip!r}: {', '.join(unknown)} names no check; the checks: "
                          f"{', '.join(name for name, _ in CHECKS)}")
    return [(name, check) for name, check in CHECKS if not any(w in name for w in words)]


def main(argv):
    """skip=compile,bare: leave out the checks whose names hold those words (a short lease, a rerun)."""
    T.keep_freed_memory()  # freed memory kept for reuse, as the script's commands run
    try:
        checks = selected_checks(T.parse_overrides(argv, defaults={"skip": ""})["skip"])
    except T.UserError as exc:
        print(f"gpu-check: {T.user_message(exc)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print(f"gpu-check: no CUDA GPU visible to PyTorch {torch.__version__} (CUDA build: "
              f"{torch.version.cuda or 'none'}): run it on a machine with an NVIDIA GPU", file=sys.stderr)
        return 1
    hw = T.detect_hardware("cuda")
    print(f"gpu-check on {T.describe(hw)}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"{torch.cuda.device_count()} GPU(s)")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        T.generate_shapes_dataset(tmp / "data", count=24, size=64)
        for name, check in checks:
            start = time.perf_counter()
            try:
                status, detail = "ok", check(hw, tmp)
                status = "skip" if detail.startswith("skipped") else status
            except Exception as exc:  # report every check, then fail
                status, detail = "FAIL", f"{type(exc).__name__}: {T.first_line(T.user_message(exc))}"
                failed += 1
                if os.environ.get("GPU_CHECK_TRACEBACK"):
                    traceback.print_exc()
            print(f"  {status:<4} {name:<30} {time.perf_counter() - start:6.1f}s  {detail}", flush=True)
    print("gpu-check: " + (f"{failed} check(s) FAILED" if failed else "all checks passed"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
