"""Issue 20, items 3, 4, 15 and 16: masks and images as real files come (palette PNGs and TIFFs,
pyramidal TIFFs), mask values that are not class indices, and a data-check cache that is not trusted
blindly (content-aware stamps, pruning, damaged entries, two caches, a load-time guard, a safe temp file)."""
import json
import os
import re
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


@pytest.mark.parametrize("shape", [(24, 32, 1), (1, 24, 32), (1, 24, 32, 3)], ids=["HW1", "1HW", "1HW3"])
def test_a_single_image_saved_with_a_length_1_axis_is_one_image_not_a_stack(tmp_path, shape):
    """tifffile.imwrite(path, gray[..., None]) writes one page, one image (axes YXQ); OpenCV and PIL open it. It was
    refused as a stack, with the fix 'save one image per file', which it already was. Images and masks."""
    gray = np.arange(24 * 32, dtype=np.uint8).reshape(24, 32)
    image = gray.reshape(shape) if shape[-1] != 3 else np.stack([gray, gray // 2, gray // 3], -1)[None]
    tifffile.imwrite(tmp_path / "i.tif", image)
    expected = image.reshape(image.shape[-3:] if shape[-1] == 3 else (24, 32))
    np.testing.assert_array_equal(train_unet.read_tiff(tmp_path / "i.tif"), expected)
    read = train_unet.read_image(tmp_path / "i.tif", 3)
    assert read.shape == (24, 32, 3) and read.dtype == np.uint8
    if shape[-1] != 3:
        tifffile.imwrite(tmp_path / "m.tif", (gray % 3).reshape(shape))
        np.testing.assert_array_equal(train_unet.read_mask(tmp_path / "m.tif", 3), gray % 3)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, bool])
def test_a_miniswhite_tiff_image_is_read_as_viewers_show_it(tmp_path, dtype):
    """tifffile returns a MinIsWhite image's stored values, 0 for white: OpenCV and PIL show the 8-bit one the
    other way round, and a data set mixing such TIFFs with PNGs trained on them inverted, with no word."""
    ramp = np.tile(np.arange(64, dtype=np.uint16) * 4, (48, 1))
    shown = ramp > 100 if dtype is bool else (ramp * (1 if dtype is np.uint8 else 257)).astype(dtype)
    stored = ~shown if dtype is bool else np.iinfo(dtype).max - shown
    tifffile.imwrite(tmp_path / "mw.tif", stored, photometric="miniswhite")
    np.testing.assert_array_equal(train_unet.read_tiff(tmp_path / "mw.tif"), shown * np.uint8(255) if dtype is bool
                                  else shown)
    if dtype is np.uint8:
        np.testing.assert_array_equal(train_unet.read_image(tmp_path / "mw.tif", 1),
                                      cv2.imread(str(tmp_path / "mw.tif"), -1))
        np.testing.assert_array_equal(np.asarray(Image.open(tmp_path / "mw.tif")), shown)
    np.testing.assert_array_equal(train_unet.read_tiff(tmp_path / "mw.tif", mask=True), stored)  # masks: as stored



@pytest.mark.parametrize("photometric", ["minisblack", "miniswhite"])
def test_a_bilevel_tiff_image_is_read_as_opencv_reads_it_and_trains(tmp_path, make_cfg, data_dir, photometric):
    """A 1-bit (bilevel) TIFF image, a scan's or a thresholded export's: always refused ('pixels of type bool'),
    where the README says a bilevel MinIsWhite one is read as shown. Now 0 and 255, as OpenCV reads a 1-bit PNG
    or TIFF; a 1-bit mask is read as stored (0 and 1)."""
    shown = np.zeros((48, 64), bool)
    shown[10:30, 20:50] = True
    tifffile.imwrite(tmp_path / "bi.tif", shown if photometric == "minisblack" else ~shown, photometric=photometric)
    want = shown.astype(np.uint8) * 255
    np.testing.assert_array_equal(cv2.imread(str(tmp_path / "bi.tif"), cv2.IMREAD_GRAYSCALE), want)  # OpenCV's
    np.testing.assert_array_equal(train_unet.read_image(tmp_path / "bi.tif", 1), want)
    np.testing.assert_array_equal(train_unet.read_image(tmp_path / "bi.tif", 3), np.dstack([want] * 3))
    assert train_unet.read_tiff(tmp_path / "bi.tif", mask=True).dtype == bool  # a mask's 0/1, as stored
    for image in sorted((data_dir / "images").iterdir()):  # a data set of bilevel scans trains
        grey = cv2.imread(str(image), cv2.IMREAD_GRAYSCALE) > 127
        tifffile.imwrite(image.with_suffix(".tif"), grey if photometric == "minisblack" else ~grey,
                         photometric=photometric)
        image.unlink()
    result = train_unet.train(make_cfg(epochs=1, max_train_images=4))
    assert len(result["history"]) == 1


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


@pytest.mark.parametrize("writer", ["imagej", "ome"])
def test_channels_stored_as_pages_are_named_so_with_the_fix(tmp_path, writer):
    """A Fiji composite or an OME-TIFF holds one image's channels as pages (axes CYX): 'is a stack ... save one
    image per file' told the user nothing to do."""
    pixels = np.random.default_rng(0).integers(0, 255, (3, 48, 64), dtype=np.uint8)
    path = tmp_path / ("c.tif" if writer == "imagej" else "c.ome.tif")
    tifffile.imwrite(path, pixels, **{writer: True}, metadata={"axes": "CYX"})
    message = one_line_error(train_unet.read_image, path, 3, match=r"holds 3 channels as pages")
    assert message.startswith(f"image {path} holds 3 channels as pages (shape (3, 48, 64), axes CYX: a Fiji "
                              "composite or an OME-TIFF)") and "Image > Type > RGB Color" in message


