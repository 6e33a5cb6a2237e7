"""unet_amp.images: readers per format family, mask values, the scaling rule, channels, normalisation."""
import cv2
import numpy as np
import pytest
import tifffile
from PIL import Image

from unet_amp.common import UserError
from unet_amp.images import (image_sketch, mask_to_classes, match_channels, normalize, prepare_image, robust_range,
                             read_image, read_mask, to_unit_range)


def test_png_rgb_rgba_grey_and_16bit(tmp_path):
    rgb = np.random.default_rng(0).integers(0, 256, (16, 20, 3), dtype=np.uint8)
    cv2.imwrite(str(tmp_path / "rgb.png"), rgb[..., ::-1])  # cv2 writes BGR
    assert np.array_equal(read_image(tmp_path / "rgb.png"), rgb)
    rgba = np.dstack([rgb, np.full((16, 20), 7, np.uint8)])
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    assert np.array_equal(read_image(tmp_path / "rgba.png"), rgba)
    grey16 = np.arange(16 * 16, dtype=np.uint16).reshape(16, 16) * 200
    cv2.imwrite(str(tmp_path / "g16.png"), grey16)
    out = read_image(tmp_path / "g16.png")
    assert out.shape == (16, 16, 1) and out.dtype == np.uint16 and np.array_equal(out[..., 0], grey16)


def test_jpeg_image_read_and_jpeg_mask_refused(tmp_path):
    cv2.imwrite(str(tmp_path / "a.jpg"), np.full((16, 16, 3), 128, np.uint8))
    assert read_image(tmp_path / "a.jpg").shape == (16, 16, 3)
    with pytest.raises(UserError, match="a.jpg"):
        read_mask(tmp_path / "a.jpg")


def test_unreadable_file_names_it(tmp_path):
    (tmp_path / "bad.png").write_bytes(b"not a png at all")
    (tmp_path / "bad.tif").write_bytes(b"II*\x00garbage")
    for name in ("bad.png", "bad.tif", "missing.png"):
        with pytest.raises(UserError, match=name):
            read_image(tmp_path / name)


def test_tiff_16bit_float_planar_and_pyramid(tmp_path):
    a16 = np.random.default_rng(1).integers(0, 4096, (16, 16, 3), dtype=np.uint16)
    tifffile.imwrite(tmp_path / "a.tif", a16, photometric="rgb")
    assert np.array_equal(read_image(tmp_path / "a.tif"), a16)
    tifffile.imwrite(tmp_path / "planar.tif", np.moveaxis(a16, -1, 0), photometric="rgb", planarconfig="separate")
    assert np.array_equal(read_image(tmp_path / "planar.tif"), a16)
    f32 = np.linspace(-1, 3, 256, dtype=np.float32).reshape(16, 16)
    tifffile.imwrite(tmp_path / "f.tiff", f32)
    assert np.array_equal(read_image(tmp_path / "f.tiff")[..., 0], f32)
    big = np.random.default_rng(2).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    with tifffile.TiffWriter(tmp_path / "pyr.tif", bigtiff=True) as tif:
        tif.write(big, subifds=1, photometric="rgb")
        tif.write(big[::2, ::2], subfiletype=1, photometric="rgb")
    assert np.array_equal(read_image(tmp_path / "pyr.tif"), big)  # the full-resolution level


def test_tiff_stack_refused(tmp_path):
    tifffile.imwrite(tmp_path / "stack.tif", np.zeros((6, 16, 16), np.uint8), photometric="minisblack")
    with pytest.raises(UserError, match="stack.tif"):
        read_image(tmp_path / "stack.tif")


def test_palette_png_mask_reads_indices_and_void(tmp_path):
    indices = np.zeros((16, 16), np.uint8)
    indices[4:8] = 1
    indices[8:12] = 2
    indices[12:] = 255  # VOC void
    image = Image.fromarray(indices, "P")
    image.putpalette([0, 0, 0, 128, 0, 0, 0, 128, 0] + [0] * (3 * 252) + [224, 224, 192])
    image.save(tmp_path / "voc.png")
    mask = read_mask(tmp_path / "voc.png")
    assert np.array_equal(mask, indices)
    classes = mask_to_classes(mask, 3, tmp_path / "voc.png")
    assert set(np.unique(classes)) == {0, 1, 2, 255}


def test_grey_rgb_mask_one_channel_colour_refused(tmp_path):
    m = np.zeros((16, 16), np.uint8)
    m[:8] = 255
    cv2.imwrite(str(tmp_path / "m.png"), np.dstack([m, m, m]))
    assert np.array_equal(read_mask(tmp_path / "m.png"), m)
    colour = np.dstack([m, np.zeros_like(m), m])
    cv2.imwrite(str(tmp_path / "c.png"), colour)
    with pytest.raises(UserError, match="c.png"):
        read_mask(tmp_path / "c.png")


