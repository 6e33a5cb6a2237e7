"""Numerical safety (issue 4): non-finite steps are detected, skipped, and fall back to a safer precision.

Every failure here is real, not a mock of the guard: fp16 overflow from scaled-up weights, a NaN
written into an input image, an inf gradient from a tensor hook. Runs are tiny (32x32 images,
4 training images in batches of 2 = 2 optimizer steps per epoch) so fp16 autocast, many times slower
than fp32 on a CPU (BENCHMARKS.md), stays affordable, and so does bf16 on a CPU without native bf16: the runs force
the dtype they test (force_amp_dtype=True), and where a path depends on the hardware (fp16 -> bf16 or
-> fp32), the hardware is faked both ways, so every path runs on every machine.
"""
import contextlib
import csv
import dataclasses
import io
import math
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import train_unet  # noqa: E402

SIZE = 32
STEPS_PER_EPOCH = 2  # max_train_images=4, batch_size=2
ORIGINAL_BUILD_MODEL = train_unet.build_model
ORIGINAL_GETITEM = train_unet.SegDataset.__getitem__
CKPT_FILES = {"last.pt", "best.pt", "history.csv", "config.json", "tensorboard"}

# train_unet steps the LR schedule on every attempted step, skipped ones included, and says so; it
# silences PyTorch's ordering warning at import, but pytest restores the filters for each test.
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """6 pairs: 5 train (the first 4 used) / 1 val."""
    return train_unet.generate_shapes_dataset(tmp_path_factory.mktemp("safety") / "data", count=6, size=SIZE)


def cfg_for(data, ckpt_dir, **overrides):
    cfg = dict(data_dir=str(data), checkpoint_dir=str(ckpt_dir), image_size=SIZE, max_train_images=4,
               batch_size=2, epochs=2, encoder_name="resnet18", encoder_weights=None, device="cpu",
               progress=False, num_workers=0, nan_patience=2, early_stopping_patience=None,
               use_amp=True, amp_dtype="bfloat16", force_amp_dtype=True)
    cfg.update(overrides)
    return cfg


def train_logged(cfg):
    """train(cfg) with stdout captured: (result, log text)."""
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        result = train_unet.train(cfg)
    return result, log.getvalue()


# ---------------------------------------------------------------------------------------------------
# Real failures
# ---------------------------------------------------------------------------------------------------
def overflowing_model(cfg):
    """A real smp U-Net whose first convolution overflows fp16 (max 65504) but not bf16 or fp32."""
    model = ORIGINAL_BUILD_MODEL(cfg)
    with torch.no_grad():
        model.encoder.conv1.weight.mul_(1e5)
    return model


def gradient_hook_model(factor_for_call, param=lambda m: m.segmentation_head[0].weight):
    """build_model replacement: a real tensor hook multiplies one parameter's gradient by
    factor_for_call(n) on the n-th backward pass (n counts from 1, across rollbacks)."""
    calls = []

    def build(cfg):
        model = ORIGINAL_BUILD_MODEL(cfg)

        def hook(grad):
            calls.append(1)
            factor = factor_for_call(len(calls))
            return grad if factor is None else grad * factor
        param(model).register_hook(hook)
        return model
    return build, calls


def nan_input(when):
    """SegDataset.__getitem__ replacement: a NaN pixel in training image `index` when when(epoch, index)."""
    injected = []

    def getitem(self, index):
        x, y = ORIGINAL_GETITEM(self, index)
        if self.train and when(self.epoch, index):
            x = x.clone()
            x[0, 0, 0] = float("nan")
            injected.append((self.epoch, index))
        return x, y
    return getitem, injected


# ---------------------------------------------------------------------------------------------------
# Checks on disk
# ---------------------------------------------------------------------------------------------------
def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def nonfinite(state, buffers):
    """Names of non-finite floating tensors in a model state dict: parameters, or BN running stats."""
    is_buffer = lambda k: k.endswith(("running_mean", "running_var"))
    return [k for k, v in state.items() if v.is_floating_point() and is_buffer(k) == buffers
            and not torch.isfinite(v).all()]


