"""Integer images wider than 8 bits: one intensity range, learnt from the training images by the data
check, saved in the checkpoint, used by training, validation and predict (issue 20, items 9 and 20).

The guarantee: 12-bit and 16-bit copies of a data set give the network its 8-bit copy's inputs.
"""
import json
import os
import re
import shutil
import sys
import tracemalloc
from pathlib import Path

import cv2
import numpy as np
import pytest
import tifffile
import torch

ROOT = Path(__file__).resolve().parents[1]
for path in (ROOT, ROOT / "tools"):
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import train_unet  # noqa: E402
from convert_depth import convert  # noqa: E402
import depth_sets  # noqa: E402
from train_unet import SegDataset, UserError  # noqa: E402

LEVEL = 1 / 255 / 0.224  # one 8-bit grey level after the mean/std normalisation (smallest std)
HALF_12_BIT = 0.5 / 4095 / 0.224  # convert_depth rounds v * 4095/255 to whole 12-bit levels


@pytest.fixture
def depths(data_dir, tmp_path):
    """{bits: data_dir} for the 8-bit shapes set and its 12- and 16-bit copies (tools/convert_depth.py), and
    "offset": 12-bit with a camera's dark offset, 300 + 12 x value."""
    offset = tmp_path / "offset"
    (offset / "images").mkdir(parents=True)
    for path in sorted((data_dir / "images").iterdir()):
        cv2.imwrite(str(offset / "images" / path.name), cv2.imread(str(path)).astype(np.uint16) * 12 + 300)
    shutil.copytree(data_dir / "masks", offset / "masks")
    return {8: data_dir, 12: convert(data_dir, tmp_path / "d12", 12), 16: convert(data_dir, tmp_path / "d16", 16),
            "offset": offset}


def run_cfg(make_cfg, data, **overrides):
    """The config a training run on `data` uses: its intensity_range as train() sets it."""
    cfg = make_cfg(data_dir=str(data), **overrides)
    train_pairs, val_pairs = train_unet.prepare_data(cfg)
    cfg = {**cfg, "intensity_range": train_unet.run_intensity_range(cfg, None, train_pairs)}
    return cfg, train_pairs, val_pairs


def test_12_16_bit_and_offset_copies_give_the_8_bit_network_inputs(make_cfg, depths):
    """The shapes set's colour channels span 0..255, so its wider copies' [min, max] maps them onto its
    8-bit values (read as gray they span less: their range maps them onto 8-bit values stretched)."""
    ref_cfg, ref_train, ref_val = run_cfg(make_cfg, depths[8])
    assert ref_cfg["intensity_range"] is None  # 8-bit data: nothing to learn, uint8 as before
    for bits, tol, learnt in ((12, HALF_12_BIT, [0, 4095]), (16, 1e-6, [0, 65535]),
                              ("offset", 1e-6, [300, 300 + 12 * 255])):
        cfg, train_pairs, val_pairs = run_cfg(make_cfg, depths[bits])
        assert cfg["intensity_range"] == learnt
        assert [Path(i).name for i, _ in train_pairs] == [Path(i).name for i, _ in ref_train]
        for pairs, refs, train in ((train_pairs, ref_train, True), (val_pairs, ref_val, False)):
            ours, theirs = SegDataset(pairs, cfg, train=train), SegDataset(refs, ref_cfg, train=train)
            for index in range(len(pairs)):
                (x, y), (ref_x, ref_y) = ours[index], theirs[index]
                # augmenting uint8 rounds to whole levels, floats do not: within ~1 level when training
                assert (x - ref_x).abs().max() <= (1.5 * LEVEL if train else tol + 1e-6), (bits, train)
                assert (x - ref_x).abs().mean() <= (0.5 * LEVEL if train else tol), (bits, train)
                assert torch.equal(y, ref_y)


