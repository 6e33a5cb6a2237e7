"""Device, native-precision detection and the one fp32/bf16/fp16 choice, plus the timed CPU probe.

Native means fast kernels: bf16 from Ampere (8.0) or AVX512-BF16/AMX, fp16 from Volta (7.0); fp16 never on a CPU.
"""
from __future__ import annotations

import json
import os
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from unet_amp.common import UserError, atomic_write_json, say

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DTYPE_NAMES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
MIN_CAPABILITY = {torch.bfloat16: (8, 0), torch.float16: (7, 0)}
BF16_CPU_FLAGS = ("avx512_bf16", "amx_bf16")
HIDE_ENV = "UNET_HIDE_NATIVE_BF16"
TF32_VALUES = (None, "highest", "high", "medium")

PROBE_MARGIN = 1.10  # bf16 must beat fp32 by this much: fp32 is the safer mode, small gains are noise
PROBE_ROUNDS = 3
PROBE_MODES = {"fp32": (torch.float32, False), "fp32_cl": (torch.float32, True),
               "bf16": (torch.bfloat16, False), "bf16_cl": (torch.bfloat16, True)}
PROBE_KEYS = ("arch", "encoder_name", "in_channels", "num_classes", "image_size", "batch_size", "loss",
              "compile_model")


# ---------------------------------------------------------------------------------------------------
# Device and hardware
# ---------------------------------------------------------------------------------------------------
def _mps_available():
    mps = getattr(torch.backends, "mps", None)
    return bool(mps and mps.is_available())


