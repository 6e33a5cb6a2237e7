"""Training numerics (accumulation, scaler, skipped steps) and end-to-end runs of train()."""
import csv
import json
import math
import os
import re
from pathlib import Path

import cv2
import pytest
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

import train_unet
from train_unet import (HISTORY_FIELDS, SegLoss, UserError, build_scaler, decide_precision,
                        load_checkpoint, train, train_one_epoch)

CKPT_KEYS = {"model", "optimizer", "scheduler", "scaler", "epoch", "best_iou", "rng", "config", "history"}


# ------------------------------------------------------------------------------------------------
# Helpers for the loop-level tests: a tiny model without BatchNorm and fixed data
# ------------------------------------------------------------------------------------------------
def tiny_net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 1, 1))


def fixed_data(n, size=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, size, size, generator=g)
    y = (torch.rand(n, size, size, generator=g) > 0.5).long()
    return TensorDataset(x, y)


def loop_cfg(**overrides):
    cfg = dict(train_unet.CONFIG, num_classes=1, progress=False, channels_last=False,
               grad_clip_norm=None, accumulation_steps=1)
    cfg.update(overrides)
    return cfg


def run_epoch(model, loader, cfg, hw, prec, scaler=None, lr=0.5):
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    run = train_unet.Run(model, model, optimizer, scheduler, scaler, prec, loss_fn=SegLoss(1, "ce"))
    return train_one_epoch(run, loader, cfg, hw)


def weights(model):
    return [p.detach().clone() for p in model.parameters()]


def assert_same_weights(a, b, atol=1e-6):
    for pa, pb in zip(a, b):
        assert torch.allclose(pa, pb, rtol=0, atol=atol), (pa - pb).abs().max()


def assert_changed(before, after):
    assert any(not torch.equal(p, q) for p, q in zip(before, after)), "the optimizer did not step"


def same_tiny_nets(n):
    """n copies of one freshly initialised tiny_net()."""
    nets = [tiny_net() for _ in range(n)]
    for net in nets[1:]:
        net.load_state_dict(nets[0].state_dict())
    return nets


@pytest.fixture
def fp32(cpu_hw):
    return decide_precision(cpu_hw, use_amp=False)


# ------------------------------------------------------------------------------------------------
# a. Gradient accumulation equals one big batch
# ------------------------------------------------------------------------------------------------
def test_accumulation_equals_one_big_batch(cpu_hw, fp32):
    data = fixed_data(8)
    init, small, big = same_tiny_nets(3)
    r_small = run_epoch(small, DataLoader(data, batch_size=2, shuffle=False),
                        loop_cfg(accumulation_steps=4), cpu_hw, fp32)
    r_big = run_epoch(big, DataLoader(data, batch_size=8, shuffle=False),
                      loop_cfg(accumulation_steps=1), cpu_hw, fp32)
    assert r_small["stats"].optimizer_steps == 1 and r_big["stats"].optimizer_steps == 1
    assert r_small["stats"].skipped_steps == 0
    assert_changed(weights(init), weights(big))
    assert_same_weights(weights(small), weights(big))
    # the measured (pre-clip) gradient norm is the big batch's
    assert r_small["stats"].grad_norm_sum == pytest.approx(r_big["stats"].grad_norm_sum, rel=1e-5)


def test_short_last_group_is_averaged_over_its_own_length(cpu_hw, fp32):
    """6 micro-batches with accumulation 4: steps after batches 1-4 and after 5-6, each the mean
    over its own group (as if batches 1-4 and 5-6 were two big batches)."""
    data = fixed_data(12)
    init, small, big = same_tiny_nets(3)
    r_small = run_epoch(small, DataLoader(data, batch_size=2, shuffle=False),
                        loop_cfg(accumulation_steps=4), cpu_hw, fp32)
    groups = DataLoader(data, batch_sampler=[list(range(0, 8)), list(range(8, 12))])
    r_big = run_epoch(big, groups, loop_cfg(accumulation_steps=1), cpu_hw, fp32)
    assert r_small["stats"].optimizer_steps == 2
    assert r_big["stats"].optimizer_steps == 2
    assert train_unet.optimizer_steps_per_epoch(6, 4) == 2
    assert_changed(weights(init), weights(big))
    assert_same_weights(weights(small), weights(big))


def test_gradient_clipping_limits_the_update(cpu_hw, fp32):
    data = fixed_data(4)
    model = tiny_net()
    before = weights(model)
    result = run_epoch(model, DataLoader(data, batch_size=4), loop_cfg(grad_clip_norm=1e-3),
                       cpu_hw, fp32, lr=1.0)
    measured = result["stats"].grad_norm_sum
    assert measured > 1e-3  # the reported norm is the pre-clip one
    step = torch.sqrt(sum(((a - b) ** 2).sum() for a, b in zip(before, weights(model))))
    assert step.item() == pytest.approx(1e-3, rel=1e-3)  # SGD lr=1: |update| == clip norm


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_non_finite_gradients_skip_the_step_without_scaler(cpu_hw, fp32):
    x, y = fixed_data(4).tensors
    x = x.clone()
    x[0, 0, 0, 0] = float("nan")
    model = tiny_net()
    before = weights(model)
    result = run_epoch(model, DataLoader(TensorDataset(x, y), batch_size=2),
                       loop_cfg(accumulation_steps=1, nan_guard=True), cpu_hw, fp32)
    stats = result["stats"]
    assert stats.optimizer_steps == 2
    assert stats.skipped_steps == 1  # the NaN batch; the other one is applied
    assert math.isfinite(stats.grad_norm_sum) and stats.grad_norm_sum > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert_changed(before, weights(model))


# ------------------------------------------------------------------------------------------------
# b. GradScaler only under fp16
# ------------------------------------------------------------------------------------------------
def record_output_dtypes(model):
    seen = []
    model.register_forward_hook(lambda m, inp, out: seen.append(out.dtype))
    return seen


def test_fp16_trains_with_a_grad_scaler(cpu_hw):
    prec = decide_precision(cpu_hw, True, "float16", force=True)
    cfg = loop_cfg(accumulation_steps=2)
    scaler = build_scaler(prec, cpu_hw, cfg)
    assert isinstance(scaler, torch.amp.GradScaler)
    model = tiny_net()
    dtypes = record_output_dtypes(model)
    before = weights(model)
    result = run_epoch(model, DataLoader(fixed_data(8), batch_size=2), cfg, cpu_hw, prec, scaler)
    assert set(dtypes) == {torch.float16}  # autocast really ran in fp16
    stats = result["stats"]
    assert stats.optimizer_steps == 2
    assert stats.skipped_steps == 0
    scale = scaler.get_scale()
    assert math.isfinite(scale) and scale > 0
    assert math.isfinite(result["loss"])
    assert_changed(before, weights(model))
    assert all(torch.isfinite(p).all() and p.dtype == torch.float32 for p in model.parameters())


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")
def test_fp16_overflow_is_skipped_and_the_scale_backs_off(cpu_hw):
    prec = decide_precision(cpu_hw, True, "float16", force=True)
    cfg = loop_cfg(init_scale=1e38)  # scaled gradients overflow fp16
    scaler = build_scaler(prec, cpu_hw, cfg)
    model = tiny_net()
    before = weights(model)
    result = run_epoch(model, DataLoader(fixed_data(4), batch_size=2), cfg, cpu_hw, prec, scaler)
    stats = result["stats"]
    assert stats.optimizer_steps == 2
    assert stats.skipped_steps >= 1
    assert scaler.get_scale() < 1e38
    if stats.skipped_steps == 2:
        assert_same_weights(before, weights(model), atol=0)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_bf16_has_no_scaler(cpu_hw):
    bf16 = train_unet.Precision(torch.bfloat16, False, "test")
    assert build_scaler(bf16, cpu_hw, loop_cfg()) is None
    model = tiny_net()
    dtypes = record_output_dtypes(model)
    result = run_epoch(model, DataLoader(fixed_data(4), batch_size=2), loop_cfg(), cpu_hw, bf16)
    assert set(dtypes) == {torch.bfloat16}
    assert result["stats"].optimizer_steps == 2 and result["stats"].skipped_steps == 0


