"""Both notebooks run top to bottom on a tiny benchmark (fp32 and bf16, one epoch), the second on its fp32 run."""
import json
from pathlib import Path

import nbformat
from nbclient import NotebookClient

from unet_amp.data import ensure_shapes_dataset

NOTEBOOKS = Path(__file__).resolve().parents[1] / "notebooks"


def execute(name):
    """(printed text, number of figures) of the notebook run in a fresh kernel from notebooks/."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    outputs = [out for cell in nb.cells for out in cell.get("outputs", [])]
    text = "\n".join(out.get("text", "") for out in outputs)
    return text, sum("image/png" in out.get("data", {}) for out in outputs)


def test_notebooks_run_on_a_tiny_benchmark(tmp_path, monkeypatch):
    data = ensure_shapes_dataset(tmp_path / "data", count=20)
    bench = tmp_path / "bench"
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the kernel and its benchmark's runs: steady on a busy machine
    monkeypatch.setenv("UNET_AMP_BENCH_DIR", str(bench))
    monkeypatch.setenv("UNET_AMP_BENCH_ARGS", f"data_dir={data} image_size=64 batch_size=4 max_train_images=8 "
                                     "encoder_name=resnet18 logger=csv")
    printed, figures = execute("fp32_vs_bf16.ipynb")
    result = json.loads((bench / "benchmark.json").read_text())
    assert [r["config"] for r in result["rows"]] == ["fp32", "bf16"]
    assert all(r["status"] == "ok" for r in result["rows"])
    assert "| fp32 |" in printed and "| bf16 |" in printed
    assert figures == 2

    monkeypatch.setenv("RUN_DIR", str(bench / "fp32"))
    printed, figures = execute("my_run.ipynb")
    assert "1 epoch(s)" in printed and figures == 2
