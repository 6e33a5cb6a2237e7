"""What a demanding user runs into: wrong types, unsafe outputs, inexact resumes, misleading hints."""
import contextlib
import errno
import io
import math
import os
import re
import shlex
import subprocess
import sys
import shutil
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import train_unet
from train_unet import UserError


def one_line_error(fn, *args, match):
    with pytest.raises(UserError, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


@pytest.mark.parametrize("key, value, words", [
    ("learning_rate", "2e-3", "learning_rate='2e-3' must be a number"),
    ("use_amp", "False", "use_amp='False' must be true or false"),
    ("seed", 1.5, "seed=1.5 must be a whole number"),
    ("batch_size", True, "batch_size=True must be a whole number"),
    ("init_scale", math.inf, "init_scale=inf must be a finite number"),
    ("data_dir", None, "data_dir=None must be a string"),
    ("max_train_images", 2.5, "max_train_images=2.5 must be a whole number or None"),
])
def test_config_values_of_the_wrong_type_are_one_line_errors(key, value, words):
    one_line_error(train_unet.validate_config, {key: value}, match=words.replace("(", r"\(").replace(")", r"\)"))


def test_batch_of_one_at_32px_is_refused_but_fine_at_64px():
    one_line_error(train_unet.validate_config, {"batch_size": 1, "image_size": 32}, match="batch_size >= 2")
    assert train_unet.validate_config({"batch_size": 1, "image_size": 64})["batch_size"] == 1


def test_duplicate_keys_and_help(capsys):
    one_line_error(train_unet.parse_overrides, ["--batch-size=2", "batch_size=3"], match="given twice")
    for argv in (["--help"], ["train", "--help"], ["epochs=1", "--help"]):  # the last two: "not key=value"
        assert train_unet.main(argv) == 0
        assert "batch_size" in capsys.readouterr().out


@pytest.mark.parametrize("argv, words", [
    (["epochs", "=", "2"], "'epochs' is a key, not a command: write epochs=2, with no spaces around ="),
    (["--epochs", "2"], "'--epochs' is a key, not a command: write epochs=2"),
    (["data_dir=x", "epochs", "=2"], "argument 'epochs' is not key=value, e.g. batch_size=2: write epochs=2"),
    (["predict", "checkpoint=x", "--input", "y"], "argument '--input' is not key=value, e.g. batch_size=2: write "
                                                  "input=y"),
    (["epochs=1", "data_dir=d/my", "data"],
     'a value with a space is one argument in quotes, e.g. "data_dir=d/my data"'),
    # a switch given alone: 'write overlay=use_amp=False', 'a value with a space ... "output=o overlay"'
    (["predict", "checkpoint=x", "--overlay", "use_amp=False"], "write overlay=True (every key takes a value"),
    (["predict", "checkpoint=x", "output=o", "overlay"], "write overlay=True (every key takes a value"),
    (["--resume", "epochs=3"], "write resume=True (every key takes a value"),
    (["predict", "checkpoint=x", "--overlay", "--progress"], "write overlay=True (every key takes a value"),
])
def test_a_key_and_its_value_written_apart_get_the_fix(argv, words, capsys):
    """'epochs = 2' said 'unknown command', '--epochs 2' too (though --batch-size=2 is taken), and an unquoted
    path with a space named its second half only."""
    assert train_unet.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert words in err and "\n" not in err


def test_embedded_data_is_never_mixed_into_a_users_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    root = Path(train_unet.EMBEDDED_DATA_DIR)
    train_unet.generate_shapes_dataset(tmp_path / "src", count=6, size=32)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i, src in enumerate(sorted((tmp_path / "src" / "images").iterdir())):
        (root / "images" / f"mine{i}.PNG").write_bytes(src.read_bytes())
        (root / "masks" / f"mine{i}.png").write_bytes((tmp_path / "src" / "masks" / src.name).read_bytes())
    cfg = train_unet.validate_config({"image_size": 32, "batch_size": 2})
    train, val = train_unet.prepare_data(cfg)
    assert len(train) + len(val) == 6 and len(list((root / "images").iterdir())) == 6


def test_checkpoint_dir_that_is_a_file_stops_before_training(make_cfg, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    one_line_error(train_unet.train, make_cfg(checkpoint_dir=str(afile)), match="is a file, not a folder")


def test_train_folder_without_val_folder_is_named(make_data, make_cfg):
    root = make_data("split", count=6, size=32)
    (root / "images").rename(root / "imgs")
    (root / "train").mkdir()
    (root / "imgs").rename(root / "train" / "images")
    (root / "masks").rename(root / "train" / "masks")
    one_line_error(train_unet.prepare_data, make_cfg(data_dir=str(root)), match="has train/ but no val/")


def test_pairs_beside_train_and_val_are_named_as_not_read(make_data, make_cfg, capsys):
    """train/ and val/ are the split: images/ and masks/ beside them were left out without a word."""
    root = make_data("split", count=8, size=32)
    for part, names in (("train", range(0, 4)), ("val", range(4, 6))):
        for sub in ("images", "masks"):
            (root / part / sub).mkdir(parents=True)
            for i in names:
                (root / sub / f"shape_{i:04d}.png").rename(root / part / sub / f"shape_{i:04d}.png")
    # a second file of one stem there would stop a run that read the folder: this run does not read it
    shutil.copy(root / "images" / "shape_0006.png", root / "images" / "shape_0006.jpg")
    train, val = train_unet.prepare_data(make_cfg(data_dir=str(root), batch_size=2))
    assert (len(train), len(val)) == (4, 2)
    out = capsys.readouterr().out
    assert f"note: {root} has train/ and val/, so the 3 file(s) in images/ and 2 file(s) in masks/ beside them " \
           f"are not read: move those pairs into train/ or val/" in out


@pytest.mark.parametrize("sub", ["images", "masks"])
def test_a_folder_named_like_an_image_or_mask_is_named_as_one(make_data, make_cfg, sub):
    """masks/shape_0002.png as a folder (the file inside it) read '1 image(s) ... have no mask'."""
    root = make_data(f"folder_{sub}", count=6, size=32)
    target = root / sub / "shape_0002.png"
    target.rename(root / "moved.png")
    target.mkdir()
    (root / "moved.png").rename(target / "shape_0002.png")
    kind = "a mask" if sub == "masks" else "an image"
    one_line_error(train_unet.prepare_data, make_cfg(data_dir=str(root)),
                   match=rf"^{target} is a folder, not {kind}: shape_0002.png's partner must be a file; move it out "
                         rf"of that folder$")


def test_a_masks_file_in_place_of_the_folder_is_named_so(make_data, make_cfg):
    """masks as a file (an archive not unpacked) read '.../masks not found', which it was not."""
    root = make_data("masks_file", count=6, size=32)
    shutil.rmtree(root / "masks")
    (root / "masks").write_bytes(b"PK\x03\x04")
    one_line_error(train_unet.prepare_data, make_cfg(data_dir=str(root)),
                   match=rf"^{root / 'masks'} is a file, not a folder: put images in {root}/images and masks")


@pytest.mark.parametrize("inside", ["", "train"])
def test_data_dir_given_as_the_images_folder_names_the_folder_above(make_data, make_cfg, inside):
    root = make_data("mine", count=6, size=32)
    if inside:  # data_dir=<root>/train/images, with val/ beside train/
        for part in ("train", "val"):
            shutil.copytree(root / "images", root / part / "images")
            shutil.copytree(root / "masks", root / part / "masks")
    images = root / inside / "images"
    one_line_error(train_unet.prepare_data, make_cfg(data_dir=str(images)),
                   match=f"{images} holds the images themselves: give the folder that holds images/ and masks/"
                         f"{' [(]in train/ and val/[)]' if inside else ''}, data_dir={root}$")


def test_class_masks_in_jpeg_compressed_tiffs_are_refused_as_jpegs(make_data, make_cfg, tmp_path):
    """A TIFF mask saved with JPEG compression has JPEG's edge noise: it read 'holds class 3 but num_classes=3: set
    num_classes=4'; a losslessly compressed TIFF (zlib) is read as ever. Binary masks: the hint names it too."""
    import tifffile

    root = make_data("jpeg_tiff", count=8, size=64, num_classes=3)
    for mask in sorted((root / "masks").iterdir()):
        tifffile.imwrite(mask.with_suffix(".tif"), cv2.imread(str(mask), cv2.IMREAD_UNCHANGED), compression="jpeg")
        mask.unlink()
    for classes in (3,):
        cfg = make_cfg(data_dir=str(root), num_classes=classes, batch_size=2)
        message = one_line_error(train_unet.prepare_data, cfg,
                                 match=r"mask .*\.tif is a JPEG-compressed TIFF: lossy compression can change class "
                                       r"indices along every edge")
        assert message.endswith("save masks as PNG") and "num_classes=" not in message
    lossless = tmp_path / "lossless.tif"
    tifffile.imwrite(lossless, np.array([[0, 1], [2, 0]], np.uint8), compression="zlib")
    assert train_unet.lossy_format(lossless) is None
    train_unet.check_mask_values(lossless, {0, 1, 2}, 3, "uint8")
    one_line_error(train_unet.check_mask_values, sorted((root / "masks").iterdir())[0], {0, 1, 2, 255}, 1, "uint8",
                   match=r"with num_classes=1 masks must be 0/1 or 0/255; it is a JPEG-compressed TIFF, whose "
                         r"compression blurs the edges: save masks as PNG")


def test_a_jpeg_tiff_mask_whose_noise_stays_within_the_classes_is_refused_and_a_maybe_lossy_codec_noted(
        make_data, make_cfg, capsys):
    """A JPEG-compressed TIFF mask was looked into only where its values were wrong: blocks of one class
    aligned to JPEG's 8 px grid (or noise that stays within num_classes) read as valid classes, and trained.
    A codec lossy or lossless by its settings (JPEG 2000) gets a note, as the file cannot tell which."""
    import tifffile

    root = make_data("jpeg_grid", count=6, size=64, num_classes=3)
    mask = np.zeros((64, 64), np.uint8)
    mask[8:32, 16:40], mask[40:56, 8:48] = 1, 2  # on the 8 px grid: quality 100 keeps every value
    masks = sorted((root / "masks").iterdir())
    for i, path in enumerate(masks):
        tifffile.imwrite(path.with_suffix(".tif"), mask, compression="jpeg2000" if i else "jpeg",
                         compressionargs={} if i else {"level": 100})
        path.unlink()
    assert np.array_equal(tifffile.imread(masks[0].with_suffix(".tif")), mask)  # exact: the values cannot tell
    cfg = make_cfg(data_dir=str(root), num_classes=3, batch_size=2)
    one_line_error(train_unet.prepare_data, cfg,
                   match=rf"mask .*{masks[0].stem}\.tif is a JPEG-compressed TIFF: lossy compression can change class "
                         r"indices along every edge, and its values \(\[0, 1, 2\]\) cannot show which pixels kept "
                         r"theirs: save masks as PNG$")
    tifffile.imwrite(masks[0].with_suffix(".tif"), mask, compression="zlib")
    train_unet.prepare_data(cfg)
    notes = [line for line in capsys.readouterr().out.splitlines() if "lossy" in line]
    assert notes == [f"note: 5 mask(s) are TIFFs compressed with a codec that can be lossy (e.g. {masks[1].stem}.tif: "
                     f"JPEG 2000): saved lossy, their class indices change along every edge; unless they were saved "
                     f"lossless, save masks as PNG"]


@pytest.mark.parametrize("levels, num_classes", [((0, 100, 200), 3), ((0, 128, 255), 3), ((0, 85, 170, 255), 4),
                                                  ((0, 100, 200), 1), ((0, 128), 1)])
def test_classes_saved_as_evenly_spaced_greys_get_that_fix_not_num_classes_201(make_data, make_cfg, levels,
                                                                                  num_classes):
    """Class indices 0/1/2 exported for viewing as 0/100/200: 'holds class 200 ... set num_classes=201 if it is a
    class', which trained to IoU 0 over 201 classes; a binary 0/128 mask: 'anti-aliased edges?'."""
    root = make_data("greys", count=6, size=32, num_classes=len(levels) if len(levels) > 2 else 1)
    for path in sorted((root / "masks").iterdir()):
        mask = cv2.imread(str(path), cv2.IMREAD_GRAYSCALE)
        spread = np.zeros_like(mask)
        for i, level in enumerate(levels):
            spread[mask == (255 if len(levels) == 2 and i else i)] = level
        cv2.imwrite(str(path), spread)
    n = len(levels)
    fix = (rf"look like {n} classes saved as evenly spaced greys: save class i as value i \(0..{n - 1}\) and set "
           rf"num_classes={n}" if n > 2 else  # binary (0/65535 in 16-bit files): num_classes=2 came first
           rf"look like binary masks with their foreground saved as {levels[1]}: save it as 1 \(or 255\) with "
           rf"num_classes=1")
    err = one_line_error(train_unet.prepare_data, make_cfg(data_dir=str(root), num_classes=num_classes, batch_size=2),
                         match=rf"the masks' values \[{', '.join(map(str, levels))}\] {fix}")
    assert "num_classes=2" not in err.replace(f"num_classes={n}", "")
    assert "num_classes=201" not in err and "anti-aliased" not in err


def test_a_class_saved_as_a_grey_beside_void_is_not_taken_for_a_binary_mask(tmp_path):
    """{0, 100, 255}: class 1 saved as 100 beside void. Told 'binary: save it as 1 (or 255) with num_classes=1',
    the user would have made the void pixels foreground, or masks num_classes=1 refuses."""
    one_line_error(train_unet.check_mask_values, tmp_path / "m.png", {0, 100, 255}, 2, "uint8",
                   match=r"the masks' values \[0, 100\] \(and 255, void\) look like 2 classes saved as evenly spaced "
                         r"greys: save class i as value i \(0..1\) and set num_classes=2$")


def test_masks_of_both_binary_conventions_with_classes_get_a_note(make_data, make_cfg, capsys):
    """num_classes=2 with half the masks 0/1 and half 0/255: the 0/255 ones have no foreground (255 is
    void); the run goes on (void-only masks can be meant), and the note says how to fix it if not."""
    root = make_data("mixed", count=8, size=32)
    for mask in sorted((root / "masks").iterdir())[:4]:
        cv2.imwrite(str(mask), (cv2.imread(str(mask), cv2.IMREAD_UNCHANGED) > 0).astype(np.uint8))
    train_unet.prepare_data(make_cfg(data_dir=str(root), num_classes=2, batch_size=2))
    notes = [line for line in capsys.readouterr().out.splitlines() if "hold only 0 and 255" in line]
    assert len(notes) == 1 and re.fullmatch(
        r"note: 4 of 8 mask\(s\) hold only 0 and 255 \(e.g. shape_000[4-7].png\) while others hold class\(es\) "
        r"\[1\]: with num_classes=2 255 is void, so their foreground is ignored; if 255 is their foreground, save "
        r"them with its class index \(binary: num_classes=1, the masks 0/1 or 0/255\)", notes[0])
    train_unet.prepare_data(make_cfg(data_dir=str(root), num_classes=1, batch_size=2))  # binary: both read as 0/1
    assert "hold only 0 and 255" not in capsys.readouterr().out
    # a mask that is all 255 (all void) was said to hold 0s
    masks = sorted((root / "masks").iterdir())
    for mask in masks[4:]:
        cv2.imwrite(str(mask), np.full((32, 32), 255, np.uint8))
    train_unet.prepare_data(make_cfg(data_dir=str(root), num_classes=2, batch_size=2))
    notes = [line for line in capsys.readouterr().out.splitlines() if "mask(s) hold only" in line]
    assert notes == [f"note: 4 of 8 mask(s) hold only 255 (e.g. {masks[4].name}) while others hold class(es) [1]: "
                     f"with num_classes=2 255 is void, so those images are ignored whole; if 255 is their foreground, "
                     f"save them with its class index (binary: num_classes=1, the masks 0/1 or 0/255)"]
    cv2.imwrite(str(masks[4]), (cv2.imread(str(masks[0]), cv2.IMREAD_UNCHANGED) * 255).astype(np.uint8))
    train_unet.prepare_data(make_cfg(data_dir=str(root), num_classes=2, batch_size=2))
    assert "4 of 8 mask(s) hold only 0 and 255, or only 255 (e.g." in capsys.readouterr().out


def test_negatives_with_a_void_border_beside_classes_with_one_get_no_binary_note(make_data, make_cfg, capsys):
    """Masks with classes 1..2 and a void (255) border, and some background-only ones with the same border: 'hold
    only 0 and 255 ... their foreground is ignored', though they have none: negatives, void used as void."""
    root = make_data("negatives", count=8, size=32, num_classes=3)
    for i, mask in enumerate(sorted((root / "masks").iterdir())):
        values = cv2.imread(str(mask), cv2.IMREAD_UNCHANGED)
        values = np.zeros_like(values) if i % 4 == 0 else values
        values[:2], values[-2:] = 255, 255  # the void border every mask has
        cv2.imwrite(str(mask), values)
    train_unet.prepare_data(make_cfg(data_dir=str(root), num_classes=3, batch_size=2))
    assert "mask(s) hold only" not in capsys.readouterr().out
    cv2.imwrite(str(sorted((root / "masks").iterdir())[1]), np.full((32, 32), 255, np.uint8))  # all void: noted
    train_unet.prepare_data(make_cfg(data_dir=str(root), num_classes=3, batch_size=2))
    assert "1 of 8 mask(s) hold only 255" in capsys.readouterr().out


def test_class_masks_saved_as_jpeg_are_refused_whatever_their_values(make_data, make_cfg):
    """JPEG's edge noise in 0/1 class masks read 'holds class 2 ...: set num_classes=3', which then trained on
    that noise as a class; noise within num_classes trained silently."""
    root = make_data("jpeg", count=12, size=32, num_classes=3)
    for mask in sorted((root / "masks").iterdir()):
        cv2.imwrite(str(mask.with_suffix(".jpg")), cv2.imread(str(mask), cv2.IMREAD_UNCHANGED), [cv2.IMWRITE_JPEG_QUALITY, 90])
        mask.unlink()
    for classes in (3, 254):  # 254: nearly every value JPEG can make is a class index
        message = one_line_error(train_unet.prepare_data, make_cfg(data_dir=str(root), num_classes=classes, batch_size=2),
                                 match=r"mask .*\.jpg is a JPEG: lossy compression can change class indices along "
                                       r"every edge, and its values \(\[0, 1, 2")
        assert message.endswith("cannot show which pixels kept theirs: save masks as PNG")
        assert "num_classes=" not in message
    # by its bytes: a JPEG named .png is one (its values wrong: the old advice was num_classes=N), a PNG named
    # .jpg is not (review)
    first = sorted((root / "masks").iterdir())[0]
    first.rename(first.with_suffix(".png"))
    one_line_error(train_unet.check_mask_values, first.with_suffix(".png"), {0, 1, 2, 3}, 3, "uint8",
                   match=r"\.png is a JPEG: lossy compression")
    lossless = root / "lossless.jpg"
    cv2.imwrite(str(root / "lossless.png"), np.zeros((4, 4), np.uint8))
    (root / "lossless.png").rename(lossless)
    train_unet.check_mask_values(lossless, {0, 1, 2}, 3, "uint8")


def test_a_class_mask_that_is_a_jpeg_named_png_is_refused_even_where_its_values_are_classes(make_data, make_cfg):
    """A JPEG class mask named .png whose noise stayed within num_classes trained silently (37 edge pixels of a
    class-2 square read as class 1): the data check looked at the bytes only where the values were wrong. Its
    facts now hold the format its bytes say (CHECK_CACHE_VERSION 13), and read_mask looks at them too."""
    root = make_data("jpeg_png", count=8, size=64, num_classes=3)
    square = np.zeros((64, 64), np.uint8)
    square[10:40, 10:40] = 2
    mask = sorted((root / "masks").iterdir())[2]
    mask.write_bytes(cv2.imencode(".jpg", square)[1].tobytes())
    assert set(np.unique(cv2.imread(str(mask), cv2.IMREAD_UNCHANGED))) <= {0, 1, 2}  # within the classes
    for read in (train_unet.prepare_data, lambda cfg: train_unet.read_mask(mask, cfg["num_classes"])):
        one_line_error(read, make_cfg(data_dir=str(root), num_classes=3, batch_size=2),
                       match=rf"mask .*{mask.name} is a JPEG: lossy compression can change class indices along "
                             r"every edge, and its values \(\[0, 1, 2\]\) cannot show which pixels kept theirs")
    binary = make_data("jpeg_binary", count=8, size=64)  # exact 0/255 in a JPEG: taken by its values, as by name
    first = sorted((binary / "masks").iterdir())[0]
    block = np.zeros((64, 64), np.uint8)
    block[8:32, 16:40] = 255  # on JPEG's 8 px grid, quality 100: every value kept
    first.write_bytes(cv2.imencode(".jpg", block, [cv2.IMWRITE_JPEG_QUALITY, 100])[1].tobytes())
    assert set(np.unique(cv2.imread(str(first), cv2.IMREAD_UNCHANGED))) == {0, 255}
    train_unet.prepare_data(make_cfg(data_dir=str(binary), batch_size=2))
    assert np.array_equal(train_unet.read_mask(first, 1), block == 255)  # read_mask's rule is the data check's


def test_one_odd_mask_in_a_binary_set_is_named_as_the_fix_not_num_classes(make_data, make_cfg, capsys):
    """Eleven 0/255 masks and one 0/2: the error advised num_classes=3, which made 255 void in the eleven
    (their foreground ignored) without a word, and the absent-class note then advised num_classes=3 again."""
    root = make_data("odd", count=12, size=32)
    odd = sorted((root / "masks").iterdir())[3]
    cv2.imwrite(str(odd), (cv2.imread(str(odd), cv2.IMREAD_UNCHANGED) > 0).astype(np.uint8) * 2)
    message = one_line_error(train_unet.prepare_data, make_cfg(data_dir=str(root), batch_size=2),
                             match=f"mask .*{odd.name} holds values \\[0, 2\\]")
    assert "the other masks are binary (11 of 12 hold only 0/255): fix this one" in message
    assert "num_classes=3" not in message
    train_unet.prepare_data(make_cfg(data_dir=str(root), num_classes=3, batch_size=2))
    out = capsys.readouterr().out
    assert "11 of 12 mask(s) hold only 0 and 255" in out and "their foreground is ignored" in out
    assert "num_classes=3 fits them" not in out and "class(es) 1 of num_classes=3 appear in no mask" in out


def test_mask_hints_point_to_the_right_fix(tmp_path, make_cfg, data_dir):
    # One 0/255 mask is legal with num_classes > 1 (255 = void), but a whole set of them is a binary set.
    message = one_line_error(train_unet.prepare_data, make_cfg(num_classes=2),
                             match="for binary 0/255 masks use num_classes=1")
    assert "num_classes=256" not in message
    path = tmp_path / "m.png"
    cv2.imwrite(str(path), np.array([[0, 1], [2, 0]], np.uint8))
    one_line_error(train_unet.read_mask, path, 1, match="set num_classes=3")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("trained")
    data = train_unet.generate_shapes_dataset(tmp / "data", count=8, size=32)
    cfg = train_unet.validate_config({"data_dir": str(data), "image_size": 32, "batch_size": 2, "epochs": 1,
                                      "progress": False, "use_amp": False,
                                      "checkpoint_dir": str(tmp / "ckpt")})
    train_unet.train(cfg)
    return cfg, data


def test_a_resume_refusal_names_every_key_to_give_data_dir_included_with_values_to_copy(trained, tmp_path):
    """A run trained with data_dir=... image_size=32 batch_size=2, resumed with resume=True alone: the refusal named
    image_size and batch_size; given those, a second refusal named data_dir. Now one names all three, as
    key=value to copy; a data_dir given (a data set moved or copied) is still judged by its files."""
    cfg, data = trained
    run = tmp_path / "run"
    shutil.copytree(cfg["checkpoint_dir"], run)
    args = ["resume=True", f"checkpoint_dir={run}", "device=cpu", "progress=False", "epochs=2"]
    given = train_unet.parse_overrides(args)
    err = one_line_error(train_unet.train_main, given, train_unet.explicit_keys(args),
                         match=r"cannot resume exactly: .*last.pt was trained with .*image_size=32.*batch_size=2.*data_dir="
                               r".*: resume with the same values \(")
    copied = err.split("resume with the same values (")[1].split("), or start")[0]
    assert f"data_dir={data}" in copied.split() and "image_size=32" in copied.split()
    again = args + copied.split()
    state = train_unet.train_main(train_unet.parse_overrides(again), train_unet.explicit_keys(again))
    assert state is not None


def test_resume_where_a_new_run_moved_the_last_one_aside_says_where_it_went(trained, tmp_path):
    """A new run started in a run's folder (its files moved to previous/<time>/), stopped before its first
    epoch wrote last.pt: resume=True said only 'last.pt does not exist'."""
    cfg, _ = trained
    run = tmp_path / "run"
    shutil.copytree(cfg["checkpoint_dir"], run)
    moved = train_unet.archive_previous_run(run)
    one_line_error(train_unet.train, {**cfg, "checkpoint_dir": str(run), "resume": True, "epochs": 2},
                   match=rf"last.pt does not exist: start without resume, or set checkpoint_dir to the run you want "
                         rf"to continue; the run before moved to {re.escape(str(moved))}/ when a new run started "
                         rf"there: move its files back to resume it$")


def test_resume_refuses_changed_optimisation_settings_and_finished_runs(trained):
    cfg, _ = trained
    one_line_error(train_unet.train, {**cfg, "resume": True, "epochs": 2, "learning_rate": 1e-5},
                   match="trained with learning_rate=0.002; this run has learning_rate=1e-05")
    # every changed key in one refusal (forgetting preset=debug used to take a round per key)
    one_line_error(train_unet.train, {**cfg, "resume": True, "epochs": 2, "batch_size": 4, "seed": 7},
                   match="trained with batch_size=2, seed=42; this run has batch_size=4, seed=7: resume with the same")


@pytest.mark.parametrize("damage", ["truncated", "empty"])
def test_a_damaged_last_pt_on_resume_says_how_to_go_on(trained, tmp_path, damage):
    """A last.pt cut short said 'give a best.pt or last.pt as training wrote it': resume takes no file, and a
    best.pt cannot be resumed."""
    cfg, _ = trained
    ckpt = tmp_path / "ckpt"
    shutil.copytree(cfg["checkpoint_dir"], ckpt)
    data = (ckpt / "last.pt").read_bytes()
    (ckpt / "last.pt").write_bytes(data[:len(data) // 2] if damage == "truncated" else b"")
    one_line_error(train_unet.train, {**cfg, "checkpoint_dir": str(ckpt), "resume": True, "epochs": 2},
                   match=f"last.pt is not a readable checkpoint of this trainer, or was cut short in a copy: restore "
                         f"it from a copy to resume, or train without resume=True \\(a new run moves it to "
                         f"{re.escape(str(ckpt / 'previous'))}/\\)")


def test_a_resume_without_the_runs_preset_names_the_preset(make_data, make_cfg):
    cfg = make_cfg(data_dir=str(make_data(count=8, size=32)), image_size=32, preset="debug", epochs=1)
    train_unet.train(cfg)
    err = one_line_error(train_unet.train, {**cfg, "preset": None, "resume": True, "epochs": 2},
                         match="cannot resume exactly: .* was trained with .*max_train_images=8")
    assert "(it ran with preset=debug: give preset=debug again)" in err
    one_line_error(train_unet.train, {**cfg, "resume": True}, match="already trained 1 epoch.*raise epochs")


def test_a_resume_with_no_epochs_left_suggests_the_runs_own_plan_where_it_stopped_early(tmp_path):
    """A run planned for 4 epochs, stopped after 2, resumed with epochs=2: the refusal suggested epochs=7, an
    extension the user never planned, instead of the 4 that finish its schedule."""
    path = tmp_path / "last.pt"
    stopped = {"epoch": 2, "config": {"epochs": 4}}
    for epochs in (1, 2):
        with pytest.raises(train_unet.UserError) as info:
            train_unet.refuse_no_epochs_left(stopped, {"epochs": epochs}, path)
        assert str(info.value) == (f"{path} has already trained 2 epoch(s) and epochs={epochs}: give epochs=4 to "
                                   f"finish its schedule (it stopped after 2 of 4)")
    train_unet.refuse_no_epochs_left(stopped, {"epochs": 3}, path)  # epochs left: no refusal
    finished = {"epoch": 4, "config": {"epochs": 4}}
    with pytest.raises(train_unet.UserError, match=r"trained 4 epoch\(s\) and epochs=4: raise epochs to continue, "
                                                   r"e\.g\. epochs=9$"):
        train_unet.refuse_no_epochs_left(finished, {"epochs": 4}, path)


def test_a_resume_with_a_preset_the_run_had_not_names_the_preset(make_data, make_cfg):
    """The other way round: the refusal named max_train_images=8, which the user never typed (user report)."""
    cfg = make_cfg(data_dir=str(make_data(count=8, size=32)), image_size=32, epochs=1)
    train_unet.train(cfg)
    err = one_line_error(train_unet.train, {**cfg, "preset": "debug", "resume": True, "epochs": 2},
                         match="cannot resume exactly: .* was trained with .*max_train_images=None")
    assert "(set by preset=debug: leave it out)" in err
    typed = {**cfg, "preset": "debug", "max_train_images": 8, "resume": True, "epochs": 2}
    err = one_line_error(train_unet.train, typed,
                         match="cannot resume exactly: .* max_train_images=None")
    assert "set by preset" not in err  # typed, not the preset's (review)


def test_predict_never_overwrites_inputs_and_validates_its_options(trained, tmp_path):
    cfg, data = trained
    ckpt = Path(cfg["checkpoint_dir"]) / "best.pt"
    images = data / "images"
    before = {p.name: p.read_bytes() for p in images.iterdir()}
    opts = {"checkpoint": str(ckpt), "input": str(images), "progress": False}
    one_line_error(train_unet.predict, {**opts, "output": str(images)}, match="holds the input images")
    assert {p.name: p.read_bytes() for p in images.iterdir()} == before
    linked = tmp_path / "linked"  # another folder, whose a mask's name is a link to an input
    linked.mkdir()
    (linked / f"{src_stem(images)}.png").symlink_to(next(iter(sorted(images.iterdir()))))
    one_line_error(train_unet.predict, {**opts, "output": str(linked)}, match="would overwrite the input")
    assert {p.name: p.read_bytes() for p in images.iterdir()} == before
    twin = tmp_path / "twin"
    twin.mkdir()
    src = next(images.iterdir())
    (twin / "a.png").write_bytes(src.read_bytes())
    (twin / "a.jpg").write_bytes(cv2.imencode(".jpg", cv2.imread(str(src)))[1].tobytes())
    one_line_error(train_unet.predict, {**opts, "input": str(twin), "output": str(tmp_path / "o")},
                   match=r"inputs a.jpg and a.png would both write .*a.png: rename one$")
    for stem in "bc":  # every clash counted: each run named one (user test)
        shutil.copy(twin / "a.png", twin / f"{stem}.png")
        shutil.copy(twin / "a.png", twin / f"{stem}.bmp")
    one_line_error(train_unet.predict, {**opts, "input": str(twin), "output": str(tmp_path / "o")},
                   match=r"inputs a.jpg and a.png would both write .*a.png: rename one \(2 more such pair\(s\): "
                         r"b.bmp/b.png, c.bmp/c.png\)$")
    one_line_error(train_unet.predict, {**opts, "output": str(tmp_path / "o"), "batch_size": 0},
                   match="batch_size=0 must be")
    one_line_error(train_unet.predict, {**opts, "output": str(tmp_path / "o"), "amp_dtype": "fp8"},
                   match="amp_dtype='fp8' is not allowed")


def src_stem(images):
    return sorted(images.iterdir())[0].stem


def test_predict_writes_no_mask_among_the_input_images(trained, tmp_path):
    """A single image's own folder as output: its mask would replace another image of the same stem
    (photos/cat.png for photos/cat.jpg) and be read as an image next time; refused, nothing changed."""
    cfg, data = trained
    photos = tmp_path / "photos"
    photos.mkdir()
    src = sorted((data / "images").iterdir())[0]
    cv2.imwrite(str(photos / "cat.jpg"), cv2.imread(str(src)))
    (photos / "cat.png").write_bytes(src.read_bytes())
    before = {p.name: p.read_bytes() for p in photos.iterdir()}
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "progress": False}
    one_line_error(train_unet.predict, {**opts, "input": str(photos / "cat.jpg"), "output": str(photos)},
                   match=f"output={photos} holds the input images")
    assert {p.name: p.read_bytes() for p in photos.iterdir()} == before


def test_predict_writes_no_mask_among_links_to_images_kept_elsewhere(trained, tmp_path):
    """A folder of links to images stored in another folder, given as input and as output: the masks would
    stand among the links (and be read as images next time); refused as for the images themselves."""
    cfg, data = trained
    links = tmp_path / "links"
    links.mkdir()
    for src in sorted((data / "images").iterdir())[:2]:
        (links / f"{src.stem}.jpg").symlink_to(src)  # other names than their targets': nothing overwritten
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "progress": False}
    one_line_error(train_unet.predict, {**opts, "input": str(links), "output": str(links)},
                   match=f"output={links} holds the input images")
    assert sorted(p.name for p in links.iterdir()) == sorted(f"{p.stem}.jpg" for p in sorted(
        (data / "images").iterdir())[:2])


@pytest.mark.parametrize("overlay", [True, False])
def test_an_overlay_and_a_mask_of_one_name_are_refused(trained, tmp_path, overlay):
    """With overlay, a.png's a_overlay.png and the mask of an input named a_overlay.png are one file."""
    cfg, data = trained
    inp = tmp_path / "in"
    inp.mkdir()
    src = sorted((data / "images").iterdir())[0]
    for name in ("a.png", "a_overlay.png"):
        (inp / name).write_bytes(src.read_bytes())
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(inp),
            "output": str(tmp_path / "out"), "overlay": overlay, "progress": False}
    if overlay:
        one_line_error(train_unet.predict, opts, match="inputs a.png and a_overlay.png would both write .*a_overlay.png")
        assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    else:
        assert train_unet.predict(opts)["predicted"] == 2


@pytest.mark.parametrize("key", ["input", "output", "checkpoint"])
def test_an_empty_path_is_refused_not_taken_as_the_current_folder(trained, key, tmp_path):
    cfg, data = trained
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(data / "images"),
            "output": str(tmp_path / "out"), "progress": False, key: " "}
    one_line_error(train_unet.predict, opts, match=f"{key}= is empty: give a path")


