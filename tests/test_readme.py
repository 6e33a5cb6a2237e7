"""The README states the current behaviour: its tables and lists are the code's own (CONFIG, PRESETS,
PREDICT_CONFIG, FIXED_ON_RESUME, HISTORY_COLUMNS), its `make` targets exist, the figures it quotes are the code's,
and the rules it gives (scaling, masks, precision, exit codes, predict's refusals) hold."""
import ast
import errno
import re
from pathlib import Path

import numpy as np
import pytest
import torch

import train_unet
from unet_amp import autobatch, checkpoint, config, data, export, images, precision, predict, report
from unet_amp.common import UserError, run_guarded

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
TEXT = " ".join(README.split())  # the prose with line breaks folded


def between(name):
    """The README's text between <!-- name --> and <!-- /name -->."""
    match = re.search(rf"<!-- {name} -->(.*?)<!-- /{name} -->", README, re.S)
    assert match, f"README has no <!-- {name} --> block"
    return match.group(1)


def table_rows(name):
    """The cells of each body row of the markdown table in block `name`."""
    rows = [line.strip() for line in between(name).strip().splitlines()]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows if row.startswith("|")]
    return cells[2:]  # header and the |---| line


def code_spans(text):
    return re.findall(r"`([^`]+)`", text)


def key_values(spans):
    """{key: value} of `key=value` spans, each value read as the command line reads it."""
    return dict(config.split_pair(span) for span in spans)


# ---------------------------------------------------------------------------------------------------
# Tables and lists against the code
# ---------------------------------------------------------------------------------------------------
def test_config_table_is_config_in_order_with_its_defaults():
    rows = table_rows("config-table")
    keys = [code_spans(key)[0] for key, *_ in rows]
    assert keys == list(train_unet.CONFIG)
    for key, default, *_ in rows:
        key, value = code_spans(key)[0], ast.literal_eval(code_spans(default)[0])
        expected = train_unet.CONFIG[key]
        assert value == expected and type(value) is type(expected), (key, value, expected)


def test_presets_table_is_presets():
    presets, name = {}, None
    for first, _, sets in table_rows("presets-table"):
        name = code_spans(first)[0] if first else name  # an empty first cell continues the row above
        presets.setdefault(name, {}).update(key_values(code_spans(sets)))
    assert list(presets) == list(train_unet.PRESETS)
    assert presets == train_unet.PRESETS


def test_predict_keys_are_predict_config():
    spans = code_spans(between("predict-keys"))
    keys = [span.partition("=")[0] for span in spans]
    assert keys == list(predict.PREDICT_CONFIG)
    written = {k: ast.literal_eval(v) for k, _, v in (s.partition("=") for s in spans)}
    assert written == predict.PREDICT_CONFIG


def test_fixed_on_resume_list_is_the_checkpoints():
    assert tuple(code_spans(between("fixed-on-resume"))) == checkpoint.FIXED_ON_RESUME


def test_history_columns_are_reports():
    assert tuple(code_spans(between("history-columns"))) == report.HISTORY_COLUMNS


def test_every_config_key_typed_in_commands_exists():
    """Every key=value in the README's bash blocks is a CONFIG key (train) or the command's own key."""
    keys = {"predict": predict.PREDICT_CONFIG, "export": export.EXPORT_CONFIG}
    for block in re.findall(r"```bash\n(.*?)```", README, re.S):
        for line in block.splitlines():
            words = line.split("#")[0].split()
            if words[:2] != ["python", "train_unet.py"]:
                continue
            command = words[2] if len(words) > 2 and "=" not in words[2] else "train"
            known = keys.get(command, train_unet.CONFIG)
            assert all(w.partition("=")[0] in known for w in words[2:] if "=" in w), line


# ---------------------------------------------------------------------------------------------------
# make targets, CI, length, links
# ---------------------------------------------------------------------------------------------------
def test_every_make_target_the_readme_names_exists():
    makefile = (ROOT / "Makefile").read_text(encoding="utf-8")
    targets = set(re.findall(r"^([\w-]+):", makefile, re.M))
    named = set(re.findall(r"\bmake ([a-z][\w-]*)", README))
    assert {"train", "test"} <= named
    assert named <= targets, named - targets


def test_ci_runs_make_test():
    assert re.search(r"^make test\b", (ROOT / ".ci" / "run").read_text(encoding="utf-8"), re.M)


