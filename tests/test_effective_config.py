"""Issue 20, items 1, 5, 6, 7: the effective config is settled before anything is decided from it
(batch_size=auto and the kept precision before the layout), batch-size trials with a clean GradScaler,
no float64 on MPS, and torchrun's start-up check shared by the ranks without the collective timeout.
GPUs, MPS and torchrun are faked on the CPU."""
import datetime
import json
import math
import os
import socket
import time
import traceback
import weakref
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves

import train_unet
from train_unet import Hardware, Precision


class StopAfterBanner(Exception):
    """Raised by a stubbed announce_run: the test has what it needs, no training."""


def train_until_announced(cfg, monkeypatch):
    """train(cfg) up to announce_run: returns the config it would save and the precision it runs in."""
    seen = {}

    def announce(cfg, hw, run, sizes, extra):
        seen.update(cfg=cfg, prec=run.prec)
        raise StopAfterBanner
    monkeypatch.setattr(train_unet, "announce_run", announce)
    with pytest.raises(StopAfterBanner):
        train_unet.train(cfg)
    return seen


# ---------------------------------------------------------------------------------------------------
# 1. batch_size=auto with channels_last=auto on a CPU: the layout is decided from the resolved batch
# ---------------------------------------------------------------------------------------------------
def test_auto_batch_and_auto_layout_on_a_cpu(make_cfg, capsys):
    cfg = make_cfg(batch_size="auto", channels_last="auto")
    result = train_unet.train(cfg)
    out = capsys.readouterr().out
    batch = train_unet.AUTO_BATCH_FALLBACK
    assert f"batch        auto -> {batch}: needs a CUDA GPU" in out
    # 8 x 64 x 64 pixels per batch is where NHWC pays off on a CPU: the decision saw the resolved 8
    expected = batch * cfg["image_size"] ** 2 >= train_unet.CPU_CHANNELS_LAST_MIN_PIXELS
    assert f"at batch {batch} x {cfg['image_size']}px" in out
    saved = json.loads((Path(cfg["checkpoint_dir"]) / "config.json").read_text())["config"]
    assert saved["batch_size"] == batch and saved["channels_last"] is expected
    assert len(result["history"]) == 1


def test_effective_config_resolves_batch_then_layout(make_cfg, cpu_hw):
    cfg = make_cfg(batch_size="auto", channels_last="auto", image_size=32)
    prec = train_unet.decide_precision(cpu_hw, use_amp=False)
    notes = []
    out, used, (layout, why), auto = train_unet.effective_config(cfg, cpu_hw, prec, None, 100, notes)
    assert used is prec
    assert out["batch_size"] == train_unet.AUTO_BATCH_FALLBACK and auto["requested"] == "auto"
    assert out["channels_last"] is layout is False  # 8 x 32 x 32 is below the CPU's NHWC line
    assert "batch 8 x 32px is too small" in why


# ---------------------------------------------------------------------------------------------------
# 17. A resumed run's kept fp32 decides the layout (pre-Ampere GPU: no tensor cores for fp32)
# ---------------------------------------------------------------------------------------------------
def test_layout_follows_the_precision_kept_on_resume(make_cfg, monkeypatch, capsys):
    cfg = make_cfg(epochs=1)
    train_unet.train(cfg)
    last = Path(cfg["checkpoint_dir"]) / "last.pt"
    state = torch.load(last, weights_only=False)
    state["precision"] = "fp32"  # as if the run had fallen back from fp16
    state["fallbacks"] = [{"epoch": 1, "step": 3, "from": "fp16", "to": "fp32",
                           "event": "fp16 went non-finite at step 3: falling back to fp32"}]
    torch.save(state, last)
    capsys.readouterr()

    # A T4 (7.5): native fp16, no bf16, no TF32 tensor cores. Tensors stay on the CPU.
    t4 = Hardware("cpu", "cuda", "Fake T4", (7, 5), bf16=False, fp16=True, bf16_feature="compute capability 7.5")
    monkeypatch.setattr(train_unet, "detect_hardware", lambda device="auto": t4)
    monkeypatch.setattr(torch.backends.cudnn, "benchmark", torch.backends.cudnn.benchmark)  # restored after
    seen = train_until_announced({**cfg, "resume": True, "epochs": 2, "use_amp": True, "amp_dtype": "auto",
                                  "channels_last": "auto"}, monkeypatch)
    banner = capsys.readouterr().out
    assert seen["prec"].name == "fp32" and "kept from the checkpoint" in banner
    assert seen["cfg"]["channels_last"] is False
    assert "contiguous (NCHW) (auto: fp32 without tensor cores gains nothing from NHWC)" in banner
    assert "AMP convolutions" not in banner


