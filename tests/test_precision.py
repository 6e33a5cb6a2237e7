"""Capability check: what the hardware supports natively, and the bf16 / fp16 / fp32 decision.

CUDA devices are faked with monkeypatch, so these run without a GPU.
"""
import pytest
import torch

import train_unet
from train_unet import UserError, build_scaler, decide_precision, detect_hardware


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu((major, minor)) -> make torch.cuda report one GPU of that compute capability."""
    def install(capability, bf16_supported=None):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
        if bf16_supported is not None:
            monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: bf16_supported)
        return detect_hardware("cuda")
    return install


# ------------------------------------------------------------------------------------------------
# detect_hardware
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("capability, bf16, fp16", [
    ((9, 0), True, True), ((8, 0), True, True), ((8, 6), True, True),
    ((7, 5), False, True), ((7, 0), False, True), ((6, 1), False, False),
])
def test_detect_fake_gpu_flags(fake_gpu, capability, bf16, fp16):
    hw = fake_gpu(capability)
    assert hw.kind == "cuda"
    assert hw.device == "cuda:0"
    assert hw.name == "Fake GPU"
    assert hw.capability == capability
    assert hw.bf16 is bf16
    assert hw.fp16 is fp16


def test_is_bf16_supported_is_not_trusted_on_turing(fake_gpu):
    """torch.cuda.is_bf16_supported() says True on a T4 (7.5), where bf16 is emulated: not native."""
    hw = fake_gpu((7, 5), bf16_supported=True)
    assert hw.bf16 is False
    prec = decide_precision(hw, True, "auto")
    assert prec.dtype == torch.float16 and prec.use_scaler


def test_cuda_without_gpu_is_a_user_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UserError) as info:
        detect_hardware("cuda")
    assert "cuda" in str(info.value) and "\n" not in str(info.value)


def test_cuda_index_out_of_range_is_a_user_error(fake_gpu):
    fake_gpu((8, 0))
    with pytest.raises(UserError) as info:
        detect_hardware("cuda:1")
    assert "cuda:1" in str(info.value)


def test_second_gpu_index_is_used(monkeypatch, fake_gpu):
    fake_gpu((8, 0))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    seen = []
    monkeypatch.setattr(torch.cuda, "get_device_capability",
                        lambda device=None: seen.append(device) or (7, 5))
    hw = detect_hardware("cuda:1")
    assert hw.device == "cuda:1" and seen == [1] and hw.bf16 is False


def test_cpu_flags():
    hw = detect_hardware("cpu")
    assert hw.kind == "cpu" and hw.device == "cpu" and hw.capability is None
    assert (hw.bf16, hw.bf16_feature) == train_unet.cpu_bf16_feature()  # what the probes say on THIS machine
    assert hw.fp16 is False  # CPU fp16 autocast is never treated as native
    assert hw.name


def test_auto_device_without_gpu_is_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    if getattr(torch.backends, "mps", None) is not None:
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    assert detect_hardware("auto").kind == "cpu"


# ------------------------------------------------------------------------------------------------
# decide_precision
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("capability, dtype, use_scaler", [
    ((9, 0), torch.bfloat16, False),
    ((8, 0), torch.bfloat16, False),
    ((7, 5), torch.float16, True),
    ((6, 1), torch.float32, False),
])
def test_auto_choice_on_fake_gpus(fake_gpu, capability, dtype, use_scaler):
    prec = decide_precision(fake_gpu(capability), True, "auto")
    assert prec.dtype == dtype
    assert prec.use_scaler is use_scaler
    assert prec.warning is None
    assert prec.amp is (dtype != torch.float32)
    assert prec.name == {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]


@pytest.mark.parametrize("capability", [(9, 0), (8, 0)])
def test_explicit_choices_honoured_on_ampere(fake_gpu, capability):
    hw = fake_gpu(capability)
    bf16 = decide_precision(hw, True, "bfloat16")
    assert (bf16.dtype, bf16.use_scaler, bf16.warning) == (torch.bfloat16, False, None)
    fp16 = decide_precision(hw, True, "float16")
    assert (fp16.dtype, fp16.use_scaler, fp16.warning) == (torch.float16, True, None)


def test_bfloat16_on_turing_falls_back_to_fp16_with_scaler(fake_gpu):
    prec = decide_precision(fake_gpu((7, 5)), True, "bfloat16")
    assert prec.dtype == torch.float16 and prec.use_scaler is True
    assert prec.warning and "8.0" in prec.warning and "7.5" in prec.warning
    assert "bfloat16" in prec.warning and "\n" not in prec.warning


def test_bfloat16_on_pascal_falls_back_to_fp32(fake_gpu):
    prec = decide_precision(fake_gpu((6, 1)), True, "bfloat16")
    assert prec.dtype == torch.float32 and prec.use_scaler is False and not prec.amp
    assert prec.warning and "8.0" in prec.warning and "float32" in prec.warning


def test_float16_on_pascal_falls_back_to_fp32(fake_gpu):
    prec = decide_precision(fake_gpu((6, 1)), True, "float16")
    assert prec.dtype == torch.float32 and not prec.use_scaler
    assert prec.warning and "7.0" in prec.warning


def test_force_keeps_the_requested_dtype_on_a_gpu(fake_gpu):
    prec = decide_precision(fake_gpu((7, 5)), True, "bfloat16", force=True)
    assert prec.dtype == torch.bfloat16 and prec.use_scaler is False and prec.warning is None


def test_float16_on_cpu_falls_back_with_a_warning(cpu_hw):
    prec = decide_precision(cpu_hw, True, "float16")
    expected = torch.bfloat16 if cpu_hw.bf16 else torch.float32
    assert prec.dtype == expected
    assert prec.use_scaler is False
    assert prec.warning and "float16" in prec.warning and "force_amp_dtype" in prec.warning


def test_float16_on_cpu_forced(cpu_hw):
    prec = decide_precision(cpu_hw, True, "float16", force=True)
    assert prec.dtype == torch.float16 and prec.use_scaler is True and prec.warning is None
    assert "force" in prec.reason


def test_bfloat16_on_cpu_never_falls_back_to_fp16(monkeypatch):
    """A CPU without native bf16 goes to fp32, never to (slow) fp16."""
    monkeypatch.setenv("UNET_HIDE_NATIVE_BF16", "1")
    hw = detect_hardware("cpu")
    assert hw.bf16 is False
    prec = decide_precision(hw, True, "bfloat16")
    assert prec.dtype == torch.float32 and prec.warning
    assert decide_precision(hw, True, "auto").dtype == torch.float32


def test_auto_on_cpu(cpu_hw):
    prec = decide_precision(cpu_hw, True, "auto")
    assert prec.dtype == (torch.bfloat16 if cpu_hw.bf16 else torch.float32)
    assert prec.use_scaler is False


@pytest.mark.parametrize("amp_dtype", ["auto", "bfloat16", "float16"])
@pytest.mark.parametrize("capability", [(9, 0), (7, 5)])
def test_use_amp_false_is_fp32(fake_gpu, capability, amp_dtype):
    prec = decide_precision(fake_gpu(capability), False, amp_dtype, force=True)
    assert prec.dtype == torch.float32 and prec.use_scaler is False and not prec.amp
    assert prec.warning is None


# ------------------------------------------------------------------------------------------------
# build_scaler, apply_tf32, banner
# ------------------------------------------------------------------------------------------------
def test_scaler_only_for_fp16(cpu_hw):
    cfg = dict(train_unet.CONFIG, init_scale=1024.0, growth_interval=7)
    fp16 = decide_precision(cpu_hw, True, "float16", force=True)
    scaler = build_scaler(fp16, cpu_hw, cfg)
    assert isinstance(scaler, torch.amp.GradScaler)
    assert scaler.is_enabled()
    assert scaler.get_scale() == 1024.0          # init_scale from the config
    assert scaler.get_growth_interval() == 7
    bf16 = train_unet.Precision(torch.bfloat16, False, "test")
    fp32 = decide_precision(cpu_hw, False, "auto")
    assert build_scaler(bf16, cpu_hw, cfg) is None
    assert build_scaler(fp32, cpu_hw, cfg) is None


def test_apply_tf32(restore_matmul_precision):
    amp = train_unet.Precision(torch.bfloat16, False, "test")
    fp32 = train_unet.Precision(torch.float32, False, "test")
    warning = train_unet.apply_tf32("high", amp)
    assert warning and "high" in warning and "bf16" in warning
    assert torch.get_float32_matmul_precision() == "high"
    assert train_unet.apply_tf32("high", fp32) is None
    assert train_unet.apply_tf32("medium", fp32) is None
    assert torch.get_float32_matmul_precision() == "medium"
    assert train_unet.apply_tf32(None, amp) is None
    assert torch.get_float32_matmul_precision() == "medium"  # None leaves it alone
    torch.set_float32_matmul_precision("highest")


def test_banner_mentions_precision_scaler_and_warning(cpu_hw):
    cfg = dict(train_unet.CONFIG)
    prec = decide_precision(cpu_hw, True, "float16")  # falls back, with a warning
    text = train_unet.banner(cpu_hw, prec, cfg, [prec.warning, None])
    assert prec.name in text
    assert "GradScaler off" in text
    assert prec.warning in text
    assert "None" not in "".join(l for l in text.splitlines() if l.startswith("note"))

    forced = decide_precision(cpu_hw, True, "float16", force=True)
    text = train_unet.banner(cpu_hw, forced, cfg, [forced.warning])
    assert "fp16" in text and "GradScaler on" in text


def test_banner_on_fake_gpu(fake_gpu):
    hw = fake_gpu((7, 5))
    prec = decide_precision(hw, True, "bfloat16")
    text = train_unet.banner(hw, prec, dict(train_unet.CONFIG), [prec.warning])
    assert "7.5" in text and "Fake GPU" in text
    assert "fp16" in text and "GradScaler on" in text
    assert prec.warning in text


def test_setup_precision_reports_the_fallback(make_cfg, monkeypatch):
    cfg = make_cfg(use_amp=True, amp_dtype="float16")
    _, hw, prec, notes = train_unet.setup_precision(cfg)
    assert hw.kind == "cpu"
    assert prec.dtype != torch.float16
    _, prec, _, _ = train_unet.effective_config(cfg, hw, prec, None, 10, notes)  # noted once the probe settled it
    assert prec.warning and prec.warning in notes


def test_an_amp_dtype_given_with_use_amp_false_is_noted_as_unused(make_cfg, capsys):
    """use_amp=False amp_dtype=bfloat16 trained in fp32 with no word of the amp_dtype (predict notes the keys
    a backend ignores; training said nothing)."""
    cfg = make_cfg(use_amp=False, amp_dtype="bfloat16")
    assert train_unet.unused_amp_dtype(cfg, {"amp_dtype"}) == (
        "amp_dtype=bfloat16 not used: use_amp=False runs in fp32 (give use_amp=True for bfloat16)")
    assert train_unet.unused_amp_dtype(make_cfg(use_amp=False), set()) is None  # auto: nothing given
    assert train_unet.unused_amp_dtype(make_cfg(use_amp=True, amp_dtype="bfloat16"), {"amp_dtype"}) is None
    train_unet.train(cfg)
    assert "amp_dtype=bfloat16 not used: use_amp=False runs in fp32" in capsys.readouterr().out
    train_unet.train({**cfg, "epochs": 2, "resume": True})  # the run's own settings, put back: not said again
    assert "not used" not in capsys.readouterr().out
    base = train_unet.parse_overrides(["amp_dtype=bfloat16"])  # a benchmark's fp32 rows read no amp_dtype
    for row in ("fp32", "tf32", "fp32_cl"):
        assert "amp_dtype=auto" in train_unet.benchmark_overrides(row, base)
