"""The benchmark command (one process per configuration) and the notebook that plots it."""
import csv
import cv2
import dataclasses
import json
import os
import random
import re
import shutil
import sys
from pathlib import Path

import nbclient
import numpy as np
import nbformat
import pytest
import torch

import train_unet

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    data = train_unet.generate_shapes_dataset(tmp / "data", count=12, size=32)
    out = tmp / "out"
    before = settings_and_draws()
    result = train_unet.run_benchmark(["configs=fp32,bf16,fp16", "epochs=2", "image_size=32", "batch_size=2",
                                       "max_train_images=8", "bare_steps=1", "encoder_name=resnet18", "inference=fp32,bf16_cl",
                                       "inference_images=4", "inference_size=96", "inference_rounds=1",
                                       "cpu_probe=False",  # rows run in subprocesses: no faked probe there
                                       f"data_dir={data}", f"output={out}"])
    AFTER_THE_BENCHMARK.update(before=before, after=settings_and_draws())
    return result, out


AFTER_THE_BENCHMARK = {}


def settings_and_draws():
    """torch's TF32 settings, then a draw of each RNG, the RNGs put back as they were."""
    state = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    draws = (torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32, random.random(),
             float(np.random.rand()), float(torch.rand(1)))
    random.setstate(state[0])
    np.random.set_state(state[1])
    torch.set_rng_state(state[2])
    return draws


def test_the_benchmark_leaves_torchs_tf32_settings_and_the_rngs_as_it_found_them(bench):
    """Its strict fp32 (cudnn.allow_tf32=False) stayed set after a notebook's benchmark: a later run in that
    kernel trained with TF32 convolutions off on an Ampere GPU; its seeds reset the notebook's random draws."""
    assert AFTER_THE_BENCHMARK["after"] == AFTER_THE_BENCHMARK["before"]


def test_benchmark_rows_files_and_table(bench, capsys):
    result, out = bench
    rows = {r["config"]: r for r in result["rows"]}
    native = train_unet.detect_hardware("cpu").bf16  # what THIS machine has decides the bf16 row
    assert rows["fp32"]["status"] == "ok" and rows["fp32"]["precision"] == "fp32"
    assert rows["fp32"]["speedup_vs_fp32"] == pytest.approx(1.0)
    machine = json.loads((out / "benchmark.json").read_text())["machine"]  # what a figure needs beside it
    assert machine["torch"] == torch.__version__ and machine["cores"] == os.cpu_count()
    assert machine["command"].startswith("python train_unet.py benchmark configs=fp32,bf16,fp16 epochs=2")
    assert machine["date"].endswith("UTC") and machine["cpu_bf16"]
    # a 1-thread figure read as the 2-core machine's: the threads and OMP_NUM_THREADS are recorded
    assert machine["torch_threads"] == torch.get_num_threads()
    assert machine["OMP_NUM_THREADS"] == os.environ.get("OMP_NUM_THREADS")
    if native:  # a full run, like fp32
        assert rows["bf16"]["status"] == "ok" and rows["bf16"]["precision"] == "bf16"
        assert rows["bf16"]["speedup_vs_fp32"] == pytest.approx(rows["bf16"]["images_per_s"]
                                                                / rows["fp32"]["images_per_s"])
    else:  # emulated: a short timed probe, its slowdown measured
        assert rows["bf16"]["status"].startswith("probe") and rows["bf16"]["precision"] == "bf16 (not native)"
        assert rows["bf16"]["slowdown_vs_fp32"] > 0
        assert rows["bf16"]["speedup_vs_fp32"] == pytest.approx(1 / rows["bf16"]["slowdown_vs_fp32"])
    # This CPU has no fast fp16 kernels: the fp16 configuration is skipped with the reason.
    assert rows["fp16"]["status"].startswith("skipped:") and "fp16" in rows["fp16"]["status"]
    for name in ("fp32", "bf16") if native else ("fp32",):
        assert rows[name]["epochs"] == 2 and len(result["histories"][name]) == 2
        first = result["histories"][name][0]  # numbers, not history.csv's strings
        assert first["epoch"] == 1 and isinstance(first["val_iou"], float) and isinstance(first["precision"], str)
        assert rows[name]["first_epoch_s"] == pytest.approx(float(result["histories"][name][0]["epoch_time_s"]))
        assert rows[name]["peak_mem_kind"] == "process_peak_rss" and rows[name]["peak_mem_mb"] > 0
        assert 0.0 <= rows[name]["final_val_iou"] <= 1.0
        assert (out / name / "best.pt").is_file() and (out / f"{name}.log").is_file()
    saved = json.loads((out / "benchmark.json").read_text())
    assert [r["config"] for r in saved["rows"]] == ["fp32", "bf16", "fp16"]
    with open(out / "benchmark.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert [r["config"] for r in csv_rows] == ["fp32", "bf16", "fp16"]
    assert set(train_unet.BENCHMARK_FIELDS) == set(csv_rows[0])
    assert set(result["bare_loop_s_per_step"]) == {"fp32", "bf16", "bf16_cl"}
    assert set(saved["bare_loop_step_spread"]) == {"fp32", "bf16", "bf16_cl"}
    table = train_unet.format_benchmark_table(result["rows"])
    for column in ("Config", "Batch", "Precision", "Time/Epoch", "Speedup vs FP32", "Peak memory", "Final IoU"):
        assert column in table.splitlines()[0]


def test_benchmark_times_predict_against_the_forward_passes_alone(bench):
    """The inference table: per mode, the whole predict command in fit mode (a folder of the data set's
    images) and patch mode (one generated image through the sliding window), timed against the forward
    passes alone over the same batches, with the masks compared to fp32's (issue 24)."""
    result, out = bench
    rows = {(r["mode"], r["data_mode"]): r for r in result["inference"]}
    assert set(rows) == {("fp32", "fit"), ("fp32", "patch"), ("bf16_cl", "fit"), ("bf16_cl", "patch")}
    native = train_unet.detect_hardware("cpu").bf16
    for (mode, data_mode), row in rows.items():
        if mode == "bf16_cl" and not native:
            assert row["status"].startswith("skipped") and row["mask_agreement_vs_fp32"] is None
            continue
        assert row["status"] == "ok" and row["precision"] == ("fp32" if mode == "fp32" else "bf16")
        assert row["images"] == (4 if data_mode == "fit" else 1)
        assert row["predict_s"] > 0 and row["forward_only_s"] > 0
        assert row["vs_forward_only"] == pytest.approx(row["predict_s"] / row["forward_only_s"])
        assert 0.95 <= row["mask_agreement_vs_fp32"] <= 1.0  # (bf16 may flip a few border pixels)
        masks = list((out / "inference" / f"{data_mode}_{mode}").glob("*.png"))
        assert len(masks) == row["images"]
    assert rows[("fp32", "fit")]["mask_agreement_vs_fp32"] == 1.0
    saved = json.loads((out / "inference" / "inference.json").read_text())
    assert [(r["mode"], r["data_mode"]) for r in saved] == [(r["mode"], r["data_mode"]) for r in result["inference"]]
    assert json.loads((out / "benchmark.json").read_text())["inference"] == saved


def test_overhead_rounds_alternate_and_time_each_call():
    """After an untimed round, the trainer, the bare loop over the same loader and the bare loop on a
    held batch run in turn, the order flipping every round (A B C, C B A, A B C): a machine that
    slows down over the measurement slows all alike, and trainer and bare loop always run adjacent."""
    calls, hw = [], train_unet.detect_hardware("cpu")
    runs = {name: (lambda name=name: calls.append(name)) for name in ("trainer", "bare", "held")}
    times = train_unet.alternate_timings(runs, 3, hw)
    order = ["trainer", "bare", "held"]
    assert calls == order + order + order[::-1] + order  # the untimed round first
    assert {k: len(v) for k, v in times.items()} == {"trainer": 3, "bare": 3, "held": 3}


def test_each_configuration_ran_in_its_own_process(bench):
    result, out = bench
    for name in [r["config"] for r in result["rows"] if r["status"] == "ok"]:
        log = (out / f"{name}.log").read_text()
        assert log.splitlines().count("unet-amp") == 1 and "done: best val IoU" in log  # the banner title


def test_benchmark_answers_for_bf16_on_a_cpu_without_native_bf16(tmp_path, monkeypatch, capsys):
    """`benchmark configs=...,bf16` prints a bf16 row with a measured number on every CPU: where bf16 is
    emulated, a short probe (a few bare steps) measures how much slower it is than fp32. The default row
    is the config as given (auto precision, auto layout); tf32 is skipped off CUDA, with the reason."""
    monkeypatch.setenv("UNET_HIDE_NATIVE_BF16", "1")  # inherited by the benchmark's subprocesses
    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=6, size=32)
    out = tmp_path / "out"
    rc = train_unet.main(["benchmark", "configs=default,fp32,tf32,bf16", "inference=", "epochs=1", "image_size=32",
                          "batch_size=2", "max_train_images=4", "bare_steps=1", "probe_steps=1",
                          "cpu_probe=False",  # the flag rule: its rows run in subprocesses, unfaked
                          f"data_dir={data}", f"output={out}"])
    text = capsys.readouterr().out
    assert rc == 0
    saved = {r["config"]: r for r in json.loads((out / "benchmark.json").read_text())["rows"]}
    assert saved["default"]["status"] == "ok" and saved["default"]["precision"] == "fp32"  # auto -> fp32
    assert saved["default"]["channels_last"] is False  # auto: 2 x 32 px is too small for NHWC
    assert saved["tf32"]["status"].startswith("skipped:") and "CUDA" in saved["tf32"]["status"]
    bf16 = saved["bf16"]
    assert bf16["status"].startswith("probe") and bf16["slowdown_vs_fp32"] > 0
    assert "hidden by UNET_HIDE_NATIVE_BF16" in bf16["status"]
    line = next(l for l in text.splitlines() if l.startswith("| bf16 "))
    assert train_unet.slower_than_fp32(bf16["slowdown_vs_fp32"]) in line and "than fp32" in line
    with open(out / "benchmark.csv") as f:
        csv_bf16 = next(r for r in csv.DictReader(f) if r["config"] == "bf16")
    assert float(csv_bf16["slowdown_vs_fp32"]) == pytest.approx(bf16["slowdown_vs_fp32"])
    assert not (out / "bf16").exists()  # no full training run for emulated bf16
    bare = json.loads((out / "benchmark.json").read_text())["bare_loop_s_per_step"]
    assert set(bare) == {"fp32", "bf16", "bf16_cl"} and all(v > 0 for v in bare.values())
    assert "bf16 (not native)" in text and "strict fp32" in text