def read_history_csv(ckpt_dir):
    with open(Path(ckpt_dir) / "history.csv", newline="") as f:
        return list(csv.DictReader(f))


def assert_checkpoint_dir_complete(ckpt_dir, epochs):
    ckpt_dir = Path(ckpt_dir)
    names = {p.name for p in ckpt_dir.iterdir()}
    assert names == CKPT_FILES, f"unexpected files (half-written temporaries?): {names ^ CKPT_FILES}"
    last = load(ckpt_dir / "last.pt")
    assert last["epoch"] == epochs
    assert len(read_history_csv(ckpt_dir)) == epochs
    load(ckpt_dir / "best.pt")
    return last


def with_native_bf16(native):
    """detect_hardware replacement: the real device, with native bf16 faked on or off."""
    real_detect = train_unet.detect_hardware
    return lambda device="auto": dataclasses.replace(real_detect(device), bf16=native,
                                                     bf16_feature=f"faked native={native}")


# ---------------------------------------------------------------------------------------------------
# a. fp16 overflow -> bf16 (hardware with native bf16, faked so this runs on every CPU)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def fp16_overflow_run(data, tmp_path_factory):
    ckpt_dir = tmp_path_factory.mktemp("fp16_overflow") / "ckpt"
    cfg = cfg_for(data, ckpt_dir, amp_dtype="float16", force_amp_dtype=True)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_unet, "build_model", overflowing_model)
        mp.setattr(train_unet, "detect_hardware", with_native_bf16(True))
        result, log = train_logged(cfg)
    return cfg, result, log


def test_fp16_fallback_target_on_this_machine():
    """What the capability check decides for THIS CPU: fp16 falls back to bf16 only where bf16 is native."""
    hw = train_unet.detect_hardware("cpu")
    fp16 = train_unet.decide_precision(hw, True, "float16", force=True)
    assert train_unet.safer_precision(fp16, hw).name == ("bf16" if hw.bf16 else "fp32")


def test_fp16_overflow_falls_back_to_bf16(fp16_overflow_run):
    cfg, result, log = fp16_overflow_run
    assert [(f["epoch"], f["from"], f["to"]) for f in result["fallbacks"]] == [(1, "fp16", "bf16")]
    # Every fp16 step overflows, so the streak reaches nan_patience at step nan_patience.
    assert result["fallbacks"][0]["step"] == cfg["nan_patience"]
    assert result["precision"] == "bf16"
    history = result["history"]
    assert [row["epoch"] for row in history] == [1, 2]  # finished every epoch
    assert [row["precision"] for row in history] == ["bf16", "bf16"]
    assert history[0]["fallback"] and "bf16" in history[0]["fallback"]
    assert history[1]["fallback"] == ""
    # Rolled back to the start: epoch 1 was re-run in full, in bf16, with no bad step left.
    assert history[0]["optimizer_steps"] == STEPS_PER_EPOCH
    assert history[0]["skipped_steps"] == 0
    assert all(math.isfinite(row["train_loss"]) and math.isfinite(row["val_loss"]) for row in history)
    assert "falling back to bf16" in log  # the event is logged


def test_fp16_overflow_fallback_is_on_disk(fp16_overflow_run):
    cfg, result, _ = fp16_overflow_run
    last = assert_checkpoint_dir_complete(cfg["checkpoint_dir"], cfg["epochs"])
    assert last["precision"] == "bf16"
    assert last["fallbacks"] == result["fallbacks"]
    assert nonfinite(last["model"], buffers=False) == []
    assert nonfinite(last["model"], buffers=True) == []
    rows = read_history_csv(cfg["checkpoint_dir"])
    assert [r["precision"] for r in rows] == ["bf16", "bf16"]
    assert rows[0]["fallback"] != "" and rows[1]["fallback"] == ""
    for column in ("grad_norm", "grad_norm_max", "zero_grad_pct", "scaler_scale", "skipped_steps"):
        assert column in rows[0]


