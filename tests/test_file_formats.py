"""Issue 20, items 3, 4, 15 and 16: masks and images as real files come (palette PNGs and TIFFs,
pyramidal TIFFs), mask values that are not class indices, and a data-check cache that is not trusted
blindly (content-aware stamps, pruning, damaged entries, two caches, a load-time guard, a safe temp file)."""
import json
import os
import shutil
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import tifffile
import torch
from PIL import Image
from torch.utils.data import DataLoader

import train_unet
from train_unet import CHECK_CACHE_NAME, IGNORE_INDEX, SegDataset, UserError, prepare_data

ROOT = Path(__file__).resolve().parents[1]


def one_line_error(fn, *args, match):
    with pytest.raises(UserError, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def voc_palette():
    """Pascal VOC's colour map (class 1 dark red, 2 green, ..., 255 the cream void colour)."""
    palette = []
    for index in range(256):
        r = g = b = 0
        c = index
        for shift in range(7, -1, -1):
            r, g, b = r | ((c & 1) << shift), g | (((c >> 1) & 1) << shift), b | (((c >> 2) & 1) << shift)
            c >>= 3
        palette += [r, g, b]
    return palette


def voc_indices(size=64):
    """Classes 1 and 2 on background 0, each object outlined by void (255), as VOC draws them."""
    mask = np.zeros((size, size), np.uint8)
    mask[8:30, 8:30], mask[34:60, 30:60] = 1, 2
    ring = cv2.dilate((mask > 0).astype(np.uint8), np.ones((3, 3), np.uint8)) - (mask > 0)
    mask[ring > 0] = IGNORE_INDEX
    return mask


def write_palette_file(path, indices, palette=None):
    image = Image.fromarray(indices, mode="P")
    image.putpalette(palette or voc_palette())
    image.save(path)
    with Image.open(path) as check:
        assert check.mode == "P"  # a real palette file: OpenCV would expand it to colour
    return path


# ----------------------------------------------------------------------------------------------------
# 3. Palette masks (VOC, labelme) are read as their indices
# ----------------------------------------------------------------------------------------------------
def test_a_voc_palette_png_is_read_as_its_indices(tmp_path):
    path = write_palette_file(tmp_path / "2007_000032.png", voc_indices())
    assert cv2.imread(str(path), cv2.IMREAD_UNCHANGED).ndim == 3  # what OpenCV alone made of it
    np.testing.assert_array_equal(train_unet.decode_mask(path), voc_indices())
    np.testing.assert_array_equal(train_unet.read_mask(path, 3), voc_indices())
    binary = (voc_indices() == 1).astype(np.uint8)  # a labelme-style 0/1 palette mask, binary run
    write_palette_file(path, binary, palette=[0, 0, 0, 128, 0, 0] + [0, 0, 0] * 254)
    np.testing.assert_array_equal(train_unet.read_mask(path, 1), binary)


def test_palette_bmp_and_tiff_masks_are_read_as_their_indices(tmp_path):
    bmp = write_palette_file(tmp_path / "m.bmp", voc_indices())  # Pillow writes an 8-bit palette BMP
    assert cv2.imread(str(bmp), cv2.IMREAD_UNCHANGED).ndim == 3
    tif = tmp_path / "m.tif"
    colormap = np.array(voc_palette(), np.uint16).reshape(256, 3).T * 257
    tifffile.imwrite(tif, voc_indices(), photometric="palette", colormap=colormap)
    for path in (bmp, tif):
        np.testing.assert_array_equal(train_unet.read_mask(path, 3), voc_indices(), err_msg=path.name)


def test_a_voc_set_of_palette_pngs_passes_the_check_and_trains_on_its_indices(make_data, make_cfg):
    root = make_data("voc", num_classes=3)
    expected = {}
    for path in sorted((root / "masks").glob("*.png")):
        mask = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
        ring = cv2.dilate((mask > 0).astype(np.uint8), np.ones((3, 3), np.uint8)) - (mask > 0)
        mask[ring > 0] = IGNORE_INDEX
        expected[path.name] = mask
        write_palette_file(path, mask)
    cfg = make_cfg(data_dir=str(root), num_classes=3)
    train, val = prepare_data(cfg)  # the data check: one-channel indices, not "a colour image"
    facts = json.loads((root / CHECK_CACHE_NAME).read_text())["files"]
    assert set(facts[os.path.abspath(train[0][1])]["values"]) <= {0, 1, 2, IGNORE_INDEX}
    plain = make_cfg(data_dir=str(root), num_classes=3, cache_images=False)
    for config in (cfg, plain):
        dataset = SegDataset(val, config, train=False)
        for i, (_, mask_path) in enumerate(val):
            _, y = dataset[i]
            truth = torch.from_numpy(cv2.resize(expected[mask_path.name], (64, 64),
                                                interpolation=cv2.INTER_NEAREST)).long()
            assert torch.equal(y, truth)


# ----------------------------------------------------------------------------------------------------
# 4. Pyramidal TIFFs: level 0 of the first series; real stacks are still refused
# ----------------------------------------------------------------------------------------------------
def write_pyramid(path, image, kind, photometric):
    """Level 0 and one half-size overview, as GeoTIFF/COG (reduced top-level pages), as a tifffile
    SubIFD pyramid, or as an OME-TIFF pyramid."""
    half = np.ascontiguousarray(image[::2, ::2])
    with tifffile.TiffWriter(path, ome=kind == "ome") as tif:
        if kind == "cog":
            tif.write(image, photometric=photometric, metadata=None)
            tif.write(half, photometric=photometric, subfiletype=1, metadata=None)
        else:
            tif.write(image, photometric=photometric, subifds=1)
            tif.write(half, photometric=photometric, subfiletype=1)
    with tifffile.TiffFile(path) as check:
        assert len(check.series[0].levels) == 2
    return path


@pytest.mark.parametrize("kind", ["cog", "subifds", "ome"])
def test_a_pyramidal_tiff_is_read_at_level_0(tmp_path, kind):
    rgb = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    path = write_pyramid(tmp_path / f"{kind}.tif", rgb, kind, "rgb")
    np.testing.assert_array_equal(train_unet.read_image(path, 3), rgb)
    mask = (rgb[..., 0] > 128).astype(np.uint8) * 255
    mask_path = write_pyramid(tmp_path / f"{kind}_mask.tif", mask, kind, "minisblack")
    np.testing.assert_array_equal(train_unet.read_mask(mask_path, 1), mask > 0)


def test_a_set_of_pyramidal_tiffs_trains(make_data, make_cfg):
    root = make_data("pyramids", count=6)
    for folder, photometric in (("images", "rgb"), ("masks", "minisblack")):
        for path in sorted((root / folder).glob("*.png")):
            pixels = cv2.imread(str(path), cv2.IMREAD_UNCHANGED)
            pixels = cv2.cvtColor(pixels, cv2.COLOR_BGR2RGB) if pixels.ndim == 3 else pixels
            write_pyramid(path.with_suffix(".tif"), pixels, "cog", photometric)
            path.unlink()
    cfg = make_cfg(data_dir=str(root), batch_size=2)
    train, _ = prepare_data(cfg)
    x, y = SegDataset(train, cfg, train=False)[0]
    assert x.shape == (3, 64, 64) and set(torch.unique(y).tolist()) <= {0, 1}


def test_a_slides_smaller_extra_images_are_ignored(tmp_path):
    """An SVS-like file: the pyramid, then a thumbnail (a full image of its own, but smaller)."""
    image = np.random.default_rng(1).integers(0, 256, (64, 96), dtype=np.uint8)
    path = tmp_path / "slide.tif"
    with tifffile.TiffWriter(path) as tif:
        tif.write(image, photometric="minisblack", subifds=1)
        tif.write(image[::2, ::2], photometric="minisblack", subfiletype=1)
        tif.write(image[::4, ::4], photometric="minisblack")
    with tifffile.TiffFile(path) as check:
        assert len(check.series) == 2
    np.testing.assert_array_equal(train_unet.read_image(path, 1), image)


def write_stack(path, kind, photometric="minisblack"):
    page = np.zeros((16, 16), np.uint8)
    if kind == "one series":  # (2, 16, 16): two pages of one series
        tifffile.imwrite(path, np.stack([page, page + 1]), photometric=photometric)
    else:  # two full-size images written one after the other: two series
        with tifffile.TiffWriter(path) as tif:
            tif.write(page, photometric=photometric)
            tif.write(page + 1, photometric=photometric)
    return path


@pytest.mark.parametrize("kind", ["one series", "two series"])
def test_a_real_stack_is_still_refused_for_images_and_masks(tmp_path, make_cfg, data_dir, kind):
    message = one_line_error(train_unet.read_image, write_stack(tmp_path / "s.tif", kind), 3,
                             match="multi-page TIFFs are not supported")
    assert "image" in message and "s.tif" in message
    # A mask stack was read as its first page by OpenCV, silently: it is refused the same way.
    message = one_line_error(train_unet.read_mask, tmp_path / "s.tif", 1, match="multi-page TIFFs")
    assert message.startswith("mask ")
    mask = sorted((data_dir / "masks").glob("*.png"))[0]
    mask.unlink()
    write_stack(mask.with_suffix(".tif"), kind)
    one_line_error(prepare_data, make_cfg(), match=f"mask .*{mask.stem}.tif is a stack")


# ----------------------------------------------------------------------------------------------------
# 15. Mask values must be non-negative whole numbers
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, dtype, words", [
    ([0, 0.5, 1, 2], np.float32, "0.5"),
    ([0, -1, 1, 2], np.int16, "-1"),
    ([0, 1, 2, np.nan], np.float32, "nan"),
])
def test_multi_class_masks_of_other_values_than_class_indices_are_refused(tmp_path, make_cfg, data_dir,
                                                                          values, dtype, words):
    mask = np.resize(np.array(values, dtype), (64, 64))
    path = tmp_path / "m.tif"
    tifffile.imwrite(path, mask)
    message = one_line_error(train_unet.read_mask, path, 3, match="not class indices")
    assert str(path) in message and f"[{words}]" in message and str(np.dtype(dtype)) in message
    assert ("255, not negative" if words == "-1" else "8-bit class indices") in message
    # ... and the data check stops the run on it, whatever the other masks hold
    target = sorted((data_dir / "masks").glob("*.png"))[3]
    target.unlink()
    tifffile.imwrite(target.with_suffix(".tif"), mask)
    one_line_error(prepare_data, make_cfg(num_classes=3), match=f"{target.stem}.tif .* not class indices")


