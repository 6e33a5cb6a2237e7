"""The predict command: masks for new images from a checkpoint (or an ONNX export), at each image's original size."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import cv2
import numpy as np
import torch

from unet_amp.checkpoint import DATA_FACTS, OLD_RULE, load_checkpoint, model_from_checkpoint
from unet_amp.common import IMAGE_EXTS, UserError, atomic_write_json, say
from unet_amp.config import check_choices, parse_args
from unet_amp.images import CLIP_NOTE, clipped_share, prepare_image, read_image, write_png
from unet_amp.patches import TTA_VIEWS, fit_logits, sliding_window_logits
from unet_amp.precision import detect_hardware, precision_for

PREDICT_CONFIG = {
    "checkpoint": "checkpoints/best.pt",  # a .pt; backend=onnxruntime: a .onnx or the folder export wrote
    "input": "data/shapes/images",        # an image file or a folder of images
    "output": "predictions",              # <stem>.png per image: 0/255 when binary, class indices else
    "device": "auto",
    "batch_size": 8,                      # fit mode: images per forward (patch mode: one image, 8 tiles)
    "tta": "checkpoint",                  # "checkpoint" (the run's) | "none" | "flip" | "d4"
    "amp": "auto",                        # "auto" (bf16 where native, else fp32) | "fp32" | "bf16" | "fp16"
    "backend": "torch",                   # "torch" | "onnxruntime"
    "progress": True,
}
CHOICES = {"tta": ("checkpoint", *TTA_VIEWS), "amp": ("auto", "fp32", "bf16", "fp16"),
           "backend": ("torch", "onnxruntime")}
MANIFEST = "predict.json"  # in the output folder: the masks predict wrote there (it may overwrite only those)
EXPORT_FORMAT = "unet-amp export"


# ---------------------------------------------------------------------------------------------------
# The exported model, called as predict calls a torch module
# ---------------------------------------------------------------------------------------------------
class OnnxModel:
    """An onnxruntime session called like the torch model: a float32 NCHW batch in, fp32 logits out."""

    def __init__(self, path, device="cpu"):
        import onnxruntime as ort

        gpu = torch.device(device).type == "cuda" and "CUDAExecutionProvider" in ort.get_available_providers()
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        try:
            self.session = ort.InferenceSession(str(path), options, providers=["CUDAExecutionProvider"] * gpu
                                                + ["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime's load errors share no base class
            raise UserError(f"{path}: not a readable ONNX model ({type(exc).__name__}); export it again") from None
        self.input, self.output = self.session.get_inputs()[0].name, self.session.get_outputs()[0].name

    def __call__(self, x):
        y = self.session.run([self.output], {self.input: np.ascontiguousarray(x.detach().float().cpu().numpy())})[0]
        return torch.from_numpy(y).to(x.device)

    def eval(self):
        return self


def read_export(path):
    """(the .onnx path, its model.json dict) from a .onnx, a model.json, or the folder export wrote."""
    path = Path(path)
    sidecar = path / "model.json" if path.is_dir() else path.with_suffix(".json")
    try:
        meta = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"{sidecar}: unreadable export sidecar ({type(exc).__name__}); run export again") from None
    if not isinstance(meta, dict) or meta.get("format") != EXPORT_FORMAT or any(k not in meta for k in DATA_FACTS):
        raise UserError(f"{sidecar}: not a model.json written by export; run export again")
    if meta.get("version", 1) < 2:
        say(f"note: {sidecar}: {OLD_RULE}")
    onnx_path = path if path.suffix.lower() == ".onnx" else sidecar.parent / meta["onnx"]
    if not onnx_path.is_file():
        raise UserError(f"{onnx_path}: not found beside {sidecar.name}; keep the two files of an export together")
    return onnx_path, meta


def load_predictor(cfg, hw):
    """(model, the run's facts: DATA_FACTS, channels_last) for the backend: a torch checkpoint or an ONNX export."""
    if cfg["backend"] == "onnxruntime":
        onnx_path, meta = read_export(cfg["checkpoint"])
        return OnnxModel(onnx_path, hw.device), {**{k: meta[k] for k in DATA_FACTS}, "channels_last": False}
    if Path(cfg["checkpoint"]).suffix.lower() in (".onnx", ".json") or Path(cfg["checkpoint"]).is_dir():
        raise UserError(f"checkpoint={cfg['checkpoint']}: an exported model; add backend=onnxruntime, or give a .pt")
    state = load_checkpoint(cfg["checkpoint"])
    facts = {"tta": "none", **state["data"], "channels_last": state.get("precision", {}).get("channels_last", False)}
    return model_from_checkpoint(state, hw.device), facts


def predict_precision(cfg, hw, facts):
    """fp32 for ONNX; amp=auto: bf16 where the hardware has native bf16, else fp32; else what amp names."""
    if cfg["backend"] == "onnxruntime":
        return precision_for("fp32", False, "onnxruntime runs the fp32 graph")
    if cfg["amp"] == "auto":
        name = "bf16" if hw.bf16_native else "fp32"
        return precision_for(name, facts["channels_last"], f"amp=auto on {hw.name}")
    return precision_for(cfg["amp"], facts["channels_last"], f"amp={cfg['amp']}")


# ---------------------------------------------------------------------------------------------------
# Inputs and the output folder (never a data folder, never a file predict did not write)
# ---------------------------------------------------------------------------------------------------
def list_images(path):
    """The image file given, or the images (IMAGE_EXTS, not hidden) directly in the folder given, sorted."""
    path = Path(path)
    if path.is_file():
        if path.suffix.lower() not in IMAGE_EXTS:
            raise UserError(f"input={path}: not an image ({', '.join(IMAGE_EXTS)}); convert it or give a folder")
        return [path]
    if not path.is_dir():
        raise UserError(f"input={path}: not found; give an image file or a folder of images")
    images = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_EXTS and not p.name.startswith(".")
                    and not p.is_dir())
    if not images:
        raise UserError(f"input={path}: no images ({', '.join(IMAGE_EXTS)}) in it; give a folder of images")
    return images