# ------------------------------------------------------------------------------------------------
# c. End to end
# ------------------------------------------------------------------------------------------------
def read_history(path):
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


@pytest.fixture
def model_dtypes(monkeypatch):
    """Record (training?, output dtype) of every forward of the model train() builds."""
    seen = []
    build = train_unet.build_model

    def build_and_watch(cfg):
        model = build(cfg)
        model.register_forward_hook(lambda m, inp, out: seen.append((m.training, out.dtype)))
        model.register_forward_pre_hook(
            lambda m, inp: seen.append(("channels_last", inp[0].is_contiguous(
                memory_format=torch.channels_last))))
        return model
    monkeypatch.setattr(train_unet, "build_model", build_and_watch)
    return seen


@pytest.mark.parametrize("amp", ["fp32", "bf16"])
def test_train_end_to_end(make_cfg, cpu_hw, model_dtypes, amp, capsys):
    overrides = dict(use_amp=False) if amp == "fp32" else dict(use_amp=True, amp_dtype="bfloat16")
    cfg = make_cfg(epochs=1, **overrides)
    expected = "bf16" if amp == "bf16" and cpu_hw.bf16 else "fp32"
    result = train(cfg)
    out = capsys.readouterr().out
    banner_line = [line for line in out.splitlines() if line.startswith("precision")]
    assert banner_line and expected in banner_line[0]

    history = result["history"]
    assert len(history) == 1 and history[0]["epoch"] == 1
    assert result["precision"] == expected
    row = history[0]
    assert row["precision"] == expected
    assert row["optimizer_steps"] == 2        # 10 train images, batch 4, drop_last -> 2 batches
    assert row["skipped_steps"] == 0
    for key in ("train_loss", "val_loss", "lr", "grad_norm"):
        assert math.isfinite(row[key]) and row[key] > 0
    for key in ("train_iou", "val_iou", "val_dice"):
        assert 0.0 <= row[key] <= 1.0
    assert result["best_iou"] == row["val_iou"]

    # training forwards ran in the requested dtype; validation in fp32 (eval_amp=False)
    train_dtypes = {d for t, d in model_dtypes if t is True}
    eval_dtypes = {d for t, d in model_dtypes if t is False}
    want = torch.bfloat16 if expected == "bf16" else torch.float32
    assert train_dtypes == {want}
    assert eval_dtypes == {torch.float32}

    ckpt = Path(cfg["checkpoint_dir"])
    for name in ("last.pt", "best.pt", "history.csv", "config.json"):
        assert (ckpt / name).is_file(), name
    assert not list(ckpt.glob(".*.tmp*"))  # no temporary files left behind

    fields, rows = read_history(ckpt / "history.csv")
    assert fields == list(HISTORY_FIELDS)
    assert len(rows) == 1
    assert rows[0]["precision"] == expected
    assert float(rows[0]["val_iou"]) == pytest.approx(row["val_iou"])

    saved = json.loads((ckpt / "config.json").read_text())
    assert saved["precision"] == expected
    assert saved["config"]["batch_size"] == cfg["batch_size"]
    assert saved["config"]["data_dir"] == cfg["data_dir"]

    state = torch.load(ckpt / "last.pt", weights_only=True)
    assert CKPT_KEYS <= set(state)
    assert state["epoch"] == 1
    assert state["scaler"] is None  # no GradScaler for bf16 / fp32
    assert state["config"] == cfg
    assert len(state["history"]) == 1
    assert state["best_iou"] == pytest.approx(row["val_iou"])
    assert load_checkpoint(ckpt / "best.pt")["epoch"] == 1
    # the weights load into a freshly built model
    train_unet.build_model(cfg).load_state_dict(state["model"])  # strict


def test_train_main_cli(data_dir, tmp_path, capsys):
    ckpt = tmp_path / "cli"
    rc = train_unet.main([f"data_dir={data_dir}", f"checkpoint_dir={ckpt}", "image_size=32",
                          "batch_size=4", "epochs=1", "progress=false", "device=cpu",
                          "use_amp=false", "num_workers=0"])
    assert rc == 0
    assert (ckpt / "last.pt").is_file()
    assert load_checkpoint(ckpt / "last.pt")["config"]["image_size"] == 32


# ------------------------------------------------------------------------------------------------
# d. Resume, and archiving an earlier run
# ------------------------------------------------------------------------------------------------
def test_resume_continues_exactly(make_cfg, tmp_path, monkeypatch, capsys):
    """Two epochs straight == one epoch, interrupted, then resume=True for the second."""
    common = dict(epochs=2, batch_size=2, image_size=32, early_stopping_patience=None)
    dir_a, dir_b = tmp_path / "A", tmp_path / "B"
    straight = train(make_cfg(checkpoint_dir=str(dir_a), **common))

    # Run B: the same config, interrupted (Ctrl-C) right after epoch 1 was checkpointed.
    summary = train_unet.epoch_summary

    def interrupt_after_epoch_1(row, cfg, improved):
        text = summary(row, cfg, improved)
        if row["epoch"] == 1:
            raise KeyboardInterrupt
        return text
    monkeypatch.setattr(train_unet, "epoch_summary", interrupt_after_epoch_1)
    cfg_b = make_cfg(checkpoint_dir=str(dir_b), **common)
    args = [f"{k}={v}" for k, v in cfg_b.items() if v != train_unet.CONFIG[k]]
    assert train_unet.main(args) == 130
    assert "interrupted" in capsys.readouterr().err
    assert load_checkpoint(dir_b / "last.pt")["epoch"] == 1
    monkeypatch.setattr(train_unet, "epoch_summary", summary)

    resumed = train({**cfg_b, "resume": True})
    assert "resumed from" in capsys.readouterr().out
    assert [r["epoch"] for r in resumed["history"]] == [1, 2]
    assert not (dir_b / "previous").exists()  # resuming does not archive

    a = torch.load(dir_a / "last.pt", weights_only=True)
    b = torch.load(dir_b / "last.pt", weights_only=True)
    assert a["epoch"] == b["epoch"] == 2
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.allclose(a["model"][key].float(), b["model"][key].float(), rtol=0, atol=1e-6), key
    assert a["scheduler"]["last_epoch"] == b["scheduler"]["last_epoch"]
    for ra, rb in zip(straight["history"], resumed["history"]):
        for key in ("train_loss", "val_loss", "val_iou", "lr", "grad_norm"):
            assert ra[key] == pytest.approx(rb[key], rel=1e-5, abs=1e-7), key
    _, rows = read_history(dir_b / "history.csv")
    assert [int(r["epoch"]) for r in rows] == [1, 2]


