"""Command line: key=value overrides, type parsing, validation errors, main()'s exit code."""
from pathlib import Path

import pytest

import train_unet
from train_unet import CONFIG, UserError, parse_overrides


def user_error(args):
    """Run parse_overrides(args), expect a UserError, return its one-line message."""
    with pytest.raises(UserError) as info:
        parse_overrides(args)
    message = str(info.value)
    assert message, "empty error message"
    assert "\n" not in message, f"error message is not one line: {message!r}"
    return message


# ------------------------------------------------------------------------------------------------
# Parsing to the default's type
# ------------------------------------------------------------------------------------------------
def test_overrides_are_parsed_to_the_defaults_type():
    cfg = parse_overrides(["batch_size=2", "amp_dtype=float16", "epochs=3"])
    assert cfg["batch_size"] == 2 and type(cfg["batch_size"]) is int
    assert cfg["epochs"] == 3 and type(cfg["epochs"]) is int
    assert cfg["amp_dtype"] == "float16"
    # everything else keeps its default, and the global CONFIG is untouched
    assert {k: v for k, v in cfg.items() if k not in ("batch_size", "amp_dtype", "epochs")} == \
        {k: v for k, v in CONFIG.items() if k not in ("batch_size", "amp_dtype", "epochs")}


def test_parse_does_not_mutate_global_config():
    before = dict(CONFIG)
    parse_overrides(["batch_size=2", "learning_rate=0.5", "use_amp=false"])
    assert CONFIG == before


@pytest.mark.parametrize("text, expected", [
    ("true", True), ("True", True), ("TRUE", True), ("1", True), ("yes", True), ("on", True),
    ("false", False), ("False", False), ("0", False), ("no", False), ("off", False),
])
def test_bool_values(text, expected):
    cfg = parse_overrides([f"use_amp={text}"])
    assert cfg["use_amp"] is expected


def test_float_values():
    cfg = parse_overrides(["learning_rate=1e-3", "weight_decay=0", "val_fraction=.25"])
    assert cfg["learning_rate"] == pytest.approx(1e-3) and type(cfg["learning_rate"]) is float
    assert cfg["weight_decay"] == 0.0 and type(cfg["weight_decay"]) is float
    assert cfg["val_fraction"] == pytest.approx(0.25)


def test_float_key_accepts_an_integer_literal():
    cfg = parse_overrides(["learning_rate=1"])
    assert cfg["learning_rate"] == 1.0 and type(cfg["learning_rate"]) is float


@pytest.mark.parametrize("key", ["grad_clip_norm", "tf32_matmul_precision", "num_workers",
                                 "early_stopping_patience", "encoder_weights"])
@pytest.mark.parametrize("text", ["none", "None", "null"])
def test_none_for_optional_keys(key, text):
    cfg = parse_overrides([f"{key}={text}"])
    assert cfg[key] is None


@pytest.mark.parametrize("arg, key, expected", [
    ("grad_clip_norm=0.5", "grad_clip_norm", 0.5),
    ("num_workers=2", "num_workers", 2),
    ("early_stopping_patience=3", "early_stopping_patience", 3),
    ("tf32_matmul_precision=high", "tf32_matmul_precision", "high"),
    ("encoder_weights=imagenet", "encoder_weights", "imagenet"),
])
def test_none_default_keys_get_their_declared_type(arg, key, expected):
    value = parse_overrides([arg])[key]
    assert value == expected and type(value) is type(expected)


# ------------------------------------------------------------------------------------------------
# A user's edits of CONFIG: read as the key's type, not as the type of the value typed there
# ------------------------------------------------------------------------------------------------
def test_key_types_match_the_shipped_configs():
    for defaults in (CONFIG, train_unet.PREDICT_CONFIG):
        for key, value in defaults.items():
            if key in train_unet.BOOL_OR_TEXT:
                continue
            if value is None:
                assert key in train_unet.NONE_KEYS, key
                assert key in train_unet.KEY_TYPES or key in ("preset", "encoder_weights", "tf32_matmul_precision"), key
                continue
            assert type(value) is train_unet.key_type(key, defaults), (key, value)