def test_the_range_is_the_training_images_min_and_max(make_cfg, tmp_path):
    def learnt(*images):
        folder = tmp_path / f"set{len(list(tmp_path.iterdir()))}"
        for sub in ("train/images", "train/masks", "val/images", "val/masks"):
            (folder / sub).mkdir(parents=True)
        for i, image in enumerate(images):
            tifffile.imwrite(folder / "train/images" / f"{i}.tif", image)
            mask = np.zeros(image.shape[:2], np.uint8)
            mask[:2, :2] = 255  # some foreground: all-empty masks are refused
            cv2.imwrite(str(folder / "train/masks" / f"{i}.png"), mask)
        tifffile.imwrite(folder / "val/images/v.tif", np.full((8, 8), 60000, np.uint16))  # not learnt from
        cv2.imwrite(str(folder / "val/masks/v.png"), np.zeros((8, 8), np.uint8))
        return run_cfg(make_cfg, folder, batch_size=1, image_size=64)[0]["intensity_range"]

    def ramp(low, high, dtype=np.uint16):
        return np.linspace(low, high, 64).astype(dtype).reshape(8, 8)

    assert learnt(ramp(300, 3000), ramp(400, 4000)) == [300, 4000]  # 12-bit camera, dark offset 300
    assert learnt(ramp(0, 235)) == [0, 235]  # 8-bit values in 16-bit files
    assert learnt(ramp(0, 1000), ramp(0, 65535)) == [0, 65535]
    assert learnt(ramp(-1000, 3000, np.int16)) == [-1000, 3000]  # signed (e.g. CT)
    assert learnt(ramp(0, 200, np.uint8)) is None  # 8-bit: their own rule
    assert learnt(ramp(0, 200, np.uint8), ramp(5, 1000)) == [5, 1000]  # only the wider ones count
    assert learnt(np.full((8, 8), 7, np.uint16)) is None  # one value: nothing to learn, the dtype's range


def test_the_range_learnt_as_gray_is_not_an_rgb_runs_cached_one(make_cfg, tmp_path):
    """The data check's cache keeps each image's range as read with one in_channels: a run with the other
    reads its images again (RGB 16-bit images whose channels span different values: their gray range is
    narrower), so the same command learns the same range whatever ran before it."""
    folder = tmp_path / "rgb16"
    for sub in ("images", "masks"):
        (folder / sub).mkdir(parents=True)
    rng = np.random.default_rng(3)
    for i in range(8):
        image = np.stack([rng.integers(0, 100, (32, 32)), rng.integers(200, 300, (32, 32)),
                          rng.integers(400, 4000, (32, 32))], axis=-1).astype(np.uint16)
        cv2.imwrite(str(folder / "images" / f"{i}.png"), image)
        mask = np.zeros((32, 32), np.uint8)
        mask[8:20, 8:20] = 255
        cv2.imwrite(str(folder / "masks" / f"{i}.png"), mask)

    def learnt(channels, cache):
        if not cache:
            (folder / train_unet.CHECK_CACHE_NAME).unlink(missing_ok=True)
        cfg = make_cfg(data_dir=str(folder), in_channels=channels, image_size=32, batch_size=2)
        train_unet.check_pairs(train_unet.prepare_data(cfg)[0], cfg)
        return run_cfg(make_cfg, folder, in_channels=channels, image_size=32, batch_size=2)[0]["intensity_range"]

    gray, rgb = learnt(1, cache=False), learnt(3, cache=False)
    assert gray[1] < rgb[1]  # the gray conversion averages the channels
    assert learnt(1, cache=True) == gray and learnt(3, cache=True) == rgb  # after the other's cache too


def train_and_predict(make_cfg, data, tmp_path, name, **overrides):
    cfg = make_cfg(data_dir=str(data), checkpoint_dir=str(tmp_path / name), **overrides)
    train_unet.train(cfg)
    return tmp_path / name / "last.pt"


def predict_masks(ckpt, folder, out):
    result = train_unet.predict({"checkpoint": str(ckpt), "input": str(folder / "images"), "output": str(out),
                                 "device": "cpu", "use_amp": False, "progress": False})
    assert result["predicted"] == len(list((folder / "images").iterdir())) and not result["failed"]
    return [cv2.imread(str(p), cv2.IMREAD_UNCHANGED) for p in sorted(Path(out).glob("*.png"))]