@pytest.mark.parametrize("eval_amp, said", [(False, "evaluated in fp32."),
                                             (True, "evaluated at its own precision (eval_amp=True).")])
def test_the_table_says_at_what_precision_the_final_iou_was_validated(eval_amp, said, capsys):
    """With eval_amp=True a bf16 row is validated in bf16: the table said 'evaluated in fp32' all the same."""
    train_unet.print_benchmark_summary([], {}, train_unet.detect_hardware("cpu"), eval_amp=eval_amp)
    assert f"Final IoU: last epoch, {said}\n" in capsys.readouterr().out


def test_the_bare_loop_line_says_when_its_steps_were_noisy(monkeypatch, capsys):
    """One run's bare loop on a Xeon read bf16_cl 1.40x fp32 beside its trained rows at 2.37x, with no word
    of doubt (a rerun read 2.27x): where a mode's steps spread, the line now says so, as the rows' Note does."""
    steps = {torch.float32: [0.50, 0.52, 0.51], torch.bfloat16: [0.20, 0.21, 0.20]}
    monkeypatch.setattr(train_unet, "train_step_times", lambda base, hw, dtype, nhwc, n: list(steps[dtype]))
    hw = train_unet.detect_hardware("cpu")
    bare, spreads = train_unet.bare_loop_speedups(dict(train_unet.CONFIG), hw, 3)
    assert bare == {"fp32": 0.51, "bf16": 0.20, "bf16_cl": 0.20} and spreads["fp32"] == pytest.approx(1.04)
    train_unet.print_benchmark_summary([], bare, hw, spreads)
    assert "noisy" not in capsys.readouterr().out
    steps[torch.bfloat16] = [0.20, 0.37, 0.36]
    bare, spreads = train_unet.bare_loop_speedups(dict(train_unet.CONFIG), hw, 3)
    train_unet.print_benchmark_summary([], bare, hw, spreads)
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("bare loop"))
    assert line.endswith("; noisy: bf16's steps 1.85x apart, so these ratios are not the machine's: run again "
                         "on a quiet machine, or compare the rows above")
    assert train_unet.bare_loop_speedups(dict(train_unet.CONFIG), hw, 0) == ({}, {})
    # one timed step: a spread of 1.00 read as steady; it has none to judge by (probe_steps=1, bare_steps=1)
    steps.update({torch.float32: [0.50], torch.bfloat16: [0.20]})
    bare, spreads = train_unet.bare_loop_speedups(dict(train_unet.CONFIG), hw, 1)
    train_unet.print_benchmark_summary([], bare, hw, spreads)
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith("bare loop"))
    assert line.endswith("; fp32, bf16, bf16_cl: 1 timed step, no spread to judge its noise by (bare_steps=6, or "
                         "probe_steps= for bf16 not native)")
    probe = {"config": "bf16", "batch": 8, "precision": "bf16 (not native)", "speedup_vs_fp32": 0.5,
             "slowdown_vs_fp32": 2.0, "step_spread": None, "status": "probe: 1 bare steps, none"}
    assert "; 1 timed step: no spread to judge its noise by; more probe_steps |" in \
        train_unet.format_benchmark_table([probe])


