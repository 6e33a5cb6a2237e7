"""Issue 11, real data as it comes: independent augmentations, 16-bit and float images, VOC void
labels, a cached data check, a smooth LR when a run is extended, exact CE under accumulation."""
import itertools
import math
import os
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import tifffile
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import train_unet
from train_unet import IGNORE_INDEX, SegDataset, SegLoss, UserError, prepare_data, read_image

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import convert_depth  # noqa: E402


def one_line_error(fn, *args, match):
    with pytest.raises(UserError, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


# ----------------------------------------------------------------------------------------------------
# 1. Augmentations fire independently
# ----------------------------------------------------------------------------------------------------
class Recording:
    """Wraps the dataset's Compose and records which transforms fired on each sample."""

    def __init__(self, inner):
        self.inner, self.fired = inner, []
        inner.save_applied_params = True

    def set_random_state(self, *args):
        self.inner.set_random_state(*args)

    def __call__(self, **data):
        out = self.inner(**data)
        self.fired.append({name for name, _ in out["applied_transforms"]})
        return out


def test_augmentations_fire_independently_with_their_own_probability(make_cfg, tmp_path):
    """One blob near the top-left corner, 400 samples through the training dataset: the blob lands
    in all four quadrants about equally often, and no two transforms fire in lock-step."""
    image = np.full((64, 64, 3), 90, np.uint8)
    mask = np.zeros((64, 64), np.uint8)
    image[5:15, 5:15], mask[5:15, 5:15] = 200, 255
    cv2.imwrite(str(tmp_path / "img.png"), image)
    cv2.imwrite(str(tmp_path / "mask.png"), mask)
    n = 400
    ds = SegDataset([(tmp_path / "img.png", tmp_path / "mask.png")] * n, make_cfg(), train=True)
    ds.transform = Recording(ds.transform)
    quadrants = {}
    for i in range(n):
        rows, cols = np.nonzero(ds[i][1].numpy() == 1)
        key = (rows.mean() >= 32, cols.mean() >= 32)  # (moved down, moved right)
        quadrants[key] = quadrants.get(key, 0) + 1
        fired = ds.transform.fired[-1]
        assert key == ("VerticalFlip" in fired, "HorizontalFlip" in fired)
    # Expected 100 each (binomial sd ~8.7): 65..135 is 4 sd; the old lock-step gave 0 in two of them.
    assert len(quadrants) == 4 and all(65 <= c <= 135 for c in quadrants.values()), quadrants
    names = ("HorizontalFlip", "VerticalFlip", "Affine", "RandomBrightnessContrast")
    for a, b in itertools.combinations(names, 2):
        both = sum(a in f and b in f for f in ds.transform.fired)
        assert 65 <= both <= 135, (a, b, both)  # independent: 25% of samples, not 50% (or 0%)
    for name in names:
        assert 160 <= sum(name in f for f in ds.transform.fired) <= 240, name


def test_augmentation_draws_depend_on_seed_epoch_and_index_only(make_cfg, data_dir):
    cfg = make_cfg()
    train, _ = prepare_data(cfg)
    a, b = SegDataset(train, cfg, train=True), SegDataset(train, cfg, train=True)
    order = [3, 1, 3, 0]
    first = [a[i] for i in order]
    second = [b[i] for i in reversed(order)][::-1]  # another order of calls: same samples
    for (xa, ya), (xb, yb) in zip(first, second):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)


# ----------------------------------------------------------------------------------------------------
# 2. Images of every common depth and type, one scaling rule
# ----------------------------------------------------------------------------------------------------
def base_image(seed=0, h=40, w=56):
    rng = np.random.default_rng(seed)
    image = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    image[0, 0], image[0, 1] = 0, 255  # full range, so float min/max scaling equals /255
    return image