def test_the_range_is_saved_in_the_checkpoint_and_predict_uses_it(make_cfg, depths, tmp_path):
    ckpt = train_and_predict(make_cfg, depths[12], tmp_path, "run12")
    state = train_unet.load_checkpoint(ckpt)
    assert state["config"].get("intensity_range") == [0, 4095]
    assert train_unet.load_model(ckpt, train_unet.detect_hardware("cpu"))[1]["intensity_range"] == [0, 4095]
    # predict reads 12-bit files on the checkpoint's scale: the masks of their 8-bit copies
    ref = predict_masks(ckpt, depths[8], tmp_path / "p8")
    masks = predict_masks(ckpt, depths[12], tmp_path / "p12")
    assert np.mean([(m == r).mean() for m, r in zip(masks, ref)]) > 0.999
    # ... and an old checkpoint (no intensity_range) still predicts as it did: 16-bit / 65535
    del state["config"]["intensity_range"]
    old = tmp_path / "old.pt"
    train_unet.save_checkpoint(old, state)
    model, cfg = train_unet.load_model(old, train_unet.detect_hardware("cpu"))
    assert cfg["intensity_range"] is None
    images = [train_unet.read_image(p, 3) for p in sorted((depths[12] / "images").iterdir())]
    np.testing.assert_allclose(images[0], cv2.cvtColor(cv2.imread(
        str(sorted((depths[12] / "images").iterdir())[0]), cv2.IMREAD_UNCHANGED), cv2.COLOR_BGR2RGB) / 65535,
        atol=1e-7)
    hw = train_unet.detect_hardware("cpu")
    expected = train_unet.predict_batch(model, images, cfg, train_unet.decide_precision(hw, use_amp=False), hw)
    masks = predict_masks(old, depths[12], tmp_path / "p_old")
    assert np.mean([(m == e * 255).mean() for m, e in zip(masks, expected)]) > 0.999


def test_a_given_range_that_leaves_pixels_outside_gets_a_note_in_training(make_cfg, depths):
    """Full-range 16-bit images trained with intensity_range=0,4095 reached the model at up to 16 (clipped to 1 by
    the brightness augmentation in half the samples only) without a word, where predict had a note for them. A
    range that holds the data, or leaves out only a hot pixel, gets none."""
    cfg = make_cfg(data_dir=str(depths[16]), intensity_range=[0, 4095])
    train_pairs, val_pairs = train_unet.prepare_data(cfg)
    notes = []
    assert train_unet.run_intensity_range(cfg, None, train_pairs, val_pairs, notes) == [0, 4095]
    images = [cv2.imread(str(image), cv2.IMREAD_UNCHANGED) for image, _ in [*train_pairs, *val_pairs]]
    out = [Path(image).name for (image, _), pixels in zip([*train_pairs, *val_pairs], images)
           if (pixels > 4095).mean() > 0.01]
    first = images[[Path(image).name for image, _ in [*train_pairs, *val_pairs]].index(out[0])]
    assert notes == [f"{len(out)} of {len(images)} image(s) wider than 8 bits have over 1% of their pixels outside "
                     f"intensity_range=0,4095 (e.g. {out[0]}, whose values span {first.min()}-{first.max()}): they are "
                     f"mapped outside 0-1 (there {first.min() / 4095:.3g} to {first.max() / 4095:.3g}), clipped to 0-1 "
                     f"only by the brightness augmentation, in half the training samples, not in validation or "
                     f"predict; check the range, or leave intensity_range=None to learn it from the training images "
                     f"(0,65535 here)"]
    hot = depths[12] / "images" / Path(train_pairs[0][0]).name
    pixels = cv2.imread(str(hot), cv2.IMREAD_UNCHANGED)
    pixels[0, 0] = 65535
    cv2.imwrite(str(hot), pixels)
    for given in ([0, 4095], [0, 65535]):
        cfg = make_cfg(data_dir=str(depths[12]), intensity_range=given)
        train_pairs, val_pairs = train_unet.prepare_data(cfg)
        notes = []
        assert train_unet.run_intensity_range(cfg, None, train_pairs, val_pairs, notes) == given and notes == [None]