def test_a_checkpoint_whose_weights_do_not_fit_its_config_names_what_differs(trained, tmp_path):
    cfg, data = trained
    state = train_unet.load_checkpoint(Path(cfg["checkpoint_dir"]) / "best.pt")
    edited = tmp_path / "edited.pt"
    torch.save({**state, "config": {**state["config"], "num_classes": 3}}, edited)
    message = one_line_error(train_unet.predict, {"checkpoint": str(edited), "input": str(data / "images"),
                                                  "output": str(tmp_path / "out"), "progress": False},
                             match="does not match the model its config describes")
    assert re.search(r"\(segmentation_head\.0\.weight is \[1, 16, 3, 3\] in the checkpoint, \[3, 16, 3, 3\] in the "
                     r"model\): it was changed after training; use the checkpoint as training wrote it$", message), message


def test_a_state_dicts_complaint_is_shortened_whole_not_cut_mid_text():
    """'...the shape in current model is torch.Size([1,): it was changed...': cut at 160 characters."""
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 5, 1))
    state = {f"extra{i}.weight": torch.zeros(1) for i in range(4)}
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict({**model.state_dict(), **state})
    assert train_unet.state_dict_mismatch(info.value) == "unexpected weights: extra0.weight, extra1.weight and 2 more"
    with pytest.raises(RuntimeError) as info:
        model.load_state_dict({k: v for k, v in model.state_dict().items() if k != "1.bias"})
    assert train_unet.state_dict_mismatch(info.value) == "missing weights: 1.bias"


@pytest.mark.parametrize("epochs_done", [0, 1])
def test_an_interrupted_training_says_whether_resume_can_continue(epochs_done, monkeypatch, capsys, tmp_path):
    """Stopped in epoch 1 it used to say "resume=True continues", and resume=True then said that last.pt
    does not exist."""
    def interrupted(cfg, explicit=()):
        if epochs_done:
            (tmp_path / "last.pt").write_bytes(b"")
        raise KeyboardInterrupt
    monkeypatch.setattr(train_unet, "train", interrupted)
    assert train_unet.main([f"checkpoint_dir={tmp_path}"]) == 130
    assert capsys.readouterr().err.strip() == "interrupted: " + (
        f"checkpoints written so far are intact; resume=True checkpoint_dir={tmp_path} continues" if epochs_done else
        "no epoch had finished, so there is no checkpoint to resume: train again")


def test_an_interrupted_run_with_its_own_epochs_names_them_for_the_resume(monkeypatch, capsys, tmp_path):
    """A run with epochs=4 stopped after 3: 'resume=True continues', and resume=True took CONFIG's 10 epochs,
    extending the run to 10 with a note. The line names the epochs that finish the run as planned."""
    def interrupted(cfg, explicit=()):
        (tmp_path / "last.pt").write_bytes(b"")
        raise KeyboardInterrupt
    monkeypatch.setattr(train_unet, "train", interrupted)
    assert train_unet.CONFIG["epochs"] != 4
    assert train_unet.main([f"checkpoint_dir={tmp_path}", "epochs=4"]) == 130
    assert capsys.readouterr().err.strip() == ("interrupted: checkpoints written so far are intact; resume=True "
                                               f"epochs=4 checkpoint_dir={tmp_path} continues")


def test_the_out_of_memory_and_worker_lines_name_the_keys_typed_over_the_preset(tmp_path):
    """The line of a run stopped by a dead loader worker (or out of memory, or a peer) left out what was typed
    at CONFIG's value over the preset's: 'resume=True preset=debug checkpoint_dir=...' ran 2 epochs, not 10 (review)."""
    (tmp_path / "last.pt").write_bytes(b"")
    cfg = train_unet.parse_overrides(["preset=debug", f"epochs={train_unet.CONFIG['epochs']}", "batch_size=8",
                                      f"checkpoint_dir={tmp_path}"])
    assert train_unet.checkpoint_kept_words(cfg) == (f"last.pt is intact: resume=True preset=debug epochs="
                                                     f"{train_unet.CONFIG['epochs']} batch_size=8 checkpoint_dir="
                                                     f"{tmp_path} continues from it")


