"""Data: folder layout, checks that name the bad file, mask conventions, SegDataset output."""
import hashlib
import json
import os
import zlib
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import train_unet
from train_unet import SegDataset, UserError, prepare_data, read_mask


def data_error(cfg):
    with pytest.raises(UserError) as info:
        prepare_data(cfg)
    message = str(info.value)
    assert "\n" not in message, f"error message is not one line: {message!r}"
    return message


def first(folder, sub):
    return sorted((Path(folder) / sub).glob("*.png"))[0]


# ------------------------------------------------------------------------------------------------
# Bad data: a UserError that names the file (or folder)
# ------------------------------------------------------------------------------------------------
def test_missing_data_dir(make_cfg, tmp_path):
    missing = tmp_path / "no_such_dir"
    message = data_error(make_cfg(data_dir=str(missing)))
    assert str(missing) in message


@pytest.mark.parametrize("sub", ["images", "masks"])
def test_missing_subfolder(make_cfg, data_dir, sub):
    for path in (data_dir / sub).iterdir():
        path.unlink()
    (data_dir / sub).rmdir()
    message = data_error(make_cfg())
    assert str(data_dir / sub) in message


def test_empty_images_folder(make_cfg, data_dir):
    for path in (data_dir / "images").iterdir():
        path.unlink()
    message = data_error(make_cfg())
    assert str(data_dir / "images") in message


def test_image_without_mask(make_cfg, data_dir):
    orphan = first(data_dir, "masks")
    orphan.unlink()
    message = data_error(make_cfg())
    assert orphan.name in message
    assert str(data_dir / "masks") in message  # where the partner is missing
    assert f"1 image(s) in {data_dir / 'images'} have no mask in {data_dir / 'masks'}" in message  # which is which


def test_mask_without_image(make_cfg, data_dir):
    orphan = first(data_dir, "images")
    orphan.unlink()
    message = data_error(make_cfg())
    assert orphan.name in message
    assert str(data_dir / "images") in message
    assert f"1 mask(s) in {data_dir / 'masks'} have no image in {data_dir / 'images'}" in message


def test_corrupt_image(make_cfg, data_dir):
    bad = sorted((data_dir / "images").glob("*.png"))[5]
    bad.write_bytes(b"\x89PNG this is not really a png" + bytes(range(256)))
    message = data_error(make_cfg())
    assert str(bad) in message


def test_corrupt_mask(make_cfg, data_dir):
    bad = sorted((data_dir / "masks").glob("*.png"))[7]
    bad.write_bytes(b"garbage" * 50)
    message = data_error(make_cfg())
    assert str(bad) in message


def png_chunks(data):
    """[(type, start, end)] of a PNG's chunks, end after the CRC."""
    pos, chunks = 8, []
    while pos < len(data):
        end = pos + 12 + int.from_bytes(data[pos:pos + 4], "big")
        chunks.append((data[pos + 4:pos + 8], pos, end))
        pos = end
    return chunks


