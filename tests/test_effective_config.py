"""Issue 20, items 1, 5, 6, 7: the effective config is settled before anything is decided from it
(batch_size=auto and the kept precision before the layout), batch-size trials with a clean GradScaler,
no float64 on MPS, and torchrun's start-up check shared by the ranks without the collective timeout.
GPUs, MPS and torchrun are faked on the CPU."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import train_unet
from train_unet import Hardware, Precision


class StopAfterBanner(Exception):
    """Raised by a stubbed announce_run: the test has what it needs, no training."""


def train_until_announced(cfg, monkeypatch):
    """train(cfg) up to announce_run: returns the config it would save and the precision it runs in."""
    seen = {}

    def announce(cfg, hw, run, sizes, extra):
        seen.update(cfg=cfg, prec=run.prec)
        raise StopAfterBanner
    monkeypatch.setattr(train_unet, "announce_run", announce)
    with pytest.raises(StopAfterBanner):
        train_unet.train(cfg)
    return seen


# ---------------------------------------------------------------------------------------------------
# 1. batch_size=auto with channels_last=auto on a CPU: the layout is decided from the resolved batch
# ---------------------------------------------------------------------------------------------------
def test_auto_batch_and_auto_layout_on_a_cpu(make_cfg, capsys):
    cfg = make_cfg(batch_size="auto", channels_last="auto")
    result = train_unet.train(cfg)
    out = capsys.readouterr().out
    batch = train_unet.AUTO_BATCH_FALLBACK
    assert f"batch        auto -> {batch}: needs a CUDA GPU" in out
    # 8 x 64 x 64 pixels per batch is where NHWC pays off on a CPU: the decision saw the resolved 8
    expected = batch * cfg["image_size"] ** 2 >= train_unet.CPU_CHANNELS_LAST_MIN_PIXELS
    assert f"at batch {batch} x {cfg['image_size']}px" in out
    saved = json.loads((Path(cfg["checkpoint_dir"]) / "config.json").read_text())["config"]
    assert saved["batch_size"] == batch and saved["channels_last"] is expected
    assert len(result["history"]) == 1


def test_effective_config_resolves_batch_then_layout(make_cfg, cpu_hw):
    cfg = make_cfg(batch_size="auto", channels_last="auto", image_size=32)
    prec = train_unet.decide_precision(cpu_hw, use_amp=False)
    notes = []
    out, (layout, why), auto = train_unet.effective_config(cfg, cpu_hw, prec, None, 100, notes)
    assert out["batch_size"] == train_unet.AUTO_BATCH_FALLBACK and auto["requested"] == "auto"
    assert out["channels_last"] is layout is False  # 8 x 32 x 32 is below the CPU's NHWC line
    assert "batch 8 x 32px is too small" in why


# ---------------------------------------------------------------------------------------------------
# 17. A resumed run's kept fp32 decides the layout (pre-Ampere GPU: no tensor cores for fp32)
# ---------------------------------------------------------------------------------------------------
def test_layout_follows_the_precision_kept_on_resume(make_cfg, monkeypatch, capsys):
    cfg = make_cfg(epochs=1)
    train_unet.train(cfg)
    last = Path(cfg["checkpoint_dir"]) / "last.pt"
    state = torch.load(last, weights_only=False)
    state["precision"] = "fp32"  # as if the run had fallen back from fp16
    state["fallbacks"] = [{"epoch": 1, "step": 3, "from": "fp16", "to": "fp32",
                           "event": "fp16 went non-finite at step 3: falling back to fp32"}]
    torch.save(state, last)
    capsys.readouterr()

    # A T4 (7.5): native fp16, no bf16, no TF32 tensor cores. Tensors stay on the CPU.
    t4 = Hardware("cpu", "cuda", "Fake T4", (7, 5), bf16=False, fp16=True, bf16_feature="compute capability 7.5")
    monkeypatch.setattr(train_unet, "detect_hardware", lambda device="auto": t4)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)  # restored after
    seen = train_until_announced({**cfg, "resume": True, "epochs": 2, "use_amp": True, "amp_dtype": "auto",
                                  "channels_last": "auto"}, monkeypatch)
    banner = capsys.readouterr().out
    assert seen["prec"].name == "fp32" and "kept from the checkpoint" in banner
    assert seen["cfg"]["channels_last"] is False
    assert "contiguous (NCHW) (auto: fp32 without tensor cores gains nothing from NHWC)" in banner
    assert "AMP convolutions" not in banner


# ---------------------------------------------------------------------------------------------------
# 5. batch_size=auto with fp16: an OOM after unscale_() does not break the next trial
# ---------------------------------------------------------------------------------------------------
def test_batch_trials_survive_an_oom_after_unscale(make_cfg, cpu_hw, monkeypatch):
    cfg = make_cfg(batch_size="auto", image_size=32, grad_clip_norm=None)
    fp16 = Precision(torch.float16, True, "fp16 + GradScaler (test)")
    assert train_unet.build_scaler(fp16, cpu_hw, cfg).is_enabled()  # a real GradScaler("cpu")
    tried, real_trial, real_norm = [], train_unet.batch_trial, torch.nn.utils.get_total_norm

    def trial(model, optimizer, loss_fn, scaler, prec, hw, cfg, n):
        tried.append(n)
        return real_trial(model, optimizer, loss_fn, scaler, prec, hw, cfg, n)

    def norm_then_oom(grads, *args, **kwargs):  # runs right after scaler.unscale_() in optimizer_step
        if tried[-1] > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (faked after unscale_)")
        return real_norm(grads, *args, **kwargs)
    monkeypatch.setattr(train_unet, "batch_trial", trial)
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", norm_then_oom)
    largest, use = train_unet.find_batch_size(cfg, cpu_hw, fp16, cap=16)
    assert tried == [2, 4, 3] and largest == 3  # 4 ran out of memory mid-step; 3 was still measured
