"""unet_amp.precision: native-precision detection (CUDA faked), autocast, scaler, TF32 and the CPU probe."""
import json
import time

import pytest
import torch

from unet_amp import precision as P
from unet_amp.common import UserError


@pytest.fixture
def fake_gpu(monkeypatch):
    """fake_gpu(capability) -> detect_hardware of one faked CUDA GPU of that compute capability."""
    def install(capability):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "Fake GPU")
        return P.detect_hardware(P.resolve_device("cuda"))
    return install


@pytest.fixture
def cache(tmp_path, monkeypatch):
    path = tmp_path / "probe" / "cpu_probe.json"
    monkeypatch.setenv("UNET_PROBE_CACHE", str(path))
    return path


@pytest.fixture
def native(monkeypatch):
    """Make the CPU count as native bf16 whatever it has (and whatever UNET_HIDE_NATIVE_BF16 says)."""
    monkeypatch.setattr(P, "cpu_bf16_native", lambda: True)


@pytest.fixture
def restore_tf32():
    before = torch.get_float32_matmul_precision(), torch.backends.cudnn.allow_tf32
    yield
    torch.set_float32_matmul_precision(before[0])
    torch.backends.cudnn.allow_tf32 = before[1]


CFG = {"arch": "Unet", "encoder_name": "resnet18", "in_channels": 3, "num_classes": 1, "image_size": 64,
       "batch_size": 4, "loss": "ce+dice", "compile_model": False}


@pytest.mark.parametrize("capability, bf16, fp16", [
    ((7, 0), False, True), ((7, 5), False, True), ((8, 0), True, True), ((9, 0), True, True), ((6, 1), False, False),
])
def test_fake_gpu_native_flags(fake_gpu, capability, bf16, fp16):
    hw = fake_gpu(capability)
    assert (hw.kind, hw.name, hw.capability) == ("cuda", "Fake GPU", capability)
    assert hw.device == torch.device("cuda", 0)
    assert (hw.bf16_native, hw.fp16_native) == (bf16, fp16)


def test_capability_ok():
    assert P.capability_ok((8, 0), torch.bfloat16) and not P.capability_ok((7, 5), torch.bfloat16)
    assert P.capability_ok((7, 0), torch.float16) and not P.capability_ok((6, 1), torch.float16)
    assert not P.capability_ok(None, torch.bfloat16) and P.capability_ok(None, torch.float32)


def test_resolve_device(monkeypatch):
    assert P.resolve_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(P, "_mps_available", lambda: False)
    assert P.resolve_device("auto") == torch.device("cpu")
    for bad in ("cuda", "cuda:1", "mps", "gpu", "xla"):
        with pytest.raises(UserError, match="device"):
            P.resolve_device(bad)


def test_cuda_index_beyond_visible_gpus(fake_gpu):
    fake_gpu((8, 0))
    assert P.resolve_device("auto") == torch.device("cuda", 0)
    with pytest.raises(UserError, match="device"):
        P.resolve_device("cuda:1")


def test_cpu_hardware_follows_flags_and_env(monkeypatch):
    monkeypatch.setattr(P, "cpu_flags", lambda: {"avx512f", "amx_bf16"})
    monkeypatch.delenv(P.HIDE_ENV, raising=False)
    hw = P.detect_hardware(torch.device("cpu"))
    assert (hw.kind, hw.bf16_native, hw.fp16_native) == ("cpu", True, False)
    assert "amx_bf16" in hw.cpu_flags
    monkeypatch.setenv(P.HIDE_ENV, "1")
    assert not P.cpu_bf16_native() and not P.detect_hardware("cpu").bf16_native
    monkeypatch.delenv(P.HIDE_ENV)
    monkeypatch.setattr(P, "cpu_flags", lambda: {"avx512f", "avx2"})
    assert not P.cpu_bf16_native()


def test_precision_properties():
    cases = {"float32": ("fp32", False, False), "bfloat16": ("bf16", True, False), "fp16": ("fp16", True, True)}
    for name, (short, amp, scaler) in cases.items():
        prec = P.precision_for(name, True, "test")
        assert (prec.name, prec.amp, prec.needs_scaler, prec.channels_last) == (short, amp, scaler, True)
    with pytest.raises(UserError, match="amp_dtype"):
        P.precision_for("int8", False, "test")


def test_autocast_bf16_on_cpu_makes_bf16_activations():
    hw, layer, x = P.detect_hardware("cpu"), torch.nn.Linear(8, 4), torch.randn(2, 8)
    with P.autocast(P.precision_for("bfloat16", False, "t"), hw):
        assert layer(x).dtype == torch.bfloat16
    with P.autocast(P.precision_for("float32", False, "t"), hw):
        assert layer(x).dtype == torch.float32