def test_shipped_keys_are_the_shipped_configs_keys():
    assert tuple(CONFIG) == train_unet.TRAINING_KEYS
    assert tuple(train_unet.PREDICT_CONFIG) == train_unet.PREDICT_KEYS


@pytest.mark.parametrize("which, edit, message", [
    ("CONFIG", {"add": ("encoder", "resnet34")}, "has a key unet-amp does not know, 'encoder': did you mean 'encoder_name'"),
    ("CONFIG", {"rename": ("batch_size", "batchsize")}, "does not know, 'batchsize': did you mean 'batch_size'"),
    ("CONFIG", {"delete": "seed"}, "has no 'seed': put the key back"),
    ("CONFIG", {"delete": "preset"}, "has no 'preset'"),
    ("PREDICT_CONFIG", {"delete": "output"}, "PREDICT_CONFIG at the top of train_unet.py has no 'output'"),
])
def test_a_key_added_or_deleted_at_the_top_is_refused_in_one_line(which, edit, message):
    """An edit of CONFIG that adds a key (a typo) was ignored or read as a word ('batchsize=4 must be a
    string'); one that deletes a key stopped with a KeyError deep in the run."""
    defaults = getattr(train_unet, which)
    saved = dict(defaults)  # restored whole, in its order (monkeypatch.delitem puts a key back at the end)
    try:
        if "add" in edit:
            defaults.__setitem__(*edit["add"])
        if "rename" in edit:
            old, new = edit["rename"]
            defaults[new] = defaults.pop(old)
        if "delete" in edit:
            del defaults[edit["delete"]]
        with pytest.raises(UserError, match=message):
            if which == "CONFIG":
                train_unet.parse_overrides(["epochs=1"])
            else:
                train_unet.predict({"checkpoint": "x.pt", "input": "in", "output": "out"})
    finally:
        defaults.clear()
        defaults.update(saved)
    assert tuple(defaults) == (train_unet.TRAINING_KEYS if which == "CONFIG" else train_unet.PREDICT_KEYS)


@pytest.mark.parametrize("edit, args, expected", [
    ({"batch_size": "auto"}, [], "auto"),                       # CONFIG's own comment offers "auto"
    ({"batch_size": "auto"}, ["batch_size=4"], 4),
    ({"weight_decay": 0}, ["weight_decay=1e-4"], 1e-4),        # a whole number typed for a float key
    ({"warmup_fraction": 0}, ["warmup_fraction=0.1"], 0.1),
    ({"learning_rate": 1}, ["learning_rate=0.001"], 0.001),
])
def test_edited_config_values_keep_the_keys_type(monkeypatch, edit, args, expected):
    for key, value in edit.items():
        monkeypatch.setitem(CONFIG, key, value)
    value = parse_overrides(args)[next(iter(edit))]
    assert value == (expected if expected == "auto" else pytest.approx(expected))


def test_a_run_resolved_from_an_edited_auto_batch_size_validates(monkeypatch):
    """A checkpoint's config records the resolved batch size; predict and resume check it against CONFIG."""
    monkeypatch.setitem(CONFIG, "batch_size", "auto")
    assert train_unet.validate_config({"batch_size": 2})["batch_size"] == 2


@pytest.mark.parametrize("key, value, words", [
    ("use_amp", "False", "true or false"),   # a string would be truthy: fp16/bf16 on while the user meant off
    ("epochs", "10", "a whole number"),
    ("seed", None, "a whole number"),
    ("image_size", 128.5, "a whole number"),
    ("device", None, "a string"),
])
def test_a_wrong_type_typed_into_config_is_refused(monkeypatch, key, value, words):
    monkeypatch.setitem(CONFIG, key, value)
    message = user_error([])
    assert key in message and words in message
    assert "(as CONFIG at the top of train_unet.py has it" in message  # where the value is: it was not said
    if isinstance(value, str):
        assert f"write {value} there, without quotes" in message


