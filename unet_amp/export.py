"""The export command: a checkpoint -> model.onnx (fp32, dynamic batch/height/width) + model.json beside it,
written only once onnxruntime's logits match PyTorch's."""
from __future__ import annotations

import contextlib
import os
import sys
import warnings
from pathlib import Path

import torch

from unet_amp.checkpoint import DATA_FACTS, load_checkpoint, model_from_checkpoint
from unet_amp.common import UserError, atomic_write, atomic_write_json, say
from unet_amp.config import parse_args
from unet_amp.images import HIGH_PERCENTILE, LOW_PERCENTILE, mean_std
from unet_amp.predict import EXPORT_FORMAT, OnnxModel, logits_to_mask

__all__ = ["EXPORT_CONFIG", "OnnxModel", "export", "main"]

EXPORT_CONFIG = {
    "checkpoint": "checkpoints/best.pt",
    "output": "model.onnx",  # the .onnx file (its sidecar: the same name with .json), or a folder: <folder>/model.onnx
    "opset": 17,             # onnxruntime >= 1.14, TensorRT >= 8.6, OpenVINO >= 2023.0
    "check": True,           # compare onnxruntime with PyTorch before anything is written
}
# |onnxruntime - torch| <= ATOL + RTOL * max|torch|: fp32 rounding differs by ~1e-5, a wrong export by 0.1-1
LOGIT_ATOL, LOGIT_RTOL = 1e-3, 1e-4


def export_path(output):
    """The .onnx file `output` names (a folder, or a name without .onnx: <output>/model.onnx)."""
    path = Path(output)
    path = path if path.suffix.lower() == ".onnx" and not path.is_dir() else path / "model.onnx"
    if path.parent.name.lower() in ("images", "masks") and (path.parent.parent / "images").is_dir():
        raise UserError(f"output={output}: inside a data set's {path.parent.name}/ folder; give another folder")
    return path


@contextlib.contextmanager
def quiet_stdout():
    """fd 1 to /dev/null: the TorchScript exporter's C++ logging prints whole graphs there."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


def export_onnx(model, data, path, opset):
    """torch.onnx (TorchScript exporter, dynamo=False) at image_size, batch/height/width dynamic; onnx.checker."""
    import onnx

    x = torch.zeros(2, data["in_channels"], data["image_size"], data["image_size"])
    dims = {0: "batch", 2: "height", 3: "width"}
    try:
        with warnings.catch_warnings(), quiet_stdout():
            warnings.simplefilter("ignore")
            torch.onnx.export(model, (x,), str(path), dynamo=False, opset_version=opset, input_names=["image"],
                              output_names=["logits"], dynamic_axes={"image": dims, "logits": dims})
        onnx.checker.check_model(str(path), full_check=True)
    except (OSError, KeyboardInterrupt):
        raise
    except Exception as exc:  # the exporter's and the checker's errors share no base class
        raise UserError(f"arch={data['arch']}: torch.onnx cannot export it ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0] if str(exc) else ''}); nothing written") from None


@torch.inference_mode()
def check_export(model, path, data):
    """onnxruntime vs PyTorch, fp32 on the CPU, on random inputs of two sizes: max |logit difference| and mask
    agreement; a UserError past the tolerance."""
    session, gen, size = OnnxModel(path), torch.Generator().manual_seed(0), data["image_size"]
    worst, scale, same, pixels = 0.0, 0.0, 0, 0
    for h, w in ((size, size), (size + 32, 2 * size)):
        x = torch.randn(2, data["in_channels"], h, w, generator=gen)
        want, got = model(x).float(), session(x)
        if got.shape != want.shape:
            raise UserError(f"arch={data['arch']}: the export gives logits {tuple(got.shape)}, torch "
                            f"{tuple(want.shape)}; this architecture does not export")
        worst, scale = max(worst, (got - want).abs().max().item()), max(scale, want.abs().max().item())
        for a, b in zip(want, got):
            same += int((logits_to_mask(a, data["num_classes"]) == logits_to_mask(b, data["num_classes"])).sum())
            pixels += h * w
    tolerance = LOGIT_ATOL + LOGIT_RTOL * scale
    check = {"max_abs_logit_difference": worst, "tolerance": tolerance, "mask_agreement": same / pixels}
    if not worst <= tolerance:  # NaN fails too
        raise UserError(f"arch={data['arch']}: onnxruntime differs from torch by {worst:.3g} > {tolerance:.1e}; "
                        f"torch.onnx does not export this model faithfully, nothing written")
    return check


def sidecar(data, path, cfg, check):
    """model.json: what predict (or tools/onnx_predict.py) needs beside the graph."""
    mean, std = ([float(v) for v in values] for values in mean_std(data["in_channels"]))  # normalize's
    return {"format": EXPORT_FORMAT, "version": 2, "onnx": path.name, "input": "image", "output": "logits",
            **{k: data.get(k) for k in DATA_FACTS}, "tta": data.get("tta") or "none", "arch": data["arch"],
            "encoder_name": data["encoder_name"], "mean": mean, "std": std, "pad": 0.0,
            "own_range_percentiles": [LOW_PERCENTILE, HIGH_PERCENTILE],
            "mask": "binary: logit > 0 -> 255; else argmax", "exported_from": str(cfg["checkpoint"]),
            "opset": cfg["opset"], "check": check}


def export(cfg):
    """Write <output>.onnx and its .json sidecar (both atomically, after the check); returns the .onnx path."""
    cfg = {**EXPORT_CONFIG, **cfg}
    path = export_path(cfg["output"])
    state = load_checkpoint(cfg["checkpoint"])
    data = {**state["config"], **state["data"]}
    model = model_from_checkpoint(state, "cpu")
    say(f"export: {cfg['checkpoint']} ({data['arch']}/{data['encoder_name']}) -> {path}, fp32, opset {cfg['opset']}")
    check = {}

    def write(tmp):
        export_onnx(model, data, tmp, cfg["opset"])
        if cfg["check"]:
            check.update(check_export(model, tmp, data))

    atomic_write(path, write)
    atomic_write_json(path.with_suffix(".json"), sidecar(data, path, cfg, check))
    if check:
        say(f"check: max |logit difference| {check['max_abs_logit_difference']:.2e} (tolerance "
            f"{check['tolerance']:.1e}); masks agree on {check['mask_agreement']:.4%} of pixels")
    say(f"wrote {path} and {path.with_suffix('.json')}; predict: backend=onnxruntime checkpoint={path}")
    return path


def main(argv):
    """`export key=value...`: exit code 0 (errors are raised as UserError for the caller's guard)."""
    cfg, _ = parse_args(argv, EXPORT_CONFIG)
    export(cfg)
    return 0