def test_make_scaler_only_for_fp16():
    hw = P.detect_hardware("cpu")
    assert P.make_scaler(P.precision_for("float32", False, ""), hw) is None
    assert P.make_scaler(P.precision_for("bfloat16", False, ""), hw) is None
    assert isinstance(P.make_scaler(P.precision_for("float16", False, ""), hw), torch.amp.GradScaler)


def test_set_tf32(restore_tf32):
    before = torch.get_float32_matmul_precision()
    P.set_tf32(None)
    assert torch.get_float32_matmul_precision() == before
    P.set_tf32("highest")
    assert torch.get_float32_matmul_precision() == "highest" and not torch.backends.cudnn.allow_tf32
    P.set_tf32("high")
    assert torch.get_float32_matmul_precision() == "high" and torch.backends.cudnn.allow_tf32
    with pytest.raises(UserError, match="tf32_matmul_precision"):
        P.set_tf32("fast")


def sleeper(seconds, calls):
    """build_step whose step sleeps seconds[(dtype name, channels_last)]; records each build."""
    def build(dtype, channels_last):
        calls.append((dtype, channels_last))
        name = "bf16" if dtype == torch.bfloat16 else "fp32"
        return lambda: time.sleep(seconds[name, channels_last])
    return build


SLOW_BF16 = {("fp32", False): 0.020, ("fp32", True): 0.016, ("bf16", False): 0.0155, ("bf16", True): 0.017}
FAST_BF16 = {("fp32", False): 0.010, ("fp32", True): 0.012, ("bf16", False): 0.006, ("bf16", True): 0.003}


def test_probe_keeps_bf16_only_past_the_margin(cache, native):
    slow = P.probe_cpu(CFG, sleeper(SLOW_BF16, []))  # bf16 1.03x fp32's best: within the margin
    assert (slow["dtype"], slow["channels_last"], slow["cached"]) == ("float32", True, False)
    assert set(slow["times"]) == {"fp32", "fp32_cl", "bf16", "bf16_cl"}
    fast = P.probe_cpu({**CFG, "image_size": 96}, sleeper(FAST_BF16, []))
    assert (fast["dtype"], fast["channels_last"]) == ("bfloat16", True)


def test_probe_cache_is_reused_and_keyed(cache, native):
    calls = []
    first = P.probe_cpu(CFG, sleeper(FAST_BF16, calls))
    assert len(calls) == 4 and cache.exists()
    second = P.probe_cpu(dict(CFG), sleeper(FAST_BF16, calls))
    assert second["cached"] and len(calls) == 4
    assert {k: second[k] for k in ("dtype", "channels_last")} == {k: first[k] for k in ("dtype", "channels_last")}
    P.probe_cpu({**CFG, "image_size": 128}, sleeper(SLOW_BF16, calls))
    assert len(calls) == 8 and len(json.loads(cache.read_text())) == 2


def test_a_job_shorter_than_the_probe_is_not_probed(cache, native):
    calls = []
    short = P.probe_cpu(CFG, sleeper(FAST_BF16, calls), job_steps=15)  # the probe: 4 modes x (1 + 3) steps
    assert short["skipped"] and calls == [] and not cache.exists()
    assert (short["dtype"], short["channels_last"]) == ("bfloat16", False)  # the flag rule's answer
    long = P.probe_cpu(CFG, sleeper(FAST_BF16, calls), job_steps=16)
    assert not long.get("skipped") and len(calls) == 4
    assert P.probe_cpu(CFG, sleeper(FAST_BF16, calls), job_steps=1)["cached"]  # a cached answer costs nothing


def test_probe_without_native_bf16_times_fp32_only(cache, monkeypatch):
    monkeypatch.setattr(P, "cpu_flags", lambda: {"avx512f", "amx_bf16"})
    monkeypatch.setenv(P.HIDE_ENV, "1")
    calls = []
    result = P.probe_cpu(CFG, sleeper(FAST_BF16, calls))
    assert result["dtype"] == "float32" and all(dtype == torch.float32 for dtype, _ in calls)
    monkeypatch.delenv(P.HIDE_ENV)  # the hidden flag is part of the key: a native CPU probes bf16 anew
    assert P.probe_cpu(CFG, sleeper(FAST_BF16, calls))["dtype"] == "bfloat16"


def test_probe_survives_a_corrupt_cache_and_keeps_rng(cache, native):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    result = P.probe_cpu(CFG, lambda dtype, cl: lambda: torch.rand(5))
    assert not result["cached"] and torch.equal(torch.rand(3), expected)
    assert len(json.loads(cache.read_text())) == 1


def test_probe_cache_path_default(monkeypatch, tmp_path):
    monkeypatch.delenv("UNET_PROBE_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert P.probe_cache_path() == tmp_path / "unet_amp" / "cpu_probe.json"
