"""The `predict` command: masks for new images from a checkpoint, at each image's original size.

Two tiny models are trained once for the whole module (32x32, 1 epoch, fp32, a few seconds each):
a binary RGB one and a 3-class grayscale (in_channels=1) one. Everything else is inference.
"""
import copy
import errno
import os
import sys
import threading
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import train_unet  # noqa: E402

SIZE = 32


def train_tiny(root, **overrides):
    data = train_unet.generate_shapes_dataset(root / "data", count=10, size=SIZE,
                                              num_classes=overrides.get("num_classes", 1))
    cfg = dict(data_dir=str(data), checkpoint_dir=str(root / "ckpt"), image_size=SIZE, epochs=1,
               max_train_images=8, batch_size=2, use_amp=False, encoder_name="resnet18",
               encoder_weights=None, device="cpu", progress=False, num_workers=0)
    cfg.update(overrides)
    train_unet.train(cfg)
    ckpt = root / "ckpt" / "last.pt"
    assert ckpt.is_file()
    return ckpt, data


@pytest.fixture(scope="module")
def binary_model(tmp_path_factory):
    """(checkpoint path, data dir) of a binary RGB model."""
    return train_tiny(tmp_path_factory.mktemp("binary"))


@pytest.fixture(scope="module")
def multiclass_model(tmp_path_factory):
    """(checkpoint path, data dir) of a 3-class grayscale (in_channels=1) model."""
    return train_tiny(tmp_path_factory.mktemp("multi"), num_classes=3, in_channels=1)


@pytest.fixture(scope="module")
def hw():
    return train_unet.detect_hardware("cpu")


@pytest.fixture(scope="module")
def fp32(hw):
    return train_unet.decide_precision(hw, use_amp=False)


def opts(ckpt, inp, out, **kw):
    return {**train_unet.PREDICT_CONFIG, "checkpoint": str(ckpt), "input": str(inp), "output": str(out),
            "device": "cpu", "use_amp": False, "progress": False, **kw}


def read_png(path):
    image = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    assert image is not None, f"{path} was not written or is not an image"
    return image


def write_odd_images(folder, source_dir):
    """Real shape images resized to awkward sizes, RGB and grayscale: {stem: (h, w)}."""
    folder.mkdir(parents=True, exist_ok=True)
    src = cv2.imread(str(sorted((Path(source_dir) / "images").glob("*.png"))[0]), cv2.IMREAD_COLOR)
    sizes = {"rgb_45x77": (45, 77, True), "gray_100x50": (100, 50, False), "rgb_7x10": (7, 10, True),
             "gray_1x200": (1, 200, False), "rgb_131x33": (131, 33, True)}
    for stem, (h, w, colour) in sizes.items():
        image = cv2.resize(src, (w, h), interpolation=cv2.INTER_LINEAR)
        if not colour:
            image = cv2.cvtColor(image, cv2.COLOR_BGR2GRAY)
            assert image.ndim == 2
        assert cv2.imwrite(str(folder / f"{stem}.png"), image)
    return {stem: (h, w) for stem, (h, w, _) in sizes.items()}


def centre_head_bias(model, x, width=None):
    """Shift the final bias so the logits straddle the decision threshold on these images.

    A 1-epoch model may predict all background; then "masks equal" would be vacuous. Shifting by
    the median logit (per class; over the first `width` columns if given) puts pixels on both
    sides of the threshold.
    """
    head = model.segmentation_head[0]
    with torch.no_grad():
        logits = model(x)[..., :width]
        median = logits.transpose(0, 1).reshape(logits.shape[1], -1).median(dim=1).values
        head.bias -= median


# ---------------------------------------------------------------------------------------------------
# a. predictions are exactly what validation computes
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["binary", "multiclass"])
def test_predict_batch_equals_validation_forward(which, request, hw, fp32):
    ckpt, data = request.getfixturevalue(f"{which}_model")
    model, cfg = train_unet.load_model(ckpt, hw)
    assert not model.training
    pairs = train_unet.find_pairs(data)  # every image is already image_size x image_size
    dataset = train_unet.SegDataset(pairs, cfg, train=False)
    loader = DataLoader(dataset, batch_size=len(pairs), shuffle=False)
    x, _ = next(iter(loader))
    binary = cfg["num_classes"] == 1
    centre_head_bias(model, x)

    # Run the real validation loop and capture the logits it computes.
    captured = []
    handle = model.register_forward_hook(lambda m, i, out: captured.append(out.detach().clone()))
    try:
        train_unet.evaluate(model, loader, train_unet.SegLoss(cfg["num_classes"]), fp32, hw, cfg)
    finally:
        handle.remove()
    assert len(captured) == 1
    logits = captured[0]
    expected = (logits[:, 0] > 0) if binary else logits.argmax(1)
    expected = expected.to(torch.uint8).numpy()

    images = [train_unet.read_image(img, cfg["in_channels"]) for img, _ in pairs]
    masks = train_unet.predict_batch(model, images, cfg, fp32, hw)
    assert len(masks) == len(images)
    if binary:
        assert len(np.unique(expected)) == 2, "test setup: the centred logits should straddle 0"
    for i, (mask, want) in enumerate(zip(masks, expected)):
        assert mask.dtype == np.uint8
        assert mask.shape == want.shape == (SIZE, SIZE)
        assert np.array_equal(mask, want), f"image {i}: {int((mask != want).sum())} pixels differ"