def write_variants(folder, rgb):
    """The same picture as 8-bit PNG, 16-bit PNG, 8/16-bit and float32 TIFF (tifffile), LZW TIFF (cv2)."""
    folder.mkdir(parents=True, exist_ok=True)
    bgr = cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR) if rgb.ndim == 3 else rgb
    wide = rgb.astype(np.uint16) * 257
    paths = {"png8": folder / "a.png", "png16": folder / "b.png", "tif8": folder / "c.tif",
             "tif16": folder / "d.tif", "tif32f": folder / "e.tif", "tif16_lzw": folder / "f.tif"}
    cv2.imwrite(str(paths["png8"]), bgr)
    cv2.imwrite(str(paths["png16"]), bgr.astype(np.uint16) * 257)
    kind = {"photometric": "rgb" if rgb.ndim == 3 else "minisblack"}
    tifffile.imwrite(paths["tif8"], rgb, **kind)
    tifffile.imwrite(paths["tif16"], wide, **kind)
    tifffile.imwrite(paths["tif32f"], rgb.astype(np.float32) / 255 * 7.0 - 2.0, **kind)  # any float range
    cv2.imwrite(str(paths["tif16_lzw"]), bgr.astype(np.uint16) * 257)  # OpenCV writes LZW TIFFs
    return paths


@pytest.mark.parametrize("gray", [False, True])
@pytest.mark.parametrize("channels", [1, 3])
def test_every_depth_and_type_reads_to_the_same_values(tmp_path, gray, channels):
    rgb = base_image()
    picture = cv2.cvtColor(rgb, cv2.COLOR_RGB2GRAY) if gray else rgb
    if gray:
        picture[0, 0], picture[0, 1] = 0, 255
    paths = write_variants(tmp_path, picture)
    reference = read_image(paths["png8"], channels)
    assert reference.dtype == np.uint8  # 8-bit files stay 8-bit: their results do not change
    assert reference.shape == (40, 56) + ((3,) if channels == 3 else ())
    for kind, path in paths.items():
        image = read_image(path, channels)
        assert image.shape == reference.shape, kind
        unit = image.astype(np.float32) / 255 if image.dtype == np.uint8 else image
        assert unit.dtype == np.float32 and 0 <= unit.min() and unit.max() <= 1, kind
        # RGB->gray of 16-bit/float pixels rounds differently from 8-bit: within one 8-bit level
        tol = 1.01 / 255 if channels == 1 and not gray else 1e-6
        np.testing.assert_allclose(unit, reference / 255.0, atol=tol, err_msg=kind)


def test_twelve_bit_data_keep_their_depth(tmp_path):
    """0..4095 stored in a 16-bit PNG: 4096 levels survive (the old reader left 16), scaled by 65535."""
    ramp = np.tile(np.arange(4096, dtype=np.uint16).reshape(64, 64), 1)
    path = tmp_path / "twelve.png"
    cv2.imwrite(str(path), ramp)
    image = read_image(path, 1)
    assert image.dtype == np.float32 and len(np.unique(image)) == 4096
    np.testing.assert_allclose(image, ramp / 65535.0, rtol=1e-6)


def test_float_images_are_scaled_by_their_own_min_and_max(tmp_path):
    path = tmp_path / "f.tif"
    values = np.linspace(-3.0, 1500.0, 32 * 32, dtype=np.float32).reshape(32, 32)
    tifffile.imwrite(path, values)
    image = read_image(path, 1)
    assert image.min() == 0.0 and image.max() == 1.0
    np.testing.assert_allclose(image, (values + 3.0) / 1503.0, atol=1e-6)
    tifffile.imwrite(path, np.full((8, 8), 5.0, np.float32))
    assert read_image(path, 3).max() == 0.0  # a constant image: no division by zero


def test_sixteen_bit_and_float_give_the_training_tensors_of_8_bit(make_cfg, tmp_path):
    rgb = base_image(h=64, w=64)
    paths = write_variants(tmp_path / "v", rgb)
    mask = tmp_path / "m.png"
    cv2.imwrite(str(mask), (rgb[..., 0] > 128).astype(np.uint8) * 255)
    cfg = make_cfg()
    level = 1 / 255 / 0.224  # one 8-bit grey level after normalisation
    for train in (False, True):
        ref_x, ref_y = SegDataset([(paths["png8"], mask)], cfg, train=train)[0]
        for kind in paths:
            x, y = SegDataset([(paths[kind], mask)], cfg, train=train)[0]  # same draws: same index
            # Normalisation happens on the [0, 1] scale for every dtype (max_pixel_value 255 vs 1);
            # augmenting uint8 rounds to whole levels, floats do not: within ~1 level when training.
            assert (x - ref_x).abs().max() <= (1.5 * level if train else 1e-5), (kind, train)
            assert (x - ref_x).abs().mean() <= (0.5 * level if train else 1e-6), (kind, train)
            assert torch.equal(y, ref_y)


