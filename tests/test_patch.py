"""data_mode=patch: training patches at native resolution, and the blended sliding window that
validation and predict share (predict_logits).

Numerics are checked with small exact models (a 1x1 and a 3x3 convolution, no BatchNorm), where the
expected answer is known; a tiny U-Net covers the end-to-end path.
"""
import cv2
import numpy as np
import pytest
import torch
import torch.nn as nn

import train_unet
from train_unet import IGNORE_INDEX, PatchDataset, UserError, cut_patch, foreground_index, predict_logits


@pytest.fixture
def fp32():
    return train_unet.Precision(torch.float32, False, "test")


def window_cfg(**overrides):
    """The keys the sliding window reads, at a 32 px window."""
    return {**train_unet.CONFIG, "image_size": 32, "tile_overlap": 0.5, "tile_batch_size": 4, "num_classes": 1,
            "in_channels": 3, "channels_last": False, "patch_scale": 1.0, "data_mode": "patch", **overrides}


def conv_model(kernel, seed=0, classes=1):
    """A plain convolution stack ('same' zero padding): receptive field radius = number of 3x3 layers."""
    torch.manual_seed(seed)
    layers = [nn.Conv2d(3, classes, 1)] if kernel == 1 else \
        [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, classes, 3, padding=1)]
    return nn.Sequential(*layers).eval()


def full_forward(model, image, cfg):
    """The reference: one forward pass over the whole (normalized) image."""
    with torch.no_grad():
        return model(train_unet.image_tensor(train_unet.normalizer(cfg)(image))[None])[0]


