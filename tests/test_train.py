"""Training end to end on tiny data: each precision path, exact resume, fallback, what a run writes."""
import csv
import json

import pytest
import torch

import train_unet
from unet_amp import checkpoint, precision
from unet_amp.common import UserError


def history(folder):
    with open(f"{folder}/history.csv") as f:
        return list(csv.DictReader(f))


@pytest.mark.parametrize("amp_dtype, name", [("float32", "fp32"), ("bfloat16", "bf16"), ("float16", "fp16")])
def test_each_precision_path_trains_and_writes_its_run(tiny, amp_dtype, name):
    cfg = {**tiny, "use_amp": amp_dtype != "float32", "amp_dtype": "auto" if amp_dtype == "float32" else amp_dtype}
    if name == "fp16":  # fp16 autocast on a CPU is 10-190x slower than fp32: the smallest run that steps
        cfg.update(max_train_images=4, batch_size=2)
    summary = train_unet.train(cfg)
    folder = tiny["checkpoint_dir"]
    assert summary["precision"] == name and 0 <= summary["best_iou"] <= 1
    assert [r["precision"] for r in history(folder)] == [name]
    state = checkpoint.load_checkpoint(f"{folder}/last.pt")
    assert state["precision"]["dtype"] == amp_dtype and (state["scaler"] is not None) == (name == "fp16")
    assert json.load(open(f"{folder}/summary.json"))["best_iou"] == summary["best_iou"]
    assert json.load(open(f"{folder}/config.json"))["amp_dtype"] == cfg["amp_dtype"]


def weights(path):
    return checkpoint.load_checkpoint(path)["model"]


