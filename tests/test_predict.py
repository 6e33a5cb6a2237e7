"""predict: one PNG mask per image at its size, ground truth protected, unreadable images named, precision choice."""
import json

import cv2
import numpy as np
import pytest
import torch

from conftest import make_checkpoint
from unet_amp.checkpoint import load_checkpoint
from unet_amp.common import UserError
from unet_amp.precision import detect_hardware
from unet_amp.predict import PREDICT_CONFIG, main, predict, predict_precision

SIZES = [(50, 70), (64, 64), (33, 90)]


def write_images(folder, sizes=SIZES):
    folder.mkdir(parents=True, exist_ok=True)
    for i, (h, w) in enumerate(sizes):
        image = np.random.default_rng(i).integers(0, 255, (h, w, 3), dtype=np.uint8)
        cv2.imwrite(str(folder / f"img{i}.png"), cv2.GaussianBlur(image, (9, 9), 3))
    return folder


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("ckpt") / "best.pt")


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    return write_images(tmp_path_factory.mktemp("data") / "images")


def run(checkpoint, source, out, **over):
    return predict({**PREDICT_CONFIG, "checkpoint": str(checkpoint), "input": str(source), "output": str(out),
                    "device": "cpu", "progress": False, **over})


def test_binary_masks_at_original_size(binary, images, tmp_path):
    out = tmp_path / "pred"
    result = run(binary, images, out)
    assert result["failed"] == [] and len(result["written"]) == 3
    for i, (h, w) in enumerate(SIZES):
        mask = cv2.imread(str(out / f"img{i}.png"), cv2.IMREAD_UNCHANGED)
        assert mask.shape == (h, w) and mask.dtype == np.uint8 and set(np.unique(mask)) <= {0, 255}
    assert json.loads((out / "predict.json").read_text())["written"] == ["img0.png", "img1.png", "img2.png"]
    again = run(binary, images / "img1.png", out, tta="flip")  # its own masks: overwritten
    assert again["written"] == [str(out / "img1.png")]


@pytest.mark.parametrize("data_mode", ["fit", "patch"])
def test_multiclass_masks_are_class_indices(data_mode, images, tmp_path):
    ckpt = make_checkpoint(tmp_path / "mc.pt", num_classes=3, data_mode=data_mode)
    run(ckpt, images, tmp_path / "pred")
    for i, (h, w) in enumerate(SIZES):
        mask = cv2.imread(str(tmp_path / "pred" / f"img{i}.png"), cv2.IMREAD_UNCHANGED)
        assert mask.shape == (h, w) and mask.max() <= 2


def test_patch_mode_equals_sliding_window_of_the_model(binary, images, tmp_path):
    from unet_amp.checkpoint import model_from_checkpoint
    from unet_amp.images import prepare_image, read_image
    from unet_amp.patches import sliding_window_logits
    from unet_amp.precision import precision_for

    state = load_checkpoint(binary)
    state["data"]["data_mode"] = state["config"]["data_mode"] = "patch"
    torch.save(state, tmp_path / "patch.pt")
    run(tmp_path / "patch.pt", images / "img2.png", tmp_path / "pred", amp="fp32")
    facts = {**state["data"], "tta": "none"}
    logits = sliding_window_logits(model_from_checkpoint(state), prepare_image(read_image(images / "img2.png"), facts),
                                   facts, precision_for("fp32", False, ""), detect_hardware("cpu"))
    want = ((logits[0] > 0).numpy() * 255).astype(np.uint8)
    assert np.array_equal(cv2.imread(str(tmp_path / "pred" / "img2.png"), cv2.IMREAD_UNCHANGED), want)


def test_refuses_input_folder_and_data_set_masks(binary, tmp_path):
    data = tmp_path / "set"
    write_images(data / "images")
    (data / "masks").mkdir()
    truth = np.zeros((50, 70), np.uint8)
    cv2.imwrite(str(data / "masks" / "img0.png"), truth)
    before = {p: p.read_bytes() for p in data.rglob("*") if p.is_file()}
    for out in (data / "images", data / "masks", data / "images" / "."):
        with pytest.raises(UserError):
            run(binary, data / "images", out)
    with pytest.raises(UserError):
        run(binary, data / "images" / "img0.png", data / "images")
    assert {p: p.read_bytes() for p in data.rglob("*") if p.is_file()} == before  # nothing written


def test_refuses_a_folder_with_files_predict_did_not_write(binary, images, tmp_path):
    out = tmp_path / "labels"
    out.mkdir()
    (out / "img0.png").write_bytes(b"ground truth")
    with pytest.raises(UserError, match="img0.png"):
        run(binary, images, out)
    assert sorted(p.name for p in out.iterdir()) == ["img0.png"] and (out / "img0.png").read_bytes() == b"ground truth"


def test_unreadable_image_is_named_others_written_exit_1(binary, images, tmp_path, capsys):
    source = write_images(tmp_path / "in", SIZES[:2])
    (source / "broken.png").write_bytes(b"not a png")
    out = tmp_path / "pred"
    code = main([f"checkpoint={binary}", f"input={source}", f"output={out}", "device=cpu", "progress=False"])
    assert code == 1
    assert sorted(p.name for p in out.glob("*.png")) == ["img0.png", "img1.png"]
    assert "broken.png" in capsys.readouterr().err
    result = run(binary, source, out)
    assert result["failed"] == [str(source / "broken.png")] and len(result["written"]) == 2