def test_resume_without_checkpoint_is_a_user_error(make_cfg):
    cfg = make_cfg(resume=True)
    with pytest.raises(UserError) as info:
        train(cfg)
    assert "last.pt" in str(info.value) and "\n" not in str(info.value)


def test_resume_with_another_model_shape_is_a_user_error(make_cfg, tmp_path):
    ckpt = Path(make_cfg()["checkpoint_dir"])
    cfg = make_cfg(image_size=32)
    state = {"model": {}, "config": dict(cfg, num_classes=2), "history": [],  # what a resume reads: check_resumable
             **dict.fromkeys(("optimizer", "scheduler", "rng"), {}), "epoch": 1, "best_iou": 0.0,
             "epochs_since_best": 0, "precision": "fp32"}
    ckpt.mkdir(parents=True)
    torch.save(state, ckpt / "last.pt")
    with pytest.raises(UserError) as info:
        train(dict(cfg, resume=True))
    assert "num_classes" in str(info.value)


def test_resume_after_images_were_added_or_removed_is_refused(make_cfg, make_data, data_dir):
    """Four pairs added to 12: the seeded split reshuffled silently (img000 and img007 validated before;
    img006, img011 and a new one after), so images the model trained on were validated."""
    import shutil

    train(make_cfg(epochs=1))
    extra = make_data(name="extra", count=4, seed=1)
    for sub in ("images", "masks"):
        for path in (extra / sub).iterdir():
            shutil.copy(path, data_dir / sub / f"new_{path.name}")
    with pytest.raises(UserError, match=r"cannot resume exactly: .* is not the data set this run started on "
                                        r"\(10 train / 2 val images then, 13 / 3 now"):
        train(make_cfg(epochs=2, resume=True))
    for sub in ("images", "masks"):
        for path in (data_dir / sub).glob("new_*"):
            path.unlink()
    assert len(train(make_cfg(epochs=2, resume=True))["history"]) == 2  # put back: it resumes


def test_resume_on_another_data_set_says_so_before_its_masks(make_cfg, make_data, data_dir):
    """A binary run resumed with data_dir= a 3-class data set was refused for that set's masks ("holds values
    [0, 1, 2, 3]: with num_classes=1 masks must be 0/1 ...; set num_classes=4"), a fix that could not resume it:
    the data check ran first. The refusal now names the data set, and the folder to give."""
    train(make_cfg(epochs=1))
    other = make_data(name="classes", count=8, num_classes=3, seed=5)
    with pytest.raises(UserError, match=rf"^cannot resume exactly: {re.escape(str(other))} is not the data set this "
                                        rf"run started on \(10 train / 2 val images then, \d+ / \d+ now, or other "
                                        rf"files\): give data_dir={re.escape(os.path.realpath(data_dir))}, or start"):
        train(make_cfg(epochs=2, resume=True, data_dir=str(other)))
    with pytest.raises(UserError, match=r"num_classes"):  # a new run on it: the data check's refusal, as before
        train(make_cfg(epochs=1, data_dir=str(other), checkpoint_dir=str(Path(other).parent / "new")))


def test_resume_finds_the_same_data_set_however_its_folder_is_given(make_cfg, data_dir, tmp_path, monkeypatch,
                                                                     capsys):
    """data_dir=./data or a moved folder held the same files, yet the path's spelling refused the resume:
    with the split recorded, the files decide. Where the run's folder is still there beside the one given
    (names and sizes alike: a copy, or a data set of uncompressed images of one size), a note names it."""
    import shutil

    train(make_cfg(epochs=1))
    monkeypatch.chdir(tmp_path)
    assert len(train(make_cfg(epochs=2, resume=True, data_dir="./data"))["history"]) == 2
    shutil.copytree(data_dir, tmp_path / "copy")
    capsys.readouterr()
    assert len(train(make_cfg(epochs=3, resume=True, data_dir=str(tmp_path / "copy")))["history"]) == 3
    assert re.search(rf"note +this run began on {re.escape(os.path.realpath(data_dir))}, which still holds its data; "
                     rf"it goes on with .*copy, whose files have the same names and sizes: if that is not a copy of "
                     rf"the same data, give data_dir=.*data to resume exactly", capsys.readouterr().out)
    (tmp_path / "copy").rename(tmp_path / "moved")  # the folder the run went on with, moved: no note
    assert len(train(make_cfg(epochs=4, resume=True, data_dir=str(tmp_path / "moved")))["history"]) == 4
    assert "still holds its data" not in capsys.readouterr().out
    shutil.copytree(tmp_path / "moved", tmp_path / "again")  # moved again, its old folder reused for other data
    shutil.rmtree(tmp_path / "moved")
    train_unet.generate_shapes_dataset(tmp_path / "moved", count=5, size=32, seed=3)
    assert len(train(make_cfg(epochs=5, resume=True, data_dir=str(tmp_path / "again")))["history"]) == 5
    assert "still holds its data" not in capsys.readouterr().out  # it holds other files: said it held the run's


def test_resume_on_another_data_set_with_the_same_file_names_is_refused(make_cfg, make_data, tmp_path, capsys):
    """img000.png ... in another folder, other pictures: the stems matched, so the run went on over two
    validation sets. Same names, other sizes: refused elsewhere, a note in the run's own folder (edited)."""
    train(make_cfg(epochs=1))
    other = make_data(name="other", count=12, size=96, seed=7)
    with pytest.raises(UserError, match=r"cannot resume exactly: .*other holds files named as those this run "
                                        r"trained on in .*data, with other contents: give data_dir=.*data"):
        train(make_cfg(epochs=2, resume=True, data_dir=str(other)))
    data = Path(make_cfg()["data_dir"])
    mask = data / "masks" / sorted(p.name for p in (data / "masks").iterdir())[0]
    fixed = cv2.imread(str(mask), cv2.IMREAD_GRAYSCALE)
    fixed[5:20, 7:30] = fixed.max()  # a label fixed
    cv2.imwrite(str(mask), fixed)
    capsys.readouterr()
    assert len(train(make_cfg(epochs=2, resume=True))["history"]) == 2
    assert "changed since this run began (same names, other file sizes)" in capsys.readouterr().out


def test_resume_after_an_edit_that_keeps_the_file_size_gets_a_note(make_cfg, tmp_path, capsys):
    """An uncompressed BMP edited keeps its size: the resume went on with no word of it (the note came only for
    other sizes)."""
    data = Path(make_cfg()["data_dir"])
    for png in sorted((data / "images").iterdir()):
        cv2.imwrite(str(png.with_suffix(".bmp")), cv2.imread(str(png)))
        png.unlink()
    train(make_cfg(epochs=1))
    image = sorted((data / "images").iterdir())[0]
    before = image.stat()
    cv2.imwrite(str(image), 255 - cv2.imread(str(image)))  # inverted: every pixel other, the size the same
    os.utime(image, (before.st_atime, before.st_mtime + 60))  # in another second than the first write, surely
    assert image.stat().st_size == before.st_size
    capsys.readouterr()
    assert len(train(make_cfg(epochs=2, resume=True))["history"]) == 2
    out = capsys.readouterr().out
    assert "were rewritten since this run began (same names and sizes, other modification times" in out
    assert "other file sizes" not in out