def test_slowdown_wording():
    assert train_unet.slower_than_fp32(33.0) == "33.0x slower than fp32"
    assert train_unet.slower_than_fp32(0.5) == "2.00x faster than fp32"
    # beside the Speedup column's two decimals: '1.0x slower than fp32' stood beside 0.99x
    assert train_unet.slower_than_fp32(1 / 0.99) == "1.01x slower than fp32"


def test_strict_fp32_and_tf32_rows_set_tf32_explicitly():
    base = train_unet.validate_config(dict(train_unet.CONFIG))
    assert "tf32_matmul_precision=highest" in train_unet.benchmark_overrides("fp32", base)
    assert "tf32_matmul_precision=high" in train_unet.benchmark_overrides("tf32", base)
    assert train_unet.benchmark_overrides("default", base) == []
    assert "channels_last=False" in train_unet.benchmark_overrides("bf16", base)


@pytest.mark.parametrize("given", [["use_amp=False"], ["use_amp=False", "amp_dtype=float16"]])
def test_bf16_rows_train_in_bf16_whatever_precision_the_benchmark_is_given(given):
    """The bf16 rows set amp_dtype only: with use_amp=False they trained in fp32, with the fp32 row's IoU, and
    the table said bf16 (user report). (A preset, which set it too, is refused: check_benchmark_fixed.)"""
    base = train_unet.validate_config(dict(train_unet.CONFIG))
    for name, amp in (("bf16", True), ("bf16_cl", True), ("bf16_2x", True), ("fp16", True), ("fp32", False)):
        args = train_unet.merge_args(given, train_unet.benchmark_overrides(name, base), ["progress=False"])
        cfg, _ = train_unet.apply_preset(train_unet.parse_overrides(args), train_unet.explicit_keys(args))
        assert cfg["use_amp"] is amp, (name, given)


def test_a_patch_mode_benchmarks_fit_rows_predict_in_fit_mode(tmp_path):
    """The fit rows predicted with the patch-mode checkpoint, so they ran its sliding window, labelled fit,
    against fit-mode forwards (user report: 5.1x 'vs forward alone')."""
    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=3, size=48)
    base = train_unet.validate_config({**train_unet.CONFIG, "data_dir": str(data), "image_size": 32,
                                       "encoder_name": "resnet18", "encoder_weights": None, "data_mode": "patch",
                                       "device": "cpu", "batch_size": 2})
    opts = {"inference_images": 3, "inference_size": 40, "inference_format": "png", "inference_rounds": 1}
    folder = tmp_path / "bench" / "inference"
    inputs = train_unet.inference_inputs(base, opts, folder)
    assert train_unet.load_checkpoint(inputs[2])["config"]["data_mode"] == "patch"
    hw = train_unet.detect_hardware("cpu")
    row = train_unet.inference_row("fp32", "fit", base, hw, opts, folder, inputs)
    assert row["status"] == "ok" and row["images"] == 3
    assert train_unet.load_checkpoint(folder / "fit.pt")["config"]["data_mode"] == "fit"
    fit = train_unet.predict({"checkpoint": str(folder / "fit.pt"), "input": str(inputs[0]),
                              "output": str(tmp_path / "m"), "device": "cpu", "use_amp": False,
                              "channels_last": False, "cpu_probe": False, "progress": False})
    assert fit["predicted"] == 3
    for mask in (tmp_path / "m").iterdir():
        assert np.array_equal(cv2.imread(str(mask), cv2.IMREAD_UNCHANGED),
                              cv2.imread(str(folder / "fit_fp32" / mask.name), cv2.IMREAD_UNCHANGED))


def test_summary_excludes_the_first_epoch_from_the_median():
    hist = [{"epoch_time_s": t, "images_per_s": 100 / t, "peak_mem_mb": m, "peak_mem_kind": "x",
             "precision": "fp16", "val_iou": 0.5, "val_dice": 0.6, "skipped_steps": k}
            for t, m, k in ((50.0, 10, 3), (2.0, 30, 1), (4.0, 20, 0), (3.0, 20, 0))]
    info = {"device": "d", "config": {"batch_size": 4, "channels_last": False, "compile_model": True}}
    row = train_unet.summarize_history("x", hist, info)
    assert row["time_per_epoch_s"] == 3.0 and row["first_epoch_s"] == 50.0
    assert row["peak_mem_mb"] == 30 and row["scaler_skipped_steps"] == 4 and row["nonfinite_steps"] == 0


def history(times, images=64):
    return [{"epoch_time_s": t, "images_per_s": images / t, "peak_mem_mb": 10, "peak_mem_kind": "x",
             "precision": "fp32", "val_iou": 0.5, "val_dice": 0.6, "skipped_steps": 0} for t in times]


INFO = {"device": "d", "config": {"batch_size": 8, "channels_last": False, "compile_model": False}}


def test_speedup_and_time_per_epoch_tell_the_same_story():
    """A user's busy machine, epochs=3 (two timed epochs): taken apart, the median time said bf16 was 1.44x
    slower and the median images/s that it was 1.04x faster. Both now come from one epoch."""
    rows = [train_unet.summarize_history("fp32", history([20.0, 15.2, 11.0]), INFO),
            train_unet.summarize_history("bf16", history([25.0, 30.0, 7.8]), INFO)]
    train_unet.add_speedups(rows)
    fp32, bf16 = rows
    assert bf16["speedup_vs_fp32"] == pytest.approx(fp32["time_per_epoch_s"] / bf16["time_per_epoch_s"])
    assert (fp32["time_per_epoch_s"], bf16["time_per_epoch_s"]) == (11.0, 7.8)  # the faster middle one
    odd = train_unet.summarize_history("x", history([9.0, 5.0, 3.0, 4.0]), INFO)
    assert odd["time_per_epoch_s"] == 4.0 and odd["images_per_s"] == 16.0 and odd["timed_epochs"] == 3