@pytest.mark.parametrize("case, match", [
    ("stack", "multi-page TIFFs are not supported"),
    ("channels", "at most 4 channels"),
    ("complex", "pixels of type complex64"),
    ("nan", "NaN or inf"),
])
def test_unsupported_images_are_one_line_errors(tmp_path, make_cfg, data_dir, case, match):
    path = tmp_path / f"{case}.tif"
    data = {"stack": np.zeros((5, 16, 16), np.uint16),
            "channels": np.zeros((16, 16, 6), np.uint16),
            "complex": np.zeros((16, 16), np.complex64),
            "nan": np.array([[np.nan, 1.0], [0.5, 0.0]], np.float32)}[case]
    extra = {"photometric": "minisblack", "planarconfig": "contig"} if case == "channels" else \
        {"photometric": "minisblack"} if case == "stack" else {}
    tifffile.imwrite(path, data, **extra)
    message = one_line_error(read_image, path, 3, match=match)
    assert str(path) in message
    # ... and the data check stops a run on it at minute 0
    image = sorted((data_dir / "images").glob("*.png"))[0]
    image.unlink()
    tifffile.imwrite(image.with_suffix(".tif"), data, **extra)
    one_line_error(prepare_data, make_cfg(), match=match)


def test_predict_reads_and_scales_the_same_way(tmp_path, make_cfg):
    """predict on 16-bit PNGs and float TIFFs = predict on their 8-bit originals; overlays are 8-bit."""
    cfg = make_cfg()
    torch.manual_seed(0)
    model = train_unet.build_model(cfg)
    ckpt = tmp_path / "m.pt"
    train_unet.save_checkpoint(ckpt, {"model": model.state_dict(), "config": cfg})
    rgb = base_image(h=48, w=64)
    paths = write_variants(tmp_path / "inputs", rgb)
    outputs = {}
    for kind in ("png8", "png16", "tif32f"):
        folder = tmp_path / kind
        folder.mkdir()
        (folder / "x.png" if kind != "tif32f" else folder / "x.tif").write_bytes(paths[kind].read_bytes())
        out = tmp_path / f"out_{kind}"
        result = train_unet.predict({"checkpoint": str(ckpt), "input": str(folder), "output": str(out),
                                     "overlay": True, "device": "cpu", "use_amp": False, "progress": False})
        assert result["predicted"] == 1 and not result["failed"]
        outputs[kind] = (cv2.imread(str(out / "x.png"), cv2.IMREAD_UNCHANGED),
                         cv2.imread(str(out / "x_overlay.png"), cv2.IMREAD_UNCHANGED))
    mask8, overlay8 = outputs["png8"]
    assert overlay8.dtype == np.uint8 and overlay8.shape == (48, 64, 3)
    for kind in ("png16", "tif32f"):
        mask, overlay = outputs[kind]
        assert (mask == mask8).mean() > 0.999, kind  # only ties at |logit| ~ 1e-6 could differ
        assert overlay.dtype == np.uint8 and overlay.shape == overlay8.shape
        assert np.abs(overlay.astype(int) - overlay8.astype(int)).max() <= 1, kind


def test_overlay_of_a_16_bit_image_is_a_sensible_8_bit_picture():
    image = np.arange(64 * 64, dtype=np.float32).reshape(64, 64) / (64 * 64 - 1)  # as read_image gives
    mask = np.zeros((64, 64), np.uint8)
    overlay = train_unet.overlay_image(image, mask)
    assert overlay.dtype == np.uint8 and overlay.shape == (64, 64, 3)
    assert overlay.min() == 0 and overlay.max() == 255  # the full range, not black or one grey level
    np.testing.assert_array_equal(overlay[..., 0], np.round(image * 255).astype(np.uint8))


# ----------------------------------------------------------------------------------------------------
# 3. VOC void (255) in multi-class masks; binary 0/255 unchanged
# ----------------------------------------------------------------------------------------------------
def voc_mask(size=64, seed=0):
    rng = np.random.default_rng(seed)
    mask = np.zeros((size, size), np.uint8)
    mask[8:30, 8:30], mask[34:60, 30:60] = 1, 2
    mask[7:31, 7] = 255  # a void boundary, as VOC draws them
    mask[rng.integers(0, size, 20), rng.integers(0, size, 20)] = 255
    return mask