def test_resume_continues_exactly(tiny, tmp_path, monkeypatch):
    base = {**tiny, "use_amp": False, "epochs": 2, "max_train_images": 8}
    train_unet.train({**base, "checkpoint_dir": str(tmp_path / "straight")})
    save = checkpoint.save_epoch

    def save_then_stop(run, *args):
        save(run, *args)
        raise KeyboardInterrupt  # Ctrl-C right after epoch 1's checkpoint
    monkeypatch.setattr(checkpoint, "save_epoch", save_then_stop)
    with pytest.raises(KeyboardInterrupt):
        train_unet.train({**base, "checkpoint_dir": str(tmp_path / "stopped")})
    monkeypatch.setattr(checkpoint, "save_epoch", save)
    train_unet.train({"resume": True, "checkpoint_dir": str(tmp_path / "stopped")})
    a, b = weights(tmp_path / "straight" / "last.pt"), weights(tmp_path / "stopped" / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    ious = [[r["val_iou"] for r in history(tmp_path / name)] for name in ("straight", "stopped")]
    assert ious[0] == ious[1]


def test_resume_refuses_a_key_that_changes_the_run(tiny):
    train_unet.train({**tiny, "use_amp": False, "max_train_images": 8})
    with pytest.raises(UserError, match="learning_rate"):
        train_unet.train({"resume": True, "checkpoint_dir": tiny["checkpoint_dir"], "learning_rate": 0.1})


def test_a_new_run_moves_the_earlier_one_aside(tiny):
    cfg = {**tiny, "use_amp": False, "max_train_images": 8}
    train_unet.train(cfg)
    first = weights(f"{tiny['checkpoint_dir']}/last.pt")
    train_unet.train({**cfg, "seed": 7})
    kept = list((checkpoint.Path(tiny["checkpoint_dir"]) / "previous").glob("*/last.pt"))
    assert len(kept) == 1 and all(torch.equal(first[k], weights(kept[0])[k]) for k in first)


def nan_after(loss_fn, steps_ok, when):
    """A loss that turns NaN after `steps_ok` calls while when() holds."""
    calls = [0]

    def wrapped(logits, target):
        calls[0] += 1
        loss = loss_fn(logits, target)
        return loss * float("nan") if calls[0] > steps_ok and when(logits) else loss
    return wrapped


def test_a_non_finite_streak_in_bf16_rolls_back_and_continues_in_fp32(tiny, monkeypatch):
    build = train_unet.models.build_loss
    in_bf16 = lambda logits: logits.dtype == torch.bfloat16  # noqa: E731
    monkeypatch.setattr(train_unet.models, "build_loss", lambda *a: nan_after(build(*a), 2, in_bf16))
    summary = train_unet.train({**tiny, "amp_dtype": "bfloat16", "nan_patience": 2})
    assert summary["fallbacks"][0]["from"] == "bf16" and summary["fallbacks"][0]["to"] == "fp32"
    row = history(tiny["checkpoint_dir"])[0]
    assert summary["precision"] == "fp32" and row["precision"] == "fp32"
    assert row["skipped_steps"] == "0" and float(row["train_loss"]) < 10  # the retry starts clean
    for value in checkpoint.load_checkpoint(f"{tiny['checkpoint_dir']}/last.pt")["model"].values():
        assert torch.isfinite(value.float()).all()


def test_a_non_finite_streak_in_fp32_stops_with_one_error(tiny, monkeypatch):
    build = train_unet.models.build_loss
    monkeypatch.setattr(train_unet.models, "build_loss", lambda *a: nan_after(build(*a), 0, lambda logits: True))
    with pytest.raises(UserError, match="fp32"):
        train_unet.train({**tiny, "use_amp": False, "nan_patience": 2})


def test_the_capability_check(monkeypatch):
    cfg = {**train_unet.CONFIG}
    def gpu(cap):
        return precision.Hardware(torch.device("cuda"), "cuda", "GPU", cap, cap >= (8, 0), cap >= (7, 0), set())
    assert train_unet.choose_dtype(cfg, gpu((9, 0)))[0] == "bfloat16"
    assert train_unet.choose_dtype(cfg, gpu((7, 5)))[0] == "float16"
    assert train_unet.choose_dtype(cfg, gpu((6, 1)))[0] == "float32"
    assert train_unet.choose_dtype({**cfg, "amp_dtype": "bfloat16"}, gpu((7, 0)))[0] == "float32"
    assert train_unet.choose_dtype({**cfg, "use_amp": False}, gpu((9, 0)))[0] == "float32"
    prec = train_unet.choose_precision({**cfg, "amp_dtype": "float16"}, gpu((8, 6)), None)
    assert prec.needs_scaler and prec.channels_last
    cpu = precision.Hardware(torch.device("cpu"), "cpu", "CPU", None, True, False, set())
    probe = {"dtype": "float32", "channels_last": True}
    assert train_unet.choose_precision(cfg, cpu, probe).dtype == torch.float32
    assert train_unet.choose_precision({**cfg, "amp_dtype": "bfloat16"}, cpu, probe).dtype == torch.bfloat16


def test_an_extended_resume_in_another_layout_adds_epochs(tiny):
    cfg = {**tiny, "use_amp": False, "max_train_images": 8, "channels_last": True}
    train_unet.train(cfg)
    summary = train_unet.train({"resume": True, "epochs": 2, "channels_last": False,
                                "checkpoint_dir": tiny["checkpoint_dir"]})
    assert [int(r["epoch"]) for r in history(tiny["checkpoint_dir"])] == [1, 2]
    assert summary["epochs_run"] == 2 and summary["channels_last"] is False


def test_patch_mode_with_ema_and_tensorboard(tiny):
    summary = train_unet.train({**tiny, "use_amp": False, "data_mode": "patch", "image_size": 32,
                                "max_train_images": 8, "ema_decay": 0.9, "logger": "tensorboard"})
    folder = checkpoint.Path(tiny["checkpoint_dir"])
    assert 0 <= summary["best_iou"] <= 1 and list((folder / "tb").glob("events.out.tfevents.*"))
    best, last = weights(folder / "best.pt"), weights(folder / "last.pt")
    assert any(not torch.equal(best[k], last[k]) for k in best if best[k].is_floating_point())  # best.pt: the EMA's


def test_the_debug_preset_trains_under_anomaly_detection(tiny):
    summary = train_unet.train({**tiny, "preset": "debug"})
    assert summary["config"]["detect_anomaly"] is True and summary["precision"] == "fp32"
    assert summary["config"]["epochs"] == 1  # typed keys win over the preset's


def test_a_run_shorter_than_the_cpu_probe_skips_it(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("UNET_PROBE_CACHE", str(tmp_path / "probe.json"))
    summary = train_unet.train({**tiny, "cpu_probe": True, "use_amp": True, "amp_dtype": "auto",
                                "channels_last": "auto"})  # 16 images at batch 4, one epoch: 4 steps
    assert not (tmp_path / "probe.json").exists()  # nothing timed, nothing cached
    assert summary["precision"] == ("bf16" if precision.cpu_bf16_native() else "fp32")