def test_a_row_says_when_its_time_cannot_be_trusted():
    table = lambda row: train_unet.format_benchmark_table([row | {"speedup_vs_fp32": 1.0}])  # noqa: E731
    busy = train_unet.summarize_history("fp32", history([20.0, 15.2, 11.0]), INFO)
    assert busy["epoch_spread"] == pytest.approx(15.2 / 11.0) and "noisy: epoch times 1.38x apart" in table(busy)
    quiet = train_unet.summarize_history("fp32", history([20.0, 11.2, 11.0]), INFO)
    assert "noisy" not in table(quiet) and "1 epoch" not in table(quiet)
    one = train_unet.summarize_history("fp32", history([20.0]), INFO)
    assert one["time_per_epoch_s"] == 20.0 and "1 epoch: its time includes start-up" in table(one)
    two = train_unet.summarize_history("fp32", history([20.0, 5.8]), INFO)  # epochs=2: one timed epoch
    assert "1 timed epoch: no spread to judge its noise by; use epochs=4" in table(two)
    assert "slower than the first" not in table(two)
    busy_two = train_unet.summarize_history("fp32", history([6.88, 10.17]), INFO)  # a helper's: said only "1 timed"
    assert "1 timed epoch" in table(busy_two) and "noisy: timed epochs 1.5x slower than the first" in table(busy_two)


def test_sub_second_epochs_read_with_three_digits_and_a_one_epoch_footer_says_so(capsys):
    """Epochs of 0.25 s and 0.27 s read 0.2s and 0.3s beside a Speedup of 1.10x (or 0.4s three times beside
    1.00x, 1.04x and 0.86x); with epochs=1 the footer still said 'median training pass over epochs 2..N'."""
    fp32 = train_unet.summarize_history("fp32", history([0.5, 0.27, 0.27]), INFO)
    bf16 = train_unet.summarize_history("bf16", history([0.5, 0.25, 0.25]), INFO)
    table = train_unet.format_benchmark_table(train_unet.add_speedups([fp32, bf16]))
    assert "| 0.27s " in table and "| 0.25s " in table
    assert train_unet.seconds_text(123.4) == "123s" and train_unet.seconds_text(12.34) == "12.3s"
    hw = train_unet.detect_hardware("cpu")
    train_unet.print_benchmark_summary(train_unet.add_speedups([fp32, bf16]), None, hw)
    assert "Time/Epoch: median training pass over epochs 2..N" in capsys.readouterr().out
    one = train_unet.summarize_history("fp32", history([0.5]), INFO)
    train_unet.print_benchmark_summary(train_unet.add_speedups([one]), None, hw)
    assert "Time/Epoch: its one epoch, start-up included (epochs=1); Speedup" in capsys.readouterr().out


def test_a_row_timed_slower_than_its_first_epoch_and_the_rows_measured_against_it_say_so():
    """A review's fp32 row: epochs of 0.85 s, then 29.0 s and 29.1 s (the machine got busy), no note, and
    every other row 34-50x faster than it, no note either."""
    fp32 = train_unet.summarize_history("fp32", history([0.85, 29.04, 29.09]), INFO)
    bf16 = train_unet.summarize_history("bf16", history([1.0, 0.86, 0.87]), INFO)
    table = train_unet.format_benchmark_table(train_unet.add_speedups([fp32, bf16]))
    fp32_line, bf16_line = (line for line in table.splitlines() if line.startswith(("| fp32 ", "| bf16 ")))
    assert "noisy: timed epochs 34.2x slower than the first" in fp32_line
    assert "speed-up against the fp32 row's time, which has a note" in bf16_line
    quiet = train_unet.summarize_history("fp32", history([1.0, 0.86, 0.87]), INFO)
    assert "note" not in train_unet.format_benchmark_table(train_unet.add_speedups([quiet, bf16]))


def test_a_row_of_another_batch_says_its_iou_does_not_compare():
    """bf16_2x trains the same epochs in half the optimizer steps: its lower IoU (0.28 against fp32's 0.35) read
    as bf16's, unsaid (user test)."""
    fp32 = {**train_unet.summarize_history("fp32", history([1.0, 0.9, 0.9]), INFO), "batch": 8}
    double = {**train_unet.summarize_history("bf16_2x", history([1.0, 0.5, 0.5]), INFO), "batch": 16}
    table = train_unet.format_benchmark_table(train_unet.add_speedups([fp32, double]))
    fp32_line, double_line = (line for line in table.splitlines() if line.startswith(("| fp32 ", "| bf16_2x ")))
    assert "batch 16: 0.5x fp32's optimizer steps per epoch, so its Final IoU does not compare with fp32's" in \
        double_line and "optimizer steps" not in fp32_line


def test_a_probe_row_says_when_its_steps_were_far_apart():
    row = {"config": "bf16", "precision": "bf16 (not native)", "batch": 4, "speedup_vs_fp32": 0.1,
           "slowdown_vs_fp32": 10.0, "status": "probe: 2 bare steps, no AVX512-BF16"}
    assert "noisy: steps 3.00x apart" in train_unet.format_benchmark_table([{**row, "step_spread": 3.0}])
    assert "noisy" not in train_unet.format_benchmark_table([{**row, "step_spread": 1.1}])


def test_unknown_configuration_is_a_clear_error():
    with pytest.raises(train_unet.UserError, match="unknown fp8.*fp32"):
        train_unet.parse_benchmark_args(["configs=fp32,fp8"])
    opts, _, _, names = train_unet.parse_benchmark_args(["configs=FP32,BF16_cl", "inference=FP32"])  # any case
    assert names == ["fp32", "bf16_cl"] and train_unet.inference_modes(opts) == ["fp32"]
    for key, command in (("overlay", "predict"), ("checkpoint", "predict")):  # 'did you mean tile_overlap?'
        with pytest.raises(train_unet.UserError, match=f"{key} is a key of {command}.*not of the benchmark: python "
                                                       f"train_unet.py {command} {key}="):
            train_unet.parse_benchmark_args([f"{key}=x"])


def test_notebook_runs_top_to_bottom_on_the_benchmark(bench):
    _, out = bench
    nb = nbformat.read(ROOT / "notebooks" / "fp32_vs_bf16.ipynb", as_version=4)
    os.environ["UNET_AMP_BENCH_DIR"] = str(out)
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    finally:
        del os.environ["UNET_AMP_BENCH_DIR"]
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 4  # bars, curves, inference, predictions
    text = "".join(o.get("text", "") for o in outputs)
    assert "fp32" in text and "bf16" in text and "best.pt" in text
    assert "Inference: the whole predict command" in text and "| Masks = fp32's" in text  # the inference table
    assert re.search(r"\| fp32 +\| fit +\| 4 ", text) and re.search(r"\| fp32 +\| patch +\| 1 ", text)