# ---------------------------------------------------------------------------------------------------
# 5. batch_size=auto with fp16: an OOM after unscale_() does not break the next trial
# ---------------------------------------------------------------------------------------------------
def test_batch_trials_survive_an_oom_after_unscale(make_cfg, cpu_hw, monkeypatch):
    cfg = make_cfg(batch_size="auto", image_size=32, grad_clip_norm=None)
    fp16 = Precision(torch.float16, True, "fp16 + GradScaler (test)")
    assert train_unet.build_scaler(fp16, cpu_hw, cfg).is_enabled()  # a real GradScaler("cpu")
    tried, real_trial, real_norm = [], train_unet.batch_trial, torch.nn.utils.get_total_norm

    def trial(model, optimizer, loss_fn, scaler, prec, hw, cfg, n):
        tried.append(n)
        return real_trial(model, optimizer, loss_fn, scaler, prec, hw, cfg, n)

    def norm_then_oom(grads, *args, **kwargs):  # runs right after scaler.unscale_() in optimizer_step
        if tried[-1] > 3:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (faked after unscale_)")
        return real_norm(grads, *args, **kwargs)
    monkeypatch.setattr(train_unet, "batch_trial", trial)
    monkeypatch.setattr(torch.nn.utils, "get_total_norm", norm_then_oom)
    largest, use = train_unet.find_batch_size(cfg, cpu_hw, fp16, cap=16)
    assert tried == [2, 4, 3] and largest == 3  # 4 ran out of memory mid-step; 3 was still measured


# ---------------------------------------------------------------------------------------------------
# 6. MPS has no float64: nothing the step, the metrics or the logging keep on the device is float64
# ---------------------------------------------------------------------------------------------------
class FakeMPS(TorchDispatchMode):
    """Runs code written for device "mps" on the CPU. A factory or .to() for "mps" makes a CPU tensor
    tagged as on MPS; any op with a tagged input makes tagged outputs (an explicit device, as .cpu()
    gives, does not). Records every float64 tensor made on the fake MPS device."""

    def __init__(self):
        super().__init__()
        self.tagged, self.float64 = weakref.WeakValueDictionary(), []  # id -> tensor

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None:
            on_mps = torch.device(device).type == "mps"
            if on_mps:
                kwargs["device"] = torch.device("cpu")
        else:
            on_mps = any(self.on_mps(t) for t in tree_leaves((args, kwargs)))
        out = func(*args, **kwargs)
        if on_mps:
            self.tag(out, func)
        return out

    def on_mps(self, t):
        return isinstance(t, torch.Tensor) and self.tagged.get(id(t)) is t

    def tag(self, out, why="to"):
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self.tagged[id(t)] = t
                if t.dtype == torch.float64:
                    where = [f for f in traceback.extract_stack() if f.filename.endswith("train_unet.py")]
                    self.float64.append(f"{why} in {where[-1].name}:{where[-1].lineno}" if where else str(why))
        return out


@pytest.fixture
def fake_mps(monkeypatch):
    """(mode, Hardware): MPS faked on the CPU; Tensor.to(mps) is checked before any dispatch mode sees
    it (PyTorch without MPS refuses it), so it is redirected here."""
    mode, real_to = FakeMPS(), torch.Tensor.to

    def to(self, *args, **kwargs):
        parse = {k: v for k, v in kwargs.items() if k != "copy"}  # _parse_to knows no copy=
        device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*args, **parse)
        if device is None or device.type not in ("mps", "cpu") or not (device.type == "mps" or mode.on_mps(self)):
            return real_to(self, *args, **kwargs)
        with _disable_current_modes():  # a copy, as a real move between devices makes
            out = real_to(self, "cpu", dtype or self.dtype, non_blocking, True,
                          memory_format=memory_format or torch.preserve_format)
        return mode.tag(out, "Tensor.to") if device.type == "mps" else out
    monkeypatch.setattr(torch.Tensor, "to", to)
    monkeypatch.setattr(torch.Tensor, "cpu", lambda self, *args, **kwargs: to(self, "cpu"))
    return mode, Hardware("mps", "mps", "Fake MPS", None, bf16=False, fp16=True, bf16_feature="faked")


class Writer:
    def add_scalar(self, *args):
        pass

    def flush(self):
        pass


@pytest.mark.parametrize("amp, nan_guard", [(False, True), (True, True), (True, False)],
                         ids=["fp32", "fp16-guard", "fp16-no-guard"])
