"""The benchmark: the same data, seed and model trained under several precision settings, each in its own
process, compared in one table (benchmark.json + benchmark.md in its output folder)."""
from __future__ import annotations

import csv
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

from unet_amp.common import UserError, atomic_write_json, atomic_write_text, say
from unet_amp.config import parse_args, parse_value, split_pair
from unet_amp.precision import DTYPE_NAMES, detect_hardware, resolve_device

TRAIN_SCRIPT = Path(__file__).resolve().parent.parent / "train_unet.py"

# The benchmark's own keys; any other key=value is a training key, passed to every run.
BENCHMARK_CONFIG = {
    "configs": "fp32,fp32_cl,bf16,bf16_cl,fp16",  # names from SETTINGS (tf32, bf16_compile: by name)
    "epochs": 3,                                  # each run trains all of them (no early stop)
    "output": "checkpoints/benchmark",            # <output>/<name>/ per run, benchmark.json and .md here
}

STRICT_FP32 = {"tf32_matmul_precision": "highest"}  # fp32 means fp32: no TF32 matmuls or cuDNN convolutions
# Each setting: the training keys it pins (a key given to the benchmark cannot turn one row into another).
SETTINGS = {
    "fp32": {"use_amp": False, "channels_last": False, "compile_model": False, **STRICT_FP32},
    "tf32": {"use_amp": False, "channels_last": False, "compile_model": False, "tf32_matmul_precision": "high"},
    "fp32_cl": {"use_amp": False, "channels_last": True, "compile_model": False, **STRICT_FP32},
    "bf16": {"use_amp": True, "amp_dtype": "bfloat16", "channels_last": False, "compile_model": False},
    "bf16_cl": {"use_amp": True, "amp_dtype": "bfloat16", "channels_last": True, "compile_model": False},
    "bf16_compile": {"use_amp": True, "amp_dtype": "bfloat16", "channels_last": False, "compile_model": True},
    "fp16": {"use_amp": True, "amp_dtype": "float16", "channels_last": False, "compile_model": False},
}
# Training keys the benchmark sets for every run; given by the user they would break the comparison.
FIXED = {"cpu_probe": False, "progress": False, "resume": False}
RUN_DEFAULTS = {"early_stopping_patience": None}  # all epochs, so the rows compare (a user's value wins)
COLUMNS = ("config", "precision", "median epoch s", "median images/s", "vs fp32", "best val IoU",
           "peak memory MB", "status")


def parse_benchmark_args(argv):
    """(benchmark options, the keys typed, the training key=value texts passed to every run)."""
    argv = list(argv)
    for arg in argv:
        split_pair(arg)  # not key=value -> UserError naming it
    ours = [a for a in argv if a.partition("=")[0] in BENCHMARK_CONFIG]
    train_args = [a for a in argv if a not in ours]
    for arg in train_args:
        key = arg.partition("=")[0]
        if key in FIXED or key == "checkpoint_dir":
            raise UserError(f"{key}: set by the benchmark for each run (output=<folder> holds them); leave it out")
    opts, typed = parse_args(ours, BENCHMARK_CONFIG)
    if opts["epochs"] < 1:
        raise UserError(f"epochs={opts['epochs']}: must be >= 1")
    return opts, typed, train_args


def config_names(text):
    """The configs= list: known names, each once, in the order given."""
    names = list(dict.fromkeys(n.strip().lower() for n in str(text).split(",") if n.strip()))
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        raise UserError(f"configs={text}: unknown {', '.join(unknown) or '(empty)'}; use a comma-separated list "
                        f"of {', '.join(SETTINGS)}")
    return names


def expected_precision(name):
    """'fp32' | 'bf16' | 'fp16': what the setting trains in."""
    setting = SETTINGS[name]
    return DTYPE_NAMES[setting["amp_dtype"]] if setting["use_amp"] else "fp32"


def skip_reason(name, hw, named):
    """Why a setting is left out here (None: it runs): a dtype without fast kernels on this hardware runs only
    when named in configs= (fp16 on a CPU is 10-190x slower than fp32: hours for a few epochs)."""
    dtype = expected_precision(name)
    native = {"fp32": True, "bf16": hw.bf16_native, "fp16": hw.fp16_native}[dtype]
    if native or named:
        return None
    return f"{dtype} has no fast kernels on this {hw.kind} ({hw.name}); name it in configs= to run it anyway"


def child_args(name, train_args, epochs, run_dir):
    """The training command's key=value list: defaults, the user's keys, the setting's, then the fixed ones."""
    pinned = {**SETTINGS[name], **FIXED, "checkpoint_dir": run_dir}
    return [*(f"{k}={v}" for k, v in RUN_DEFAULTS.items()), f"epochs={epochs}", *train_args,
            *(f"{k}={v}" for k, v in pinned.items())]


def read_history(path):
    """history.csv's rows, numbers as numbers."""
    with open(path, newline="") as f:
        return [{k: parse_value(v) if v else None for k, v in row.items()} for row in csv.DictReader(f)]


def last_line(text, code):
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else f"exit code {code}"