def test_loader_workers_tool_makes_frames_the_data_check_accepts(tmp_path):
    """tools/loader_workers.py's synthetic 1100x700 frames are valid training pairs with cells and background."""
    import importlib.util

    import cv2

    spec = importlib.util.spec_from_file_location("loader_workers", ROOT / "tools" / "loader_workers.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    tool.make_frames(tmp_path, count=3)
    cfg = train_unet.parse_overrides([f"data_dir={tmp_path}", "val_fraction=0.34", "batch_size=2"])
    train_pairs, val_pairs = train_unet.prepare_data(cfg)
    assert len(train_pairs) == 2 and len(val_pairs) == 1
    image, mask = (cv2.imread(str(p), cv2.IMREAD_UNCHANGED) for p in train_pairs[0])
    assert image.shape == (700, 1100, 3) and mask.shape == (700, 1100)
    assert set(map(int, mask.ravel())) == {0, 255}
    threads = cv2.getNumThreads(), torch.get_num_threads()
    ms = tool.sample_cpu_ms({**cfg, "image_size": 64, "checkpoint_dir": str(tmp_path / "ck")},
                            (train_pairs, val_pairs), rounds=2)
    assert set(ms) == {"first epoch (decode, write)", "cache_images=True", "cache_images=False"}
    assert all(value > 0 for value in ms.values())
    assert (cv2.getNumThreads(), torch.get_num_threads()) == threads  # the tool restores both


def test_the_inference_image_is_the_same_pixels_as_png_or_tif(tmp_path):
    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=4, size=32)
    base = train_unet.validate_config({**train_unet.CONFIG, "data_dir": str(data), "image_size": 32})
    images = {}
    for fmt in ("png", "tif"):
        opts = {"inference_images": 2, "inference_size": 50, "inference_format": fmt}
        _, patch_dir, _ = train_unet.inference_inputs(base, opts, tmp_path / fmt)
        [path] = list(patch_dir.iterdir())
        assert path.name == f"large.{fmt}"
        images[fmt] = train_unet.read_image(path, 3)
    assert images["png"].shape == (50, 50, 3) and np.array_equal(images["png"], images["tif"])


def test_a_benchmarks_earlier_results_moved_aside_say_how_much_previous_holds(tmp_path, capsys, monkeypatch):
    """Each benchmark moved the one before to previous/ (about 1.5 GB a default run): ten filled a disk, with
    no word of the archive's size, which training says past ARCHIVE_NOTE_BYTES."""
    out = tmp_path / "bench"
    (out / "previous" / "20200101-000000").mkdir(parents=True)
    (out / "previous" / "20200101-000000" / "big.pt").write_bytes(b"x" * 5000)
    (out / "benchmark.json").write_text("{}")
    monkeypatch.setattr(train_unet, "ARCHIVE_NOTE_BYTES", 4096)
    with train_unet.run_folders_held():
        train_unet.claim_output_folder(out, ["fp32"])
    assert f"({out / 'previous'} now holds 2 earlier runs, " in capsys.readouterr().out


def test_the_untrained_inference_model_of_a_benchmark_without_fp32_loads(tmp_path):
    """configs without fp32 (configs=bf16): the inference table's untrained model was saved with the
    benchmark's parsed config, a TypedConfig, which loading refused ('holds a pickled __main__.TypedConfig'):
    the benchmark stopped after its training table (user test)."""
    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=4, size=32)
    base = train_unet.parse_overrides([f"data_dir={data}", "image_size=32", "encoder_weights=None"])
    assert type(base) is not dict
    opts = {"inference_images": 2, "inference_size": 40, "inference_format": "png"}
    _, _, checkpoint = train_unet.inference_inputs(base, opts, tmp_path / "bench" / "inference")
    assert checkpoint.name == "fresh.pt" and type(train_unet.load_checkpoint(checkpoint)["config"]) is dict
    model, cfg = train_unet.load_model(checkpoint, "cpu")
    assert cfg["image_size"] == 32


def test_inference_predicts_all_the_data_sets_images_not_only_the_training_subset(tmp_path, capsys):
    """max_train_images limits training, not the inference folder; asking for more images than the data
    set has says so."""
    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=6, size=32)
    base = train_unet.validate_config({**train_unet.CONFIG, "data_dir": str(data), "image_size": 32,
                                       "max_train_images": 2})
    opts = {"inference_images": 50, "inference_size": 40, "inference_format": "png"}
    fit_dir, _, _ = train_unet.inference_inputs(base, opts, tmp_path / "inference")
    assert len(list(fit_dir.iterdir())) == 6
    assert f"note: inference_images=50: {data} has 6 images; fit mode predicts them all" in capsys.readouterr().out


def inference_rows(*modes, skipped=()):
    return [{"mode": m, "data_mode": d, "status": "skipped: bf16 not native here" if m in skipped else "ok"}
            for m in modes for d in ("fit", "patch")]


def test_masks_are_compared_with_fp32s_whatever_the_order_of_the_modes():
    """The fp32 row is the reference even when listed after bf16; fp32_cl where there is no fp32; no
    reference (not a bf16 row standing in) where no fp32 row ran, nor a skipped row's empty folder."""
    ones, zeros = {"a.png": np.ones((2, 2), np.uint8)}, {"a.png": np.array([[1, 1], [1, 0]], np.uint8)}
    masks = {("bf16", d): zeros for d in ("fit", "patch")} | {(m, d): ones for m in ("fp32", "fp32_cl")
                                                                  for d in ("fit", "patch")}
    rows = inference_rows("bf16", "fp32")
    train_unet.add_mask_agreement(rows, masks)
    assert [(r["mask_reference"], r["mask_agreement_vs_fp32"]) for r in rows] == [("fp32", 0.75)] * 2 + [("fp32", 1.0)] * 2
    rows = inference_rows("bf16", "fp32_cl")
    train_unet.add_mask_agreement(rows, masks)
    assert [r["mask_agreement_vs_fp32"] for r in rows] == [0.75, 0.75, 1.0, 1.0]
    row = {**rows[0], "vs_forward_only": 1.0, "rounds": 3, "round_spread": 1.0}  # the column's fp32 is fp32_cl's:
    assert train_unet.inference_note(row) == "masks compared with fp32_cl's (no fp32 row)"  # said (user report)
    rows = inference_rows("bf16")
    train_unet.add_mask_agreement(rows, masks)
    assert [r["mask_agreement_vs_fp32"] for r in rows] == [None, None]
    skipped = {("fp32", d): {} for d in ("fit", "patch")} | {("fp32_cl", d): ones for d in ("fit", "patch")}
    rows = inference_rows("fp32", "fp32_cl", skipped=("fp32",))  # (fp32 is never skipped; the rule holds)
    train_unet.add_mask_agreement(rows, skipped)
    assert [r["mask_agreement_vs_fp32"] for r in rows] == [None, None, 1.0, 1.0]


