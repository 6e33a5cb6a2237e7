"""TensorBoard logging: events read back with tensorboard's own reader; no extra host syncs per step."""
import math
from pathlib import Path

import pytest
import torch
import torch.nn as nn
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import DataLoader, TensorDataset

import train_unet
from train_unet import Run, RunLogger, SegLoss, UserError, decide_precision, train, train_one_epoch

# The LR schedule steps on skipped steps too (fp16's scaler may skip the first): expected, see train_unet.
pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")


def read_events(folder):
    acc = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return acc


def scalars(acc, tag):
    return [(e.step, e.value) for e in acc.Scalars(tag)]


def test_steps_and_epochs_are_logged(make_cfg):
    # 10 train images, batch 2 -> 5 micro-batches; accumulation 2 -> groups of 2, 2, 1 = 3 steps/epoch
    cfg = make_cfg(epochs=2, batch_size=2, accumulation_steps=2)
    result = train(cfg)
    acc = read_events(Path(cfg["checkpoint_dir"]) / "tensorboard")
    tags = set(acc.Tags()["scalars"])
    assert {"step/loss", "step/lr", "step/grad_norm"} <= tags
    assert "step/loss_scale" not in tags  # fp32: no GradScaler, no scale to log
    for tag in ("step/loss", "step/lr", "step/grad_norm"):
        assert [s for s, _ in scalars(acc, tag)] == [1, 2, 3, 4, 5, 6], tag
    history = result["history"]
    # Each step's loss is the mean over its micro-batches: weighted by group size it gives the epoch's.
    losses = [v for _, v in scalars(acc, "step/loss")]
    for epoch, chunk in enumerate((losses[:3], losses[3:])):
        weighted = (2 * chunk[0] + 2 * chunk[1] + chunk[2]) / 5
        assert weighted == pytest.approx(history[epoch]["train_loss"], rel=1e-5)
    assert all(math.isfinite(v) and v > 0 for _, v in scalars(acc, "step/grad_norm"))
    # The learning rate each step used: the schedule's value before that step's scheduler.step()
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=cfg["learning_rate"])
    sched = train_unet.build_scheduler(opt, cfg, steps_per_epoch=3)
    expected = []
    for _ in range(6):
        expected.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert [v for _, v in scalars(acc, "step/lr")] == pytest.approx(expected, rel=1e-6)
    for tag in ("epoch/val_iou", "epoch/val_dice", "epoch/train_loss", "epoch/epoch_time_s",
                "epoch/images_per_s", "epoch/peak_mem_mb", "epoch/skipped_steps", "epoch/grad_norm"):
        assert [s for s, _ in scalars(acc, tag)] == [1, 2], tag
    assert [v for _, v in scalars(acc, "epoch/val_iou")] == pytest.approx([h["val_iou"] for h in history])
    texts = acc.Tags()["tensors"]
    assert "precision/text_summary" in texts and "config/text_summary" in texts
    assert [e.step for e in acc.Tensors("precision/text_summary")] == [1, 2]


def test_fp16_logs_the_loss_scale(make_cfg):
    cfg = make_cfg(image_size=32, use_amp=True, amp_dtype="float16", force_amp_dtype=True)
    train(cfg)
    acc = read_events(Path(cfg["checkpoint_dir"]) / "tensorboard")
    scale = scalars(acc, "step/loss_scale")
    assert [s for s, _ in scale] == [1, 2]
    assert scale[0][1] == cfg["init_scale"] or scale[0][1] == cfg["init_scale"] * cfg["backoff_factor"]


def test_a_new_run_archives_the_earlier_events(make_cfg):
    cfg = make_cfg(epochs=2)
    train(cfg)
    train({**cfg, "epochs": 1})
    ckpt = Path(cfg["checkpoint_dir"])
    archived = list((ckpt / "previous").glob("*/tensorboard"))
    assert len(archived) == 1
    assert [s for s, _ in scalars(read_events(archived[0]), "epoch/val_iou")] == [1, 2]
    assert [s for s, _ in scalars(read_events(ckpt / "tensorboard"), "epoch/val_iou")] == [1]


def test_logger_none_and_csv_write_no_events(make_cfg):
    for kind in ("none", "csv"):
        cfg = make_cfg(logger=kind, checkpoint_dir=make_cfg()["checkpoint_dir"] + kind)
        train(cfg)
        assert not (Path(cfg["checkpoint_dir"]) / "tensorboard").exists()
        assert (Path(cfg["checkpoint_dir"]) / "history.csv").is_file()