def test_the_line_a_stopped_run_ends_with_resumes_that_run(data_dir, tmp_path, monkeypatch, capsys, interrupt_at):
    """'resume=True preset=debug epochs=4 continues' left out the run's checkpoint_dir and data_dir: run as
    printed, it opened checkpoints/last.pt, another run's (refused there for its batch size; one trained with
    the same keys would have been resumed, unsaid). The line, as printed, resumes this run (user test)."""
    monkeypatch.chdir(tmp_path)  # where a plain resume=True would look: checkpoints/, not this run's folder
    mine = tmp_path / "my run"  # a name the shell splits: quoted in the line
    args = [f"data_dir={data_dir}", f"checkpoint_dir={mine}", "preset=debug", "epochs=3", "image_size=32",
            "encoder_name=resnet18", "progress=False", "cpu_probe=False", "detect_anomaly=False"]
    real = interrupt_at(2)
    assert train_unet.main(args) == 130
    said = capsys.readouterr().err.strip().splitlines()[-1]
    words = re.fullmatch(r"interrupted: checkpoints written so far are intact; (.*) continues", said).group(1)
    assert shlex.split(words) == ["resume=True", "preset=debug", f"data_dir={data_dir}", "image_size=32",
                                  "encoder_name=resnet18", "epochs=3", "cpu_probe=False", "detect_anomaly=False",
                                  f"checkpoint_dir={mine}", "progress=False"]  # as typed, in CONFIG's order
    monkeypatch.setattr(train_unet, "run_epoch", real)
    assert train_unet.main(shlex.split(words)) == 0
    assert "resumed from" in capsys.readouterr().out
    assert [row["epoch"] for row in train_unet.load_checkpoint(mine / "last.pt")["history"]] == [1, 2, 3]
    assert not (tmp_path / "checkpoints").exists()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_under_torchrun_rank_0_alone_says_the_run_was_interrupted(rank, monkeypatch, capsys, tmp_path):
    """Each process printed the interrupt's line: one per GPU, where the README says rank 0 alone prints."""
    def interrupted(cfg, explicit=()):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_unet, "train", interrupted)
    monkeypatch.setenv("RANK", rank)
    assert train_unet.main([f"checkpoint_dir={tmp_path}"]) == 130
    assert capsys.readouterr().err.startswith("interrupted: ") == (rank == "0")


@pytest.mark.parametrize("command", ["predict", "export", "benchmark"])
@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_command_other_than_train_under_torchrun_is_refused_once(command, rank, monkeypatch, capsys, tmp_path):
    """torchrun ... predict ran the whole predict in every process, into one folder: one exited 2 with no
    line at all (rank 0 alone says an error every rank met), torchrun a ChildFailedError."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    monkeypatch.setattr(train_unet, "predict", lambda opts: pytest.fail("predict ran"))
    assert train_unet.main([command, f"output={tmp_path / 'out'}"]) == 2
    err = capsys.readouterr().err
    said = (f"error: {command} runs in one process, not under torchrun (its 2 processes would each run it whole, "
            f"into the same folder): python train_unet.py {command} key=value ...\n")
    assert err == (said if rank == "0" else "")
    assert not (tmp_path / "out").exists()


def test_a_run_interrupted_in_epoch_1_says_where_the_earlier_run_it_moved_aside_is(monkeypatch, capsys, tmp_path):
    """A fresh run in a folder that held a finished run moves that run to previous/<time>/; stopped before
    its first epoch ended, the line used to say only that there was nothing to resume."""
    (tmp_path / "history.csv").write_text("epoch\n1\n")
    (tmp_path / "last.pt").write_bytes(b"")
    (tmp_path / "previous" / "20260101-000000").mkdir(parents=True)  # an older archive, not this run's
    old = train_unet.time.time() - 3600
    train_unet.os.utime(tmp_path / "previous" / "20260101-000000", (old, old))

    def interrupted(cfg, explicit=()):
        train_unet.archive_previous_run(tmp_path)
        raise KeyboardInterrupt
    monkeypatch.setattr(train_unet, "train", interrupted)
    assert train_unet.main([f"checkpoint_dir={tmp_path}"]) == 130
    err = capsys.readouterr().err.strip()
    [moved] = [p for p in (tmp_path / "previous").iterdir() if p.name != "20260101-000000"]
    assert (moved / "history.csv").is_file()
    assert err.endswith(f"train again; the earlier run is in {moved}/ (move its files back to resume it)")
    train_unet.os.utime(moved, (old, old))  # that archive is from an earlier start, as it would be
    (tmp_path / "config.json").write_text("{}")  # what a run stopped in epoch 1 leaves: nothing to resume
    assert train_unet.main([f"checkpoint_dir={tmp_path}"]) == 130
    assert capsys.readouterr().err.strip().endswith("no checkpoint to resume: train again")


def test_a_fresh_run_stopped_in_set_up_does_not_offer_to_resume_the_earlier_run(monkeypatch, capsys, tmp_path):
    """Ctrl-C in a fresh run's set-up, before the earlier run was moved to previous/: the line said
    'checkpoints written so far are intact; resume=True continues', and resume=True was then refused, the last.pt
    there being the earlier run's (trained with other settings). A resumed run's own last.pt still resumes."""
    (tmp_path / "last.pt").write_bytes(b"earlier")
    old = train_unet.time.time() - 3600
    train_unet.os.utime(tmp_path / "last.pt", (old, old))

    def interrupted(cfg, explicit=()):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_unet, "train", interrupted)
    assert train_unet.main([f"checkpoint_dir={tmp_path}", "image_size=64"]) == 130
    assert capsys.readouterr().err.strip() == (f"interrupted: stopped before training began: nothing of this run was "
                                               f"written, and the run already in {tmp_path} is untouched")
    assert (tmp_path / "last.pt").read_bytes() == b"earlier"
    assert train_unet.main([f"checkpoint_dir={tmp_path}", "resume=True", "epochs=12"]) == 130
    assert capsys.readouterr().err.strip().endswith(f"intact; resume=True epochs=12 checkpoint_dir={tmp_path} "
                                                    f"continues")
    train_unet.os.utime(tmp_path / "last.pt")  # written by this fresh run's first epoch
    assert train_unet.main([f"checkpoint_dir={tmp_path}"]) == 130
    assert capsys.readouterr().err.strip().endswith(f"intact; resume=True checkpoint_dir={tmp_path} continues")


def test_an_interrupted_predict_says_what_it_leaves(monkeypatch, capsys):
    def interrupted(opts):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_unet, "predict", interrupted)
    assert train_unet.main(["predict", "input=x"]) == 130
    assert capsys.readouterr().err.strip() == ("interrupted: the masks written so far are complete; no partial "
                                               "file is left")


def test_a_key_given_twice_names_both_arguments():
    """'data_dir is given twice on the command line' from a notebook's T.parse_overrides([...]) list, which
    is no command line (a user's report); both arguments are named now."""
    one_line_error(train_unet.parse_overrides, ["data_dir=a", "--data-dir=b"],
                   match=r"^data_dir is given twice \(data_dir=a and --data-dir=b\): keep one$")


def test_benchmark_arguments(tmp_path):
    opts, base, _, names = train_unet.parse_benchmark_args(["--configs=fp32,bf16", "batch_size=4"])
    assert names == ["fp32", "bf16"] and base["batch_size"] == 4
    one_line_error(train_unet.parse_benchmark_args, ["checkpoint_dir=x"], match="set by the benchmark itself")
    one_line_error(train_unet.parse_benchmark_args, ["configs=fp32,bf16,fp32"],
                   match=r"configs='fp32,bf16,fp32' names fp32 more than once: name each once")
    one_line_error(train_unet.parse_benchmark_args, ["inference=bf16,bf16"], match="names bf16 more than once")
    one_line_error(train_unet.parse_benchmark_args, ["bare_steps=-1"], match=r"^bare_steps=-1 must be >= 0$")
    # each key's own reason (progress= was told "results go to output=...", which is checkpoint_dir's)
    one_line_error(train_unet.parse_benchmark_args, ["progress=True"],
                   match=r"progress is set by the benchmark itself \(each run logs to <config>.log in output=")
    # as the benchmark sets them, copied from a training command: taken (progress=False was refused)
    assert train_unet.parse_benchmark_args(["progress=False", "--resume=false", "early_stopping_patience=None"])[1][
        "progress"] is False
    assert train_unet.merge_args(["batch_size=4", "epochs=2"], ["batch_size=8"]) == ["batch_size=8", "epochs=2"]
    # preset=debug ran batch 2 on 8 images with anomaly detection, the header and benchmark.json saying CONFIG's
    one_line_error(train_unet.parse_benchmark_args, ["preset=debug", "image_size=32"],
                   match=r"^preset is not for the benchmark \(each row sets its own precision, layout and compile; "
                         r"give the preset's other keys, such as batch_size= or epochs=, directly\): leave it out$")
    one_line_error(train_unet.parse_benchmark_args, ["detect_anomaly=True"],
                   match=r"^detect_anomaly is not for the benchmark \(anomaly detection slows every step")
    assert train_unet.parse_benchmark_args(["preset=None", "detect_anomaly=False"])[1]["preset"] is None
    one_line_error(train_unet.parse_benchmark_args, ["checkpoint_dir=checkpoints"], match="set by the benchmark itself")


def test_earlier_results_are_archived_not_overwritten(tmp_path):
    (tmp_path / "fp32").mkdir()
    (tmp_path / "benchmark.json").write_text("{}")
    dest = train_unet.archive_previous_run(tmp_path, ["fp32", "benchmark.json"])
    assert (dest / "fp32").is_dir() and (dest / "benchmark.json").read_text() == "{}"
    assert not (tmp_path / "benchmark.json").exists()


def test_a_second_predict_into_one_folder_moves_the_first_ones_results_aside(trained, tmp_path, capsys):
    """Masks and overlays of an earlier predict, for the images this one predicts, move unchanged to
    previous/<time>/: none is lost, and no mask stands beside an older run's overlay of its image.
    Results of other images stay where they are."""
    cfg, data = trained
    images = sorted((data / "images").iterdir())
    first_in, second_in, out = tmp_path / "first", tmp_path / "second", tmp_path / "out"
    for folder, chosen in ((first_in, images[:3]), (second_in, images[1:3])):
        folder.mkdir()
        for path in chosen:
            (folder / path.name).write_bytes(path.read_bytes())
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "output": str(out), "progress": False}
    train_unet.predict({**opts, "input": str(first_in), "overlay": True})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    capsys.readouterr()
    train_unet.predict({**opts, "input": str(second_in)})
    [moved] = list((out / "previous").iterdir())
    assert f"moved to {moved}/" in capsys.readouterr().out
    second = {f"{p.stem}.png" for p in images[1:3]}
    assert {p.name for p in moved.iterdir()} == second | {f"{p.stem}_overlay.png" for p in images[1:3]}
    assert all((moved / name).read_bytes() == before[name] for name in before if (moved / name).exists())
    left = {p.name for p in out.iterdir() if p.is_file()}
    assert left == second | {f"{images[0].stem}.png", f"{images[0].stem}_overlay.png"}
    assert (out / f"{images[0].stem}.png").read_bytes() == before[f"{images[0].stem}.png"]


def test_predict_into_a_folder_of_ground_truth_masks_is_refused_and_moves_nothing(trained, tmp_path):
    """output=<data>/masks: the ground truth has the names predict writes, but not predict's mark. Moved
    aside and replaced by predictions, the next training run would learn from the model's own output."""
    cfg, data = trained
    gt = tmp_path / "gt"
    shutil.copytree(data, gt)
    before = {p.name: p.read_bytes() for p in (gt / "masks").iterdir()}
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(gt / "images"),
            "output": str(gt / "masks"), "progress": False}
    err = one_line_error(train_unet.predict, opts, match="holds .*png and .* more of the names .* not written by predict")
    assert "choose another output=" in err
    assert {p.name: p.read_bytes() for p in (gt / "masks").iterdir()} == before  # nothing moved, no previous/
    photos = tmp_path / "photos"  # a user's own picture named like an input
    photos.mkdir()
    first = sorted((gt / "images").iterdir())[0]
    cv2.imwrite(str(photos / f"{first.stem}.png"), np.full((8, 8, 3), 200, np.uint8))
    one_line_error(train_unet.predict, {**opts, "output": str(photos)}, match=f"holds {first.stem}.png of the names")
    assert [p.name for p in photos.iterdir()] == [f"{first.stem}.png"]
    folders = tmp_path / "folders"  # a user's folder named like a mask: it was moved to previous/
    (folders / f"{first.stem}.png").mkdir(parents=True)
    (folders / f"{first.stem}.png" / "notes.txt").write_text("mine")
    one_line_error(train_unet.predict, {**opts, "output": str(folders)}, match=f"holds {first.stem}.png \\(a folder\\)")
    assert (folders / f"{first.stem}.png" / "notes.txt").read_text() == "mine" and not (folders / "previous").exists()


def test_predict_writes_no_unpaired_mask_into_a_data_sets_masks_or_images_folder(trained, tmp_path):
    """A photo from elsewhere predicted into data/masks: its mask had no image there, and the next training
    run stopped ('1 file(s) have no partner'). The data set's own images (pseudo-labels) may go there."""
    cfg, data = trained
    gt = tmp_path / "gt"
    shutil.copytree(data, gt)
    photo = tmp_path / "photo.png"
    shutil.copy(sorted((gt / "images").iterdir())[0], photo)
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(photo),
            "output": str(gt / "masks"), "progress": False}
    before = sorted(p.name for p in (gt / "masks").iterdir())
    one_line_error(train_unet.predict, opts, match=f"^output={re.escape(str(gt / 'masks'))} looks like a data set's masks "
                   f"folder \\(beside {re.escape(str(gt / 'images'))}\\), and photo.png is not one of its images: a "
                   f"second mask, or one without an image, there stops the next training run; choose another output=... "
                   f"folder$")
    (tmp_path / "link").symlink_to(gt / "masks")  # through a link: the same folder
    one_line_error(train_unet.predict, {**opts, "output": str(tmp_path / "link")}, match="photo.png is not one of its")
    assert sorted(p.name for p in (gt / "masks").iterdir()) == before
    own = tmp_path / "own"  # pseudo-labels: the images' own masks folder, still empty
    (own / "images").mkdir(parents=True)
    shutil.copy(photo, own / "images" / "photo.png")
    assert train_unet.predict({**opts, "input": str(own / "images"), "output": str(own / "masks")})["predicted"] == 1
    one_line_error(train_unet.predict, {**opts, "input": str(own / "images"), "output": str(own / "masks"),
                                        "overlay": True}, match="overlay=True writes <name>_overlay.png there")
    (own / "masks" / "photo.png").rename(own / "masks" / "photo.bmp")  # a ground truth of another format
    one_line_error(train_unet.predict, {**opts, "input": str(own / "images"), "output": str(own / "masks")},
                   match="and photo.bmp is the mask of photo.png there")
    # its images folder: masks there were taken for images (then masks of them went to masks/, and trained)
    one_line_error(train_unet.predict, {**opts, "output": str(gt / "images")},
                   match=f"^output={re.escape(str(gt / 'images'))} is a data set's images folder \\(masks/ beside "
                         f"it\\): masks written there would be taken for images by the next training run; choose "
                         f"another output=... folder$")
    assert sorted(p.name for p in (gt / "masks").iterdir()) == before


def test_a_file_named_previous_where_earlier_results_are_kept_is_a_one_line_error(trained, tmp_path):
    """predict (and training, export, the benchmark: archive_previous_run) moves earlier results into
    previous/<time>/; a file named previous stopped it with NotADirectoryError's traceback."""
    cfg, data = trained
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(data / "images"),
            "output": str(tmp_path / "out"), "progress": False}
    with contextlib.redirect_stdout(io.StringIO()):
        train_unet.predict(opts)
    (tmp_path / "out" / "previous").write_text("a note of mine")
    masks = {p.name: p.read_bytes() for p in (tmp_path / "out").glob("*.png")}
    one_line_error(train_unet.predict, opts, match="out/previous is a file, but earlier results move into a folder "
                                                   "of that name .*: move or rename it")
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").glob("*.png")} == masks
    assert (tmp_path / "out" / "previous").read_text() == "a note of mine"


@pytest.mark.parametrize("across", [False, True])
def test_an_earlier_result_that_cannot_be_moved_leaves_every_file_in_place(tmp_path, monkeypatch, across):
    """An earlier result that could not be moved (immutable, another user's in a sticky folder) stopped the
    archive with PermissionError's traceback halfway: some files in previous/, some not, and an export's
    .onnx moved away from its sidecar. Now what moved goes back, a cross-device move's copy goes, and one
    line names the file."""
    folder = tmp_path / "out"
    folder.mkdir()
    files = {name: f"{name} of the earlier run" for name in ("a.png", "b.png", "c.png")}
    for name, text in files.items():
        (folder / name).write_text(text)
    real = shutil.move

    def move(src, dst):
        if Path(src).name == "b.png":
            if across:  # shutil.move across file systems: copied, then the source cannot be removed
                shutil.copy2(src, dst)
            raise PermissionError(1, "Operation not permitted", src)
        return real(src, dst)
    monkeypatch.setattr(shutil, "move", move)
    err = one_line_error(train_unet.archive_previous_run, folder, list(files),
                         match=rf"cannot move {re.escape(str(folder / 'b.png'))} into {re.escape(str(folder))}/previous/ "
                               r"\(Operation not permitted\), where earlier results go .*; nothing was moved$")
    assert {p.name: p.read_text() for p in folder.iterdir()} == files, err  # previous/ made and removed
    (folder / "previous" / "older").mkdir(parents=True)
    with pytest.raises(UserError):
        train_unet.archive_previous_run(folder, list(files))
    assert [p.name for p in (folder / "previous").iterdir()] == ["older"]  # an earlier archive stays


def test_an_earlier_runs_folder_that_cannot_be_moved_comes_back_whole(tmp_path, monkeypatch):
    """A folder (a run's tensorboard/) moved across file systems is copied, then removed: where the removal
    failed partway, the undo unlinked the copy (a folder: IsADirectoryError's traceback). Now a file the
    removal took comes back from the copy, and the copy goes."""
    folder = tmp_path / "ckpt"
    (folder / "tensorboard" / "run").mkdir(parents=True)
    events = {f"run/events.{i}": f"event {i}" for i in range(3)}
    for name, text in events.items():
        (folder / "tensorboard" / name).write_text(text)
    (folder / "history.csv").write_text("epoch\n1\n")

    def move(src, dst):
        if Path(src).name != "tensorboard":
            return os.rename(src, dst)
        shutil.copytree(src, dst)
        (Path(src) / "run" / "events.0").unlink()  # the removal took one file, then failed
        raise PermissionError(1, "Operation not permitted", src)
    monkeypatch.setattr(shutil, "move", move)
    one_line_error(train_unet.archive_previous_run, folder, ["history.csv", "tensorboard"],
                   match=r"cannot move .*tensorboard into .*; nothing was moved$")
    monkeypatch.undo()
    assert {str(p.relative_to(folder / "tensorboard")): p.read_text()
            for p in (folder / "tensorboard").rglob("*") if p.is_file()} == events
    assert sorted(p.name for p in folder.iterdir()) == ["history.csv", "tensorboard"]