def test_resume_after_two_masks_of_one_size_swapped_names_gets_a_note(make_cfg, capsys):
    """Uncompressed masks of one size written in one second, two of them swapped by name: the same names, sizes
    and modification times, two images trained against each other's masks, and the resume said nothing."""
    data = Path(make_cfg()["data_dir"])
    for png in sorted((data / "masks").iterdir()):  # uncompressed: every mask one size
        cv2.imwrite(str(png.with_suffix(".bmp")), cv2.imread(str(png), cv2.IMREAD_GRAYSCALE))
        png.unlink()
    train(make_cfg(epochs=1))
    first, second = sorted((data / "masks").iterdir())[:2]
    times = [(p.stat().st_atime_ns, p.stat().st_mtime_ns) for p in (first, second)]
    first.rename(first.with_name("swap"))
    second.rename(first)
    first.with_name("swap").rename(second)
    for path, (atime, mtime) in zip((second, first), times):  # the times as they were: each name's own
        os.utime(path, ns=(atime, mtime))
    capsys.readouterr()
    assert first.stat().st_size == second.stat().st_size
    assert len(train(make_cfg(epochs=2, resume=True))["history"]) == 2
    out = capsys.readouterr().out
    assert "were changed since this run began (same names, sizes and modification times, other status-change " \
           "times: renamed, swapped" in out
    assert "other file sizes" not in out and "were rewritten" not in out


def test_resume_of_a_data_set_moved_and_then_edited_goes_on_with_a_note(make_cfg, data_dir, tmp_path, capsys):
    """A data folder moved and a label fixed in it: the refusal said to give data_dir= the folder it was moved
    from, which no longer existed (the same edit unmoved was a note). Images added after the move stay refused,
    naming the folder the run began on."""
    import shutil

    train(make_cfg(epochs=1))
    shutil.move(str(data_dir), str(tmp_path / "moved"))
    mask = sorted((tmp_path / "moved" / "masks").iterdir())[0]
    fixed = cv2.imread(str(mask), cv2.IMREAD_GRAYSCALE)
    fixed[5:20, 7:30] = fixed.max()  # a label fixed
    cv2.imwrite(str(mask), fixed)
    capsys.readouterr()
    assert len(train(make_cfg(epochs=2, resume=True, data_dir=str(tmp_path / "moved")))["history"]) == 2
    assert re.search(rf"changed since this run began \(same names, other file sizes\); it began in "
                     rf"{re.escape(os.path.realpath(data_dir))}, which no longer holds them: the resume trains",
                     capsys.readouterr().out)
    shutil.move(str(tmp_path / "moved"), str(tmp_path / "again"))  # last.pt now records "moved"
    for sub in ("images", "masks"):
        first = sorted((tmp_path / "again" / sub).iterdir())[0]
        shutil.copy(first, first.with_name("added" + first.suffix))
    with pytest.raises(UserError, match=rf"give data_dir= the folder that holds the data it began on in "
                                        rf"{re.escape(os.path.realpath(tmp_path / 'moved'))}, or start a new run"):
        train(make_cfg(epochs=3, resume=True, data_dir=str(tmp_path / "again")))


def test_resume_with_data_dir_left_out_names_the_runs_folder_and_writes_nothing(make_cfg, tmp_path, monkeypatch):
    """Left out, data_dir is the embedded set's folder: the 300 shapes pairs were written there before the
    split told the user, in words that pointed at that folder, to put it back as it was."""
    cfg = make_cfg(epochs=1)
    train(cfg)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"was trained with data_dir='.*data'; this run has data_dir='data/shapes'"):
        train({**cfg, "epochs": 2, "resume": True, "data_dir": train_unet.CONFIG["data_dir"]})
    assert not (tmp_path / "data" / "shapes").exists()


def test_a_resume_whose_data_dir_is_missing_names_the_runs_data_not_the_embedded_set(make_cfg, data_dir, tmp_path):
    """data_dir not found on a resume: the error offered data_dir=data/shapes, the embedded set, which the resume
    then refuses as another data set. It names the run's folder where that is there, else says to put it back."""
    import shutil

    cfg = make_cfg(epochs=1)
    train(cfg)
    typo = str(tmp_path / "dta")
    with pytest.raises(UserError, match=rf"^resume=True but data_dir {re.escape(typo)} does not exist: .*last.pt "
                                        rf"trained on {re.escape(os.path.realpath(data_dir))}, which is still there: "
                                        rf"give data_dir={re.escape(os.path.realpath(data_dir))}$"):
        train({**cfg, "epochs": 2, "resume": True, "data_dir": typo})
    shutil.move(str(data_dir), str(tmp_path / "elsewhere"))
    with pytest.raises(UserError, match=rf"does not exist: .*last.pt trained on {re.escape(str(data_dir))}: put that "
                                        rf"data set back there, or give data_dir= the folder it moved to$") as info:
        train({**cfg, "epochs": 2, "resume": True})
    assert "shapes" not in str(info.value)
    assert len(train({**cfg, "epochs": 2, "resume": True, "data_dir": str(tmp_path / "elsewhere")})["history"]) == 2


def test_a_resume_refusal_from_another_folder_names_the_runs_data_as_a_path_that_leads_there(make_cfg, tmp_path,
                                                                                             monkeypatch):
    """A run trained with data_dir=d in its project folder, resumed from elsewhere: the refusal said 'resume with
    the same values (data_dir=d)', and that was 'not found'. It now names the folder the run recorded."""
    project = Path(make_cfg()["data_dir"]).parent
    monkeypatch.chdir(project)
    cfg = make_cfg(epochs=1, data_dir=Path(make_cfg()["data_dir"]).name)  # relative to the project
    train(cfg)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    resumed = {**cfg, "epochs": 2, "resume": True, "data_dir": train_unet.CONFIG["data_dir"],
               "checkpoint_dir": str(project / cfg["checkpoint_dir"])}
    with pytest.raises(UserError, match=r"resume with the same values \(data_dir=(\S+)\)") as info:
        train(resumed)
    given = re.search(r"data_dir=(\S+)\)", str(info.value))[1]
    assert given == os.path.realpath(project / cfg["data_dir"])
    assert len(train({**resumed, "data_dir": given})["history"]) == 2