def test_a_given_range_on_8_bit_images_is_noted_as_unused_in_training(make_cfg, depths):
    """intensity_range=0,4095 on a set of 8-bit images trained as without it, unsaid, and was saved in the
    checkpoint (predict already said 'was not used' of such images)."""
    cfg = make_cfg(data_dir=str(depths[8]), intensity_range=[0, 4095])
    train_pairs, val_pairs = train_unet.prepare_data(cfg)
    notes = []
    assert train_unet.run_intensity_range(cfg, None, train_pairs, val_pairs, notes) == [0, 4095]
    assert notes == ["intensity_range=0,4095 is not used: every image is 8-bit or float, and the range maps integer "
                     "images wider than 8 bits (8-bit images are divided by 255, float images mapped by their own min "
                     "and max); the checkpoint keeps it for predict's wider images"]


@pytest.mark.parametrize("dtype", [np.uint16, np.int16, np.int8])
def test_the_bulk_span_says_exactly_which_ranges_leave_over_1_percent_outside(dtype):
    """range_leaves_out's rule: a range whose low lies above bulk[0], or whose high lies below bulk[1], leaves
    more than 1% of the pixels below or above it, and no other range does."""
    rng = np.random.default_rng(1)
    info = np.iinfo(dtype)
    low, high = max(info.min, -3000), min(info.max, 3000)
    values = rng.integers(low, high, (333, 77, 3)).astype(dtype)
    bulk = train_unet.bulk_span(values)
    for given in rng.integers(low, high, 300):
        assert ((values < given).mean() > 0.01) == (bulk[0] < given)
        assert ((values > given).mean() > 0.01) == (bulk[1] > given)


def test_images_outside_the_checkpoints_own_range_get_a_note(make_cfg, depths, tmp_path, capsys):
    """Full-range 16-bit images predicted with a model that learnt 0-4095 from 12-bit data reach it at up to
    16x its training scale: the note a given range gets was not said for the checkpoint's own."""
    ckpt = train_and_predict(make_cfg, depths[12], tmp_path, "run12")
    capsys.readouterr()
    predict_masks(ckpt, depths[12], tmp_path / "p12")
    assert "outside intensity_range" not in capsys.readouterr().out
    predict_masks(ckpt, depths[16], tmp_path / "p16")
    note = [line for line in capsys.readouterr().out.splitlines() if "outside intensity_range" in line]
    n = len(list((depths[16] / "images").iterdir()))
    assert len(note) == 1 and f"{n} of {n} image(s) have over 1% of their pixels outside intensity_range=0,4095 (" \
        in note[0], note
    assert f"{ckpt}'s, learnt from its training images)" in note[0] and "predict with intensity_range=" in note[0]



def test_predicts_outside_note_names_the_images_stored_values(capsys):
    """A uint16 image of 0-4999 under intensity_range=123,4095: its values were said to span '-0-4999' (the
    stored 0 computed back from its float32 scaled value, -1e-6, printed with its sign)."""
    cfg = {"intensity_range": [123, 4095], "in_channels": 1, "data_mode": "fit", "image_size": 64}
    notes = train_unet.InputNotes(cfg, {"intensity_range": [123, 4095], "checkpoint": "m.pt"})
    image = np.tile(np.linspace(0, 4999, 64).astype(np.uint16), (64, 1))
    notes.look("a.tif", image, train_unet.scale_image(image, "a.tif", [123, 4095]))
    notes.print()
    assert "(e.g. 22% of a.tif's, whose values span 0-4999): the model sees them outside" in capsys.readouterr().out


def test_resume_keeps_the_runs_range(make_cfg, depths, tmp_path, capsys):
    cfg = make_cfg(data_dir=str(depths[12]))
    train_unet.train(cfg)
    # new images outside the learnt range do not move a resumed run's scale; they are named (user test: data
    # edited 16 times brighter trained at up to 16, said only as 'files changed')
    bright = next((depths[12] / "images").iterdir())
    cv2.imwrite(str(bright), np.full((64, 64, 3), 65535, np.uint16))
    capsys.readouterr()
    result = train_unet.train({**cfg, "epochs": 2, "resume": True})
    assert [r["epoch"] for r in result["history"]] == [1, 2]
    assert (f"image(s) wider than 8 bits have over 1% of their pixels outside intensity_range=0,4095, the run's, "
            f"which a resume keeps (e.g. {bright.name}, whose values span 65535-65535): they reach the model outside "
            f"0-1 (there 16 to 16)") in capsys.readouterr().out
    assert train_unet.load_checkpoint(tmp_path / "ckpt" / "last.pt")["config"]["intensity_range"] == [0, 4095]
    with pytest.raises(UserError, match="intensity_range") as info:
        train_unet.train({**cfg, "epochs": 3, "resume": True, "intensity_range": [0, 65535]})
    assert "\n" not in str(info.value)