# ---------------------------------------------------------------------------------------------------
# b. fp16 overflow on hardware without native bf16 -> fp32
# ---------------------------------------------------------------------------------------------------
def test_fp16_overflow_without_native_bf16_falls_back_to_fp32(data, tmp_path, monkeypatch):
    monkeypatch.setattr(train_unet, "detect_hardware", with_native_bf16(False))
    monkeypatch.setattr(train_unet, "build_model", overflowing_model)
    cfg = cfg_for(data, tmp_path / "ckpt", amp_dtype="float16", force_amp_dtype=True)
    result, log = train_logged(cfg)
    assert [(f["from"], f["to"]) for f in result["fallbacks"]] == [("fp16", "fp32")]
    assert result["precision"] == "fp32"
    assert [row["precision"] for row in result["history"]] == ["fp32", "fp32"]
    assert "falling back to fp32" in log
    last = assert_checkpoint_dir_complete(cfg["checkpoint_dir"], cfg["epochs"])
    assert last["precision"] == "fp32" and last["fallbacks"] == result["fallbacks"]
    assert nonfinite(last["model"], buffers=False) == []


# ---------------------------------------------------------------------------------------------------
# c. inf gradients: bf16 -> fp32; and when fp32 fails too, a clean stop with a diagnosis
# ---------------------------------------------------------------------------------------------------
def test_bf16_inf_gradient_falls_back_to_fp32(data, tmp_path, monkeypatch):
    patience = 2
    # inf gradients on the first `patience` steps (bf16); finite after the rollback.
    build, calls = gradient_hook_model(lambda n: float("inf") if n <= patience else None)
    monkeypatch.setattr(train_unet, "build_model", build)
    cfg = cfg_for(data, tmp_path / "ckpt", nan_patience=patience)
    result, log = train_logged(cfg)
    assert [(f["epoch"], f["from"], f["to"]) for f in result["fallbacks"]] == [(1, "bf16", "fp32")]
    assert result["precision"] == "fp32"
    assert [row["precision"] for row in result["history"]] == ["fp32", "fp32"]
    assert result["history"][0]["fallback"] != ""
    assert [row["skipped_steps"] for row in result["history"]] == [0, 0]  # the bad steps were rolled back
    assert len(calls) == patience + cfg["epochs"] * STEPS_PER_EPOCH
    last = assert_checkpoint_dir_complete(cfg["checkpoint_dir"], cfg["epochs"])
    assert last["precision"] == "fp32"
    assert nonfinite(last["model"], buffers=False) == []
    assert nonfinite(last["model"], buffers=True) == []


def test_nonfinite_in_fp32_stops_with_a_diagnosis_and_keeps_last_checkpoint(data, tmp_path, monkeypatch,
                                                                           capsys):
    ckpt_dir = tmp_path / "ckpt"
    saved = {}

    def factor(n):
        if n <= STEPS_PER_EPOCH:
            return None  # epoch 1 is healthy and writes last.pt
        if not saved:  # first bad backward: remember last.pt as epoch 1 left it
            saved["last"] = (ckpt_dir / "last.pt").read_bytes()
            saved["best"] = (ckpt_dir / "best.pt").read_bytes()
        return float("inf")
    build, _ = gradient_hook_model(factor)
    monkeypatch.setattr(train_unet, "build_model", build)
    cfg = cfg_for(data, ckpt_dir, epochs=3)
    with pytest.raises(train_unet.UserError) as info:
        train_unet.train(cfg)
    message = str(info.value)
    assert "\n" not in message
    assert "fp32" in message
    assert "gradient" in message and "segmentation_head" in message  # where the hook sits
    assert "falling back to fp32" in capsys.readouterr().out  # bf16 -> fp32 was tried first
    assert saved, "the hook never fired from epoch 2"
    assert (ckpt_dir / "last.pt").read_bytes() == saved["last"]
    assert (ckpt_dir / "best.pt").read_bytes() == saved["best"]
    last = assert_checkpoint_dir_complete(ckpt_dir, 1)
    assert nonfinite(last["model"], buffers=False) == []