def test_an_inference_row_says_when_its_figures_cannot_be_trusted():
    row = {"vs_forward_only": 1.02, "rounds": 3, "round_spread": 1.1, "mask_reference": "fp32", "peak_mem_mb": 900}
    assert train_unet.inference_note(row) == ""
    assert train_unet.inference_note({**row, "rounds": 1}).startswith("1 round: no spread")
    assert train_unet.inference_note({**row, "round_spread": 1.4}).startswith("noisy: rounds 1.40x apart")
    assert "faster than its forwards alone" in train_unet.inference_note({**row, "vs_forward_only": 0.46})
    assert train_unet.inference_note({**row, "mask_reference": None}) == "no fp32 row to compare masks with"
    failed = {**row, "peak_mem_mb": None, "peak_mem_kind": "not measured: its predict process exited 1: x"}
    assert train_unet.inference_note(failed) == "peak memory not measured: its predict process exited 1: x"
    table = train_unet.format_inference_table([{**failed, "mode": "fp32", "data_mode": "fit", "status": "ok",
                                                "images": 2, "predict_s": 1.0, "images_per_s": 2.0,
                                                "megapixels_per_s": 0.1, "mask_agreement_vs_fp32": None}])
    assert "| - " in table and "peak memory not measured" in table


def test_an_inference_rows_peak_memory_is_its_own_predicts_not_this_process(tmp_path):
    """Measured in a fresh process: memory this process holds (earlier rows, the forward alone's inputs)
    does not count."""
    cfg = train_unet.validate_config({**train_unet.CONFIG, "image_size": 32, "encoder_name": "resnet18"})
    checkpoint = tmp_path / "m.pt"
    train_unet.save_checkpoint(checkpoint, {"model": train_unet.build_model({**cfg, "encoder_weights": None})
                                            .state_dict(), "config": cfg})
    images = tmp_path / "images"
    images.mkdir()
    cv2.imwrite(str(images / "a.png"), np.full((40, 40, 3), 128, np.uint8))
    held = np.ones(3 * 2**30, np.uint8)  # 3 GB touched here: more than a small predict peaks at (1.2 GB)
    args = {"checkpoint": str(checkpoint), "input": str(images), "output": str(tmp_path / "out"),
            "device": "cpu", "cpu_probe": False, "progress": False}
    peak, kind = train_unet.predict_peak_memory(args)
    here, _ = train_unet.peak_memory_mb(train_unet.detect_hardware("cpu"))
    assert kind == "process_peak_rss" and 0 < peak < here - 2000 and held[-1] == 1
    assert (tmp_path / "out" / "a.png").is_file()
    train_unet.predict_peak_memory(args)  # into an emptied folder: no copy of the masks in previous/
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.png"]
    missing = train_unet.predict_peak_memory({**args, "checkpoint": str(tmp_path / "none.pt")})
    assert missing[0] is None and missing[1].startswith("not measured: its predict process exited")


@pytest.mark.parametrize("arg, message", [
    ("inference=fp32,fp64", "inference='fp32,fp64': unknown fp64; use a comma-separated list of fp32, fp32_cl"),
    ("inference_size=0", "inference_size=0 must be >= 1"),
    ("inference_images=0", "inference_images=0 must be >= 1"),
    ("inference_rounds=0", "inference_rounds=0 must be >= 1"),
    ("inference_size=10", "inference_size=10 is below image_size=128: the sliding window's image must hold at least "
                          "one window; give inference_size=128 or more (the default is 1024)"),  # it timed 10x10
])
def test_inference_keys_are_refused_before_any_training(arg, message):
    """They were read only after every configuration had trained: a KeyError, an OpenCV assertion or a
    table of NaNs at the end."""
    with pytest.raises(train_unet.UserError, match=re.escape(message)):
        train_unet.parse_benchmark_args([arg])
    if not arg.startswith("inference="):
        train_unet.parse_benchmark_args([arg, "inference="])  # no table: nothing to check


def test_an_empty_output_is_refused():
    """output= (an unset $OUT) wrote the results, the runs and their logs into the current folder (user report)."""
    with pytest.raises(train_unet.UserError, match=re.escape("output= is empty: give a path (an unset shell "
                                                             "variable?)")):
        train_unet.parse_benchmark_args(["output=", "inference="])


def test_an_unknown_inference_format_is_refused():
    with pytest.raises(train_unet.UserError, match="inference_format='jpg' is not allowed: use png or tif"):
        train_unet.parse_benchmark_args(["inference_format=jpg"])


def test_a_failed_rows_note_holds_the_whole_error_and_its_log(tmp_path):
    """The run's last line, its fix at the end, was cut at 160 characters."""
    missing = tmp_path / ("a_long_folder_name_" * 8)
    base = train_unet.validate_config(dict(train_unet.CONFIG))
    row, history = train_unet.run_benchmark_config("fp32", base, [f"data_dir={missing}", "cpu_probe=False"], tmp_path)
    assert history == []
    assert row["status"] == (f"failed (exit 2): error: data_dir {missing} not found: create {missing}/images and "
                             f"{missing}/masks, or use data_dir=data/shapes for the embedded data set "
                             f"(log: {tmp_path / 'fp32.log'})")


