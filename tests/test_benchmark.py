"""The benchmark: a tiny real one (fp32 and bf16, one process each), and its parts on made-up rows."""
import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from unet_amp import benchmark
from unet_amp.common import UserError
from unet_amp.data import ensure_shapes_dataset

ROOT = Path(__file__).resolve().parents[1]


def test_tiny_benchmark_trains_each_config_in_its_own_process(tmp_path):
    data = ensure_shapes_dataset(tmp_path / "data", count=20)
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, "train_unet.py", "benchmark", "configs=fp32,bf16", "epochs=1",
                           "max_train_images=8", "image_size=64", "batch_size=4", "encoder_name=resnet18",
                           "logger=csv", f"data_dir={data}", f"output={out}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})  # one thread: steady on a busy machine
    assert proc.returncode == 0, proc.stderr[-2000:]
    table = [line for line in proc.stdout.splitlines() if line.startswith("| fp32 |") or line.startswith("| bf16 |")]
    assert len(table) == 2 and all(line.rstrip().endswith("| ok |") for line in table)
    result = json.loads((out / "benchmark.json").read_text())
    fp32, bf16 = result["rows"]
    assert (fp32["config"], fp32["precision"], bf16["config"], bf16["precision"]) == ("fp32", "fp32", "bf16", "bf16")
    assert fp32["channels_last"] is False and bf16["channels_last"] is False
    assert fp32["speedup_vs_fp32"] == 1.0
    assert bf16["speedup_vs_fp32"] == pytest.approx(bf16["median_images_per_s"] / fp32["median_images_per_s"])
    assert all(r["epochs_run"] == 1 and r["median_epoch_s"] > 0 and 0 <= r["best_iou"] <= 1 for r in result["rows"])
    assert result["complete"] and [len(h) for h in result["histories"].values()] == [1, 1]
    for name in ("fp32", "bf16"):
        assert (out / name / "summary.json").is_file() and (out / f"{name}.log").is_file()
    assert "| bf16 |" in (out / "benchmark.md").read_text()


def test_a_failed_run_is_a_failed_row_and_exit_code_1(tmp_path):
    code = benchmark.main(["configs=fp32", "no_such_key=1", f"output={tmp_path}"])
    row = json.loads((tmp_path / "benchmark.json").read_text())["rows"][0]
    assert code == 1 and row["status"].startswith("failed:") and "no_such_key" in row["status"]


def fake_run(statuses):
    def run_config(name, train_args, epochs, out):
        if statuses.get(name) == "failed":
            return {"config": name, "status": "failed: error: boom", "wall_s": 1.0}, None
        rate = {"fp32": 10.0, "bf16": 25.0}.get(name, 20.0)
        summary = {"precision": benchmark.expected_precision(name), "channels_last": name.endswith("_cl"),
                   "config": {}, "median_epoch_s": 100 / rate, "median_images_per_s": rate, "best_iou": 0.5,
                   "peak_memory_mb": 900.0, "epochs_run": epochs, "device_name": "cpu"}
        return benchmark.summary_row(name, summary, 1.0), [{"epoch": 1, "epoch_s": 100 / rate, "val_iou": 0.5}]
    return run_config


def test_default_configs_skip_slow_dtypes_on_a_cpu(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmark, "run_config", fake_run({}))
    result = benchmark.run_benchmark(["device=cpu", f"output={tmp_path}"])
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == ["fp32", "fp32_cl", "bf16", "bf16_cl", "fp16"]
    assert rows["fp16"]["status"].startswith("skipped:")  # fp16 on a CPU: never fast
    assert rows["fp32_cl"]["speedup_vs_fp32"] == 2.0
    saved = json.loads((tmp_path / "benchmark.json").read_text())
    assert saved["rows"] == result["rows"] and saved["complete"]
    assert "| fp16 | fp16 |" in (tmp_path / "benchmark.md").read_text()


def test_exit_code_1_when_a_row_failed(tmp_path, monkeypatch):
    monkeypatch.setattr(benchmark, "run_config", fake_run({"bf16": "failed"}))
    assert benchmark.main(["configs=fp32,bf16", f"output={tmp_path}"]) == 1
    monkeypatch.setattr(benchmark, "run_config", fake_run({}))
    assert benchmark.main(["configs=fp32,bf16", f"output={tmp_path}"]) == 0


def test_a_dtype_without_fast_kernels_runs_only_when_named():
    hw = types.SimpleNamespace(kind="cpu", name="cpu", bf16_native=False, fp16_native=False)
    assert benchmark.skip_reason("fp16", hw, named=False) and benchmark.skip_reason("bf16_cl", hw, named=False)
    assert benchmark.skip_reason("fp16", hw, named=True) is None
    assert benchmark.skip_reason("fp32", hw, named=False) is None


def test_each_setting_pins_its_own_keys_over_the_users():
    args = benchmark.child_args("bf16", ["use_amp=False", "epochs=7", "image_size=64"], 2, Path("out/bf16"))
    settings = dict(a.split("=", 1) for a in args)  # the last value of a key wins, as in train_unet.py
    assert settings["use_amp"] == "True" and settings["amp_dtype"] == "bfloat16" and settings["epochs"] == "7"
    assert settings["checkpoint_dir"] == str(Path("out/bf16")) and settings["cpu_probe"] == "False"
    assert settings["image_size"] == "64"


def test_without_an_fp32_row_there_is_no_speed_up():
    rows = [{"config": "bf16", "status": "ok", "median_images_per_s": 3.0, "speedup_vs_fp32": None}]
    benchmark.add_speedups(rows)
    assert rows[0]["speedup_vs_fp32"] is None


@pytest.mark.parametrize("argv, key", [(["configs=fp32,fp64"], "configs"), (["checkpoint_dir=x"], "checkpoint_dir"),
                                      (["progress=True"], "progress"), (["epochs=0"], "epochs")])
def test_bad_arguments_are_user_errors_naming_the_key(argv, key):
    with pytest.raises(UserError, match=key):
        benchmark.run_benchmark(argv)


def test_the_train_script_path():
    assert benchmark.TRAIN_SCRIPT == ROOT / "train_unet.py" and benchmark.TRAIN_SCRIPT.is_file()
