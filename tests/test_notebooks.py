"""The run notebook (RUN_DIR), the benchmark notebook's robustness, and the Makefile targets the README names."""
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import nbclient
import nbformat
import pytest

import train_unet

ROOT = Path(__file__).resolve().parents[1]


def execute(name, env):
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                                resources={"metadata": {"path": str(ROOT / "notebooks")}}).execute()
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    errors = [o for o in outputs if o.output_type == "error"]
    assert not errors, errors[0].get("evalue")
    text = "".join(o.get("text", "") for o in outputs)
    return outputs, text


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """A real 2-epoch, 3-class run with class names (64 px, 12 images): what RUN_DIR points at. Trained in its
    own folder with data_dir=data, relative to it, as a user's project is; the notebooks run elsewhere."""
    tmp = tmp_path_factory.mktemp("run")
    data = train_unet.generate_shapes_dataset(tmp / "data", count=12, size=64, num_classes=3)
    (data / "class_names.txt").write_text("background\ncircle\nbox\n")
    cfg = dict(train_unet.CONFIG, data_dir="data", checkpoint_dir=str(tmp / "run"), image_size=64,
               num_classes=3, epochs=2, batch_size=4, device="cpu", progress=False, use_amp=False)
    cwd = os.getcwd()
    os.chdir(tmp)
    try:
        train_unet.train(cfg)
    finally:
        os.chdir(cwd)
    return tmp / "run"


def test_run_notebook_plots_the_run_in_run_dir(tiny_run):
    outputs, text = execute("my_run.ipynb", {"RUN_DIR": str(tiny_run)})
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 5  # curves, health, steps, confusion, predictions
    assert f"run: {tiny_run}" in text and "2 epoch(s)" in text and "batch: 4 x 1\n" in text  # one process
    assert "confusion matrix at epoch" in text and "3 classes" in text
    assert "precision per epoch: 1: fp32, 2: fp32" in text
    assert "optimizer steps logged; live view" in text  # no epoch without events
    # data_dir=data was the run's own folder's, not the repository's, where the notebook runs ("not found")
    assert f"model: {tiny_run / 'best.pt'}; images from {os.path.realpath(tiny_run.parent / 'data')}" in text


def test_run_notebook_says_a_torchrun_runs_process_count(tiny_run, tmp_path):
    """A run of 4 processes read "batch: 4 x 1": a quarter of the batch each optimizer step took."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    info = json.loads((run / "config.json").read_text())
    (run / "config.json").write_text(json.dumps({**info, "world_size": 4}))
    _, text = execute("my_run.ipynb", {"RUN_DIR": str(run)})
    assert f"batch: {info['config']['batch_size']} x 1 x 4 processes\n" in text


def test_run_notebook_names_the_epochs_with_no_events(tiny_run, tmp_path):
    """A run resumed with logger=csv between has epochs in history.csv and none in tensorboard/: the notebook
    said 'N optimizer steps logged' as though they were the run's."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    lines = (run / "history.csv").read_text().splitlines()
    (run / "history.csv").write_text("\n".join([*lines, "3" + lines[-1][lines[-1].index(","):]]) + "\n")
    _, text = execute("my_run.ipynb", {"RUN_DIR": str(run)})
    assert "optimizer steps logged; no events for epoch(s) 3 (trained without TensorBoard: gaps above)" in text