# ----------------------------------------------------------------------------------------------------
# 15. Mask values must be non-negative whole numbers
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("values, dtype, words", [
    ([0, 0.5, 1, 2], np.float32, "0.5"),
    ([0, -1, 1, 2], np.int16, "-1"),
    ([0, np.float32(0.9999999), 1, 2], np.float32, "0.9999999"),  # once shown as [1]: class 1 "not a class"
    ([0, 1, 2, np.float32(254.99998)], np.float32, "254.99998"),  # once shown as [255]: void "not a class"
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


def test_mask_values_in_messages_read_back_as_they_are():
    """A message's values are the mask's: not rounded to a whole number, not cut to 6 digits."""
    values = [0.5, 255, float(np.float32(0.9999999)), 1234567, 1.0000000000000002, float("nan")]
    assert train_unet.format_values(values) == "[0.5, 255, 0.9999999, 1234567, 1.0000000000000002, nan]"


@pytest.mark.parametrize("classes, fill", [(1, "0 \\(background\\) or 1 \\(foreground\\)"),
                                           (3, "a class index, or 255 for void")])
def test_masks_holding_nan_are_refused_for_the_nan(tmp_path, make_cfg, data_dir, classes, fill):
    """A float mask with NaN pixels ('no label' in some pipelines): the binary error had advised 0/255 beside
    values [0.0, nan] and never named the NaN; the data check stops the run on it, in training too."""
    mask = np.zeros((64, 64), np.float32)
    mask[0, 0], mask[5, 5] = np.nan, np.inf
    path = tmp_path / "m.tif"
    tifffile.imwrite(path, mask)
    one_line_error(train_unet.read_mask, path, classes,
                   match=rf"^mask {re.escape(str(path))} \(float32\) holds inf and nan pixels, which are no class: "
                         rf"give them {fill} and save it again$")
    target = sorted((data_dir / "masks").glob("*.png"))[3]
    target.unlink()
    tifffile.imwrite(target.with_suffix(".tif"), mask)
    one_line_error(prepare_data, make_cfg(num_classes=classes),
                   match=f"{target.stem}.tif \\(float32\\) holds inf and nan")


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


# ----------------------------------------------------------------------------------------------------
# 16. The data-check cache
# ----------------------------------------------------------------------------------------------------
@pytest.fixture
def count_decodes(monkeypatch):
    calls = []
    real_mask, real_image = train_unet.decode_mask, train_unet.decode_image
    monkeypatch.setattr(train_unet, "decode_mask", lambda p: calls.append(Path(p).name) or real_mask(p))
    monkeypatch.setattr(train_unet, "decode_image",
                        lambda p, *c: calls.append(Path(p).name) or real_image(p, *c))
    return calls


def edit_keeping_mtime(path, values):
    """Same size, same mtime: a BMP rewritten in place, then os.utime puts the old time back."""
    before = path.stat()
    time.sleep(0.02)  # past the file system's timestamp granularity (ctime is a coarse clock on Linux)
    cv2.imwrite(str(path), values)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = path.stat()
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.fixture
def bmp_data(data_dir):
    """The 12 pairs with BMP masks: an edited BMP keeps its size (no compression)."""
    for path in sorted((data_dir / "masks").glob("*.png")):
        cv2.imwrite(str(path.with_suffix(".bmp")), cv2.imread(str(path), cv2.IMREAD_UNCHANGED))
        path.unlink()
    return data_dir


def test_an_edited_mask_with_its_old_size_and_mtime_is_checked_again(make_cfg, bmp_data, count_decodes):
    cfg = make_cfg()
    prepare_data(cfg)
    mask = sorted((bmp_data / "masks").glob("*.bmp"))[0]
    edit_keeping_mtime(mask, np.full((64, 64), 7, np.uint8))
    count_decodes.clear()
    one_line_error(prepare_data, cfg, match=f"{mask.name} holds values")
    assert count_decodes == [mask.name]


def test_an_edited_copy_with_the_old_mtime_is_checked_again(make_cfg, bmp_data, tmp_path):
    """cp -p / rsync -a of an edited same-size file over the checked one (shutil.copy2 does the same)."""
    cfg = make_cfg()
    prepare_data(cfg)
    mask = sorted((bmp_data / "masks").glob("*.bmp"))[0]
    edited = tmp_path / mask.name
    shutil.copy2(mask, edited)
    edit_keeping_mtime(edited, np.full((64, 64), 7, np.uint8))
    shutil.copy2(edited, mask)
    assert mask.stat().st_mtime_ns == edited.stat().st_mtime_ns
    one_line_error(prepare_data, cfg, match=f"{mask.name} holds values")


def cached_files(folder):
    return json.loads((Path(folder) / CHECK_CACHE_NAME).read_text())["files"]


def test_entries_of_removed_files_are_pruned_and_other_subsets_kept(make_cfg, data_dir, make_data):
    prepare_data(make_cfg())
    all_twelve = set(cached_files(data_dir))
    assert len(all_twelve) == 24
    removed = [sorted((data_dir / sub).glob("*.png"))[5] for sub in ("images", "masks")]
    for path in removed:
        path.unlink()
    extra = make_data("extra", count=1, seed=3)  # a new pair: the cache is written again
    for sub in ("images", "masks"):
        shutil.copy(extra / sub / "shape_0000.png", data_dir / sub / "new_pair.png")
    cfg = make_cfg(max_train_images=3, batch_size=2)  # a run on a subset: the others' entries stay for other runs
    train, val = prepare_data(cfg)
    files = cached_files(data_dir)
    assert not {os.path.abspath(p) for p in removed} & set(files)
    assert set(files) == (all_twelve - {os.path.abspath(p) for p in removed}) | {
        os.path.abspath(data_dir / sub / "new_pair.png") for sub in ("images", "masks")}
    assert len(train) == 3 and len(files) > 2 * (len(train) + len(val))


@pytest.mark.parametrize("damage", ["no values", "stamp text", "entry list", "hw short", "bad dtype"])
def test_a_damaged_entry_is_checked_again_not_a_traceback(make_cfg, data_dir, count_decodes, damage):
    cfg = make_cfg()
    prepare_data(cfg)
    cache = json.loads((data_dir / CHECK_CACHE_NAME).read_text())
    mask = os.path.abspath(sorted((data_dir / "masks").glob("*.png"))[2])
    entry = cache["files"][mask]
    if damage == "no values":
        del entry["values"]
    elif damage == "stamp text":
        entry["stamp"] = "yesterday"
    elif damage == "entry list":
        cache["files"][mask] = [1, 2]
    elif damage == "hw short":
        entry["hw"] = [64]
    else:
        entry["dtype"] = "no-such-type"
    (data_dir / CHECK_CACHE_NAME).write_text(json.dumps(cache))
    count_decodes.clear()
    prepare_data(cfg)
    assert count_decodes == [Path(mask).name]
    assert cached_files(data_dir)[mask]["values"] == [0, 255]  # repaired


@pytest.mark.parametrize("damage", [["a", 3], [9], [5, 2], "0-4095"])
def test_a_damaged_image_range_is_checked_again_not_a_traceback(make_cfg, data_dir, count_decodes, damage):
    """16-bit images: the cached [min, max] (learnt_intensity_range) is validated like the rest."""
    for path in sorted((data_dir / "images").glob("*.png")):
        cv2.imwrite(str(path), cv2.imread(str(path), cv2.IMREAD_UNCHANGED).astype(np.uint16) * 16)
    cfg = make_cfg()
    train, _ = prepare_data(cfg)
    learnt = train_unet.learnt_intensity_range(train, cfg)
    cache = json.loads((data_dir / CHECK_CACHE_NAME).read_text())
    image = os.path.abspath(train[0][0])
    cache["files"][image]["range"] = damage
    (data_dir / CHECK_CACHE_NAME).write_text(json.dumps(cache))
    count_decodes.clear()
    train, _ = prepare_data(cfg)
    assert count_decodes == [Path(image).name]
    assert train_unet.learnt_intensity_range(train, cfg) == learnt


def test_a_stale_cache_in_a_read_only_data_dir_is_not_read_in_place_of_the_fresh_one(
        make_cfg, data_dir, count_decodes, monkeypatch):
    cfg = make_cfg()
    prepare_data(cfg)  # data_dir's cache, written while it was writable
    real = train_unet.atomic_write

    def read_only_data_dir(path, write):
        if Path(path).parent == data_dir:
            raise PermissionError(13, "Permission denied", str(path))
        return real(path, write)
    monkeypatch.setattr(train_unet, "atomic_write", read_only_data_dir)
    masks = sorted((data_dir / "masks").glob("*.png"))
    for mask in masks[:4]:  # edited since: data_dir's entries for them are stale
        cv2.imwrite(str(mask), np.flipud(cv2.imread(str(mask), cv2.IMREAD_UNCHANGED)))
    count_decodes.clear()
    prepare_data(cfg)
    assert sorted(count_decodes) == sorted(m.name for m in masks[:4])
    assert (Path(cfg["checkpoint_dir"]) / CHECK_CACHE_NAME).is_file()
    count_decodes.clear()
    prepare_data(cfg)  # the fresh entries in checkpoint_dir are used, though data_dir's is read first
    assert count_decodes == []


def test_a_cache_in_another_version_is_checked_again(make_cfg, data_dir, count_decodes):
    cfg = make_cfg()
    prepare_data(cfg)
    cache = json.loads((data_dir / CHECK_CACHE_NAME).read_text())
    cache["version"] = 1  # stamps of size and mtime only: not trusted
    (data_dir / CHECK_CACHE_NAME).write_text(json.dumps(cache))
    count_decodes.clear()
    prepare_data(cfg)
    assert len(count_decodes) == 24


def multi_class_set_changed_after_the_check(make_data, make_cfg, **overrides):
    root = make_data("multi", num_classes=3)
    cfg = make_cfg(data_dir=str(root), num_classes=3, cache_images=False, **overrides)
    train, val = prepare_data(cfg)
    bad = train[1][1]
    mask = cv2.imread(str(bad), cv2.IMREAD_UNCHANGED)
    cv2.imwrite(str(bad), np.where(mask == 2, 7, mask).astype(np.uint8))  # after the check
    assert (mask == 2).any()
    return cfg, train, bad


@pytest.mark.parametrize("workers", [0, 1])
def test_a_class_the_check_did_not_see_stops_loading_with_one_line(make_data, make_cfg, workers):
    cfg, train, bad = multi_class_set_changed_after_the_check(make_data, make_cfg)
    loader = DataLoader(SegDataset(train, cfg, train=True), batch_size=2, num_workers=workers,
                        worker_init_fn=train_unet.one_opencv_thread if workers else None)  # as the trainer's
    with pytest.raises(UserError) as info:
        list(loader)
    message = train_unet.user_message(info.value)
    assert "\n" not in message and str(bad) in message
    assert "holds class 7 but num_classes=3" in message and "set num_classes=8" in message


def test_a_class_the_check_did_not_see_is_one_line_from_the_command_line(make_data, make_cfg, monkeypatch,
                                                                          capsys):
    """Through a real run with a loader worker: an error message, exit code 2, no CUDA assert/traceback."""
    cfg, _, bad = multi_class_set_changed_after_the_check(make_data, make_cfg)
    monkeypatch.setattr(train_unet, "check_pairs", lambda pairs, cfg: None)  # as a stale cache would
    args = [f"{key}={cfg[key]}" for key in ("data_dir", "checkpoint_dir", "image_size", "encoder_name",
                                             "batch_size", "num_classes", "device", "use_amp")]
    args += ["encoder_weights=None", "epochs=1", "num_workers=1", "progress=False", "compile_model=False",
             "channels_last=False", "cache_images=False", "max_train_images=4"]
    assert train_unet.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"error: mask {bad} holds class 7"), err


def test_values_that_are_not_class_indices_are_caught_at_load_time(tmp_path, make_cfg):
    """A mask changed after the check to -1 (would become 255, void) or 0.5 (would become 0)."""
    image, mask = tmp_path / "i.png", tmp_path / "m.tif"
    cv2.imwrite(str(image), np.zeros((8, 8, 3), np.uint8))
    for values, dtype in (([0, 1, -1], np.int16), ([0, 1, 0.5], np.float32)):
        tifffile.imwrite(mask, np.resize(np.array(values, dtype), (8, 8)))
        with pytest.raises(UserError, match=f"mask {mask} .*not class indices"):
            train_unet.read_pair((image, mask), make_cfg(num_classes=3))


def test_the_temp_file_is_new_and_unpredictable(tmp_path):
    """A symlink planted under the old predictable temp name (.<name>.tmp<pid>) is not written through."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    target = tmp_path / CHECK_CACHE_NAME
    planted = tmp_path / f".{target.name}.tmp{os.getpid()}"
    planted.symlink_to(victim)
    train_unet.atomic_write(target, lambda tmp: Path(tmp).write_text("cache"))
    assert victim.read_text() == "precious"
    assert target.read_text() == "cache" and not target.is_symlink()
    assert planted.is_symlink()  # not ours to remove


def test_atomic_writes_get_the_usual_permissions_and_leave_nothing_behind(tmp_path):
    old = os.umask(0o027)
    try:
        train_unet.atomic_write(tmp_path / "a.json", lambda tmp: Path(tmp).write_text("{}"))
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o640  # not mkstemp's 0600

    def fail(tmp):
        Path(tmp).write_text("half")
        raise OSError(28, "No space left on device")
    with pytest.raises(OSError):
        train_unet.atomic_write(tmp_path / "b.json", fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


@pytest.mark.parametrize("dtype", [np.int16, np.int32, np.float64])
def test_colour_tiffs_opencv_reads_in_any_depth_come_out_rgb(tmp_path, monkeypatch, dtype):
    """OpenCV reads the TIFFs read_tiff leaves to it (CMYK, palette colours); cvtColor has no signed
    16/32-bit or float64 kernels, so their BGR -> RGB swap must not depend on it."""
    rgb = np.zeros((6, 5, 3), dtype)
    rgb[..., 0], rgb[..., 1], rgb[..., 2] = 300, 20, 1
    path = tmp_path / "scene.tif"
    assert cv2.imwrite(str(path), rgb[..., ::-1].copy())
    monkeypatch.setattr(train_unet, "read_tiff", lambda *a, **k: None)  # as for a TIFF left to OpenCV
    image = train_unet.decode_image(path, 3)
    assert image.dtype == dtype and np.array_equal(image, rgb)


def test_a_gray_palette_png_is_read_as_its_gray_values(tmp_path):
    """A gray mask that a PNG optimiser stored with a palette, entries in its own order: the gray levels
    it shows are the mask (as OpenCV read it), not the entries' order; a colour (VOC) palette gives indices."""
    values = np.array([[0, 255, 255], [0, 0, 255]], np.uint8)
    gray = Image.fromarray((values == 0).astype(np.uint8), mode="P")  # index 0 = white, 1 = black
    gray.putpalette([255, 255, 255, 0, 0, 0])
    gray.save(tmp_path / "gray.png")
    assert np.array_equal(train_unet.decode_mask(tmp_path / "gray.png"), values)
    colour = Image.fromarray((values == 0).astype(np.uint8), mode="P")
    colour.putpalette([0, 0, 0, 128, 0, 0])
    colour.save(tmp_path / "colour.png")
    assert np.array_equal(train_unet.decode_mask(tmp_path / "colour.png"), (values == 0).astype(np.uint8))


def test_a_short_grey_palette_whose_indices_are_classes_is_named_in_the_error(tmp_path):
    """[black, white, grey] for classes 0, 1, 2 reads as 0, 255, 128: the error advised only num_classes=129."""
    indices = np.zeros((8, 8), np.uint8)
    indices[:, 3:], indices[:, 6:] = 1, 2
    mask = Image.fromarray(indices, mode="P")
    mask.putpalette([0, 0, 0, 255, 255, 255, 128, 128, 128])
    mask.save(tmp_path / "m.png")
    values = set(np.unique(train_unet.decode_mask(tmp_path / "m.png")).tolist())
    err = one_line_error(train_unet.check_mask_values, tmp_path / "m.png", values, 3, "uint8",
                         match=r"holds class 128 but num_classes=3 \(255 = void is allowed\): it is a palette image of "
                               r"greys, read by its greys as a viewer shows it; if its palette indices \(\[0, 1, 2\]\) "
                               r"are the classes, save it as plain grey values \(class i as level i\); else ")
    assert err.index("palette indices") < err.index("evenly spaced greys")  # the likelier fix first
    assert "num_classes=129" not in err  # 0/128/255 reads as 3 classes saved as greys, not as 129 classes


def test_white_black_palette_class_masks_refused_with_num_classes_2_name_the_palette(make_cfg, data_dir):
    """Class indices 0/1 saved with a [white, black] palette read as 255/0 (by their greys, as a viewer shows
    them): the refusal ('every mask holds only 0 and 255') advised only num_classes=1, which trains on them
    inverted where the indices were the classes."""
    for path in (data_dir / "masks").iterdir():
        mask = Image.fromarray((cv2.imread(str(path), cv2.IMREAD_GRAYSCALE) > 0).astype(np.uint8), mode="P")
        mask.putpalette([255, 255, 255, 0, 0, 0])
        mask.save(path)
    err = one_line_error(train_unet.train, make_cfg(num_classes=2),
                         match=r"every mask holds only 0 and 255: .* use num_classes=1; or: it is a palette image "
                               r"of greys, read by its greys as a viewer shows it; if its palette indices "
                               r"\(\[0, 1\]\) are the classes, save it as plain grey values")
    assert err.count("palette") == 2  # one mask named, not every one


def test_a_mask_with_a_full_inverted_grey_lut_is_read_by_its_indices(tmp_path):
    """ImageJ's inverting LUT (256 greys, entry i = 255 - i) shows foreground 255 black: read by its grey
    values, foreground and background swapped silently."""
    values = np.array([[0, 255, 255], [0, 0, 255]], np.uint8)
    mask = Image.fromarray(values, mode="P")
    mask.putpalette([255 - i for i in range(256) for _ in range(3)])
    mask.save(tmp_path / "inverted.png")
    assert np.array_equal(train_unet.decode_mask(tmp_path / "inverted.png"), values)
    padded = Image.fromarray((values == 0).astype(np.uint8), mode="P")  # [white, black] padded to 256 by its writer
    padded.putpalette([255, 255, 255, 0, 0, 0] + [0] * 762)
    padded.save(tmp_path / "padded.png")
    assert np.array_equal(train_unet.decode_mask(tmp_path / "padded.png"), values)  # by its greys, as before


@pytest.mark.skipif(not Path("/proc/self/status").is_file(), reason="reads /proc (Linux)")
def test_the_umask_is_read_without_setting_it(monkeypatch):
    """Setting the umask to read it would race with other threads creating files (TensorBoard's writer)."""
    expected = os.umask(0o027)
    os.umask(expected)
    monkeypatch.setattr(os, "umask", lambda mask: pytest.fail("the umask was set to read it"))
    assert train_unet.current_umask() == expected


def test_class_indices_saved_with_pillows_default_palette_stay_indices(tmp_path):
    """Image.fromarray(mask, mode="P") without putpalette gets a one-entry black palette: the indices
    past its end are the classes, not gray levels (they must not all read as 0)."""
    values = np.array([[0, 1, 1], [1, 1, 0]], np.uint8)
    Image.fromarray(values, mode="P").save(tmp_path / "mask.png")
    assert np.array_equal(train_unet.read_mask(tmp_path / "mask.png", 1), values)


# Damaged and unusual files as users have them: each one named in one line, or read right; never a crash,
# a traceback or a silently wrong image.
def rgb_image(h=40, w=48):
    """Smooth colours (JPEG keeps them within a few levels)."""
    noise = (np.random.default_rng(3).random((h, w, 3)) * 255).astype(np.uint8)
    return cv2.GaussianBlur(noise, (0, 0), 3)


def test_a_truncated_compressed_tiff_is_one_line_not_a_traceback(tmp_path):
    path = tmp_path / "z.tif"
    tifffile.imwrite(path, rgb_image(), photometric="rgb", compression="zlib")
    with tifffile.TiffFile(path) as tif:
        start = tif.pages[0].dataoffsets[0] + tif.pages[0].databytecounts[0] // 2
    data = bytearray(path.read_bytes())
    data[start:start + 64] = bytes(64)  # zlib.error inside tifffile
    path.write_bytes(bytes(data))
    one_line_error(train_unet.read_image, path, 3, match=r"cannot read image .*z.tif \(corrupt TIFF data: .*\): fix "
                                                         r"or remove it")


@pytest.mark.parametrize("orientation", [3, 6])
def test_lzw_tiffs_are_read_as_stored_whatever_their_orientation_tag(tmp_path, orientation):
    """Without imagecodecs tifffile cannot decode LZW and OpenCV read them: turned by the Orientation tag
    (3: a half turn, silently against its mask drawn as stored), or refused as corrupt (6). tifffile, with
    imagecodecs (requirements.txt), reads them as stored."""
    image = rgb_image(32, 64)
    path = tmp_path / "o.tif"
    Image.fromarray(image).save(path, compression="tiff_lzw", tiffinfo={0x0112: orientation})
    assert np.array_equal(train_unet.read_image(path, 3), image)


def test_an_lzw_palette_tiff_mask_is_read_by_its_indices(tmp_path):
    """VOC colours in an LZW TIFF: without imagecodecs OpenCV expanded the palette ('is a colour image')."""
    indices = np.zeros((16, 16), np.uint8)
    indices[:, 5:] = 1
    indices[:, 10:] = 2
    indices[0] = 255
    mask = Image.fromarray(indices, "P")
    mask.putpalette([0, 0, 0, 128, 0, 0, 0, 128, 0] + [0] * 756 + [224, 224, 192])
    mask.save(tmp_path / "m.tif", compression="tiff_lzw")
    assert np.array_equal(train_unet.read_mask(tmp_path / "m.tif", 3), indices)


def test_a_tiff_whose_codec_is_missing_names_imagecodecs(tmp_path, monkeypatch):
    path = tmp_path / "o.tif"
    Image.fromarray(rgb_image()).save(path, compression="tiff_lzw")

    def no_codec(self, *args, **kwargs):
        raise ValueError("<COMPRESSION.LZW: 5> requires the 'imagecodecs' package")  # tifffile's words
    monkeypatch.setattr(tifffile.TiffPageSeries, "asarray", no_codec)
    one_line_error(train_unet.read_image, path, 3, match=r"^cannot read image .*o.tif: tifffile says '<COMPRESSION.LZW: "
                                                         r"5> requires the 'imagecodecs' package': pip install -U "
                                                         r"imagecodecs \(requirements.txt has it\)$")


def test_a_truncated_jpeg_is_refused_and_a_whole_one_with_a_trailer_is_read(tmp_path):
    """libjpeg decodes a cut JPEG with grey for the missing rows and only a warning; a JPEG with bytes after
    its end (a camera's trailer, a motion photo's video) is whole, and an EXIF-turned one still upright."""
    image = rgb_image()
    data = cv2.imencode(".jpg", image[..., ::-1])[1].tobytes()
    whole = train_unet.read_image(write(tmp_path / "whole.jpg", data), 3)
    assert np.abs(whole.astype(int) - image).mean() < 8  # JPEG's loss, in RGB order
    one_line_error(train_unet.read_image, write(tmp_path / "cut.jpg", data[:len(data) // 2]), 3,
                   match=r"cannot read image .*cut.jpg \(a truncated JPEG: .*\): fix or remove it")
    trailer = write(tmp_path / "trailer.jpg", data + b"\x00" * 7 + b"ftypmp42" + bytes(range(256)))
    assert np.array_equal(train_unet.read_image(trailer, 3), whole)
    turned = tmp_path / "turned.jpg"
    exif = Image.new("RGB", (1, 1)).getexif()
    exif[0x0112] = 6  # shown turned a quarter clockwise
    Image.fromarray(image).save(turned, exif=exif, quality=95)
    assert train_unet.read_image(turned, 3).shape == (48, 40, 3)


def test_a_damaged_jpeg_is_refused_and_named_and_other_stderr_output_is_kept(tmp_path, capfd):
    """A JPEG damaged in its middle (its end marker intact) decoded into wrong pixels with one libjpeg line on
    stderr that named no file: predict wrote its mask, training trained on it. Also cut and closed with an end
    marker. What else reaches fd 2 during the decode is written back."""
    image = rgb_image()
    data = cv2.imencode(".jpg", image[..., ::-1])[1].tobytes()
    damaged = bytearray(data)
    for i in range(len(data) // 3, len(data) // 3 + 100):
        damaged[i] ^= 0x33
    closed = data[:len(data) * 3 // 4] + b"\xff\xd9"
    for name, bad in [("damaged.jpg", bytes(damaged)), ("closed.jpg", closed)]:
        one_line_error(train_unet.read_image, write(tmp_path / name, bad), 3,
                       match=rf"^cannot read image .*{name} \(a damaged JPEG: libjpeg says 'Corrupt JPEG data: "
                             rf".*', and fills what it cannot read with made-up pixels\): remove it, or replace it")
    assert "Corrupt JPEG" not in capfd.readouterr().err  # said once, in the error

    def printing():
        os.write(2, b"another line \xe9\n\rpredict:  50%|#####     | 20/40")  # not UTF-8, a bar with no newline
        return "decoded"
    assert train_unet.WATCHED_DECODES.decode(printing) == ("decoded", [])
    assert capfd.readouterr().err == "another line \ufffd\n\rpredict:  50%|#####     | 20/40"  # written back as it came

    def bar_then_warning():  # a progress bar's line, then libjpeg's warning right after it: it went unseen
        os.write(2, b"\rpredict:  50%|#####     | 20/40")
        return cv2.imdecode(np.frombuffer(bytes(damaged), np.uint8), cv2.IMREAD_COLOR)
    _, said = train_unet.WATCHED_DECODES.decode(bar_then_warning)
    assert [m.startswith(b"Corrupt JPEG data: ") for m in said] == [True]
    assert capfd.readouterr().err == "\rpredict:  50%|#####     | 20/40"
    padded = write(tmp_path / "padded.jpg", data[:-2] + b"\x00" * 5 + data[-2:])  # a camera's filler: exact pixels
    assert np.array_equal(train_unet.read_image(padded, 3), train_unet.read_image(write(tmp_path / "w.jpg", data), 3))
    capfd.readouterr()
    whole = write(tmp_path / "whole.jpg", data)
    assert np.abs(train_unet.read_image(whole, 3).astype(int) - image).mean() < 8
    assert capfd.readouterr().err == ""


def test_the_jpeg_watch_cost_tool_prints_its_table(capsys):
    """tools/jpeg_watch_cost.py, BENCHMARKS.md's figures for the watch: runs, and prints both ways' rows."""
    import runpy

    tool = runpy.run_path(str(ROOT / "tools" / "jpeg_watch_cost.py"))
    tool["main"](images=4, side=32, rounds=1)
    out = capsys.readouterr().out
    assert "| cv2.imdecode alone | " in out and "| jpeg_decode (watched) | " in out


def test_an_interrupt_while_a_decode_waits_holds_back_no_later_decode(monkeypatch):
    """A Ctrl-C in a notebook while a decode waited to run alone left it counted as waiting: every later decode
    then waited for it, for ever (review)."""
    watch = train_unet.WatchedDecodes()
    watch.active = 1  # another thread's round is on

    def interrupted(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(watch.cond, "wait", interrupted)
    with pytest.raises(KeyboardInterrupt):
        watch.decode(lambda: None, alone=True)
    assert watch.wanting == 0
    watch.active = 0
    assert watch.decode(lambda: "decoded") == ("decoded", [])


def test_a_process_forked_mid_round_gets_its_stderr_back(tmp_path):
    """A child forked while another thread decoded (a loader's worker, a subprocess) kept fd 2 on the round's
    temporary file: what it printed was lost."""
    import threading

    if not hasattr(os, "fork"):
        pytest.skip("no fork on this system")
    started, release, out = threading.Event(), threading.Event(), tmp_path / "child.txt"

    def held():
        started.set()
        release.wait(20)
    with open(out, "wb") as f:
        saved = os.dup(2)
        os.dup2(f.fileno(), 2)  # this process's stderr: the file
        try:
            thread = threading.Thread(target=train_unet.WATCHED_DECODES.decode, args=(held,))
            thread.start()
            started.wait(20)
            go, told = os.pipe()
            pid = os.fork()
            if pid == 0:  # writes once the parent's round has ended: its fd 2 was then a file no one read
                os.read(go, 1)
                os.write(2, b"from the child\n")
                os._exit(0)
            release.set()
            thread.join(20)
            os.write(told, b"x")
            os.waitpid(pid, 0)
            os.close(go)
            os.close(told)
        finally:
            os.dup2(saved, 2)
            os.close(saved)
    assert out.read_bytes() == b"from the child\n"


def test_jpegs_decode_at_once_and_only_the_damaged_one_is_refused(tmp_path):
    """Watching fd 2 one decode at a time would have cost predict's readers and the data check their
    parallel decoding: the threads decoding at once share a round (here two meet at a barrier inside it, which
    one at a time could not pass), and the one JPEG libjpeg warned of, among eight decoded together, is found
    by decoding again alone."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    barrier = threading.Barrier(2, timeout=20)
    with ThreadPoolExecutor(2) as pool:
        assert [f.result()[0] for f in [pool.submit(train_unet.WATCHED_DECODES.decode, barrier.wait)
                                        for _ in range(2)]] in ([0, 1], [1, 0])
    data = cv2.imencode(".jpg", rgb_image()[..., ::-1])[1].tobytes()
    damaged = bytearray(data)
    for i in range(len(data) // 3, len(data) // 3 + 100):
        damaged[i] ^= 0x33
    paths = [write(tmp_path / f"{i}.jpg", bytes(damaged) if i == 5 else data) for i in range(8)]

    def read(path):
        try:
            return train_unet.read_image(path, 3).shape
        except UserError as exc:
            return str(exc)
    for _ in range(3):
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(read, paths))
        assert [r for r in results if r != (40, 48, 3)] == [results[5]] and "5.jpg (a damaged JPEG" in results[5]


@pytest.mark.parametrize("compression", ["jpeg", "zlib"])
def test_a_compressed_tiff_cut_short_is_refused_whatever_its_codec(tmp_path, compression):
    """Cut within its JPEG-compressed strip, a TIFF decoded with the rest made up (max difference 119): its
    strips run past the file's end. An uncompressed one whose last strip is counted in full, though shorter (some
    writers do), reads exactly and is taken (review)."""
    path = tmp_path / "cut.tif"
    tifffile.imwrite(path, rgb_image(), photometric="rgb", compression=compression)
    path.write_bytes(path.read_bytes()[:int(path.stat().st_size * 0.9)])
    one_line_error(train_unet.read_image, path, 3, match=r"^cannot read image .*cut.tif \(a truncated TIFF: its "
                                                         r"image data run past the end of the file, \d+ bytes\)")
    plain = tmp_path / "plain.tif"
    tifffile.imwrite(plain, rgb_image(), photometric="rgb", rowsperstrip=7)  # 40 rows: a last strip of 5
    with tifffile.TiffFile(plain) as tif:
        page, tag = tif.pages[0], tif.pages[0].tags["StripByteCounts"]
        width = {3: 2, 4: 4, 16: 8}[int(tag.dtype)]  # SHORT, LONG or LONG8
        where = tag.valueoffset + width * (len(page.databytecounts) - 1)
        counted, last_at = page.databytecounts[-1], page.dataoffsets[-1]
    assert last_at + counted == plain.stat().st_size  # the last strip ends the file
    data = bytearray(plain.read_bytes())
    data[where:where + width] = (counted * 7 // 5).to_bytes(width, "little")  # counted as a full strip of 7 rows
    plain.write_bytes(bytes(data))
    with tifffile.TiffFile(plain) as tif:
        assert tif.pages[0].databytecounts[-1] == counted * 7 // 5
    assert np.array_equal(train_unet.read_image(plain, 3), rgb_image())


def test_a_library_read_of_a_damaged_file_is_its_one_line_alone(tmp_path):
    """In a notebook, read_image on a cut BMP or a TIFF of garbage raised its one-line error after OpenCV's
    and tifffile's own log lines ('[ERROR:0@2.7] global loadsave.cpp ...'): only the script's main quieted
    them. A fresh process, as a notebook's kernel is."""
    import subprocess
    import sys

    bmp = cv2.imencode(".bmp", rgb_image())[1].tobytes()
    write(tmp_path / "cut.bmp", bmp[:100])
    write(tmp_path / "garbage.tif", b"II*\x00" + b"\xff" * 50)
    code = ("import sys, train_unet\nfor name in sys.argv[1:]:\n    try:\n        train_unet.read_image(name, 3)\n"
            "    except train_unet.UserError as exc:\n        print(exc)\n")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "cut.bmp"), str(tmp_path / "garbage.tif")],
                          capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.stdout.splitlines() == [f"cannot read image {tmp_path / name} (corrupt or not an image): fix or "
                                        f"remove it" for name in ("cut.bmp", "garbage.tif")]
    assert done.stderr == ""


def write(path, data):
    path.write_bytes(data)
    return path


@pytest.fixture
def fresh_checkpoint(tmp_path):
    """An untrained fit-mode model's checkpoint at 32 px: predict needs a model, not a good one."""
    cfg = train_unet.validate_config({"image_size": 32, "encoder_weights": None})
    path = tmp_path / "fresh.pt"
    train_unet.save_checkpoint(path, {"model": train_unet.build_model(cfg).state_dict(), "config": cfg})
    return path


@pytest.mark.parametrize("errors", ["strict", "surrogateescape"])  # a UTF-8 locale's stdout; the C locale's
def test_an_image_whose_name_is_not_utf8_is_read_predicted_and_named(fresh_checkpoint, tmp_path, errors):
    """A name of Latin-1 bytes (an old archive's): cv2.imread crashed the whole process on it (a segfault,
    no mask written); predict reads it, writes its mask, and names another such file that is damaged,
    also where stdout's encoding is strict, and as an escape of its byte (\\xe9, not Python's \\udce9) on
    stdout (in the C locale stdout wrote the raw byte; stderr had escapes). Run in a child process, where a
    crash cannot take pytest."""
    import subprocess
    import sys

    folder = tmp_path / "in"
    folder.mkdir()
    png = cv2.imencode(".png", rgb_image())[1].tobytes()
    write(Path(os.fsdecode(bytes(folder) + b"/caf\xe9.png")), png)
    write(Path(os.fsdecode(bytes(folder) + b"/cut\xe9.jpg")), cv2.imencode(".jpg", rgb_image())[1].tobytes()[:300])
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(ROOT / "train_unet.py"), "predict", f"checkpoint={fresh_checkpoint}",
                           f"input={folder}", f"output={out}", "progress=False", "cpu_probe=False", "use_amp=False"],
                          capture_output=True, env={**os.environ, "PYTHONIOENCODING": f"utf-8:{errors}"})
    assert proc.returncode == 1, proc.stderr[-2000:]  # one image failed: its name printed, no traceback
    assert sorted(os.listdir(bytes(out))) == [b"caf\xe9.png"]
    assert b"failed: cannot read image " in proc.stdout and b"cut\\xe9.jpg (a truncated JPEG" in proc.stdout
    assert b"Traceback" not in proc.stderr


def test_what_a_stream_cannot_encode_is_printed_as_its_bytes():
    """printable_file_names' handler: a byte no encoding decoded (Python's surrogate for it) as that byte, any
    other character as its UTF-8 bytes, so that a Latin-1 name and a UTF-8 one print apart; a lone surrogate of
    another kind does not stop the print."""
    train_unet.printable_file_names()
    latin1, utf8 = os.fsdecode(b"caf\xe9.png"), "café.png"
    assert latin1.encode("utf-8", train_unet.BYTE_ESCAPES) == b"caf\\xe9.png"
    assert latin1.encode("ascii", train_unet.BYTE_ESCAPES) == b"caf\\xe9.png"
    assert utf8.encode("ascii", train_unet.BYTE_ESCAPES) == b"caf\\xc3\\xa9.png"
    assert utf8.encode("utf-8", train_unet.BYTE_ESCAPES) == utf8.encode("utf-8")  # encodable: as it is
    assert "\ud800.png".encode("utf-8", train_unet.BYTE_ESCAPES) == b"\\xed\\xa0\\x80.png"


def test_damaged_files_get_predicts_line_alone(fresh_checkpoint, tmp_path, capfd):
    """A TIFF whose first image has no plane (its series' shape is ()) took predict down with a TypeError
    from the memory check; tifffile logged '<tifffile.TiffPages @8> invalid offset ...' and '... contains
    no pages', and OpenCV '[ERROR:0@5.9] global loadsave.cpp ... imread_(...): can't read header', beside
    the script's own line for each."""
    folder = tmp_path / "in"
    folder.mkdir()
    write(folder / "ok.png", cv2.imencode(".png", rgb_image())[1].tobytes())
    write(folder / "planeless.tif", b"II*\x00\x08\x00\x00\x00\x00\x00")
    write(folder / "empty.tif", b"")
    write(folder / "header.bmp", b"BM" + b"x" * 40)
    code = train_unet.main(["predict", f"checkpoint={fresh_checkpoint}", f"input={folder}", f"output={tmp_path / 'out'}",
                            "progress=False", "cpu_probe=False", "use_amp=False"])
    out, err = capfd.readouterr()
    assert code == 1 and sorted(os.listdir(tmp_path / "out")) == ["ok.png"], err[-2000:]
    failed = sorted(line.strip() for line in out.splitlines() if line.strip().startswith("failed:"))
    assert failed == [f"failed: cannot read image {folder / name} ({why}): fix or remove it" for name, why in
                      (("empty.tif", "an empty file"), ("header.bmp", "corrupt or not an image"),
                       ("planeless.tif", "corrupt or not an image"))]
    assert err == "", err


def test_the_split_record_of_a_name_that_is_not_utf8(tmp_path):
    """Training on such a name: the split's digest hashed the stems as UTF-8 and stopped the run."""
    image = write(Path(os.fsdecode(bytes(tmp_path) + b"/caf\xe9.png")), b"x")
    record = train_unet.split_record([(str(image), str(image))], [], tmp_path)
    assert record["train"] == 1 and len(record["digest"]) == 16


def test_wide_integer_pixels_need_a_range(tmp_path):
    """int32 pixels over the whole int32 range are one flat grey (0.5 +- 1e-6): without a range they are
    refused with the fix; with one they are scaled by it."""
    pixels = (np.random.default_rng(0).random((16, 16)) * 1000).astype(np.int32)
    tifffile.imwrite(tmp_path / "i.tif", pixels)
    one_line_error(train_unet.read_image, tmp_path / "i.tif", 1,
                   match=r"i.tif has int32 pixels \(\d+ to \d+\) and no intensity_range .*set intensity_range=low,high")
    np.testing.assert_allclose(train_unet.read_image(tmp_path / "i.tif", 1, [0, 1000]), pixels / 1000, atol=1e-6)


def test_a_wide_integer_image_no_range_maps_stops_the_run_at_start_up(make_cfg, data_dir, monkeypatch):
    """One flat int32 TIFF among PNGs (no range to learn) passed the data check and stopped the run only
    when the first epoch read it, after the banner."""
    png = sorted((data_dir / "images").glob("*.png"))[3]
    png.unlink()
    tifffile.imwrite(png.with_suffix(".tif"), np.full((64, 64), 5, np.int32))
    built, real = [], train_unet.build_loaders
    monkeypatch.setattr(train_unet, "build_loaders", lambda *a: built.append(1) or real(*a))
    with pytest.raises(UserError, match=r"image .*\.tif has int32 pixels \(5 to 5\) and no intensity_range") as info:
        train_unet.train(make_cfg())
    assert "\n" not in str(info.value) and not built  # at start-up, before any loader
    assert train_unet.train(make_cfg(intensity_range=[0, 10]))["history"]  # with a range it trains


def test_a_cmyk_tiff_is_read_as_its_rgb_colours(tmp_path):
    """tifffile returns a CMYK TIFF's four inks; K was dropped as if it were alpha and C, M, Y read as R, G,
    B (inverted colours). OpenCV converts it to RGB, as Pillow converts it back."""
    image = rgb_image()
    Image.fromarray(image).convert("CMYK").save(tmp_path / "c.tif")
    assert tifffile.TiffFile(tmp_path / "c.tif").pages[0].photometric == 5  # really CMYK (SEPARATED)
    expected = np.asarray(Image.open(tmp_path / "c.tif").convert("RGB"))
    assert np.array_equal(train_unet.read_image(tmp_path / "c.tif", 3), expected)