def output_names(paths):
    """<stem>.png per image; two images of one stem would write one mask: refused."""
    names = {}
    for path in paths:
        name = path.stem + ".png"
        if name in names:
            raise UserError(f"{path}: same name as {names[name]}, both would write {name}; rename one")
        names[name] = path
    return list(names)


def written_before(out):
    """The names a previous predict wrote into `out` (its manifest), else an empty set."""
    try:
        return set(json.loads((out / MANIFEST).read_text(encoding="utf-8"))["written"])
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def check_output(out, source):
    """Refuse the input folder, a data set's masks/ folder, and a folder holding files predict did not write."""
    folder = source if source.is_dir() else source.parent
    if out.exists() and not out.is_dir():
        raise UserError(f"output={out}: a file, not a folder; give a folder for the masks")
    if out.resolve() == folder.resolve():
        raise UserError(f"output={out}: the input folder; give another folder, the images stay untouched")
    if out.name.lower() == "masks" and (out.parent / "images").is_dir():
        raise UserError(f"output={out}: the masks/ folder of a data set (ground truth); give another folder")
    if out.is_dir():
        ours = written_before(out) | {MANIFEST}
        theirs = sorted(p.name for p in out.iterdir() if p.name not in ours and not p.name.startswith("."))
        if theirs:
            raise UserError(f"output={out}: holds {theirs[0]} (and {len(theirs) - 1} more) that predict did not "
                            f"write; give a new or empty folder")


def logits_to_mask(logits, num_classes):
    """CxHxW logits -> HxW uint8: 0/255 when binary (logit > 0), class indices else."""
    if num_classes == 1:
        return ((logits[0] > 0).numpy() * 255).astype(np.uint8)
    return logits.argmax(0).numpy().astype(np.uint8)


# ---------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------
def check_keys(cfg):
    check_choices(cfg, CHOICES)
    if not isinstance(cfg["batch_size"], int) or cfg["batch_size"] < 1:
        raise UserError(f"batch_size={cfg['batch_size']!r}: must be a whole number >= 1")


def read_batch(paths, facts, failed):
    """(paths read, prepared images); an unreadable file is named on stderr and added to `failed`."""
    read, images = [], []
    for path in paths:
        try:
            image = read_image(path)
            images.append(prepare_image(image, facts, path))
            read.append(path)
            share = clipped_share(image, facts["intensity_range"])
            if share > CLIP_NOTE:
                say(f"note: {path}: {share:.0%} of its pixels lie outside intensity_range {facts['intensity_range']}"
                    f" and are clipped")
        except (UserError, OSError, ValueError, cv2.error) as exc:
            line = f"error: {exc}" if str(path) in str(exc) else f"error: {path}: cannot read it ({exc})"
            print(line, file=sys.stderr, flush=True)
            failed.append(str(path))
    return read, images


def run_batches(model, paths, out, facts, prec, hw, cfg):
    """Predict every image, batch by batch; returns (masks written, images that failed)."""
    from tqdm import tqdm

    per_batch = 1 if facts["data_mode"] == "patch" else cfg["batch_size"]
    written, failed = [], []
    with tqdm(total=len(paths), desc="predict", disable=not cfg["progress"], dynamic_ncols=True) as bar:
        for start in range(0, len(paths), per_batch):
            read, images = read_batch(paths[start:start + per_batch], facts, failed)
            if images and facts["data_mode"] == "patch":
                logits = [sliding_window_logits(model, images[0], facts, prec, hw)]
            elif images:
                logits = fit_logits(model, images, facts, prec, hw)
            for path, y in zip(read, logits if images else []):
                write_png(out / (path.stem + ".png"), logits_to_mask(y, facts["num_classes"]))
                written.append(str(out / (path.stem + ".png")))
            bar.update(len(paths[start:start + per_batch]))
    return written, failed


@torch.inference_mode()
def predict(cfg):
    """Masks for cfg["input"] into cfg["output"]; returns {"written": [mask paths], "failed": [image paths]}."""
    cfg = {**PREDICT_CONFIG, **cfg}
    check_keys(cfg)
    source, out = Path(cfg["input"]), Path(cfg["output"])
    paths = list_images(source)
    names = output_names(paths)
    check_output(out, source)
    hw = detect_hardware(cfg["device"])
    model, facts = load_predictor(cfg, hw)
    facts["tta"] = (facts.get("tta") or "none") if cfg["tta"] == "checkpoint" else cfg["tta"]
    prec = predict_precision(cfg, hw, facts)
    say(f"predict: {len(paths)} image(s) from {source} -> {out} ({cfg['backend']}, {prec.name} on {hw.name}, "
        f"data_mode={facts['data_mode']}, tta={facts['tta']})")
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / MANIFEST, {"written": sorted(written_before(out) | set(names)),
                                       "checkpoint": str(cfg["checkpoint"])})
    written, failed = run_batches(model, paths, out, facts, prec, hw, cfg)
    say(f"wrote {len(written)} mask(s) to {out}" + (f"; {len(failed)} image(s) unreadable" if failed else ""))
    return {"written": written, "failed": failed}


def main(argv):
    """`predict key=value...`: exit code 0, or 1 where an image could not be read (the others are written)."""
    cfg, _ = parse_args(argv, PREDICT_CONFIG)
    return 1 if predict(cfg)["failed"] else 0