@pytest.mark.parametrize("sub", ["images", "masks"])
def test_a_damaged_png_is_one_line_with_no_libpng_line_before_it(make_cfg, data_dir, capfd, sub):
    """libpng printed 'libpng error: IDAT: CRC error' on stderr, from C, before the one-line error."""
    bad = first(data_dir, sub)
    data = bytearray(bad.read_bytes())
    _, start, end = next(c for c in png_chunks(bytes(data)) if c[0] == b"IDAT")
    data[(start + end) // 2] ^= 0x55  # one flipped byte inside the image data, as a failing disk leaves
    bad.write_bytes(bytes(data))
    capfd.readouterr()
    message = data_error(make_cfg())
    assert str(bad) in message and "IDAT chunk fails its CRC check" in message
    assert "libpng" not in capfd.readouterr().err


def test_a_png_cut_short_is_named_truncated_with_no_libpng_line(data_dir, capfd):
    bad = first(data_dir, "images")
    data = bad.read_bytes()
    for cut in (len(data) - 12, len(data) // 2):  # only IEND lost (OpenCV refused it too), and half lost
        bad.write_bytes(data[:cut])
        capfd.readouterr()
        with pytest.raises(UserError, match=r"a truncated PNG: its data stop before the IEND chunk\): fix"):
            train_unet.read_image(bad, 3)
        assert "libpng" not in capfd.readouterr().err


def test_a_png_with_a_damaged_text_chunk_reads_as_before(data_dir):
    """libpng only warns about an ancillary chunk's CRC and skips the chunk: the pixels are whole."""
    path = first(data_dir, "images")
    data = path.read_bytes()
    before = train_unet.read_image(path, 3)
    _, _, ihdr_end = png_chunks(data)[0]
    text = b"tEXt" + b"Comment\0scanned"
    bad_crc = (zlib.crc32(text) ^ 1).to_bytes(4, "big")
    path.write_bytes(data[:ihdr_end] + (len(text) - 4).to_bytes(4, "big") + text + bad_crc + data[ihdr_end:])
    np.testing.assert_array_equal(train_unet.read_image(path, 3), before)


def with_chunk_crc_flipped(data, kind):
    chunk = next(c for c in png_chunks(data) if c[0] == kind)
    return data[:chunk[2] - 1] + bytes([data[chunk[2] - 1] ^ 1]) + data[chunk[2]:]


def with_chunk_after_ihdr(data, kind, body):
    _, _, ihdr_end = png_chunks(data)[0]
    return data[:ihdr_end] + len(body).to_bytes(4, "big") + kind + body + \
        zlib.crc32(kind + body).to_bytes(4, "big") + data[ihdr_end:]


def test_chunks_libpng_only_warns_about_read_as_before(tmp_path):
    """IEND's own CRC, and a truecolour image's suggested palette: libpng warns and reads the pixels, so
    OpenCV read them before; png_damage refused them at first. A palette image's PLTE is needed."""
    from PIL import Image

    image = np.random.default_rng(0).integers(0, 255, (16, 20, 3), np.uint8)
    path = tmp_path / "a.png"
    cv2.imwrite(str(path), image)
    data = path.read_bytes()
    for damaged in (with_chunk_crc_flipped(data, b"IEND"),
                    with_chunk_crc_flipped(with_chunk_after_ihdr(data, b"PLTE", bytes(range(48))), b"PLTE")):
        path.write_bytes(damaged)
        np.testing.assert_array_equal(train_unet.read_image(path, 3), image[..., ::-1])  # written BGR, read RGB
    Image.fromarray(np.arange(16 * 20, dtype=np.uint8).reshape(16, 20) % 7).convert("P").save(path)
    path.write_bytes(with_chunk_crc_flipped(path.read_bytes(), b"PLTE"))
    with pytest.raises(UserError, match=r"a damaged PNG: its PLTE chunk fails its CRC check"):
        train_unet.read_image(path, 3)


def test_multiclass_mask_value_out_of_range(make_cfg, make_data):
    root = make_data("multi", num_classes=3)
    bad = first(root, "masks")
    mask = cv2.imread(str(bad), cv2.IMREAD_UNCHANGED)
    assert mask.max() <= 2
    mask[3, 4] = 5
    cv2.imwrite(str(bad), mask)
    message = data_error(make_cfg(data_dir=str(root), num_classes=3))
    assert str(bad) in message
    assert "5" in message and "num_classes=3" in message
    # the generated multi-class set itself is fine
    cv2.imwrite(str(bad), np.minimum(mask, 2))
    train, val = prepare_data(make_cfg(data_dir=str(root), num_classes=3))
    assert len(train) + len(val) == 12


@pytest.mark.parametrize("value", [128, 2, 254])
def test_binary_mask_with_other_values(make_cfg, data_dir, value):
    bad = sorted((data_dir / "masks").glob("*.png"))[3]
    mask = cv2.imread(str(bad), cv2.IMREAD_UNCHANGED)
    mask[0, 0] = value
    cv2.imwrite(str(bad), mask)
    message = data_error(make_cfg())
    assert str(bad) in message and "num_classes=1" in message


def test_binary_mask_mixing_1_and_255(make_cfg, data_dir):
    bad = first(data_dir, "masks")
    mask = np.zeros((64, 64), np.uint8)
    mask[:10] = 1
    mask[20:30] = 255
    cv2.imwrite(str(bad), mask)
    assert str(bad) in data_error(make_cfg())


def test_colour_mask(make_cfg, data_dir):
    bad = first(data_dir, "masks")
    colour = np.zeros((64, 64, 3), np.uint8)
    colour[10:20, 10:20] = (0, 0, 255)  # red in BGR
    cv2.imwrite(str(bad), colour)
    message = data_error(make_cfg())
    assert str(bad) in message and "colour" in message


def test_grey_mask_saved_as_rgb_is_accepted(make_cfg, data_dir):
    path = first(data_dir, "masks")
    mask = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
    cv2.imwrite(str(path), np.repeat(mask[..., None], 3, axis=2))
    assert read_mask(path, 1).ndim == 2
    np.testing.assert_array_equal(read_mask(path, 1), (mask > 0).astype(np.uint8))
    prepare_data(make_cfg())


def test_image_mask_size_mismatch(make_cfg, data_dir):
    bad = sorted((data_dir / "images").glob("*.png"))[2]
    image = cv2.imread(str(bad))
    cv2.imwrite(str(bad), cv2.resize(image, (48, 64)))
    message = data_error(make_cfg())
    assert str(bad) in message
    assert "48x64" in message and "64x64" in message


def test_fewer_train_images_than_batch_size(make_cfg):
    # 12 pairs, val_fraction 0.2 -> 2 val, 10 train
    message = data_error(make_cfg(batch_size=11))
    assert "batch_size=11" in message and "10" in message
    train, _ = prepare_data(make_cfg(batch_size=10))
    assert len(train) == 10


def test_single_image_cannot_be_split(make_cfg, make_data):
    root = make_data("one", count=1)
    message = data_error(make_cfg(data_dir=str(root), batch_size=1))
    assert str(root) in message


def test_two_files_with_one_stem(make_cfg, data_dir):
    image = first(data_dir, "images")
    cv2.imwrite(str(image.with_suffix(".jpg")), cv2.imread(str(image)))
    message = data_error(make_cfg())
    assert image.stem in message


# ------------------------------------------------------------------------------------------------
# Good data
# ------------------------------------------------------------------------------------------------
def test_split_is_deterministic_disjoint_and_complete(make_cfg, data_dir):
    train, val = prepare_data(make_cfg())
    again = prepare_data(make_cfg())
    assert (train, val) == again
    assert len(val) == 2 and len(train) == 10
    stems = [p[0].stem for p in train + val]
    assert len(set(stems)) == 12
    for image, mask in train + val:
        assert image.parent == data_dir / "images" and mask.parent == data_dir / "masks"
        assert image.stem == mask.stem
    other_seed, _ = prepare_data(make_cfg(seed=7))
    assert {p[0] for p in other_seed} != {p[0] for p in train}  # the split follows the seed


def test_binary_masks_0_1_and_0_255(make_cfg, data_dir, tmp_path):
    shape = np.zeros((64, 64), np.uint8)
    shape[10:30, 5:40] = 1
    p01, p255 = tmp_path / "m01.png", tmp_path / "m255.png"
    cv2.imwrite(str(p01), shape)
    cv2.imwrite(str(p255), shape * 255)
    for path in (p01, p255):
        mask = read_mask(path, 1)
        assert mask.dtype == np.uint8
        np.testing.assert_array_equal(mask, shape)
    # a data set mixing both conventions (file by file) is accepted
    masks = sorted((data_dir / "masks").glob("*.png"))
    for path in masks[::2]:
        m = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
        assert set(np.unique(m).tolist()) <= {0, 255}
        cv2.imwrite(str(path), (m > 0).astype(np.uint8))
    train, val = prepare_data(make_cfg())
    dataset = SegDataset(train + val, make_cfg(), train=False)
    for i in range(len(dataset)):
        _, y = dataset[i]
        assert set(torch.unique(y).tolist()) <= {0, 1}


def test_all_background_binary_mask_is_fine(tmp_path):
    path = tmp_path / "zeros.png"
    cv2.imwrite(str(path), np.zeros((8, 8), np.uint8))
    assert read_mask(path, 1).max() == 0


def test_grayscale_images_with_three_channels(make_cfg, data_dir):
    for path in (data_dir / "images").glob("*.png"):
        cv2.imwrite(str(path), cv2.imread(str(path), cv2.IMREAD_GRAYSCALE))
    assert cv2.imread(str(first(data_dir, "images")), cv2.IMREAD_UNCHANGED).ndim == 2
    cfg = make_cfg(in_channels=3)
    train, val = prepare_data(cfg)
    x, y = SegDataset(train, cfg, train=True)[0]
    assert x.shape == (3, 64, 64) and x.dtype == torch.float32
    assert y.shape == (64, 64) and y.dtype == torch.int64


def test_rgb_images_with_one_channel(make_cfg, data_dir):
    cfg = make_cfg(in_channels=1)
    train, val = prepare_data(cfg)
    x, y = SegDataset(val, cfg, train=False)[0]
    assert x.shape == (1, 64, 64) and x.dtype == torch.float32
    assert y.shape == (64, 64)
    model = train_unet.build_model(cfg)
    with torch.no_grad():
        assert model(x[None]).shape == (1, 1, 64, 64)


def test_odd_sizes_come_out_square_padded_bottom_right(make_cfg, data_dir):
    """50 (high) x 70 (wide) -> longest side 64, aspect kept, padding below marked IGNORE_INDEX."""
    for path in (data_dir / "images").glob("*.png"):
        cv2.imwrite(str(path), cv2.resize(cv2.imread(str(path)), (70, 50)))
    masks = sorted((data_dir / "masks").glob("*.png"))
    for path in masks:
        cv2.imwrite(str(path), np.full((50, 70), 255, np.uint8))  # all foreground
    cv2.imwrite(str(masks[0]), np.pad(np.full((48, 70), 255, np.uint8), ((2, 0), (0, 0))))  # one with background
    cfg = make_cfg()
    train, val = prepare_data(cfg)
    for dataset in (SegDataset(val, cfg, train=False), SegDataset(train, cfg, train=True)):
        x, y = dataset[0]
        assert x.shape == (3, 64, 64) and y.shape == (64, 64)
    x, y = SegDataset(val, cfg, train=False)[next(i for i, (_, mask) in enumerate(val) if Path(mask) != masks[0])]
    rows = (y == 1).any(1).nonzero().flatten()
    assert (y[:44] == 1).all()                          # the image area: 64 wide, ~46 high
    assert (y[48:] == train_unet.IGNORE_INDEX).all()    # padding is ignored by loss and metrics
    assert set(y.unique().tolist()) == {1, train_unet.IGNORE_INDEX}
    assert rows.max().item() in (44, 45, 46)
    assert torch.all(x[:, 48:] == x[:, 63:64])          # padded rows are one constant value


def test_train_and_val_folders_are_used(make_cfg, make_data, tmp_path):
    root = tmp_path / "split"
    make_data("split/train", count=8, seed=1)
    make_data("split/val", count=3, seed=2)
    train, val = prepare_data(make_cfg(data_dir=str(root), val_fraction=0.5))
    assert len(train) == 8 and len(val) == 3
    assert all(img.parent == root / "train" / "images" for img, _ in train)
    assert all(msk.parent == root / "val" / "masks" for _, msk in val)


def test_a_pair_copied_into_both_train_and_val_gets_a_note(make_cfg, make_data, tmp_path, capsys):
    """Names shared by train/ and val/ are fine (the sets above, other pictures); the same pair in both was
    validated after training on it, without a word."""
    import shutil

    root = tmp_path / "split"
    make_data("split/train", count=8, seed=1)
    make_data("split/val", count=3, seed=2)
    prepare_data(make_cfg(data_dir=str(root)))
    assert "in both" not in capsys.readouterr().out
    image = sorted((root / "train" / "images").iterdir())[5]
    shutil.copy(image, root / "val" / "images" / image.name)
    shutil.copy(root / "train" / "masks" / image.name, root / "val" / "masks" / image.name)
    prepare_data(make_cfg(data_dir=str(root)))
    assert (f"note: 1 image(s) in both {root}/train and {root}/val with the same mask (e.g. {image.stem}"
            in capsys.readouterr().out)


def test_val_fraction_given_beside_train_and_val_folders_gets_a_note(make_cfg, make_data, tmp_path):
    root = tmp_path / "split"
    make_data("split/train", count=8, seed=1)
    make_data("split/val", count=3, seed=2)
    cfg = make_cfg(data_dir=str(root), val_fraction=0.5)
    assert train_unet.unused_val_fraction(cfg, ()) == (f"val_fraction=0.5 not used: {root} has train/ and val/ "
                                                       f"folders, which are the split")
    assert train_unet.unused_val_fraction(make_cfg(data_dir=str(root)), ()) is None  # not given
    assert train_unet.unused_val_fraction(make_cfg(data_dir=str(root)), {"val_fraction"}) is not None
    assert train_unet.unused_val_fraction(make_cfg(val_fraction=0.5), ()) is None  # images/ and masks/: used


def test_val_folder_is_checked_too(make_cfg, make_data, tmp_path):
    root = tmp_path / "split"
    make_data("split/train", count=8, seed=1)
    make_data("split/val", count=3, seed=2)
    bad = first(root / "val", "images")
    bad.write_bytes(b"not an image")
    message = data_error(make_cfg(data_dir=str(root)))
    assert str(bad) in message


def test_embedded_data_set_is_generated(make_cfg, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert not Path(train_unet.EMBEDDED_DATA_DIR).exists()
    cfg = make_cfg(data_dir=train_unet.EMBEDDED_DATA_DIR)
    train, val = prepare_data(cfg)
    images = sorted((tmp_path / train_unet.EMBEDDED_DATA_DIR / "images").glob("*.png"))
    masks = sorted((tmp_path / train_unet.EMBEDDED_DATA_DIR / "masks").glob("*.png"))
    assert len(images) == len(masks) == len(train) + len(val) > 0
    assert len(val) == round(len(images) * cfg["val_fraction"])
    # a second call uses what is there (no regeneration)
    stamp = images[0].stat().st_mtime_ns
    prepare_data(cfg)
    assert images[0].stat().st_mtime_ns == stamp


def test_generate_shapes_dataset_is_deterministic(tmp_path):
    def digest(root):
        return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
                for p in sorted(root.rglob("*.png"))}
    a = digest(train_unet.generate_shapes_dataset(tmp_path / "a", count=6, size=64))
    b = digest(train_unet.generate_shapes_dataset(tmp_path / "b", count=6, size=64))
    c = digest(train_unet.generate_shapes_dataset(tmp_path / "c", count=6, size=64, seed=1))
    assert len(a) == 12
    assert a == b
    assert a != c


def test_generated_masks_follow_the_conventions(tmp_path):
    binary = train_unet.generate_shapes_dataset(tmp_path / "bin", count=6, size=64)
    multi = train_unet.generate_shapes_dataset(tmp_path / "multi", count=6, size=64, num_classes=4)
    for path in (binary / "masks").glob("*.png"):
        m = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
        assert m.shape == (64, 64) and set(np.unique(m).tolist()) <= {0, 255}
    values = set()
    for path in (multi / "masks").glob("*.png"):
        values |= set(np.unique(cv2.imread(str(path), cv2.IMREAD_UNCHANGED)).tolist())
    assert values <= {0, 1, 2, 3} and len(values) > 2


def test_augmentation_is_seeded_by_epoch_and_index(make_cfg, data_dir):
    cfg = make_cfg()
    train, _ = prepare_data(cfg)
    a, b = SegDataset(train, cfg, train=True), SegDataset(train, cfg, train=True)
    assert torch.equal(a[3][0], b[3][0]) and torch.equal(a[3][1], b[3][1])
    samples = []
    for epoch in range(4):
        a.epoch = epoch
        samples.append(a[3][0])
    assert any(not torch.equal(samples[0], s) for s in samples[1:])  # augmentation changes by epoch


def test_loader_is_the_same_for_any_worker_count_and_epoch_restart(make_cfg, cpu_hw):
    """Shuffle and augmentation depend on (seed, epoch) only: the same with 0 or 2 workers, and the
    same when an epoch is replayed (what resume relies on)."""
    def epoch_batches(workers, epoch):
        cfg = make_cfg(num_workers=workers, batch_size=4)
        train, val = prepare_data(cfg)
        loader, _ = train_unet.build_loaders(train, val, cfg, cpu_hw)
        train_unet.start_epoch_data(loader, epoch, cfg["seed"])
        return [(x.clone(), y.clone()) for x, y in loader]

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(xa, xb) and torch.equal(ya, yb)
                                        for (xa, ya), (xb, yb) in zip(a, b))
    epoch2 = epoch_batches(0, 2)
    assert len(epoch2) == 2 and epoch2[0][0].shape == (4, 3, 64, 64)  # 10 images, drop_last
    assert same(epoch2, epoch_batches(0, 2))
    assert same(epoch2, epoch_batches(2, 2))
    assert not same(epoch2, epoch_batches(0, 3))


def exif_set(root, size, tag, mask_size, count=3, untagged=()):
    """images/e{i}.jpg of `size` (h, w) with EXIF Orientation `tag` (none for the indices in `untagged`), and
    masks/e{i}.png of `mask_size` with a square of foreground. Returns the pairs."""
    from PIL import Image

    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True)
    for i in range(count):
        image = Image.fromarray(np.full((*size, 3), 40 * i, np.uint8))
        exif = image.getexif()
        exif[0x0112] = tag
        image.save(root / "images" / f"e{i}.jpg", **({} if i in untagged else {"exif": exif.tobytes()}))
        mask = np.zeros(mask_size, np.uint8)
        mask[10:30, 10:30] = 255
        cv2.imwrite(str(root / "masks" / f"e{i}.png"), mask)
    return [(root / "images" / f"e{i}.jpg", root / "masks" / f"e{i}.png") for i in range(count)]


