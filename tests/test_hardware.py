"""Issue 9: the same trainer, right on every machine.

CPU bf16 detection from the real instruction-set probes (faked here for every kind of CPU), the
UNET_HIDE_NATIVE_BF16 switch, the precision and layout decision tables with faked hardware, resume
across hardware, RNG restore over a different GPU count, cuDNN settings, predict's layout, the GPU
check without a GPU; and real CUDA runs, marked `cuda`, wherever a GPU is present.
"""
import dataclasses
import random
import io
import contextlib
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

import train_unet
from train_unet import Hardware, Precision, decide_channels_last, decide_precision

ROOT = Path(__file__).resolve().parents[1]
CPU = Hardware("cpu", "cpu", "Fake CPU", None, bf16=False, fp16=False, bf16_feature="faked")
BF16 = Precision(torch.bfloat16, False, "test")
FP32 = Precision(torch.float32, False, "test")


@pytest.fixture
def fake_cpu(monkeypatch):
    """fake_cpu(machine, amx=, avx512_bf16=, avx512=, flags=) -> cpu_bf16_feature() on that CPU."""
    def install(machine, amx=False, avx512_bf16=False, avx512=False, flags=()):
        monkeypatch.delenv("UNET_HIDE_NATIVE_BF16", raising=False)
        monkeypatch.setattr(train_unet.platform, "machine", lambda: machine)
        monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)
        monkeypatch.setattr(torch.cpu, "_is_avx512_supported", lambda: avx512, raising=False)
        # oneDNN "supports" bf16 on any AVX512 CPU (emulated): it must not decide anything.
        monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: True)
        monkeypatch.setattr(train_unet, "cpu_flags", lambda: set(flags))
        monkeypatch.setattr(train_unet, "macos_has_arm_bf16", lambda: False)
        return train_unet.detect_hardware("cpu")
    return install


# ------------------------------------------------------------------------------------------------
# CPU bf16 detection: the decision table, every case
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("machine, probes, flags, native, feature", [
    ("x86_64", dict(amx=True, avx512_bf16=True, avx512=True), (), True, "AMX"),                 # Sapphire Rapids
    ("x86_64", dict(avx512_bf16=True, avx512=True), (), True, "AVX512-BF16"),                   # Zen 4, Cooper Lake
    ("x86_64", dict(avx512=True), (), False, "AVX512 without AVX512-BF16 or AMX"),              # Skylake..Ice Lake
    ("x86_64", dict(), (), False, "AVX2"),                                                      # Zen 3
    ("aarch64", dict(), ("fp", "asimd", "bf16", "sve"), True, "ARM BF16"),                      # Graviton 3
    ("aarch64", dict(), ("fp", "asimd"), False, "without the BF16 extension"),                  # Graviton 2
    ("riscv64", dict(), (), False, "no known bf16 instructions"),
])
def test_cpu_bf16_decision_table(fake_cpu, machine, probes, flags, native, feature):
    hw = fake_cpu(machine, flags=flags, **probes)
    assert hw.bf16 is native and feature in hw.bf16_feature and hw.fp16 is False
    auto = decide_precision(hw, True, "auto")
    assert auto.dtype == (torch.bfloat16 if native else torch.float32) and not auto.use_scaler
    asked = decide_precision(hw, True, "bfloat16")
    assert asked.dtype == auto.dtype and (asked.warning is None) is native
    if not native:  # the banner says why: the feature that is missing
        assert feature in auto.reason and feature in asked.warning
        text = train_unet.banner(hw, auto, dict(train_unet.CONFIG), [asked.warning])
        assert "native bf16: no" in text and feature in text
    else:
        assert f"native bf16: yes ({feature})" in train_unet.banner(hw, auto, dict(train_unet.CONFIG))


def test_avx512_alone_is_not_native_bf16_even_though_onednn_says_so(fake_cpu):
    hw = fake_cpu("x86_64", avx512=True)
    assert torch.ops.mkldnn._is_mkldnn_bf16_supported() and hw.bf16 is False
    assert decide_precision(hw, True, "auto").dtype == torch.float32