def test_predicts_notes_name_the_first_image_by_name_whatever_order_the_readers_finish_in(tmp_path):
    """Each note kept the first image a reader thread finished, and a reader that checked before another's
    finding and finished after it wrote None over it (the outside-range note lost)."""
    opts = {"checkpoint": "best.pt", "intensity_range": None}
    notes = train_unet.InputNotes({"intensity_range": [0.0, 4095.0], "in_channels": 3, "data_mode": "fit",
                                   "image_size": 64}, opts)
    strip = np.zeros((8, 400), np.uint16)
    for name, top in (("c.png", 4000), ("b.png", 65535), ("a.png", 60000), ("d.png", 100)):
        image = np.full((8, 400), top, np.uint16)
        notes.look(tmp_path / name, image, train_unet.scale_image(image, name, [0, 4095]))
    assert notes.outside[0] == tmp_path / "a.png" and notes.thin[0] == tmp_path / "a.png"
    rgba = np.dstack([strip + 100] * 3 + [np.full_like(strip, 65535)])  # an opaque alpha is not data
    fresh = train_unet.InputNotes(notes.cfg, opts)
    fresh.look(tmp_path / "rgba.tif", rgba, train_unet.scale_image(rgba, "rgba.tif", [0, 4095]))
    assert fresh.outside is None


def test_predicts_masks_and_overlays_carry_its_mark_and_decode_unchanged(tmp_path):
    mask = np.zeros((30, 40), np.uint8)
    mask[5:9] = 255
    overlay = np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)
    for name, image in (("m.png", mask), ("o.png", overlay)):
        train_unet.save_prediction(tmp_path / name, image, 0)
        assert train_unet.written_by_predict(tmp_path / name)
        assert np.array_equal(cv2.imread(str(tmp_path / name), cv2.IMREAD_UNCHANGED), image)
    train_unet.write_png(tmp_path / "plain.png", mask)
    assert not train_unet.written_by_predict(tmp_path / "plain.png")
    assert not train_unet.written_by_predict(tmp_path / "missing.png")


def test_a_model_that_cannot_take_the_image_size_is_refused_before_anything_moves(make_cfg):
    """PAN pools its 1/16 map three more times: at 64 px a traceback from inside torch at the first batch,
    after the earlier run had been moved aside."""
    cfg = make_cfg(arch="PAN", image_size=64)
    ckpt = Path(cfg["checkpoint_dir"])
    ckpt.mkdir(parents=True)
    (ckpt / "history.csv").write_text("epoch\n1\n")  # an earlier run's
    err = one_line_error(train_unet.train, cfg, match="arch=PAN with encoder_name=resnet18 cannot take image_size=64")
    assert "use image_size=128 (the smallest it takes)" in err
    assert (ckpt / "history.csv").read_text() == "epoch\n1\n" and not (ckpt / "previous").exists()
    assert train_unet.smallest_model_side(make_cfg(arch="Unet")) == 32


def test_a_model_the_meta_device_cannot_judge_is_not_refused(make_cfg, monkeypatch):
    """mit_b* encoders read a value while built, which the meta device cannot give: not judged (it raised
    a traceback before anything started); a size the meta device refuses is confirmed by a real forward
    (an op it lacks is not the model's limit)."""
    segformer = make_cfg(arch="Segformer", encoder_name="mit_b0", image_size=64)
    assert train_unet.model_takes(segformer, 64) is None and train_unet.smallest_model_side(segformer) is None
    train_unet.check_model_takes_image_size(segformer)
    assert [tuple(b.shape[2:]) for b in train_unet.check_batches(segformer)[0]] == [(64, 64), (96, 160), (224, 64)]
    monkeypatch.setattr(train_unet, "model_takes_side", lambda *key: False)  # a meta device that refuses all
    train_unet.check_model_takes_image_size(make_cfg(arch="Unet", image_size=64))  # the real forward runs
    err = one_line_error(train_unet.check_model_takes_image_size, make_cfg(arch="PAN", image_size=64),
                         match="cannot take image_size=64")
    assert "use another image_size, or another arch" in err


def test_the_export_check_sizes_stay_within_what_the_model_takes(make_cfg):
    cfg = make_cfg(arch="PAN", image_size=128)
    batches, _ = train_unet.check_batches(cfg)
    assert [tuple(b.shape[2:]) for b in batches] == [(128, 128), (128, 160), (224, 128)]
    batches, _ = train_unet.check_batches(make_cfg(image_size=64))
    assert [tuple(b.shape[2:]) for b in batches] == [(64, 64), (96, 160), (224, 64)]


def test_signed_16_bit_images_without_a_range_get_a_note_of_the_range_they_were_scaled_from(trained, tmp_path,
                                                                                              capsys):
    """An int16 TIFF (CT) predicted with a checkpoint without intensity_range is scaled from -32768-32767
    (0 mid-grey); the note said 0-65535 and advised 0,4095."""
    import tifffile

    cfg, data = trained
    inp = tmp_path / "in"
    inp.mkdir()
    tifffile.imwrite(inp / "ct.tif", np.random.default_rng(0).integers(-1000, 1000, (32, 32), dtype=np.int16))
    image = train_unet.read_image(inp / "ct.tif", 3)
    assert abs(float(image.mean()) - 0.5) < 0.02  # what the note says: 0 is mid-grey
    train_unet.predict({"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(inp),
                        "output": str(tmp_path / "out"), "progress": False})
    out = capsys.readouterr().out
    assert "note: ct.tif has signed 16-bit pixels" in out and "scaled from -32768-32767" in out
    assert "0-65535" not in out and "intensity_range=0,4095" not in out


def test_float_tiffs_get_no_16_bit_note_and_a_range_given_for_them_is_named_as_unused(trained, tmp_path, capsys):
    """A float16 TIFF has 2 bytes a sample: predict called it 16-bit and advised intensity_range=0,4095, which
    changed nothing (floats are mapped by their own min and max); a range given for float TIFFs was dropped
    silently, where for 8-bit images it is named."""
    import tifffile

    cfg, _ = trained
    inp = tmp_path / "in"
    inp.mkdir()
    pixels = np.random.default_rng(0).random((32, 32), np.float32) * 3
    tifffile.imwrite(inp / "half.tif", pixels.astype(np.float16))
    tifffile.imwrite(inp / "single.tif", pixels)
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(inp), "progress": False}
    train_unet.predict({**opts, "output": str(tmp_path / "a")})
    assert "16-bit" not in capsys.readouterr().out
    train_unet.predict({**opts, "output": str(tmp_path / "b"), "intensity_range": [0, 4095]})
    assert ("note: intensity_range=0,4095 was not used for half.tif and any other 8-bit or float image: the range "
            "maps integer images wider than 8 bits; as in training, 8-bit images are divided by 255 and float "
            "images mapped by their own min and max") in capsys.readouterr().out


def test_predict_notes_colour_read_as_grey_and_a_dropped_channel_that_is_not_alpha(trained, tmp_path, capsys):
    """Training's data check notes colour that in_channels=1 reads as grey and a TIFF channel dropped that is
    not alpha (near-infrared); predict read such images the same way without a word."""
    import tifffile

    cfg, data = trained
    inp = tmp_path / "in"
    inp.mkdir()
    first = cv2.imread(str(sorted((data / "images").iterdir())[0]))
    colour = first.copy()
    colour[..., 0] = 255 - colour[..., 2]  # blue unlike red: colour that grey drops
    cv2.imwrite(str(inp / "grey.png"), cv2.cvtColor(first, cv2.COLOR_BGR2GRAY))
    cv2.imwrite(str(inp / "colour.png"), colour)
    tifffile.imwrite(inp / "nir.tif", np.dstack([first[..., ::-1], first[..., 0]]), photometric="rgb",
                     extrasamples=[0])
    grey_cfg = {**cfg, "in_channels": 1, "checkpoint_dir": str(tmp_path / "grey")}
    train_unet.train(grey_cfg)
    capsys.readouterr()
    colour = "note: 2 of 3 image(s) hold colour (e.g. colour.png), read as grey (their luminance): {} takes " \
             "in_channels=1; if colour tells the classes apart, train with in_channels=3"  # colour.png and nir.tif
    nir = "note: 1 of 3 image(s) hold a channel that is not alpha beside their grey or RGB (e.g. nir.tif: a TIFF " \
          "extra sample such as near-infrared), and it is dropped: {} takes in_channels={}"
    for ckpt, channels in ((Path(grey_cfg["checkpoint_dir"]) / "best.pt", 1), (Path(cfg["checkpoint_dir"]) / "best.pt", 3)):
        train_unet.predict({"checkpoint": str(ckpt), "input": str(inp), "progress": False, "use_amp": False,
                            "output": str(tmp_path / ckpt.parent.name)})
        notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
        assert nir.format(ckpt, channels) in notes, notes
        assert sum(colour.format(ckpt) in line for line in notes) == (channels == 1) and len(notes) == 1 + (channels == 1)
    (inp / "colour.png").unlink()
    (inp / "nir.tif").unlink()
    train_unet.predict({"checkpoint": str(Path(grey_cfg["checkpoint_dir"]) / "best.pt"), "input": str(inp),
                        "progress": False, "use_amp": False, "output": str(tmp_path / "plain")})
    assert "note:" not in capsys.readouterr().out


def test_an_image_fit_mode_squeezes_under_16_px_across_gets_a_note_in_training_and_predict(trained, tmp_path,
                                                                                          capsys):
    """A 1000x40 strip went to a 32 px fit-mode model as 32x1, its detail across gone, without a word. A small
    image (upscaled) gets no note, nor, at image_size=64, a 400x100 one (64x16); patch mode none."""
    cfg, data = trained
    strip = np.zeros((40, 1000, 3), np.uint8)
    strip[10:30, 100:900] = 200
    mask = np.where(strip[..., 0] > 0, 255, 0).astype(np.uint8)
    root = tmp_path / "set"
    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True)
    pairs = [(root / "images" / f"{name}.png", root / "masks" / f"{name}.png") for name in ("strip", "small", "wide")]
    for (image, target), (h, w) in zip(pairs, ((40, 1000), (20, 17), (100, 400))):
        cv2.imwrite(str(image), cv2.resize(strip, (w, h)))
        cv2.imwrite(str(target), cv2.resize(mask, (w, h), interpolation=cv2.INTER_NEAREST))
    base = {**cfg, "data_dir": str(root), "checkpoint_dir": str(tmp_path / "c")}
    train_unet.check_pairs(pairs, train_unet.validate_config({**base, "image_size": 64}))
    notes = [line for line in capsys.readouterr().out.splitlines() if "elongated" in line]
    assert notes == ["note: 1 of 3 image(s) are so elongated that fit mode (longest side to image_size=64) leaves them "
                     "under 16 px across (e.g. strip.png: 1000x40 -> 64x3): their detail across is lost; "
                     "data_mode=patch trains on them at full resolution"]
    train_unet.check_pairs(pairs, train_unet.validate_config({**base, "data_mode": "patch", "image_size": 64}))
    assert "elongated" not in capsys.readouterr().out
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(root / "images"),
            "progress": False, "use_amp": False}
    train_unet.predict({**opts, "output": str(tmp_path / "out")})
    notes = [line for line in capsys.readouterr().out.splitlines() if "across" in line]
    # at the checkpoint's 32 px the 400x100 image (32x8) is under 16 px across too: counted, as training counts
    assert notes == ["note: 2 of 3 image(s) went to the model under 16 px across (fit mode: longest side to 32 px; e.g. "
                     "strip.png: 1000x40 -> 32x1): their detail across is lost; a model trained with data_mode=patch "
                     "predicts such images at full resolution"]


def test_predict_notes_images_a_patch_checkpoints_scale_shrinks_below_a_shape(tmp_path, capsys):
    """Training refuses an image patch_scale shrinks under 8 px across; predict wrote such an image's mask,
    all background, with no word (user test). An image that small as stored is the user's data: not counted."""
    cfg = train_unet.validate_config({"image_size": 32, "encoder_weights": None, "data_mode": "patch",
                                      "patch_scale": 0.5})
    ckpt = tmp_path / "patch.pt"
    train_unet.save_checkpoint(ckpt, {"model": train_unet.build_model(cfg).state_dict(), "config": cfg})
    folder = tmp_path / "in"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name, (h, w) in (("sliver", (10, 300)), ("dot", (1, 1)), ("fine", (64, 64))):
        cv2.imwrite(str(folder / f"{name}.png"), rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    train_unet.predict({"checkpoint": str(ckpt), "input": str(folder), "output": str(tmp_path / "out"),
                        "progress": False, "use_amp": False, "device": "cpu"})
    notes = [line for line in capsys.readouterr().out.splitlines() if "across" in line]
    assert notes == ["note: 1 of 3 image(s) went to the model under 8 px across (patch_scale=0.5; e.g. sliver.png: "
                     "300x10 -> 150x5), too small to hold a shape: their masks are not to be trusted; a model trained "
                     "at a larger patch_scale predicts them"]


def test_the_16_bit_note_names_the_image_holding_12_bit_data_not_the_first_16_bit_one(trained, tmp_path, capsys):
    """A full-range 16-bit a.tif beside 12-bit data in b.png: the note named a.tif, the first, and advised
    0,4095, which would put all of a.tif outside the range; b.png, 16 times too dark, went unnamed."""
    import tifffile

    cfg, data = trained
    inp = tmp_path / "in"
    inp.mkdir()
    grey = cv2.imread(str(sorted((data / "images").iterdir())[0]), cv2.IMREAD_GRAYSCALE)
    tifffile.imwrite(inp / "a.tif", grey.astype(np.uint16) * 257)
    cv2.imwrite(str(inp / "b.png"), grey.astype(np.uint16) * 16)
    cv2.imwrite(str(inp / "c.png"), grey.astype(np.uint16) * 4)  # 10-bit data
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(inp), "progress": False}
    train_unet.predict({**opts, "output": str(tmp_path / "a")})
    notes = [line for line in capsys.readouterr().out.splitlines() if "16-bit" in line]
    top = int(grey.max()) * 16
    assert notes == [f"note: b.png has 16-bit pixels and {opts['checkpoint']} has no intensity_range: they were scaled "
                     f"from 0-65535, but its values reach only {top}: if it holds 12-bit data, the model saw it 16 times "
                     f"too dark: predict again with intensity_range=0,4095 (2 of the 3 16-bit images stay below 16384)"]
    (inp / "b.png").unlink()
    (inp / "c.png").unlink()
    train_unet.predict({**opts, "output": str(tmp_path / "b")})
    assert [line for line in capsys.readouterr().out.splitlines() if "16-bit" in line] == [
        f"note: 1 image(s) have 16-bit pixels (e.g. a.tif) and {opts['checkpoint']} has no intensity_range: they were "
        f"scaled from 0-65535 (their values reach up to {int(grey.max()) * 257})"]


def test_16_bit_images_with_a_checkpoint_that_has_no_intensity_range_get_a_note_and_a_key(trained, tmp_path,
                                                                                         capsys):
    """12-bit data in 16-bit files, predicted with a model trained on 8-bit images: scaled from 0-65535,
    16 times too dark, silently. Now a note names the file and the key; intensity_range= sets it."""
    cfg, data = trained
    inp = tmp_path / "in"
    inp.mkdir()
    first = sorted((data / "images").iterdir())[0]
    cv2.imwrite(str(inp / "twelve.png"), cv2.imread(str(first)).astype(np.uint16) * 16)
    cv2.imwrite(str(inp / "eight.png"), cv2.imread(str(first)))
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(inp), "progress": False}
    train_unet.predict({**opts, "output": str(tmp_path / "a")})
    out = capsys.readouterr().out
    assert "note: twelve.png has 16-bit pixels and" in out and "again with intensity_range=0,4095" in out
    train_unet.predict({**opts, "output": str(tmp_path / "b"), "intensity_range": [0, 4095]})
    out = capsys.readouterr().out
    assert "16-bit" not in out  # the range given: the 12-bit data were scaled by it
    # ... and the 8-bit image beside it, which the range does not touch, is named (it was ignored silently)
    assert "note: intensity_range=0,4095 was not used for eight.png and any other 8-bit or float image" in out
    (inp / "eight.png").unlink()
    train_unet.predict({**opts, "output": str(tmp_path / "b2"), "intensity_range": [0, 4095]})
    out = capsys.readouterr().out
    assert "was not used" not in out and "outside intensity_range" not in out
    # a range that does not fit the images (here full-range 16-bit data given 0-4095) gets a note too
    cv2.imwrite(str(inp / "full.png"), cv2.imread(str(first)).astype(np.uint16) * 256)
    train_unet.predict({**opts, "output": str(tmp_path / "b3"), "intensity_range": [0, 4095]})
    note = [line for line in capsys.readouterr().out.splitlines() if "outside intensity_range" in line]
    assert len(note) == 1 and note[0].startswith("note: 1 of 2 image(s) have over 1% of their pixels outside "
                                                 "intensity_range=0,4095 (e.g. ") and "of full.png's, whose" in note[0]
    read = lambda folder, name: cv2.imread(str(tmp_path / folder / name), cv2.IMREAD_UNCHANGED)  # noqa: E731
    assert (read("b", "twelve.png") == read("b", "eight.png")).mean() > 0.99  # 0-4095 = the 8-bit 0-255
    seen = train_unet.predict_intensity_range({"intensity_range": None}, {"intensity_range": [0, 4095]})
    assert seen["intensity_range"] == [0.0, 4095.0]
    one_line_error(train_unet.predict, {**opts, "output": str(tmp_path / "c"), "intensity_range": [5, 1]},
                   match="intensity_range=.* must be two numbers low,high")
    assert train_unet.parse_overrides(["intensity_range=0,4095"], defaults=train_unet.PREDICT_CONFIG)[
        "intensity_range"] == [0.0, 4095.0]


@pytest.mark.parametrize("arg, defaults", [("data_dir='my data'", None), ('epochs="2"', None),
                                           ("checkpoint='best.pt'", "PREDICT_CONFIG"), (" amp_dtype= 'bf16' ", None)])
def test_values_that_kept_their_quote_marks_say_so(arg, defaults):
    """A shell that passes quotes on (data_dir="'x'", or data_dir='x' in Windows' cmd): the path read
    'not found' with its quotes, a number 'not a whole number'."""
    key, _, value = arg.strip().partition("=")
    bare = value.strip()[1:-1]
    parse = lambda: train_unet.parse_overrides([arg], defaults=getattr(train_unet, defaults or "CONFIG"))  # noqa: E731
    err = one_line_error(parse, match=f"{key.strip()}={value.strip()} holds its quote marks")
    key = key.strip()
    assert err.endswith(f'write {key}={bare}, or quote the whole argument where the value has spaces: "{key}={bare}"')


def test_quote_marks_inside_a_value_are_kept():
    assert train_unet.parse_overrides(["data_dir='a'b"])["data_dir"] == "'a'b"
    assert train_unet.parse_overrides(["data_dir=it's"])["data_dir"] == "it's"


