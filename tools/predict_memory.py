"""Peak host memory of `predict` on one large generated image, each run in a fresh process.

    python tools/predict_memory.py side=6000 classes=3                   # patch mode: the mask in bands vs whole
    python tools/predict_memory.py side=33000 classes=1 data_mode=fit channels=1 masks=banded

Writes a side x side PNG (a blurred random image, or `channels=1` gray; kept under checkpoints/ for the next
run) and a fresh Unet(resnet18) checkpoint of `classes` classes in `data_mode`, then runs the predict
command on it in a fresh process per row and reports: predict's own time, the process's peak resident
memory before predict (torch and the script loaded) and at its end, the difference, and predict's lower bound of
what the image needs (train_unet.predict_memory). Rows (`masks=`):
- banded: the script as it is (the mask made in bands of rows, train_unet.mask_tensor);
- whole: the mask made from the whole image at once (an int64 argmax over every pixel), as before.
"""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]
import train_unet as T  # noqa: E402

TOOL_CONFIG = {"side": 6000, "classes": 3, "data_mode": "patch", "channels": 3, "masks": "banded,whole",
               "folder": "checkpoints/predict_memory"}


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        return child(*argv[1:])
    try:
        opts = T.parse_overrides(argv, defaults=TOOL_CONFIG)
    except T.UserError as exc:
        print(f"error: {T.user_message(exc)}", file=sys.stderr)
        return 2
    folder = Path(opts["folder"]) / f"{opts['side']}_{opts['channels']}ch"
    image, checkpoint = make_inputs(folder, opts)
    need = T.predict_memory(*T.image_header(image), {"num_classes": opts["classes"], "in_channels": opts["channels"]})
    lines = [("masks", "predict s", "peak before predict", "peak at the end", "predict's share", "lower bound")]
    for masks in [m.strip() for m in opts["masks"].split(",") if m.strip()]:
        out = subprocess.run([sys.executable, __file__, "--child", str(checkpoint), str(image.parent),
                              str(folder / f"out_{masks}"), masks], check=True, capture_output=True, text=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        lines.append((masks, f"{r['seconds']:.1f}", f"{r['before_mb']:.0f} MB", f"{r['peak_mb']:.0f} MB",
                      f"{r['peak_mb'] - r['before_mb']:.0f} MB", T.size_text(need)))
    print(f"{T.describe(T.detect_hardware('cpu'))}; {opts['side']}² x {opts['channels']} channel(s), "
          f"{opts['classes']} class(es), data_mode={opts['data_mode']}; free memory {T.size_text(T.available_memory())}")
    print(T.markdown_table(lines))
    return 0


def make_inputs(folder, opts):
    """The image (written once, kept) and a fresh model's checkpoint for these settings."""
    import cv2
    import torch

    image = folder / "in" / "scene.png"
    if not image.is_file():
        image.parent.mkdir(parents=True, exist_ok=True)
        shape = (opts["side"], opts["side"]) + ((3,) if opts["channels"] == 3 else ())
        pixels = np.random.default_rng(0).integers(0, 256, shape, dtype=np.uint8)
        T.write_png(image, cv2.GaussianBlur(pixels, (0, 0), 3))
    cfg = T.validate_config({**T.CONFIG, "num_classes": opts["classes"], "data_mode": opts["data_mode"],
                             "in_channels": opts["channels"], "device": "cpu"})
    torch.manual_seed(0)
    model = T.build_model({**cfg, "encoder_weights": None})
    T.save_checkpoint(folder / "model.pt", {"model": model.state_dict(), "config": cfg})
    return image, folder / "model.pt"


def child(checkpoint, inputs, output, masks):
    import torch

    T.keep_freed_memory()
    if masks == "whole":
        T.mask_tensor = lambda logits, n: ((logits[0] > 0) if n == 1 else logits.argmax(0)).to(torch.uint8)
    before = status_mb("VmHWM")
    result = T.predict({"checkpoint": checkpoint, "input": inputs, "output": output, "progress": False,
                        "cpu_probe": False, "device": "cpu"})  # host memory: on a GPU fit mode's logits stay there
    assert result["predicted"] == 1, result["failed"]
    print(json.dumps({"seconds": result["seconds"], "before_mb": before,
                      "peak_mb": status_mb("VmHWM")}))
    return 0


def status_mb(field):
    """A memory figure of this process from /proc/self/status, in MB. VmHWM is the peak resident memory of
    this program only (getrusage's ru_maxrss also counts the parent's, from before the child started)."""
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1]) / 1024


if __name__ == "__main__":
    sys.exit(main())