def test_voc_void_is_accepted_and_kept_as_ignore(tmp_path):
    path = tmp_path / "voc.png"
    cv2.imwrite(str(path), voc_mask())
    mask = train_unet.read_mask(path, 3)
    assert set(np.unique(mask).tolist()) == {0, 1, 2, IGNORE_INDEX}
    np.testing.assert_array_equal(mask, voc_mask())
    cv2.imwrite(str(path), np.array([[0, 255], [255, 0]], np.uint8))  # binary: 255 is foreground
    np.testing.assert_array_equal(train_unet.read_mask(path, 1), [[0, 1], [1, 0]])


def test_void_hints_never_suggest_256_classes(tmp_path):
    path = tmp_path / "voc.png"
    cv2.imwrite(str(path), voc_mask())
    message = one_line_error(train_unet.read_mask, path, 1, match="set num_classes=3")
    assert "255 = void" in message and "256" not in message
    cv2.imwrite(str(path), np.where(voc_mask() == 2, 7, voc_mask()).astype(np.uint8))
    message = one_line_error(train_unet.read_mask, path, 3, match="holds class 7 but num_classes=3")
    assert "set num_classes=8" in message and "256" not in message


def test_loss_and_metric_skip_void_like_padding():
    torch.manual_seed(0)
    target = torch.from_numpy(voc_mask(16)).long()[None].repeat(2, 1, 1)
    logits = torch.randn(2, 3, 16, 16, requires_grad=True)
    real = target != IGNORE_INDEX
    for kind in ("ce", "dice+ce", "dice"):
        loss_fn = SegLoss(3, kind)
        loss = loss_fn(logits, target)
        noisy = logits.detach().clone()
        noisy[:, :, ~real[0]] += 100 * torch.randn_like(noisy[:, :, ~real[0]])  # void pixels only
        assert torch.allclose(loss_fn(noisy, target), loss, atol=1e-6), kind
    ce = nn.functional.cross_entropy(logits.permute(0, 2, 3, 1)[real], target[real])
    assert torch.allclose(SegLoss(3, "ce")(logits, target), ce, atol=1e-6)
    metric = train_unet.SegMetric(3)
    pred = logits.detach().clone()
    metric.update(pred, target)
    before = metric.matrix.clone()
    assert before.sum() == real.sum()  # void pixels are not counted
    worse = pred.clone()
    worse[:, 0][~real] = 1e4  # "background" everywhere in void: nothing changes
    metric2 = train_unet.SegMetric(3)
    metric2.update(worse, target)
    assert torch.equal(metric2.matrix, before)


def write_voc_set(root, count=12, size=64):
    """The shapes set with 3 classes and a void ring around each object (VOC style)."""
    train_unet.generate_shapes_dataset(root, count=count, size=size, num_classes=3)
    for path in (root / "masks").glob("*.png"):
        mask = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
        ring = cv2.dilate((mask > 0).astype(np.uint8), np.ones((3, 3), np.uint8)) - (mask > 0)
        mask[ring > 0] = 255
        cv2.imwrite(str(path), mask)
    return root


def test_voc_masks_train_with_void_ignored(make_cfg, tmp_path):
    root = write_voc_set(tmp_path / "voc")
    cfg = make_cfg(data_dir=str(root), num_classes=3, batch_size=4)
    train, val = prepare_data(cfg)
    x, y = SegDataset(train, cfg, train=True)[0]
    assert set(torch.unique(y).tolist()) <= {0, 1, 2, IGNORE_INDEX} and (y == IGNORE_INDEX).any()
    result = train_unet.train(cfg)
    row = result["history"][-1]
    assert math.isfinite(row["train_loss"]) and math.isfinite(row["val_loss"]) and 0 <= row["val_iou"] <= 1


def test_a_set_of_only_0_255_masks_with_many_classes_is_refused(make_cfg, data_dir):
    message = one_line_error(prepare_data, make_cfg(num_classes=3), match="255 means void")
    assert "num_classes=1" in message


# ----------------------------------------------------------------------------------------------------
# 4. The data check runs once per file, cached by (path, size, mtime)
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def count_decodes(monkeypatch):
    calls = []
    real_mask, real_image = train_unet.decode_mask, train_unet.decode_image
    monkeypatch.setattr(train_unet, "decode_mask", lambda p: calls.append(p) or real_mask(p))
    monkeypatch.setattr(train_unet, "decode_image", lambda p, c=3: calls.append(p) or real_image(p, c))
    return calls