def test_bad_streak_spanning_epochs_still_falls_back(data, tmp_path, monkeypatch):
    """nan_patience counts consecutive optimizer steps, not steps within one epoch.

    With 2 optimizer steps per epoch and nan_patience=3, three inf-gradient steps in a row span
    epochs 1 and 2. A run whose epochs are shorter than nan_patience must still fall back.
    """
    patience = 3
    assert patience > STEPS_PER_EPOCH
    build, _ = gradient_hook_model(lambda n: float("inf") if n <= patience else None)
    monkeypatch.setattr(train_unet, "build_model", build)
    result, _ = train_logged(cfg_for(data, tmp_path / "ckpt", nan_patience=patience))
    assert [(f["from"], f["to"]) for f in result["fallbacks"]] == [("bf16", "fp32")], \
        f"{patience} consecutive non-finite steps did not fall back; skipped per epoch: " \
        f"{[row['skipped_steps'] for row in result['history']]}"


# ---------------------------------------------------------------------------------------------------
# d. one NaN batch: skipped, no fallback
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def nan_batch_run(data, tmp_path_factory):
    """bf16, a NaN pixel in training image 0 in epoch 1 only; GradScaler constructions counted."""
    cfg = cfg_for(data, tmp_path_factory.mktemp("nan_batch") / "ckpt", nan_patience=3)
    getitem, injected = nan_input(lambda epoch, index: epoch == 1 and index == 0)
    built = []

    class CountingScaler(torch.amp.GradScaler):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_unet.SegDataset, "__getitem__", getitem)
        mp.setattr(torch.amp, "GradScaler", CountingScaler)
        result, log = train_logged(cfg)
    return cfg, result, injected, built


def test_single_nan_batch_is_skipped_without_fallback(nan_batch_run):
    cfg, result, injected, _ = nan_batch_run
    assert injected == [(1, 0)]
    assert result["fallbacks"] == []
    assert result["precision"] == "bf16"
    history = result["history"]
    assert [row["epoch"] for row in history] == [1, 2]
    assert [row["skipped_steps"] for row in history] == [1, 0]
    assert [row["optimizer_steps"] for row in history] == [STEPS_PER_EPOCH, STEPS_PER_EPOCH]
    assert all(row["fallback"] == "" for row in history)
    assert all(math.isfinite(row["grad_norm"]) for row in history)
    rows = read_history_csv(cfg["checkpoint_dir"])
    assert [int(r["skipped_steps"]) for r in rows] == [1, 0]
    last = assert_checkpoint_dir_complete(cfg["checkpoint_dir"], cfg["epochs"])
    assert nonfinite(last["model"], buffers=False) == []  # the NaN step was not applied


def test_single_nan_batch_leaves_the_saved_model_usable(nan_batch_run):
    """Skipping the optimizer step is not enough: the NaN forward pass in train mode also updated
    the BatchNorm running statistics. The saved model must still be finite and validate finitely."""
    cfg, result, _, _ = nan_batch_run
    last = load(Path(cfg["checkpoint_dir"]) / "last.pt")
    assert nonfinite(last["model"], buffers=True) == [], "BatchNorm running stats poisoned by the skipped NaN batch"
    assert all(math.isfinite(row["val_loss"]) for row in result["history"]), \
        [row["val_loss"] for row in result["history"]]