def resolve_device(name):
    """'auto' -> cuda, else mps, else cpu; a device that is not here is a UserError."""
    name = str(name or "auto").strip().lower()
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "mps" if _mps_available() else "cpu"
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError):
        raise UserError(f"device={name}: not a device; use auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UserError(f"device={name}: PyTorch sees no CUDA GPU; use device=auto or device=cpu")
        index = device.index if device.index is not None else int(os.environ.get("LOCAL_RANK", 0))
        if index >= torch.cuda.device_count():
            raise UserError(f"device={name}: only {torch.cuda.device_count()} GPU(s) visible; use cuda:0")
        return torch.device("cuda", index)
    if device.type == "mps" and not _mps_available():
        raise UserError(f"device={name}: MPS is not available; use device=auto or device=cpu")
    if device.type not in ("cpu", "mps"):
        raise UserError(f"device={name}: not supported; use auto, cpu, cuda, cuda:N or mps")
    return device


@dataclass
class Hardware:
    device: torch.device
    kind: str                       # "cuda" | "cpu" | "mps"
    name: str
    capability: tuple | None        # CUDA compute capability, e.g. (8, 0)
    bf16_native: bool
    fp16_native: bool
    cpu_flags: set = field(default_factory=set)


def _cpuinfo(key):
    """The value of the first /proc/cpuinfo line named `key`, or ''."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.split(":")[0].strip() == key:
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_flags():
    """The CPU feature words ('flags' on x86, 'Features' on arm64); empty where unknown."""
    return set((_cpuinfo("flags") or _cpuinfo("Features")).split())


def cpu_name():
    return _cpuinfo("model name") or platform.processor() or "CPU"


def native_bf16_hidden():
    """UNET_HIDE_NATIVE_BF16=1 makes a bf16 CPU act as one without (tests, comparisons)."""
    return os.environ.get(HIDE_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def cpu_bf16_native():
    """Real bf16 instructions (AVX512-BF16 or AMX); elsewhere oneDNN emulates bf16, slower than fp32."""
    return not native_bf16_hidden() and any(flag in cpu_flags() for flag in BF16_CPU_FLAGS)


def capability_ok(capability, dtype):
    """Whether a CUDA compute capability has native kernels for `dtype` (bf16 >= 8.0, fp16 >= 7.0)."""
    if dtype == torch.float32:
        return True
    return capability is not None and tuple(capability) >= MIN_CAPABILITY[dtype]


def detect_hardware(device):
    """What `device` (a torch.device or a name) supports natively."""
    device = resolve_device(device) if isinstance(device, str) else device
    if device.type == "cuda":
        index = device.index or 0
        cap = tuple(torch.cuda.get_device_capability(index))
        return Hardware(device, "cuda", torch.cuda.get_device_name(index), cap,
                        capability_ok(cap, torch.bfloat16), capability_ok(cap, torch.float16))
    if device.type == "mps":
        return Hardware(device, "mps", "Apple MPS", None, False, True)
    return Hardware(device, "cpu", cpu_name(), None, cpu_bf16_native(), False, cpu_flags())


# ---------------------------------------------------------------------------------------------------
# Precision
# ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Precision:
    dtype: torch.dtype              # autocast dtype; float32 means autocast off
    channels_last: bool
    reason: str

    @property
    def amp(self):
        return self.dtype != torch.float32

    @property
    def needs_scaler(self):
        return self.dtype == torch.float16

    @property
    def name(self):
        return next(name for name, dtype in DTYPES.items() if dtype == self.dtype)


def precision_for(dtype_name, channels_last, reason):
    """Precision from 'float32'|'bfloat16'|'float16' (or fp32|bf16|fp16)."""
    short = DTYPE_NAMES.get(dtype_name, dtype_name)
    if short not in DTYPES:
        raise UserError(f"amp_dtype={dtype_name}: unknown; use float32, bfloat16 or float16")
    return Precision(DTYPES[short], bool(channels_last), reason)


def autocast(prec, hw):
    """Autocast to prec.dtype on hw's device type; disabled for fp32."""
    return torch.autocast(hw.kind, dtype=prec.dtype, enabled=prec.amp)


def make_scaler(prec, hw):
    """A GradScaler for fp16 (its narrow range needs loss scaling); None otherwise."""
    return torch.amp.GradScaler(hw.kind) if prec.needs_scaler else None


def set_tf32(value):
    """Apply tf32_matmul_precision to matmuls and cuDNN convolutions; None keeps torch's defaults."""
    if value not in TF32_VALUES:
        raise UserError(f"tf32_matmul_precision={value}: unknown; use None, highest, high or medium")
    if value is not None:
        torch.set_float32_matmul_precision(value)
        torch.backends.cudnn.allow_tf32 = value != "highest"


# ---------------------------------------------------------------------------------------------------
# CPU probe: the feature flags say bf16 is native, a few timed steps say whether it is faster here
# ---------------------------------------------------------------------------------------------------
def probe_cache_path():
    """UNET_PROBE_CACHE, else $XDG_CACHE_HOME/unet_amp/cpu_probe.json (default ~/.cache)."""
    if os.environ.get("UNET_PROBE_CACHE"):
        return Path(os.environ["UNET_PROBE_CACHE"])
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "unet_amp" / "cpu_probe.json"


def probe_key(cfg):
    """What a probe's answer depends on: this CPU, torch, and the step's model, size and batch."""
    key = {"cpu": cpu_name(), "hidden": native_bf16_hidden(), "torch": torch.__version__,
           **{k: cfg.get(k) for k in PROBE_KEYS}}
    return json.dumps(key, sort_keys=True, default=str)


def _load_cache(path):
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def time_modes(steps, rounds=PROBE_ROUNDS):
    """Median seconds per call of each step, after one warm-up each, in alternating order per round."""
    for step in steps.values():
        step()
    times, names = {name: [] for name in steps}, list(steps)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            start = time.perf_counter()
            steps[name]()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def choose_mode(times):
    """(dtype name, channels_last): the faster layout of fp32, or of bf16 when PROBE_MARGIN faster."""
    best = {name: min((times[k], k.endswith("_cl")) for k in times if k.split("_")[0] == name)
            for name in ("fp32", "bf16") if name in times}
    bf16 = "bf16" in best and best["fp32"][0] / best["bf16"][0] >= PROBE_MARGIN
    dtype, (_, channels_last) = ("bfloat16", best["bf16"]) if bf16 else ("float32", best["fp32"])
    return dtype, channels_last


def probe_cpu(cfg, build_step, job_steps=None):
    """Time build_step(dtype, channels_last)() per mode (bf16 only where native); cached per CPU and setting. A job
    of fewer steps than the probe takes is not probed: the flag rule's answer, marked skipped."""
    path, key = probe_cache_path(), probe_key(cfg)
    entry = _load_cache(path).get(key)
    if isinstance(entry, dict) and {"dtype", "channels_last", "times"} <= set(entry):
        return {**entry, "cached": True}
    modes = {k: v for k, v in PROBE_MODES.items() if cpu_bf16_native() or v[0] == torch.float32}
    probe_steps = len(modes) * (1 + PROBE_ROUNDS)
    if job_steps is not None and job_steps < probe_steps:
        return {"dtype": "bfloat16" if cpu_bf16_native() else "float32", "channels_last": False,
                "skipped": f"this job's {job_steps} steps are fewer than the probe's {probe_steps}"}
    say("probe: fp32 and bf16 training steps on this CPU (timed once per machine and setting, then cached)")
    with torch.random.fork_rng(devices=[]):  # the run trains the same whether probed or cached
        times = time_modes({k: build_step(*mode) for k, mode in modes.items()})
    dtype, channels_last = choose_mode(times)
    entry = {"dtype": dtype, "channels_last": channels_last, "times": times}
    try:
        atomic_write_json(path, {**_load_cache(path), key: entry})
    except OSError:
        pass  # an unwritable cache costs a probe next time, never the run
    return {**entry, "cached": False}