def test_bad_values_refused(binary, images, tmp_path):
    for key, value in (("tta", "rot"), ("amp", "fp8"), ("backend", "tf")):
        with pytest.raises(UserError, match=key):
            run(binary, images, tmp_path / "p", **{key: value})
    with pytest.raises(UserError):
        run(tmp_path / "missing.pt", images, tmp_path / "p")
    with pytest.raises(UserError):
        run(binary, tmp_path / "nothing", tmp_path / "p")


@pytest.mark.parametrize("native", [True, False])
def test_amp_auto_uses_bf16_only_where_native(native):
    hw = detect_hardware("cpu")
    hw.bf16_native = native
    facts = {"channels_last": False}
    prec = predict_precision({**PREDICT_CONFIG, "amp": "auto"}, hw, facts)
    assert prec.dtype == (torch.bfloat16 if native else torch.float32)
    assert predict_precision({**PREDICT_CONFIG, "amp": "fp32"}, hw, facts).dtype == torch.float32
    assert predict_precision({**PREDICT_CONFIG, "backend": "onnxruntime"}, hw, facts).dtype == torch.float32


def test_bf16_masks_close_to_fp32(binary, images, tmp_path):
    run(binary, images, tmp_path / "a", amp="fp32")
    run(binary, images, tmp_path / "b", amp="bf16")
    a, b = (cv2.imread(str(tmp_path / d / "img0.png"), cv2.IMREAD_UNCHANGED) for d in "ab")
    assert (a == b).mean() > 0.9


def with_range(checkpoint, intensity_range, path, version=None):
    """A copy of a checkpoint with another learnt intensity range (and checkpoint version)."""
    state = load_checkpoint(checkpoint)
    state["data"]["intensity_range"] = state["config"]["intensity_range"] = intensity_range
    state["version"] = version or state["version"]
    torch.save(state, path)
    return path


@pytest.mark.parametrize("intensity_range", [None, [0, 4095]])
def test_same_values_as_uint16_png_and_float32_tiff_predict_the_same_masks(binary, intensity_range, tmp_path):
    import tifffile

    ckpt = with_range(binary, intensity_range, tmp_path / "b.pt")
    rng = np.random.default_rng(3)
    for i, gain in enumerate((1, 16)):  # a dim frame and a bright one, 12-bit values
        rgb = (cv2.GaussianBlur(rng.integers(0, 255, (48, 40, 3), dtype=np.uint8), (9, 9), 3) * gain).astype(np.uint16)
        for folder in ("png", "tif"):
            (tmp_path / folder).mkdir(exist_ok=True)
        cv2.imwrite(str(tmp_path / "png" / f"f{i}.png"), rgb[..., ::-1])  # OpenCV writes BGR
        tifffile.imwrite(tmp_path / "tif" / f"f{i}.tif", rgb.astype(np.float32), photometric="rgb")
    run(ckpt, tmp_path / "png", tmp_path / "out_png", amp="fp32")
    run(ckpt, tmp_path / "tif", tmp_path / "out_tif", amp="fp32")
    for i in range(2):
        png = cv2.imread(str(tmp_path / "out_png" / f"f{i}.png"), cv2.IMREAD_UNCHANGED)
        tif = cv2.imread(str(tmp_path / "out_tif" / f"f{i}.png"), cv2.IMREAD_UNCHANGED)
        assert np.array_equal(png, tif)


def test_one_hot_pixel_reaches_the_model_as_its_neighbours_median(tmp_path):
    from unet_amp.images import prepare_image, read_image

    frame = np.random.default_rng(4).integers(200, 3000, (32, 32)).astype(np.uint16)
    cv2.imwrite(str(tmp_path / "clean.png"), frame)
    frame[9, 13] = 65535
    cv2.imwrite(str(tmp_path / "hot.png"), frame)
    facts = {"in_channels": 1, "intensity_range": [100.0, 4000.0]}
    clean, hot = (prepare_image(read_image(tmp_path / f"{name}.png"), facts) for name in ("clean", "hot"))
    neighbours = np.delete(clean[8:11, 12:15, 0].ravel(), 4)
    assert neighbours.min() <= hot[9, 13, 0] <= neighbours.max()  # a hot pixel takes its 3x3 median
    assert np.argwhere(clean != hot).tolist() in ([[9, 13, 0]], [])  # nothing else moves


def test_predict_notes_images_it_clips_noticeably(binary, tmp_path, capsys):
    ckpt = with_range(binary, [0, 1000], tmp_path / "b.pt")
    (tmp_path / "in").mkdir()
    bright, ok = np.full((32, 32, 3), 900, np.uint16), np.full((32, 32, 3), 900, np.uint16)
    bright[:8] = 5000  # a quarter over the range
    ok[0, 0] = 5000     # one pixel: not worth a note
    cv2.imwrite(str(tmp_path / "in" / "bright.png"), bright)
    cv2.imwrite(str(tmp_path / "in" / "ok.png"), ok)
    capsys.readouterr()
    assert run(ckpt, tmp_path / "in", tmp_path / "out")["failed"] == []
    said = capsys.readouterr().out
    assert "bright.png" in said and "ok.png" not in said


def test_a_checkpoint_from_before_the_clipped_rule_loads_and_says_so(binary, tmp_path, capsys):
    old = with_range(binary, [0, 4095], tmp_path / "old.pt", version=2)
    capsys.readouterr()
    load_checkpoint(binary)
    assert capsys.readouterr().out == ""
    assert load_checkpoint(old)["version"] == 2
    assert str(old) in capsys.readouterr().out
    torch.save({**load_checkpoint(binary), "version": 1}, tmp_path / "older.pt")
    with pytest.raises(UserError):
        load_checkpoint(tmp_path / "older.pt")
