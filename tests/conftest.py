"""Shared fixtures for the train_unet.py test suite.

Everything runs on the CPU with tiny data (12 images of 64x64 by default), so the whole suite
stays within a few minutes on a 2-core machine. Tests marked @pytest.mark.cuda run only where a GPU is.
The suite passes on CPUs with and without native bf16: UNET_HIDE_NATIVE_BF16=1 runs it as the latter.
"""
import math
import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import train_unet  # noqa: E402

# One intra-op thread: on a 2-core machine that may be shared with another training process,
# two OpenMP threads oversubscribe the cores and a 64x64 U-Net step goes from ~0.15 s to ~3 s.
# Override with UNET_TEST_THREADS=2 on an idle machine.
torch.set_num_threads(int(os.environ.get("UNET_TEST_THREADS", "1")))


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: takes a minute or more (torch.compile with a cold "
                                       "inductor cache); deselect with -m 'not slow'")
    config.addinivalue_line("markers", "cuda: needs a CUDA GPU; skipped where torch.cuda.is_available() "
                                       "is False, run wherever one is present")
    config.addinivalue_line("markers", "real_cpu_probe: times the CPU probe for real (else its timings "
                                       "are faked by rule_confirming_timings)")


def pytest_collection_modifyitems(config, items):
    # Decided once, before any test monkeypatches torch.cuda.
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
    for item in items:  # the marker, not the keyword: a parameter id "cuda" (a faked device) is a keyword too
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)


def rule_confirming_timings(cfg, hw, labels, kind):
    """Fake CPU-probe seconds per step that agree with the flag rule (bf16 2x fp32; NHWC 1.25x faster
    where decide_channels_last says NHWC, else 1.25x slower): a probe then changes nothing."""
    nhwc = cfg["batch_size"] * cfg["image_size"] ** 2 >= train_unet.CPU_CHANNELS_LAST_MIN_PIXELS
    base = {"fp32": 1.0, "bf16": 0.5}
    return {label: base[label[:4]] * ((0.8 if nhwc else 1.25) if label.endswith("_cl") else 1.0)
            for label in labels}


REAL_MEASURE_CPU_MODES = train_unet.measure_cpu_modes


@pytest.fixture(scope="session", autouse=True)
def hermetic_cpu_probe(tmp_path_factory):
    """For the whole session, set up before any module- or class-scoped fixture trains: the CPU probe's
    timings are faked (rule_confirming_timings) and its cache is a temporary folder, in os.environ, so
    subprocesses (torchrun, notebook kernels, the CLI) inherit it; nothing reads or writes the user's cache.
    Their temporary files go under pytest's own folder too (TMPDIR): torchrun leaves a torchelastic_* folder
    in the temporary folder after every run, and a killed process its pymp-* folder."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache_session")))
        patch.setenv("TMPDIR", str(tmp_path_factory.mktemp("subprocess_tmp")))
        patch.setattr(train_unet, "measure_cpu_modes", rule_confirming_timings)
        yield


@pytest.fixture(autouse=True)
def fake_cpu_probe(request, monkeypatch, tmp_path_factory, hermetic_cpu_probe):
    """Each test starts with an empty CPU-probe cache (a fresh XDG_CACHE_HOME); a test marked
    real_cpu_probe times the probe for real, and caches it however busy the machine running the suite is."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))
    if "real_cpu_probe" in request.keywords:
        monkeypatch.setattr(train_unet, "measure_cpu_modes", REAL_MEASURE_CPU_MODES)
        monkeypatch.setattr(train_unet, "CPU_PROBE_BUSY_SHARE", math.inf)


@pytest.fixture
def make_data(tmp_path):
    """make_data(name="data", count=12, size=64, num_classes=1) -> a fresh shapes data set."""
    def make(name="data", count=12, size=64, num_classes=1, seed=0):
        return train_unet.generate_shapes_dataset(tmp_path / name, count=count, size=size,
                                                  num_classes=num_classes, seed=seed)
    return make


@pytest.fixture
def data_dir(make_data):
    """12 binary 64x64 image/mask pairs in tmp_path/data (10 train / 2 val with the default split)."""
    return make_data()


@pytest.fixture
def make_cfg(tmp_path, data_dir):
    """make_cfg(**overrides) -> a validated tiny config: CONFIG + small, fast, offline settings.

    data_dir and checkpoint_dir always point inside tmp_path.
    """
    def make(**overrides):
        cfg = dict(train_unet.CONFIG)
        cfg.update(
            data_dir=str(data_dir),
            checkpoint_dir=str(tmp_path / "ckpt"),
            image_size=64,
            encoder_name="resnet18",
            encoder_weights=None,
            epochs=1,
            batch_size=4,
            num_workers=0,
            progress=False,
            device="cpu",
            use_amp=False,
            compile_model=False,
            channels_last=False,
            cpu_probe=False,  # the feature-flag rule; tests/test_cpu_probe.py covers the probe
            tf32_matmul_precision=None,
        )
        cfg.update(overrides)
        return train_unet.validate_config(cfg)
    return make


@pytest.fixture
def tiny_cfg(make_cfg):
    """The tiny config with no overrides (fp32, 1 epoch, batch 4, 64x64)."""
    return make_cfg()


@pytest.fixture
def cpu_hw():
    return train_unet.detect_hardware("cpu")


@pytest.fixture
def restore_matmul_precision():
    """Undo global changes made by apply_tf32."""
    before = torch.get_float32_matmul_precision()
    cudnn_tf32 = torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(before)
    torch.backends.cudnn.allow_tf32 = cudnn_tf32


@pytest.fixture
def optimizer_steps(monkeypatch):
    """optimizer_steps(read=lr) -> a list that gets read(param_groups[0]) at every AdamW step, in order."""
    def record(read=lambda group: group["lr"]):
        seen, real = [], torch.optim.AdamW.step

        def step(self, *args, **kwargs):
            seen.append(read(self.param_groups[0]))
            return real(self, *args, **kwargs)
        monkeypatch.setattr(torch.optim.AdamW, "step", step)
        return seen
    return record


@pytest.fixture
def interrupt_at(monkeypatch):
    """interrupt_at(epoch) -> Ctrl-C when `epoch` would start (last.pt then holds the epoch before it);
    returns the real run_epoch, to put back."""
    def interrupt(epoch):
        real = train_unet.run_epoch

        def stop(run, e, *args):
            if e == epoch:
                raise KeyboardInterrupt
            return real(run, e, *args)
        monkeypatch.setattr(train_unet, "run_epoch", stop)
        return real
    return interrupt