def test_run_notebook_plots_a_run_whose_tensorboard_folder_has_no_events(tiny_run, tmp_path):
    """A library run stopped at its first epoch's line (a closed stdout) left tensorboard/ with an event file of
    no scalars: the per-step cell was matplotlib's 'Number of columns must be a positive integer, not 0', and the
    cells after it did not run."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    shutil.rmtree(run / train_unet.TENSORBOARD_DIR)
    (run / train_unet.TENSORBOARD_DIR).mkdir()
    _, text = execute("my_run.ipynb", {"RUN_DIR": str(run)})
    assert f"no per-step events in {run / train_unet.TENSORBOARD_DIR}; no events for epoch(s) 1" in text
    assert "confusion matrix at epoch" in text  # the cells after it ran


def test_run_notebook_plots_a_run_whose_history_csv_is_gone_from_last_pt(tiny_run, tmp_path):
    """A run with best.pt and last.pt but no history.csv (deleted) was 'no finished epoch ... a run stopped in
    its first epoch'; its data set deleted since, the predictions cell was a traceback that hid the plots'
    end; RUN_DIR=<run>/best.pt was 'not found'."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    (run / "history.csv").unlink()
    gone = tmp_path / "gone"  # the data set the run trained on, deleted since: 49 lines of traceback
    state = train_unet.load_checkpoint(run / "best.pt")
    state["config"]["data_dir"], state["data_split"]["folder"] = str(gone), str(gone)
    train_unet.save_checkpoint(run / "best.pt", state)
    _, text = execute("my_run.ipynb", {"RUN_DIR": str(run)})
    assert f"no history.csv in {run}: the 2 epoch(s) last.pt records" in text and "2 epoch(s); best val IoU" in text
    assert f"no predictions: the run's data cannot be read: data_dir {gone} not found" in text
    with pytest.raises(nbclient.exceptions.CellExecutionError,
                       match=rf"RUN_DIR={re.escape(str(run / 'best.pt'))} is a file: give the run's folder, "
                             rf"{re.escape(str(run))}"):
        execute("my_run.ipynb", {"RUN_DIR": str(run / "best.pt")})


def test_a_user_error_in_a_notebook_cell_shows_its_one_line_not_a_traceback():
    """Jupyter showed 12 to 49 lines of traceback around a UserError's one line (a notebook's own refusal, or
    load_model's, or prepare_data's through three frames)."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"import sys; sys.path.insert(0, {str(ROOT)!r}); import train_unet as T"),
                nbformat.v4.new_code_cell("T.load_model('/nonexistent/best.pt', 'cpu')")]
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", allow_errors=True)
    client.execute()
    [error] = [o for o in nb.cells[1].outputs if o.output_type == "error"]
    assert error.ename == "UserError" and len(error.traceback) == 1
    assert error.traceback[0].startswith("UserError: ") and "/nonexistent/best.pt" in error.traceback[0]


@pytest.mark.parametrize("case", ["typo", "interrupted", "benchmark"])
def test_run_notebook_trains_nothing_in_a_folder_the_user_named(case, tmp_path):
    """Given a folder with no finished epoch, it used to train a preset=debug run there and plot it as the
    user's: in a mistyped path it made a fake run; in a run stopped in epoch 1 it moved the user's files
    aside for it. Now it says what is missing and leaves the folder as it was."""
    run = tmp_path / "previous" / "20260101-120000"
    if case == "interrupted":  # what SIGTERM in epoch 1 leaves
        (run / "tensorboard").mkdir(parents=True)
        (run / "config.json").write_text("{}")
    if case == "benchmark":  # a benchmark's folder: it said 'no finished epoch ... stopped in its first epoch'
        (run / "fp32").mkdir(parents=True)
        (run / "fp32" / "history.csv").write_text("epoch\n1\n")
        (run / "benchmark.json").write_text("{}")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    said = ("no finished epoch in .*no history.csv" if case == "interrupted" else
            rf"RUN_DIR={re.escape(str(run))} is a benchmark's folder: set RUN_DIR to one of its runs "
            rf"\({re.escape(str(run / 'fp32'))}\), or open fp32_vs_bf16.ipynb with UNET_AMP_BENCH_DIR="
            rf"{re.escape(str(run))} for the whole benchmark"
            if case == "benchmark" else  # a typo: no such folder, said
            rf"RUN_DIR={re.escape(str(run))} not found \(a relative RUN_DIR is taken from the repository, .*\): give "
            rf"the run's checkpoint_dir from there, or as an absolute path")
    with pytest.raises(nbclient.exceptions.CellExecutionError, match=said):
        execute("my_run.ipynb", {"RUN_DIR": str(run)})
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_benchmark_notebook_runs_nothing_in_a_folder_the_user_named(tmp_path):
    """Pointed at an interrupted benchmark (no benchmark.json), it started a 5-minute benchmark there, moving
    the partial results aside, as my_run.ipynb no longer does with a run's folder."""
    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "fp32.log").write_text("[benchmark] fp32: ...\n")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(nbclient.exceptions.CellExecutionError, match="no benchmark.json in .*bench"):
        execute("fp32_vs_bf16.ipynb", {"UNET_AMP_BENCH_DIR": str(bench)})
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before


