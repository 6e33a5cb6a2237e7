"""What a demanding user runs into: wrong types, unsafe outputs, inexact resumes, misleading hints."""
import math
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
    ("use_amp", "False", "use_amp='False' must be a true or false"),
    ("seed", 1.5, "seed=1.5 must be a whole number"),
    ("batch_size", True, "batch_size=True must be a whole number"),
    ("init_scale", math.inf, "init_scale=inf must be a number"),
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
    assert train_unet.main(["--help"]) == 0
    assert "batch_size" in capsys.readouterr().out


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


def test_resume_refuses_changed_optimisation_settings_and_finished_runs(trained):
    cfg, _ = trained
    one_line_error(train_unet.train, {**cfg, "resume": True, "epochs": 2, "learning_rate": 1e-5},
                   match="trained with learning_rate=0.002, this run has learning_rate=1e-05")
    one_line_error(train_unet.train, {**cfg, "resume": True, "epochs": 2, "batch_size": 4},
                   match="batch_size")
    one_line_error(train_unet.train, {**cfg, "resume": True}, match="already trained 1 epoch.*raise epochs")


def test_predict_never_overwrites_inputs_and_validates_its_options(trained, tmp_path):
    cfg, data = trained
    ckpt = Path(cfg["checkpoint_dir"]) / "best.pt"
    images = data / "images"
    before = {p.name: p.read_bytes() for p in images.iterdir()}
    opts = {"checkpoint": str(ckpt), "input": str(images), "progress": False}
    one_line_error(train_unet.predict, {**opts, "output": str(images)}, match="would overwrite the input")
    assert {p.name: p.read_bytes() for p in images.iterdir()} == before
    twin = tmp_path / "twin"
    twin.mkdir()
    src = next(images.iterdir())
    (twin / "a.png").write_bytes(src.read_bytes())
    (twin / "a.jpg").write_bytes(cv2.imencode(".jpg", cv2.imread(str(src)))[1].tobytes())
    one_line_error(train_unet.predict, {**opts, "input": str(twin), "output": str(tmp_path / "o")},
                   match="share the name 'a'")
    one_line_error(train_unet.predict, {**opts, "output": str(tmp_path / "o"), "batch_size": 0},
                   match="batch_size=0 must be")
    one_line_error(train_unet.predict, {**opts, "output": str(tmp_path / "o"), "amp_dtype": "fp8"},
                   match="amp_dtype='fp8' is not allowed")


def test_benchmark_arguments(tmp_path):
    opts, base, _, names = train_unet.parse_benchmark_args(["--configs=fp32,bf16", "batch_size=4"])
    assert names == ["fp32", "bf16"] and base["batch_size"] == 4
    one_line_error(train_unet.parse_benchmark_args, ["checkpoint_dir=x"], match="set by the benchmark itself")
    assert train_unet.merge_args(["batch_size=4", "epochs=2"], ["batch_size=8"]) == ["batch_size=8", "epochs=2"]


def test_earlier_results_are_archived_not_overwritten(tmp_path):
    (tmp_path / "fp32").mkdir()
    (tmp_path / "benchmark.json").write_text("{}")
    dest = train_unet.archive_previous_run(tmp_path, ["fp32", "benchmark.json"])
    assert (dest / "fp32").is_dir() and (dest / "benchmark.json").read_text() == "{}"
    assert not (tmp_path / "benchmark.json").exists()
