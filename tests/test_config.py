"""key=value parsing, presets and the one table of limits."""
import pytest

import train_unet
from unet_amp.common import UserError
from unet_amp.config import parse_args, train_config


def test_values_take_their_defaults_type():
    cfg, typed = parse_args(["epochs=3", "learning_rate=1e-3", "use_amp=false", "ema_decay=0.99",
                             "intensity_range=0,4095", "class_weights=auto", "batch_size=auto", "data_dir=x/y",
                             "channels_last=False"],
                            train_unet.CONFIG)
    assert (cfg["epochs"], cfg["learning_rate"], cfg["use_amp"], cfg["ema_decay"]) == (3, 1e-3, False, 0.99)
    assert cfg["intensity_range"] == [0, 4095] and cfg["class_weights"] == "auto" and cfg["batch_size"] == "auto"
    assert cfg["data_dir"] == "x/y" and cfg["channels_last"] is False
    assert typed == {"epochs", "learning_rate", "use_amp", "ema_decay", "intensity_range", "class_weights",
                     "batch_size", "data_dir", "channels_last"}


@pytest.mark.parametrize("arg", ["epochs=two", "epochs=2.5", "image_size=100", "val_fraction=1.5", "learning_rate=0",
                                 "amp_dtype=fp8", "data_mode=tiles", "class_weights=1,2,3", "ema_decay=1.0",
                                 "nope=1", "epochs", "device=tpu", "num_workers=auto", "ema_decay=yes",
                                 "max_train_images=all", "epochs=True", "intensity_range=a,b"])
def test_a_bad_value_is_refused_naming_its_key(arg):
    with pytest.raises(UserError) as err:
        train_config(train_unet.CONFIG, train_unet.PRESETS, [arg])
    assert arg.split("=")[0] in str(err.value)


def test_command_line_wins_over_preset_over_config():
    cfg, _ = train_config(train_unet.CONFIG, train_unet.PRESETS, ["preset=debug", "epochs=5"])
    assert cfg["epochs"] == 5 and cfg["batch_size"] == 2 and cfg["use_amp"] is False
    cfg, _ = train_config(train_unet.CONFIG, train_unet.PRESETS, {"preset": "low_memory"})
    assert (cfg["batch_size"], cfg["accumulation_steps"]) == (4, 2)


def test_every_preset_names_real_keys_and_passes_the_checks():
    for name, preset in train_unet.PRESETS.items():
        assert set(preset) <= set(train_unet.CONFIG), name
        train_config(train_unet.CONFIG, train_unet.PRESETS, [f"preset={name}"])


def test_the_word_none_is_a_choice_where_the_key_has_it():
    words = ["tta=none", "logger=none", "tf32_matmul_precision=None"]
    cfg, _ = train_config(train_unet.CONFIG, train_unet.PRESETS, words)
    assert (cfg["tta"], cfg["logger"], cfg["tf32_matmul_precision"]) == ("none", "none", None)


def test_a_value_of_the_wrong_type_edited_into_config_is_refused_naming_its_key():
    for key, value in (("epochs", "3"), ("num_classes", "2"), ("learning_rate", None)):
        with pytest.raises(UserError, match=key):
            train_config({**train_unet.CONFIG, key: value}, train_unet.PRESETS, [])