def test_benchmark_notebook_skips_rows_with_missing_numbers(tiny_run, tmp_path):
    """A row without some numbers (e.g. a probe row) must not break the plots."""
    history = list(train_unet.csv.DictReader(open(tiny_run / "history.csv")))
    row = {"config": "bf16", "status": "ok", "batch": 4, "precision": "bf16", "channels_last": False,
           "compile": False, "time_per_epoch_s": 1.0, "first_epoch_s": 1.5, "images_per_s": 10.0,
           "speedup_vs_fp32": 1.0, "peak_mem_mb": 100.0, "peak_mem_kind": "process_peak_rss",
           "final_val_iou": 0.5, "final_val_dice": 0.6}
    # The numbers the benchmark's own table prints stay; the others are missing.
    probe = {k: None for k in row} | {k: row[k] for k in ("batch", "precision", "compile", "time_per_epoch_s",
                                                          "peak_mem_mb", "final_val_iou")} | {"config": "probe"}
    probe["status"] = "ok"
    bench = tmp_path / "bench"
    shutil.copytree(tiny_run, bench / "bf16")
    (bench / "benchmark.json").write_text(json.dumps({
        "device": "cpu", "settings": {}, "rows": [{**row, "config": "fp32", "precision": "fp32"}, row, probe],
        "histories": {"fp32": history, "bf16": history}, "bare_loop_s_per_step": {}}))
    (bench / "benchmark.csv").write_text("")
    outputs, text = execute("fp32_vs_bf16.ipynb", {"UNET_AMP_BENCH_DIR": str(bench)})
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 3
    assert "best.pt" in text


def test_benchmark_notebook_plots_a_validation_set_of_one_image(tiny_run, tmp_path):
    """plt.subplots(1, 3) returns one row of axes, not a grid: the predictions cell raised 'Axes' object is
    not iterable on a benchmark whose validation set held one image."""
    data = train_unet.generate_shapes_dataset(tmp_path / "five", count=5, size=64, num_classes=3)
    bench = tmp_path / "bench"
    shutil.copytree(tiny_run, bench / "fp32")
    state = train_unet.load_checkpoint(bench / "fp32" / "best.pt")
    state["config"] = {**state["config"], "data_dir": str(data), "val_fraction": 0.2}
    state["data_split"] = {**state["data_split"], "folder": str(data)}  # as if trained on it (trained_data_dir)
    assert len(train_unet.prepare_data(state["config"])[1]) == 1
    train_unet.save_checkpoint(bench / "fp32" / "best.pt", state)
    history = list(train_unet.csv.DictReader(open(tiny_run / "history.csv")))
    row = {"config": "fp32", "status": "ok", "batch": 4, "precision": "fp32", "channels_last": False,
           "compile": False, "time_per_epoch_s": 1.0, "first_epoch_s": 1.5, "images_per_s": 10.0,
           "speedup_vs_fp32": 1.0, "peak_mem_mb": 100.0, "peak_mem_kind": "process_peak_rss",
           "final_val_iou": 0.5, "final_val_dice": 0.6}
    (bench / "benchmark.json").write_text(json.dumps({"device": "cpu", "settings": {}, "rows": [row],
                                                      "histories": {"fp32": history}, "bare_loop_s_per_step": {}}))
    (bench / "benchmark.csv").write_text("")
    outputs, text = execute("fp32_vs_bf16.ipynb", {"UNET_AMP_BENCH_DIR": str(bench)})
    assert f"model: {bench / 'fp32' / 'best.pt'}" in text