def test_a_size_mismatch_from_an_exif_turn_says_so(make_cfg, tmp_path):
    """A phone's JPEG, stored 96x64 with EXIF Orientation 6, reads 64x96 (OpenCV turns it, as viewers do);
    its mask, drawn on the stored pixels, is 96x64. The message named two sizes the user's tools disagree
    with; now it says where the turn comes from."""
    root = tmp_path / "exif"
    exif_set(root, (64, 96), 6, (64, 96))
    message = data_error(make_cfg(data_dir=str(root)))
    assert "is 64x96 as read (stored 96x64, turned by its EXIF Orientation tag 6" in message
    assert "but its mask is 96x64" in message


def test_a_mask_of_another_size_gets_the_fix(make_data, make_cfg):
    """A mask at half its image's size read 'they must have the same size', with no fix."""
    root = make_data("half", count=6, size=64)
    first = sorted((root / "masks").iterdir())[0]
    mask = cv2.imread(str(first), cv2.IMREAD_GRAYSCALE)
    cv2.imwrite(str(first), cv2.resize(mask, (32, 32), interpolation=cv2.INTER_NEAREST))
    message = data_error(make_cfg(data_dir=str(root)))
    assert message.endswith("is 64x64 but its mask is 32x32: they must have the same size: resize the mask to 64x64 "
                            "with nearest-neighbour interpolation (class values stay exact), or pair it with its own "
                            "image"), message


