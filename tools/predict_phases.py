"""Where fit-mode predict's time goes: each of its steps timed alone, one after another on one thread.

    python tools/predict_phases.py                                   # 200 shapes images, bf16_cl (else fp32)
    python tools/predict_phases.py input=data/cells/images mode=fp32 rounds=5 batch_size=8

Per image, medians of `rounds` passes after an untimed one, in milliseconds and as a share of the
forward: reading (read_image), preprocessing (fit_input), stacking the batch, the forward, the masks
(cropped, resized back, thresholded: fit_masks, as predict_masks), the copy to the host and to numpy, PNG encoding, and
write_png into a new file and over the file a previous pass wrote (on ext4 the second also deletes the
old file). Predict runs the reading and writing on threads beside the forward where the model leaves a core
free, and between the forwards where torch's threads take every core; there the sum of the host steps is
about what they add (BENCHMARKS.md "Predict speed").
Keys: input (a folder of images; default: the embedded shapes set), checkpoint (default: a fresh
resnet18, CONFIG's), mode (fp32, fp32_cl, bf16, bf16_cl; default: bf16_cl where bf16 is native, else
fp32), rounds, batch_size, device (cpu, or cuda: there each device step is timed to its end, with a
synchronize, so "forward" is the GPU's time and "to numpy" the copy alone; tools/gpu_check.py runs it).
"""
import sys
import tempfile
import time
from pathlib import Path

import cv2
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_unet as T  # noqa: E402

TOOL_CONFIG = {"input": "", "checkpoint": "", "mode": "auto", "rounds": 3, "batch_size": 8, "device": "cpu"}
STEPS = ("read", "preprocess", "stack", "forward", "masks", "to numpy", "encode", "write, new file",
         "write, over a file")


def main(argv=None):
    T.keep_freed_memory()
    try:
        opts = T.parse_overrides(sys.argv[1:] if argv is None else argv, defaults=TOOL_CONFIG)
        with tempfile.TemporaryDirectory(prefix="predict_phases_") as tmp:
            ms, count, mode = measure(opts, Path(tmp))
    except T.UserError as exc:
        print(f"error: {T.user_message(exc)}", file=sys.stderr)
        return 2
    print(f"{T.describe(T.detect_hardware(opts['device']))}; {mode}, {count} images, batch {opts['batch_size']}, "
          f"{opts['rounds']} rounds, medians, ms per image")
    print(T.markdown_table([("step", "ms per image", "vs forward")] + [
        (step, f"{ms[step]:.3f}", f"{ms[step] / ms['forward']:.1%}") for step in STEPS]))
    return 0


def measure(opts, tmp):
    """({step: median ms per image}, images, mode) of opts' folder and checkpoint."""
    hw = T.detect_hardware(opts["device"])
    mode = tool_mode(opts["mode"], hw)
    dtype, nhwc = T.CPU_PROBE_MODES[mode]
    model, cfg = T.load_model(opts["checkpoint"] or fresh_checkpoint(tmp), hw)
    cfg = {**cfg, "data_mode": "fit", "channels_last": nhwc, "tta": "none"}
    model = model.to(memory_format=torch.channels_last if nhwc else torch.contiguous_format)
    prec = T.Precision.of(T.DTYPES[dtype], "predict_phases")
    paths = T.list_images(opts["input"] or T.generate_shapes_dataset(tmp / "shapes") / "images")
    (tmp / "out").mkdir()
    times = {step: [] for step in STEPS}
    for r in range(opts["rounds"] + 1):
        passed = dict.fromkeys(STEPS, 0.0)
        for i in range(0, len(paths), opts["batch_size"]):
            one_batch(model, paths[i:i + opts["batch_size"]], cfg, prec, hw, tmp / "out", r, passed)
        for step in STEPS if r else ():  # the first pass is untimed
            times[step].append(passed[step] * 1e3 / len(paths))
    return {step: float(np.median(v)) for step, v in times.items()}, len(paths), mode


def tool_mode(mode, hw):
    """The benchmark label a tool's mode= names: auto is bf16_cl where bf16 is native, else fp32."""
    mode = mode if mode != "auto" else "bf16_cl" if hw.bf16 else "fp32"
    if mode not in T.CPU_PROBE_MODES:
        raise T.UserError(f"mode={mode!r} is not allowed: use auto or one of {', '.join(T.CPU_PROBE_MODES)}")
    return mode


def one_batch(model, paths, cfg, prec, hw, out, r, passed):
    """Predict's steps for one batch, each timed alone into passed[step] (seconds)."""
    def timed(step, f, *args):
        start = time.perf_counter()
        result = f(*args)
        T.synchronize(hw)  # CUDA: the step's kernels done, not only launched
        passed[step] += time.perf_counter() - start
        return result
    with torch.inference_mode():
        images = [timed("read", T.read_image, p, cfg["in_channels"], cfg["intensity_range"]) for p in paths]
        x = timed("stack", T.stacked_inputs, [timed("preprocess", T.fit_input, image, cfg) for image in images], hw)
        logits = timed("forward", T.eval_forward, model, x, cfg, prec, hw)
        masks = timed("masks", T.fit_masks, logits, [image.shape[:2] for image in images], cfg)
    masks, ready = timed("to numpy", T.on_host, masks, hw)  # CUDA: the batch's copies, waited for (timed)
    for path, mask in zip(paths, masks):
        png = T.mask_to_png(timed("to numpy", lambda: mask.numpy()), cfg["num_classes"])
        timed("encode", cv2.imencode, ".png", png)
        timed("write, new file", T.write_png, out / f"{path.stem}_{r}.png", png)
        timed("write, over a file", T.write_png, out / f"{path.stem}.png", png)  # the previous pass's


def fresh_checkpoint(tmp):
    cfg = T.validate_config({**T.CONFIG, "encoder_weights": None})
    torch.manual_seed(cfg["seed"])
    T.save_checkpoint(tmp / "fresh.pt", {"model": T.build_model(cfg).state_dict(), "config": cfg})
    return tmp / "fresh.pt"


if __name__ == "__main__":
    sys.exit(main())
