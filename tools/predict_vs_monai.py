"""The sliding window (patch mode's predict) against MONAI's sliding_window_inference on one synthetic image:
the same model, window, overlap and Gaussian blend (sigma = window / 8); max logit difference and time.

    python tools/predict_vs_monai.py                          # a 1024x1024 image, a random resnet18 U-Net
    python tools/predict_vs_monai.py size=2048 rounds=5 checkpoint=checkpoints/best.pt

MONAI is this tool's own dependency (pip install monai), not the trainer's. Nothing is downloaded.
"""
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_unet as T  # noqa: E402
from unet_amp import config  # noqa: E402
from unet_amp.checkpoint import load_checkpoint, model_from_checkpoint  # noqa: E402
from unet_amp.common import UserError, run_guarded  # noqa: E402
from unet_amp.data import draw_shapes  # noqa: E402
from unet_amp.images import prepare_image  # noqa: E402
from unet_amp.model import build_model  # noqa: E402
from unet_amp.patches import TILE_BATCH, sliding_window_logits  # noqa: E402
from unet_amp.precision import detect_hardware, precision_for, resolve_device  # noqa: E402

TOOL_CONFIG = {"size": 1024, "rounds": 3, "checkpoint": None, "device": "auto"}


def load(opts, hw):
    """(model in eval mode on the device, the config its predict would use)."""
    if opts["checkpoint"]:
        state = load_checkpoint(opts["checkpoint"])
        return model_from_checkpoint(state, hw.device), {**state["config"], **state["data"], "tta": "none"}
    torch.manual_seed(0)
    cfg = {**T.CONFIG, "tta": "none", "intensity_range": None}
    return build_model(cfg).to(hw.device).eval(), cfg


def timed(runs, rounds):
    """Median seconds of each run, in alternating order per round after one untimed call each."""
    times = {name: [] for name in runs}
    for r in range(rounds + 1):
        for name in (list(runs) if r % 2 else list(runs)[::-1]):
            start = time.perf_counter()
            runs[name]()
            if r:
                times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def run(argv):
    opts, _ = config.parse_args(argv, TOOL_CONFIG)
    try:
        from monai.inferers import sliding_window_inference
    except ImportError:
        raise UserError("monai: not installed; pip install monai (this tool's own dependency)") from None
    hw = detect_hardware(resolve_device(opts["device"]))
    model, cfg = load(opts, hw)
    cfg = {**cfg, "patch_scale": 1.0}
    prec, window = precision_for("float32", False, "comparison in fp32"), cfg["image_size"]
    image = draw_shapes(np.random.default_rng(0), opts["size"])[0][..., :cfg["in_channels"]]
    prepared = prepare_image(image, cfg)
    x = torch.from_numpy(prepared.transpose(2, 0, 1).copy())[None]

    def monai():
        with torch.no_grad():
            return sliding_window_inference(x, (window, window), TILE_BATCH, lambda t: model(t).float(),
                                            overlap=cfg["tile_overlap"], mode="gaussian", sigma_scale=0.125,
                                            sw_device=hw.device, device="cpu")[0]

    ours, theirs = sliding_window_logits(model, prepared, cfg, prec, hw), monai()
    difference = (ours - theirs).abs().max().item()
    agree = ((ours.argmax(0) == theirs.argmax(0)) if len(ours) > 1 else ((ours > 0) == (theirs > 0))).float().mean()
    times = timed({"unet-amp": lambda: sliding_window_logits(model, prepared, cfg, prec, hw), "monai": monai},
                  opts["rounds"])
    print(f"{hw.name}; {opts['size']}x{opts['size']} image, {window} px tiles, overlap {cfg['tile_overlap']}, "
          f"{cfg['encoder_name']}, fp32; max |logit difference| {difference:.2e}; masks agree on {agree:.2%} of pixels")
    print("| run | median s | Mpx/s |\n|---|---|---|")
    for name, seconds in times.items():
        print(f"| {name} | {seconds:.3f} | {opts['size'] ** 2 / 1e6 / seconds:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(lambda: run(sys.argv[1:])))