def test_a_transposed_mask_is_not_told_to_be_resized_and_other_mismatches_are_counted(make_data, make_cfg):
    """A mask of 64x48 beside its 48x64 image was told to be resized to 48x64, which squashes it onto the
    image; and each run named one mismatched pair, so a folder of them took a run per pair."""
    root = make_data("turned", count=6, size=64)
    images, masks = sorted((root / "images").iterdir()), sorted((root / "masks").iterdir())
    for image, mask in zip(images[:3], masks[:3]):
        cv2.imwrite(str(image), cv2.imread(str(image))[:48])
        cv2.imwrite(str(mask), cv2.imread(str(mask), cv2.IMREAD_GRAYSCALE)[:48].T.copy())
    message = data_error(make_cfg(data_dir=str(root)))
    assert message.endswith("is 64x48 but its mask is 48x64: they must have the same size: its width and height "
                            "are the image's swapped (a mask turned or transposed by a quarter?): turn it to match "
                            "the image, or pair it with its own image (2 other pair(s) differ in size too)"), message


def test_every_unreadable_file_is_counted_and_the_readable_ones_are_not_read_again(make_data, make_cfg):
    """The data check stopped at the first bad file: an empty image named, a truncated one met only by the
    next run, a run per file; and the files it had read were read again by each run (nothing was cached)."""
    root = make_data("broken", count=8, size=32)
    images = sorted((root / "images").iterdir())
    images[2].write_bytes(b"")
    images[5].write_bytes(images[5].read_bytes()[:40])
    (root / "masks" / images[6].name).write_bytes(b"")
    message = data_error(make_cfg(data_dir=str(root)))
    assert message.startswith(f"cannot read image {images[2]} (") and message.endswith(
        f"; 2 other file(s) fail the check too ({images[5].name}, {images[6].name})"), message
    cached = set(json.loads((root / train_unet.CHECK_CACHE_NAME).read_text())["files"])
    every = {os.path.abspath(p) for folder in ("images", "masks") for p in (root / folder).iterdir()}
    assert cached == every - {os.path.abspath(p) for p in (images[2], images[5], root / "masks" / images[6].name)}


