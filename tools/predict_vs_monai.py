"""Sliding-window predict against MONAI's sliding_window_inference, side by side in one process.

    python tools/predict_vs_monai.py                         # a 2048x2048 scene, resnet18, 128 px tiles
    python tools/predict_vs_monai.py size=4000 trivial=True  # the host work alone (a 1x1 conv as the model)
    python tools/predict_vs_monai.py checkpoint=checkpoints/best.pt size=4000 rounds=5

Same model, window (image_size), overlap (tile_overlap), Gaussian blending (sigma = window / 8), tiles per
forward (tile_batch_size), precision and layout, output on the CPU. Timed in alternating rounds (the order
flipping each round, after an untimed round), medians:
- forward only: the model over the same tile batches, cut and normalised beforehand (model_inputs): the floor;
- unet-amp: predict_logits on the image as read (scaling, normalisation, tiling, blending included);
- monai: sliding_window_inference on the image normalised beforehand (not timed);
- monai + normalise: the same with the normalisation of the whole image timed too.
trivial=True puts a 1x1 convolution in the model's place, so what is left is the host work.
reference=path/to/an/older/train_unet.py adds its predict_logits as a row: a change measured side by side.
MONAI is a dependency of this tool only (pip install monai), not of the trainer. Any other key=value
is a training config key (data_mode=patch is set here), as for train_unet.py.
"""
import sys
from pathlib import Path

import numpy as np
import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]
import train_unet as T  # noqa: E402
from make_scenes import draw_scene  # noqa: E402

TOOL_CONFIG = {"size": 2048, "rounds": 3, "trivial": False, "checkpoint": "", "reference": ""}
DEFAULTS = ["data_mode=patch", "image_size=128", "encoder_name=resnet18", "tile_overlap=0.25", "tile_batch_size=8"]


def main(argv=None):
    T.keep_freed_memory()  # freed memory kept for reuse, as the script's commands run
    argv = sys.argv[1:] if argv is None else argv
    try:
        rows, facts, megapixels = run(argv)
    except T.UserError as exc:
        print(f"error: {T.user_message(exc)}", file=sys.stderr)
        return 2
    print(facts)
    print(T.markdown_table([("run", "median s", "Mpx/s", "vs forward only")] + [
        (name, f"{s:.2f}", f"{megapixels / s:.2f}", f"{s / rows['forward only']:.3f}x")
        for name, s in rows.items()]))
    return 0


def run(args):
    """({run: median seconds}, a line saying what was timed, the image's megapixels)."""
    tool_args = [a for a in args if T.normalize_key(a.partition("=")[0]) in TOOL_CONFIG]
    opts = T.parse_overrides(tool_args, defaults=TOOL_CONFIG)
    try:
        from monai.inferers import sliding_window_inference  # this tool's own dependency
    except ImportError:
        raise T.UserError("this tool compares with MONAI, which is not installed here: pip install monai "
                          "(the trainer itself does not need it)") from None
    model, cfg, hw, prec = load(opts, [a for a in args if a not in tool_args])
    image = draw_scene(np.random.default_rng(0), opts["size"], opts["size"])[0]
    if cfg["in_channels"] == 1:
        image = image[..., 0]
    size, inputs = cfg["image_size"], T.model_inputs([image], cfg, hw, cfg["tile_batch_size"])
    tiles, normalised = sum(len(x) for x in inputs), normalise(image, cfg)

    def forward_only():
        for x in inputs:
            T.eval_forward(model, x, cfg, prec, hw).float().cpu()

    def monai(x):
        predictor = lambda t: T.eval_forward(model, t, cfg, prec, hw).float()  # noqa: E731
        return sliding_window_inference(x, (size, size), cfg["tile_batch_size"], predictor, cfg["tile_overlap"],
                                        mode="gaussian", sigma_scale=0.125, sw_device=hw.device, device="cpu")
    runs = {"forward only": forward_only, "unet-amp": lambda: T.predict_logits(model, image, cfg, prec, hw),
            "monai": lambda: monai(normalised), "monai + normalise": lambda: monai(normalise(image, cfg))}
    if opts["reference"]:
        old = reference_module(opts["reference"])
        runs["reference unet-amp"] = lambda: old.predict_logits(model, image, cfg, prec, hw)
    with torch.inference_mode():
        agree = (T.predict_logits(model, image, cfg, prec, hw) - monai(normalised)[0]).abs().max().item()
        times = T.alternate_timings(runs, opts["rounds"], hw)
    facts = (f"{T.describe(hw)}; {opts['size']}x{opts['size']} image, {tiles} tiles of {size} px, "
                  f"{cfg['tile_batch_size']} per forward, overlap {cfg['tile_overlap']}; "
                  f"{'a 1x1 conv (host work only)' if opts['trivial'] else cfg['encoder_name']}, {prec.name}, "
                  f"{'NHWC' if cfg['channels_last'] else 'NCHW'}; {opts['rounds']} rounds; "
             f"max |logit difference| unet-amp vs monai {agree:.2e}")
    return {name: float(np.median(t)) for name, t in times.items()}, facts, opts["size"] ** 2 / 1e6


def reference_module(path):
    import importlib.util
    spec = importlib.util.spec_from_file_location("reference_train_unet", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def load(opts, train_args):
    """(model in eval mode on the device, cfg with the layout resolved, hardware, precision)."""
    hw = T.detect_hardware(T.parse_overrides(train_args)["device"])
    if opts["checkpoint"]:
        model, cfg = T.load_model(Path(opts["checkpoint"]), hw)
        cfg = T.parse_overrides(train_args, base=cfg)
    else:
        cfg = T.validate_config(T.parse_overrides(with_defaults(train_args)))
        torch.manual_seed(0)
        model = T.build_model(cfg).to(hw.device)
    if opts["trivial"]:
        model = torch.nn.Conv2d(cfg["in_channels"], cfg["num_classes"], 1).to(hw.device)
    prec = T.decide_precision(hw, cfg["use_amp"], cfg["amp_dtype"], cfg["force_amp_dtype"])
    cfg = {**cfg, "channels_last": T.decide_channels_last({**cfg, "batch_size": cfg["tile_batch_size"]}, hw,
                                                          prec)[0]}
    model = model.to(memory_format=torch.channels_last) if cfg["channels_last"] else model
    return model.eval(), cfg, hw, prec


def with_defaults(args):
    """This tool's DEFAULTS with the given key=value settings, a given key replacing its default."""
    given = {T.normalize_key(a.partition("=")[0]) for a in args}
    return [d for d in DEFAULTS if T.normalize_key(d.partition("=")[0]) not in given] + list(args)


def normalise(image, cfg):
    """The whole image scaled and normalised as the sliding window's tiles are: 1 x C x H x W float32."""
    scaled = T.rescale(image, None, cfg["patch_scale"])[0]
    return T.image_tensor(T.normalizer(cfg)(scaled))[None]


if __name__ == "__main__":
    sys.exit(main())