def test_nothing_float64_on_mps(make_cfg, fake_mps, amp, nan_guard):
    mode, hw = fake_mps
    # progress=True: the progress bar's figures too (the first batch refreshes it)
    cfg = make_cfg(image_size=32, batch_size=2, nan_guard=nan_guard, max_train_images=4, progress=True)
    prec = Precision(torch.float16, True, "fp16 (test)") if amp else Precision(torch.float32, False, "fp32")
    train_pairs, val_pairs = train_unet.prepare_data(cfg)
    train_loader, val_loader = train_unet.build_loaders(train_pairs, val_pairs, cfg, hw)
    loss_fn = train_unet.SegLoss(cfg["num_classes"], cfg["loss"])
    with mode:
        model = train_unet.prepare_model(cfg, hw)
        for t in [*model.parameters(), *model.buffers()]:
            mode.tag(t)
        optimizer, scaler = train_unet.build_optimizer(model, cfg), train_unet.build_scaler(prec, hw, cfg)
        scheduler = train_unet.build_scheduler(optimizer, cfg, len(train_loader))
        logger = train_unet.RunLogger()
        logger.writer = Writer()
        run = train_unet.Run(model, model, optimizer, scheduler, scaler, prec, logger=logger, loss_fn=loss_fn)
        out = train_unet.train_one_epoch(run, train_loader, cfg, hw)
        logger.flush_steps()
        val = train_unet.evaluate(model, val_loader, loss_fn, prec, hw, cfg)
    assert mode.tagged, "the fake saw no MPS tensor: it tested nothing"
    assert mode.float64 == [], f"float64 tensors made on MPS by: {sorted(set(mode.float64))}"
    assert out["stats"].optimizer_steps == 2 and math.isfinite(out["loss"]) and 0 <= val["iou"] <= 1


def test_sums_stay_float64_off_mps(make_cfg, cpu_hw):
    """CPU (and CUDA) keep float64 running sums: their results do not change."""
    assert train_unet.sum_dtype(cpu_hw.device) == torch.float64 == train_unet.sum_dtype("cuda:0")
    assert train_unet.sum_dtype("mps") == torch.float32
    health = train_unet.GradHealth("cpu")
    for norm in (1.0, 1e-9):
        health.record(train_unet.StepResult(torch.tensor(norm), True, zeros=torch.tensor(3), elems=10))
    stats = health.stats()
    assert stats.grad_norm_sum == 1.0 + 1e-9  # float32 would lose the second step
    assert (stats.zero_grad_elems, stats.grad_elems) == (6, 20)


# ---------------------------------------------------------------------------------------------------
# 7. torchrun: start-up work longer than the default group's timeout (NCCL's watchdog: 10 minutes)
# ---------------------------------------------------------------------------------------------------
DEFAULT_TIMEOUT_S = 3   # the default process group's timeout in this test (NCCL's is 10 minutes)
SLOW_FILE_S = 1.0       # per decoded file; 4 threads: 12 pairs take 6 s on one rank, 3 s on each of two


def start_up_in_rank(rank, world, port, root, out):
    """One torchrun rank (spawned): join the group with a short default timeout, then prepare_data on a
    first run of the embedded data set (rank 0 writes it, slowly) with slow decoding."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    init = torch.distributed.init_process_group
    torch.distributed.init_process_group = lambda backend, **kw: init(
        backend, timeout=datetime.timedelta(seconds=DEFAULT_TIMEOUT_S))
    train_unet.setup_distributed("cpu")
    decoded = []

    def slow(decode):
        def run(path, *args):
            decoded.append(path)
            time.sleep(SLOW_FILE_S)
            return decode(path, *args)
        return run
    train_unet.decode_image, train_unet.decode_mask = slow(train_unet.decode_image), slow(train_unet.decode_mask)
    train_unet.EMBEDDED_DATA_DIR = str(root / "shapes")

    def write_embedded(folder):
        time.sleep(DEFAULT_TIMEOUT_S + 2)
        train_unet.generate_shapes_dataset(folder, count=12, size=32)
    train_unet.write_embedded_dataset = write_embedded
    cfg = {**train_unet.CONFIG, "data_dir": str(root / "shapes"), "checkpoint_dir": str(root / "ckpt"),
           "image_size": 32, "batch_size": 2}
    first = train_unet.prepare_data(cfg)
    start = len(decoded)
    again = train_unet.prepare_data(cfg)  # the cache written by rank 0 is read by every rank
    (out / f"{rank}.json").write_text(json.dumps({"decoded": decoded[:start], "again": decoded[start:],
                                                  "first": first, "second": again}, default=str))
    train_unet.cleanup_distributed()


def test_torchrun_start_up_outlasts_the_default_timeout(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = torch.multiprocessing.start_processes(start_up_in_rank, (2, port, tmp_path, tmp_path), nprocs=2,
                                                join=False, start_method="spawn")
    deadline = time.monotonic() + 240
    while not ctx.join(timeout=5):  # raises if a rank failed (old code: a barrier timed out)
        assert time.monotonic() < deadline, "the ranks did not finish"
    ranks = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["first"] == ranks[1]["first"] == ranks[0]["second"] == ranks[1]["second"]
    files = {p for pair in ranks[0]["first"][0] + ranks[0]["first"][1] for p in pair}
    decoded = [set(r["decoded"]) for r in ranks]
    assert len(files) == 24 and decoded[0] | decoded[1] == {os.path.abspath(p) for p in files}
    assert not decoded[0] & decoded[1] and len(decoded[0]) == len(decoded[1]) == 12  # each its share, once
    assert ranks[0]["again"] == ranks[1]["again"] == []  # the second start-up only reads the cache
    cache = json.loads((tmp_path / "shapes" / train_unet.CHECK_CACHE_NAME).read_text())
    assert len(cache["files"]) == 24