def test_images_fit_mode_enlarges_many_times_get_a_note(make_data, make_cfg, capsys):
    """image_size=512 on 128 px images enlarged them 4 times (16 times the compute: 1.2 img/s), unsaid."""
    root = make_data("small", count=6, size=48)
    prepare_data(make_cfg(data_dir=str(root), image_size=96))
    assert "note: every image is at most 48 px on its longer side: fit mode enlarges them to image_size=96 " \
           "(2 times), at about 4 times the compute and memory per image, with no detail gained: image_size=64 " \
           "keeps them about as they are" in capsys.readouterr().out
    prepare_data(make_cfg(data_dir=str(root), image_size=64))
    assert "enlarges" not in capsys.readouterr().out
    # 8 px images at image_size=32, the least there is: 'image_size=32 keeps them about as they are' (user test)
    tiny = make_data("tiny", count=6, size=8)
    prepare_data(make_cfg(data_dir=str(tiny), image_size=32))
    said = capsys.readouterr().out
    assert "with no detail gained: image_size=32 is the least the model takes: they cannot stay smaller" in said
    assert "keeps them about as they are" not in said


@pytest.mark.parametrize("tag", [3, 6])
def test_images_turned_by_exif_where_the_size_check_cannot_see_it_get_a_note(tmp_path, capsys, tag):
    """Square JPEGs with Orientation 6 (a quarter turn) and any with 3 (a half turn) read turned, as viewers
    show them, and pass the size check whichever way their masks were drawn: one drawn on the stored pixels
    was misaligned without a word. The data check now notes such images (kept in its cache) and names one;
    a set without the tag gets no note."""
    root = tmp_path / "exif"
    pairs = exif_set(root, (64, 64), tag, (64, 64), untagged=(0,))
    cfg = train_unet.validate_config({**train_unet.CONFIG, "data_dir": str(root),
                                      "checkpoint_dir": str(tmp_path / "c")})
    for run in range(2):  # the second from the data check's cache
        train_unet.check_pairs(pairs, cfg)
        note = [line for line in capsys.readouterr().out.splitlines() if "EXIF" in line]
        assert len(note) == 1 and note[0].startswith("note: 2 image(s) carry an EXIF Orientation"), note
        assert f"e1.jpg: tag {tag}, {train_unet.EXIF_TURNS[tag]}" in note[0]
    train_unet.check_pairs(pairs[:1], cfg)
    assert "EXIF" not in capsys.readouterr().out