@pytest.mark.parametrize("key, value, expected", [
    ("intensity_range", (0, 4095), [0, 4095]),  # 'must be a list of numbers or None'; train() took a tuple
    ("data_dir", Path("d/tiny"), "d/tiny"),    # 'must be a string'; the README says paths are taken
    ("device", "CPU", "cpu"),                  # refused, where device=CPU on the command line was taken
    ("preset", "Debug", "debug"),
])
def test_config_edits_are_read_as_a_library_dict_and_the_command_line_are(monkeypatch, key, value, expected):
    monkeypatch.setitem(CONFIG, key, value)
    assert parse_overrides([])[key] == expected


def test_class_weights_that_overflow_the_loss_are_refused_before_training():
    """class_weights=1e38,1e38: an epoch, then a fallback, then 'check the masks; likely learning_rate too high'.
    The loss sums weighted pixels: past float32's range at about 1e38 / (100 x the batch's pixels)."""
    args = ["image_size=64", "batch_size=4"]
    with pytest.raises(UserError, match=r"class_weights up to 1e\+38 overflow the loss's sums over a batch's 16384 "
                                        r"pixels: use weights nearer 1"):
        train_unet.check_class_weights_weigh(parse_overrides([*args, "class_weights=1e38,1e38"]))
    train_unet.check_class_weights_weigh(parse_overrides([*args, "class_weights=1,1e20"]))  # large, yet it sums
    loss = train_unet.SegLoss(1, "ce", [1.0, 1e38])
    assert "class_weights up to 1e+38" in train_unet.overflowing_weights(loss, 16384)  # auto's, a checkpoint's
    assert train_unet.overflowing_weights(train_unet.SegLoss(1, "ce", [1.0, 5.0]), 16384) is None


def test_class_weights_with_a_loss_they_cannot_weigh_is_refused_at_training_start(capsys):
    """loss=dice+lovasz class_weights=auto trained byte-identical epochs to class_weights=None, while the
    banner printed the weights as if applied. (At training's start: a checkpoint saved so still loads.)"""
    with pytest.raises(UserError, match="weighs the ce and focal terms, and loss=dice\\+lovasz has neither"):
        train_unet.check_class_weights_weigh(parse_overrides(["loss=dice+lovasz", "class_weights=auto"]))
    train_unet.check_class_weights_weigh(parse_overrides(["loss=focal+dice", "class_weights=1,5"]))
    train_unet.check_class_weights_weigh(parse_overrides(["loss=dice+lovasz"]))
    assert train_unet.main(["loss=dice", "class_weights=auto", "data_dir=/nonexistent"]) == 2
    assert "weighs the ce and focal terms" in capsys.readouterr().err  # before the data is looked at


def test_none_is_refused_for_a_required_int():
    message = user_error(["epochs=none"])
    assert "epochs" in message


def test_dashed_keys_are_accepted():
    cfg = parse_overrides(["--batch-size=3"])
    assert cfg["batch_size"] == 3


# ------------------------------------------------------------------------------------------------
# Errors: one line, naming the key and what is allowed
# ------------------------------------------------------------------------------------------------
def test_unknown_key_suggests_the_nearest():
    message = user_error(["batchsize=2"])
    assert "batchsize" in message
    assert "did you mean 'batch_size'" in message


def test_unknown_key_without_a_near_match_lists_the_keys():
    message = user_error(["zzzzqqqq=1"])
    assert "zzzzqqqq" in message
    assert "batch_size" in message and "amp_dtype" in message  # the known keys are listed


def test_bad_amp_dtype_lists_the_choices():
    message = user_error(["amp_dtype=fp8"])
    assert "amp_dtype" in message and "fp8" in message
    for choice in ("auto", "bfloat16", "float16"):
        assert choice in message