def test_best_pt_keeps_no_optimizer_state_and_a_resume_from_it_is_a_one_line_error(make_cfg):
    """best.pt held AdamW's two moments per weight: three times the model (172 MB for resnet18's U-Net),
    written at every better epoch. Predict and export need none of it; a resume reads last.pt."""
    import shutil

    cfg = make_cfg(epochs=1)
    train(cfg)
    ckpt = Path(cfg["checkpoint_dir"])
    best, last = (train_unet.load_checkpoint(ckpt / name) for name in ("best.pt", "last.pt"))
    assert not set(train_unet.RESUME_ONLY) & set(best) and set(train_unet.RESUME_ONLY) <= set(last)
    assert all(torch.equal(best["model"][k], last["model"][k]) for k in last["model"])  # epoch 1 was the best
    assert (ckpt / "best.pt").stat().st_size < 0.5 * (ckpt / "last.pt").stat().st_size
    shutil.copy(ckpt / "best.pt", ckpt / "last.pt")
    with pytest.raises(UserError, match="without the optimizer state a resume continues from") as info:
        train(make_cfg(epochs=2, resume=True))
    assert "\n" not in str(info.value)


def test_a_last_pt_copied_in_from_another_run_sets_the_folders_own_files_aside(make_cfg, tmp_path, capsys):
    """Resuming another run's last.pt copied into a run folder kept that folder's best.pt as the run's (the
    summary named a best IoU it did not hold) and wrote over its history.csv unsaid (user report): its files
    but last.pt move to previous/<time>/ with a note. A resume of the folder's own run moves nothing."""
    import shutil

    own, other = (make_cfg(epochs=2, checkpoint_dir=str(tmp_path / "own")),
                  make_cfg(epochs=1, checkpoint_dir=str(tmp_path / "other")))
    train(own)
    train(other)
    folder = Path(own["checkpoint_dir"])
    capsys.readouterr()
    train({**own, "epochs": 3, "resume": True})  # its own run: nothing moves
    assert "is not of the run" not in capsys.readouterr().out and not (folder / "previous").exists()
    before = {name: (folder / name).read_bytes() for name in ("best.pt", "history.csv", "config.json")}
    shutil.copy(Path(other["checkpoint_dir"]) / "last.pt", folder / "last.pt")
    capsys.readouterr()
    train({**own, "epochs": 3, "resume": True})
    said = capsys.readouterr().out
    [moved] = list((folder / "previous").iterdir())
    assert f"{folder / 'best.pt'} is not of the run its last.pt continues (their histories differ: a last.pt copied " \
           f"from another run?): that run's files but last.pt moved to {moved}" in said
    assert {name: (moved / name).read_bytes() for name in before} == before and (moved / "tensorboard").is_dir() is \
        (folder / "tensorboard").is_dir()
    assert not (moved / "last.pt").exists()
    rows = (folder / "history.csv").read_text().splitlines()[1:]
    assert [row.split(",")[0] for row in rows] == ["1", "2", "3"]  # the other run's epoch 1, then this resume's
    capsys.readouterr()
    train({**own, "epochs": 4, "resume": True})  # the run's own best.pt now (or none): nothing moves
    assert "is not of the run" not in capsys.readouterr().out and len(list((folder / "previous").iterdir())) == 1


def test_a_best_pt_one_epoch_ahead_of_last_pt_is_the_runs_own(make_cfg, capsys):
    """finish_epoch writes best.pt before last.pt: stopped between the two (or last.pt restored from an older
    copy), best.pt holds one more epoch than last.pt. It is the run's own: nothing moves (review)."""
    cfg = make_cfg(epochs=2)
    train(cfg)
    folder = Path(cfg["checkpoint_dir"])
    last, best = (torch.load(folder / name, map_location="cpu", weights_only=False) for name in ("last.pt", "best.pt"))
    torch.save({**best, "history": last["history"], "epoch": 2}, folder / "best.pt")
    torch.save({**last, "history": last["history"][:1], "epoch": 1}, folder / "last.pt")
    capsys.readouterr()
    train({**cfg, "resume": True})
    assert "is not of the run" not in capsys.readouterr().out and not (folder / "previous").exists()


def test_an_edited_history_csv_moves_aside_on_resume_not_written_over(make_cfg, capsys):
    """A resume wrote history.csv again from last.pt's history: a column of notes the user had added (or a
    value changed) was gone without a word (helper's report). It moves to previous/<time>/ with a note;
    one a row behind last.pt, as a stop between the two writes leaves it, is the run's own."""
    cfg = make_cfg(epochs=2)
    train(cfg)
    folder = Path(cfg["checkpoint_dir"])
    path = folder / "history.csv"
    lines = path.read_text().splitlines()
    path.write_text("\n".join(lines[:-1]) + "\n")  # one row behind, as written
    capsys.readouterr()
    train({**cfg, "epochs": 3, "resume": True})
    assert "differs from the history" not in capsys.readouterr().out and not (folder / "previous").exists()
    edited = "\n".join(line + (",notes" if i == 0 else ",looked fine") for i, line in
                       enumerate(path.read_text().splitlines())) + "\n"
    path.write_text(edited)
    train({**cfg, "epochs": 4, "resume": True})
    [moved] = list((folder / "previous").iterdir())
    assert f"{path} differs from the history last.pt holds (edited, or written by another version): it moved " \
           f"to {moved}, and history.csv is written again from last.pt's" in capsys.readouterr().out
    assert (moved / "history.csv").read_text() == edited
    assert [row.split(",")[0] for row in path.read_text().splitlines()[1:]] == ["1", "2", "3", "4"]


def test_a_resume_stopped_before_its_first_epoch_keeps_a_history_csv(make_cfg, monkeypatch):
    """The edited history.csv moved aside at the start, and the new one came only at the end of the first
    epoch: stopped before it, the run's folder had none (the notebook: "no finished epoch")."""
    cfg = make_cfg(epochs=1)
    train(cfg)
    folder = Path(cfg["checkpoint_dir"])
    own = (folder / "history.csv").read_text()
    (folder / "history.csv").write_text(own + "mean,,,,,,0.5\n")  # a summary line added: not an epoch's row

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_unet, "run_epoch", stopped)
    with pytest.raises(KeyboardInterrupt):
        train({**cfg, "epochs": 2, "resume": True})
    [moved] = list((folder / "previous").iterdir())
    assert (moved / "history.csv").read_text().endswith("mean,,,,,,0.5\n")
    assert (folder / "history.csv").read_text() == own


@pytest.mark.parametrize("keep", [("model", "optimizer", "config", "epoch"), ("model", "config", "optimizer", "epoch",
                                                                            "scheduler", "history", "best_iou", "rng")])
def test_a_last_pt_saved_another_way_is_one_line(make_cfg, keep):
    """A last.pt with some of training's keys (a notebook's torch.save) gave KeyError: 'precision' from deep in the
    resume (user report)."""
    cfg = make_cfg(epochs=1)
    train(cfg)
    last = Path(cfg["checkpoint_dir"]) / "last.pt"
    state = torch.load(last, map_location="cpu", weights_only=False)
    torch.save({key: state[key] for key in keep}, last)
    with pytest.raises(UserError, match=rf"^{re.escape(str(last))} lacks .*precision, which a resume continues "
                                        rf"from: it is not a last.pt as training writes it") as info:
        train(make_cfg(epochs=2, resume=True))
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("data_mode, refused", [("patch", True), ("fit", False)])
def test_resume_with_another_tile_overlap_is_refused_in_patch_mode(make_cfg, data_mode, refused):
    """Patch mode's validation slides a window: epochs scored at overlap 0.25 and 0.5 were compared by best.pt
    without a word. Fit mode has no window: the key is unused there."""
    cfg = make_cfg(data_mode=data_mode)
    state = {"config": dict(cfg), "data_split": None}
    assert train_unet.changed_resume_keys(state, {**cfg, "tile_overlap": 0.5}) == (["tile_overlap"] if refused else [])