def start_training_benchmark(tmp_path):
    """A benchmark process (its own session, as a terminal's job) whose fp32 row is training: its first epoch
    is written. Returns (the benchmark's Popen, its output folder)."""
    import subprocess
    import sys
    import time

    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=12, size=32)
    out = tmp_path / "out"
    bench = subprocess.Popen([sys.executable, str(ROOT / "train_unet.py"), "benchmark", "configs=fp32", "inference=",
                              "bare_steps=0", "epochs=500", "image_size=32", "batch_size=2", "encoder_name=resnet18",
                              "cpu_probe=False", f"data_dir={data}", f"output={out}"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.monotonic() + 180
    while not (out / "fp32" / "history.csv").is_file() and time.monotonic() < deadline and bench.poll() is None:
        time.sleep(0.2)
    return bench, out


def rows_running(out, wait_s=0):
    """The processes still training the benchmark's fp32 row (by their command line), after waiting up to
    wait_s for them to end; None where /proc cannot tell."""
    import time

    proc, deadline = Path("/proc"), time.monotonic() + wait_s
    if not proc.is_dir():
        return None
    while True:
        running = [p for p in proc.iterdir() if p.name.isdigit() and f"checkpoint_dir={out / 'fp32'}".encode()
                   in _cmdline(p)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def _cmdline(proc_dir):
    try:
        return (proc_dir / "cmdline").read_bytes()
    except OSError:  # ended meanwhile
        return b""


@pytest.mark.skipif(os.name != "posix", reason="a row's own session and its signals are POSIX's")
@pytest.mark.parametrize("whole_group", [False, True], ids=["jupyter-interrupt", "terminal-ctrl-c"])
def test_a_stopped_benchmark_stops_its_training_row_as_ctrl_c_stops_training(tmp_path, whole_group):
    """Jupyter's interrupt reaches the benchmark's process alone: its row's training went on untold and was
    killed 0.25 s later (subprocess.run), mid-write, and the benchmark said "files written so far are
    complete". Now the row is told once, stops as a Ctrl-C stops training (its log says so), leaves no
    temporary file and no process behind, and the benchmark says its table is missing."""
    import signal

    bench, out = start_training_benchmark(tmp_path)
    (os.killpg if whole_group else os.kill)(bench.pid, signal.SIGINT)
    _, err = bench.communicate(timeout=120)
    assert bench.returncode == 130 and "Traceback" not in err, err[-2000:]
    assert err.strip().endswith('interrupted: the benchmark did not finish (its benchmark.json, where written, says '
                                '"complete": false); the runs and files written so far are intact: run it again '
                                "for the whole table; no row had ended"), err[-2000:]
    log = (out / "fp32.log").read_text().strip()
    # its own words, not training's 'resume=True epochs=500 continues', which the benchmark refuses
    assert log.endswith("interrupted: the benchmark stopped this row: run the benchmark again (each row trains "
                        "afresh; resume=True is not for it)"), log[-2000:]
    assert not [p for p in out.rglob("*") if p.name.endswith(".tmp")]
    assert (out / "fp32" / "last.pt").is_file()
    record = json.loads((out / "benchmark.json").read_text())  # what the notebook refuses, naming the command
    assert record["complete"] is False and record["rows"] == [] and "epochs=500" in record["machine"]["command"]
    assert not rows_running(out)  # no training process left behind


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the kernel's parent-death signal is Linux's")
def test_a_benchmark_killed_outright_stops_its_training_row_too(tmp_path):
    """Killed (the out-of-memory killer; a dropped ssh session hangs up the benchmark, not its row's own
    process group), the benchmark left its row training, untold, through its 500 epochs. The kernel now
    sends the row SIGTERM, which stops it as it stops training."""
    import signal

    bench, out = start_training_benchmark(tmp_path)
    os.kill(bench.pid, signal.SIGKILL)
    bench.communicate(timeout=60)
    assert rows_running(out, wait_s=90) == []
    log = (out / "fp32.log").read_text().strip()
    assert log.endswith("stopped by SIGTERM: the benchmark stopped this row: run the benchmark again (each row "
                        "trains afresh; resume=True is not for it)"), log[-2000:]
    assert (out / "fp32" / "last.pt").is_file() and not [p for p in out.rglob("*") if p.name.endswith(".tmp")]


def test_an_inference_image_too_large_for_memory_is_refused_before_any_training(tmp_path, monkeypatch):
    """inference_size=200000 trained every row, then failed in numpy: 'Unable to allocate 112. GiB', a
    traceback. Now refused at once, with the largest size the same check passes."""
    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=4, size=32)
    monkeypatch.setattr(train_unet, "available_memory", lambda: 2**30)
    monkeypatch.setattr(train_unet, "run_benchmark_config", lambda *a: pytest.fail("a row was trained"))
    args = ["configs=fp32", "bare_steps=0", "inference=fp32", "image_size=32", f"data_dir={data}",
            f"output={tmp_path / 'out'}", "cpu_probe=False"]
    with pytest.raises(train_unet.UserError, match=r"^inference_size=200000 needs at least \S+ [GT]B of memory for "
                       r"the inference table's 200000x200000 image, and 1.0 GB is free: use a smaller inference_size "
                       r"\(at most (\d+)\), or inference= for no inference table$") as err:
        train_unet.run_benchmark([*args, "inference_size=200000"])
    fits = int(re.search(r"at most (\d+)", str(err.value))[1])
    assert 1024 < fits < 200000 and not (tmp_path / "out").exists()
    opts, base, _, _ = train_unet.parse_benchmark_args([*args, f"inference_size={fits}"])
    hw = train_unet.detect_hardware("cpu")
    train_unet.check_inference_memory(opts, base, hw, 2**30)  # the size it names fits
    opts["inference_size"] = fits + 1
    with pytest.raises(train_unet.UserError):
        train_unet.check_inference_memory(opts, base, hw, 2**30)


def test_the_memory_check_counts_what_the_inference_table_will_run(tmp_path):
    """Where bf16 is not native its inference rows are skipped: only the generated image is held, and a size
    refused for a fp32 row passes. Where not even one pixel fits, only inference= is suggested."""
    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=4, size=32)
    opts, base, _, _ = train_unet.parse_benchmark_args(["inference=bf16,bf16_cl", "inference_size=4000",
                                                        f"data_dir={data}"])
    hw = train_unet.detect_hardware("cpu")
    emulated = dataclasses.replace(hw, bf16=False)
    free = 4000 * 4000 * 8
    train_unet.check_inference_memory(opts, base, emulated, free)  # the image made, no row run
    with pytest.raises(train_unet.UserError):
        train_unet.check_inference_memory({**opts, "inference": "fp32,bf16"}, base, emulated, free)
    with pytest.raises(train_unet.UserError, match=r"and 0 kB is free: use inference= for no inference table$"):
        train_unet.check_inference_memory(opts, base, hw, 3)


def test_the_benchmark_header_names_the_torch_threads(monkeypatch):
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    assert train_unet.thread_words() == f"{os.cpu_count()} cores, 1 torch thread (OMP_NUM_THREADS=1)"
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads + 1)
    assert train_unet.thread_words() == f"{os.cpu_count()} cores, {threads + 1} torch threads"