def test_second_start_up_decodes_nothing(make_cfg, data_dir, count_decodes):
    cfg = make_cfg()
    first = prepare_data(cfg)
    assert len(count_decodes) == 24  # 12 pairs, each file once
    assert (data_dir / train_unet.CHECK_CACHE_NAME).is_file()
    count_decodes.clear()
    assert prepare_data(cfg) == first
    assert count_decodes == []


def test_a_changed_file_is_checked_again(make_cfg, data_dir, count_decodes):
    cfg = make_cfg()
    prepare_data(cfg)
    count_decodes.clear()
    bad = sorted((data_dir / "masks").glob("*.png"))[0]
    cv2.imwrite(str(bad), np.full((64, 64), 7, np.uint8))
    one_line_error(prepare_data, cfg, match="holds values")
    assert [Path(p).resolve() for p in count_decodes] == [bad.resolve()]


def test_read_only_data_folder_keeps_the_cache_in_checkpoint_dir(make_cfg, data_dir, count_decodes):
    (data_dir / train_unet.CHECK_CACHE_NAME).mkdir()  # cannot be written as a file (works as root too)
    cfg = make_cfg()
    prepare_data(cfg)
    assert (Path(cfg["checkpoint_dir"]) / train_unet.CHECK_CACHE_NAME).is_file()
    count_decodes.clear()
    prepare_data(cfg)
    assert count_decodes == []


def test_other_ranks_check_only_their_share_and_never_write(make_cfg, data_dir, monkeypatch, count_decodes):
    """Rank 1 of 2 takes its share of the pairs from the cache, exchanges it (gather_setup: rank 0's
    share faked from the cache file) and writes nothing."""
    cfg = make_cfg()
    prepare_data(cfg)  # a first check, as rank 0's
    count_decodes.clear()
    monkeypatch.setattr(train_unet, "DIST", train_unet.Dist(rank=1, world=2))
    waits, sent = [], []
    cache = train_unet.load_check_cache(Path(cfg["data_dir"]) / train_unet.CHECK_CACHE_NAME)

    def gather(mine):
        if not isinstance(mine, dict):  # said_once_if_alike's exchange of a start-up error (None: none)
            return [mine, mine]
        sent.append(mine)
        return [{p: e for p, e in cache.items() if p not in mine}, mine]
    monkeypatch.setattr(train_unet, "gather_setup", gather)
    monkeypatch.setattr(train_unet, "barrier", lambda: waits.append(1))
    monkeypatch.setattr(train_unet, "save_check_cache", lambda *a: pytest.fail("only rank 0 writes"))
    monkeypatch.setattr(train_unet, "write_embedded_dataset", lambda *a: pytest.fail("rank 1 writes"))
    pairs = train_unet.find_pairs(data_dir)
    train_unet.check_pairs(pairs, cfg)
    assert waits and count_decodes == []
    assert sorted(sent[0]) == sorted(os.path.abspath(p) for pair in pairs[1::2] for p in pair)


def test_getitem_runs_no_np_unique(make_cfg, data_dir, monkeypatch):
    cfg = make_cfg()
    train, _ = prepare_data(cfg)
    calls = []
    real = np.unique

    def counting(*args, **kwargs):
        if sys._getframe(1).f_code.co_filename == train_unet.__file__:
            calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(np, "unique", counting)
    ds = SegDataset(train, cfg, train=True)
    for i in range(len(ds)):
        ds[i]
    assert calls == []


# ----------------------------------------------------------------------------------------------------
# 5. Extending a finished run continues the learning rate smoothly
# ----------------------------------------------------------------------------------------------------
def test_extended_schedule_is_continuous():
    cfg = dict(train_unet.CONFIG, epochs=10, warmup_fraction=0.05)
    old = train_unet.lr_schedule(cfg)  # in epochs of progress, sampled here at 5 steps per epoch
    for stop in (30, 50):  # interrupted at epoch 6, or finished
        new = train_unet.extend_schedule(old, stop / 5, 20)
        factors = [train_unet.lr_factor(s / 5, new) for s in range(0, 101)]
        assert factors[:stop + 1] == [train_unet.lr_factor(s / 5, old) for s in range(stop + 1)]
        jumps = [abs(b - a) for a, b in zip(factors[stop:], factors[stop + 1:])]
        assert max(jumps) < 0.05 * factors[stop] + 1e-12  # no restart: small steps only
        assert factors[-1] == pytest.approx(train_unet.LR_FLOOR)
        assert all(b <= a + 1e-12 for a, b in zip(factors[stop:], factors[stop + 1:]))