def test_predict_command_writes_the_validation_masks(binary_model, hw, fp32, tmp_path):
    """End to end: predict() on the data folder writes mask*255 of the validation forward pass."""
    ckpt, data = binary_model
    result = train_unet.predict(opts(ckpt, data / "images", tmp_path / "out"))
    model, cfg = train_unet.load_model(ckpt, hw)
    pairs = train_unet.find_pairs(data)
    dataset = train_unet.SegDataset(pairs, cfg, train=False)
    x = torch.stack([dataset[i][0] for i in range(len(dataset))])
    with torch.no_grad():
        expected = (model(x)[:, 0] > 0).to(torch.uint8).numpy() * 255
    assert result["predicted"] == len(pairs) and result["failed"] == []
    assert result["precision"] == "fp32"
    assert Path(result["output"]) == tmp_path / "out"
    for (image_path, _), want in zip(pairs, expected):
        got = read_png(tmp_path / "out" / f"{image_path.stem}.png")
        assert got.ndim == 2 and got.dtype == np.uint8
        assert np.array_equal(got, want), image_path.name


def test_predict_batch_runs_under_inference_mode(binary_model, hw, fp32):
    ckpt, data = binary_model
    model, cfg = train_unet.load_model(ckpt, hw)
    seen = []
    model.register_forward_hook(lambda m, i, out: seen.append((torch.is_inference_mode_enabled(),
                                                               out.requires_grad)))
    image = train_unet.read_image(sorted((data / "images").glob("*.png"))[0], 3)
    train_unet.predict_batch(model, [image], cfg, fp32, hw)
    assert seen == [(True, False)]
    assert all(p.grad is None for p in model.parameters())


def test_loading_a_model_draws_no_random_weights(binary_model, hw):
    """load_model builds the model on the meta device and takes the checkpoint's tensors as its weights: no
    random initialisation (resnet18: 146 -> 31 ms on a 2-core Xeon), so for this RGB model the caller's random
    stream is as it was (smp's first-conv patch for other channel counts still draws numbers on the CPU, where
    meta does not reach), and every parameter and buffer is the checkpoint's, on the device, none on meta."""
    ckpt, _ = binary_model
    state = train_unet.load_checkpoint(ckpt)["model"]
    before = torch.get_rng_state()
    model, _ = train_unet.load_model(ckpt, hw)
    assert torch.equal(before, torch.get_rng_state())
    loaded = model.state_dict()
    assert loaded.keys() == state.keys() and all(torch.equal(loaded[k], state[k]) for k in state)
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}


@pytest.mark.parametrize("trouble", ["cannot be built on meta", "keeps a buffer of its own", "keeps a tensor"])
def test_a_model_that_meta_cannot_hold_is_loaded_as_usual(binary_model, hw, monkeypatch, trouble):
    """An encoder that reads a value while built (mit_b*: Tensor.item() on the meta device), or a model with a
    tensor the checkpoint does not hold (a non-persistent buffer, a plain tensor attribute: left on meta), is
    built as usual and the checkpoint's weights copied in: the same model, no meta tensor left."""
    ckpt, _ = binary_model
    build = train_unet.build_model

    def troubled(cfg):
        if trouble == "cannot be built on meta" and torch.empty(0).is_meta:
            raise RuntimeError("Tensor.item() cannot be called on meta tensors")
        model = build(cfg)
        if trouble == "keeps a tensor":
            model.encoder.table = torch.arange(3.0)
        else:
            model.register_buffer("table", torch.arange(3.0), persistent=False)
        return model
    monkeypatch.setattr(train_unet, "build_model", troubled)
    model, _ = train_unet.load_model(ckpt, hw)
    state = train_unet.load_checkpoint(ckpt)["model"]
    assert all(torch.equal(model.state_dict()[k], state[k]) for k in state)
    table = model.encoder.table if trouble == "keeps a tensor" else model.table
    assert torch.equal(table, torch.arange(3.0))
    assert {t.device.type for t in [*model.parameters(), *model.buffers()]} == {"cpu"}


def test_a_checkpoint_of_a_channels_last_model_loads_in_nchw(binary_model, hw, tmp_path):
    """torch.save keeps a tensor's strides: a run trained channels_last saved NHWC weights, and assigning them
    kept that layout, so an NCHW predict (the probe's or the user's choice) ran a mixed layout (logits up to
    2e-5 off the NCHW model's). Loaded, the weights are NCHW, as a copy into a fresh model gave them."""
    ckpt, _ = binary_model
    state = train_unet.load_checkpoint(ckpt)
    nhwc = {k: v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v for k, v in state["model"].items()}
    assert not all(v.is_contiguous() for v in nhwc.values())
    train_unet.save_checkpoint(tmp_path / "nhwc.pt", {**state, "model": nhwc})
    model, _ = train_unet.load_model(tmp_path / "nhwc.pt", hw)
    assert all(p.is_contiguous() for p in model.parameters())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in nhwc.items())


def test_weights_saved_in_another_dtype_are_cast_into_the_models(binary_model, hw, tmp_path):
    """A checkpoint whose weights were saved in bf16 (by a user's own code) loads into the model's fp32
    parameters, cast, as load_state_dict copies them: assigning would have made a bf16 model."""
    ckpt, _ = binary_model
    state = train_unet.load_checkpoint(ckpt)
    halved = {k: v.bfloat16() if v.is_floating_point() else v for k, v in state["model"].items()}
    train_unet.save_checkpoint(tmp_path / "bf16.pt", {**state, "model": halved})
    model, _ = train_unet.load_model(tmp_path / "bf16.pt", hw)
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(torch.equal(model.state_dict()[k], v.to(model.state_dict()[k].dtype)) for k, v in halved.items())