def rng_image(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------------
# The sliding window
# ---------------------------------------------------------------------------------------------------
def test_constant_image_gives_a_seam_free_constant_prediction(fp32):
    """Overlapping tiles in a grid that does not divide the image: the blend is exactly constant."""
    cfg = window_cfg(tile_overlap=0.25)
    image = np.full((150, 230, 3), 97, np.uint8)
    logits = predict_logits(conv_model(1), image, cfg, fp32, train_unet.detect_hardware("cpu"))
    assert logits.shape == (1, 150, 230) and logits.dtype == torch.float32
    expected = full_forward(conv_model(1), image[:1, :1], cfg)[0, 0, 0]
    assert torch.allclose(logits, expected.expand_as(logits), atol=1e-5), (logits.min(), logits.max())


def clean_pixels(height, width, window, overlap, radius):
    """Pixels that every covering tile holds with their whole receptive field (not within `radius`
    of a tile edge that lies inside the image)."""
    ys = train_unet.tile_starts(height, window, overlap)
    xs = train_unet.tile_starts(width, window, overlap)
    dirty = np.zeros((height, width), bool)
    for y in ys:
        for x in xs:
            tile = np.zeros((window, window), bool)
            if y > 0:
                tile[:radius] = True
            if y + window < height:
                tile[-radius:] = True
            if x > 0:
                tile[:, :radius] = True
            if x + window < width:
                tile[:, -radius:] = True
            dirty[y:y + window, x:x + window] |= tile
    return ~dirty


@pytest.mark.parametrize("overlap", [0.0, 0.25, 0.5])
def test_sliding_window_equals_a_full_forward_where_tiles_hold_the_receptive_field(fp32, overlap):
    cfg = window_cfg(tile_overlap=overlap)
    model, image = conv_model(3), rng_image(100, 140)
    logits = predict_logits(model, image, cfg, fp32, train_unet.detect_hardware("cpu"))
    full = full_forward(model, image, cfg)
    clean = torch.from_numpy(clean_pixels(100, 140, 32, overlap, radius=2))
    assert clean.float().mean() > 0.5
    assert torch.allclose(logits[0][clean], full[0][clean], atol=1e-5)
    # where a tile edge cut the receptive field the blend differs: the comparison above is not vacuous
    assert (logits[0][~clean] - full[0][~clean]).abs().max() > 1e-4


def test_results_do_not_depend_on_the_tile_batch_size(fp32):
    import segmentation_models_pytorch as smp

    torch.manual_seed(0)
    model = smp.Unet("resnet18", encoder_weights=None, classes=3).eval()
    image, hw = rng_image(90, 150, seed=1), train_unet.detect_hardware("cpu")
    out = [predict_logits(model, image, window_cfg(num_classes=3, tile_batch_size=b), fp32, hw) for b in (1, 3, 64)]
    assert out[0].shape == (3, 90, 150)
    for other in out[1:]:
        assert torch.allclose(out[0], other, atol=1e-4)
        assert np.array_equal(train_unet.logits_to_mask(out[0], 3), train_unet.logits_to_mask(other, 3))


def test_images_smaller_than_a_tile_are_padded_and_cropped(fp32):
    cfg, model, hw = window_cfg(), conv_model(3), train_unet.detect_hardware("cpu")
    image = rng_image(20, 27)
    padded = np.zeros((32, 32, 3), np.uint8)
    padded[:20, :27] = image
    logits = predict_logits(model, image, cfg, fp32, hw)
    assert logits.shape == (1, 20, 27)
    assert torch.allclose(logits, full_forward(model, padded, cfg)[:, :20, :27], atol=1e-5)


def test_patch_scale_predicts_at_the_original_size(fp32):
    cfg, hw = window_cfg(patch_scale=0.5), train_unet.detect_hardware("cpu")
    logits = predict_logits(conv_model(1), rng_image(101, 77), cfg, fp32, hw)
    assert logits.shape == (1, 101, 77)


class ShapeRecorder(nn.Module):
    """Records every input batch the model sees (what would sit on the device)."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.shapes = inner, []

    def forward(self, x):
        self.shapes.append(tuple(x.shape))
        return self.inner(x)


def test_device_memory_does_not_grow_with_the_image(fp32):
    """Only one batch of tiles is ever handed to the model; the full-size sum stays on the CPU.
    (On a GPU, tests/test_patch.py::test_cuda_memory_is_the_same_for_small_and_huge_images measures it.)"""
    cfg, hw = window_cfg(tile_batch_size=5), train_unet.detect_hardware("cpu")
    sizes = {}
    for h, w in ((100, 100), (700, 900)):
        model = ShapeRecorder(conv_model(1))
        logits = predict_logits(model, rng_image(h, w), cfg, fp32, hw)
        assert logits.device.type == "cpu" and logits.dtype == torch.float32
        sizes[(h, w)] = (max(np.prod(s) for s in model.shapes), len(model.shapes))
    (small, small_calls), (big, big_calls) = sizes[(100, 100)], sizes[(700, 900)]
    assert small == big == 5 * 3 * 32 * 32
    assert big_calls > 20 * small_calls


def test_logits_are_accumulated_in_fp32_under_autocast():
    cfg, hw = window_cfg(), train_unet.detect_hardware("cpu")
    bf16 = train_unet.Precision(torch.bfloat16, False, "test")
    logits = predict_logits(conv_model(3), rng_image(70, 70), cfg, bf16, hw)
    assert logits.dtype == torch.float32
    reference = predict_logits(conv_model(3), rng_image(70, 70), cfg, train_unet.Precision(torch.float32, False, "t"), hw)
    assert (logits - reference).abs().max() < 0.05  # bf16 forward, fp32 sum: close, not equal


@pytest.mark.cuda
def test_cuda_memory_is_the_same_for_small_and_huge_images():
    hw = train_unet.detect_hardware("cuda")
    cfg, prec = window_cfg(image_size=256, tile_batch_size=8), train_unet.Precision(torch.bfloat16, False, "t")
    model, peaks = conv_model(3).to(hw.device), []
    for side in (1000, 20000):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        predict_logits(model, np.zeros((side, side, 3), np.uint8), cfg, prec, hw)
        peaks.append(torch.cuda.max_memory_allocated() - base)
    assert peaks[1] <= peaks[0] * 1.05 + (1 << 20), peaks


# ---------------------------------------------------------------------------------------------------
# Training patches
# ---------------------------------------------------------------------------------------------------
def blob_mask(h, w, boxes):
    mask = np.zeros((h, w), np.uint8)
    for value, (y, x, s) in boxes:
        mask[y:y + s, x:x + s] = value
    return mask


def foreground_share(mask, cfg, n=1000, value=None):
    image = np.zeros(mask.shape + (3,), np.uint8)
    positions, hits = foreground_index(mask), 0
    for i in range(n):
        _, patch = cut_patch(image, mask, positions, cfg, np.random.default_rng(i))
        hits += bool(((patch > 0) & (patch != IGNORE_INDEX)).any() if value is None else (patch == value).any())
    return hits / n


def test_patches_are_centred_on_rare_foreground_at_the_configured_share():
    mask = blob_mask(512, 512, [(1, (400, 30, 6))])  # one 6x6 blob in 512x512: 0.014% of the pixels
    base = dict(image_size=64, patch_foreground=0.0)
    assert foreground_share(mask, base) < 0.05  # uniform patches alone hardly ever see it
    share = foreground_share(mask, {**base, "patch_foreground": 0.5})
    assert 0.45 <= share <= 0.6, share  # 0.5 centred + the few uniform ones that catch it


def test_a_rare_class_gets_as_many_centred_patches_as_a_common_one():
    mask = blob_mask(400, 400, [(1, (0, 0, 200)), (2, (350, 350, 4))])  # class 2: 16 pixels
    cfg = dict(image_size=64, patch_foreground=1.0)
    assert 0.42 <= foreground_share(mask, cfg, value=2) <= 0.6


def test_a_patch_of_an_image_smaller_than_the_patch_is_padded_with_the_ignore_label():
    image = np.full((40, 50, 3), 200, np.uint8)
    mask = blob_mask(40, 50, [(1, (10, 10, 5))])
    img, msk = cut_patch(image, mask, foreground_index(mask), dict(image_size=64, patch_foreground=0.5),
                         np.random.default_rng(0))
    assert img.shape == (64, 64, 3) and msk.shape == (64, 64)
    assert (msk[40:] == IGNORE_INDEX).all() and (msk[:, 50:] == IGNORE_INDEX).all()
    assert (img[40:] == 0).all() and (img[:40, :50] == 200).all()
    assert np.array_equal(msk[:40, :50], mask)


def write_scenes(root, count=6, size=(160, 200), seed=0):
    """Large-ish scenes with small bright squares: images/ and masks/ (0/255)."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i in range(count):
        image = rng.integers(0, 90, size + (3,), dtype=np.uint8)
        mask = np.zeros(size, np.uint8)
        for _ in range(4):
            y, x, s = rng.integers(0, size[0] - 8), rng.integers(0, size[1] - 8), rng.integers(4, 9)
            image[y:y + s, x:x + s] = 230
            mask[y:y + s, x:x + s] = 255
        cv2.imwrite(str(root / "images" / f"scene_{i}.png"), image)
        cv2.imwrite(str(root / "masks" / f"scene_{i}.png"), mask)
    return root


@pytest.fixture
def scenes(tmp_path):
    return write_scenes(tmp_path / "scenes")


def patch_config(make_cfg, scenes, **overrides):
    settings = dict(data_dir=str(scenes), data_mode="patch", image_size=64, batch_size=4, val_fraction=0.34,
                    tile_batch_size=4)
    return make_cfg(**{**settings, **overrides})


def test_an_epoch_tiles_each_image_about_once_unless_patches_per_image_is_set(make_cfg, scenes):
    cfg = patch_config(make_cfg, scenes)
    train, _ = train_unet.prepare_data(cfg)
    sizes = train_unet.image_sizes(train, cfg)
    assert sizes == [(160, 200)] * len(train)
    assert len(PatchDataset(train, cfg, sizes)) == len(train) * 3 * 4  # ceil(160/64) x ceil(200/64)
    # what the batch-size checks (and batch_size=auto's cap) count: patches, not images
    assert train_unet.training_samples(train, cfg) == len(train) * 3 * 4
    assert len(PatchDataset(train, {**cfg, "patches_per_image": 5}, sizes)) == len(train) * 5
    half = {**cfg, "patch_scale": 0.5}
    assert len(PatchDataset(train, half, sizes)) == len(train) * 2 * 2  # 80 x 100 px after scaling


def test_patch_sampling_is_reproducible_per_seed_epoch_and_index(make_cfg, scenes):
    cfg = patch_config(make_cfg, scenes)
    train, _ = train_unet.prepare_data(cfg)
    sizes = train_unet.image_sizes(train, cfg)
    a, b = PatchDataset(train, cfg, sizes), PatchDataset(train, cfg, sizes)
    order = list(range(len(a)))
    first = [a[i] for i in order]
    again = [b[i] for i in reversed(order)][::-1]  # another instance, the cache filled in another order
    for (xa, ya), (xb, yb) in zip(first, again):
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    b.epoch = 1
    assert not all(torch.equal(a[i][1], b[i][1]) for i in order[:8])  # a new epoch cuts other patches
    assert not torch.equal(a[0][0], a[1][0])  # two patches of one image differ
    # A worker as the trainer's (loader_options): OpenCV on the calling thread, else a worker forked after
    # this process's OpenCV pool started can hang in cv2 (seen: warpAffine, once in a full run).
    loader = torch.utils.data.DataLoader(PatchDataset(train, cfg, sizes), batch_size=4, num_workers=1,
                                         worker_init_fn=train_unet.one_opencv_thread)
    for (xl, yl), start in zip(loader, range(0, len(order), 4)):
        assert torch.equal(xl, torch.stack([x for x, _ in first[start:start + 4]]))


def test_patch_mode_trains_and_val_iou_is_the_iou_predict_gives(make_cfg, scenes, tmp_path):
    cfg = patch_config(make_cfg, scenes, epochs=1)
    result = train_unet.train(cfg)
    val_iou = result["history"][-1]["val_iou"]
    _, val = train_unet.prepare_data(cfg)
    out = tmp_path / "pred"
    train_unet.predict({"checkpoint": str(tmp_path / "ckpt" / "last.pt"), "input": str(scenes / "images"),
                        "output": str(out), "use_amp": False, "progress": False, "device": "cpu"})
    metric = train_unet.SegMetric(1)
    for image_path, mask_path in val:
        pred = cv2.imread(str(out / f"{image_path.stem}.png"), cv2.IMREAD_UNCHANGED)
        assert pred.shape == (160, 200)
        truth = torch.from_numpy(train_unet.read_mask(mask_path, 1)).long()
        logits = torch.from_numpy(np.where(pred > 0, 1.0, -1.0).astype(np.float32))
        metric.update(logits[None, None], truth[None])
    assert metric.compute()["iou"] == pytest.approx(val_iou, abs=1e-9)


def test_predict_can_override_the_tiling_and_refuses_impossible_values(make_cfg, scenes, tmp_path, capsys):
    train_unet.train(patch_config(make_cfg, scenes, epochs=1))
    base = {"checkpoint": str(tmp_path / "ckpt" / "last.pt"), "input": str(scenes / "images" / "scene_0.png"),
            "output": str(tmp_path / "p"), "use_amp": False, "progress": False, "device": "cpu"}
    assert train_unet.predict({**base, "tile_overlap": 0.5, "tile_batch_size": 2})["predicted"] == 1
    out = capsys.readouterr().out
    assert "overlap 0.5, 2 tile(s) per forward" in out
    # the val IoU scored the run's seams (0.25): said, as another tta is (user test)
    assert "was validated with tile_overlap=0.25; predict blends tiles at 0.5: leave tile_overlap out" in out
    train_unet.predict({**base, "tile_batch_size": 2})
    assert "was validated with tile_overlap" not in capsys.readouterr().out
    with pytest.raises(UserError, match=r"tile_overlap=0.95 must be in \[0, 0.9\]"):
        train_unet.predict({**base, "tile_overlap": 0.95})


def test_the_overlap_advice_counts_the_tiles_as_the_sliding_window_cuts_them():
    """'0.5 for smoother seams (~1.8x the tiles)' was 0.25 against no overlap: against 0.25, 0.5 cuts 1.8-2.2x
    the tiles of small images and 2.25x on large scenes (README audit)."""
    tiles = lambda side, overlap: len(train_unet.tile_starts(side, 128, overlap)) ** 2  # noqa: E731
    ratios = [tiles(side, 0.5) / tiles(side, 0.25) for side in (300, 512, 1000, 4000, 20000)]
    assert 1.75 < min(ratios) and max(ratios) <= 2.25 and sorted(ratios)[len(ratios) // 2] == pytest.approx(2, abs=0.15)
    with pytest.raises(UserError, match=r"0.5 for smoother seams \(about 2x the tiles of 0.25\)"):
        train_unet.validate_config({**train_unet.CONFIG, "tile_overlap": 0.95})


@pytest.mark.parametrize("arg, message", [
    ("data_mode=tiles", "data_mode='tiles' is not allowed: use one of fit, patch"),
    ("patch_scale=0", r"patch_scale=0.0 must be in \(0, 4\]"),
    ("tile_overlap=1", r"tile_overlap=1.0 must be in \[0, 0.9\]"),
    ("tile_overlap=none", r"tile_overlap=None must be in \[0, 0.9\]"),
    ("patches_per_image=0", "patches_per_image=0 must be >= 1"),
    ("patch_foreground=1.5", r"patch_foreground=1.5 must be a share in \[0, 1\]"),
    ("tile_batch_size=0", "tile_batch_size=0 must be a whole number >= 1"),
])
def test_impossible_patch_settings_are_one_line_errors(arg, message):
    with pytest.raises(UserError, match=message):
        train_unet.parse_overrides([arg])


def test_too_few_patches_for_a_batch_is_a_clear_error(make_cfg, scenes):
    cfg = patch_config(make_cfg, scenes, patches_per_image=1, batch_size=8)
    with pytest.raises(UserError, match=r"4 patch\(es\) per epoch from 4 image\(s\), fewer than batch_size=8"):
        train_unet.prepare_data(cfg)


def test_the_padding_note_never_advises_a_larger_image_size_and_an_image_small_as_stored_hides_none(monkeypatch):
    """Review: a 100x1000 strip at image_size=256 was told image_size=992 (from its longer side), where it
    covers less; a 4x4 image, small as stored, hid a 100x100 one that patch_scale=0.05 shrank to 5x5."""
    cfg = {"data_mode": "patch", "resume": False, "patch_scale": 1.0, "image_size": 256}
    note = lambda sizes, **kw: train_unet.patches_of_padding([(f"{i}.png", "m.png") for i in range(len(sizes))],  # noqa: E731
                                                             [], {**cfg, **kw})
    monkeypatch.setattr(train_unet, "image_sizes", lambda pairs, cfg: sizes)
    sizes = [(100, 1000)]
    assert note(sizes).endswith("(the largest: 1000x100 px), so most of each patch is padding, computed and left out "
                                "of the loss: set image_size=192, or use data_mode=fit")  # 100 of 192 rows: 52 %
    sizes = [(10, 1000)]
    assert note(sizes).endswith("loss: use data_mode=fit")  # 10 rows cover under half of any patch
    sizes = [(4, 4), (100, 100)]
    with pytest.raises(UserError, match=r"^patch_scale=0.05 shrinks 1.png \(100x100\) to 5x5 px"):
        note(sizes, patch_scale=0.05)


def test_a_patch_scale_that_shrinks_a_val_image_to_a_few_pixels_stops_the_run_too(make_cfg, tmp_path):
    """A 300x10 image in val/ at patch_scale=0.5 went to the model as 150x5 and was scored, unsaid, in the val IoU
    that picks best.pt; in train/ the same image stopped the run, as the README says of any image (user test)."""
    root = tmp_path / "split"
    write_scenes(root / "train", count=4)
    write_scenes(root / "val", count=1, seed=1)
    cv2.imwrite(str(root / "val" / "images" / "strip.png"), np.full((10, 300, 3), 200, np.uint8))
    cv2.imwrite(str(root / "val" / "masks" / "strip.png"), np.zeros((10, 300), np.uint8))
    cfg = patch_config(make_cfg, root, batch_size=2)
    with pytest.raises(UserError, match=r"^patch_scale=0.5 shrinks \S+val/images/strip.png \(300x10\) to 150x5 "
                                        r"px, too small to hold a shape: use patch_scale=0.8 or more"):
        train_unet.prepare_data({**cfg, "patch_scale": 0.5})
    train_unet.prepare_data({**cfg, "patch_scale": 0.8})  # 240x8: the rule's least


def test_a_patch_scale_that_shrinks_images_to_a_few_pixels_is_a_one_line_error(make_cfg, scenes):
    """160x200 scenes at patch_scale=0.02 would train on 3x4 px images, unsaid; 0.05 gives 8x10."""
    with pytest.raises(UserError, match=r"patch_scale=0.02 shrinks \S+scene_\d.png \(200x160\) to 4x3 px, too small "
                                        r"to hold a shape: use patch_scale=0.05 or more \(8 px on its shorter side\)"):
        train_unet.prepare_data(patch_config(make_cfg, scenes, patch_scale=0.02, batch_size=2))
    train_unet.prepare_data(patch_config(make_cfg, scenes, patch_scale=0.05, batch_size=2))


@pytest.mark.parametrize("settings, note", [
    ({"image_size": 448}, "note: every training image covers less than half a 448x448 patch (the largest: 200x160 "
                          "px), so most of each patch is padding, computed and left out of the loss: set "
                          "image_size=224, or use data_mode=fit"),
    ({"image_size": 256, "patch_scale": 0.5}, "note: at patch_scale=0.5 every training image covers less than half "
                                              "a 256x256 patch (the largest: 100x80 px)"),
    ({"image_size": 224}, None),  # 160x200 of 224x224: 64 % of the patch is image
    ({"image_size": 448, "resume": True}, None),  # a resume keeps image_size: no advice to change it
    ({"image_size": 448, "data_mode": "fit"}, None),
])
def test_patches_that_would_be_mostly_padding_get_a_note(make_cfg, scenes, capsys, settings, note):
    train_unet.prepare_data(patch_config(make_cfg, scenes, **settings))
    out = capsys.readouterr().out
    assert (note in out) if note else "most of each patch is padding" not in out, out


def test_an_epoch_of_more_patches_than_memory_holds_is_a_one_line_error(make_cfg, scenes, monkeypatch):
    """patches_per_image=10**9: torch.randperm asked for 80 GB, a traceback once the run had begun."""
    with pytest.raises(UserError, match=r"^patches_per_image=1000000000 makes 4,000,000,000 patches per epoch from 4 "
                                        r"image\(s\), more than 10,000,000: set patches_per_image=2500000 or less$"):
        train_unet.prepare_data(patch_config(make_cfg, scenes, patches_per_image=10**9))
    monkeypatch.setattr(train_unet, "MAX_EPOCH_SAMPLES", 10)  # tiling: 4 images of 160x200 in 64 px, 12 each
    with pytest.raises(UserError, match=r"^tiling each image once at image_size=64 makes 48 patches per epoch from 4 "
                                        r"image\(s\), more than 10: set patches_per_image=2 or less$"):
        train_unet.prepare_data(patch_config(make_cfg, scenes))


@pytest.mark.cuda
def test_whole_image_counts_taken_on_the_cpu_add_up_on_the_gpu():
    """Patch-mode validation counts whole images on the CPU and moves only the counts to the device."""
    logits, target = torch.randn(1, 3, 300, 200), torch.randint(0, 3, (1, 300, 200))
    target[0, :10] = IGNORE_INDEX
    cpu, gpu = train_unet.SegMetric(3), train_unet.SegMetric(3, "cuda")
    cpu.update(logits, target)
    gpu.update(logits, target)
    assert torch.equal(cpu.flat, gpu.flat.cpu())


def test_a_checkpoint_from_before_patch_mode_resumes_as_fit(make_cfg, tmp_path):
    """Checkpoints written before data_mode existed carry none of its keys: they mean fit mode."""
    cfg = make_cfg(epochs=1)
    train_unet.train(cfg)
    last = tmp_path / "ckpt" / "last.pt"
    state = torch.load(last, weights_only=True)
    for key in ("data_mode", "patch_scale", "patch_foreground", "patches_per_image", "tile_overlap",
                "tile_batch_size"):
        del state["config"][key]
    torch.save(state, last)
    result = train_unet.train({**cfg, "epochs": 2, "resume": True})
    assert [r["epoch"] for r in result["history"]] == [1, 2]


def test_patch_mode_resume_is_exact(make_cfg, scenes, tmp_path, monkeypatch):
    """Two epochs straight == one epoch, interrupted, then resume=True: the same patches are cut."""
    straight = train_unet.train(patch_config(make_cfg, scenes, epochs=2, checkpoint_dir=str(tmp_path / "a")))
    summary = train_unet.epoch_summary

    def interrupt_after_epoch_1(row, cfg, improved):
        if row["epoch"] == 1:
            raise KeyboardInterrupt
        return summary(row, cfg, improved)
    monkeypatch.setattr(train_unet, "epoch_summary", interrupt_after_epoch_1)
    cfg_b = patch_config(make_cfg, scenes, epochs=2, checkpoint_dir=str(tmp_path / "b"))
    with pytest.raises(KeyboardInterrupt):
        train_unet.train(cfg_b)
    monkeypatch.setattr(train_unet, "epoch_summary", summary)
    resumed = train_unet.train({**cfg_b, "resume": True})
    assert resumed["history"][-1]["val_iou"] == pytest.approx(straight["history"][-1]["val_iou"], abs=1e-9)
    a, b = (torch.load(tmp_path / d / "last.pt", weights_only=True)["model"] for d in "ab")
    assert all(torch.allclose(a[k].float(), b[k].float(), rtol=0, atol=1e-6) for k in a)


def test_scoring_large_images_in_bands_keeps_iou_and_dice_exact(make_cfg, scenes, monkeypatch, fp32):
    import segmentation_models_pytorch as smp

    cfg, hw = patch_config(make_cfg, scenes, channels_last=False), train_unet.detect_hardware("cpu")
    train, val = train_unet.prepare_data(cfg)
    _, loader = train_unet.build_loaders(train, val, cfg, hw)
    torch.manual_seed(0)
    model, loss_fn = smp.Unet("resnet18", encoder_weights=None, classes=1).eval(), train_unet.SegLoss(1)
    whole = train_unet.evaluate(model, loader, loss_fn, fp32, hw, cfg)
    monkeypatch.setattr(train_unet, "SCORE_BAND_PIXELS", 200 * 7)  # bands of 7 rows of these 200 px images
    banded = train_unet.evaluate(model, loader, loss_fn, fp32, hw, cfg)
    assert banded["iou"] == whole["iou"] and banded["dice"] == whole["dice"]
    assert banded["loss"] == pytest.approx(whole["loss"], rel=0.5)  # Dice per band: close, not equal


def test_patches_a_partial_last_batch_leaves_out_are_said_as_fit_modes_images_are(make_cfg, scenes, capsys):
    """4 training images of one patch each at batch_size=3: drop_last trained 3 a epoch, one image unseen at
    random each epoch, while the banner said '3 patches per epoch' and fit mode names the images it leaves out."""
    cfg = patch_config(make_cfg, scenes, epochs=1, patch_scale=0.25, batch_size=3, tile_batch_size=2)
    train, _ = train_unet.prepare_data(cfg)
    samples = train_unet.training_samples(train, cfg)
    assert samples == len(train) == 4  # 40x50 px after scaling: one patch each
    capsys.readouterr()
    train_unet.train(cfg)
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("patch mode: "))
    assert line.startswith("patch mode: 3 patches of 64x64 per epoch (1 more left out at random each epoch: full "
                           "batches only) at scale 0.25"), line
    capsys.readouterr()
    train_unet.train({**cfg, "batch_size": 2})
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("patch mode: "))
    assert line.startswith("patch mode: 4 patches of 64x64 per epoch at scale"), line