def test_binary_masks_refuse_fractions_and_negatives(tmp_path):
    path = tmp_path / "m.tif"
    for values, dtype in (([0, 0.5, 1], np.float32), ([0, -1], np.int16)):
        tifffile.imwrite(path, np.resize(np.array(values, dtype), (8, 8)))
        one_line_error(train_unet.read_mask, path, 1, match="with num_classes=1 masks must be 0/1 or 0/255")


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.int16, np.uint16])
def test_whole_numbered_masks_of_any_type_are_accepted_exactly(tmp_path, dtype):
    """A float32 TIFF of 0.0/1.0/2.0 (numpy pipelines write those) converts exactly; so do int16 and
    16-bit masks of class indices, and 0.0/1.0 or 0/255 binary masks."""
    path = tmp_path / "m.tif"
    indices = voc_indices(32)
    tifffile.imwrite(path, indices.astype(dtype))
    np.testing.assert_array_equal(train_unet.read_mask(path, 3), indices)
    tifffile.imwrite(path, (indices == 1).astype(dtype))
    np.testing.assert_array_equal(train_unet.read_mask(path, 1), indices == 1)


def test_a_16_bit_png_class_mask_is_checked_the_same_way(tmp_path):
    path = tmp_path / "m.png"
    cv2.imwrite(str(path), np.resize(np.array([0, 1, 2], np.uint16), (8, 8)))
    np.testing.assert_array_equal(train_unet.read_mask(path, 3), np.resize(np.array([0, 1, 2]), (8, 8)))
    cv2.imwrite(str(path), np.resize(np.array([0, 1, 300], np.uint16), (8, 8)))
    one_line_error(train_unet.read_mask, path, 3, match="holds class 300")


def test_requirements_list_pillow():
    """Palette masks are read with Pillow, imported directly: a requirement of its own."""
    text = (ROOT / "requirements.txt").read_text().lower()
    assert any(line.split(">=")[0].strip() == "pillow" for line in text.splitlines())