def test_benchmark_notebook_refuses_a_benchmark_stopped_before_its_inference_table(tmp_path):
    """Interrupted after its rows trained, a benchmark's benchmark.json had no inference table: the notebook
    said 'benchmark inference=... adds one', an option the user had given (user report). It names the command
    the benchmark recorded, as for one stopped before any row finished (test_benchmark)."""
    bench = tmp_path / "bench"
    bench.mkdir()
    command = "python train_unet.py benchmark configs=fp32 inference=fp32,bf16"
    (bench / "benchmark.json").write_text(json.dumps({"device": "cpu", "settings": {}, "rows": [], "histories": {},
                                                      "bare_loop_s_per_step": {}, "complete": False,
                                                      "machine": {"command": command}}))
    with pytest.raises(nbclient.exceptions.CellExecutionError,
                       match=re.escape(f"did not finish (interrupted, or it failed): run `{command}`")):
        execute("fp32_vs_bf16.ipynb", {"UNET_AMP_BENCH_DIR": str(bench)})


def test_benchmark_notebook_plots_the_rows_an_interrupted_benchmark_finished(tmp_path, tiny_run):
    """Stopped in its inference table, after both training rows were done: the notebook refused the whole
    benchmark and plotted nothing. Its finished rows are shown now, with a note saying what is missing."""
    bench = tmp_path / "bench"
    shutil.copytree(tiny_run, bench / "fp32")
    shutil.copytree(tiny_run, bench / "bf16")  # the row it was training when stopped: its best.pt is not shown
    history = list(train_unet.csv.DictReader(open(tiny_run / "history.csv")))
    row = {"config": "fp32", "status": "ok", "batch": 4, "precision": "fp32", "channels_last": False,
           "compile": False, "time_per_epoch_s": 1.0, "first_epoch_s": 1.5, "images_per_s": 10.0,
           "speedup_vs_fp32": 1.0, "peak_mem_mb": 100.0, "peak_mem_kind": "process_peak_rss",
           "final_val_iou": 0.5, "final_val_dice": 0.6}
    command = "python train_unet.py benchmark configs=fp32 inference=fp32"
    (bench / "benchmark.json").write_text(json.dumps({"device": "cpu", "settings": {}, "rows": [row],
                                                      "histories": {"fp32": history}, "bare_loop_s_per_step": {},
                                                      "complete": False, "machine": {"command": command}}))
    _, text = execute("fp32_vs_bf16.ipynb", {"UNET_AMP_BENCH_DIR": str(bench)})
    assert (f"note: the benchmark in {bench} did not finish (interrupted, or it failed): shown are the 1 row(s) it "
            f"finished, without what came after them; run `{command}` to the end for the whole table") in text
    assert "no inference table: the benchmark stopped before it" in text and f"model: {bench / 'fp32'}" in text


def test_benchmark_notebook_with_no_trained_row_says_so(tmp_path):
    """Every row skipped or probed (bf16 not native here): the predictions cell raised a bare StopIteration."""
    bench = tmp_path / "bench"
    bench.mkdir()
    rows = [{"config": "bf16", "precision": "bf16 (not native)", "batch": 8, "speedup_vs_fp32": 0.03,
             "slowdown_vs_fp32": 33.0, "status": "probe: 8 bare steps, none"},
            {"config": "fp16", "status": "skipped: amp_dtype=float16 on a CPU"}]
    (bench / "benchmark.json").write_text(json.dumps({"device": "cpu", "settings": {"eval_amp": False}, "rows": rows,
                                                      "histories": {}, "bare_loop_s_per_step": {}, "complete": True}))
    _, text = execute("fp32_vs_bf16.ipynb", {"UNET_AMP_BENCH_DIR": str(bench)})
    assert f"no trained configuration in {bench} to show predictions from" in text
    assert "no configuration trained (all skipped or probed): no training curves to plot" in text