def run_config(name, train_args, epochs, out):
    """(row, history or None): one setting trained by train_unet.py in a process of its own."""
    run_dir = out / name
    cmd = [sys.executable, str(TRAIN_SCRIPT), *child_args(name, train_args, epochs, run_dir)]
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    seconds = time.perf_counter() - start
    atomic_write_text(out / f"{name}.log", f"$ {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}")
    summary_path = run_dir / "summary.json"
    if proc.returncode != 0 or not summary_path.is_file():
        return {"config": name, "status": f"failed: {last_line(proc.stderr, proc.returncode)}", "wall_s": seconds}, None
    return summary_row(name, json.loads(summary_path.read_text()), seconds), read_history(run_dir / "history.csv")


def summary_row(name, summary, seconds):
    """A table row from a run's summary.json; a run that fell back to another precision says so."""
    ran = summary["precision"]
    status = "ok" if ran == expected_precision(name) else f"ok: ran as {ran} (fallback)"
    return {"config": name, "precision": ran, "channels_last": summary["channels_last"],
            "compile": bool(summary["config"].get("compile_model")), "median_epoch_s": summary["median_epoch_s"],
            "median_images_per_s": summary["median_images_per_s"], "speedup_vs_fp32": None,
            "best_iou": summary["best_iou"], "peak_memory_mb": summary["peak_memory_mb"],
            "epochs_run": summary["epochs_run"], "device_name": summary["device_name"], "wall_s": seconds,
            "status": status}


def add_speedups(rows):
    """speedup_vs_fp32: images/s over the fp32 row's, both medians of this benchmark (None without fp32)."""
    fp32 = next((r for r in rows if r["config"] == "fp32" and r["status"].startswith("ok")), None)
    for row in rows:
        if row["status"].startswith("ok") and fp32 is not None:
            row["speedup_vs_fp32"] = row["median_images_per_s"] / fp32["median_images_per_s"]


def _cell(value, spec=""):
    return "-" if value is None else format(value, spec)


def precision_words(row):
    if "precision" not in row:
        return expected_precision(row["config"])
    return row["precision"] + " NHWC" * row["channels_last"] + " compiled" * row["compile"]


def format_table(rows):
    """The rows as a markdown table."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for r in rows:
        cells = (r["config"], precision_words(r), _cell(r.get("median_epoch_s"), ".2f"),
                 _cell(r.get("median_images_per_s"), ".1f"),
                 _cell(r.get("speedup_vs_fp32"), ".2f") + ("x" if r.get("speedup_vs_fp32") else ""),
                 _cell(r.get("best_iou"), ".4f"), _cell(r.get("peak_memory_mb"), ".0f"), r["status"])
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def markdown(result, table):
    """benchmark.md: where and how it ran, the table, what the columns mean."""
    return (f"# Benchmark: {result['device_name']} ({result['device']}), torch {result['torch']}\n\n"
            f"`{result['command']}` on {result['date']}; {result['epochs']} epoch(s) per configuration.\n\n"
            f"{table}\n\n"
            "Median epoch s and images/s: medians over the run's epochs (the first includes warm-up and any "
            "compile). vs fp32: images/s over the fp32 row's in this benchmark. Best val IoU: evaluated in fp32. "
            "Peak memory: the GPU allocator's peak on CUDA, the process's resident set elsewhere.\n")


def run_benchmark(argv):
    """The `benchmark` command: every setting trained in turn; returns benchmark.json's content."""
    opts, typed, train_args = parse_benchmark_args(argv)
    names = config_names(opts["configs"])
    device = dict(split_pair(a) for a in train_args).get("device", "auto")
    hw = detect_hardware(resolve_device(device))
    out = Path(opts["output"])
    result = {"device": hw.kind, "device_name": hw.name, "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "epochs": opts["epochs"],
              "command": shlex.join(["python", "train_unet.py", "benchmark", *argv]), "train_args": train_args,
              "rows": [], "histories": {}, "complete": False}
    say(f"[benchmark] {hw.name} ({hw.kind}): {', '.join(names)}; {opts['epochs']} epoch(s) each; results in {out}/")
    for i, name in enumerate(names, 1):
        reason = skip_reason(name, hw, "configs" in typed)
        say(f"[benchmark] {i}/{len(names)} {name}: " + (f"skipped: {reason}" if reason else "training..."))
        row, history = ({"config": name, "status": f"skipped: {reason}"}, None) if reason else \
            run_config(name, train_args, opts["epochs"], out)
        result["rows"].append(row)
        if history is not None:
            result["histories"][name] = history
        add_speedups(result["rows"])
        atomic_write_json(out / "benchmark.json", result)  # an interrupted benchmark keeps the rows that ended
        if not reason:
            say(f"[benchmark] {name}: {row['status']} ({row['wall_s']:.0f}s)")
    result["complete"] = True
    table = format_table(result["rows"])
    say(table)
    atomic_write_json(out / "benchmark.json", result)
    atomic_write_text(out / "benchmark.md", markdown(result, table))
    return result


def main(argv):
    """Exit code: 0 when every row ran (or was skipped), 1 when one failed."""
    result = run_benchmark(argv)
    return int(any(r["status"].startswith("failed") for r in result["rows"]))