def test_words_are_read_in_any_case_and_near_misses_get_a_suggestion():
    parsed = train_unet.parse_overrides(["tta=FLIP", "preset=Debug", "device=CPU", "amp_dtype=BFloat16"])
    assert (parsed["tta"], parsed["preset"], parsed["device"], parsed["amp_dtype"]) == ("flip", "debug", "cpu", "bfloat16")
    for name, dtype in (("bf16", "bfloat16"), ("fp16", "float16")):  # the names the banner and benchmark use
        assert train_unet.validate_config({"amp_dtype": name})["amp_dtype"] == dtype
    err = one_line_error(train_unet.validate_config, {"preset": "fsat"}, match="preset='fsat' is not allowed")
    assert err.endswith("use one of None, fast, stable, low_memory, debug (did you mean fast?)")
    one_line_error(train_unet.validate_config, {"tta": "flips"}, match=r"\(did you mean flip\?\)")
    one_line_error(train_unet.validate_config, {"amp_dtype": ["bf16"]}, match="amp_dtype=.* must be a string")


def test_a_val_fraction_that_leaves_nothing_to_train_on_says_so(make_data, make_cfg):
    data = make_data(count=12)
    err = one_line_error(train_unet.split_pairs, make_cfg(data_dir=str(data), val_fraction=0.99),
                         match="val_fraction=0.99 of .*'s 12 images leaves none to train on")
    value = float(err.split("use val_fraction=")[1].split()[0])
    # the advice leaves a batch (batch_size=4) to train on: it once left one image, which the batch_size
    # check refused next
    assert value == 0.66 and len(train_unet.split_pairs(make_cfg(data_dir=str(data), val_fraction=value))[0]) == 4
    assert train_unet.largest_val_fraction(3, {"batch_size": 4, "data_mode": "fit"}) == \
        "use val_fraction=0.33 or less (e.g. 0.2), with batch_size=2 or less"
    assert train_unet.largest_val_fraction(12, {"batch_size": 4, "data_mode": "patch"}).startswith("use val_fraction=0.91 ")


def test_an_unreadable_file_says_what_it_is(tmp_path):
    """A folder named like an image, an empty file, a broken link: each named for what it is, in one line
    (no OpenCV warning beside it)."""
    (tmp_path / "folder.png").mkdir()
    (tmp_path / "empty.png").write_bytes(b"")
    (tmp_path / "empty.jpg").write_bytes(b"")  # decoded from its bytes, as PNGs are too: imdecode asserted
    (tmp_path / "broken.png").symlink_to(tmp_path / "gone.png")
    (tmp_path / "junk.png").write_bytes(b"not an image at all" * 10)
    for name, why in (("folder.png", "a folder, not an image"), ("empty.png", "an empty file"),
                      ("empty.jpg", "an empty file"), ("broken.png", "a broken link"),
                      ("junk.png", "corrupt or not an image")):
        one_line_error(train_unet.read_image, tmp_path / name, 3,
                       match=f"cannot read image {tmp_path / name} \\({why}\\): fix or remove it")
    # OpenCV's own warning for a path it cannot open reaches stderr at exit: seen in a fresh process only
    code = f"import train_unet\ntry: train_unet.read_image(train_unet.Path({str(tmp_path / 'broken.png')!r}), 3)\n" \
           f"except train_unet.UserError: pass"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=Path(train_unet.__file__).parent)
    assert run.returncode == 0 and "WARN" not in run.stderr, run.stderr


@pytest.mark.parametrize("args, said", [
    (["overlay=True"], "overlay is a key of predict, not of training: python train_unet.py predict overlay=..."),
    (["configs=fp32"], "configs is a key of benchmark, not of training: python train_unet.py benchmark configs=..."),
    (["benchmark", "inferense=fp32"], "unknown key 'inferense': did you mean 'inference'? the benchmark's keys: "),
])
def test_a_key_of_another_command_or_a_misspelt_benchmark_key_is_named(args, said, capsys):
    """overlay=True given to training read "did you mean 'tile_overlap'?"; a misspelt benchmark key was matched
    against the training keys alone, with no suggestion and a list that left the benchmark's own out."""
    assert train_unet.main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {said}") and err.count("\n") == 1, err


@pytest.mark.parametrize("command, key", [("predict", "tile_overlap"), ("export", "output"), ("benchmark", "configs")])
def test_each_command_lists_its_keys_with_help(command, key, capsys):
    assert train_unet.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"python train_unet.py {command} key=value") and f"  {key}" in out


def test_a_folder_says_which_files_predict_skips(tmp_path, capsys):
    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "b.webp").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("x")
    assert train_unet.list_images(tmp_path) == [tmp_path / "a.png"]
    assert capsys.readouterr().out == (f"note: 2 other file(s) in {tmp_path} skipped (e.g. b.webp): only "
                                       f"{', '.join(train_unet.IMAGE_EXTS)} are read\n")


def test_hidden_images_are_said_to_be_skipped(tmp_path, capsys):
    """Files named like images but hidden (.g.png) were skipped without a word, and a folder of only them
    was said to hold no images; macOS's ._ metadata files stay unmentioned."""
    (tmp_path / ".g.png").write_bytes(b"")
    (tmp_path / "._x.png").write_bytes(b"")
    with pytest.raises(train_unet.UserError, match=r"no images .* \(1 hidden file\(s\) skipped \(e.g. .g.png\): "
                                                   r"names starting with '.' are not read\): rename them without the "
                                                   r"leading '.' to predict them$"):
        train_unet.list_images(tmp_path)
    (tmp_path / "a.png").write_bytes(b"")
    assert train_unet.list_images(tmp_path) == [tmp_path / "a.png"]
    assert capsys.readouterr().out == ("note: 1 hidden file(s) skipped (e.g. .g.png): names starting with '.' are "
                                       "not read\n")


def test_a_folder_named_like_an_image_is_skipped_with_subfolders_named(tmp_path, capsys):
    """A folder x.png in predict's input was taken for an image and reported unreadable (exit 1); a
    subfolder of images was left out without a word."""
    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "x.png").mkdir()
    (tmp_path / "more").mkdir()
    assert train_unet.list_images(tmp_path) == [tmp_path / "a.png"]
    assert capsys.readouterr().out == (f"note: 2 folder(s) in {tmp_path} skipped (e.g. more/): predict reads "
                                       f"the images directly in it; give each folder as its own input=\n")
    (tmp_path / "b.png").symlink_to(tmp_path / "gone.png")  # a broken link stays an input: named unreadable
    assert train_unet.list_images(tmp_path) == [tmp_path / "a.png", tmp_path / "b.png"]
    (tmp_path / "a.png").unlink()
    (tmp_path / "b.png").unlink()
    with pytest.raises(train_unet.UserError, match=r"no images .* \(its subfolders are not read: more/, x.png/\): "
                                                   r"give input= a folder of images, or one image file$"):
        train_unet.list_images(tmp_path)
    (tmp_path / "more" / "b.png").write_bytes(b"")  # a subfolder that holds images: named as the input to give
    with pytest.raises(train_unet.UserError, match=rf"not read: more/, x.png/\): give a subfolder as input= "
                                                   rf"\(input={re.escape(str(tmp_path / 'more'))}\)$"):
        train_unet.list_images(tmp_path)
    (tmp_path / "more" / "b.png").unlink()
    (tmp_path / "images").mkdir()  # a data set's folder given: its images are one level down
    with pytest.raises(train_unet.UserError, match=r"not read: images/, more/, x.png/\): give input=.*/images$"):
        train_unet.list_images(tmp_path)


@pytest.mark.parametrize("args, defaults, hint", [
    (["lr=0.1"], None, "did you mean 'learning_rate'?"),
    (["bs=4"], None, "did you mean 'batch_size'?"),
    (["ckpt=x.pt"], train_unet.PREDICT_CONFIG, "did you mean 'checkpoint'?"),
    (["batchsize=4"], None, "did you mean 'batch_size'?"),  # difflib's, as ever
])
def test_other_trainers_key_names_point_to_ours(args, defaults, hint):
    message = one_line_error(lambda: train_unet.parse_overrides(args, defaults=defaults), match="unknown key")
    assert hint in message


@pytest.mark.parametrize("key", ["in_channels", "num_classes", "image_size"])
def test_a_training_key_given_to_predict_says_the_checkpoint_holds_it(key):
    """predict in_channels=1 was answered "did you mean 'channels_last'?"."""
    message = one_line_error(lambda: train_unet.parse_overrides([f"{key}=1"], defaults=train_unet.PREDICT_CONFIG),
                             match=f"{key} is not a predict key: the model was trained with one, and predict takes "
                                   f"it from the checkpoint")
    assert "did you mean" not in message


@pytest.mark.parametrize("key, said", [("logger", "a training key, which predict does not use"),
                                       ("epochs", "a training key, which predict does not use"),
                                       ("ema_decay", "predict uses the checkpoint's EMA weights where it was trained "
                                                     "with ema_decay, else its weights")])
def test_a_training_only_key_given_to_predict_is_not_said_to_be_the_checkpoints(key, said):
    """predict logger=csv read 'the model was trained with one, and predict takes it from the checkpoint'."""
    message = one_line_error(lambda: train_unet.parse_overrides([f"{key}=1"], defaults=train_unet.PREDICT_CONFIG),
                             match=f"^{key} is not a predict key: {said}; predict's keys: checkpoint, ")
    assert "trained with one" not in message


def test_a_data_dir_that_is_a_file_says_so(tmp_path):
    (tmp_path / "afile").write_text("x")
    one_line_error(train_unet.split_pairs, {"data_dir": str(tmp_path / "afile")},
                   match="data_dir .*afile is a file: give the folder that holds images/ and masks/")


def test_a_stop_waits_until_the_epochs_files_are_all_written(make_cfg, monkeypatch, tmp_path):
    """Ctrl-C just after last.pt was written used to leave no best.pt and no history.csv: resumed, the run
    then never wrote that best epoch's weights, as last.pt already recorded its IoU as the one to beat."""
    import signal

    real = train_unet.save_checkpoint

    def save_then_stop(path, state):
        real(path, state)
        if path.name == "last.pt":
            os.kill(os.getpid(), signal.SIGINT)  # arrives before best.pt is written
    monkeypatch.setattr(train_unet, "save_checkpoint", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train_unet.train(make_cfg(epochs=2))
    written = {p.name for p in (tmp_path / "ckpt").iterdir()}
    assert {"last.pt", "best.pt", "history.csv"} <= written
    assert train_unet.load_checkpoint(tmp_path / "ckpt" / "best.pt")["epoch"] == 1
    # ... and TensorBoard got the epoch too: it was logged after the hold, so the stop dropped it for good
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "ckpt" / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    assert [e.step for e in events.Scalars("epoch/val_iou")] == [1]


def test_a_best_pt_that_cannot_be_written_leaves_last_pt_at_the_epoch_before(make_cfg, monkeypatch, tmp_path):
    """best.pt was written after last.pt: a full disk at best.pt left last.pt counting a best IoU that no
    best.pt held, and a resume never wrote it. Now best.pt goes first: last.pt stays behind and resume
    trains that epoch again."""
    real = train_unet.save_checkpoint

    def full_at_best(path, state):
        if path.name == "best.pt" and state["epoch"] == 2:
            raise train_unet.UserError(f"cannot write {path} (the write stopped short, as on a full disk)")
        real(path, state)
    train_unet.train(make_cfg(epochs=1))
    monkeypatch.setattr(train_unet, "save_checkpoint", full_at_best)
    monkeypatch.setattr(train_unet, "finish_epoch", lambda run, row, cfg, real=train_unet.finish_epoch: real(
        run, {**row, "val_iou": 1.0} if row["epoch"] == 2 else row, cfg))  # epoch 2 is best
    with pytest.raises(train_unet.UserError, match="full disk"):
        train_unet.train(make_cfg(epochs=2, resume=True))
    assert train_unet.load_checkpoint(tmp_path / "ckpt" / "last.pt")["epoch"] == 1


@pytest.mark.parametrize("text, said", [
    ("DataLoader worker (pid 15597) is killed by signal: Killed. ", "(signal Killed, as the out-of-memory killer"),
    ("DataLoader worker (pid(s) 15597) exited unexpectedly", "a data loader worker died; last.pt is intact"),
])
def test_a_killed_loader_worker_is_one_line_with_what_to_do(make_cfg, monkeypatch, text, said):
    """The out-of-memory killer's SIGKILL to a worker gave 30 lines of traceback ending in torch's RuntimeError,
    with no word of the intact last.pt or of what to change."""
    real = train_unet.run_epoch

    def die(run, epoch, *args):
        if epoch == 2:
            raise RuntimeError(text)
        return real(run, epoch, *args)
    monkeypatch.setattr(train_unet, "run_epoch", die)
    with pytest.raises(UserError) as err:
        train_unet.train_main(make_cfg(epochs=2))
    assert said in str(err.value) and re.search(r"last.pt is intact: resume=True .*epochs=2 .*continues from it",
                                                str(err.value))
    assert "use fewer num_workers" in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setattr(train_unet, "run_epoch", lambda *a: (_ for _ in ()).throw(RuntimeError("CUDA error: x")))
    with pytest.raises(RuntimeError, match="CUDA error"):  # any other RuntimeError is a bug: raised as it is
        train_unet.train_main(make_cfg(epochs=3, resume=True))


def test_a_dead_worker_names_a_small_dev_shm(make_cfg, monkeypatch):
    """A 64 MB /dev/shm (Docker's default) killed a worker: the message spoke only of memory."""
    exc = RuntimeError("DataLoader worker (pid(s) 15597) exited unexpectedly")
    usage = shutil.disk_usage("/")
    monkeypatch.setattr(train_unet.shutil, "disk_usage", lambda path: usage._replace(free=60 * 2**20))
    said = str(train_unet.worker_death(exc, make_cfg()))
    assert "; /dev/shm, through which workers pass batches, has 60 MB free (Docker's default is 64 MB: run the " \
           "container with --shm-size=2g); to need less memory" in said
    monkeypatch.setattr(train_unet.shutil, "disk_usage", lambda path: usage._replace(free=2**33))
    assert "/dev/shm" not in str(train_unet.worker_death(exc, make_cfg()))


def test_a_hangup_stops_like_a_sigterm_unless_ignored_and_a_closed_terminal_is_not_written_to(monkeypatch):
    """SIGHUP (a closed terminal) ended a run at once, its epoch lost and its caches left. Now it stops as
    SIGTERM does, held by interrupts_held like the others; ignored (nohup) it stays ignored; and a write to
    the closed terminal (EIO) no longer raises."""
    import signal

    monkeypatch.setattr(train_unet, "STOP_SIGNAL", [])
    before = signal.getsignal(signal.SIGHUP)
    with pytest.raises(KeyboardInterrupt):
        with train_unet.sigterm_as_exit():
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(1)
    assert train_unet.stop_word().startswith("stopped by SIGHUP (its terminal closed")
    assert signal.getsignal(signal.SIGHUP) == before
    train_unet.STOP_SIGNAL.clear()
    with pytest.raises(KeyboardInterrupt):
        with train_unet.interrupts_held():
            os.kill(os.getpid(), signal.SIGHUP)
    assert train_unet.stop_word().startswith("stopped by SIGHUP")
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with train_unet.sigterm_as_exit():
            os.kill(os.getpid(), signal.SIGHUP)  # nohup's: nothing happens
            time.sleep(0.2)
    finally:
        signal.signal(signal.SIGHUP, before)

    class ClosedTerminal(io.StringIO):
        def write(self, text):
            raise OSError(errno.EIO, "Input/output error")
    out = train_unet.OutputReaderGone(ClosedTerminal(), "stderr")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert out.write("stopped\n") == len("stopped\n") and out.gone


def test_held_interrupts_are_raised_after_the_block_and_handlers_come_back(monkeypatch):
    """A held SIGTERM is named as one ("stopped by SIGTERM"): a benchmark's row stopped by the kernel when the
    benchmark was killed said "interrupted", as if by a Ctrl-C."""
    import signal

    monkeypatch.setattr(train_unet, "STOP_SIGNAL", [])
    before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    done = []
    with pytest.raises(KeyboardInterrupt):
        with train_unet.interrupts_held():
            os.kill(os.getpid(), signal.SIGTERM)
            done.append("rest of the block")
    assert done == ["rest of the block"] and train_unet.stop_word() == "stopped by SIGTERM"
    assert (signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)) == before
    with train_unet.interrupts_held():  # nothing held: nothing raised
        pass


def test_a_group_stop_ending_the_workers_mid_write_waits_for_the_block_too(monkeypatch):
    """A stop sent to the whole process group ends the DataLoader's workers as well, and torch's SIGCHLD
    handler raised in the middle of the epoch's writes (best.pt and history.csv lost, in 1 of 8 real
    trials); an ignored Ctrl-C (a script's background job) became a stop inside the block."""
    import signal

    def torch_handler(signum, frame):
        raise RuntimeError("DataLoader worker (pid 1) is killed by signal: Terminated. ")
    previous = signal.signal(signal.SIGCHLD, torch_handler)
    done = []
    try:
        with pytest.raises(RuntimeError, match="killed by signal: Terminated"):
            with train_unet.interrupts_held():
                os.kill(os.getpid(), signal.SIGCHLD)
                done.append("rest of the block")
        assert done == ["rest of the block"] and signal.getsignal(signal.SIGCHLD) is torch_handler
    finally:
        signal.signal(signal.SIGCHLD, previous)
    ignored = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with train_unet.interrupts_held():
            os.kill(os.getpid(), signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, ignored)


@pytest.mark.skipif(os.name != "posix", reason="process groups and SIGTERM are POSIX's")
def test_a_stop_sent_to_the_whole_process_group_exits_130_without_a_traceback(make_data, tmp_path):
    """Slurm's scancel, `kill -TERM -PGID` and timeout signal the DataLoader's workers too; torch then
    reported their end as a RuntimeError: a traceback and exit 1 (or 'Exception ignored' at exit)."""
    import signal
    import subprocess
    import sys
    import time

    data = make_data(count=40, size=32)
    run = subprocess.Popen([sys.executable, str(Path(train_unet.__file__)), f"data_dir={data}", "image_size=32",
                            f"checkpoint_dir={tmp_path / 'ck'}", "epochs=500", "batch_size=2", "num_workers=1",
                            "progress=False", "device=cpu", "use_amp=False", "logger=csv", "cpu_probe=False",
                            "encoder_name=resnet18"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)  # its own process group, as a job under a scheduler
    deadline = time.monotonic() + 120
    while not (tmp_path / "ck" / "history.csv").is_file() and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGTERM)
    _, err = run.communicate(timeout=60)
    assert run.returncode == 130, err[-2000:]
    assert "Traceback" not in err and "Exception ignored" not in err, err[-2000:]
    # "stopped by SIGTERM" once the main process's handler has run; where the workers' end was reported
    # first (stopped_with_its_workers), the stop is named as an interruption
    assert re.search(r"(interrupted|stopped by SIGTERM): checkpoints written so far are intact; resume=True "
                     r"data_dir=.* epochs=500 .*checkpoint_dir=.* continues$", err.strip()), err[-2000:]