def test_a_quarter_turned_image_that_passed_the_size_check_gets_no_exif_note(tmp_path, capsys):
    """Stored 96x64 with Orientation 6, read 64x96: a mask of 64x96 can only have been drawn on the turned
    image, so there is nothing to check; and a damaged cache entry's orientation counts as unchecked."""
    root = tmp_path / "exif"
    pairs = exif_set(root, (64, 96), 6, (96, 64), count=1)
    cfg = train_unet.validate_config({**train_unet.CONFIG, "data_dir": str(root),
                                      "checkpoint_dir": str(tmp_path / "c")})
    train_unet.check_pairs(pairs, cfg)
    assert "EXIF" not in capsys.readouterr().out
    entry = {"stamp": [1, 2, 3], "hw": [96, 64], "dtype": "uint8", "channels": 3}
    assert train_unet.entry_valid({**entry, "orientation": 6}, mask=False)
    assert not train_unet.entry_valid({**entry, "orientation": 9}, mask=False)
    assert not train_unet.entry_valid({**entry, "orientation": True}, mask=False)


def colour_files(root):
    """{name: holds colour} of image files as they ship: colour or grey stored as RGB, JPEG, palettes, TIFF,
    alpha, 16 bits."""
    import tifffile
    from PIL import Image

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    grey = rng.integers(0, 256, (40, 48), np.uint8)
    colour = rng.integers(0, 256, (40, 48, 3), np.uint8)
    cv2.imwrite(str(root / "colour.png"), colour)
    cv2.imwrite(str(root / "grey.png"), grey)
    cv2.imwrite(str(root / "grey_as_rgb.png"), np.dstack([grey] * 3))
    cv2.imwrite(str(root / "grey_as_rgb.jpg"), np.dstack([grey] * 3), [cv2.IMWRITE_JPEG_QUALITY, 75])
    cv2.imwrite(str(root / "colour.jpg"), colour)
    cv2.imwrite(str(root / "colour_alpha.png"), np.dstack([colour, grey]))
    cv2.imwrite(str(root / "colour16.png"), colour.astype(np.uint16) * 257)
    for name, palette in (("grey_palette.png", [v for i in range(256) for v in (i, i, i)]),
                          ("colour_palette.png", [v for i in range(256) for v in (i, 255 - i, 0)])):
        image = Image.fromarray(grey, "L").convert("P")
        image.putpalette(palette)
        image.save(root / name)
    tifffile.imwrite(root / "colour.tif", colour, photometric="rgb")
    tifffile.imwrite(root / "grey.tif", grey)
    twelve = (grey.astype(np.uint16) + 300)[..., None].repeat(3, axis=2)  # 12-bit data, 300-555, in 16-bit files
    cv2.imwrite(str(root / "grey12_as_rgb.png"), twelve)
    twelve[10:20, 10:20, 1] += 700  # colour only in one channel: 700 levels, under 3/255 of 65535 (771)
    cv2.imwrite(str(root / "colour12.png"), twelve)
    floats = grey.astype(np.float32) / 100000  # a float image's span, 0-0.00255, its own min and max map to 0-1
    tifffile.imwrite(root / "grey_float_as_rgb.tif", np.dstack([floats] * 3), photometric="rgb")
    tifffile.imwrite(root / "colour_float.tif", np.dstack([floats, floats, floats * 0.5]), photometric="rgb")
    return {"colour.png": True, "grey.png": False, "grey_as_rgb.png": False, "grey_as_rgb.jpg": False,
            "colour.jpg": True, "colour_alpha.png": True, "colour16.png": True, "grey_palette.png": False,
            "colour_palette.png": True, "colour.tif": True, "grey.tif": False, "grey12_as_rgb.png": False,
            "colour12.png": True, "grey_float_as_rgb.tif": False, "colour_float.tif": True}


def test_images_read_as_grey_are_told_apart_from_grey_saved_as_colour(tmp_path, monkeypatch):
    """in_channels=1 reads colour as grey: the data check tells real colour from grey stored as RGB (JPEG's
    rounding included), palettes by their entries; a file whose header says grey is decoded once only."""
    expected = colour_files(tmp_path)
    reads, real = [], train_unet.opencv_read
    monkeypatch.setattr(train_unet, "opencv_read", lambda path, *a: reads.append(Path(path).name) or real(path, *a))
    for name, colour in expected.items():
        facts = train_unet.image_facts(tmp_path / name, channels=1)
        assert facts.get("colour", False) is colour, name
        assert "colour" not in train_unet.image_facts(tmp_path / name, channels=3), name
    assert reads.count("grey.png") == 2 and reads.count("grey_palette.png") == 2  # one read for each channels
    assert reads.count("grey_as_rgb.png") == 3  # its header says RGB: decoded in colour to look