def test_predict_batch_names_an_image_the_model_cannot_take(binary_model, hw, fp32):
    """A notebook user's own arrays: a gray or RGBA image for an RGB model ended in a convolution's
    "expected input[1, 1, 64, 64] to have 3 channels"; an empty list in torch.stack's error."""
    ckpt, _ = binary_model
    model, cfg = train_unet.load_model(ckpt, hw)
    for bad in (np.zeros((64, 64), np.uint8), np.zeros((64, 64, 4), np.uint8), np.zeros(64, np.uint8)):
        with pytest.raises(train_unet.UserError, match=r"image 1 has shape .* but the model takes 3 channel\(s\) "
                                                       r"\(HxWx3\): read it with read_image\(path, 3"):
            train_unet.predict_batch(model, [np.zeros((64, 64, 3), np.uint8), bad], cfg, fp32, hw)
    assert train_unet.predict_batch(model, [], cfg, fp32, hw) == []
    for bad, what in ((np.zeros((40, 40, 3)), "a float64 array"), (np.zeros((40, 40, 3), np.uint16), "a uint16 array"),
                      (torch.zeros(40, 40, 3), "a Tensor"), (None, "a NoneType")):
        with pytest.raises(train_unet.UserError, match=f"image 0 is {what}: pass numpy arrays as read_image"):
            train_unet.predict_batch(model, [bad], cfg, fp32, hw)
    for empty in (np.zeros((0, 10, 3), np.uint8), np.zeros((10, 0), np.uint8)):  # was OpenCV's resize assertion
        with pytest.raises(train_unet.UserError, match=r"image 0 has shape \(.*\): no pixels to predict"):
            train_unet.predict_batch(model, [empty], cfg, fp32, hw)
    with pytest.raises(train_unet.UserError, match=r"^images is one ndarray of shape \(64, 64, 3\): pass a list of "
                                                   r"images \(\[image\] for one\)$"):  # its rows were the images
        train_unet.predict_batch(model, np.zeros((64, 64, 3), np.uint8), cfg, fp32, hw)


def test_predict_batch_refuses_float_images_it_would_get_wrong(binary_model, hw, fp32):
    """float32 in 0..255 (cv2.imread(...).astype(np.float32)) gave half the mask wrong; one NaN pixel made the
    whole mask background; neither said a word. read_image's own floats (16-bit data, a little past
    intensity_range) still go through."""
    ckpt, _ = binary_model
    model, cfg = train_unet.load_model(ckpt, hw)
    pixels = np.random.default_rng(0).integers(0, 256, (40, 40, 3)).astype(np.uint8)
    with pytest.raises(train_unet.UserError, match=r"^image 0 is float32 with whole-number values up to 255: "
                                                   r"unscaled "):
        train_unet.predict_batch(model, [pixels.astype(np.float32)], cfg, fp32, hw)
    nan = pixels.astype(np.float32) / 255
    nan[3, 4, 0] = np.nan
    with pytest.raises(train_unet.UserError, match=r"^image 1 holds NaN or inf pixels"):
        train_unet.predict_batch(model, [pixels, nan], cfg, fp32, hw)
    past = pixels.astype(np.float32) / 200  # scaled, up to 1.275: beyond the range, not unscaled
    assert train_unet.predict_batch(model, [past, np.ones((8, 8, 3), np.float32)], cfg, fp32, hw)[0].shape == (40, 40)
    # unscaled pixels resized are no longer whole numbers (user test: 20% of the mask wrong, unsaid); a model
    # trained with no intensity_range takes floats in [0, 1] alone, give or take FLOAT_INPUT_SLACK
    resized = cv2.resize(pixels.astype(np.float32), (44, 44))
    with pytest.raises(train_unet.UserError, match=r"^image 0 is float32 with values from .* to .*, where the model "
                                                   r"takes them in \[0, 1\] \(it was trained with no "
                                                   r"intensity_range\): scale them \(8-bit: / 255\), or pass"):
        train_unet.predict_batch(model, [resized], cfg, fp32, hw)
    with pytest.raises(train_unet.UserError, match=r"^image 0 is float32 with values from -0\.6 "):
        train_unet.predict_batch(model, [past - 0.6], cfg, fp32, hw)
    assert cfg["intensity_range"] is None  # given one, values a little past it are read_image's own: taken
    masks = train_unet.predict_batch(model, [resized / 200], {**cfg, "intensity_range": [0, 200]}, fp32, hw)
    assert masks[0].shape == (44, 44)
    # but not most pixels far outside 0-1 yet inside the raw range: raw 12-bit data resized as float (205-3360,
    # range 200,3399) gave 90% of the mask foreground, unsaid (user test)
    with pytest.raises(train_unet.UserError, match=r"^image 0 is float32 with \d+% of its pixels beyond 0-1 by over "
                                                   r"0\.5 but within intensity_range=0,255 \(values from .* to .*\), "
                                                   r"which maps the training images to 0-1: unscaled pixels\? pass"):
        train_unet.predict_batch(model, [resized], {**cfg, "intensity_range": [0, 255]}, fp32, hw)
    # read_image's own output under a range narrower than the image: far outside 0-1, outside the raw range too
    raw = np.zeros((40, 40), np.uint16)
    raw[10:20, 10:20] = 2400
    narrow = np.repeat(train_unet.scale_image(raw, "raw", [2000, 2500])[..., None], 3, -1)  # as read_image maps it
    assert narrow.min() == -4.0 and train_unet.predict_batch(model, [narrow], {**cfg, "intensity_range": [2000, 2500]},
                                                             fp32, hw)[0].shape == (40, 40)