def test_probes_exist_in_this_torch():
    """cpu_bf16_feature guards them with getattr; they exist in the torch this project pins."""
    assert callable(torch.cpu._is_avx512_bf16_supported) and callable(torch.cpu._is_amx_tile_supported)


def test_missing_probes_mean_not_native(monkeypatch):
    monkeypatch.delenv("UNET_HIDE_NATIVE_BF16", raising=False)
    monkeypatch.setattr(train_unet.platform, "machine", lambda: "x86_64")
    for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported", "_is_avx512_supported"):
        monkeypatch.delattr(torch.cpu, name, raising=False)
    assert train_unet.cpu_bf16_feature()[0] is False


def test_hide_switch_hides_native_bf16(fake_cpu, monkeypatch):
    assert fake_cpu("x86_64", amx=True, avx512_bf16=True).bf16
    monkeypatch.setenv("UNET_HIDE_NATIVE_BF16", "1")
    hw = train_unet.detect_hardware("cpu")
    assert hw.bf16 is False and "UNET_HIDE_NATIVE_BF16" in hw.bf16_feature
    prec = decide_precision(hw, True, "auto")
    assert prec.dtype == torch.float32
    assert "hidden by UNET_HIDE_NATIVE_BF16=1" in train_unet.banner(hw, prec, dict(train_unet.CONFIG))
    monkeypatch.setenv("UNET_HIDE_NATIVE_BF16", "0")
    assert train_unet.detect_hardware("cpu").bf16 is True
    for off in ("false", "No", " off ", ""):  # =false hid it, and the banner said "=1"
        monkeypatch.setenv("UNET_HIDE_NATIVE_BF16", off)
        assert train_unet.detect_hardware("cpu").bf16 is True
    monkeypatch.setenv("UNET_HIDE_NATIVE_BF16", "yes")
    assert train_unet.detect_hardware("cpu").bf16_feature == "native bf16 hidden by UNET_HIDE_NATIVE_BF16=yes"


def test_this_machine_decision_is_its_probes():
    """Whatever this CPU is, auto picks bf16 exactly where the probes found native bf16."""
    hw = train_unet.detect_hardware("cpu")
    native, feature = train_unet.cpu_bf16_feature()
    assert (hw.bf16, hw.bf16_feature) == (native, feature)
    assert decide_precision(hw).name == ("bf16" if native else "fp32")


# ------------------------------------------------------------------------------------------------
# channels_last: "auto" and the one decision
# ------------------------------------------------------------------------------------------------
def cfg(**kw):
    return dict(train_unet.CONFIG, **kw)


CUDA80 = Hardware("cuda:0", "cuda", "Fake A100", (8, 0), True, True, "compute capability 8.0")
CUDA75 = Hardware("cuda:0", "cuda", "Fake T4", (7, 5), False, True, "compute capability 7.5 < 8.0")
MPS = Hardware("mps", "mps", "Apple MPS", None, True, True, "macOS 14+")
FP16 = Precision(torch.float16, True, "test")


@pytest.mark.parametrize("hw, prec, settings, expected", [
    (CPU, FP32, dict(image_size=128, batch_size=8), True),     # the default: NHWC won (fp32 and bf16)
    (CPU, BF16, dict(image_size=256, batch_size=8), True),
    (CPU, FP32, dict(image_size=64, batch_size=2), False),     # tiny: NHWC lost (0.66x)
    (CPU, BF16, dict(image_size=64, batch_size=4), False),
    (CPU, FP32, dict(image_size=64, batch_size=8), True),      # the threshold itself
    (CUDA80, BF16, dict(), True), (CUDA75, FP16, dict(), True),  # tensor cores under AMP
    (CUDA80, FP32, dict(), True),                              # TF32 tensor cores
    (CUDA75, FP32, dict(), False),
    (MPS, BF16, dict(), False),
    (CUDA80, BF16, dict(channels_last=False), False),          # an explicit setting always wins
    (CPU, FP32, dict(image_size=32, batch_size=2, channels_last=True), True),
])
def test_channels_last_decision_table(hw, prec, settings, expected):
    on, why = decide_channels_last(cfg(**settings), hw, prec)
    assert on is expected and why
    assert ("auto" in why) == ("channels_last" not in settings)
    text = train_unet.banner(hw, prec, cfg(**settings))
    layout = next(l for l in text.splitlines() if l.startswith("layout"))
    assert layout.split()[1] == ("channels_last" if expected else "contiguous") and why in layout