def test_bad_tf32_setting_lists_the_choices():
    message = user_error(["tf32_matmul_precision=fastest"])
    assert "tf32_matmul_precision" in message
    for choice in ("None", "highest", "high", "medium"):
        assert choice in message


def test_bad_loss_lists_the_choices():
    message = user_error(["loss=focl"])  # focal is a loss since issue 23
    assert "loss" in message and all(term in message for term in train_unet.LOSS_TERMS)


def test_in_channels_must_be_1_or_3():
    message = user_error(["in_channels=2"])
    assert "in_channels" in message and "1" in message and "3" in message


@pytest.mark.parametrize("key", ["batch_size", "accumulation_steps", "epochs", "num_classes"])
@pytest.mark.parametrize("value", ["0", "-1"])
def test_counts_must_be_at_least_one(key, value):
    message = user_error([f"{key}={value}"])
    assert key in message and ">= 1" in message


@pytest.mark.parametrize("size, suggestion", [("100", "96"), ("130", "128"), ("16", "32"), ("-64", "32")])
def test_image_size_must_be_a_multiple_of_32(size, suggestion):
    """image_size=-64 read 'must be a multiple of 32', which it is."""
    message = user_error([f"image_size={size}"])
    assert f"image_size={size} must be a multiple of 32, at least 32" in message
    assert f"image_size={suggestion}" in message


@pytest.mark.parametrize("size", ["32", "64", "96", "256"])
def test_image_size_multiples_of_32_are_fine(size):
    assert parse_overrides([f"image_size={size}"])["image_size"] == int(size)


def test_argument_without_equals():
    message = user_error(["notkeyvalue"])
    assert "notkeyvalue" in message and "key=value" in message


def test_unknown_encoder_suggests_names():
    message = user_error(["encoder_name=resnet19"])
    assert "encoder_name" in message and "resnet19" in message
    assert "resnet18" in message  # a close real name is suggested


def test_unknown_arch():
    message = user_error(["arch=Unet3D"])
    assert "arch" in message and "Unet3D" in message and "Unet" in message


@pytest.mark.parametrize("text", ["maybe", "2", "tru"])
def test_bad_bool(text):
    message = user_error([f"use_amp={text}"])
    assert f"use_amp={text!r} is not true or false" in message


@pytest.mark.parametrize("arg, key", [
    ("batch_size=two", "batch_size"), ("learning_rate=fast", "learning_rate"),
    ("epochs=2.5", "epochs"), ("grad_clip_norm=big", "grad_clip_norm"),
])
def test_bad_numbers(arg, key):
    message = user_error([arg])
    assert key in message


@pytest.mark.parametrize("value", ["float32", "fp32", "FP32"])
def test_amp_dtype_float32_points_to_use_amp_false_not_to_float16(value):
    """'did you mean float16?' steered someone asking for the safest precision to the riskiest."""
    message = user_error([f"amp_dtype={value}"])
    assert "set use_amp=False" in message and "did you mean" not in message


@pytest.mark.parametrize("arg, key", [
    ("learning_rate=0", "learning_rate"), ("learning_rate=nan", "learning_rate"),
    ("weight_decay=-1", "weight_decay"), ("val_fraction=1", "val_fraction"),
    ("warmup_fraction=1", "warmup_fraction"), ("grad_clip_norm=0", "grad_clip_norm"),
    ("early_stopping_patience=0", "early_stopping_patience"), ("num_workers=-1", "num_workers"),
    ("growth_factor=1", "growth_factor"), ("backoff_factor=1", "backoff_factor"),
    ("init_scale=0", "init_scale"), ("device=gpu", "device"),
    ("init_scale=1e39", "init_scale"), ("init_scale=1e30", "init_scale"), ("growth_factor=1e30", "growth_factor"),
])
def test_out_of_range_values(arg, key):
    message = user_error([arg])
    assert message.startswith(key)