# ---------------------------------------------------------------------------------------------------
# e. persistent NaN input in fp32: stop, name the input batch, lose nothing
# ---------------------------------------------------------------------------------------------------
def test_persistent_nan_input_in_fp32_stops_naming_the_input(data, tmp_path, monkeypatch):
    ckpt_dir = tmp_path / "ckpt"
    saved = {}
    getitem, injected = nan_input(lambda epoch, index: epoch >= 2)

    def getitem_saving(self, index):
        if self.train and self.epoch >= 2 and not saved:
            saved["last"] = (ckpt_dir / "last.pt").read_bytes()
            saved["history"] = (ckpt_dir / "history.csv").read_bytes()
        return getitem(self, index)
    monkeypatch.setattr(train_unet.SegDataset, "__getitem__", getitem_saving)
    cfg = cfg_for(data, ckpt_dir, use_amp=False, epochs=3)
    with pytest.raises(train_unet.UserError) as info:
        train_unet.train(cfg)
    message = str(info.value)
    assert "\n" not in message
    assert "input batch" in message
    assert injected and saved
    assert (ckpt_dir / "last.pt").read_bytes() == saved["last"]
    assert (ckpt_dir / "history.csv").read_bytes() == saved["history"]
    last = assert_checkpoint_dir_complete(ckpt_dir, 1)
    assert last["precision"] == "fp32" and last["fallbacks"] == []
    assert nonfinite(last["model"], buffers=False) == []
    assert nonfinite(last["model"], buffers=True) == []


# ---------------------------------------------------------------------------------------------------
# f. resume keeps the safer precision
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("native_bf16", [True, False], ids=["same-hardware", "no-native-bf16-now"])
def test_resume_after_fallback_keeps_the_safer_precision(fp16_overflow_run, tmp_path, monkeypatch, native_bf16):
    """The run fell back fp16 -> bf16. Resumed where bf16 is native it stays bf16; resumed on hardware
    without native bf16 it goes one step safer (fp32), never to emulated bf16 and never back to fp16."""
    cfg, first, _ = fp16_overflow_run
    ckpt_dir = tmp_path / "ckpt"
    shutil.copytree(cfg["checkpoint_dir"], ckpt_dir)  # leave the module fixture's files alone
    monkeypatch.setattr(train_unet, "detect_hardware", with_native_bf16(native_bf16))
    resumed_cfg = {**cfg, "checkpoint_dir": str(ckpt_dir), "resume": True, "epochs": cfg["epochs"] + 1,
                   "amp_dtype": "float16", "force_amp_dtype": True}
    result, log = train_logged(resumed_cfg)
    expected = "bf16" if native_bf16 else "fp32"
    assert [row["epoch"] for row in result["history"]] == [1, 2, 3]
    new = result["history"][-1]
    assert new["precision"] == expected, "a resumed run left the safer precision (or chose an emulated one)"
    assert new["fallback"] == ""  # no second overflow: it never ran fp16 again
    assert new["scaler_scale"] is None
    assert result["fallbacks"] == first["fallbacks"]  # the earlier event is kept, none added
    assert result["precision"] == expected
    assert "kept from the checkpoint" in log and (native_bf16 or "not native" in log)
    last = assert_checkpoint_dir_complete(ckpt_dir, 3)
    assert last["precision"] == expected and last["fallbacks"] == first["fallbacks"]


# ---------------------------------------------------------------------------------------------------
# g. GradScaler only under fp16; gradient health columns
# ---------------------------------------------------------------------------------------------------
def test_fp16_scaler_skips_are_counted_and_the_scale_shown(data, tmp_path, monkeypatch):
    """An init_scale far too large for fp16 makes the scaler skip steps (a real overflow of the
    scaled gradients). Skips are counted, the scale is shown, and they are not a fallback: the loss
    was finite. With growth_interval > total steps the scale only ever backs off, once per skip."""
    built = []

    class CountingScaler(torch.amp.GradScaler):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)
    monkeypatch.setattr(torch.amp, "GradScaler", CountingScaler)
    init, backoff = 2.0 ** 30, 2.0 ** -14
    cfg = cfg_for(data, tmp_path / "ckpt", amp_dtype="float16", force_amp_dtype=True, epochs=1,
                  init_scale=init, backoff_factor=backoff, growth_interval=1000)
    result, log = train_logged(cfg)
    assert built == [1]
    assert result["fallbacks"] == [] and result["precision"] == "fp16"
    row = result["history"][0]
    assert row["precision"] == "fp16"
    assert isinstance(row["scaler_scale"], float)
    assert 1 <= row["skipped_steps"] <= row["optimizer_steps"] == STEPS_PER_EPOCH
    assert row["scaler_scale"] == init * backoff ** row["skipped_steps"]
    csv_row = read_history_csv(cfg["checkpoint_dir"])[0]
    assert float(csv_row["scaler_scale"]) == row["scaler_scale"]
    assert int(csv_row["skipped_steps"]) == row["skipped_steps"]
    last = load(Path(cfg["checkpoint_dir"]) / "last.pt")
    assert last["scaler"] is not None and last["scaler"]["scale"] == row["scaler_scale"]


