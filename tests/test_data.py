"""unet_amp.data: the shapes data set, pairing, splitting, the data check, FitDataset and the loaders."""
import hashlib
from pathlib import Path
from types import SimpleNamespace

import cv2
import numpy as np
import pytest
import tifffile
import torch

from unet_amp.common import IGNORE_INDEX, UserError
from unet_amp.data import (FitDataset, check_data, class_weights_from, collate_val, ensure_shapes_dataset,
                           find_pairs, make_loaders, set_epoch, split_pairs)

CPU = SimpleNamespace(kind="cpu", device=torch.device("cpu"))


def make_set(root, count=6, size=(32, 32), binary=True):
    """count pairs of RGB PNG images and masks (0/255 when binary, else indices 0..2) under root."""
    rng = np.random.default_rng(0)
    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for i in range(count):
        cv2.imwrite(str(root / "images" / f"s{i:02d}.png"), rng.integers(0, 256, (*size, 3), dtype=np.uint8))
        mask = np.zeros(size, np.uint8)
        mask[: size[0] // 2] = 255 if binary else 1 + i % 2
        cv2.imwrite(str(root / "masks" / f"s{i:02d}.png"), mask)
    return root


def config(root, **changes):
    cfg = dict(data_dir=str(root), image_size=32, in_channels=3, num_classes=1, val_fraction=0.34,
               max_train_images=None, num_workers=0, intensity_range=None, data_mode="fit", seed=0, batch_size=2)
    return {**cfg, **changes}


def digest(root):
    h = hashlib.sha256()
    for path in sorted(Path(root).rglob("*")):
        if path.is_file():
            h.update(path.relative_to(root).as_posix().encode() + path.read_bytes())
    return h.hexdigest()


def test_shapes_dataset_deterministic(tmp_path):
    a = ensure_shapes_dataset(tmp_path / "a", count=12)
    b = ensure_shapes_dataset(tmp_path / "b", count=12)
    assert digest(a) == digest(b)
    assert len(find_pairs(a)) == 12
    image = cv2.imread(str(a / "images" / "shape_0000.png"))
    mask = cv2.imread(str(a / "masks" / "shape_0000.png"), cv2.IMREAD_UNCHANGED)
    assert image.shape == (128, 128, 3) and set(np.unique(mask)) == {0, 255}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]  # no temporary folder left
    before = digest(a)
    ensure_shapes_dataset(a, count=3)  # a folder with files is left alone
    assert digest(a) == before


def test_find_pairs_unpaired_names_the_file(tmp_path):
    root = make_set(tmp_path / "d", count=3)
    pairs = find_pairs(root)
    assert [p[0].stem for p in pairs] == ["s00", "s01", "s02"] and pairs[0][1].parent.name == "masks"
    cv2.imwrite(str(root / "images" / "lonely.png"), np.zeros((8, 8), np.uint8))
    with pytest.raises(UserError, match="lonely.png"):
        find_pairs(root)
    (root / "images" / "lonely.png").unlink()
    cv2.imwrite(str(root / "masks" / "orphan.png"), np.zeros((8, 8), np.uint8))
    with pytest.raises(UserError, match="orphan.png"):
        find_pairs(root)
    with pytest.raises(UserError, match="nowhere"):
        find_pairs(tmp_path / "nowhere")


def test_split_deterministic_and_folders(tmp_path):
    root = make_set(tmp_path / "d", count=10)
    train, val = split_pairs(config(root))
    assert (train, val) == split_pairs(config(root))
    assert len(val) == 3 and len(train) == 7 and not set(train) & set(val)
    assert split_pairs(config(root, seed=1)) != (train, val)
    assert len(split_pairs(config(root, max_train_images=2))[0]) == 2
    make_set(tmp_path / "s" / "train", count=4)
    make_set(tmp_path / "s" / "val", count=2)
    train, val = split_pairs(config(tmp_path / "s"))
    assert len(train) == 4 and len(val) == 2 and val[0][0].parts[-3] == "val"


def test_check_data_sizes_values_ranges(tmp_path):
    root = make_set(tmp_path / "d", count=4)
    pairs = find_pairs(root)
    info = check_data(pairs[:3], pairs[3:], config(root))
    assert info["intensity_range"] is None
    assert info["class_counts"] == [3 * 16 * 32, 3 * 16 * 32]
    assert check_data(pairs[:3], pairs[3:], config(root, intensity_range=[0, 10]))["intensity_range"] == [0, 10]
    tifffile.imwrite(root / "images" / "s00.tif", np.full((32, 32), 700, np.uint16))  # replaces s00.png below
    (root / "images" / "s00.png").unlink()
    tifffile.imwrite(root / "images" / "s01.tif", np.full((32, 32), 90, np.uint16))
    (root / "images" / "s01.png").unlink()
    pairs = find_pairs(root)
    assert check_data(pairs[:3], pairs[3:], config(root))["intensity_range"] == [90, 700]
    cv2.imwrite(str(root / "masks" / "s03.png"), np.zeros((16, 32), np.uint8))
    with pytest.raises(UserError, match="s03.png"):
        check_data(pairs[:3], pairs[3:], config(root))