def test_predict_batch_notes_images_read_without_the_range_and_predicts_in_predicts_batches(
        binary_model, hw, fp32, capsys, monkeypatch):
    """read_image(path, 3) without the checkpoint's range scales 12-bit data in a 16-bit file from 0-65535:
    the masks were all background, unsaid (predict itself uses the range). And a list of 512 images ran as
    one forward (1.8 GB at 64 px): it now runs in predict's batches, with the same masks."""
    ckpt, data = binary_model
    model, cfg = train_unet.load_model(ckpt, hw)
    ranged = {**cfg, "intensity_range": [200, 3399]}
    dark = np.full((40, 40, 3), 3399 / 65535, np.float32)
    train_unet.predict_batch(model, [np.zeros((8, 8, 3), np.uint8), dark], ranged, fp32, hw)
    assert capsys.readouterr().out == ("note: 1 float image(s) (e.g. image 1) reach under 1/16 of the 0-1 the model "
                                       "takes: read by read_image without cfg['intensity_range']? A 16-bit file is "
                                       "then scaled from 0-65535: read it with read_image(path, 3, "
                                       "cfg['intensity_range'])\n")
    train_unet.predict_batch(model, [dark], cfg, fp32, hw)  # no range: no such note
    assert capsys.readouterr().out == ""
    images = [train_unet.read_image(p, 3) for p in sorted((data / "images").glob("*.png"))] * 2
    sizes, real = [], train_unet.predict_masks
    whole = [m.cpu().numpy() for m in real(model, images, cfg, fp32, hw)]
    monkeypatch.setattr(train_unet, "predict_masks",
                        lambda m, batch, *a: sizes.append(len(batch)) or real(m, batch, *a))
    masks = train_unet.predict_batch(model, images, cfg, fp32, hw)
    assert len(images) > 8 and sizes == [8] * (len(images) // 8) + ([len(images) % 8] if len(images) % 8 else [])
    assert all(np.array_equal(a, b) for a, b in zip(masks, whole)) and len(masks) == len(images)


def test_predict_batch_takes_device_names_iterables_and_a_model_in_training_mode(binary_model, hw, fp32):
    """hw="cpu" (load_model takes it) and prec="fp32" were AttributeErrors deep inside; a generator of images
    a TypeError; a model left in training mode (a notebook's fine-tuning) gave masks normalised by the batch's
    own statistics (2-5% of pixels changed), unsaid. Now: device names taken, a bad prec is one line, the
    model predicts in eval mode and is put back in the mode it was in."""
    ckpt, data = binary_model
    model, cfg = train_unet.load_model(ckpt, torch.device("cpu"))
    images = [train_unet.read_image(p, 3) for p in sorted((data / "images").glob("*.png"))[:4]]
    expected = train_unet.predict_batch(model, images, cfg, fp32, hw)
    for device in ("cpu", torch.device("cpu")):
        masks = train_unet.predict_batch(model, iter(images), cfg, train_unet.decide_precision(device, False), device)
        assert all(np.array_equal(a, b) for a, b in zip(masks, expected))
    model.train()
    masks = train_unet.predict_batch(model, images, cfg, fp32, hw)
    assert model.training and all(np.array_equal(a, b) for a, b in zip(masks, expected))
    model.eval()
    for prec in ("fp32", None):
        with pytest.raises(train_unet.UserError, match=rf"^prec is {prec!r}: pass decide_precision\(hw\)"):
            train_unet.predict_batch(model, images, cfg, prec, hw)
    with pytest.raises(train_unet.UserError, match=r"^hw is int: pass detect_hardware\(\)'s result, or a device"):
        train_unet.predict_batch(model, images, cfg, fp32, 0)


def test_predict_batch_refuses_a_config_that_is_not_the_models(binary_model, hw, fp32):
    """CONFIG, or the user's own dict, in place of load_model's: num_classes=3 for a binary model gave all-
    background masks, image_size=32 for a 64 px model 12% of pixels changed; both silently."""
    ckpt, data = binary_model
    model, cfg = train_unet.load_model(ckpt, hw)
    image = train_unet.read_image(sorted((data / "images").glob("*.png"))[0], 3)
    for key, value in (("num_classes", 3), ("image_size", cfg["image_size"] // 2), ("data_mode", "patch")):
        with pytest.raises(train_unet.UserError, match=rf"^cfg does not describe this model \({key}={value!r}, trained "
                                                       rf"with .*\): pass the config load_model returned with it$"):
            train_unet.predict_batch(model, [image], {**cfg, key: value}, fp32, hw)
    built = train_unet.build_model({**cfg, "encoder_weights": None})  # no trained config: its layers still tell
    with pytest.raises(train_unet.UserError, match=r"num_classes=3, trained with 1"):
        train_unet.predict_batch(built, [image], {**cfg, "num_classes": 3}, fp32, hw)
    assert train_unet.predict_batch(model, [image], {**cfg, "tile_overlap": 0.5}, fp32, hw)  # a tiling choice
    assert train_unet.predict_batch(model, [image], {**cfg, "intensity_range": [0, 200]}, fp32, hw)  # read_image's
    assert train_unet.predict_batch(model, [image], {**cfg, "patch_scale": 0.5}, fp32, hw)  # fit mode: not used


def test_predict_batch_refuses_a_model_cast_to_another_dtype_or_none(binary_model, hw, fp32):
    """model.to(torch.bfloat16), or .double(), was torch's 'Input type (torch.FloatTensor) and weight type
    (CPUBFloat16Type) should be the same'; a model of None, 'NoneType' object is not callable."""
    ckpt, data = binary_model
    model, cfg = train_unet.load_model(ckpt, hw)
    image = train_unet.read_image(sorted((data / "images").glob("*.png"))[0], 3)
    for dtype in (torch.bfloat16, torch.float64):
        with pytest.raises(train_unet.UserError, match=rf"^the model's weights are {str(dtype)[6:]}: pass it in "
                                                       rf"float32, as load_model returns it \(model.float\(\)\)"):
            train_unet.predict_batch(copy.deepcopy(model).to(dtype), [image], cfg, fp32, hw)
    with pytest.raises(train_unet.UserError, match=r"^model is NoneType: pass the model load_model returned$"):
        train_unet.predict_batch(None, [image], cfg, fp32, hw)


def test_a_long_library_message_is_cut_at_a_word():
    """torch.load's weights_only text came out as '... the `weights_only` argumen)'."""
    exc = ValueError("In PyTorch 2.6, we changed the default value of the `weights_only` argument in torch.load")
    assert train_unet.first_line(exc, 75) == "In PyTorch 2.6, we changed the default value of the `weights_only`..."
    assert train_unet.first_line(ValueError("short\nsecond"), 75) == "short"


# ---------------------------------------------------------------------------------------------------
# b. any size, RGB or grayscale: masks at the original size
# ---------------------------------------------------------------------------------------------------
def test_odd_sizes_round_trip_binary(binary_model, tmp_path):
    ckpt, data = binary_model
    sizes = write_odd_images(tmp_path / "in", data)
    result = train_unet.predict(opts(ckpt, tmp_path / "in", tmp_path / "out"))
    assert result["failed"] == []
    assert result["predicted"] == len(sizes)
    for stem, (h, w) in sizes.items():
        mask = read_png(tmp_path / "out" / f"{stem}.png")
        assert mask.shape == (h, w), stem  # one channel, the input's exact height and width
        assert mask.dtype == np.uint8
        assert set(np.unique(mask).tolist()) <= {0, 255}, stem
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"{s}.png" for s in sizes)


def test_padding_is_cropped_from_the_right_place(binary_model, hw, fp32):
    """A 32x20 image is padded on the right to 32x32: the mask is the left 20 columns."""
    ckpt, data = binary_model
    model, cfg = train_unet.load_model(ckpt, hw)
    full = train_unet.read_image(sorted((data / "images").glob("*.png"))[0], 3)
    image = np.ascontiguousarray(full[:, :20])
    x = train_unet.build_transforms(cfg, train=False)(image=image)["image"]
    assert x.shape[:2] == (SIZE, SIZE)
    x = torch.from_numpy(x.transpose(2, 0, 1).copy())[None]
    centre_head_bias(model, x, width=20)
    with torch.no_grad():
        logits = model(x)[0, 0]
    expected = (logits[:, :20] > 0).to(torch.uint8).numpy()
    assert len(np.unique(expected)) == 2, "test setup: the centred logits should straddle 0"
    mask = train_unet.predict_batch(model, [image], cfg, fp32, hw)[0]
    assert mask.shape == (SIZE, 20)
    assert np.array_equal(mask, expected)


# ---------------------------------------------------------------------------------------------------
# c. multi-class (and a grayscale model, rebuilt from the checkpoint's config)
# ---------------------------------------------------------------------------------------------------
def test_multiclass_masks_hold_class_indices(multiclass_model, hw, tmp_path):
    ckpt, data = multiclass_model
    model, cfg = train_unet.load_model(ckpt, hw)
    assert (cfg["num_classes"], cfg["in_channels"]) == (3, 1)  # from the checkpoint, not PREDICT_CONFIG
    assert model.segmentation_head[0].out_channels == 3
    sizes = write_odd_images(tmp_path / "in", data)
    result = train_unet.predict(opts(ckpt, tmp_path / "in", tmp_path / "out"))
    assert result["failed"] == [] and result["predicted"] == len(sizes)
    for stem, (h, w) in sizes.items():
        mask = read_png(tmp_path / "out" / f"{stem}.png")
        assert mask.shape == (h, w)
        assert mask.dtype == np.uint8
        assert mask.max() <= 2, f"{stem}: class indices of a 3-class model, not 0/255"


# ---------------------------------------------------------------------------------------------------
# d. overlays
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["binary", "multiclass"])
def test_overlay_written_and_only_tints_the_mask(which, request, tmp_path):
    ckpt, data = request.getfixturevalue(f"{which}_model")
    channels = torch.load(ckpt, map_location="cpu", weights_only=True)["config"]["in_channels"]
    sizes = write_odd_images(tmp_path / "in", data)
    result = train_unet.predict(opts(ckpt, tmp_path / "in", tmp_path / "out", overlay=True))
    assert result["failed"] == [] and result["predicted"] == len(sizes)
    for stem, (h, w) in sizes.items():
        overlay = read_png(tmp_path / "out" / f"{stem}_overlay.png")
        mask = read_png(tmp_path / "out" / f"{stem}.png")
        assert overlay.shape == (h, w, 3), stem
        # The overlay is drawn on the image as the model saw it (grayscale for an in_channels=1 model).
        flag = cv2.IMREAD_COLOR if channels == 3 else cv2.IMREAD_GRAYSCALE
        original = cv2.imread(str(tmp_path / "in" / f"{stem}.png"), flag)
        if original.ndim == 2:
            original = np.repeat(original[..., None], 3, axis=2)
        background = mask == 0
        assert np.array_equal(overlay[background], original[background]), \
            f"{stem}: the overlay changed pixels outside the mask"


def test_no_overlay_by_default(binary_model, tmp_path):
    ckpt, data = binary_model
    train_unet.predict(opts(ckpt, data / "images", tmp_path / "out"))
    assert not list((tmp_path / "out").glob("*_overlay.png"))


# ---------------------------------------------------------------------------------------------------
# e. a single file or a folder
# ---------------------------------------------------------------------------------------------------
def test_single_file_input(binary_model, tmp_path):
    ckpt, data = binary_model
    image = sorted((data / "images").glob("*.png"))[3]
    result = train_unet.predict(opts(ckpt, image, tmp_path / "out"))
    assert result["predicted"] == 1 and result["failed"] == []
    assert [p.name for p in (tmp_path / "out").iterdir()] == [image.name]
    assert read_png(tmp_path / "out" / image.name).shape == cv2.imread(str(image)).shape[:2]


def test_folder_input_predicts_every_image_and_ignores_other_files(binary_model, tmp_path):
    ckpt, data = binary_model
    folder = tmp_path / "in"
    folder.mkdir()
    stems = []
    for i, src in enumerate(sorted((data / "images").glob("*.png"))[:4]):
        image = cv2.imread(str(src))
        ext = ".jpg" if i % 2 else ".png"
        cv2.imwrite(str(folder / f"img{i}{ext}"), image)
        stems.append(f"img{i}")
    (folder / "notes.txt").write_text("not an image")
    result = train_unet.predict(opts(ckpt, folder, tmp_path / "out", batch_size=3))
    assert result["failed"] == []
    assert result["predicted"] == len(stems)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(f"{s}.png" for s in stems)


def test_main_predict_returns_0(binary_model, tmp_path, capsys):
    ckpt, data = binary_model
    code = train_unet.main(["predict", f"checkpoint={ckpt}", f"input={data / 'images'}",
                            f"output={tmp_path / 'out'}", "overlay=True", "use_amp=False", "device=cpu",
                            "progress=False"])
    assert code == 0
    n = len(list((data / "images").glob("*.png")))
    assert len(list((tmp_path / "out").glob("*_overlay.png"))) == n
    assert len(list((tmp_path / "out").glob("*.png"))) == 2 * n


# ---------------------------------------------------------------------------------------------------
# f. clear errors
# ---------------------------------------------------------------------------------------------------
def test_missing_checkpoint(binary_model, tmp_path, capsys):
    _, data = binary_model
    missing = tmp_path / "nope" / "best.pt"
    with pytest.raises(train_unet.UserError, match="not found"):
        train_unet.predict(opts(missing, data / "images", tmp_path / "out"))
    code = train_unet.main(["predict", f"checkpoint={missing}", f"input={data / 'images'}",
                            f"output={tmp_path / 'out'}", "progress=False", "device=cpu"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and str(missing) in err
    assert "Traceback" not in err


@pytest.mark.parametrize("content", ["garbage", "foreign_torch_file", "a_whole_module"])
def test_not_a_checkpoint(content, binary_model, tmp_path):
    _, data = binary_model
    path = tmp_path / "model.pt"
    if content == "garbage":
        path.write_bytes(b"this is not a checkpoint\x00\x01\x02" * 10)
    elif content == "a_whole_module":  # torch.save(model): it was said to be cut short in a copy, maybe
        torch.save(torch.nn.Linear(2, 2), path)
    else:
        torch.save({"state_dict": {"w": torch.zeros(2)}}, path)
    match = ("holds a pickled torch.nn.modules.linear.Linear .*, not a checkpoint of this trainer: give"
             if content == "a_whole_module" else "not a (readable )?checkpoint")
    with pytest.raises(train_unet.UserError, match=match) as info:
        train_unet.predict(opts(path, data / "images", tmp_path / "out"))
    assert str(path) in str(info.value)
    assert "\n" not in str(info.value)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").iterdir())


def test_a_truncated_checkpoint_and_a_folder_say_what_to_give(binary_model, tmp_path):
    ckpt, data = binary_model
    cut = tmp_path / "cut.pt"
    cut.write_bytes(ckpt.read_bytes()[:100_000])  # a copy that stopped short
    with pytest.raises(train_unet.UserError, match="cut short in a copy: give a best.pt or last.pt") as info:
        train_unet.predict(opts(cut, data / "images", tmp_path / "out"))
    assert "\n" not in str(info.value)
    with pytest.raises(train_unet.UserError, match=f"checkpoint {ckpt.parent} is a folder: give a .pt file in it "
                                                   f"\\(.*best.pt"):
        train_unet.predict(opts(ckpt.parent, data / "images", tmp_path / "out"))


class _Payload:
    """Pickles to `open(marker, 'w')`: a full unpickler would create the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_checkpoint_is_loaded_with_weights_only(binary_model, tmp_path):
    """A checkpoint carrying arbitrary pickled code is refused and the code never runs."""
    ckpt, data = binary_model
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    marker = tmp_path / "payload_ran"
    state["extra"] = _Payload(str(marker))
    evil = tmp_path / "evil.pt"
    torch.save(state, evil)
    with pytest.raises(train_unet.UserError, match="not a (readable )?checkpoint") as err:
        train_unet.predict(opts(evil, data / "images", tmp_path / "out"))
    assert not marker.exists()
    assert "weights_only" not in str(err.value)  # torch's advice for pickles, not for a user's wrong file


def test_a_file_that_is_no_checkpoint_is_one_line_without_torchs_warnings(tmp_path, capsys):
    import pickle

    other = tmp_path / "x.pt"
    other.write_bytes(pickle.dumps({"a": 1}, protocol=4))
    with pytest.raises(train_unet.UserError, match="x.pt is not a readable checkpoint of this trainer"):
        train_unet.load_checkpoint(other)
    assert "Warning" not in capsys.readouterr().err


def test_help_piped_into_a_reader_that_stops_exits_without_a_traceback():
    import subprocess

    script = Path(train_unet.__file__)
    proc = subprocess.run(f"{sys.executable} {script} --help | head -1", shell=True, capture_output=True, text=True)
    assert proc.stdout.strip() and "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr, proc.stderr


def test_a_single_input_file_of_a_type_a_folder_skips_is_refused(tmp_path):
    """A folder's .webp is skipped with a note; given alone it was predicted: one rule now."""
    (tmp_path / "e.webp").write_bytes(b"RIFF")
    with pytest.raises(train_unet.UserError, match=r"input .*e.webp is not one of the image types predict reads"):
        train_unet.list_images(tmp_path / "e.webp")


def test_an_input_pattern_is_told_to_be_the_folder(tmp_path):
    """input="dir/*.tif" (quoted, or left as it is by the shell) was "not found: give an image file or a
    folder", which it looked like it was (a user's report)."""
    (tmp_path / "dir").mkdir()
    with pytest.raises(train_unet.UserError, match=rf"input .*\*.tif not found: a pattern is not expanded here; give "
                                                   rf"the folder, input={tmp_path / 'dir'}, whose images are all"):
        train_unet.list_images(tmp_path / "dir" / "*.tif")
    with pytest.raises(train_unet.UserError, match="not found: give an image file or a folder of images"):
        train_unet.list_images(tmp_path / "dir" / "a.tif")


def test_corrupt_image_is_named_and_the_others_are_predicted(binary_model, tmp_path, capsys):
    ckpt, data = binary_model
    folder = tmp_path / "in"
    folder.mkdir()
    good = []
    for src in sorted((data / "images").glob("*.png"))[:3]:
        (folder / src.name).write_bytes(src.read_bytes())
        good.append(src.stem)
    bad = folder / "broken.png"
    bad.write_bytes(b"\x89PNG\r\n\x1a\n" + b"truncated garbage")
    result = train_unet.predict(opts(ckpt, folder, tmp_path / "out", batch_size=2))
    assert result["predicted"] == len(good)
    assert len(result["failed"]) == 1
    failed_path, reason = result["failed"][0]
    assert Path(failed_path).name == "broken.png"
    assert "broken.png" in reason
    assert sorted(p.stem for p in (tmp_path / "out").iterdir()) == sorted(good)
    out = capsys.readouterr().out
    assert "broken.png" in out  # the run reports which failed

    code = train_unet.main(["predict", f"checkpoint={ckpt}", f"input={folder}",
                            f"output={tmp_path / 'out2'}", "use_amp=False", "device=cpu", "progress=False"])
    assert code == 1
    assert sorted(p.stem for p in (tmp_path / "out2").iterdir()) == sorted(good)


def test_missing_input(binary_model, tmp_path):
    ckpt, _ = binary_model
    with pytest.raises(train_unet.UserError, match="not found"):
        train_unet.predict(opts(ckpt, tmp_path / "no_such_folder", tmp_path / "out"))


def test_input_folder_without_images(binary_model, tmp_path):
    ckpt, _ = binary_model
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "readme.txt").write_text("hi")
    with pytest.raises(train_unet.UserError, match="no images"):
        train_unet.predict(opts(ckpt, tmp_path / "empty", tmp_path / "out"))


def test_output_not_writable(binary_model, tmp_path, capsys):
    ckpt, data = binary_model
    blocker = tmp_path / "afile"
    blocker.write_text("a regular file, not a folder")
    out = blocker / "out"
    with pytest.raises(train_unet.UserError, match="not writable") as info:
        train_unet.predict(opts(ckpt, data / "images", out))
    assert str(out) in str(info.value)
    assert blocker.read_text() == "a regular file, not a folder"
    code = train_unet.main(["predict", f"checkpoint={ckpt}", f"input={data / 'images'}", f"output={out}",
                            "progress=False", "device=cpu"])
    assert code == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_out_of_gpu_memory_is_a_message_and_keeps_the_masks_written(binary_model, tmp_path, monkeypatch):
    """Fit mode sizes the logits back to each image's size on the device, which no budget counts: a large
    image ended in torch's multi-line OutOfMemoryError."""
    ckpt, data = binary_model
    real, calls = train_unet.predict_masks, []

    def second_batch_runs_out(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args, **kwargs)
    monkeypatch.setattr(train_unet, "predict_masks", second_batch_runs_out)
    out = tmp_path / "out"
    with pytest.raises(train_unet.UserError, match=r"^out of GPU memory predicting shape_00\d\d.png, .*: set "
                                                   r"batch_size=4 lower, or device=cpu .* the masks of the images "
                                                   r"before them are written$"):
        train_unet.predict({**opts(ckpt, data / "images", out), "batch_size": 4})
    assert len(list(out.glob("*.png"))) == 4  # the first batch's, all written (its writes were cancelled: 1 of 4)


# ---------------------------------------------------------------------------------------------------
# g. the same capability check as training
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("use_amp, amp_dtype", [(True, "auto"), (False, "auto"), (True, "float16")])
def test_predict_precision_follows_the_capability_check(use_amp, amp_dtype, binary_model, hw, tmp_path):
    ckpt, data = binary_model
    image = sorted((data / "images").glob("*.png"))[0]
    result = train_unet.predict(opts(ckpt, image, tmp_path / "out", use_amp=use_amp, amp_dtype=amp_dtype))
    expected = train_unet.decide_precision(train_unet.detect_hardware("cpu"), use_amp, amp_dtype, False)
    assert result["precision"] == expected.name
    if not use_amp:
        assert result["precision"] == "fp32"
    assert result["predicted"] == 1
    mask = read_png(tmp_path / "out" / image.name)
    assert mask.shape == (SIZE, SIZE) and set(np.unique(mask).tolist()) <= {0, 255}


def test_tile_settings_for_a_fit_checkpoint_are_named_as_ignored(binary_model, tmp_path, capsys):
    ckpt, data = binary_model
    image = sorted((data / "images").iterdir())[0]
    result = train_unet.predict(opts(ckpt, image, tmp_path / "out", tile_overlap=0.5))
    assert result["predicted"] == 1
    assert "note: tile_overlap ignored" in capsys.readouterr().out


@pytest.mark.parametrize("use_amp", [True, False])
def test_predict_in_bf16_says_the_checkpoint_was_validated_in_fp32(binary_model, tmp_path, capsys, use_amp):
    """The README said the val IoU is predict's: predict's default bf16 (where native) changed a few pixels
    of the fp32 masks that validation scored, with no word."""
    ckpt, data = binary_model
    image = sorted((data / "images").glob("*.png"))[0]
    train_unet.predict(opts(ckpt, image, tmp_path / "out", use_amp=use_amp, amp_dtype="bfloat16",
                            force_amp_dtype=True, channels_last=False))
    said = f"note: masks in bf16; {ckpt} was validated in fp32 (use_amp=False): use_amp=False gives the masks"
    assert (said in capsys.readouterr().out) == use_amp


def test_predict_in_another_layout_than_an_eval_amp_validation_says_so(make_cfg, tmp_path, capsys):
    """eval_amp=True validated in bf16 and NCHW; predict chose NHWC by the rule at its batch: its masks differed
    from those the val IoU scored (0.5014 against 0.5012), with no word."""
    cfg = make_cfg(use_amp=True, amp_dtype="bfloat16", force_amp_dtype=True, eval_amp=True, channels_last=False)
    train_unet.train(cfg)
    ckpt = Path(cfg["checkpoint_dir"]) / "best.pt"
    image = sorted((Path(cfg["data_dir"]) / "images").iterdir())[0]
    for layout, said in ((True, True), (False, False)):
        train_unet.predict(opts(ckpt, image, tmp_path / f"out{layout}", use_amp=True, amp_dtype="bfloat16",
                                force_amp_dtype=True, channels_last=layout))
        out = capsys.readouterr().out
        assert ("note: masks in bf16 and NHWC; " in out and "was validated in NCHW (eval_amp=True): "
                "channels_last=False gives the masks its val IoU scored" in out) == said
        assert "was validated in fp32" not in out
    # another dtype than validation's: the layout advice alone left fp16's masks (user test)
    train_unet.predict(opts(ckpt, image, tmp_path / "out16", use_amp=True, amp_dtype="float16", force_amp_dtype=True,
                            channels_last=False))
    assert f"note: masks in fp16; {ckpt} was validated in bf16 (eval_amp=True): amp_dtype=bfloat16 gives the masks " \
           f"its val IoU scored" in capsys.readouterr().out


def test_predict_says_an_eval_amp_run_that_trained_in_fp32_was_validated_in_fp32(make_cfg, tmp_path, capsys):
    """eval_amp=True in a run whose precision was fp32 (no native bf16 there, or the probe's choice): predict in
    bf16 said 'validated in NCHW (eval_amp=True): channels_last=False gives the masks', which kept bf16's."""
    cfg = make_cfg(use_amp=True, eval_amp=True, channels_last=False)
    state_precision = "fp32"
    train_unet.train({**cfg, "use_amp": False, "eval_amp": True})
    ckpt = Path(cfg["checkpoint_dir"]) / "best.pt"
    state = train_unet.load_checkpoint(ckpt)
    state["config"]["use_amp"] = True  # use_amp=True that fell back to fp32: the checkpoint records fp32
    assert state["precision"] == state_precision
    train_unet.save_checkpoint(ckpt, state)
    image = sorted((Path(cfg["data_dir"]) / "images").iterdir())[0]
    train_unet.predict(opts(ckpt, image, tmp_path / "out", use_amp=True, amp_dtype="bfloat16", force_amp_dtype=True,
                            channels_last=True))
    out = capsys.readouterr().out
    assert f"note: masks in bf16; {ckpt} was validated in fp32 (eval_amp=True, in a run that trained in fp32): " \
           f"use_amp=False gives the masks its val IoU scored" in out and "channels_last=False gives" not in out


@pytest.fixture
def pipe_opened():
    """fifo -> a function telling whether anything opened that named pipe to read. A thread stands ready to
    open it for writing, which succeeds only once a reader has it open, and then lets that reader go (it reads
    no bytes): code that opened it waits for ever otherwise, and the test would hang, not fail."""
    stop, opened, threads = threading.Event(), {}, []

    def watch(fifo):
        while not stop.wait(0.01):
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as exc:
                assert exc.errno == errno.ENXIO, exc  # no reader yet
                continue
            opened[fifo] = True

    def make(fifo):
        os.mkfifo(fifo)
        threads.append(threading.Thread(target=watch, args=(fifo,), daemon=True))
        threads[-1].start()
        return lambda: opened.get(fifo, False)
    yield make
    stop.set()
    for thread in threads:
        thread.join()


def test_a_named_pipe_among_the_images_is_named_and_not_opened(binary_model, tmp_path, pipe_opened, capsys):
    """A named pipe named like an image (f.png, g.tif) hung predict for ever: its memory check opened it,
    waiting for a writer, and the run then outlived its SIGTERM. It fails with the reason; the rest predict."""
    ckpt, data = binary_model
    folder = tmp_path / "in"
    folder.mkdir()
    cv2.imwrite(str(folder / "a.png"), cv2.imread(str(sorted((data / "images").glob("*.png"))[0])))
    opened = [pipe_opened(folder / name) for name in ("f.png", "g.tif")]
    result = train_unet.predict(opts(ckpt, folder, tmp_path / "out"))
    assert result["predicted"] == 1 and (tmp_path / "out" / "a.png").is_file()
    assert [why for _, why in result["failed"]] == [
        f"cannot read image {folder / name} (a named pipe, not a file): remove it, or put the image file in its place"
        for name in ("f.png", "g.tif")]
    assert not any(was() for was in opened)
    with pytest.raises(train_unet.UserError, match=r"^input .*f\.png is a named pipe, not a file: give an image "
                                                   r"file or a folder of images$"):
        train_unet.predict(opts(ckpt, folder / "f.png", tmp_path / "out2"))


def test_a_named_pipe_as_a_mask_stops_training_at_once(tmp_path, pipe_opened):
    """The data check opened a mask that was a named pipe and waited for ever (a SIGTERM did not end it)."""
    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=8, size=SIZE)
    mask = sorted((data / "masks").glob("*.png"))[2]
    mask.unlink()
    opened = pipe_opened(mask)
    cfg = dict(data_dir=str(data), checkpoint_dir=str(tmp_path / "ckpt"), image_size=SIZE, epochs=1, batch_size=2,
               encoder_name="resnet18", encoder_weights=None, device="cpu", progress=False, num_workers=0)
    with pytest.raises(train_unet.UserError, match=rf"^cannot read mask {mask} \(a named pipe, not a file\): remove "
                                                   rf"it, or put the mask file in its place$"):
        train_unet.train(cfg)
    assert not opened()