def test_a_given_range_wins_and_parses_from_the_command_line(make_cfg, depths):
    cfg = train_unet.parse_overrides(["intensity_range=0,65535"], base=make_cfg(data_dir=str(depths[12])))
    assert cfg["intensity_range"] == [0.0, 65535.0]
    assert run_cfg(make_cfg, depths[12], intensity_range=[0, 65535])[0]["intensity_range"] == [0, 65535]
    for bad in ("4095,0", "1,2,3", "a,b", "0,1e39", "-3e38,3e38"):
        with pytest.raises(UserError, match="intensity_range") as info:
            train_unet.parse_overrides([f"intensity_range={bad}"])
        assert "\n" not in str(info.value)


@pytest.mark.parametrize("top", [255, 4095, 65535])
def test_float32_scaling_is_within_one_ulp_of_exact(top):
    values = np.arange(top + 1, dtype=np.uint16)
    scaled = train_unet.scale_image(values, intensity_range=[0, top])
    assert scaled.dtype == np.float32
    exact = values.astype(np.float64) / top
    assert np.all(np.abs(scaled - exact) <= np.spacing(scaled.astype(np.float32)))


def test_scale_image_keeps_to_one_float32_copy():
    image = np.random.default_rng(0).integers(0, 4096, (600, 500, 3)).astype(np.uint16)
    tracemalloc.start()
    try:
        out = train_unet.scale_image(image)  # the dtype's range, as an old checkpoint reads
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 1.1 * out.nbytes, peak / out.nbytes  # float64 arithmetic took 3x
    assert image.dtype == np.uint16 and image.max() > 1  # the caller's array is left alone