def test_bf16_never_builds_a_grad_scaler(nan_batch_run):
    cfg, result, _, built = nan_batch_run
    assert result["precision"] == "bf16"
    assert built == []
    assert all(row["scaler_scale"] is None for row in result["history"])
    assert all(r["scaler_scale"] == "" for r in read_history_csv(cfg["checkpoint_dir"]))
    assert load(Path(cfg["checkpoint_dir"]) / "last.pt")["scaler"] is None


def test_gradient_health_columns(data, tmp_path, monkeypatch):
    """grad_norm is measured before clipping; zero_grad_pct sees a parameter whose gradient is 0."""
    big = lambda m: m.encoder.layer4[1].conv2.weight
    build, _ = gradient_hook_model(lambda n: 0.0, param=big)  # a real all-zero gradient every step
    monkeypatch.setattr(train_unet, "build_model", build)
    clip = 1e-4
    cfg = cfg_for(data, tmp_path / "ckpt", grad_clip_norm=clip, epochs=1)
    result, _ = train_logged(cfg)
    model = ORIGINAL_BUILD_MODEL(train_unet.validate_config(cfg))
    share = 100.0 * big(model).numel() / sum(p.numel() for p in model.parameters())
    row = result["history"][0]
    assert row["skipped_steps"] == 0
    assert row["grad_norm"] > clip, "grad_norm must be the norm before clipping"
    assert row["grad_norm_max"] >= row["grad_norm"] > 0
    assert share <= row["zero_grad_pct"] <= 100.0
    csv_row = read_history_csv(cfg["checkpoint_dir"])[0]
    for column in ("grad_norm", "grad_norm_max", "zero_grad_pct"):
        assert math.isclose(float(csv_row[column]), row[column], rel_tol=1e-9)
    assert csv_row["fallback"] == "" and csv_row["precision"] == "bf16"


@pytest.mark.parametrize("init_scale, underflow", [(1.0, False), (2.0 ** -40, True)])
def test_the_fp16_underflow_warning_blames_fp16_only_for_zeros_fp32_does_not_have(data, tmp_path, init_scale,
                                                                                   underflow):
    """At 32 px resnet18's layer4 runs its 3x3 convolutions on 1x1 maps: 8 of 9 taps see only padding, so
    about half the gradient entries are exactly zero in any precision: no warning (init_scale=1: the default
    scale overflows this model's first steps, which then count no zeros). A loss scaled by 2^-40 (growth_interval
    past the run) puts the gradients below fp16's smallest value: a real underflow, warned."""
    cfg = cfg_for(data, tmp_path / "ckpt", amp_dtype="float16", force_amp_dtype=True, epochs=1,
                  init_scale=init_scale, growth_interval=1000)
    result, log = train_logged(cfg)
    row = result["history"][0]
    assert row["precision"] == "fp16" and row["zero_grad_pct"] > train_unet.FP16_UNDERFLOW_WARN_PCT
    warned = [line for line in log.splitlines() if "fp16 underflow" in line]
    assert bool(warned) == underflow, log
    if underflow:
        half, full = (float(v) for v in re.search(r"([\d.]+)% in fp16 against ([\d.]+)% in fp32", warned[0]).groups())
        assert half > full + train_unet.FP16_UNDERFLOW_WARN_PCT


