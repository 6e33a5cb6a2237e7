"""Every CUDA path of the trainer on this machine's GPU, on the embedded data; a short report.

    make gpu-check                         # or: python tools/gpu_check.py
    python tools/gpu_check.py skip=compile # leave out the checks whose names hold these words

Exit code: 0 all passed (or no CUDA GPU: nothing to check), 1 a check failed.
"""
import contextlib
import io
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402


def train(tmp, name, **overrides):
    """A short quiet training run; its summary."""
    import train_unet as T

    cfg = {"data_dir": str(tmp / "data"), "checkpoint_dir": str(tmp / name), "image_size": 64, "batch_size": 8,
           "epochs": 2, "max_train_images": 32, "progress": False, "device": "cuda", "cpu_probe": False,
           "early_stopping_patience": None, "logger": "csv", **overrides}
    with contextlib.redirect_stdout(io.StringIO()):
        summary = T.train(cfg)
    assert summary["best_iou"] == summary["best_iou"], "non-finite val IoU"
    return summary


def trained(summary, expect, layout=False):
    assert summary["precision"] == expect, f"trained in {summary['precision']}, not {expect}"
    assert summary["channels_last"] == layout, f"channels_last {summary['channels_last']}, not {layout}"
    return (f"{summary['median_images_per_s']:.0f} img/s, val IoU {summary['best_iou']:.3f}, peak "
            f"{summary['peak_memory_mb']:.0f} MB")


def check_capability(hw, tmp):
    import train_unet as T

    prec = T.choose_precision(T.CONFIG, hw, None)
    return (f"capability {hw.capability[0]}.{hw.capability[1]}: native bf16 {hw.bf16_native}, fp16 "
            f"{hw.fp16_native}; auto -> {prec.name}{' NHWC' * prec.channels_last}")


def check_fp16_scaler(hw, tmp):
    from unet_amp.checkpoint import load_checkpoint

    words = trained(train(tmp, "fp16", amp_dtype="float16", channels_last=False), "fp16")
    scaler = load_checkpoint(tmp / "fp16" / "last.pt")["scaler"]
    assert scaler is not None, "no GradScaler state in last.pt"
    return f"{words}, loss scale {scaler['scale']:.0f}"


def check_auto_batch(hw, tmp):
    summary = train(tmp, "auto_batch", batch_size="auto", epochs=1, max_train_images=None)
    return f"batch_size=auto -> {summary['config']['batch_size']}, {summary['median_images_per_s']:.0f} img/s"


def check_predict(hw, tmp):
    from unet_amp.predict import predict

    images = tmp / "some" / "images"
    images.mkdir(parents=True)
    for path in sorted((tmp / "data" / "images").iterdir())[:16]:
        shutil.copy(path, images)
    with contextlib.redirect_stdout(io.StringIO()):
        out = predict({"checkpoint": str(next(tmp.glob("*/best.pt"))), "input": str(images),
                       "output": str(tmp / "pred"), "device": "cuda", "progress": False})
    assert len(out["written"]) == 16 and not out["failed"], out
    return f"{len(out['written'])} masks"


def check_export(hw, tmp):
    from unet_amp.export import export

    with contextlib.redirect_stdout(io.StringIO()):
        path = export({"checkpoint": str(next(tmp.glob("*/best.pt"))), "output": str(tmp / "model.onnx")})
    return f"{path.name}, {path.stat().st_size / 2**20:.0f} MB, checked in onnxruntime"


CHECKS = {
    "capability": check_capability,
    "train fp32": lambda hw, tmp: trained(train(tmp, "fp32", use_amp=False, channels_last=False), "fp32"),
    "train bf16": lambda hw, tmp: trained(train(tmp, "bf16", amp_dtype="bfloat16", channels_last=False), "bf16"),
    "train fp16 + GradScaler": check_fp16_scaler,
    "channels_last": lambda hw, tmp: trained(train(tmp, "cl", channels_last=True), "bf16" if hw.bf16_native else
                                             "fp16", True),
    "compile": lambda hw, tmp: trained(train(tmp, "compile", compile_model=True, channels_last=False, epochs=1),
                                       "bf16" if hw.bf16_native else "fp16"),
    "batch_size=auto": check_auto_batch,
    "predict": check_predict,
    "export": check_export,
}
NEEDS = {"train bf16": "bf16_native", "train fp16 + GradScaler": "fp16_native"}


def run_check(name, check, hw, tmp):
    """'ok'|'failed'|'skipped', seconds, words."""
    if NEEDS.get(name) and not getattr(hw, NEEDS[name]):
        return "skipped", 0.0, f"not native on this GPU (capability {hw.capability})"
    start = time.perf_counter()
    try:
        words = check(hw, tmp)
        status = "ok"
    except Exception as exc:  # each check's failure is reported, the others still run
        traceback.print_exc(file=sys.stderr)
        status, words = "failed", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return status, time.perf_counter() - start, words


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    skip = [w for a in argv if a.startswith("skip=") for w in a[5:].split(",") if w]
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA GPU visible here: nothing to check")
        return 0
    from unet_amp.data import ensure_shapes_dataset
    from unet_amp.precision import detect_hardware

    hw = detect_hardware(torch.device("cuda", 0))
    print(f"gpu-check: {hw.name}, capability {hw.capability}, torch {torch.__version__}, CUDA {torch.version.cuda}")
    failed = 0
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        ensure_shapes_dataset(tmp / "data")
        for name, check in CHECKS.items():
            if any(word in name for word in skip):
                print(f"  {name:<24} skipped (skip=)", flush=True)
                continue
            status, seconds, words = run_check(name, check, hw, tmp)
            failed += status == "failed"
            print(f"  {name:<24} {status:<7} {seconds:6.1f}s  {words}", flush=True)
    print(f"gpu-check: {'all passed' if not failed else f'{failed} failed'}")
    return int(bool(failed))


if __name__ == "__main__":
    sys.exit(main())