@pytest.mark.parametrize("both", [False, True], ids=["stdout", "2>&1"])
def test_a_run_whose_output_reader_ended_goes_on_and_says_so(make_data, tmp_path, both):
    """`python train_unet.py | head -3`: the first print after head ended raised BrokenPipeError, and the run
    stopped with exit 1, no word, and no checkpoint. With `2>&1 | head` (a user's report) the note itself,
    or the progress bar in the first epoch, did so: no epoch was written, and predict wrote no mask."""
    import subprocess
    import sys

    data = make_data(count=12, size=32)
    run = subprocess.Popen([sys.executable, str(Path(train_unet.__file__)), f"data_dir={data}", "image_size=32",
                            f"checkpoint_dir={tmp_path / 'ck'}", "epochs=2", "batch_size=2", f"progress={both}",
                            "device=cpu", "use_amp=False", "cpu_probe=False", "encoder_name=resnet18"],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT if both else subprocess.PIPE, text=True)
    run.stdout.readline()  # the banner's first line, then the reader ends
    run.stdout.close()
    err = "" if both else run.stderr.read()
    assert run.wait(timeout=300) == 0, err[-2000:]
    assert both or "Traceback" not in err and "note: the output's reader has ended (a pipe such as | head): the " \
        "command goes on without printing there; its results are written as usual" in err, err[-2000:]
    assert len((tmp_path / "ck" / "history.csv").read_text().splitlines()) == 3  # both epochs


def test_stopped_workers_are_told_from_failed_ones():
    assert train_unet.stopped_with_its_workers(RuntimeError("DataLoader worker (pid 15098) is killed by signal: "
                                                            "Terminated. "))
    assert not train_unet.stopped_with_its_workers(RuntimeError("DataLoader worker (pid 1) is killed by signal: "
                                                                "Killed. "))  # out of memory: a failure
    assert not train_unet.stopped_with_its_workers(RuntimeError("CUDA error: out of memory"))


def test_an_empty_checkpoint_dir_is_refused_before_the_current_folder_is_touched(make_cfg, tmp_path, monkeypatch):
    """checkpoint_dir= (an unset shell variable) meant the current folder: the user's own config.json was
    moved to previous/ as an 'earlier run' and 340 MB of checkpoints landed beside their files."""
    project = tmp_path / "project"
    project.mkdir()
    (project / "config.json").write_text("the user's")
    monkeypatch.chdir(project)
    for key in ("checkpoint_dir", "data_dir"):
        with pytest.raises(UserError, match=f"^{key}= is empty: give a path"):
            train_unet.train(make_cfg(**{key: ""}))
    assert [p.name for p in project.iterdir()] == ["config.json"]


def test_more_workers_than_the_machine_can_run_is_refused_before_anything_moves(make_cfg, tmp_path):
    """num_workers=999 on 2 cores: the kernel killed the run out of memory and left workers running."""
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "history.csv").write_text("an earlier run's")
    most = train_unet.WORKERS_PER_CORE * train_unet.cores_per_process()
    with pytest.raises(UserError, match=f"num_workers={most + 1} is more than this machine can run.*at most {most}$"):
        train_unet.train(make_cfg(num_workers=most + 1))
    assert [p.name for p in ckpt.iterdir()] == ["history.csv"]  # not moved aside for a run that cannot start


def test_small_messages_from_a_users_review(make_cfg, data_dir, tmp_path):
    """A key in capitals gets 'did you mean'; a folder named last.pt is not said to be missing; a broken
    link among the images is named as one, not as an image without a mask."""
    with pytest.raises(UserError, match="unknown key 'EPOCHS': did you mean 'epochs'"):
        train_unet.parse_overrides(["EPOCHS=2"])
    (tmp_path / "ckpt" / "last.pt").mkdir(parents=True)
    with pytest.raises(UserError, match=r"last.pt is not a file: start without resume"):
        train_unet.train(make_cfg(resume=True))
    (data_dir / "images" / "gone.png").symlink_to(tmp_path / "nowhere.png")
    with pytest.raises(UserError, match=r"gone.png is a broken link \(it points to .*nowhere.png"):
        train_unet.find_pairs(data_dir)


@pytest.mark.parametrize("values, hint", [
    ({0, 1, 2, 3}, "set num_classes=4 or fix the mask"),
    ({0, 1, 200}, r"it stands far above the others \(\[0, 1\]\): a stray value\? fix the mask, or set num_classes=201"),
    ({200}, r"holds class 200 but num_classes=3 \(255 = void is allowed\): set num_classes=201 or fix the mask$"),
])
def test_a_class_beyond_num_classes_gets_the_likely_fix(values, hint, tmp_path):
    mask = np.array(sorted(values), np.uint8).reshape(1, -1)
    path = tmp_path / "m.png"
    cv2.imwrite(str(path), mask)
    with pytest.raises(UserError, match=hint):
        train_unet.read_mask(path, 3)


@pytest.mark.parametrize("names", [False, True])
def test_the_num_classes_suggested_for_class_index_masks_is_the_whole_sets(make_data, make_cfg, names):
    """0..3 and void in palette masks, the first holding 0..2 only: num_classes=1 suggested num_classes=3,
    and the run with it was refused at the next mask: "holds class 3 ... set num_classes=4" (a user's
    report). class_names.txt's lines count too: a class no mask holds yet."""
    data = make_data("classes", count=6, size=32, num_classes=4)
    masks = sorted((data / "masks").iterdir())
    first = cv2.imread(str(masks[0]), cv2.IMREAD_UNCHANGED)
    first[first == 3] = 2
    first[0, 0] = 255
    cv2.imwrite(str(masks[0]), first)
    if names:
        (data / "class_names.txt").write_text("background\na\nb\nc\nd\n")
    want = 5 if names else 4
    for num_classes, match in ((1, rf"holds values \[0, 1, 2, 255\]: with num_classes=1 .*set num_classes={want}"),
                               (3, rf"holds class 3 but num_classes=3 .*set num_classes={want}")):
        one_line_error(train_unet.prepare_data, make_cfg(data_dir=str(data), num_classes=num_classes), match=match)


def test_the_num_classes_suggested_holds_a_voc_like_sets_classes_beyond_15(make_data, make_cfg):
    """Indices 0..20 over the masks, the first holding 0..5: "set num_classes=6", then "holds class 20 ...
    set num_classes=21" at the next mask (review). A stray 200 in a set of 0..3 is no class count."""
    data = make_data("voc", count=4, size=32)
    for i, path in enumerate(sorted((data / "masks").iterdir())):
        cv2.imwrite(str(path), np.resize(np.arange(6 * i, 6 * i + 6) % 21, (32, 32)).astype(np.uint8))
    one_line_error(train_unet.prepare_data, make_cfg(data_dir=str(data), num_classes=3),
                   match=r"holds class 5 but num_classes=3 .*: set num_classes=21 or fix the mask$")
    assert train_unet.set_classes([{0, 1, 2}, {0, 3, 200}], {"data_dir": str(data)}) == 4