def test_extending_a_run_at_its_lr_floor_says_the_added_epochs_barely_train():
    cfg = dict(train_unet.CONFIG, epochs=10)
    for done, at_floor in ((10, True), (6, False)):  # finished, or interrupted mid-cosine
        state = {"config": {"epochs": 10}, "epoch": done, "lr_schedule": train_unet.lr_schedule(cfg)}
        notes = []
        train_unet.resumed_schedule(state, {**cfg, "epochs": 20}, 5, notes)
        assert len(notes) == 1 and notes[0].startswith("epochs changed from 10 to 20")
        assert ("change the weights little" in notes[0]) == at_floor, notes[0]
        assert ("start a new run" in notes[0]) == at_floor


def test_extending_a_finished_run_does_not_jump_the_lr(make_cfg, optimizer_steps, capsys):
    cfg = make_cfg(epochs=2, early_stopping_patience=None, warmup_fraction=0.0)
    lrs = optimizer_steps()
    train_unet.train(cfg)
    before = list(lrs)
    lrs.clear()
    finished = train_unet.load_checkpoint(Path(cfg["checkpoint_dir"]) / "last.pt")["model"]
    result = train_unet.train({**cfg, "resume": True, "epochs": 4})
    out = capsys.readouterr().out
    assert "stays at its floor" in out  # said in the banner
    # ... and what the added epochs do change (the note said only "the weights little", user test: val IoU
    # 0.19 -> 0.37 in one added epoch): BatchNorm's running statistics, which no learning rate slows
    assert "though BatchNorm's running statistics, which follow no learning rate, are estimated again" in out
    extended = train_unet.load_checkpoint(Path(cfg["checkpoint_dir"]) / "last.pt")["model"]
    change = lambda keys: (sum(float((extended[k].float() - finished[k].float()).norm()) for k in keys)  # noqa: E731
                           / sum(float(finished[k].float().norm()) for k in keys))
    stats = [k for k in finished if k.endswith(("running_mean", "running_var"))]
    weights = [k for k in finished if k.endswith("weight") and finished[k].ndim == 4]
    assert change(stats) > 10 * change(weights), (change(stats), change(weights))
    ended = result["history"][1]["lr"]  # the LR the finished run ended at (1% of the peak)
    assert ended == pytest.approx(cfg["learning_rate"] * train_unet.LR_FLOOR)
    assert lrs[0] == pytest.approx(ended, rel=1e-6)  # continues there (it restarted near the peak)
    assert max(lrs) <= before[-1]  # never above the last LR used before the extension
    assert all(r["lr"] == pytest.approx(ended, rel=1e-6) for r in result["history"][2:])


def test_interrupted_extended_run_resumes_exactly(make_cfg, tmp_path, monkeypatch, interrupt_at):
    """2 epochs, then extended to 4: straight through, or interrupted after epoch 3 and resumed."""
    def run(name, stop_at=None):
        cfg = make_cfg(epochs=2, early_stopping_patience=None, checkpoint_dir=str(tmp_path / name))
        train_unet.train(cfg)
        if stop_at:
            real = interrupt_at(stop_at)
            with pytest.raises(KeyboardInterrupt):
                train_unet.train({**cfg, "resume": True, "epochs": 4})
            monkeypatch.setattr(train_unet, "run_epoch", real)
        train_unet.train({**cfg, "resume": True, "epochs": 4})
        return train_unet.load_checkpoint(Path(cfg["checkpoint_dir"]) / "last.pt")
    a, b = run("straight"), run("interrupted", stop_at=4)
    assert [r["lr"] for r in a["history"]] == [r["lr"] for r in b["history"]]
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key