def test_readme_fits_its_budget():
    lines = README.splitlines()
    assert len(lines) <= 250
    assert max(map(len, lines)) <= 120


def anchor(heading):
    """GitHub's anchor for a heading."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_links_lead_somewhere():
    anchors = {anchor(h) for h in re.findall(r"^#{1,6} (.+)$", README, re.M)}
    for target in re.findall(r"\]\(([^)]+)\)", README):
        path, _, fragment = target.partition("#")
        if path:
            assert (ROOT / path).exists(), target
        else:
            assert fragment in anchors, target


# ---------------------------------------------------------------------------------------------------
# The figures the README quotes are the code's
# ---------------------------------------------------------------------------------------------------
def test_quoted_figures_are_the_codes():
    from unet_amp import benchmark  # being rewritten beside this file: its import fails only this test

    assert precision.PROBE_MARGIN == 1.10 and "1.10x faster" in TEXT
    assert precision.PROBE_ROUNDS == 3 and "median of 3 rounds" in TEXT
    assert precision.MIN_CAPABILITY == {torch.bfloat16: (8, 0), torch.float16: (7, 0)}
    assert "capability >= 8.0" in TEXT and "CUDA 7.x" in TEXT
    assert torch.finfo(torch.float16).max == 65504 and "±65504" in TEXT
    assert (export.LOGIT_ATOL, export.LOGIT_RTOL) == (1e-3, 1e-4) and "1e-3 + 1e-4 x the largest logit" in TEXT
    assert autobatch.HEADROOM == 0.10 and "less 10 %" in TEXT
    assert {k: export.EXPORT_CONFIG[k] for k in ("opset", "check")} == {"opset": 17, "check": True}
    assert "`opset` (17), `check` (True)" in TEXT
    assert benchmark.BENCHMARK_CONFIG["configs"] in TEXT
    assert f"`epochs` ({benchmark.BENCHMARK_CONFIG['epochs']})" in TEXT
    assert f"`output` (`{benchmark.BENCHMARK_CONFIG['output']}`)" in TEXT
    named = {"fp32", "fp32_cl", "bf16", "bf16_cl", "fp16", "tf32", "bf16_compile"}
    assert named <= set(benchmark.SETTINGS)


def test_the_embedded_data_set_is_as_described():
    import inspect

    defaults = {k: p.default for k, p in inspect.signature(data.ensure_shapes_dataset).parameters.items()}
    assert (defaults["count"], defaults["size"]) == (300, 128) and "300 synthetic 128x128" in TEXT
    assert train_unet.CONFIG["data_dir"] == "data/shapes"


# ---------------------------------------------------------------------------------------------------
# The rules the README gives
# ---------------------------------------------------------------------------------------------------
def test_scaling_rule():
    u8 = np.array([[[0], [51], [255]]], np.uint8)
    assert np.allclose(images.to_unit_range(u8, [0, 1000]), [[[0], [0.2], [1]]])  # the range never applies
    u16 = np.array([[[100], [4095], [5000]]], np.uint16)
    assert np.allclose(images.to_unit_range(u16, [0, 4095])[0, :, 0], [100 / 4095, 1, 1])  # clipped
    f32 = np.array([[[-2.0], [0.0], [2.0]]], np.float32)
    assert np.allclose(images.to_unit_range(f32, [-1, 1])[..., 0], [[0, 0.5, 1]])  # floats take the range too
    assert not images.to_unit_range(np.full((2, 2, 1), 7, np.uint16), [7, 8]).any()  # lo maps to 0
    assert not images.to_unit_range(np.full((2, 2, 1), 3.0, np.float32), None).any()  # a flat image is 0
    ramp = np.arange(10000, dtype=np.uint16).reshape(100, 100, 1)  # no range: the image's own 0.1-99.9th
    assert np.allclose(images.to_unit_range(ramp, None)[[0, 0, 99], [5, 10, 89], 0], [0, (10 - 9.999) / 9979.002, 1])
    with pytest.raises(UserError):
        images.to_unit_range(np.array([[[np.nan], [1.0]]], np.float32), None)
    assert (images.LOW_PERCENTILE, images.HIGH_PERCENTILE, images.CLIP_NOTE) == (0.1, 99.9, 0.01)


def test_learnt_range_pools_images_wider_than_8_bits(tmp_path):
    import cv2

    for i in range(3):
        cv2.imwrite(str(tmp_path / f"w{i}.png"), np.arange(1000 * i, 1000 * i + 1000, dtype=np.uint16).reshape(40, 25))
    cv2.imwrite(str(tmp_path / "c.png"), np.full((4, 4), 250, np.uint8))
    def learnt(paths):
        return images.robust_range(images.image_sketch(images.read_image(p)) for p in paths)
    lo, hi = learnt(sorted(tmp_path.iterdir()))  # 0..2999, each image weighing the same: 0.1-99.9th percentiles
    assert abs(lo - 3) < 0.5 and abs(hi - 2996) < 0.5
    assert learnt([tmp_path / "c.png"]) is None


def test_mask_rules(tmp_path):
    as_classes = images.mask_to_classes
    assert set(as_classes(np.array([[0, 255]], np.uint8), 1, "m").ravel()) == {0, 1}
    assert set(as_classes(np.array([[0, 1]], np.uint8), 1, "m").ravel()) == {0, 1}
    assert set(as_classes(np.array([[0, 1, 255]], np.uint8), 1, "m").ravel()) == {0, 1, 255}  # 255 void
    assert set(as_classes(np.array([[0, 255]], np.uint8), 2, "m").ravel()) == {0, 255}  # multi-class: 255 void
    with pytest.raises(UserError, match="m.png"):
        as_classes(np.array([[0, 3]], np.uint8), 3, "m.png")
    (tmp_path / "m.jpg").write_bytes(b"not read")
    with pytest.raises(UserError, match="m.jpg"):
        images.read_mask(tmp_path / "m.jpg")


def hardware(kind, capability=None, bf16=False, fp16=False):
    return precision.Hardware(torch.device("cpu"), kind, "test", capability, bf16, fp16)


@pytest.mark.parametrize("hw, probe, expected", [
    (hardware("cuda", (8, 0), True, True), None, "bf16"),
    (hardware("cuda", (7, 5), False, True), None, "fp16"),
    (hardware("cuda", (6, 1), False, False), None, "fp32"),
    (hardware("cpu", bf16=True), {"dtype": "bfloat16", "channels_last": True}, "bf16"),
    (hardware("cpu", bf16=True), {"dtype": "float32", "channels_last": False}, "fp32"),
    (hardware("cpu"), None, "fp32"),
    (hardware("mps", fp16=True), None, "fp32"),
])
def test_capability_check(hw, probe, expected):
    prec = train_unet.choose_precision(train_unet.CONFIG, hw, probe)
    assert prec.name == expected
    assert prec.needs_scaler == (expected == "fp16")
    assert train_unet.choose_dtype({**train_unet.CONFIG, "use_amp": False}, hw)[0] == "float32"


def test_channels_last_auto():
    cfg = train_unet.CONFIG
    assert train_unet.choose_precision(cfg, hardware("cuda", (8, 0), True, True), None).channels_last
    assert not train_unet.choose_precision(cfg, hardware("cpu", bf16=True), None).channels_last  # no probe: NCHW
    probe = {"dtype": "bfloat16", "channels_last": True}
    assert train_unet.choose_precision(cfg, hardware("cpu", bf16=True), probe).channels_last


def test_exit_codes(capsys):
    assert run_guarded(lambda: (_ for _ in ()).throw(UserError("x: bad; fix"))) == 2
    assert run_guarded(lambda: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full", "f"))) == 2
    assert run_guarded(lambda: (_ for _ in ()).throw(KeyboardInterrupt())) == 130
    assert train_unet.main(["no_such_command"]) == 2
    assert train_unet.main(["bach_size=2"]) == 2
    assert train_unet.main(["--help"]) == 0
    assert "batch_size" in capsys.readouterr().out


def test_predict_refuses_ground_truth_and_foreign_files(tmp_path):
    (tmp_path / "set" / "images").mkdir(parents=True)
    (tmp_path / "set" / "masks").mkdir()
    source = tmp_path / "set" / "images"
    for out in (source, tmp_path / "set" / "masks"):
        with pytest.raises(UserError):
            predict.check_output(out, source)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "mine.png").write_bytes(b"")
    with pytest.raises(UserError):
        predict.check_output(tmp_path / "other", source)
    (tmp_path / "other" / predict.MANIFEST).write_text('{"written": ["mine.png"]}')
    predict.check_output(tmp_path / "other", source)  # files predict wrote may be overwritten
    predict.check_output(tmp_path / "new", source)