def test_a_data_dir_that_cannot_be_listed_keeps_its_one_line_message(make_cfg, tmp_path, monkeypatch):
    """A folder entered but not listed (mode 711: a colleague's on a shared cluster) gave PermissionError's
    traceback from the split folders' names (review); checkpoint_dir under such an images/ folder too."""
    root = tmp_path / "shared"
    (root / "train" / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    real = Path.iterdir

    def iterdir(self):
        if self in (root, root / "images"):
            raise PermissionError(13, "Permission denied", str(self))
        return real(self)
    monkeypatch.setattr(Path, "iterdir", iterdir)
    one_line_error(train_unet.split_pairs, make_cfg(data_dir=str(root)), match=r"has train/ but no val/")
    (root / "images").mkdir()
    one_line_error(train_unet.check_not_in_a_data_set, root / "images" / "runs" / "r1",
                   match=r"is inside .*images, which is a data set's images folder")


@pytest.mark.parametrize("num_classes", [1, 3])
def test_masks_with_no_foreground_at_all_are_refused(make_cfg, data_dir, num_classes):
    """All-zero masks trained, and an IoU of 0.0000 was marked 'best' with no word of why (multi-class:
    'every mask holds only 0 and 255', which they do not)."""
    for path in (data_dir / "masks").iterdir():
        cv2.imwrite(str(path), np.zeros_like(cv2.imread(str(path), cv2.IMREAD_UNCHANGED)))
    with pytest.raises(UserError, match=r"every mask is all 0: there is no foreground to learn, and IoU would be "
                                        r"1\.0 for a model that predicts none"):  # it said 0 whatever the model did
        train_unet.train(make_cfg(num_classes=num_classes))
    logits = torch.full((2, num_classes, 8, 8), -5.0)  # a model predicting no foreground: the metric's IoU
    logits[:, 0] = 5.0 if num_classes > 1 else -5.0
    metric = train_unet.SegMetric(num_classes, "cpu")
    metric.update(logits, torch.zeros(2, 8, 8, dtype=torch.long))
    assert metric.compute()["iou"] == 1.0


@pytest.mark.parametrize("kind", ["LA", "RGBA"])
def test_masks_drawn_in_the_alpha_channel_are_refused(make_cfg, data_dir, kind):
    """A mask saved white on transparent (the shape only in its alpha) read as foreground everywhere: the run
    trained on it to the end without a word. Now the mask is named, with the fix; an alpha beside real values
    stays ignored."""
    from PIL import Image

    masks = sorted((data_dir / "masks").iterdir())
    for i, path in enumerate(masks):
        shape = cv2.imread(str(path), cv2.IMREAD_GRAYSCALE)
        flat = np.full_like(shape, 255) if i == 1 else shape
        channels = [flat] if kind == "LA" else [flat] * 3
        Image.fromarray(np.dstack([*channels, np.where(shape > 0, 255, 0).astype(np.uint8)]), kind).save(path)
    with pytest.raises(UserError, match=rf"mask .*{masks[1].name} is 255 everywhere and draws its shape in the "
                                        r"alpha channel \(transparency\)"):
        train_unet.train(make_cfg(epochs=1))
    assert (train_unet.decode_mask(masks[0]) == cv2.imread(str(masks[0]), cv2.IMREAD_UNCHANGED)[..., 0]).all()


def test_masks_with_no_background_at_all_are_refused(make_cfg, data_dir):
    """Binary masks all foreground (all 255) trained to an IoU near 1 that says nothing: refused, as all-0 ones."""
    for path in (data_dir / "masks").iterdir():
        cv2.imwrite(str(path), np.full_like(cv2.imread(str(path), cv2.IMREAD_UNCHANGED), 255))
    with pytest.raises(UserError, match="no mask holds a 0 \\(background\\): every pixel is foreground"):
        train_unet.train(make_cfg())


def test_the_worker_limit_counts_the_cores_this_process_may_use(monkeypatch):
    """Under taskset or a container's cpuset the machine's core count is not this process's."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert train_unet.cores_per_process() == 1
    with pytest.raises(UserError, match="num_workers=5 is more than this machine can run: 1 core"):
        train_unet.check_worker_count({"num_workers": 5})


def test_more_workers_than_cores_get_the_scripts_note_not_torchs_warning(monkeypatch, capsys):
    """num_workers=8 on 2 cores: torch's raw UserWarning with a site-packages path, twice, before the banner,
    and an epoch 3x slower than at the default, with no word of the script's."""
    import warnings

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    train_unet.check_worker_count({"num_workers": 8})
    assert capsys.readouterr().out == ("note: num_workers=8 on 2 core(s) per process here: the workers share the cores "
                                       "with the training itself and each other, which slows an epoch; "
                                       "num_workers=None picks for this machine\n")
    train_unet.check_worker_count({"num_workers": 2})
    assert capsys.readouterr().out == ""
    warn = ("import warnings, train_unet; warnings.warn('This DataLoader will create 8 worker processes in total. Our "
            "suggested max number of worker in current system is 2', UserWarning)")
    out = subprocess.run([sys.executable, "-c", warn], capture_output=True, text=True,
                         cwd=Path(train_unet.__file__).parent)
    assert out.returncode == 0 and "DataLoader" not in out.stderr, out.stderr


@pytest.mark.parametrize("call, arg, said", [
    ("parse_overrides", "epochs=2", "'epochs=2': pass the settings as a list of key=value strings"),
    ("run_benchmark", "configs=fp32", "'configs=fp32': pass the settings as a list of key=value strings"),
    ("train", None, "the config is NoneType: pass a dict such as dict(train_unet.CONFIG, data_dir=...)"),
    ("prepare_data", {"data_dir": "x", "batchsize": 2}, "unknown key 'batchsize': did you mean 'batch_size'?"),
    ("predict", {"checkpoint": "c.pt", "input": "i", "output": "o", "backed": "onnxruntime"},
     "unknown key 'backed': did you mean 'backend'?"),
    ("predict", {"checkpoint": "c.pt", "input": "i", "output": "o", "overlays": True},
     "unknown key 'overlays': did you mean 'overlay'?"),
    ("predict", ["input=i"], "the options are list: pass a dict of the command's keys"),
    ("export", {"checkpoint": "c.pt", "output": "d", "opset": 18}, "unknown key 'opset': known keys: checkpoint"),
])
def test_the_librarys_documented_calls_say_a_wrong_argument_in_one_line(call, arg, said):
    """A string where a list goes was iterated a character at a time ("argument 'e' is not key=value"),
    train(None) was Python's TypeError, and prepare_data took a typo silently (and a partial dict: KeyError);
    predict ran without backed=onnxruntime, took overlays=True for a string key's bad value, and export's
    opset=18 was a KeyError."""
    one_line_error(getattr(train_unet, call), arg, match=re.escape(said))


@pytest.mark.parametrize("value, said", [
    ("runs/r1/last.pt", "to continue the run in runs/r1, give checkpoint_dir=runs/r1 resume=True"),
    ("runs/r1/best.pt", "give checkpoint_dir=runs/r1 resume=True (it continues from last.pt)"),
    ("my runs/r1", "to continue the run in my runs/r1, give checkpoint_dir='my runs/r1' resume=True"),
    ("maybe", "(default False)"),
])
def test_resume_given_a_run_says_how_to_continue_it(value, said):
    """resume=checkpoints/last.pt, the natural guess, was told only that it is not true or false."""
    message = one_line_error(train_unet.parse_overrides, [f"resume={value}"], match="is not true or false")
    assert message.endswith(said)
    message = one_line_error(train_unet.validate_config, {"resume": value}, match="must be true or false")
    assert message.endswith(said if value != "maybe" else "must be true or false")


def test_resume_empty_or_none_names_no_run_in_the_current_folder():
    """resume= and CONFIG's "resume": None were told 'to continue the run in ., give checkpoint_dir=.': Path("")
    is the current folder, where no run was."""
    assert one_line_error(train_unet.parse_overrides, ["resume="], match="is not true or false").endswith(
        "is not true or false (default False)")
    assert one_line_error(train_unet.validate_config, {"resume": None}, match="must be").endswith(
        "resume=None must be true or false")


@pytest.mark.parametrize("call, args, said", [
    ("detect_hardware", ("gpu",), "device='gpu' is not supported: use auto, cpu, cuda, cuda:N or mps"),
    ("decide_precision", ("False",), "use_amp='False' must be true or false"),
    ("decide_precision", (True, "bf8"), "amp_dtype='bf8' is not allowed: use one of auto, bfloat16, float16"),
    ("decide_precision", (True, "auto", "yes"), "force_amp_dtype='yes' must be true or false"),
    ("prepare_data", ({"data_dir": "x", "val_fraction": "0.2"},), "val_fraction='0.2' must be a number"),
    ("read_image", ("image.png", 2), "in_channels=2 is not allowed: use one of 1, 3"),
    ("read_mask", ("mask.png", 0), "num_classes=0 must be a whole number from 1 to 254"),
    ("read_mask", ("mask.png", True), "num_classes=True must be a whole number from 1 to 254"),
])
def test_the_librarys_hardware_precision_and_data_calls_check_their_values(call, args, said):
    """detect_hardware("gpu") was torch's RuntimeError listing 20 device types; decide_precision(hw, "False")
    chose bf16 (a string is true) and amp_dtype="bf8" an AssertionError; prepare_data's values were not
    checked at all ("type str doesn't define __round__"); read_image(path, 2) gave a grey image, read_mask(path,
    0) a hint about evenly spaced greys."""
    if call == "decide_precision":
        args = (train_unet.detect_hardware("cpu"), *args)
    one_line_error(getattr(train_unet, call), *args, match=re.escape(said))


def test_library_values_of_numpy_and_pathlib_types_are_taken(tmp_path):
    """read_mask(path, np.int64(1)) (a count from numpy) was refused as no whole number."""
    cv2.imwrite(str(tmp_path / "m.png"), np.array([[0, 255]], np.uint8))
    assert train_unet.read_mask(tmp_path / "m.png", np.int64(1)).tolist() == [[0, 1]]


def test_read_mask_notes_a_binary_mask_read_with_several_classes(tmp_path, capsys):
    """read_mask(path, 3) of a 0/255 mask gave its foreground as void, unsaid: scored, it counted for nothing
    (training refuses such a data set; one file cannot tell, so a note)."""
    cv2.imwrite(str(tmp_path / "m.png"), np.array([[0, 255]], np.uint8))
    assert train_unet.read_mask(tmp_path / "m.png", 3).tolist() == [[0, 255]]
    assert f"note: mask {tmp_path / 'm.png'} holds only 0 and 255: with num_classes=3, 255 is void (not scored)" \
        in capsys.readouterr().out
    assert train_unet.read_mask(tmp_path / "m.png", 1).tolist() == [[0, 1]] and capsys.readouterr().out == ""
    cv2.imwrite(str(tmp_path / "v.png"), np.array([[0, 1, 255]], np.uint8))  # classes with void: no note
    assert train_unet.read_mask(tmp_path / "v.png", 3).tolist() == [[0, 1, 255]] and capsys.readouterr().out == ""


def test_a_config_of_numpy_values_and_tuples_is_taken_as_the_command_line_gives_them(tmp_path):
    """A sweep's values (np.arange, a DataFrame row) were refused with false messages: 'batch_size=np.int64(2)
    must be a whole number or auto', 'use_amp=np.False_ must be true or false'; (0, 255) for intensity_range
    'must be a list'. Now they are the Python values the command line gives."""
    given = {"batch_size": np.int64(2), "learning_rate": np.float64(1e-3), "image_size": np.int32(64),
             "use_amp": np.bool_(False), "intensity_range": (0, np.uint16(4095)), "class_weights": np.array([1, 3.0]),
             "checkpoint_dir": tmp_path / "run", "weight_decay": np.float32(1e-4),
             "tile_overlap": np.float16(0.25)}
    cfg = train_unet.validate_config(train_unet.check_config_dict(given))
    # np.float32(1e-4) is 1e-4 as typed: float32's 9.999999747378752e-05 was recorded, and a resume with 1e-4
    # refused ('cannot resume exactly: ... was trained with weight_decay=9.999999747378752e-05')
    assert {k: cfg[k] for k in given} == {"batch_size": 2, "learning_rate": 1e-3, "image_size": 64, "use_amp": False,
                                         "intensity_range": [0, 4095], "class_weights": [1.0, 3.0],
                                         "checkpoint_dir": str(tmp_path / "run"), "weight_decay": 1e-4,
                                         "tile_overlap": 0.25}
    weights = train_unet.check_config_dict({"class_weights": np.array([1, 0.3], np.float32)})["class_weights"]
    assert weights == [1.0, 0.3]  # float32's 0.30000001192092896 in an array too
    assert type(cfg["batch_size"]) is int and type(cfg["use_amp"]) is bool
    opts = train_unet.check_command_dict({"tile_batch_size": np.int64(4)}, train_unet.PREDICT_CONFIG)
    assert type(opts["tile_batch_size"]) is int


def test_a_command_to_paste_is_quoted_for_the_shell_it_runs_in():
    """shlex's single quotes stay in the path in Windows' cmd.exe ('C:\\runs\\model.onnx' not found)."""
    assert train_unet.cli_value("my runs/r1", posix=True) == "'my runs/r1'"
    assert train_unet.cli_value(r"C:\runs\model.onnx", posix=False) == r"C:\runs\model.onnx"
    assert train_unet.cli_value(r"C:\my runs\model.onnx", posix=False) == r'"C:\my runs\model.onnx"'


def test_a_process_started_by_a_benchmark_through_a_launcher_is_not_stopped():
    """stop_with_benchmark took a parent of another pid (a shell between the benchmark and its row) for the
    benchmark's end, and the row stopped itself at once."""
    import subprocess
    import sys

    code = ("import os; os.environ['UNET_BENCHMARK_PARENT'] = str(os.getpid()); import train_unet as T; "
            "T.stop_with_benchmark(); print('trained on')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=Path(train_unet.__file__).parent, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "trained on", (out.returncode, out.stderr[-500:])


@pytest.mark.skipif(os.name != "posix", reason="a launch that ignores SIGINT is a POSIX shell's `&`")
def test_a_row_of_a_benchmark_started_in_the_background_takes_the_benchmarks_ctrl_c():
    """A script's `python train_unet.py benchmark &` starts it with SIGINT ignored, and its rows inherited
    that: the SIGINT a stopped benchmark sends its row (stop_child) did nothing, and the benchmark waited
    until the row had trained all its epochs."""
    import signal
    import subprocess
    import sys

    code = ("import os, signal; os.environ['UNET_BENCHMARK_PARENT'] = str(os.getppid()); import train_unet as T; "
            "T.stop_with_benchmark(); print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(train_unet.__file__).parent,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # as `&` starts it
    assert out.returncode == 0 and out.stdout.strip() == "True", (out.returncode, out.stderr[-500:])


def test_the_open_file_limit_met_where_nothing_checked_it_is_one_line(monkeypatch, capsys):
    """num_workers=0 at ulimit -n 12: the image cache's np.load met the limit, and the run ended in
    OSError's traceback (a user's report). Any command that meets it says it in one line."""
    import errno

    def run_command(command, args):
        raise OSError(errno.EMFILE, "Too many open files")
    monkeypatch.setattr(train_unet, "run_command", run_command)
    assert train_unet.main(["epochs=1"]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"error: too many open files( \(the limit here is \d+, ulimit -n\))?: raise it \(ulimit -n "
                        r"4096; in Docker --ulimit nofile=4096\)\n", err), err


def test_decide_precision_takes_amp_dtypes_short_names_as_configs_do():
    hw = train_unet.detect_hardware("cpu")
    assert train_unet.decide_precision(hw, True, "bf16", force=True).name == "bf16"


def test_prepare_data_takes_a_partial_config_as_train_does(data_dir):
    train, val = train_unet.prepare_data({"data_dir": str(data_dir)})  # KeyError: 'seed'
    assert len(train) + len(val) == 12
    assert train_unet.prepare_data({"data_dir": data_dir}) == (train, val)  # a Path, as a notebook has it


@pytest.mark.parametrize("sub", ["masks", "images", "images/run1"])
def test_a_checkpoint_dir_in_a_data_sets_folders_is_refused(make_cfg, data_dir, sub):
    """checkpoint_dir=data/x/masks wrote best.pt, last.pt and tensorboard/ among the masks; data/x/images/run1
    put them inside the images folder, noted as an entry not read by every later run."""
    part = sub.split("/")[0]
    before = sorted(p.name for p in (data_dir / part).iterdir())
    inside = rf" is inside .*{part}, which is" if "/" in sub else " is"
    one_line_error(train_unet.train, make_cfg(checkpoint_dir=str(data_dir / sub)),
                   match=rf"checkpoint_dir=.*{sub}{inside} a data set's {part} folder: checkpoints and logs would go "
                         rf"among its files; choose another checkpoint_dir \(e.g. {data_dir.parent / 'checkpoints' / 'data'}\)$")
    assert sorted(p.name for p in (data_dir / part).iterdir()) == before


def test_a_checkpoint_dir_below_a_folder_named_images_that_holds_no_images_is_taken(tmp_path, data_dir):
    """~/images/projects/run1 with a ~/masks of other uses beside ~/images was refused as inside a data set's
    images folder, though ~/images holds no image of its own; a real data set's folder above still refuses."""
    home = tmp_path / "home"
    (home / "images" / "projects").mkdir(parents=True)
    (home / "masks").mkdir()
    train_unet.check_not_in_a_data_set(home / "images" / "projects" / "run1")
    with pytest.raises(train_unet.UserError, match="is inside .*images, which is a data set's images folder"):
        train_unet.check_not_in_a_data_set(data_dir / "images" / "projects" / "run1")


def test_the_checkpoint_dir_suggested_for_a_split_data_sets_folder_is_outside_the_data_set(make_data, tmp_path):
    """checkpoint_dir=c/train/images suggested c/checkpoints/train: inside the data set again."""
    make_data("c/train", count=4, size=32), make_data("c/val", count=2, size=32)
    one_line_error(train_unet.check_not_in_a_data_set, tmp_path / "c" / "train" / "images",
                   match=rf"choose another checkpoint_dir \(e.g. {tmp_path / 'checkpoints' / 'c'}\)$")


def test_a_training_set_of_one_image_at_32_px_gets_a_fix_that_is_not_refused(make_cfg):
    """1 training image at image_size=32, batch_size=2: 'lower batch_size', and batch_size=1 was then refused
    at 32 px ('use batch_size >= 2 or image_size >= 64'): advice in a circle (user test)."""
    pairs = [("0.png", "0.png")]
    one_line_error(train_unet.check_enough_samples, pairs, make_cfg(batch_size=2, image_size=32),
                   match=r"fewer than batch_size=2: give batch_size=1 image_size=64, or add images$")
    one_line_error(train_unet.check_enough_samples, pairs * 2, make_cfg(batch_size=4, image_size=32),
                   match=r"fewer than batch_size=4: lower batch_size or add images$")
    train_unet.validate_config(make_cfg(batch_size=1, image_size=64))  # the fix is taken


def test_the_data_line_says_how_many_images_each_epoch_leaves_out(make_cfg, capsys):
    """10 training images in batches of 4: 2 of them sat out every epoch without a word."""
    train_unet.train(make_cfg(batch_size=4))
    out = capsys.readouterr().out
    assert "10 train / 2 val images" in out
    assert "2 batches of 4, 2 optimizer steps/epoch; 2 random training image(s) left out each epoch" in out
    train_unet.train(make_cfg(batch_size=5))
    assert "left out" not in capsys.readouterr().out
    train_unet.train(make_cfg(batch_size=10))  # it said "1 batches of 10, 1 optimizer steps/epoch"
    assert "1 batch of 10, 1 optimizer step/epoch" in capsys.readouterr().out


def test_early_stopping_counts_the_epochs_without_improvement_not_the_patience(capsys):
    """A resumed run can stop with more epochs since its best than the patience (the patience was raised
    from 1 to 2 on resume, or resumed past it): the line says how many it has been."""
    run = type("Run", (), {"since_best": 3, "best_iou": 0.5})()
    assert train_unet.stop_early(run, 5, {"early_stopping_patience": 2, "epochs": 10})
    assert "has not improved for 3 epochs (best 0.5000; early_stopping_patience=2)" in capsys.readouterr().out
    assert not train_unet.stop_early(run, 10, {"early_stopping_patience": 2, "epochs": 10})  # the last epoch
    run.since_best = 1
    assert train_unet.stop_early(run, 5, {"early_stopping_patience": 1, "epochs": 10})
    assert "has not improved for 1 epoch (best" in capsys.readouterr().out  # not '1 epochs'


def test_files_training_does_not_read_are_named_not_silently_dropped(make_data, make_cfg, capsys):
    """Half the pairs in images/sub and masks/sub trained on the other half without a word; a .webp
    image read as "no partner" though its mask's partner was right there."""
    data = make_data(count=12, size=32)
    for sub in ("images", "masks"):
        (data / sub / "sub").mkdir()
        for path in sorted((data / sub).glob("*.png"))[:6]:
            path.rename(data / sub / "sub" / path.name)
    (data / "images" / "readme.txt").write_text("notes")
    (data / "images" / ".hidden.png").write_bytes(b"")  # named like an image: named too (was silent)
    (data / "masks" / "._shape_0000.png").write_bytes(b"")  # macOS metadata: not
    train, val = train_unet.prepare_data(make_cfg(data_dir=str(data), batch_size=2))
    assert len(train + val) == 6
    assert ("note: 4 entries in " in capsys.readouterr().out)  # images/sub/, masks/sub/, readme.txt, .hidden.png
    assert train_unet.unread_entries(data) == ["images/.hidden.png", "images/readme.txt", "images/sub/", "masks/sub/"]
    (data / "images" / ".hidden.png").unlink()
    for path in sorted((data / "images").glob("*.png")):
        path.unlink()
    (data / "images" / ".ipynb_checkpoints").mkdir()  # hidden: neither read nor named
    one_line_error(train_unet.find_pairs, data, match=r"no images .* \(its subfolders sub/ are not searched: ")
    webp = make_data(name="webp", count=4, size=32)
    first = sorted((webp / "images").glob("*.png"))[0]
    first.rename(first.with_suffix(".webp"))
    one_line_error(train_unet.find_pairs, webp, match=f"{first.stem}.webp is not a format this script reads")


def test_ctrl_c_while_the_libraries_load_is_a_stop_not_a_traceback():
    """The first seconds of every command load torch; Ctrl-C there printed a 30-line traceback. Here
    the SIGINT arrives as `import torch` starts, every time."""
    code = ("import builtins, os, runpy, signal, sys\n"
            "real = builtins.__import__\n"
            "def hooked(name, *args, **kwargs):\n"
            "    if name == 'torch' and 'torch' not in sys.modules:\n"
            "        os.kill(os.getpid(), signal.SIGINT)\n"
            "    return real(name, *args, **kwargs)\n"
            "builtins.__import__ = hooked\n"
            "sys.argv = ['train_unet.py', '--help']\n"
            f"runpy.run_path({str(Path(train_unet.__file__))!r}, run_name='__main__')\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 130 and run.stdout == ""
    assert run.stderr.strip() == "interrupted: while loading its libraries; nothing was written"
    other_rank = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                env={**os.environ, "RANK": "1", "WORLD_SIZE": "2"})  # torchrun's: said once, by rank 0
    assert other_rank.returncode == 130 and other_rank.stderr == ""


def test_settings_onnxruntime_fixes_are_noted_when_changed(capsys):
    """backend=onnxruntime runs its fp32 graph: amp_dtype=bfloat16 channels_last=True did nothing, silently."""
    opts = {**train_unet.PREDICT_CONFIG, "backend": "onnxruntime", "amp_dtype": "bf16", "channels_last": True}
    fixed = train_unet.validate_predict(opts)
    assert fixed["use_amp"] is False and fixed["channels_last"] is False
    assert capsys.readouterr().out.strip() == ("note: amp_dtype, channels_last ignored: backend=onnxruntime runs the "
                                               "exported fp32 graph in the contiguous layout")
    train_unet.validate_predict({**train_unet.PREDICT_CONFIG, "backend": "onnxruntime", "channels_last": False})
    train_unet.validate_predict({**opts, "backend": "torch"})
    assert capsys.readouterr().out == ""  # as the backend runs it anyway, or a backend that does it


def test_accumulation_groups_an_epoch_does_not_fill_are_said():
    """accumulation_steps=8 over 4 batches took one step over 4 batches, with no word of it."""
    assert train_unet.short_accumulation(4, 8) == ("; accumulation_steps=8 is more than the epoch's 4 batches: "
                                                   "each epoch takes one optimizer step over 4")
    assert train_unet.short_accumulation(10, 4) == "; each epoch's last optimizer step averages 2 batch(es), not 4"
    assert train_unet.short_accumulation(8, 4) == train_unet.short_accumulation(5, 1) == ""


def test_predict_output_named_like_an_image_file_is_refused(tmp_path):
    """output=mask.png made a folder named mask.png; a folder of that name already there is still used."""
    opts = {**train_unet.PREDICT_CONFIG, "output": str(tmp_path / "mask.png")}
    one_line_error(train_unet.validate_predict, opts, match=f"output={tmp_path / 'mask.png'} names a file.*"
                                                           f"e.g. output={tmp_path / 'mask'}")
    (tmp_path / "mask.png").mkdir()
    assert train_unet.validate_predict(opts)["output"] == str(tmp_path / "mask.png")


def test_the_banner_says_when_earlier_runs_kept_in_previous_grow_large(tmp_path, monkeypatch):
    """Each fresh run moves the last one to previous/ and nothing is ever deleted: six debug runs filled
    2 GB unseen. Past ARCHIVE_NOTE_BYTES the banner says how much is kept there."""
    previous = tmp_path / "previous"
    for name, size in (("20260101-000000", 600), ("20260102-000000", 500)):
        (previous / name / "tensorboard").mkdir(parents=True)
        (previous / name / "last.pt").write_bytes(b"x" * size)
        (previous / name / "tensorboard" / "events").write_bytes(b"x" * 100)
    monkeypatch.setattr(train_unet, "ARCHIVE_NOTE_BYTES", 1300)  # the two runs hold 1,300 bytes
    assert train_unet.archive_size_note(previous) == ""
    monkeypatch.setattr(train_unet, "ARCHIVE_NOTE_BYTES", 1299)
    assert train_unet.archive_size_note(previous).startswith(f" ({previous} now holds 2 earlier runs, ")
    assert train_unet.archive_size_note(previous).endswith("delete those you do not need; nothing there is "
                                                           "deleted for you)")


@pytest.mark.parametrize("rename, affix", [(lambda stem: f"{stem}_mask", "'_mask'"),
                                           (lambda stem: f"mask_{stem}", "'mask_'")])
def test_masks_named_with_a_word_added_are_told_to_be_renamed(make_data, rename, affix):
    """Masks named shape_0000_mask.png beside shape_0000.png: the error said the images had no partner
    ('add masks'), though every mask was there under another name."""
    root = make_data("affix", count=6, size=32)
    for mask in sorted((root / "masks").iterdir()):
        mask.rename(mask.with_name(rename(mask.stem) + mask.suffix))
    first = sorted((root / "masks").iterdir())[0]
    one_line_error(train_unet.find_pairs, root, match=f"6 of the masks in .* are named as the images with {affix} "
                                                      f"added .*rename them \\(e.g. {first.name} -> shape_0000.png\\)")
    for i, mask in enumerate(sorted((root / "masks").iterdir())):  # names of no relation: no rename advised
        mask.rename(mask.with_name(f"label{i}.png"))
    message = one_line_error(train_unet.find_pairs, root,
                             match="6 image\\(s\\) in .*images have no mask in .*masks .*: add masks")
    assert "rename" not in message


def test_masks_named_in_other_letter_case_are_told_to_be_renamed(make_data):
    """IMG_0000.png beside img_0000.png: matched exactly, so "6 file(s) have no partner ... add masks",
    though every mask was there (helper's report)."""
    root = make_data("case", count=6, size=32)
    for mask in sorted((root / "masks").iterdir()):
        mask.rename(mask.with_name(mask.stem.upper() + mask.suffix))
    one_line_error(train_unet.find_pairs, root,
                   match=r"6 of the masks in .*masks are named as their images in other letter case \(e.g. "
                         r"SHAPE_0000.png for shape_0000.png\): stems are matched exactly, so rename them \(e.g. "
                         r"SHAPE_0000.png -> shape_0000.png\)$")


def test_a_leading_tilde_is_the_home_folder(trained, tmp_path, monkeypatch, capsys):
    """make train ARGS="data_dir=~/x": make's sh leaves ~ in key=~/x as it is: the data set was 'not found', and
    checkpoint_dir=~/runs (or predict's output=~/masks) wrote into a folder named ~ in the current folder."""
    cfg, data = trained
    home = tmp_path / "home"
    (home / "sets").mkdir(parents=True)
    shutil.copytree(data, home / "sets" / "tiny")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    assert train_unet.main(["data_dir=~/sets/tiny", "checkpoint_dir=~/runs", "image_size=32", "batch_size=2",
                            "epochs=1", "progress=False", "use_amp=False"]) == 0
    assert (home / "runs" / "best.pt").is_file() and not (tmp_path / "~").exists()
    assert train_unet.main(["predict", "checkpoint=~/runs/best.pt", "input=~/sets/tiny/images", "output=~/masks",
                            "progress=False"]) == 0
    assert len(list((home / "masks").glob("*.png"))) == 8 and not (tmp_path / "~").exists()
    assert f"-> {home / 'masks'}" in capsys.readouterr().out
    # the config the stop and out-of-memory messages read holds the folder too: they looked for ./~/runs/last.pt
    for cfg in (train_unet.parse_overrides(["checkpoint_dir=~/runs"]), train_unet.check_config_dict(
            {"checkpoint_dir": "~/runs", "data_dir": "~/sets/tiny"})):
        assert cfg["checkpoint_dir"] == str(home / "runs")
        assert "last.pt is intact" in str(train_unet.out_of_memory(MemoryError(), cfg))
    assert len(train_unet.prepare_data({"data_dir": "~/sets/tiny", "batch_size": 2})[0]) == 6  # a notebook's call


def test_data_dir_at_the_train_part_of_a_split_gets_a_note(make_data):
    """data_dir=d/split/train: '6 train / 2 val images', validation cut from the training images, val/ unread,
    unsaid. A note (a run may hold val/ out on purpose; runs begun so resume)."""
    root = make_data("split", count=8, size=32)
    for part, names in (("train", range(6)), ("val", range(6, 8))):
        for sub in ("images", "masks"):
            (root / part / sub).mkdir(parents=True)
            for i in names:
                (root / sub / f"shape_{i:04d}.png").rename(root / part / sub / f"shape_{i:04d}.png")
    for sub in ("images", "masks"):
        (root / sub).rmdir()
    for part, other in (("train", "val"), ("val", "train")):
        note = train_unet.half_a_split_note(root / part)
        assert re.fullmatch(rf"note: data_dir=.*split/{part} is the {part}/ part of a split: validation is cut from "
                            rf"its images by val_fraction, and .*split/{other}/ is not read; to train on train/ and "
                            rf"validate on val/, give data_dir=.*split", note)
    assert train_unet.half_a_split_note(root) is None
    cfg = {**train_unet.CONFIG, "seed": 0, "val_fraction": 0.2, "max_train_images": None}
    assert [len(part) for part in train_unet.split_pairs({**cfg, "data_dir": str(root / "train")})] == [5, 1]


def test_names_in_two_unicode_forms_pair(make_data):
    """Images named on Linux (é one character, NFC) and masks copied from macOS (e + accent, NFD): the names look
    alike, yet '3 image(s) have no mask (e.g. café.png ...)'. They pair; two such files in one folder are named."""
    import unicodedata

    root = make_data("accents", count=3, size=32)
    for i, name in enumerate(["über", "café", "naïve"]):
        (root / "images" / f"shape_{i:04d}.png").rename(root / "images" / f"{unicodedata.normalize('NFC', name)}.png")
        (root / "masks" / f"shape_{i:04d}.png").rename(root / "masks" / f"{unicodedata.normalize('NFD', name)}.png")
    pairs = train_unet.find_pairs(root)
    assert len(pairs) == 3 and all(image.exists() and mask.exists() for image, mask in pairs)
    assert all(unicodedata.normalize("NFC", image.stem) == unicodedata.normalize("NFC", mask.stem)
               for image, mask in pairs)
    (root / "images" / f"{unicodedata.normalize('NFD', 'café')}.jpg").write_bytes(b"")
    one_line_error(train_unet.find_pairs, root, match="share the stem 'café' \\(spelt in two Unicode forms")
    nfd = make_data("nfd", count=3, size=32)  # both sides copied from macOS: they paired before, in this order
    for i, name in enumerate(["ea", "fa", "été"]):
        for sub in ("images", "masks"):
            (nfd / sub / f"shape_{i:04d}.png").rename(nfd / sub / f"{unicodedata.normalize('NFD', name)}.png")
    stems = [image.stem for image, _ in train_unet.find_pairs(nfd)]
    assert stems == sorted(stems)  # the raw names' order: the seeded split of a run begun on them is kept


@pytest.mark.skipif(os.name == "nt", reason="a folder link needs a privilege on Windows")
def test_masks_linked_to_the_images_folder_are_named_so(make_data):
    """masks/ a link to images/ (a slip while setting up): each image was read as its own mask, and the
    error called the mask "a colour image"."""
    root = make_data("linked", count=6, size=32)
    shutil.rmtree(root / "masks")
    (root / "masks").symlink_to(root / "images", target_is_directory=True)
    one_line_error(train_unet.find_pairs, root, match=r"masks and .*images are one folder \(.*images\): masks are "
                                                      r"files of their own")


@pytest.mark.parametrize("names, fix", [
    (("train", "Val"), "has train/ and Val/, .*: rename Val/ to val/$"),
    (("train", "validation"), "has train/ and validation/, .*: rename validation/ to val/$"),
    (("Training", "val"), "has val/ and Training/, .*: rename Training/ to train/$"),
    (("Train", "Valid"), "has Train/ and Valid/, .*: rename Train/ to train/ and Valid/ to val/$")])
def test_split_folders_named_otherwise_are_told_to_be_renamed(make_data, make_cfg, tmp_path, names, fix):
    """train/ beside Val/ or validation/ was "has train/ but no val/" (or, both named otherwise, "images
    not found"), though the folder was right there."""
    root = tmp_path / "split"
    for name in names:
        make_data(f"split/{name}", count=4, size=32)
    if any((root / name).is_dir() and name not in names for name in ("train", "val")):
        pytest.skip("a file system that ignores letter case finds Val/ as val/: nothing to rename")
    one_line_error(train_unet.split_pairs, make_cfg(data_dir=str(root)),
                   match=rf"{root} {fix}")
    assert "but the split's folders are named train/ and val/: rename" in str(train_unet.misnamed_split(
        root, [(root / name).is_dir() for name in ("train", "val")]))


def test_a_run_refused_at_start_up_leaves_no_empty_checkpoint_folder(make_cfg, tmp_path):
    """A data error stopped the run after its checkpoint folder was made: an empty folder stayed behind
    for each refused attempt. One the user made stays."""
    empty = tmp_path / "empty"
    for sub in ("images", "masks"):
        (empty / sub).mkdir(parents=True)
    cfg = make_cfg(data_dir=str(empty), checkpoint_dir=str(tmp_path / "new" / "ck"))
    one_line_error(train_unet.train, cfg, match="no images")
    assert not (tmp_path / "new" / "ck").exists()
    (tmp_path / "mine").mkdir()
    one_line_error(train_unet.train, {**cfg, "checkpoint_dir": str(tmp_path / "mine")}, match="no images")
    assert (tmp_path / "mine").is_dir()


def test_no_images_names_the_fix(tmp_path):
    """An empty images/ folder (train) or input folder (predict) was named with no fix, unlike every other error."""
    data = tmp_path / "data"
    for sub in ("images", "masks"):
        (data / sub).mkdir(parents=True)
    one_line_error(train_unet.find_pairs, data, match=rf"^no images .* in {re.escape(str(data / 'images'))}: put the "
                   rf"images there, each with its mask of the same file name in {re.escape(str(data / 'masks'))}, or "
                   rf"give data_dir= the folder that holds images/ and masks/$")
    one_line_error(train_unet.list_images, data / "masks", match=r"^no images .*: give input= a folder of images, or "
                                                                  r"one image file$")
    (data / "images" / "a.gif").write_bytes(b"GIF89a")  # files there, of another type: converted, not 'put there'
    one_line_error(train_unet.find_pairs, data, match=r"\(1 file\(s\) of other types, e.g. a.gif\): convert them to "
                                                      r"one of these types$")
    one_line_error(train_unet.list_images, data / "images", match=r"\(1 file\(s\) of other types, e.g. a.gif\): "
                                                                   r"convert them to one of these types$")
    split = tmp_path / "split"  # train/ and val/: the part to fill is named, and no data_dir= that would circle back
    for part in ("train", "val"):
        for sub in ("images", "masks"):
            (split / part / sub).mkdir(parents=True)
    one_line_error(train_unet.find_pairs, split / "train", match=rf"in {re.escape(str(split / 'train' / 'masks'))}$")


def test_a_run_stopped_at_start_up_leaves_no_empty_folder_and_says_nothing_was_written(make_cfg, tmp_path,
                                                                                       monkeypatch, capsys):
    """Ctrl-C during the data check left an empty checkpoint folder; during the config check (the model
    library's import) it said 'checkpoints written so far are intact; resume=True continues'."""
    def stop(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_unet, "check_pairs", stop)
    with pytest.raises(KeyboardInterrupt):
        train_unet.train(make_cfg(checkpoint_dir=str(tmp_path / "new" / "ck")))
    assert not (tmp_path / "new" / "ck").exists()
    monkeypatch.setattr(train_unet, "parse_overrides", stop)
    assert train_unet.main(["epochs=1"]) == 130
    assert capsys.readouterr().err == "interrupted: stopped while the config was checked: nothing was written\n"


def test_the_data_check_weighs_the_sets_binary_convention_once(make_data, make_cfg, monkeypatch):
    """binary_others looks at every mask: called per pair, a set of 20,000 masks took minutes."""
    root = make_data("once", count=6, size=32)
    calls, real = [], train_unet.binary_others
    monkeypatch.setattr(train_unet, "binary_others", lambda values: calls.append(1) or real(values))
    train_unet.prepare_data(make_cfg(data_dir=str(root), batch_size=2))
    assert len(calls) == 1


def test_predicts_notes_on_its_images_read_no_header_on_the_main_thread(trained, tmp_path, monkeypatch, capsys):
    """The 16-bit, unused-range and outside-range notes read each float image's header (and a 16-bit TIFF's
    sample type) on predict's main thread, which on a GPU launches the model's kernels, every image where no
    note was due. Now each image is looked at on the reader thread that decoded it, by its decoded type."""
    import threading

    import tifffile

    cfg, _ = trained
    inp = tmp_path / "in"
    inp.mkdir()
    pixels = np.random.default_rng(0).random((32, 32, 3), np.float32)
    for i in range(4):
        tifffile.imwrite(inp / f"float{i}.tif", pixels * (i + 1), photometric="rgb")
    tifffile.imwrite(inp / "z_ct.tif", (pixels * 2000 - 1000).astype(np.int16), photometric="rgb")
    main = []
    for name in ("image_header", "tiff_header"):
        real = getattr(train_unet, name)
        monkeypatch.setattr(train_unet, name, lambda path, real=real: (
            main.append(Path(path).name) if threading.current_thread() is threading.main_thread() else None,
            real(path))[1])
    monkeypatch.setattr(train_unet, "available_memory", lambda: None)  # no budget: it reads headers itself
    train_unet.predict({"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(inp),
                        "progress": False, "output": str(tmp_path / "out"), "batch_size": 1})
    assert main == []
    assert "note: z_ct.tif has signed 16-bit pixels" in capsys.readouterr().out  # its type, as decoded


def test_pretrained_weights_with_the_hub_out_of_reach_come_from_the_cache_or_one_line_at_once(
        tmp_path, monkeypatch, caplog):
    """encoder_weights=imagenet offline: huggingface_hub retried each request 5 times over 23 s, a log line each,
    before the one-line error. Now an unreachable hub means its cache alone: weights found there load; missing
    ones are the one line, with no retry. (The hub is made unreachable here whatever this machine's network.)"""
    import huggingface_hub.constants
    import segmentation_models_pytorch as smp
    from safetensors.torch import save_file

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(train_unet, "unreachable_hub", lambda: "huggingface.co")
    cfg = {**train_unet.CONFIG, "encoder_name": "resnet18", "encoder_weights": "imagenet", "num_classes": 1}
    with caplog.at_level("DEBUG"):
        one_line_error(train_unet.build_model, cfg,
                       match=r"could not get encoder_weights='imagenet' for resnet18 \(huggingface.co cannot be "
                             r"reached from here, and they are not in the local Hugging Face cache\): to run offline")
    assert not any("Retrying" in record.getMessage() for record in caplog.records)
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False or os.environ.get("HF_HUB_OFFLINE")  # put back
    settings = smp.encoders.encoders["resnet18"]["pretrained_settings"]["imagenet"]
    repo = f"models--{settings['repo_id'].replace('/', '--')}"
    snapshot = tmp_path / "hub" / repo / "snapshots" / settings["revision"]
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    weights = smp.encoders.get_encoder("resnet18", weights=None).state_dict()
    weights = {key: torch.full_like(value, 0.5) if value.is_floating_point() else value
               for key, value in weights.items()}
    save_file(weights, str(snapshot / "model.safetensors"))
    model = train_unet.build_model(cfg)
    assert torch.equal(model.encoder.layer1[0].conv1.weight, torch.full_like(model.encoder.layer1[0].conv1.weight, 0.5))


def test_a_resume_does_not_fetch_pretrained_weights_it_replaces(make_cfg, monkeypatch):
    """A run started with encoder_weights=imagenet, resumed on a machine without the hub: the resume built the
    model with the pretrained weights first, fetching them, and was refused for want of weights the checkpoint
    then replaced."""
    cfg = make_cfg(max_train_images=4, image_size=32, batch_size=2)
    train_unet.train(cfg)
    monkeypatch.setattr(train_unet, "unreachable_hub", lambda: pytest.fail("the hub was asked on a resume"))
    result = train_unet.train({**cfg, "encoder_weights": "imagenet", "resume": True, "epochs": 2})
    assert [row["epoch"] for row in result["history"]] == [1, 2]


def test_library_calls_take_paths_and_left_out_keys_and_say_one_line_for_wrong_arguments(trained, tmp_path,
                                                                                         monkeypatch):
    """From a notebook: export() without output ended in KeyError 'output'; predict() refused a pathlib.Path
    that train() and load_model() take; load_model(path, "cpu") ended in AttributeError; run_benchmark(None) in
    TypeError and run_benchmark({...}) in "argument 'configs' is not key=value"; score_masks of two sizes in a
    RuntimeError from inside torch."""
    cfg, data = trained
    ckpt = Path(cfg["checkpoint_dir"]) / "best.pt"
    done = train_unet.predict({"checkpoint": ckpt, "input": data / "images", "output": tmp_path / "masks",
                               "progress": False})
    assert done["predicted"] == len(list((data / "images").iterdir())) and not done["failed"]
    monkeypatch.chdir(tmp_path)
    exported = train_unet.export({"checkpoint": ckpt})  # output: EXPORT_CONFIG's, as on the command line
    assert Path(tmp_path / exported["onnx"]).is_file() and Path(exported["onnx"]).name == "model.onnx"
    model, loaded = train_unet.load_model(ckpt, "cpu")
    assert loaded["image_size"] == 32
    for args in (None, {"configs": "fp32"}, "configs=fp32"):
        one_line_error(train_unet.run_benchmark, args, match=r"pass the settings as a list of key=value strings")
    one_line_error(train_unet.score_masks, np.zeros((4, 4)), np.zeros((4, 5)), 1,
                   match=r"^the predicted mask is 4x4 and its truth 4x5: score masks of one image")


def test_the_benchmark_refuses_an_output_among_a_data_sets_or_a_training_runs_files(trained, tmp_path):
    """output= a data set's images/ folder or a training run's folder: the benchmark wrote its rows, logs and
    table among their files, where training refuses such a checkpoint_dir."""
    cfg, data = trained
    one_line_error(train_unet.run_benchmark, [f"data_dir={data}", f"output={data / 'images'}", "configs=fp32"],
                   match=rf"^output={re.escape(str(data / 'images'))} is a data set's images folder: checkpoints and "
                         r"logs would go among its files; choose another output \(e.g. ")
    run = Path(cfg["checkpoint_dir"])
    one_line_error(train_unet.run_benchmark, [f"data_dir={data}", f"output={run}", "configs=fp32"],
                   match=rf"^output={re.escape(str(run))} holds a training run \(best.pt, last.pt\): the benchmark's "
                         rf"runs, logs and table would go among its files; choose another output \(e.g. "
                         rf"{re.escape(str(run / 'benchmark'))}\)$")
    assert not (run / "benchmark.json").exists() and not (data / "images" / "benchmark.json").exists()


def test_unknown_encoder_weights_offer_none(monkeypatch):
    """encoder_weights=foo listed smp's names only, not None (the offline default)."""
    monkeypatch.setattr(train_unet, "unreachable_hub", lambda: None)  # not asked: the name is refused first
    cfg = train_unet.validate_config({"encoder_weights": "foo", "encoder_name": "resnet18"})
    one_line_error(train_unet.build_model, cfg, match=r"Available options are.*\(or encoder_weights=None: random "
                                                      r"initial weights, no download\)$")


def test_an_interrupted_first_run_leaves_no_hidden_half_data_set(tmp_path, monkeypatch):
    """Ctrl-C while the embedded data set was written left data/.shapes.tmp<pid> (10 MB) for good; a later run
    wrote data/shapes beside it. Now Ctrl-C removes it, and a killed run's is removed by the next."""
    root = tmp_path / "data" / "shapes"
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = root.with_name(f".shapes.tmp{dead}")
    (stale / "images").mkdir(parents=True)
    real = train_unet.generate_shapes_dataset

    def interrupted(folder, **kwargs):
        (Path(folder) / "images").mkdir(parents=True)
        raise KeyboardInterrupt
    monkeypatch.setattr(train_unet, "generate_shapes_dataset", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train_unet.write_embedded_dataset(root)
    assert sorted(p.name for p in root.parent.iterdir()) == []  # the stale one and its own
    monkeypatch.setattr(train_unet, "generate_shapes_dataset", lambda folder: real(folder, count=4, size=32))
    assert train_unet.write_embedded_dataset(root) == root and [p.name for p in root.parent.iterdir()] == ["shapes"]


@pytest.mark.skipif(os.name == "nt", reason="SIGINT to oneself: POSIX")
@pytest.mark.parametrize("code", [0, 1])
def test_a_ctrl_c_after_the_command_returned_keeps_its_exit_code(code):
    """Ctrl-C in the second between 'done: ...' (every file written) and the process's end exited 130: a
    script or a make rule read the finished run as failed."""
    script = ("import os, signal, sys, time; sys.path.insert(0, sys.argv[1]); import train_unet\n"
              f"print('done', flush=False); train_unet.exit_at_next_interrupt({code})\n"
              "os.kill(os.getpid(), signal.SIGINT); time.sleep(30)")
    done = subprocess.run([sys.executable, "-c", script, str(Path(train_unet.__file__).parent)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == code and done.stdout == "done\n"  # printed, not lost to os._exit


def test_help_gives_each_key_the_comment_it_has_in_the_source(capsys):
    """--help listed bare defaults: `tile_overlap = None` without the word that None means the checkpoint's."""
    assert train_unet.main(["predict", "--help"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"\n  tile_overlap +  = None +  # patch-mode checkpoints: None = the checkpoint's", out), out
    assert train_unet.main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    source = Path(train_unet.__file__).read_text().split("\nCONFIG = {\n", 1)[1].split("\n}\n", 1)[0]
    commented = re.findall(r'^    "(\w+)": .*?  # (.+)$', source, flags=re.M)
    assert len(commented) > 30
    for key, comment in commented:  # read here by a regex, there by tokenize: the same words
        assert any(line.startswith(f"  {key} ") and line.endswith(f"# {comment}") for line in lines), key
    cache = lines.index(next(line for line in lines if line.startswith("  cache_images ")))
    assert lines[cache + 1].strip().startswith("files: image_size^2")  # a comment's second line, under it
    preset = next(line for line in lines if line.startswith("  preset "))
    assert preset.endswith('# None | "fast" | "stable" | "low_memory" | "debug"')  # not the heading comment above


@pytest.mark.parametrize("argv, words", [
    (["predict", "tile_overlap=abc"], "tile_overlap='abc' is not a number or None (default None = the checkpoint's "
                                      "(sliding window))"),
    (["max_train_images=x"], "max_train_images='x' is not a whole number or None (default None = all)"),
    (["early_stopping_patience=x"], "early_stopping_patience='x' is not a whole number or None (default 5)"),
    # the words a key takes besides its type: 'is not a whole number (default 8)' left auto out (user test)
    (["batch_size=8.0"], "batch_size='8.0' is not a whole number or auto (default 8)"),
    (["class_weights=a,b"], "class_weights='a,b' is not a list of numbers, auto or None (default None)"),
    (["learning_rate=x"], "learning_rate='x' is not a number (default 0.002)"),
    # only what the command takes: predict's batch_size no auto, training's tiling keys no None (review)
    (["predict", "batch_size=8.0"], "batch_size='8.0' is not a whole number (default 8)"),
    (["tile_batch_size=x"], "tile_batch_size='x' is not a whole number (default 8)"),
])
def test_a_type_error_says_what_the_key_takes_and_what_the_default_none_means(argv, words, capsys):
    assert train_unet.main(argv) == 2
    assert capsys.readouterr().err == f"error: {words}\n"


def test_help_and_errors_without_a_readable_source(monkeypatch, capsys):
    """A copy run from a notebook cell has no file to read the comments from: the bare listing, no traceback."""
    train_unet.source_comments.cache_clear()
    monkeypatch.setattr(train_unet, "__file__", "/nonexistent/train_unet.py")
    try:
        assert train_unet.main(["predict", "--help"]) == 0
        assert "\n  tile_overlap    = None\n" in capsys.readouterr().out
        assert train_unet.main(["predict", "tile_overlap=abc"]) == 2
        assert capsys.readouterr().err == "error: tile_overlap='abc' is not a number or None (default None)\n"
    finally:
        train_unet.source_comments.cache_clear()