def test_a_tiff_channel_that_is_not_alpha_gets_a_note_when_dropped(tmp_path, capsys):
    """RGB + near-infrared (an extra sample declared 'unspecified'): the near-infrared was dropped as if it
    were alpha, unsaid; a declared alpha, or an undeclared opaque one (OpenCV's RGBA TIFF), without a word."""
    import tifffile

    root = tmp_path / "set"
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    rgb, band = np.zeros((16, 16, 3), np.uint8), np.full((16, 16), 200, np.uint8)
    pairs = []
    cv2.imwrite(str(root / "images" / "opencv.tif"), np.dstack([rgb, np.full((16, 16), 255, np.uint8)]))  # no tag
    for name, extra in (("nir.tif", 0), ("rgba.tif", 2), ("opencv.tif", None)):
        if extra is not None:
            tifffile.imwrite(root / "images" / name, np.dstack([rgb, band]), photometric="rgb", extrasamples=[extra])
        mask = np.zeros((16, 16), np.uint8)
        mask[4:9, 4:9] = 255
        cv2.imwrite(str(root / "masks" / name.replace(".tif", ".png")), mask)
        pairs.append((root / "images" / name, root / "masks" / name.replace(".tif", ".png")))
    cfg = train_unet.validate_config({**train_unet.CONFIG, "data_dir": str(root), "checkpoint_dir": str(tmp_path / "c")})
    for run in range(2):  # the second from the data check's cache
        train_unet.check_pairs(pairs, cfg)
        note = [line for line in capsys.readouterr().out.splitlines() if "not alpha" in line]
        assert note == ["note: 1 of 3 image(s) hold a channel that is not alpha beside their grey or RGB (e.g. nir.tif: "
                        "a TIFF extra sample such as near-infrared), and it is dropped: the model takes in_channels=1 "
                        "or 3; if it tells the classes apart, save it in place of one of those"]
    train_unet.check_pairs(pairs[1:], cfg)
    assert "not alpha" not in capsys.readouterr().out


def test_colour_images_read_as_grey_get_a_note(tmp_path, capsys):
    """A colour set trained with in_channels=1 was turned to grey without a word: the data check notes it
    (kept in its cache), naming one image; with in_channels=3, or grey images, there is no note."""
    root = tmp_path / "set"
    colour_files(root / "images")
    (root / "masks").mkdir()
    pairs = []
    for name in ("colour.png", "grey.png", "colour.jpg"):
        mask, mask_path = np.zeros((40, 48), np.uint8), root / "masks" / (name.replace(".", "_") + ".png")
        mask[5:20, 5:20] = 255
        cv2.imwrite(str(mask_path), mask)
        pairs.append((root / "images" / name, mask_path))
    base = {**train_unet.CONFIG, "data_dir": str(root), "checkpoint_dir": str(tmp_path / "c")}
    for run in range(2):  # the second from the data check's cache
        train_unet.check_pairs(pairs, train_unet.validate_config({**base, "in_channels": 1}))
        note = [line for line in capsys.readouterr().out.splitlines() if "grey" in line]
        assert note == ["note: 2 of 3 image(s) hold colour (e.g. colour.png) but in_channels=1 reads them as grey, "
                        "their luminance; if colour tells the classes apart, set in_channels=3"]
    train_unet.check_pairs(pairs, train_unet.validate_config({**base, "in_channels": 3}))
    train_unet.check_pairs(pairs[1:2], train_unet.validate_config({**base, "in_channels": 1}))
    assert "grey" not in capsys.readouterr().out
    entry = {"stamp": [1, 2, 3], "hw": [40, 48], "dtype": "uint8", "channels": 1}
    assert train_unet.entry_valid({**entry, "colour": True}, mask=False)
    assert not train_unet.entry_valid({**entry, "colour": "yes"}, mask=False)


def test_a_jpeg_named_png_is_known_by_its_bytes(make_cfg, tmp_path, capsys):
    """OpenCV decodes a file by its bytes, so a JPEG named .png was turned by its EXIF, while the data check
    looked for the tag with the reader its name chose: no word of the turn, and a square image's mask misaligned
    without a note. Now the format comes from the file's first bytes for both."""
    root = tmp_path / "exif"
    pairs = exif_set(root, (64, 96), 6, (64, 96), count=2)
    for image, _ in pairs:
        image.rename(image.with_suffix(".png"))
    assert "is 64x96 as read (stored 96x64, turned by its EXIF Orientation tag 6" in \
        data_error(make_cfg(data_dir=str(root)))
    square = tmp_path / "square"
    pairs = exif_set(square, (64, 64), 3, (64, 64), count=2)
    for image, _ in pairs:
        image.rename(image.with_suffix(".png"))
    pairs = [(image.with_suffix(".png"), mask) for image, mask in pairs]
    cfg = train_unet.validate_config({**train_unet.CONFIG, "data_dir": str(square),
                                      "checkpoint_dir": str(tmp_path / "c")})
    train_unet.check_pairs(pairs, cfg)
    assert "note: 2 image(s) carry an EXIF Orientation" in capsys.readouterr().out
    assert train_unet.format_suffix(pairs[0][0]) == ".jpg" and train_unet.format_suffix(pairs[0][1]) == ".png"
    assert train_unet.image_header(pairs[0][0]) == (64, 64, 1)


def test_a_large_first_data_check_says_so_before_it_starts(make_cfg, monkeypatch, capsys):
    """The first check of a large set decodes every file (minutes), before the banner: it said nothing."""
    monkeypatch.setattr(train_unet, "DATA_CHECK_SAY_FILES", 4)
    cfg = make_cfg()
    train_unet.prepare_data(cfg)
    assert "data check: reading " in capsys.readouterr().out
    train_unet.prepare_data(cfg)  # from its cache: nothing to read, nothing said
    assert "data check" not in capsys.readouterr().out