def test_check_data_bad_mask_values(tmp_path):
    root = make_set(tmp_path / "d", count=2, binary=False)
    pairs = find_pairs(root)
    assert check_data(pairs, [], config(root, num_classes=3))["class_counts"] == [1024, 512, 512]
    with pytest.raises(UserError, match="s01.png"):
        check_data(pairs, [], config(root, num_classes=2))


def test_class_weights_from():
    w = class_weights_from([900, 100])
    assert w == [0.5556, 5.0] and np.isclose(0.9 * w[0] + 0.1 * w[1], 1.0, atol=1e-4)  # mean pixel weight 1
    assert class_weights_from([100, 0, 100]) == [1.0, 1.0, 1.0]


def test_fit_dataset_items_and_padding(tmp_path):
    root = make_set(tmp_path / "d", count=3, size=(16, 32))  # wide: padded at the bottom when fitted
    pairs = find_pairs(root)
    train = FitDataset(pairs, config(root), train=True)
    x, y = train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.shape == (32, 32) and y.dtype == torch.int64
    assert set(torch.unique(y).tolist()) <= {0, 1, IGNORE_INDEX}
    val = FitDataset(pairs, config(root), train=False)
    x, y, original = val[1]
    assert (y[16:] == IGNORE_INDEX).all() and (y[:8] == 1).all() and (y[8:16] == 0).all()
    assert torch.allclose(x[:, 16:], torch.zeros(()), atol=1e-6)  # padding is 0 once normalised
    assert original.shape == (16, 32) and original.dtype == torch.int64 and original.max() == 1
    images, masks, originals = collate_val([val[0], val[1]])
    assert images.shape == (2, 3, 32, 32) and masks.shape == (2, 32, 32) and len(originals) == 2


def test_augmentation_seeded_by_epoch(tmp_path):
    root = make_set(tmp_path / "d", count=2)
    ds = FitDataset(find_pairs(root), config(root), train=True)
    views = []
    for epoch in (0, 1, 0):
        ds.set_epoch(epoch)
        views.append(torch.cat([ds[i][0].flatten() for i in range(2)]))
    assert torch.equal(views[0], views[2]) and not torch.equal(views[0], views[1])


def test_loaders_batches_and_order(tmp_path):
    root = make_set(tmp_path / "d", count=7)
    train_pairs, val_pairs = split_pairs(config(root, val_fraction=0.3))
    cfg = config(root, batch_size=2)
    info = check_data(train_pairs, val_pairs, cfg)
    train_loader, val_loader = make_loaders(train_pairs, val_pairs, cfg, CPU, info)
    shapes = [(x.shape, y.shape) for x, y in train_loader]
    full = len(train_pairs) // 2 * 2  # the last, short batch is dropped: no BatchNorm batch of one
    assert shapes[0] == ((2, 3, 32, 32), (2, 32, 32)) and sum(s[0][0] for s in shapes) == full
    x, y, originals = next(iter(val_loader))
    assert x.shape == (2, 3, 32, 32) and y.shape == (2, 32, 32) and originals[0].shape == (32, 32)

    def order(epoch):
        set_epoch(train_loader, epoch)
        return list(iter(train_loader.sampler))
    assert order(3) == order(3) and sorted(order(3)) == list(range(len(train_pairs)))
    assert any(order(e) != order(3) for e in (4, 5, 6))


def test_loaders_with_workers(tmp_path):
    root = make_set(tmp_path / "d", count=5)
    train_pairs, val_pairs = split_pairs(config(root))
    cfg = config(root, num_workers=1)
    train_loader, _ = make_loaders(train_pairs, val_pairs, cfg, CPU, check_data(train_pairs, val_pairs, cfg))
    set_epoch(train_loader, 2)
    first = torch.cat([x for x, _ in train_loader])
    set_epoch(train_loader, 2)
    assert torch.equal(first, torch.cat([x for x, _ in train_loader]))  # workers see the epoch set here


def test_patch_mode_loaders(tmp_path):
    root = make_set(tmp_path / "d", count=4, size=(48, 40))
    train_pairs, val_pairs = split_pairs(config(root, val_fraction=0.25))
    cfg = config(root, data_mode="patch", patch_scale=1.0, tile_overlap=0.25)
    train_loader, val_loader = make_loaders(train_pairs, val_pairs, cfg, CPU, check_data(train_pairs, val_pairs, cfg))
    x, y = next(iter(train_loader))
    assert x.shape[1:] == (3, 32, 32) and y.shape[1:] == (32, 32)
    image, mask = next(iter(val_loader))
    assert image.shape == (48, 40, 3) and mask.shape == (48, 40) and mask.dtype == torch.int64