# ----------------------------------------------------------------------------------------------------
# 6. Gradient accumulation: exact CE on padded images
# ----------------------------------------------------------------------------------------------------
def padded_batch(num_classes, seed=0):
    """4 images; the first two mostly padding (IGNORE_INDEX), as a small image padded to a square."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(4, 3, 16, 16, generator=g)
    y = torch.randint(0, max(2, num_classes), (4, 16, 16), generator=g)
    y[:2, 3:, :] = IGNORE_INDEX
    y[:2, :, 5:] = IGNORE_INDEX
    return x, y


def tiny_net(num_classes):
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, num_classes, 1))


def grads_after(model, batches, loss_fn, k):
    hw = train_unet.detect_hardware("cpu")
    fp32 = train_unet.Precision(torch.float32, False, "test")
    model.zero_grad(set_to_none=True)
    run = train_unet.Run(model, model, None, None, None, fp32, loss_fn=loss_fn)
    for group, group_valid in train_unet.accumulation_groups(batches, k, "cpu"):
        for x, y in group:
            train_unet.forward_backward(run, x, y, hw, len(group), group_valid)
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("num_classes", [1, 3])
def test_accumulated_ce_gradients_equal_one_big_batch_on_padded_images(num_classes):
    x, y = padded_batch(num_classes)
    loss_fn = SegLoss(num_classes, "ce")
    model = tiny_net(num_classes)
    big = grads_after(model, [(x, y)], loss_fn, 1)
    accumulated = grads_after(model, [(x[:2], y[:2]), (x[2:], y[2:])], loss_fn, 2)
    for a, b in zip(big, accumulated):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
    # The single big batch is the plain mean CE over its real pixels (what SegLoss reports)
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()
    for a, p in zip(big, model.parameters()):
        torch.testing.assert_close(p.grad, a, rtol=1e-5, atol=1e-7)


def test_train_one_epoch_accumulation_matches_one_batch_with_padding():
    """Through the training loop: SGD (linear in the gradient), 2 x 2 accumulated vs 1 x 4."""
    x, y = padded_batch(1, seed=1)
    hw = train_unet.detect_hardware("cpu")
    fp32 = train_unet.Precision(torch.float32, False, "test")
    results = []
    for batch, k in ((4, 1), (2, 2)):
        model = tiny_net(1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
        cfg = dict(train_unet.CONFIG, num_classes=1, progress=False, channels_last=False,
                   grad_clip_norm=None, accumulation_steps=k)
        loader = DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)
        run = train_unet.Run(model, model, optimizer, scheduler, None, fp32, loss_fn=SegLoss(1, "ce"))
        train_unet.train_one_epoch(run, loader, cfg, hw)
        results.append([p.detach().clone() for p in model.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)


# ----------------------------------------------------------------------------------------------------
# The 8-bit / 16-bit conversion used for the "same IoU in 8 and 16 bits" runs
# ----------------------------------------------------------------------------------------------------
def test_convert_depth_writes_16_and_12_bit_copies(make_data, tmp_path):
    src = make_data("src", count=3)
    for depth, top in ((16, 65535), (12, 4095)):
        out = convert_depth.convert(src, tmp_path / f"d{depth}", depth)
        a = sorted((src / "images").glob("*.png"))[0]
        b = cv2.imread(str(out / "images" / a.name), cv2.IMREAD_UNCHANGED)
        assert b.dtype == np.uint16 and b.max() <= top
        np.testing.assert_array_equal(b, np.round(cv2.imread(str(a), cv2.IMREAD_UNCHANGED).astype(np.float64)
                                                  * top / 255).astype(np.uint16))
        assert (out / "masks").is_dir() and len(list((out / "masks").glob("*.png"))) == 3


def test_the_cache_file_alone_is_not_a_data_set(tmp_path):
    """An emptied embedded-data folder that still holds our cache is regenerated, not refused."""
    folder = tmp_path / "shapes"
    folder.mkdir()
    (folder / train_unet.CHECK_CACHE_NAME).write_text("{}")
    assert not train_unet.has_files(folder)
    (folder / "images").mkdir()
    (folder / "images" / "a.png").write_bytes(b"x")
    assert train_unet.has_files(folder)


@pytest.mark.parametrize("suffix", [".png", ".jpg"])
def test_8_bit_files_read_and_normalise_exactly_as_before(tmp_path, make_cfg, suffix):
    import albumentations as A

    path = tmp_path / f"a{suffix}"
    cv2.imwrite(str(path), base_image())
    before = {3: cv2.cvtColor(cv2.imread(str(path), cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB),
              1: cv2.imread(str(path), cv2.IMREAD_GRAYSCALE)}  # the previous reader
    for channels, old in before.items():
        new = read_image(path, channels)
        assert new.dtype == np.uint8 and np.array_equal(new, old)
        mean, std = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225)) if channels == 3 else ((0.5,), (0.25,))
        normalised = train_unet.UnitRangeNormalize(mean, std)(new)
        assert np.array_equal(normalised, A.Normalize(mean=mean, std=std)(image=old)["image"])
