"""Presets (fast / stable / low_memory / debug): how they merge with CONFIG and the command line."""
import json
from pathlib import Path

import pytest
import torch

import train_unet
from train_unet import CONFIG, PRESETS, UserError, apply_preset, explicit_keys, parse_overrides

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()


def resolve(args):
    """What the command line does: parse key=value, then apply the preset with the typed keys winning."""
    return apply_preset(parse_overrides(args), explicit_keys(args))


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_sets_valid_values_of_known_keys(name):
    cfg, line = resolve([f"preset={name}"])
    for key, value in PRESETS[name].items():
        assert key in CONFIG and cfg[key] == value
    assert line.startswith(f"{name}: ") and "kept yours" not in line
    untouched = set(CONFIG) - set(PRESETS[name]) - {"preset"}
    assert all(cfg[k] == CONFIG[k] for k in untouched)


def test_train_of_parse_overrides_keeps_the_typed_keys_over_a_preset(make_cfg, capsys):
    """A library call, train(parse_overrides([...])): batch_size=8, typed but CONFIG's value, lost to debug's 2,
    where the command line keeps it. A copy of the dict is a plain config: values away from CONFIG's count."""
    base = make_cfg()
    args = ["preset=debug", "batch_size=8", "use_amp=True", "image_size=32", "epochs=1", "progress=False",
            "max_train_images=8", f"data_dir={base['data_dir']}", f"checkpoint_dir={base['checkpoint_dir']}",
            "encoder_name=resnet18", "device=cpu"]
    cfg = parse_overrides(args)
    assert cfg.typed == explicit_keys(args)
    train_unet.train(cfg)
    line = next(line for line in capsys.readouterr().out.splitlines() if "preset" in line and "debug:" in line)
    assert "kept yours: " in line and "batch_size=8" in line.split("kept yours: ")[1] and "use_amp=True" in line
    assert json.loads((Path(base["checkpoint_dir"]) / "config.json").read_text())["config"]["batch_size"] == 8
    assert not hasattr({**cfg}, "typed")
    # a notebook's sweep, cfg | {"learning_rate": lr}: the typed keys still win (batch_size=8 ran at debug's 2)
    assert (cfg | {"seed": 1}).typed == cfg.typed | {"seed"} and (cfg | {"seed": 1})["seed"] == 1 and cfg["seed"] != 1
    assert cfg.copy().typed == cfg.typed and cfg.copy() == cfg
    # a key merged in is typed too: cfg | {"batch_size": 8} under preset=debug trained at debug's 2
    sweep = parse_overrides(["preset=debug"]) | {"batch_size": 8}
    assert "batch_size" in sweep.typed and train_unet.apply_preset(sweep, sweep.typed)[0]["batch_size"] == 8
    sweep = parse_overrides(["preset=debug"])
    sweep |= {"batch_size": 8}
    assert "batch_size" in sweep.typed and train_unet.apply_preset(sweep, sweep.typed)[0]["batch_size"] == 8



def test_a_typed_configs_keys_set_item_by_item_are_typed_and_copies_keep_its_keys():
    """q = cfg.copy(); q["batch_size"] = 8 under preset=debug trained at debug's 2 (CONFIG's value, set but not
    typed), as did q.update(batch_size=8); parse_overrides([...], base=cfg) lost the base's typed keys."""
    import copy
    import pickle

    base = parse_overrides(["preset=debug"])
    for set_it in (lambda q: q.__setitem__("batch_size", 8), lambda q: q.update(batch_size=8),
                   lambda q: q.update({"batch_size": 8}),
                   lambda q: q.pop("batch_size") and q.setdefault("batch_size", 8)):
        q = base.copy()
        set_it(q)
        assert "batch_size" in q.typed and train_unet.apply_preset(q, q.typed)[0]["batch_size"] == 8
        assert "batch_size" not in base.typed  # the copy's, not the original's
    q = parse_overrides(["batch_size=8"], base=parse_overrides(["preset=debug", "epochs=5"]))
    assert q.typed == {"preset", "epochs", "batch_size"}
    resolved = train_unet.apply_preset(q, q.typed)[0]
    assert resolved["batch_size"] == 8 and resolved["epochs"] == 5
    for twin in (copy.deepcopy(q), pickle.loads(pickle.dumps(q))):  # the same keys typed, not every key
        assert type(twin) is type(q) and twin == q and twin.typed == q.typed
    # another TypedConfig merged in types its typed keys, not all it holds (the preset had been switched off)
    updated = parse_overrides(["preset=debug"])
    updated.update(parse_overrides(["epochs=5"]))
    for merged in (parse_overrides(["preset=debug"]) | parse_overrides(["epochs=5"]), updated):
        resolved = train_unet.apply_preset(merged, merged.typed)[0]
        assert merged.typed == {"preset", "epochs"} and resolved["batch_size"] == 2 and resolved["epochs"] == 5
    q = parse_overrides(["preset=debug", "epochs=5", "seed=3"])  # a key removed is typed no more
    del q["epochs"]
    q.pop("seed")
    assert q.typed == {"preset"} and train_unet.apply_preset({**train_unet.CONFIG, **q}, q.typed)[0]["epochs"] == 2