def test_resume_with_another_tta_is_refused(make_cfg):
    """best.pt compares every epoch's val IoU: plain epochs against a TTA one made a 'best' of a method."""
    train(make_cfg(epochs=1))
    with pytest.raises(UserError, match="cannot resume exactly: .* tta='none'; this run has tta='flip'"):
        train(make_cfg(epochs=2, resume=True, tta="flip"))


def test_resume_with_another_eval_precision_is_refused_and_other_clipping_is_said(make_cfg, capsys):
    """eval_amp scores the resumed epochs in another precision than best.pt's IoU to beat; grad_clip_norm
    (turned on to tame a run, say) changes the steps: both were taken without a word."""
    cfg = make_cfg()
    state = {"config": dict(cfg), "data_split": None}
    assert train_unet.changed_resume_keys(state, {**cfg, "eval_amp": True}) == ["eval_amp"]
    assert train_unet.changed_resume_keys({"config": {k: v for k, v in cfg.items() if k != "eval_amp"}}, cfg) == []
    train(make_cfg(epochs=1))
    train(make_cfg(epochs=2, resume=True, grad_clip_norm=0.5))
    assert "grad_clip_norm changed from 1.0 to 0.5: the steps from here differ" in capsys.readouterr().out


def test_resuming_a_run_that_stopped_early_is_refused_unless_the_patience_grows(make_cfg, monkeypatch):
    """Resumed with its patience, an early-stopped run trained one more epoch and stopped again, every time."""
    rows = iter([0.5, 0.4, 0.3, 0.2])
    real = train_unet.finish_epoch
    monkeypatch.setattr(train_unet, "finish_epoch",
                        lambda run, row, cfg: real(run, {**row, "val_iou": next(rows)}, cfg))
    result = train(make_cfg(epochs=6, early_stopping_patience=1))
    assert len(result["history"]) == 2
    with pytest.raises(UserError, match=r"stopped early after epoch 2: its val IoU had not improved for 1 epoch\(s\), "
                                        r"and early_stopping_patience=1: raise it to go on \(e.g. early_stopping"):
        train(make_cfg(epochs=6, early_stopping_patience=1, resume=True))
    result = train(make_cfg(epochs=6, early_stopping_patience=2, resume=True))
    assert [row["epoch"] for row in result["history"]] == [1, 2, 3]


def test_a_run_that_ended_its_epochs_without_improving_is_not_said_to_have_stopped_early(make_cfg, monkeypatch):
    """A run never stops early at its last epoch: one that ended its 3 epochs 2 epochs after its best, extended
    with its patience of 2 kept, was refused as 'stopped early after epoch 3' (review)."""
    rows = iter([0.5, 0.4, 0.3])
    real = train_unet.finish_epoch
    monkeypatch.setattr(train_unet, "finish_epoch",
                        lambda run, row, cfg: real(run, {**row, "val_iou": next(rows)}, cfg))
    train(make_cfg(epochs=3, early_stopping_patience=2))
    with pytest.raises(UserError, match=r"last.pt ended its 3 epochs without a better val IoU for 2 epoch\(s\), and "
                                        r"early_stopping_patience=2: raise it to go on"):
        train(make_cfg(epochs=5, early_stopping_patience=2, resume=True))


def test_a_resume_keeps_the_runs_early_stopping_patience_unless_given(make_cfg, monkeypatch, capsys):
    """A run trained with early_stopping_patience=None, stopped, resumed as its stop said (resume=True epochs=N):
    CONFIG's 5 came back, unsaid, and the resume stopped early where the uninterrupted run trained every epoch;
    given a patience it has already waited out, the refusal said 'stopped early' of a run that never did."""
    rows = iter([0.5, 0.4, 0.3, 0.2, 0.1, 0.09, 0.08, 0.07])
    real = train_unet.finish_epoch
    monkeypatch.setattr(train_unet, "finish_epoch",
                        lambda run, row, cfg: real(run, {**row, "val_iou": next(rows)}, cfg))
    train(make_cfg(epochs=4, early_stopping_patience=None))
    resumed = make_cfg(epochs=8, resume=True)  # early_stopping_patience left out: CONFIG's 5
    last = Path(resumed["checkpoint_dir"]) / "last.pt"
    stopped = train_unet.load_checkpoint(last)
    train_unet.save_checkpoint(last.with_name("stopped.pt"), {**stopped, "config": {**stopped["config"], "epochs": 8}})
    assert resumed["early_stopping_patience"] == train_unet.CONFIG["early_stopping_patience"] == 5
    with pytest.raises(UserError, match=r"last.pt ended its 4 epochs without a better val IoU for 3 epoch\(s\), and "
                                        r"early_stopping_patience=2: raise it"):
        train({**resumed, "early_stopping_patience": 2})
    finished = last.read_bytes()
    last.write_bytes(last.with_name("stopped.pt").read_bytes())  # a run of 8 epochs stopped after 4 (Ctrl-C)
    with pytest.raises(UserError, match=r"last.pt has not improved its val IoU for 3 epoch\(s\) \(it trained with "
                                        r"early_stopping_patience=None\), and early_stopping_patience=2: raise it"):
        train({**resumed, "early_stopping_patience": 2})
    last.write_bytes(finished)
    capsys.readouterr()
    result = train(resumed)
    assert [row["epoch"] for row in result["history"]] == list(range(1, 9))  # not stopped after epoch 6
    assert "; early_stopping_patience=None as it trained" in capsys.readouterr().out
    assert train_unet.resume_words({**train_unet.CONFIG, "preset": "debug"}) == "resume=True preset=debug"
    # epochs typed as CONFIG's over the preset's: named, or the resume would end the run at debug's 2 (review)
    assert train_unet.resume_words({**train_unet.CONFIG, "preset": "debug"}, {"epochs"}) == \
        f"resume=True preset=debug epochs={train_unet.CONFIG['epochs']}"