def test_benchmark_notebook_plots_the_curves_of_the_configs_it_has_without_fp32_or_bf16(tmp_path, tiny_run):
    """configs=fp32_cl,bf16_cl: the curves cell drew three empty plots, with matplotlib's 'No artists with
    labels found to put in legend' (user test)."""
    bench = tmp_path / "bench"
    shutil.copytree(tiny_run, bench / "bf16_cl")
    history = list(train_unet.csv.DictReader(open(tiny_run / "history.csv")))
    row = {"config": "bf16_cl", "status": "ok", "batch": 4, "precision": "bf16", "channels_last": True,
           "compile": False, "time_per_epoch_s": 1.0, "first_epoch_s": 1.5, "images_per_s": 10.0,
           "speedup_vs_fp32": None, "peak_mem_mb": 100.0, "peak_mem_kind": "process_peak_rss",
           "final_val_iou": 0.5, "final_val_dice": 0.6}
    (bench / "benchmark.json").write_text(json.dumps({"device": "cpu", "settings": {}, "rows": [row],
                                                      "histories": {"bf16_cl": history}, "bare_loop_s_per_step": {},
                                                      "complete": True}))
    outputs, text = execute("fp32_vs_bf16.ipynb", {"UNET_AMP_BENCH_DIR": str(bench)})
    assert "neither fp32 nor bf16 was trained: the curves of bf16_cl" in text and "No artists" not in text


def test_every_make_target_the_readme_names_exists():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"\bmake ([a-z][a-z-]*[a-z])\b", readme))
    assert {"train", "test", "notebook", "benchmark", "tensorboard", "clean"} <= named
    for target in sorted(named):
        # -n: print the commands without running them; -o: do not rebuild the venv for this check
        done = subprocess.run(["make", "-n", "-o", ".venv/.installed", target], cwd=ROOT,
                              capture_output=True, text=True)
        assert done.returncode == 0, (target, done.stderr)
    assert "jupyter notebook --notebook-dir=notebooks" in subprocess.run(
        ["make", "-n", "-o", ".venv/.installed", "notebook"], cwd=ROOT, capture_output=True, text=True).stdout


def test_benchmark_notebook_tells_a_running_benchmark_from_an_interrupted_one(tmp_path):
    """benchmark.json says "complete": false from a benchmark's start: opened while one runs, the notebook
    said it had been interrupted. A running benchmark holds its folder's lock (here this process holds it)."""
    fcntl = pytest.importorskip("fcntl")  # no flock on Windows: nothing is held there

    bench = tmp_path / "bench"
    bench.mkdir()
    (bench / "benchmark.json").write_text(json.dumps({"device": "cpu", "settings": {}, "rows": [], "histories": {},
                                                      "complete": False, "machine": {"command": "python ..."}}))
    running = os.open(bench, os.O_RDONLY)
    fcntl.flock(running, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(nbclient.exceptions.CellExecutionError, match=re.escape(
                f"the benchmark in {bench} is still running: run this notebook again once it has finished")):
            execute("fp32_vs_bf16.ipynb", {"UNET_AMP_BENCH_DIR": str(bench)})
    finally:
        os.close(running)
    assert not train_unet.held_by_another(bench)


def test_the_data_folder_of_a_run_whose_recorded_folder_was_emptied_is_its_data_dir(tmp_path):
    """The embedded data set emptied after training: its recorded (absolute) folder would not be written
    again, as data_dir=data/shapes, given, is."""
    model = train_unet.build_model({**train_unet.CONFIG, "encoder_name": "resnet18", "encoder_weights": None})
    (tmp_path / "emptied").mkdir()
    state = {"model": model.state_dict(), "config": {**train_unet.CONFIG, "data_dir": "data/shapes"},
             "data_split": {"folder": str(tmp_path / "emptied")}}
    train_unet.save_checkpoint(tmp_path / "best.pt", state)
    assert train_unet.trained_data_dir(tmp_path / "best.pt") == "data/shapes"
    state["data_split"]["folder"] = str(tmp_path)  # holds best.pt: a folder with files
    train_unet.save_checkpoint(tmp_path / "best.pt", state)
    assert train_unet.trained_data_dir(tmp_path / "best.pt") == str(tmp_path)