def test_benchmark_keys_the_rows_cannot_compare_under_are_refused_or_pinned(tmp_path, monkeypatch):
    """batch_size=auto was a traceback from the data check ('<' not supported between 'int' and 'str');
    compile_model=True compiled every row (bf16 was bf16_compile, and each row paid a minute of compiling);
    bf16_2x's doubled batch failed after the rows before it had trained, naming a batch_size never given."""
    with pytest.raises(train_unet.UserError, match=r"^batch_size=auto is not for the benchmark: .*give batch_size= "
                                                   r"a number \(auto trains 8 on a CPU\)$"):
        train_unet.run_benchmark(["batch_size=auto", f"output={tmp_path / 'a'}"])
    base = train_unet.parse_overrides(["compile_model=True", "batch_size=4"])
    for name in train_unet.BENCHMARK_SETTINGS:
        said = train_unet.benchmark_overrides(name, base)
        assert f"compile_model={name == 'bf16_compile'}" in said or name == "default", (name, said)
    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=10, size=32)
    out = tmp_path / "out"
    base = train_unet.parse_overrides(["batch_size=6", "max_train_images=8", f"data_dir={data}"])
    pairs, _ = train_unet.data_pairs(base)
    no_bf16 = dataclasses.replace(train_unet.detect_hardware("cpu"), bf16=False)
    train_unet.check_doubled_batch(["bf16_2x"], base, pairs, no_bf16)  # a probe times random batches: no check
    monkeypatch.setattr(train_unet, "probe_instead", lambda *args: False)  # trained, as where bf16 is native
    monkeypatch.setattr(train_unet, "skip_reason", lambda *args: None)
    with pytest.raises(train_unet.UserError, match=r"^bf16_2x trains at twice batch_size=6, 12, more than the "
                                                   r"training set's 8 image\(s\): give batch_size=4 or less, or leave "
                                                   r"bf16_2x out$"):
        train_unet.run_benchmark(["configs=fp32,bf16_2x", "batch_size=6", "max_train_images=8", "image_size=32",
                                  f"data_dir={data}", f"output={out}", "inference="])
    assert not (out / "fp32.log").exists()  # nothing trained first


def test_the_doubled_batch_note_counts_the_steps_each_row_made():
    """12 images: fp32 at batch 4 made 3 steps an epoch, bf16_2x at 8 one (4 images left out): the note said
    '0.5x fp32's optimizer steps', and Time/Epoch (2.2x faster) contradicted Speedup (1.49x), unsaid."""
    ref = {"config": "fp32", "batch": 4, "optimizer_steps": 3, "accumulation_steps": 1}
    row = {"config": "bf16_2x", "batch": 8, "optimizer_steps": 1, "accumulation_steps": 1}
    assert train_unet.other_batch_note(row, ref) == (
        "batch 8: 1 optimizer step(s) per epoch to fp32's 3, so its Final IoU does not compare with fp32's; its epoch "
        "trains 8 images to fp32's 12 (full batches only), so compare its Speedup (images/s), not its Time/Epoch")
    assert train_unet.other_batch_note({**row, "optimizer_steps": 2}, {**ref, "optimizer_steps": 4}) == \
        "batch 8: 2 optimizer step(s) per epoch to fp32's 4, so its Final IoU does not compare with fp32's"
    older = {"config": "bf16_2x", "batch": 8}  # a row of an older benchmark.json: by the batch sizes
    assert train_unet.other_batch_note(older, {"batch": 4}).startswith("batch 8: 0.5x fp32's optimizer steps")


def test_a_stop_as_a_trained_rows_process_exits_keeps_the_row(bench, tmp_path, monkeypatch):
    """Ctrl-C in the seconds a row's training process takes to exit after its 'done' line: its history.csv was
    complete, benchmark.json's rows empty, and the stop said nothing of rows; the notebook refused it."""
    result, out = bench
    mine = tmp_path / "out"
    mine.mkdir()
    shutil.copytree(out / "fp32", mine / "fp32")

    def stopped(name, *args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_unet, "benchmark_row", stopped)
    kept = {"rows": [], "histories": {}}
    with pytest.raises(KeyboardInterrupt, match=r"; benchmark.json keeps the 1 row\(s\) that ended: fp32$"):
        train_unet.benchmark_rows(["fp32", "bf16"], {"epochs": 2}, None, {}, [], mine, kept)
    fp32 = next(r for r in result["rows"] if r["config"] == "fp32")
    assert kept["rows"] == [fp32] and json.loads((mine / "benchmark.json").read_text())["rows"] == [fp32]
    kept = {"rows": [], "histories": {}}  # a run stopped before its last epoch: no row
    with pytest.raises(KeyboardInterrupt, match=r"; no row had ended$"):
        train_unet.benchmark_rows(["fp32"], {"epochs": 3}, None, {}, [], mine, kept)
    assert kept["rows"] == []


def test_the_default_row_runs_the_config_as_training_would_where_its_precision_falls_back():
    """amp_dtype=bfloat16 where bf16 is not native: training falls back to fp32, while the default row was
    probed and labelled 'bf16 (not native)'; amp_dtype=float16 on a CPU: training runs in fp32, the row was
    skipped. The named rows keep their own rule (a probe, a skip)."""
    hw = dataclasses.replace(train_unet.detect_hardware("cpu"), bf16=False)
    base = train_unet.parse_overrides(["amp_dtype=bfloat16"])
    assert not train_unet.probe_instead("default", base, hw) and train_unet.skip_reason("default", base, hw) is None
    assert train_unet.probe_instead("bf16", base, hw)
    forced = train_unet.parse_overrides(["amp_dtype=bfloat16", "force_amp_dtype=True"])
    assert train_unet.probe_instead("default", forced, hw)  # bf16 as forced: emulated, probed as the bf16 rows
    half = train_unet.parse_overrides(["amp_dtype=float16"])
    assert train_unet.skip_reason("default", half, hw) is None and train_unet.skip_reason("fp16", half, hw)


def test_a_benchmark_stopped_in_its_inference_table_ends_with_its_own_line(tmp_path, monkeypatch):
    """Ctrl-C during the inference table's in-process predict ended with predict's line ('2 of 6 image(s)
    written'), not the benchmark's (review)."""
    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=6, size=32)
    monkeypatch.setattr(train_unet, "bare_loop_speedups", lambda *args: ({}, {}))
    monkeypatch.setattr(train_unet, "benchmark_rows", lambda *args: [])

    def stopped(*args):
        raise KeyboardInterrupt("the masks written so far are complete; 2 of 6 image(s) written")
    monkeypatch.setattr(train_unet, "inference_table", stopped)
    with pytest.raises(KeyboardInterrupt) as stop:
        train_unet.run_benchmark(["configs=fp32", "image_size=32", "batch_size=2", f"data_dir={data}",
                                  f"output={tmp_path / 'o'}"])
    assert str(stop.value) == train_unet.INTERRUPTED["benchmark"] + "; no row had ended"