def test_a_tiff_with_an_orientation_tag_is_not_called_turned(tmp_path):
    """tifffile ignores the tag: a TIFF is read as stored, so the size message must not say it was turned."""
    import tifffile

    path = tmp_path / "t.tif"
    tifffile.imwrite(path, np.zeros((64, 96, 3), np.uint8), photometric="rgb", extratags=[(274, 3, 1, 6, True)])
    assert train_unet.decode_image(path).shape[:2] == (64, 96)
    assert train_unet.exif_turn(path, [64, 96]) == ""


def test_classes_that_no_mask_holds_get_a_note(tmp_path, capsys):
    """num_classes=5 over masks of classes 0-3: class 4 had an output, was predicted, and counted as IoU 0
    in val_iou without a word."""
    root = tmp_path / "mc"
    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True)
    pairs = []
    for i in range(2):
        cv2.imwrite(str(root / "images" / f"m{i}.png"), np.full((32, 32, 3), 60 * i, np.uint8))
        mask = np.zeros((32, 32), np.uint8)
        mask[:8], mask[8:16], mask[16:24] = 1, 2, 3
        cv2.imwrite(str(root / "masks" / f"m{i}.png"), mask)
        pairs.append((root / "images" / f"m{i}.png", root / "masks" / f"m{i}.png"))
    for classes, noted in ((5, True), (4, False)):
        cfg = train_unet.validate_config({**train_unet.CONFIG, "data_dir": str(root), "num_classes": classes,
                                          "checkpoint_dir": str(tmp_path / "c")})
        train_unet.check_pairs(pairs, cfg)
        out = capsys.readouterr().out
        assert ("note: class(es) 4 of num_classes=5 appear in no mask: if the masks hold classes 0-3, "
                "num_classes=4 fits them" in out) == noted, out


@pytest.mark.parametrize("num_classes, fill, said", [
    (1, 0, "none holds foreground: val IoU will be 1.0 while the model predicts nothing there and 0 once"),
    (3, 0, "none holds a class above 0 (background): val_iou will be background's IoU, averaged with 0"),
    (3, 255, "all their pixels are void (255): val_iou will be 1.0 whatever the model predicts")])
def test_a_validation_set_with_nothing_to_find_gets_a_note(make_cfg, make_data, capsys, num_classes, fill, said):
    """A binary val split with no foreground scored 1.0 while the model predicted nothing and 0 after: best.pt
    and early stopping followed that, and nothing said so."""
    root = make_data("sparse", num_classes=num_classes)
    cfg = make_cfg(data_dir=str(root), num_classes=num_classes)
    _, val = train_unet.split_pairs(cfg)
    for _, mask in val:
        cv2.imwrite(str(mask), np.full(cv2.imread(str(mask), cv2.IMREAD_UNCHANGED).shape, fill, np.uint8))
    train_unet.prepare_data(cfg)
    out = capsys.readouterr().out
    assert f"note: of the {len(val)} validation mask(s), {said}" in out
    assert out.rstrip().endswith("not the model's quality; change seed or raise val_fraction")
    cv2.imwrite(str(val[0][1]), np.pad(np.full((4, 4), 1, np.uint8), ((0, 60), (0, 60))))
    train_unet.prepare_data(cfg)
    assert "validation mask" not in capsys.readouterr().out  # one mask with a class to find is enough


def test_a_class_only_the_validation_masks_hold_gets_a_note(make_cfg, make_data, capsys):
    """Class 2 in val masks only: the model cannot learn it and val_iou averages its 0, with no word."""
    root = make_data("val_only", num_classes=3)
    cfg = make_cfg(data_dir=str(root), num_classes=3)
    train, val = train_unet.split_pairs(cfg)
    for _, mask in train:
        pixels = cv2.imread(str(mask), cv2.IMREAD_UNCHANGED)
        cv2.imwrite(str(mask), np.where(pixels == 2, 1, pixels).astype(np.uint8))
    pixels = cv2.imread(str(val[0][1]), cv2.IMREAD_UNCHANGED)
    pixels[:4, :4] = 2
    cv2.imwrite(str(val[0][1]), pixels)
    train_unet.prepare_data(cfg)
    assert ("note: class(es) 2 appear in validation masks but in no training mask: the model cannot learn them, and "
            "val_iou averages their IoU, 0 unless predicted by chance; change seed or val_fraction, or add images "
            "holding them") in capsys.readouterr().out
    train_unet.prepare_data({**cfg, "max_train_images": 8, "batch_size": 2})
    assert "by chance; raise max_train_images (now 8), or change seed" in capsys.readouterr().out
    for _, mask in val:
        cv2.imwrite(str(mask), np.minimum(cv2.imread(str(mask), cv2.IMREAD_UNCHANGED), 1).astype(np.uint8))
    train_unet.prepare_data(cfg)
    assert "in no training mask" not in capsys.readouterr().out


def test_a_folder_named_like_an_image_is_skipped_as_the_note_says(make_cfg, data_dir, capsys):
    """The note said images/sub.png/ was not read, and the next line stopped the run on it as 'a folder,
    not an image'."""
    for sub in ("images", "masks"):
        (data_dir / sub / "sub.png").mkdir()
    train, val = prepare_data(make_cfg())
    assert len(train) + len(val) == 12 and all("sub" not in str(p) for pair in train + val for p in pair)
    assert "(e.g. images/sub.png/, masks/sub.png/)" in capsys.readouterr().out


def test_caches_of_deeply_nested_json_read_as_empty(tmp_path):
    """A damaged cache is checked again, not a RecursionError traceback (review)."""
    (tmp_path / "deep.json").write_text("[" * 200000)
    assert train_unet.load_check_cache(tmp_path / "deep.json") == {}
    assert train_unet.load_cpu_probe_cache(tmp_path / "deep.json") == {}