def test_a_preset_given_on_resume_sets_the_patience_it_says(make_cfg, monkeypatch, capsys):
    """resume=True preset=debug on a run of patience 5: the banner said debug's early_stopping_patience=None, the
    run kept its 5, unsaid, and stopped early (an early-stopped one was refused: 'set it to None'). The run's own
    preset given again, as its stop line says, keeps the patience the run trained with (user test)."""
    rows = iter([0.5, 0.4, 0.3, 0.2, 0.1, 0.09])
    real = train_unet.finish_epoch
    monkeypatch.setattr(train_unet, "finish_epoch",
                        lambda run, row, cfg: real(run, {**row, "val_iou": next(rows)}, cfg))
    keep = {key: value for key, value in train_unet.PRESETS["debug"].items()
            if key not in ("early_stopping_patience", "epochs")}  # the first run: debug's settings but these
    result = train(make_cfg(epochs=6, early_stopping_patience=1, **keep))
    assert len(result["history"]) == 2  # stopped early
    capsys.readouterr()
    resumed = make_cfg(epochs=4, resume=True, preset="debug", **keep)
    result = train(resumed, explicit={"epochs", *keep})
    assert [row["epoch"] for row in result["history"]] == [1, 2, 3, 4]  # every epoch: debug's None
    assert "early_stopping_patience changed from 1 to None" in capsys.readouterr().out
    saved = json.loads((Path(resumed["checkpoint_dir"]) / "config.json").read_text())["config"]
    assert saved["early_stopping_patience"] is None
    # a run trained with preset=debug and patience 1 typed over it: resumed with preset=debug, it keeps 1
    train(make_cfg(checkpoint_dir=resumed["checkpoint_dir"] + "2", epochs=6, preset="debug",
                   early_stopping_patience=1), explicit={"epochs", "early_stopping_patience"})
    with pytest.raises(UserError, match=r"stopped early after epoch 2: .* early_stopping_patience=1: raise it"):
        train(make_cfg(checkpoint_dir=resumed["checkpoint_dir"] + "2", epochs=6, preset="debug", resume=True),
              explicit={"epochs"})


def test_the_preset_line_of_a_resume_names_the_patience_kept_from_the_run(make_cfg, capsys):
    """preset=debug early_stopping_patience=5, resumed with preset=debug as its stop line says: the run kept its 5,
    but the banner's preset line (and config.json's) still listed debug's early_stopping_patience=None."""
    cfg = make_cfg(epochs=1, preset="debug", early_stopping_patience=5, image_size=32)
    train(cfg, explicit={"epochs", "early_stopping_patience", "image_size"})
    capsys.readouterr()
    train({**cfg, "epochs": 2, "resume": True}, explicit={"epochs", "image_size"})
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("preset "))
    assert "early_stopping_patience=None" not in line
    assert line.endswith("kept the resumed run's: early_stopping_patience=5")
    info = json.loads((Path(cfg["checkpoint_dir"]) / "config.json").read_text())
    assert info["config"]["early_stopping_patience"] == 5 and info["preset"] == line.split(None, 1)[1]


def stopped_then_started_again(cfg, epoch, interrupt_at, monkeypatch, capsys):
    """A run stopped by Ctrl-C in `epoch`, then started again in its folder without resume: that run's output."""
    real = interrupt_at(epoch)
    with pytest.raises(KeyboardInterrupt):
        train(cfg)
    monkeypatch.setattr(train_unet, "run_epoch", real)
    capsys.readouterr()
    train(cfg)
    return capsys.readouterr().out


def test_a_run_stopped_in_its_first_epoch_is_not_called_an_earlier_run(make_cfg, capsys, interrupt_at, monkeypatch):
    """Ctrl-C in epoch 1 leaves config.json and a TensorBoard log; the next run said "an earlier run ... was
    moved" of them. It now says what was moved."""
    cfg = make_cfg(epochs=1)
    out = stopped_then_started_again(cfg, 1, interrupt_at, monkeypatch, capsys)
    assert "what an earlier run that finished no epoch wrote (config.json, its TensorBoard log) in " in out
    train(cfg)
    assert "note         an earlier run in " in capsys.readouterr().out


def test_a_new_run_says_the_run_it_moves_aside_had_stopped_before_its_epochs(make_cfg, capsys, interrupt_at,
                                                                             monkeypatch, tmp_path):
    """A run stopped after epoch 1 of 3, started again without resume=True: the note said only that an earlier
    run was moved, not that it could have continued. A finished run, or one that stopped early, gets no such
    words; nor does a last.pt killed in its first write leave 'finished no epoch' (its best.pt was moved)."""
    cfg = make_cfg(epochs=3)
    assert "(it had stopped after epoch 1 of 3: to continue it instead, move its files back and give resume=True)" \
        in stopped_then_started_again(cfg, 2, interrupt_at, monkeypatch, capsys)
    train(cfg)
    out = capsys.readouterr().out
    assert "note         an earlier run in " in out and "it had stopped" not in out
    (Path(cfg["checkpoint_dir"]) / "last.pt").unlink()  # killed in last.pt's first write: best.pt alone
    (Path(cfg["checkpoint_dir"]) / "history.csv").unlink()
    train(cfg)
    assert "note         an earlier run in " in capsys.readouterr().out


def test_a_library_train_interrupted_says_what_the_command_line_says(make_cfg, interrupt_at):
    """A notebook's interrupt of train() was a bare KeyboardInterrupt(); the command line's 'checkpoints
    written so far are intact; resume=True continues' was never said."""
    cfg = make_cfg(epochs=2)
    interrupt_at(2)
    with pytest.raises(KeyboardInterrupt, match="^checkpoints written so far are intact; resume=True .*epochs=2 "
                                                ".*continues$"):
        train(cfg)
    interrupt_at(1)
    with pytest.raises(KeyboardInterrupt, match="^no epoch had finished, so there is no checkpoint to resume"):
        train({**cfg, "checkpoint_dir": cfg["checkpoint_dir"] + "2"})


@pytest.mark.parametrize("stop", [KeyboardInterrupt, UserError])
def test_a_stopped_library_train_lets_its_workers_caches_and_writer_go(make_cfg, monkeypatch, stop):
    """A notebook keeps the last exception (sys.last_value; here pytest's, held below): the frames it
    passed through held the stopped run's loader workers (hundreds of MB each), its decoded-image folders
    and its TensorBoard writer's thread, alive until another error took its place."""
    import multiprocessing
    import tempfile
    import threading
    cfg = make_cfg(epochs=2, num_workers=1, image_size=32, logger="tensorboard")
    real, before = train_unet.run_epoch, set(threading.enumerate())

    def stopped(run, epoch, *args):
        if epoch == 2:  # the workers (persistent) and the caches are the first epoch's
            raise stop("stopped") if stop is UserError else stop
        return real(run, epoch, *args)
    monkeypatch.setattr(train_unet, "run_epoch", stopped)
    with pytest.raises(stop) as held:
        train(cfg)
    assert held.value is not None  # still held, as Jupyter holds it
    assert multiprocessing.active_children() == []
    mine = f"{train_unet.CACHE_PREFIX}{os.getpid()}-"
    assert not [name for name in os.listdir(tempfile.gettempdir()) if name.startswith(mine)]
    assert [t.name for t in set(threading.enumerate()) - before
            if not t.name.startswith(("unet-amp-masks", "tqdm"))] == []  # pools kept across runs
    assert (Path(cfg["checkpoint_dir"]) / "last.pt").is_file()  # nothing written is lost


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="Linux's clear_refs resets the peak")
def test_a_runs_peak_memory_is_its_own_not_the_processes_before_it(make_cfg):
    """In a notebook's kernel the CPU peak (VmHWM) was the kernel's: a 2 GiB array freed before a run
    made every later run's peak_mem_mb read 2 GiB more than the same run from the command line."""
    import numpy as np
    big = np.ones(2**28)  # 2 GiB, every page touched
    del big
    with open("/proc/self/status") as status:
        before = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:")) / 2**10
    row = train(make_cfg(image_size=32))["history"][-1]
    assert row["peak_mem_kind"] == "process_peak_rss" and 0 < row["peak_mem_mb"] < before - 1024