def test_the_gpu_layout_reason_says_what_the_convolutions_run_in(restore_cudnn):
    """Strict fp32 on an A100 read 'TF32 convolutions on tensor cores want NHWC' beside the banner's 'fp32 means
    strict fp32'; forced bf16 on a Pascal GPU read 'AMP convolutions on tensor cores', which it has none of."""
    pascal = dataclasses.replace(CUDA75, name="Fake P100", capability=(6, 0))
    torch.backends.cudnn.allow_tf32 = True
    assert decide_channels_last(cfg(), CUDA80, FP32)[1] == "auto: TF32 convolutions on tensor cores want NHWC"
    train_unet.apply_tf32("highest", FP32)
    assert decide_channels_last(cfg(), CUDA80, FP32) == (
        True, "auto: strict fp32 (TF32 off) convolutions on this GPU: NHWC by the rule, not measured")
    assert decide_channels_last(cfg(), pascal, BF16) == (
        True, "auto: AMP convolutions on this GPU: NHWC by the rule, not measured")
    assert decide_channels_last(cfg(), CUDA75, FP16)[1] == "auto: AMP convolutions on tensor cores want NHWC"


def test_channels_last_default_is_auto_and_parses_from_the_command_line():
    assert train_unet.CONFIG["channels_last"] == "auto"
    for text, value in (("auto", "auto"), ("true", True), ("False", False), ("on", True), ("0", False)):
        assert train_unet.parse_overrides([f"channels_last={text}"])["channels_last"] == value
    with pytest.raises(train_unet.UserError) as info:
        train_unet.parse_overrides(["channels_last=fast"])
    assert "channels_last" in str(info.value) and "auto" in str(info.value) and "\n" not in str(info.value)
    with pytest.raises(train_unet.UserError):
        train_unet.validate_config(cfg(channels_last="sometimes"))


def test_training_uses_the_auto_layout_and_says_why(make_cfg, capsys):
    cfg_ = make_cfg(image_size=64, batch_size=8, channels_last="auto")  # 32k px per batch: NHWC on a CPU
    result = train_unet.train(cfg_)
    out = capsys.readouterr().out
    layout = next(l for l in out.splitlines() if l.startswith("layout"))
    assert "channels_last (NHWC)" in layout and "auto:" in layout
    state = torch.load(Path(result["checkpoint_dir"]) / "last.pt", weights_only=True)
    assert state["config"]["channels_last"] is True  # what the run used


def test_predict_converts_the_model_with_its_inputs(make_cfg):
    """predict decides the layout for its own machine and batch; model and inputs are converted together
    and the masks equal those of the plain NCHW model."""
    model_cfg = make_cfg(image_size=64)
    model = train_unet.build_model(model_cfg).eval()
    hw, prec = train_unet.detect_hardware("cpu"), FP32
    big, big_cfg = train_unet.predict_layout(train_unet.build_model(model_cfg).eval(), model_cfg,
                                             {"batch_size": 8}, hw, prec)
    big.load_state_dict(model.state_dict())
    assert big_cfg["channels_last"] is True
    assert big.encoder.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    small, small_cfg = train_unet.predict_layout(model, model_cfg, {"batch_size": 1}, hw, prec)
    assert small_cfg["channels_last"] is False
    assert small.encoder.conv1.weight.is_contiguous()
    images = [train_unet.draw_shapes(__import__("numpy").random.default_rng(i), 64, 1)[0] for i in range(2)]
    nhwc = train_unet.predict_batch(big, images, big_cfg, prec, hw)
    nchw = train_unet.predict_batch(small, images, small_cfg, prec, hw)
    for a, b in zip(nhwc, nchw):
        assert (a != b).mean() < 0.01  # same model: masks agree up to float summation order