def test_checking_a_large_16_bit_image_makes_no_scaled_copy(make_cfg, tmp_path):
    """The data check learns size and range from the decoded pixels alone: the image at 1x its raw
    bytes, plus its mask's check in another thread, 1.6x in all (reading it scaled took 7x)."""
    raw = np.random.default_rng(0).integers(0, 4096, (1000, 900, 3)).astype(np.uint16)
    image, mask = tmp_path / "a.png", tmp_path / "m.png"
    cv2.imwrite(str(image), raw)
    cv2.imwrite(str(mask), np.zeros((1000, 900), np.uint8))
    cfg = make_cfg(data_dir=str(tmp_path), checkpoint_dir=str(tmp_path / "ck"))
    tracemalloc.start()
    try:
        facts = train_unet.checked_facts([str(image), str(mask)], cfg, write=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= 2 * raw.nbytes, peak / raw.nbytes
    assert facts[str(image)]["hw"] == [1000, 900]
    assert facts[str(image)]["range"] == [int(raw.min()), int(raw.max())]


def test_depth_sets_writes_every_variant_as_a_checked_split(tmp_path, make_cfg):
    """tools/depth_sets.py on a stand-in for stardist's files: each variant is a train/val split that
    passes the data check, and the wide copies learn the range their conversion implies."""
    rng = np.random.default_rng(0)
    image = rng.integers(0, 236, (512, 512)).astype(np.uint16)  # 8-bit values in a 16-bit TIFF
    mask = (rng.random((512, 512)) > 0.7).astype(np.uint16) * 3  # instance labels
    tifffile.imwrite(tmp_path / "img2d.tif", image)
    tifffile.imwrite(tmp_path / "mask2d.tif", mask)
    depth_sets.main(tmp_path, tmp_path / "sets")
    low, high = int(image.min()), int(image.max())
    expected = {"u8": None, "u16_as_shipped": [low, high], "b16": [low * 257, high * 257],
                "b12_offset": [low * 12 + 300, high * 12 + 300]}
    for name in depth_sets.VARIANTS:
        cfg = make_cfg(data_dir=str(tmp_path / "sets" / name))
        train, val = train_unet.prepare_data(cfg)
        assert (len(train), len(val)) == (35, 4)
        if name in expected:
            assert train_unet.learnt_intensity_range(train, cfg) == expected[name], name


# ----------------------------------------------------------------------------------------------------
# Review of the range: caches from before ranges, alpha, old checkpoints, mixed depths, no re-decoding
# ----------------------------------------------------------------------------------------------------
def test_a_cache_written_before_ranges_is_checked_again(make_cfg, depths):
    """A version-2 cache (stamps with ctime, no image ranges) must not read as '8-bit images'."""
    cfg = make_cfg(data_dir=str(depths[12]))
    train_unet.prepare_data(cfg)
    path = Path(cfg["data_dir"]) / train_unet.CHECK_CACHE_NAME
    cache = json.loads(path.read_text())
    files = {p: {k: v for k, v in e.items() if k not in ("range", "dtype")} for p, e in cache["files"].items()}
    path.write_text(json.dumps({"version": 2, "files": files}))
    learnt, _, _ = run_cfg(make_cfg, depths[12])
    assert learnt["intensity_range"] == [0, 4095]


def test_an_opaque_alpha_channel_is_not_counted_in_the_range(make_cfg, depths, tmp_path):
    """RGBA TIFFs with 12-bit colour and an opaque 16-bit alpha: the alpha is dropped, so it sets no range."""
    rgba = tmp_path / "rgba"
    (rgba / "images").mkdir(parents=True)
    for path in sorted((depths[12] / "images").iterdir()):
        rgb = cv2.cvtColor(cv2.imread(str(path), cv2.IMREAD_UNCHANGED), cv2.COLOR_BGR2RGB)
        alpha = np.full(rgb.shape[:2] + (1,), 65535, np.uint16)
        tifffile.imwrite(rgba / "images" / f"{path.stem}.tif", np.concatenate([rgb, alpha], axis=2))
    shutil.copytree(depths[12] / "masks", rgba / "masks")
    for channels in (3, 1):
        cfg, train_pairs, _ = run_cfg(make_cfg, rgba, in_channels=channels)
        assert cfg["intensity_range"] == [0, 4095]
        image, _ = train_unet.read_pair(train_pairs[0], cfg)
        assert image.max() <= 1.0 and image.max() > 0.5


def test_a_checkpoint_from_before_ranges_predicts_on_the_dtype_range_whatever_config_says(
        make_cfg, depths, tmp_path, monkeypatch):
    ckpt = train_and_predict(make_cfg, depths[12], tmp_path, "old")
    state = train_unet.load_checkpoint(ckpt)
    del state["config"]["intensity_range"]  # as written before ranges were learnt
    torch.save(state, ckpt)
    monkeypatch.setitem(train_unet.CONFIG, "intensity_range", [0, 4095])  # the user's edited script
    _, loaded = train_unet.load_model(ckpt, train_unet.detect_hardware("cpu"))
    assert loaded["intensity_range"] is None


def test_the_cache_estimate_takes_the_widest_depth_in_the_set(make_cfg, data_dir):
    """8-bit first, 16-bit after: every cached image is float32 (4 bytes a value) but the first."""
    cfg = make_cfg()
    first = train_unet.prepare_data(cfg)[0][0][0]
    for path in sorted((data_dir / "images").iterdir()):
        if path != Path(first):
            cv2.imwrite(str(path), cv2.imread(str(path)).astype(np.uint16) * 257)
    train, _ = train_unet.prepare_data(cfg)
    assert train[0][0] == first and cv2.imread(str(first), cv2.IMREAD_UNCHANGED).dtype == np.uint8
    assert train_unet.cache_bytes(train, cfg) == len(train) * cfg["image_size"] ** 2 * (3 * 4 + 1)


def test_questions_after_the_check_decode_nothing_where_no_cache_could_be_written(make_cfg, depths, monkeypatch):
    """Read-only data_dir and checkpoint_dir: the range, sizes and cache estimate come from the check's
    own facts (as the ranks exchanged them under torchrun), not from decoding every image again."""
    monkeypatch.setattr(train_unet, "atomic_write", lambda *a: (_ for _ in ()).throw(PermissionError(13, "no")))
    cfg = make_cfg(data_dir=str(depths[16]))
    train, _ = train_unet.prepare_data(cfg)
    decoded = []
    real = train_unet.decode_image
    monkeypatch.setattr(train_unet, "decode_image", lambda p, *a: decoded.append(p) or real(p, *a))
    assert train_unet.learnt_intensity_range(train, cfg) == [0, 65535]
    train_unet.image_sizes(train, cfg)
    train_unet.cache_bytes(train, cfg)
    assert decoded == []


def test_a_range_set_by_one_hot_pixel_is_noted_with_the_rest_of_the_datas_range(make_cfg, depths, capsys):
    """One 12-bit image with a hot pixel at 65535 set intensity_range=[0, 65535]: the other images reached
    the model at 0-0.06, and only the config's intensity_range line said so (a user's report)."""
    data = depths[12]
    hot = sorted((data / "images").iterdir())[3]
    image = cv2.imread(str(hot), cv2.IMREAD_UNCHANGED)
    image[0, 0] = 65535
    cv2.imwrite(str(hot), image)
    cfg = make_cfg(data_dir=str(data))
    train_pairs, _ = train_unet.prepare_data(cfg)
    notes = []
    assert train_unet.run_intensity_range(cfg, None, train_pairs, notes=notes) == [0, 65535]
    assert notes[1:] == [None]  # no validation images given
    assert notes[:1] == [f"intensity_range=[0, 65535] is set by {hot.name}'s maximum (65535); the other "
                     f"{len(train_pairs) - 1} training image(s) lie within [0, 4095], under half of it, so they reach "
                     f"the model squashed: if 0-4095 is the data's range (a hot pixel, a saturated frame?), set "
                     f"intensity_range=0,4095"]
    assert [hot.name == Path(p).name for p, _ in train_pairs].count(True) == 1  # it is a training image
    train_unet.train({**cfg, "epochs": 1})
    assert "set intensity_range=0,4095" in capsys.readouterr().out  # in the banner's notes
    notes, cfg16 = [], make_cfg(data_dir=str(depths[16]))
    train_unet.run_intensity_range(cfg16, None, *train_unet.prepare_data(cfg16), notes=notes)
    assert notes == [None, None]  # no image stands out, none of the validation images lies outside: no note


def test_validation_images_outside_the_learnt_range_get_a_note_in_training(make_cfg, depths, tmp_path, capsys):
    """12-bit training images, full-range 16-bit validation images: the range learnt was 0-4095, the validation
    images reached the model at up to 16 (val loss 22 against a train loss of 1.7) and scored the val IoU that
    picks best.pt, unsaid; predict's note named the same images."""
    cfg, train_pairs, val_pairs = train_and_val_of_depths(make_cfg, depths, tmp_path, 12, 16)
    notes = []
    assert train_unet.run_intensity_range(cfg, None, train_pairs, val_pairs, notes) == [0, 4095]
    n = len(val_pairs)
    assert notes[0] is None and notes[1].startswith(
        f"{n} of {n} validation image(s) wider than 8 bits have over 1% of their pixels outside intensity_range="
        f"0,4095, learnt from the training images (e.g. ") and notes[1].endswith(
        "put such images in training too, or give intensity_range= a range that holds both")
    assert "(there 0 to 15." in notes[1]  # 16-bit values, scaled as 12-bit ones
    train_unet.train({**cfg, "epochs": 1})
    assert "validation image(s) wider than 8 bits" in capsys.readouterr().out  # in the banner's notes
    train_unet.train({**cfg, "epochs": 2, "resume": True})  # nothing changed: said at the start, not again
    assert "outside intensity_range" not in capsys.readouterr().out


def train_and_val_of_depths(make_cfg, depths, tmp_path, train, val):
    """(config, train pairs, val pairs) of a data set whose train/ and val/ are copies of `depths` at two depths."""
    data = tmp_path / "mixed"
    for part, depth in (("train", train), ("val", val)):
        shutil.copytree(depths[depth], data / part)
    cfg = make_cfg(data_dir=str(data))
    return (cfg, *train_unet.prepare_data(cfg))


def test_16_bit_validation_images_beside_8_bit_training_ones_get_a_note_in_training(make_cfg, depths, tmp_path,
                                                                                   capsys):
    """8-bit training images, 12-bit data in 16-bit validation files: no range was learnt, the validation images
    were scaled from 0-65535 (16 times too dark) and scored the val IoU that picks best.pt, with no word;
    predict's note named the same images."""
    cfg, train_pairs, val_pairs = train_and_val_of_depths(make_cfg, depths, tmp_path, 8, 12)
    notes = []
    assert train_unet.run_intensity_range(cfg, None, train_pairs, val_pairs, notes) is None
    n = len(val_pairs)
    assert re.fullmatch(
        f"{n} of {n} validation image\\(s\\) are uint16 \\(e.g. [^,]+, values \\d+-\\d+\\) but the training images "
        f"are 8-bit or float, so no intensity_range was learnt: they are scaled from 0-65535 \\(if they hold 12-bit "
        f"data, 16 times too dark\\), and the val IoU that picks best.pt scores them so; put such images in training "
        f"too, or give intensity_range=0,4095", notes[0]), notes
    train_unet.train({**cfg, "epochs": 1})
    assert "no intensity_range was learnt" in capsys.readouterr().out  # in the banner's notes
    notes = []
    train_unet.run_intensity_range(make_cfg(data_dir=str(depths[8])), None, *train_unet.prepare_data(
        make_cfg(data_dir=str(depths[8]))), notes=notes)
    assert notes == [None]  # all 8-bit: nothing to say


def test_only_an_extreme_standing_apart_is_named_and_the_suggested_range_holds_the_rest(monkeypatch):
    """Minima a few counts apart (a camera's dark level) named the darkest image as a setter of the range
    beside the hot pixel, counted it out of "the other" images, and suggested a range that cut into it."""
    ranges = {"a.tif": [98, 4000], "b.tif": [97, 3900], "c.tif": [100, 65535], "d.tif": [101, 4095]}
    pairs = [(f"/d/images/{name}", f"/d/masks/{name}") for name in ranges]
    monkeypatch.setattr(train_unet, "start_up_facts", lambda pairs, cfg: {
        os.path.abspath(image): {"range": ranges[Path(image).name]} for image, _ in pairs})
    note = train_unet.range_set_by_few(pairs, {}, [97, 65535])
    assert note.startswith("intensity_range=[97, 65535] is set by c.tif's maximum (65535); the other 3 training "
                           "image(s) lie within [97, 4095]") and note.endswith("set intensity_range=97,4095")
    ranges.update({"b.tif": [3, 3900], "c.tif": [100, 4100]})
    assert train_unet.range_set_by_few(pairs, {}, [3, 4100]) is None  # nothing stands apart: no note
    ranges.update({"b.tif": [30000, 30100], "a.tif": [30050, 30200], "d.tif": [30020, 30150]})  # c's minimum does
    assert "set by c.tif's minimum (100); the other 3" in train_unet.range_set_by_few(pairs, {}, [100, 30200])


@pytest.mark.parametrize("given", [[4095, 0], [5, 5], "0,4095", [4095], (0, float("inf"))])
def test_a_library_read_checks_its_intensity_range(tmp_path, given):
    """read_image(path, 1, [4095, 0]) in a notebook inverted the image, unsaid; [5, 5] gave -inf pixels; "0,4095"
    and [4095] failed in unpacking, a traceback. The command line's rule, one line."""
    path = tmp_path / "g16.png"
    cv2.imwrite(str(path), np.arange(4096, dtype=np.uint16).reshape(64, 64))
    with pytest.raises(train_unet.UserError, match=r"intensity_range=.* must be \[low, high\] with low < high"):
        train_unet.read_image(path, 1, given)
    assert train_unet.read_image(path, 1, (0, 4095)).max() == 1.0  # a tuple, as train() takes