# ------------------------------------------------------------------------------------------------
# main(): exit code 2 and a one-line "error: ..." on stderr, no traceback
# ------------------------------------------------------------------------------------------------
def assert_clean_exit_2(rc, capsys, *words):
    out, err = capsys.readouterr()
    assert rc == 2
    assert err.startswith("error: ")
    assert err.count("\n") == 1, f"more than one line on stderr: {err!r}"
    assert "Traceback" not in err + out
    for word in words:
        assert word in err


def test_main_bad_key_exits_2(capsys, tmp_path):
    rc = train_unet.main(["batchsize=2", f"checkpoint_dir={tmp_path / 'ck'}"])
    assert_clean_exit_2(rc, capsys, "batchsize", "batch_size")
    assert not (tmp_path / "ck").exists()  # nothing was started


def test_main_bad_value_exits_2(capsys, tmp_path):
    rc = train_unet.main(["amp_dtype=fp8", f"checkpoint_dir={tmp_path / 'ck'}"])
    assert_clean_exit_2(rc, capsys, "amp_dtype", "bfloat16")


def test_main_missing_data_exits_2(capsys, tmp_path):
    rc = train_unet.main([f"data_dir={tmp_path / 'nope'}", f"checkpoint_dir={tmp_path / 'ck'}",
                          "device=cpu", "progress=false"])
    assert_clean_exit_2(rc, capsys, "nope")


@pytest.mark.parametrize("device", ["cuda1", "cuda:x"])
def test_main_malformed_cuda_device_exits_2(device, capsys, tmp_path):
    """device=cuda1 (typo for cuda:1) passes validate_config, which only checks startswith("cuda");
    torch.device() then raises RuntimeError and main() prints a traceback instead of one line."""
    rc = train_unet.main([f"device={device}", f"data_dir={tmp_path / 'data'}",
                          f"checkpoint_dir={tmp_path / 'ck'}", "progress=false"])
    assert_clean_exit_2(rc, capsys, "device", device)


def test_main_negative_seed_is_rejected_or_works(capsys, data_dir, tmp_path):
    """seed=-1 is not validated; np.random.seed(-1) raises ValueError out of main() (a traceback).
    Either a one-line error (exit 2) or a normal run (exit 0) is acceptable."""
    rc = train_unet.main(["seed=-1", f"data_dir={data_dir}", f"checkpoint_dir={tmp_path / 'ck'}",
                          "image_size=32", "batch_size=2", "epochs=1", "progress=false",
                          "device=cpu", "use_amp=false"])
    if rc == 2:
        assert_clean_exit_2(rc, capsys, "seed")
    else:
        assert rc == 0


@pytest.mark.parametrize("given, arch", [("unet", "Unet"), ("Unet++", "UnetPlusPlus"), ("fpn", "FPN"),
                                         ("deeplabv3+", "DeepLabV3Plus")])
def test_arch_in_any_case_or_by_its_papers_name_is_smps(given, arch):
    """arch=unet was 'not allowed: use one of Unet, ...'; Unet++ too."""
    assert parse_overrides([f"arch={given}"])["arch"] == arch
    assert "arch='unets' is not allowed: use one of Unet, " in user_error(["arch=unets"])


def test_a_config_edit_read_as_given_is_not_taken_for_the_users_key(monkeypatch):
    """channels_last="Auto" edited at the top reads as auto; it is CONFIG's value, not the user's: a preset
    still sets the key (it was kept as 'given', the preset's NHWC left out)."""
    monkeypatch.setitem(CONFIG, "channels_last", "Auto")
    assert parse_overrides([])["channels_last"] == "auto"
    preset = lambda args: train_unet.apply_preset(parse_overrides(args), train_unet.explicit_keys(args))[0]  # noqa
    assert preset(["preset=fast"])["channels_last"] is True
    assert preset(["preset=fast", "channels_last=auto"])["channels_last"] == "auto"  # typed: it wins
