"""batch_size=auto: the search with faked OOMs (no CUDA needed), the CPU fallback, config and resume."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import train_unet
from train_unet import UserError, parse_overrides, search_batch_size


def oom_above(limit, calls):
    """A batch_trial replacement: raises CUDA's OOM error for batches above `limit`."""
    def trial(model, optimizer, loss_fn, scaler, prec, hw, cfg, n):
        calls.append(n)
        if n > limit:
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} images")
    return trial


@pytest.mark.parametrize("limit", [2, 3, 37, 64, 100, 1000])
def test_search_finds_the_largest_batch_that_fits(limit):
    tried = []
    fits = lambda n: tried.append(n) or n <= limit
    assert search_batch_size(fits, cap=1024) == limit
    assert len(tried) <= 2 * 11  # doubling then bisection: logarithmic, a few seconds of real steps
    assert len(set(tried)) == len(tried)  # never the same batch twice


def test_search_edges():
    assert search_batch_size(lambda n: False) == 0           # not even the smallest batch fits
    assert search_batch_size(lambda n: True, cap=40) == 40   # memory is not the limit: the cap is
    assert search_batch_size(lambda n: n <= 5, start=1, cap=4) == 4


@pytest.fixture
def fake_cuda(cpu_hw):
    """A Hardware that says CUDA but keeps tensors on the CPU (the trial itself is faked)."""
    return dataclasses.replace(cpu_hw, kind="cuda", name="Fake GPU")


def test_find_batch_size_recovers_from_oom_and_keeps_headroom(make_cfg, fake_cuda, monkeypatch):
    calls = []
    monkeypatch.setattr(train_unet, "batch_trial", oom_above(37, calls))
    cfg = make_cfg(batch_size="auto")
    prec = train_unet.decide_precision(fake_cuda, use_amp=False)
    largest, use = train_unet.find_batch_size(cfg, fake_cuda, prec, cap=1024)
    assert largest == 37 and use == int(37 * (1 - train_unet.AUTO_BATCH_HEADROOM)) == 31
    assert max(calls) > 37  # it really went past the limit and recovered


def test_resolve_on_cuda_records_the_search(make_cfg, fake_cuda, monkeypatch):
    monkeypatch.setattr(train_unet, "batch_trial", oom_above(100, []))
    cfg = make_cfg(batch_size="auto")
    prec = train_unet.decide_precision(fake_cuda, use_amp=False)
    notes = []
    out, info = train_unet.resolve_batch_size(cfg, fake_cuda, prec, None, n_train=500, notes=notes)
    assert out["batch_size"] == 85 and info["batch_size"] == 85 and info["requested"] == "auto"
    assert notes[0][0] == "batch" and "largest that fit 100, using 85" in notes[0][1]
    # a small data set caps the batch instead (no headroom needed: memory was not the limit)
    out, _ = train_unet.resolve_batch_size(cfg, fake_cuda, prec, None, n_train=40, notes=[])
    assert out["batch_size"] == 40


def test_nothing_fits_is_a_clear_error(make_cfg, fake_cuda, monkeypatch):
    monkeypatch.setattr(train_unet, "batch_trial", oom_above(1, []))
    prec = train_unet.decide_precision(fake_cuda, use_amp=False)
    with pytest.raises(UserError, match="batch_size=auto: not even a batch of 2 fits.*lower image_size"):
        train_unet.resolve_batch_size(make_cfg(batch_size="auto"), fake_cuda, prec, None, 500, [])


def test_auto_on_cpu_uses_the_default_and_says_why(make_cfg, capsys):
    """At image_size=32 too: the data check runs with batch 1 for batch_size=auto, which a config check of
    that batch refused at 32 px (BatchNorm), and the run stopped on a batch_size=1 the user never gave."""
    cfg = make_cfg(batch_size="auto", image_size=32)
    result = train_unet.train(cfg)
    out = capsys.readouterr().out
    assert "batch        auto -> 8: needs a CUDA GPU (this run is on cpu): using batch_size=8" in out
    saved = json.loads((Path(cfg["checkpoint_dir"]) / "config.json").read_text())
    assert saved["config"]["batch_size"] == 8 and saved["batch_size_auto"]["requested"] == "auto"
    assert result["history"][0]["optimizer_steps"] == 1  # 10 train images // 8

    # resume with batch_size=auto continues with the run's batch size (exact resume)
    result = train_unet.train({**cfg, "resume": True, "epochs": 2})
    assert "kept the resumed run's batch size" in capsys.readouterr().out
    assert len(result["history"]) == 2


def test_auto_capped_at_one_training_image_says_auto_chose_it(fake_cuda):
    """One training image at image_size=32: 'batch_size=1 ... use batch_size >= 2', a batch size the user never
    typed (auto, capped at the training set) and one the single image cannot fill (user test); on CUDA the
    search's trial of one image raised BatchNorm's ValueError, a traceback (review)."""
    cfg = train_unet.validate_config({**train_unet.CONFIG, "batch_size": "auto", "image_size": 32})
    for hw in (train_unet.detect_hardware("cpu"), fake_cuda):
        with pytest.raises(UserError, match=r"^batch_size=auto: a batch of at most 1 \(training images: 1\), and at "
                                            r"image_size=32 a batch of 1 leaves BatchNorm one value per channel .*: "
                                            r"add training images, or use image_size >= 64$"):
            train_unet.resolve_batch_size(cfg, hw, train_unet.decide_precision(hw, use_amp=False), None, 1, [])
    hw = train_unet.detect_hardware("cpu")
    out, _ = train_unet.resolve_batch_size({**cfg, "image_size": 64}, hw, None, None, 1, [])
    assert out["batch_size"] == 1  # 2x2 values per channel at the bottleneck: trains


def test_auto_is_parsed_and_validated():
    assert parse_overrides(["batch_size=auto"])["batch_size"] == "auto"
    assert parse_overrides(["batch_size=AUTO"])["batch_size"] == "auto"
    with pytest.raises(UserError, match="batch_size='big' is not a whole number"):
        parse_overrides(["batch_size=big"])
    with pytest.raises(UserError, match="learning_rate"):
        parse_overrides(["learning_rate=auto"])
    with pytest.raises(UserError, match="batch_size='auto' must be a whole number"):
        train_unet.validate_predict({**train_unet.PREDICT_CONFIG, "batch_size": "auto"})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_search_on_cuda(make_cfg):
    hw = train_unet.detect_hardware("cuda")
    cfg = make_cfg(batch_size="auto", device="cuda", use_amp=True)
    prec = train_unet.decide_precision(hw)
    largest, use = train_unet.find_batch_size(cfg, hw, prec, cap=64)
    assert 2 <= use <= largest <= 64