@pytest.mark.parametrize("by_l1", [False, True])
def test_zero_gradient_count_is_exact(monkeypatch, by_l1):
    """Both ways of counting (the L0 norm on a CPU, |sign(g)|'s L1 norm where _foreach_norm is fused,
    CUDA) count exactly the fp32 gradient entries that are 0 (+0 and -0, not tiny or infinite ones).
    NaN is left out: with nan_guard (the default) or fp16's scaler its step is skipped, uncounted."""
    monkeypatch.setattr(train_unet, "ZERO_COUNT_BY_L1", ("cpu",) if by_l1 else ())
    g = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=g) * (torch.rand(shape, generator=g) > p)
             for shape, p in (((64, 32, 3, 3), 0.3), ((7,), 0.9), ((5, 5), 0.0), ((3, 3), 1.0))]
    grads.append(torch.tensor([0.0, -0.0, 1e-30, float("inf"), -1.0]))
    expected = sum(int((t == 0).sum()) for t in grads)
    assert expected > 5000 and train_unet.count_zero_grads(grads).item() == expected


# ---------------------------------------------------------------------------------------------------
# h. nan_guard=False: no detection, no fallback
# ---------------------------------------------------------------------------------------------------
def test_nan_guard_off_applies_the_nan_step_and_never_falls_back(data, tmp_path, monkeypatch):
    getitem, injected = nan_input(lambda epoch, index: epoch == 1 and index == 0)
    monkeypatch.setattr(train_unet.SegDataset, "__getitem__", getitem)
    cfg = cfg_for(data, tmp_path / "ckpt", nan_guard=False, nan_patience=1)
    result, log = train_logged(cfg)
    assert injected == [(1, 0)]
    # Plain PyTorch behaviour: nothing is checked, so nothing is skipped or rolled back ...
    assert result["fallbacks"] == [] and result["precision"] == "bf16"
    assert [row["epoch"] for row in result["history"]] == [1, 2]  # ... the run still finishes ...
    assert all(row["skipped_steps"] == 0 and row["fallback"] == "" for row in result["history"])
    # ... and the NaN gradients were applied: the weights are NaN (what nan_guard=True prevents). Every
    # validation is then NaN: no epoch is best, so no best.pt (one was written, of NaN weights), and the
    # last lines say so.
    ckpt_dir = Path(cfg["checkpoint_dir"])
    assert {p.name for p in ckpt_dir.iterdir()} == CKPT_FILES - {"best.pt"}
    last = load(ckpt_dir / "last.pt")
    assert last["epoch"] == cfg["epochs"] and nonfinite(last["model"], buffers=False) != []
    assert "done: no epoch validated finite;" in log and "every epoch's val loss was NaN/inf" in log


def test_a_val_loss_blown_up_but_finite_gets_one_note_naming_the_learning_rate(data, tmp_path, monkeypatch):
    """learning_rate=10 ran at val losses of 1e29, 1e15, 1e10, its IoU the same every epoch, and finished as
    a normal run: only a non-finite loss was caught. A class weight scales the limit (the loss with it)."""
    real_evaluate, losses = train_unet.evaluate, iter([9.5e29, 1.6e15, 2.0])

    def evaluate(*args, **kwargs):
        return {**real_evaluate(*args, **kwargs), "loss": next(losses)}
    monkeypatch.setattr(train_unet, "evaluate", evaluate)
    cfg = cfg_for(data, tmp_path / "ckpt", epochs=3, use_amp=False, learning_rate=10.0)
    _, log = train_logged(cfg)
    assert log.count("note: val loss") == 1 and "note: val loss 9.5e+29 in epoch 1: the model has diverged (the loss " \
        "starts near 1); likely learning_rate=10.0 too high (grad_clip_norm=1.0): try one 10 times lower" in log
    # the last line too: the note came two epochs before it, and best.pt is a diverged model
    assert "(the model diverged from epoch 1, val loss 9.5e+29: try a learning_rate 10 times lower); checkpoints" in log
    history, cfg = [{"epoch": 1, "val_loss": 5e4}], {**train_unet.CONFIG, **cfg}
    assert train_unet.diverged_note(history, {**cfg, "class_weights": [1.0, 10.0]}) is None
    assert train_unet.diverged_note(history, cfg).startswith("note: val loss 5e+04 in epoch 1")