def test_an_epoch_whose_line_cannot_be_printed_is_in_tensorboard_as_in_history_csv(make_cfg, monkeypatch):
    """A library run whose stdout was closed (a notebook piped to head) stopped at the epoch's line, which came
    before the epoch's events: history.csv and last.pt held epoch 1, tensorboard/ nothing."""
    def closed_stdout(*args, **kwargs):
        raise BrokenPipeError(32, "Broken pipe")
    monkeypatch.setattr(train_unet, "epoch_summary", closed_stdout)
    cfg = make_cfg(epochs=2)
    with pytest.raises(BrokenPipeError):
        train(cfg)
    acc = read_events(Path(cfg["checkpoint_dir"]) / "tensorboard")
    assert [s for s, _ in scalars(acc, "epoch/val_iou")] == [1]
    assert train_unet.load_checkpoint(Path(cfg["checkpoint_dir"]) / "last.pt")["epoch"] == 1


def test_a_full_disk_under_the_event_file_is_one_line_naming_its_folder(make_cfg, monkeypatch, capsys):
    """The writer thread's ENOSPC at start-up (a full disk) printed "Exception in thread" and a traceback cut
    short by the exit around "error: cannot write a file (...)" (a user's report)."""
    from tensorboard.summary.writer import record_writer

    def write(self, data):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(record_writer.RecordWriter, "write", write)
    cfg = make_cfg(logger="tensorboard")
    args = [f"{key}={value}" for key, value in cfg.items() if key in ("data_dir", "checkpoint_dir", "image_size",
                                                                      "encoder_name", "batch_size", "epochs")]
    assert train_unet.main([*args, "encoder_weights=None", "progress=False", "device=cpu", "use_amp=False",
                            "cpu_probe=False", "num_workers=0", "logger=tensorboard"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (f"error: cannot write {Path(cfg['checkpoint_dir']) / 'tensorboard'} (No space left on "
                           f"device): free disk space there or choose another folder; files are written under "
                           f"temporary names, so those written before are intact"), err


def test_logger_tensorboard_without_the_package_is_a_clear_error(make_cfg, monkeypatch):
    monkeypatch.setattr(train_unet, "tensorboard_installed", lambda: False)
    with pytest.raises(UserError, match="logger=tensorboard but the tensorboard package is not installed"):
        RunLogger.create(make_cfg(logger="tensorboard"))
    assert RunLogger.create(make_cfg(logger="auto")).writer is None  # auto: history.csv only


class SyncCounter:
    """Counts tensor -> Python conversions (each one a device sync on a GPU)."""
    METHODS = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.METHODS:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self.wrap(real))

    def wrap(self, real):
        def counted(t, *args, **kwargs):
            self.count += 1
            return real(t, *args, **kwargs)
        return counted


def test_logging_adds_no_host_sync_per_step(tmp_path, cpu_hw, monkeypatch):
    """Per-step values stay on the device; the epoch's flush is one transfer."""
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 3, 16, 16, generator=g), (torch.rand(8, 16, 16, generator=g) > 0.5).long())
    cfg = dict(train_unet.CONFIG, progress=False, channels_last=False, accumulation_steps=1)
    prec = decide_precision(cpu_hw, use_amp=False)

    def epoch(logger):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.Conv2d(4, 1, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
        counter = SyncCounter(monkeypatch)
        run = Run(model, model, opt, sched, None, prec, logger=logger or RunLogger(), loss_fn=SegLoss(1, "ce"))
        train_one_epoch(run, DataLoader(data, batch_size=2), cfg, cpu_hw)
        monkeypatch.undo()
        return counter.count

    logger = RunLogger(tmp_path / "tb", cfg)
    without, with_logger = epoch(None), epoch(logger)
    assert with_logger == without
    assert len(logger.steps) == 4
    counter = SyncCounter(monkeypatch)
    logger.flush_steps()
    monkeypatch.undo()
    assert counter.count == 1 and logger.steps == []
    logger.close()
    assert [s for s, _ in scalars(read_events(tmp_path / "tb"), "step/loss")] == [1, 2, 3, 4]


def test_fallback_events_are_logged_as_text(data_dir, tmp_path, monkeypatch):
    """bf16 with inf gradients on the first two steps falls back to fp32: TensorBoard gets the event."""
    build, calls = train_unet.build_model, []

    def inf_grads_first(cfg):
        model = build(cfg)
        def hook(grad):
            calls.append(1)
            return grad * float("inf") if len(calls) <= 2 else grad
        model.segmentation_head[0].weight.register_hook(hook)
        return model
    monkeypatch.setattr(train_unet, "build_model", inf_grads_first)
    cfg = dict(data_dir=str(data_dir), checkpoint_dir=str(tmp_path / "ckpt"), image_size=32, max_train_images=4,
               batch_size=2, epochs=1, encoder_weights=None, device="cpu", progress=False, num_workers=0,
               nan_patience=2, use_amp=True, amp_dtype="bfloat16", force_amp_dtype=True)
    result = train(cfg)
    assert [f["to"] for f in result["fallbacks"]] == ["fp32"]
    acc = read_events(tmp_path / "ckpt" / "tensorboard")
    events = acc.Tensors("fallback/text_summary")
    assert [e.step for e in events] == [1]
    assert b"falling back to fp32" in events[0].tensor_proto.string_val[0]
    # the re-run epoch replaces the rolled-back steps: finite norms at steps 1 and 2
    norms = scalars(acc, "step/grad_norm")
    assert [s for s, _ in norms] == [1, 2] and all(math.isfinite(v) for _, v in norms)
    # ... and the steps that went bad are kept apart
    bad = scalars(acc, "rolled_back/grad_norm")
    assert [s for s, _ in bad] == [1, 2] and not any(math.isfinite(v) for _, v in bad)


def test_a_resume_names_the_epochs_tensorboard_lacks(make_cfg, capsys):
    """tensorboard, then a resume with logger=csv, then tensorboard again: the events held epochs 1 and 3,
    and nothing said so (my_run.ipynb counted the steps logged as the run's). last.pt records the epochs
    tensorboard/ holds; a resume notes the gap, or that this run's logger adds none."""
    cfg = make_cfg(epochs=1, logger="tensorboard")
    ckpt = Path(cfg["checkpoint_dir"])
    train(cfg)
    assert train_unet.load_checkpoint(ckpt / "last.pt")["tensorboard_epochs"] == [1]
    capsys.readouterr()
    train({**cfg, "epochs": 2, "logger": "csv", "resume": True})
    out = capsys.readouterr().out
    assert "off in this run: tensorboard/ keeps epoch(s) 1 and gets none from here" in out
    assert "for the 1 added epoch (no restart)" in out  # not '1 added epochs'
    assert train_unet.load_checkpoint(ckpt / "last.pt")["tensorboard_epochs"] == [1]
    train({**cfg, "epochs": 4, "resume": True})
    assert "tensorboard/ has no events for epoch(s) 2 (trained without TensorBoard: logger=csv or none, or " \
           "tensorboard not installed)" in capsys.readouterr().out
    assert train_unet.load_checkpoint(ckpt / "last.pt")["tensorboard_epochs"] == [1, 3, 4]
    assert [s for s, _ in scalars(read_events(ckpt / "tensorboard"), "epoch/val_iou")] == [1, 3, 4]
    train({**cfg, "epochs": 5, "resume": True})
    assert "tensorboard/ has no events for epoch(s) 2 " in capsys.readouterr().out  # said on every resume


@pytest.mark.parametrize("epochs, text", [([1, 2, 3, 5], "1-3, 5"), ([4], "4"), ([2, 3, 7, 8, 9], "2-3, 7-9")])
def test_epoch_ranges(epochs, text):
    assert train_unet.epoch_ranges(epochs) == text


def test_a_checkpoint_from_before_the_record_never_gets_a_gap_note(make_cfg, capsys):
    """Resumed from a last.pt without tensorboard_epochs, the next last.pt recorded the new epochs alone, and
    the resume after it named the earlier, logged, epochs as missing (review)."""
    cfg = make_cfg(epochs=1, logger="tensorboard")
    ckpt = Path(cfg["checkpoint_dir"])
    train(cfg)
    state = train_unet.load_checkpoint(ckpt / "last.pt")
    del state["tensorboard_epochs"]
    train_unet.save_checkpoint(ckpt / "last.pt", state)
    train({**cfg, "epochs": 2, "resume": True})
    assert train_unet.load_checkpoint(ckpt / "last.pt")["tensorboard_epochs"] is None  # still not known
    capsys.readouterr()
    train({**cfg, "epochs": 3, "resume": True})
    assert "has no events" not in capsys.readouterr().out