def test_fit_dataset_16bit_grey_uses_the_learnt_range(tmp_path):
    root = tmp_path / "d"
    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True)
    for i, top in enumerate((1000, 4000)):
        tifffile.imwrite(root / "images" / f"t{i}.tif", np.full((32, 32), top, np.uint16))
        cv2.imwrite(str(root / "masks" / f"t{i}.png"), np.eye(32, dtype=np.uint8))
    pairs = find_pairs(root)
    cfg = config(root, in_channels=1)
    info = check_data(pairs, [], cfg)
    assert info["intensity_range"] == [1000, 4000]
    x, _, _ = FitDataset(pairs, {**cfg, **info}, train=False)[1]
    assert x.shape == (1, 32, 32) and torch.allclose(x, torch.tensor(2.0))  # (1 - 0.5) / 0.25


def test_ddp_samplers(tmp_path, monkeypatch):
    from unet_amp import distributed

    monkeypatch.setattr(distributed.DIST, "world", 2)
    monkeypatch.setattr(distributed.DIST, "rank", 1)
    root = make_set(tmp_path / "d", count=8)
    train_pairs, val_pairs = split_pairs(config(root, val_fraction=0.5))
    cfg = config(root)
    train_loader, val_loader = make_loaders(train_pairs, val_pairs, cfg, CPU, check_data(train_pairs, val_pairs, cfg))
    assert isinstance(train_loader.sampler, torch.utils.data.DistributedSampler) and len(train_loader.sampler) == 2
    set_epoch(train_loader, 3)
    assert train_loader.sampler.epoch == 3
    assert list(val_loader.sampler) == [1, 3]  # every other validation image: each counted once in all


def test_a_binary_sets_255_means_one_thing_for_every_mask(tmp_path):
    root = tmp_path / "d"
    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True)
    masks = {"a": [[0, 1], [255, 0]], "b": [[0, 0], [255, 255]]}  # 0/1 with a void border; an empty one
    for stem, mask in masks.items():
        cv2.imwrite(str(root / "images" / f"{stem}.png"), np.zeros((2, 2, 3), np.uint8))
        cv2.imwrite(str(root / "masks" / f"{stem}.png"), np.array(mask, np.uint8))
    pairs = find_pairs(root)
    info = check_data(pairs, [], config(root))
    assert info["void_255"] and info["class_counts"] == [4, 1]  # b's 255s are void, not foreground
    _, y, _ = FitDataset(pairs[1:], {**config(root), **info, "image_size": 32}, train=False)[0]
    assert int((y == 1).sum()) == 0


def test_a_set_without_foreground_or_with_half_a_split_is_refused(tmp_path):
    root = make_set(tmp_path / "d", count=4)
    for mask in (root / "masks").iterdir():
        cv2.imwrite(str(mask), np.where(cv2.imread(str(mask), 0) > 0, 255, 0).astype(np.uint8))
    pairs = find_pairs(root)
    with pytest.raises(UserError, match="foreground"):  # 0/255 masks read as 3 classes: 255 is void, no class 1
        check_data(pairs, [], config(root, num_classes=3))
    (tmp_path / "s" / "train").mkdir(parents=True)
    with pytest.raises(UserError, match="val"):
        split_pairs(config(tmp_path / "s"))


def test_a_typed_intensity_range_maps_and_clips_a_float_set(tmp_path):
    root = tmp_path / "f"
    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True)
    for i, top in enumerate((500.0, 9000.0)):  # float32 TIFFs (ImageJ/Fiji's 32-bit): the second is mostly over 1000
        tifffile.imwrite(root / "images" / f"t{i}.tif", np.linspace(0, top, 32 * 32, dtype=np.float32).reshape(32, 32))
        cv2.imwrite(str(root / "masks" / f"t{i}.png"), np.eye(32, dtype=np.uint8))
    pairs = find_pairs(root)
    cfg = config(root, in_channels=1, intensity_range=[0, 1000])
    info = check_data(pairs, [], cfg)
    assert info["intensity_range"] == [0, 1000] and info["clipped"] == [str(pairs[1][0])]
    dim, _, _ = FitDataset(pairs, {**cfg, **info}, train=False)[0]
    bright, _, _ = FitDataset(pairs, {**cfg, **info}, train=False)[1]
    assert torch.isclose(dim.max(), torch.tensor(0.0), atol=1e-3)  # 500 of 1000: (0.5 - 0.5) / 0.25
    assert bright.max() == 2.0 and (bright == 2.0).float().mean() > 0.8  # clipped at 1000: (1 - 0.5) / 0.25


def test_fixed_hot_pixels_do_not_set_the_learnt_range(tmp_path):
    root = tmp_path / "hot"
    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True)
    rng = np.random.default_rng(5)
    for i in range(5):  # 12-bit frames, each with the same two hot pixels at 65535
        frame = rng.integers(80, 4000, (48, 48)).astype(np.uint16)
        frame[4, 4] = frame[30, 17] = 65535
        cv2.imwrite(str(root / "images" / f"t{i}.png"), frame)
        cv2.imwrite(str(root / "masks" / f"t{i}.png"), (frame > 2000).astype(np.uint8))
    pairs = find_pairs(root)
    info = check_data(pairs[:4], pairs[4:], config(root, in_channels=1))
    lo, hi = info["intensity_range"]
    assert 80 <= lo < 90 and 3990 < hi < 4000 and info["clipped"] == []