def test_predict_runs_fp32_as_the_checkpoint_validated_it(make_cfg, tmp_path, restore_cudnn, monkeypatch):
    """A run with tf32_matmul_precision=highest validates in strict fp32; predict left PyTorch's default (TF32
    convolutions on Ampere+), so `predict use_amp=False` did not give the masks its val IoU scored. Both leave
    torch's settings as they found them (a notebook's next cell)."""
    cfg = make_cfg(tf32_matmul_precision="highest")
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's defaults, as a new process starts
    torch.set_float32_matmul_precision("high")
    train_unet.train(cfg)
    assert torch.backends.cudnn.allow_tf32 is True and torch.get_float32_matmul_precision() == "high"
    seen, forward = [], train_unet.eval_forward

    def recorded(*args):
        seen.append((torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision(),
                     train_unet.fp32_math(CUDA80)))
        return forward(*args)
    monkeypatch.setattr(train_unet, "eval_forward", recorded)
    images = sorted((Path(cfg["data_dir"]) / "images").iterdir())[:1]
    train_unet.predict({"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(images[0]),
                        "output": str(tmp_path / "out"), "progress": False, "device": "cpu", "use_amp": False})
    assert seen and set(seen) == {(False, "highest", "strict fp32")}
    assert torch.backends.cudnn.allow_tf32 is True and torch.get_float32_matmul_precision() == "high"


