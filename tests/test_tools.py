"""The developer tools: gpu_check without a GPU, overhead's counts on a tiny model, predict_vs_monai without MONAI."""
import importlib.util
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import gpu_check  # noqa: E402
import overhead  # noqa: E402


def tool(name, *args):
    return subprocess.run([sys.executable, str(ROOT / "tools" / name), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is here: make gpu-check runs the real checks")
def test_gpu_check_without_a_gpu_says_so_and_exits_0():
    proc = tool("gpu_check.py")
    assert proc.returncode == 0 and "no CUDA GPU" in proc.stdout


def test_gpu_check_reports_a_failed_check_and_a_skipped_one(tmp_path):
    hw = types.SimpleNamespace(bf16_native=False, fp16_native=True, capability=(7, 5))
    status, seconds, words = gpu_check.run_check("x", lambda hw, tmp: 1 / 0, hw, tmp_path)
    assert status == "failed" and "ZeroDivisionError" in words and seconds >= 0
    assert gpu_check.run_check("train bf16", lambda hw, tmp: "ran", hw, tmp_path)[0] == "skipped"
    assert gpu_check.run_check("train fp16 + GradScaler", lambda hw, tmp: "ran", hw, tmp_path)[::2] == ("ok", "ran")


def test_overhead_counts_ops_and_host_reads_per_step(capsys):
    originals, threads = {name: getattr(torch.Tensor, name) for name in overhead.CONVERSIONS}, torch.get_num_threads()
    torch.set_num_threads(1)  # counts do not depend on threads; one thread keeps a busy machine's time short
    try:
        assert overhead.run(["precisions=fp32", "steps=2", "rounds=1", "image_size=32", "batch_size=2",
                             "device=cpu", "encoder_name=resnet18", "ema_decay=None"]) == 0
    finally:
        torch.set_num_threads(threads)
    rows = {line.split("|")[1].strip(): line.split("|")[2:5] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| fp32")}
    trainer, bare = ([float(cell) for cell in rows[name]] for name in ("fp32 trainer", "fp32 bare"))
    assert bare[0] > 100 and trainer[0] >= bare[0]  # aten ops per step: forward, backward, optimizer
    assert bare[1] == 0 and 1 <= trainer[1] <= 1.5  # the guard's one host read per step (+ the epoch's loss)
    assert {name: getattr(torch.Tensor, name) for name in overhead.CONVERSIONS} == originals


@pytest.mark.skipif(importlib.util.find_spec("monai") is not None, reason="MONAI is installed here")
def test_predict_vs_monai_without_monai_says_how_to_install_it():
    proc = tool("predict_vs_monai.py", "size=256")
    assert proc.returncode == 2 and "pip install monai" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and proc.stdout == ""