def test_fresh_run_archives_the_previous_one(make_cfg, tmp_path, capsys):
    cfg = make_cfg(image_size=32, batch_size=4)
    ckpt = Path(cfg["checkpoint_dir"])
    train(cfg)
    first = {n: (ckpt / n).read_bytes() for n in ("last.pt", "best.pt", "history.csv", "config.json")}
    train(cfg)
    assert "was moved to" in capsys.readouterr().out
    archived = list((ckpt / "previous").iterdir())
    assert len(archived) == 1
    for name, data in first.items():
        assert (archived[0] / name).read_bytes() == data, name  # nothing lost
    for name in first:
        assert (ckpt / name).is_file()  # and the new run wrote its own


def test_two_archives_in_the_same_second_lose_nothing(tmp_path, monkeypatch):
    """archive_previous_run names the folder by the second; a second archive within that second
    (e.g. two quick failed runs) must not overwrite the first archive's files."""
    monkeypatch.setattr(train_unet.time, "strftime", lambda fmt, *a: "20250101-120000")
    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    for run in ("run1", "run2"):
        for name in ("last.pt", "history.csv", "config.json"):
            (ckpt / name).write_text(f"{run} {name}")
        assert train_unet.archive_previous_run(ckpt) is not None
        assert not (ckpt / "last.pt").exists()
    contents = {p.read_text() for p in (ckpt / "previous").rglob("*") if p.is_file()}
    for run in ("run1", "run2"):
        for name in ("last.pt", "history.csv", "config.json"):
            assert f"{run} {name}" in contents, f"{run}'s {name} was lost"


# ------------------------------------------------------------------------------------------------
# e. torch.compile and channels_last
# ------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_compile_model(make_cfg, make_data):
    """Slow (inductor compiles forward and backward; ~80 s with a cold cache on 2 cores)."""
    root = make_data("tiny", count=6, size=32)
    cfg = make_cfg(data_dir=str(root), image_size=32, batch_size=2, compile_model=True)
    result = train(cfg)
    assert len(result["history"]) == 1
    assert math.isfinite(result["history"][0]["train_loss"])
    for name in ("last.pt", "best.pt"):
        state = load_checkpoint(Path(cfg["checkpoint_dir"]) / name)
        assert not [k for k in state["model"] if "_orig_mod" in k]
        train_unet.build_model(cfg).load_state_dict(state["model"])  # strict: plain keys


def test_channels_last_with_eval_amp(make_cfg, model_dtypes, cpu_hw, capsys):
    cfg = make_cfg(image_size=32, channels_last=True, use_amp=True, amp_dtype="bfloat16",
                   eval_amp=True)
    result = train(cfg)
    out = capsys.readouterr().out
    assert "channels_last" in [line for line in out.splitlines() if line.startswith("layout")][0]
    assert len(result["history"]) == 1
    if cpu_hw.bf16:  # eval_amp=True: validation runs under autocast too
        assert {d for t, d in model_dtypes if t is False} == {torch.bfloat16}
        assert {d for t, d in model_dtypes if t is True} == {torch.bfloat16}
    assert math.isfinite(result["history"][0]["train_loss"])
    layouts = [flag for tag, flag in model_dtypes if tag == "channels_last"]
    assert layouts and all(layouts)  # every forward got an NHWC input
    state = load_checkpoint(Path(cfg["checkpoint_dir"]) / "last.pt")
    assert not [k for k in state["model"] if "_orig_mod" in k]


# ------------------------------------------------------------------------------------------------
# f. Early stopping
# ------------------------------------------------------------------------------------------------
def expected_stop(val_ious, patience, epochs):
    best, since = -1.0, 0
    for epoch, iou in enumerate(val_ious, 1):
        best, since = (iou, 0) if iou > best else (best, since + 1)
        if since >= patience and epoch < epochs:
            return epoch
    return epochs


def test_early_stopping_with_a_tiny_learning_rate(make_cfg):
    """lr 1e-9: the weights stay put; only BatchNorm statistics drift, so val IoU soon stops
    improving and patience=1 ends the run before `epochs`."""
    epochs = 6
    cfg = make_cfg(epochs=epochs, batch_size=2, learning_rate=1e-9, early_stopping_patience=1)
    result = train(cfg)
    history = result["history"]
    ious = [r["val_iou"] for r in history]
    assert len(history) < epochs, f"early stopping did not trigger: val IoU {ious}"
    assert len(history) == expected_stop(ious, 1, epochs)
    assert result["best_iou"] == max(ious)
    best = load_checkpoint(Path(cfg["checkpoint_dir"]) / "best.pt")
    assert best["epoch"] == ious.index(max(ious)) + 1


def test_early_stopping_follows_patience(make_cfg, make_data, monkeypatch):
    """Scripted val IoU 0.5, 0.6, 0.6, 0.55, 0.9 with patience 2: stop after epoch 4."""
    scripted = iter([0.5, 0.6, 0.6, 0.55, 0.9])
    evaluate = train_unet.evaluate

    def fake_evaluate(*args, **kwargs):
        return {**evaluate(*args, **kwargs), "iou": next(scripted)}
    monkeypatch.setattr(train_unet, "evaluate", fake_evaluate)
    root = make_data("tiny", count=6, size=32)
    cfg = make_cfg(data_dir=str(root), image_size=32, batch_size=2, epochs=5,
                   early_stopping_patience=2)
    result = train(cfg)
    assert [r["val_iou"] for r in result["history"]] == [0.5, 0.6, 0.6, 0.55]
    assert result["best_iou"] == 0.6
    assert load_checkpoint(Path(cfg["checkpoint_dir"]) / "best.pt")["epoch"] == 2
    assert load_checkpoint(Path(cfg["checkpoint_dir"]) / "last.pt")["epoch"] == 4


# ------------------------------------------------------------------------------------------------
# g. load_checkpoint refuses what is not a checkpoint of this trainer
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["garbage", "empty", "text", "list", "dict_without_model"])
def test_load_checkpoint_rejects_non_checkpoints(tmp_path, kind):
    path = tmp_path / f"{kind}.pt"
    if kind == "garbage":
        path.write_bytes(bytes(range(256)) * 4)
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "text":
        path.write_text("hello, not a checkpoint\n")
    elif kind == "list":
        torch.save([1, 2, 3], path)
    else:
        torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(UserError) as info:
        load_checkpoint(path)
    message = str(info.value)
    assert str(path) in message and "\n" not in message


def test_load_checkpoint_missing_file(tmp_path):
    with pytest.raises(UserError) as info:
        load_checkpoint(tmp_path / "nope.pt")
    assert "nope.pt" in str(info.value)


def test_resume_from_an_empty_last_pt_is_a_user_error(make_cfg):
    cfg = make_cfg(resume=True)
    ckpt = Path(cfg["checkpoint_dir"])
    ckpt.mkdir(parents=True)
    (ckpt / "last.pt").write_bytes(b"")
    with pytest.raises(UserError) as info:
        train(cfg)
    assert "last.pt" in str(info.value)