def test_mask_to_classes_binary_and_multiclass():
    m = np.array([[0, 255], [255, 0]], np.uint8)
    assert np.array_equal(mask_to_classes(m, 1, "m"), [[0, 1], [1, 0]])
    assert np.array_equal(mask_to_classes(m // 255, 1, "m"), [[0, 1], [1, 0]])
    void = np.array([[0, 1], [255, 0]], np.uint8)
    assert np.array_equal(mask_to_classes(void, 1, "m"), void)  # 255 beside 1 is void
    with pytest.raises(UserError, match="m7.png"):
        mask_to_classes(np.array([[0, 7]], np.uint8), 1, "m7.png")
    assert np.array_equal(mask_to_classes(np.array([[0, 2, 255]], np.uint16), 3, "m"), [[0, 2, 255]])
    with pytest.raises(UserError, match="bad.png"):
        mask_to_classes(np.array([[0, 3]], np.uint8), 3, "bad.png")


def test_scaling_rule():
    u8 = np.array([[[0], [255]]], np.uint8)
    assert np.array_equal(to_unit_range(u8, None), [[[0.0], [1.0]]])
    u16 = np.array([[[0], [4095], [65535]]], np.uint16)
    assert np.allclose(to_unit_range(u16, [0, 4095]).ravel(), [0, 1, 1])  # clipped
    f = np.array([[[-2.0], [0.0], [2.0]]], np.float32)
    assert np.allclose(to_unit_range(f, [0, 4]).ravel(), [0, 0, 0.5])
    assert to_unit_range(f, None).dtype == np.float32 and np.allclose(to_unit_range(f, None).ravel(), [0, 0.5, 1])
    assert np.array_equal(to_unit_range(np.full((2, 2, 1), 3.0, np.float32), None), np.zeros((2, 2, 1)))
    with pytest.raises(UserError, match="intensity_range"):
        to_unit_range(u16, [10, 5])


def test_without_a_range_a_wide_image_uses_its_own_percentiles():
    image = np.random.default_rng(0).integers(100, 4000, (64, 64, 1)).astype(np.uint16)
    image[5, 5] = 65535        # a hot pixel: one of 4096, above the 99.9th percentile
    image[40:43, 40:43] = 9000  # a bright spot of 9 pixels, also above it
    unit = to_unit_range(image, None)
    lo, hi = np.percentile(image, [0.1, 99.9])
    around = (image[4:7, 4:7, 0].astype(np.float32) - lo) / (hi - lo)
    assert np.isclose(unit[5, 5, 0], np.median(around))  # the hot pixel takes its 3x3 median
    assert (unit[40:43, 40:43] == 1).all()  # a spot is not a defect: clipped
    assert unit.min() >= 0 and unit.max() == 1 and np.quantile(unit, 0.99) < 1
    assert np.array_equal(unit, to_unit_range(image.astype(np.float32), None))  # integer or float alike


def learn_intensity_range(paths):
    return robust_range(image_sketch(read_image(p)) for p in paths)


def test_learnt_range_ignores_fixed_hot_pixels(tmp_path):
    cv2.imwrite(str(tmp_path / "a.png"), np.full((16, 16), 200, np.uint8))
    assert learn_intensity_range([tmp_path / "a.png"]) is None  # 8-bit only: no range
    rng, paths = np.random.default_rng(1), []
    for i in range(4):  # 12-bit frames with the same two hot pixels each
        frame = rng.integers(50, 4000, (64, 64)).astype(np.uint16)
        frame[3, 7] = frame[40, 21] = 65535
        paths.append(tmp_path / f"f{i}.png")
        cv2.imwrite(str(paths[-1]), frame)
    lo, hi = learn_intensity_range([tmp_path / "a.png", *paths])
    assert 50 <= lo < 60 and 3990 < hi <= 4000
    flat = [tmp_path / "b.tif", tmp_path / "c.tif"]  # mostly one value: the min and max
    tifffile.imwrite(flat[0], np.full((16, 16), 100, np.uint16))
    tifffile.imwrite(flat[1], np.full((16, 16), 3000, np.uint16))
    assert learn_intensity_range(flat) == [100, 3000]


def test_same_values_as_uint16_png_and_float32_tiff_scale_alike(tmp_path):
    values = np.random.default_rng(2).integers(0, 300, (32, 32)).astype(np.uint16)  # a dim 12-bit frame
    cv2.imwrite(str(tmp_path / "v.png"), values)
    tifffile.imwrite(tmp_path / "v.tif", values.astype(np.float32))
    png, tif = read_image(tmp_path / "v.png"), read_image(tmp_path / "v.tif")
    assert png.dtype == np.uint16 and tif.dtype == np.float32
    for intensity_range in (None, [0, 4095]):
        cfg = {"in_channels": 3, "intensity_range": intensity_range}
        assert np.array_equal(prepare_image(png, cfg), prepare_image(tif, cfg))


def test_match_channels_and_normalize():
    grey = np.full((4, 4, 1), 0.5, np.float32)
    assert match_channels(grey, 3, "g").shape == (4, 4, 3)
    rgba = np.zeros((4, 4, 4), np.float32)
    assert match_channels(rgba, 3, "x").shape == (4, 4, 3)
    rgb = np.ones((4, 4, 3), np.float32)
    assert np.allclose(match_channels(rgb, 1, "x"), 1.0) and match_channels(rgb, 1, "x").shape == (4, 4, 1)
    with pytest.raises(UserError, match="five.tif"):
        match_channels(np.zeros((4, 4, 5), np.float32), 3, "five.tif")
    assert np.allclose(normalize(grey), 0.0)  # (0.5 - 0.5) / 0.25
    mean = np.array([0.485, 0.456, 0.406], np.float32)
    assert np.allclose(normalize(np.broadcast_to(mean, (2, 2, 3)).copy()), 0.0)


def test_prepare_image_uint8_and_16bit_grey():
    u8 = np.full((4, 4, 3), 255, np.uint8)
    out = prepare_image(u8, {"in_channels": 3, "intensity_range": None})
    assert out.dtype == np.float32 and np.allclose(out[0, 0], (1 - np.array([0.485, 0.456, 0.406])) /
                                                   np.array([0.229, 0.224, 0.225]))
    u16 = np.full((4, 4, 1), 4095, np.uint16)
    out = prepare_image(u16, {"in_channels": 1, "intensity_range": [0, 4095]})
    assert out.shape == (4, 4, 1) and np.allclose(out, 2.0)  # (1 - 0.5) / 0.25