@pytest.mark.parametrize("guard", [True, False])
def test_a_nonfinite_validation_is_never_best_and_stops_a_guarded_run(data, tmp_path, monkeypatch, guard):
    """A model that gives NaN in eval mode (a BatchNorm running mean gone NaN: the training steps, which use
    the batch's statistics, stay finite) was saved as best.pt where its IoU (0) beat the best so far. Now,
    with nan_guard, epoch 2 going so stops the run with a one-line error naming the buffer, epoch 1's
    checkpoints intact; without it, epoch 1 going so (for its validation only) is recorded, never best."""
    ckpt_dir, calls, real_evaluate = tmp_path / "ckpt", [], train_unet.evaluate

    def evaluate(model, *args, **kwargs):
        calls.append(1)
        mean = train_unet.unwrap(model).encoder.bn1.running_mean
        kept = mean.clone()
        if len(calls) == (2 if guard else 1):
            with torch.no_grad():
                mean.fill_(float("nan"))
        result = real_evaluate(model, *args, **kwargs)
        if not guard:
            with torch.no_grad():
                mean.copy_(kept)
        return result
    monkeypatch.setattr(train_unet, "evaluate", evaluate)
    cfg = cfg_for(data, ckpt_dir, epochs=2, use_amp=False, nan_guard=guard)
    if guard:
        with pytest.raises(train_unet.UserError, match="validation went non-finite in epoch 2 .*encoder.bn1.running_mean "
                                                       "is non-finite.*last.pt \\(epoch 1\\) is intact") as info:
            train_logged(cfg)
        assert "\n" not in str(info.value)
        assert train_unet.load_checkpoint(ckpt_dir / "last.pt")["epoch"] == 1
    else:
        result, log = train_logged(cfg)
        assert math.isnan(result["history"][0]["val_loss"]) and math.isfinite(result["history"][1]["val_loss"])
        first = next(line for line in log.splitlines() if line.startswith("epoch   1/2 |"))
        assert not first.endswith("| best"), first
    best = train_unet.load_checkpoint(ckpt_dir / "best.pt")
    assert best["epoch"] == (1 if guard else 2) and nonfinite(best["model"], buffers=True) == []


def test_a_ctrl_c_while_the_script_exits_ends_it_at_once_with_the_commands_code():
    """After a stop, Python joins the script's threads and runs its exit handlers: a second Ctrl-C then printed
    "Exception ignored in: <module 'threading'> ... KeyboardInterrupt" and ended the process by the signal. It
    ends it at once, with the command's own code: here --help's 0 (a stopped run's is 130)."""
    script = str(ROOT / "train_unet.py")
    code = ("import os, runpy, signal, sys, threading, time\n"
            f"sys.argv = [{script!r}, '--help']\n"
            "try:\n"
            f"    runpy.run_path({script!r}, run_name='__main__')\n"
            "except SystemExit:\n"
            "    threading.Thread(target=time.sleep, args=(60,)).start()  # joined at exit, as the script's are\n"
            "    threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()\n"
            "    raise\n")
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and time.monotonic() - start < 50, (done.returncode, done.stderr[-800:])
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr


def test_an_epoch_whose_every_loss_is_nan_reports_nan_not_a_perfect_zero(cpu_hw):
    """nan_guard=False, learning_rate=1e30: every loss NaN read 'train loss 0.0000', in history.csv too."""
    tally = train_unet.EpochTally(1, "cpu")
    logits, y = torch.zeros(2, 1, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long)
    for _ in range(3):
        assert not bool(tally.add(torch.tensor(math.nan), logits, y))
    assert math.isnan(result_loss(tally, cpu_hw))
    tally.add(torch.tensor(2.0), logits, y)  # one finite loss: the mean of the finite ones, as before
    assert result_loss(tally, cpu_hw) == 2.0


def result_loss(tally, hw):
    class NoHealth:  # the step's gradient statistics: not what is tested
        def stats(self):
            return None
    return tally.result(NoHealth(), hw)["loss"]