def test_no_preset_changes_nothing():
    for args in ([], ["preset=None"], ["preset="]):
        cfg, line = resolve(args)
        assert line is None and {k: v for k, v in cfg.items() if k != "preset"} == \
            {k: v for k, v in CONFIG.items() if k != "preset"}


def test_command_line_keys_win_even_when_they_equal_the_default():
    # use_amp=True is CONFIG's default, but it was typed: it beats debug's use_amp=False.
    cfg, line = resolve(["preset=debug", "batch_size=4", "use_amp=True"])
    assert cfg["batch_size"] == 4 and cfg["use_amp"] is True
    assert cfg["epochs"] == PRESETS["debug"]["epochs"] and cfg["detect_anomaly"] is True
    assert "kept yours: batch_size=4, use_amp=True" in line
    assert "batch_size=" not in line.split(";")[0] and "use_amp=" not in line.split(";")[0]


def test_in_python_keys_that_differ_from_config_win():
    cfg = train_unet.validate_config({**CONFIG, "preset": "low_memory", "accumulation_steps": 3})
    out, _ = apply_preset(cfg)
    assert out["accumulation_steps"] == 3 and out["batch_size"] == PRESETS["low_memory"]["batch_size"]


def test_a_preset_overrides_config_values(monkeypatch):
    # CONFIG is the base a preset changes: an edited CONFIG value of a preset key gives way to it
    # (the command line is where a key is made to win).
    monkeypatch.setitem(CONFIG, "batch_size", 16)
    cfg, _ = resolve(["preset=debug"])
    assert cfg["batch_size"] == 2
    cfg, _ = resolve(["preset=debug", "batch_size=16"])
    assert cfg["batch_size"] == 16


def test_unknown_preset_lists_the_choices():
    with pytest.raises(UserError, match="preset='turbo' is not allowed: use one of.*fast.*stable.*"
                                        "low_memory.*debug"):
        parse_overrides(["preset=turbo"])


def test_the_string_none_in_a_dict_is_refused_naming_pythons_none():
    """preset="none" in a dict was refused with 'use one of None, fast, ...': seemingly the value given."""
    with pytest.raises(UserError, match="^preset='none' is not allowed: in Python, write None \\(not the string\\), "
                                        "or use one of fast, stable, low_memory, debug$"):
        train_unet.validate_config(dict(CONFIG, preset="none"))
    assert parse_overrides(["preset=none"])["preset"] is None  # the command line's none is None


def test_low_memory_keeps_the_default_effective_batch():
    values = PRESETS["low_memory"]
    assert values["batch_size"] * values["accumulation_steps"] == CONFIG["batch_size"] * CONFIG["accumulation_steps"]
    assert values["batch_size"] < CONFIG["batch_size"]


def test_readme_table_is_generated_from_presets():
    assert train_unet.preset_table() in README


def test_debug_run_finishes_on_tiny_data(data_dir, tmp_path, monkeypatch, capsys):
    """`python train_unet.py preset=debug` end to end: 2 epochs of 8 images at batch 2, fp32,
    anomaly detection on while training (and off again afterwards)."""
    seen = []
    real = train_unet.train_one_epoch

    def watch(*args, **kwargs):
        seen.append(torch.is_anomaly_enabled())
        return real(*args, **kwargs)
    monkeypatch.setattr(train_unet, "train_one_epoch", watch)
    ckpt = tmp_path / "ckpt"
    code = train_unet.main(["preset=debug", f"data_dir={data_dir}", f"checkpoint_dir={ckpt}", "image_size=64",
                            "device=cpu", "progress=False"])
    out = capsys.readouterr().out
    assert code == 0
    banner = out.split("config:")[0]
    assert "preset       debug: batch_size=2" in banner and "kept yours: progress=False" in banner
    assert "precision    fp32" in banner
    assert seen == [True, True] and not torch.is_anomaly_enabled()
    saved = json.loads((ckpt / "config.json").read_text())
    assert saved["config"]["preset"] == "debug" and saved["config"]["batch_size"] == 2
    assert saved["preset"].startswith("debug:")
    history = saved and (ckpt / "history.csv").read_text().splitlines()
    assert len(history) == 3  # header + 2 epochs
    assert "8 train / 2 val images" in out and "4 batches of 2" in out