def test_a_run_leaves_torchs_settings_and_rngs_as_it_found_them(make_cfg, restore_cudnn, monkeypatch):
    """A notebook's run with tf32_matmul_precision=medium left it set: the next run trained under it, its banner
    and checkpoint saying 'not set (PyTorch default)'; the run's seed stayed the notebook's too. Threads cut to
    the cores this process may use stay cut: a correction for the machine, not a setting of the run."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(train_unet, "cores_per_process", lambda: 1)  # fit_cpu_threads cuts threads to 1
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    torch.set_float32_matmul_precision("highest")  # PyTorch's default (restore_cudnn puts back the suite's)
    try:
        draws = lambda: (random.random(), float(np.random.rand()), float(torch.rand(1)))  # noqa: E731
        random.seed(7), np.random.seed(7), torch.manual_seed(7)
        expected = draws()
        random.seed(7), np.random.seed(7), torch.manual_seed(7)
        result = train_unet.train(make_cfg(tf32_matmul_precision="medium"))
        assert draws() == expected
        assert torch.get_float32_matmul_precision() == "highest" and torch.get_num_threads() == 1
        assert result["history"]
    finally:
        torch.set_num_threads(threads)
    # a notebook on torch's newer per-backend TF32 API: reading the old one raises there ('mix of the legacy and
    # new APIs'); the run leaves that setting to its caller, and does not stop
    code = ("import torch, train_unet; torch.backends.cuda.matmul.fp32_precision = 'tf32'\n"
            "with train_unet.process_state_kept(): pass\nprint(torch.backends.cuda.matmul.fp32_precision)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(train_unet.__file__).parent)
    assert done.returncode == 0 and done.stdout.strip() == "tf32", done.stderr[-2000:]


# ------------------------------------------------------------------------------------------------
# Resume across hardware, RNG over a different GPU count
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("saved, hw, now, expected", [
    ("bf16", dataclasses.replace(CPU, bf16=True), "fp16", "bf16"),   # same kind of hardware: kept
    ("bf16", CPU, "fp16", "fp32"),                                   # bf16 emulated here: one step safer
    ("bf16", CUDA75, "fp16", "fp32"),                                # a T4: bf16 not native -> fp32
    ("fp32", CUDA80, "bf16", "fp32"),
    ("bf16", CUDA80, "fp32", "fp32"),                                # already safer now: nothing kept
])
def test_keep_safer_precision_on_the_hardware_it_runs_on(saved, hw, now, expected):
    state = {"precision": saved, "fallbacks": [{"event": "went non-finite"}]}
    prec = Precision(train_unet.DTYPES[now], now == "fp16", "decided")
    kept = train_unet.keep_safer_precision(prec, state, hw)
    assert kept.name == expected and kept.use_scaler is False
    if saved != expected and now != expected:
        assert "not native" in kept.reason
    assert train_unet.keep_safer_precision(prec, {**state, "fallbacks": []}, hw) is prec


@pytest.mark.parametrize("saved_gpus, visible", [(4, 2), (1, 2), (2, 2)])
def test_rng_restore_tolerates_a_different_gpu_count(monkeypatch, saved_gpus, visible):
    state = train_unet.rng_state()
    state["cuda"] = [torch.ByteTensor([i]) for i in range(saved_gpus)]
    restored = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda s, device="cuda": restored.append((int(s[0]), device)))
    monkeypatch.setattr(torch.cuda, "set_rng_state_all", lambda states: pytest.fail("would IndexError"))
    train_unet.set_rng_state(state)
    assert restored == [(i, i) for i in range(min(saved_gpus, visible))]


# ------------------------------------------------------------------------------------------------
# CUDA settings: cudnn.benchmark, which fp32
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def restore_cudnn():
    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32, torch.get_float32_matmul_precision())
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.allow_tf32 = saved[:2]
    torch.set_float32_matmul_precision(saved[2])


def test_cudnn_benchmark_on_cuda_only(restore_cudnn):
    torch.backends.cudnn.benchmark = False
    train_unet.setup_cudnn(CPU)
    assert torch.backends.cudnn.benchmark is False
    train_unet.setup_cudnn(CUDA80)
    assert torch.backends.cudnn.benchmark is True
    assert "cudnn.benchmark on" in train_unet.banner(CUDA80, BF16, cfg())
    assert "cudnn.benchmark" not in train_unet.banner(CPU, FP32, cfg())


def test_banner_says_which_fp32(restore_cudnn):
    torch.backends.cudnn.allow_tf32 = True  # PyTorch's default
    assert train_unet.fp32_math(CUDA80) == "tf32"
    assert "fp32 means   tf32 (convolutions in TF32" in train_unet.banner(CUDA80, FP32, cfg())
    train_unet.apply_tf32("highest", FP32)  # what the benchmark's strict fp32 row sets
    assert train_unet.fp32_math(CUDA80) == "strict fp32"
    assert train_unet.fp32_math(CUDA75) == train_unet.fp32_math(CPU) == "strict fp32"
    assert "fp32 means   strict fp32" in train_unet.banner(CPU, FP32, cfg())


def test_compile_on_a_machine_without_a_gpu_does_not_log_torchs_cuda_home_line(monkeypatch, tmp_path):
    """compile_model=True on a CPU where a CUDA toolkit is installed: torch's C++ builder logged 'No CUDA
    runtime is found, using CUDA_HOME=...' in the middle of the first batch's progress bar."""
    import logging
    import torch.utils.cpp_extension as cpp_extension

    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # a toolkit 'installed'
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    logger = logging.getLogger("torch.utils.cpp_extension")
    monkeypatch.setattr(logger, "level", logger.level)  # put back after the test
    seen = []
    handler = logging.Handler()
    handler.emit = seen.append
    logger.addHandler(handler)
    try:
        model = torch.nn.Conv2d(1, 1, 1)
        assert train_unet.compiled(model, False) is model
        compiled = train_unet.compiled(model, True)
        assert compiled is not model and compiled._orig_mod is model
        assert cpp_extension._find_cuda_home() == str(tmp_path)  # what torch's builder asks at the first call
    finally:
        logger.removeHandler(handler)
    assert [r.getMessage() for r in seen if r.levelno >= logging.WARNING] == []


# ------------------------------------------------------------------------------------------------
# The GPU check
# ------------------------------------------------------------------------------------------------
def test_gpu_check_without_cuda_says_so_and_fails(monkeypatch):
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in ([], ["skip=compile"]):  # an explicit list (sys.argv here is pytest's); a valid skip= too
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            assert gpu_check.main(argv) == 1
        message = err.getvalue().strip()
        assert "no CUDA GPU" in message and "\n" not in message


def test_makefile_has_gpu_check():
    text = (ROOT / "Makefile").read_text()
    assert "gpu-check:" in text and "gpu-check" in text.split(".PHONY:")[1].splitlines()[0]
    assert "tools/gpu_check.py" in text


# ------------------------------------------------------------------------------------------------
# Real CUDA: run wherever a GPU is present (skipped elsewhere by the `cuda` marker)
# ------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.parametrize("amp_dtype, expect", [("bfloat16", "bf16"), ("float16", "fp16")])
def test_cuda_training_steps(make_cfg, amp_dtype, expect):
    hw = train_unet.detect_hardware("cuda")
    if not (hw.bf16 if expect == "bf16" else hw.fp16):
        pytest.skip(f"{expect} is not native on {hw.name}")
    result = train_unet.train(make_cfg(device="cuda", use_amp=True, amp_dtype=amp_dtype, channels_last="auto"))
    row = result["history"][-1]
    assert result["precision"] == expect and row["peak_mem_kind"] == "cuda_max_allocated"
    assert (row["scaler_scale"] is not None) == (expect == "fp16")
    assert row["train_loss"] == row["train_loss"]  # finite
    assert torch.backends.cudnn.benchmark is True


@pytest.mark.cuda
def test_cuda_predict(make_cfg, tmp_path):
    cfg_ = make_cfg(device="cuda", use_amp=True)
    train_unet.train(cfg_)
    out = train_unet.predict({"checkpoint": str(Path(cfg_["checkpoint_dir"]) / "best.pt"),
                              "input": str(Path(cfg_["data_dir"]) / "images"), "output": str(tmp_path / "p"),
                              "device": "cuda", "progress": False})
    assert out["predicted"] > 0 and not out["failed"]


@pytest.mark.cuda
@pytest.mark.slow
def test_gpu_check_passes_on_a_gpu():
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "gpu_check.py")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all checks passed" in proc.stdout


def test_gpu_check_records_the_benchmarks_inference_table(tmp_path):
    """gpu-check runs the benchmark's inference table (issue 24's figures for a GPU): run here on the CPU
    at tiny sizes; on a GPU it takes INFERENCE_ARGS, which the benchmark accepts as they are."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    train_unet.parse_benchmark_args(list(gpu_check.INFERENCE_ARGS))
    train_unet.generate_shapes_dataset(tmp_path / "shapes", count=12, size=32)
    hw = train_unet.detect_hardware("cpu")
    args = ("configs=fp32", "epochs=1", "bare_steps=0", "inference=fp32,bf16_cl", "inference_size=96",
            "inference_images=4", "inference_rounds=1", "image_size=32", "batch_size=2", "max_train_images=8",
            "encoder_name=resnet18", "cpu_probe=False")
    detail = gpu_check.check_inference(hw, tmp_path, args)
    first, *table = detail.splitlines()
    assert "fp32 fit " in first and "fp32 patch " in first and ("bf16_cl patch " in first) == hw.bf16
    assert any("| Masks = fp32's" in line for line in table)
    assert table[-1].strip().startswith("command: python train_unet.py benchmark configs=fp32")
    assert (tmp_path / "benchmark" / "inference" / "inference.json").is_file()


def test_gpu_check_trains_fp32_on_a_gpu_without_fast_half_precision(monkeypatch, tmp_path):
    """A Pascal GPU (capability 6.1): the fp32 training check (torch.compile at auto's fp32) was skipped as
    "fp32 is not native", so no best.pt existed and the predict checks failed: exit 1 on a working GPU."""
    sys.path.insert(0, str(ROOT / "tools"))
    import gpu_check

    pascal = types.SimpleNamespace(bf16=False, fp16=False, device="cuda", bf16_feature="compute capability 6.1")
    class Trained(Exception):
        pass

    def train(cfg):
        raise Trained  # it got as far as training; the stand-in stops it there
    monkeypatch.setattr(gpu_check, "quiet_train", train)
    with pytest.raises(Trained):
        gpu_check.check_train(pascal, tmp_path, "auto", "fp32")
    assert gpu_check.check_train(pascal, tmp_path, "bfloat16", "bf16").startswith("skipped: bf16 is not native")
    # ... and that run comes before the checks that need its best.pt (a reordering once put it after them)
    names = [name for name, _ in gpu_check.CHECKS]
    needs_best = min(names.index("predict"), names.index("sliding window (patch mode)"))
    assert names.index("torch.compile (bf16/auto)") < needs_best
