"""What the trainer adds to a bare PyTorch training step: aten ops and tensor->Python conversions (host syncs
on a GPU) per optimizer step, counted, and the time per step. For developers.

    python tools/overhead.py                                   # fp32 and bf16 at the CONFIG defaults
    python tools/overhead.py precisions=bf16 steps=6 rounds=5 image_size=256 encoder_name=resnet34

The trainer's step is train_unet.train_one_epoch (nan_guard, clipping, EMA, schedule); the bare loop runs
forward, loss, backward, optimizer step on the same model, batches and autocast. Other keys: training keys.
"""
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_unet as T  # noqa: E402
from unet_amp import config, precision  # noqa: E402
from unet_amp import model as models  # noqa: E402
from unet_amp.common import run_guarded  # noqa: E402

TOOL_CONFIG = {"precisions": "fp32,bf16", "steps": 4, "rounds": 3}  # rounds: timed, alternating
CONVERSIONS = ("item", "tolist", "__bool__", "__float__", "__int__")  # each reads a tensor on the host


class OpCounter(TorchDispatchMode):
    """Counts every aten op dispatched (forward, backward and optimizer), by name."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class ConversionCounter:
    """Counts calls of torch.Tensor's tensor->Python conversions while active (patched, then put back)."""

    def __enter__(self):
        self.calls, self.saved = Counter(), {name: getattr(torch.Tensor, name) for name in CONVERSIONS}
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, self.wrap(name, method))
        return self

    def wrap(self, name, method):
        def counted(tensor, *args, **kwargs):
            self.calls[name] += 1
            return method(tensor, *args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)


def setup(cfg, hw, dtype):
    """(run, loss, batches) for `dtype` on random data at the config's size."""
    prec = precision.precision_for(dtype, cfg["channels_last"] is True, "overhead")
    n, c, s = cfg["batch_size"], cfg["in_channels"], cfg["image_size"]
    batches = [(torch.randn(n, c, s, s), torch.randint(0, max(2, cfg["num_classes"]), (n, s, s)))
               for _ in range(cfg["steps"])]
    run = T.build_run(cfg, hw, prec, cfg["steps"])
    return run, models.build_loss(cfg, None, hw.device), batches


def bare_loop(run, loss_fn, batches, hw):
    for x, y in batches:
        x, y = T.to_device(x, y, hw, run.prec.channels_last)
        with precision.autocast(run.prec, hw):
            logits = run.model(x)
        loss_fn(logits, y).backward()
        run.optimizer.step()
        run.optimizer.zero_grad(set_to_none=True)


def count(loop, steps):
    """(aten ops per step, conversions per step, the op counts) of loop(), after a warm-up call."""
    loop()
    with ConversionCounter() as conversions, OpCounter() as ops:
        loop()
    return sum(ops.ops.values()) / steps, sum(conversions.calls.values()) / steps, ops.ops


def seconds_per_step(loops, steps, hw, rounds=3):
    """Median seconds per step of each loop, timed in alternating rounds (a busy machine's drift hits all)."""
    times = {name: [] for name in loops}
    for _ in range(rounds):
        for name, loop in loops.items():
            if hw.kind == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            loop()
            if hw.kind == "cuda":
                torch.cuda.synchronize()
            times[name].append((time.perf_counter() - start) / steps)
    return {name: sorted(t)[len(t) // 2] for name, t in times.items()}


def rows_for(dtype, cfg, hw):
    run, loss_fn, batches = setup(cfg, hw, dtype)
    loops = {"trainer": lambda: T.train_one_epoch(run, loss_fn, batches, hw, "overhead"),
             "bare": lambda: bare_loop(run, loss_fn, batches, hw)}
    counts = {name: count(loop, cfg["steps"]) for name, loop in loops.items()}
    seconds = seconds_per_step(loops, cfg["steps"], hw, cfg["rounds"])
    extra = counts["trainer"][2] - counts["bare"][2]
    added = ", ".join(f"{name} {n / cfg['steps']:g}" for name, n in extra.most_common(6))
    return [(f"{dtype} {name}", *counts[name][:2], seconds[name], added if name == "trainer" else "")
            for name in loops]


def run(argv):
    ours = [a for a in argv if a.partition("=")[0] in TOOL_CONFIG]
    opts, _ = config.parse_args(ours, TOOL_CONFIG)
    cfg, _ = config.train_config(T.CONFIG, T.PRESETS, [a for a in argv if a not in ours])
    cfg = {**cfg, "steps": opts["steps"], "rounds": opts["rounds"], "progress": False, "accumulation_steps": 1,
           "batch_size": 8 if cfg["batch_size"] == "auto" else cfg["batch_size"]}
    hw = precision.detect_hardware(precision.resolve_device(cfg["device"]))
    T.seed_everything(cfg["seed"])
    print(f"[overhead] {hw.name} ({hw.kind}); {cfg['arch']}({cfg['encoder_name']}) {cfg['image_size']}px, batch "
          f"{cfg['batch_size']}, {opts['steps']} optimizer steps")
    rows = [row for dtype in str(opts["precisions"]).split(",") for row in rows_for(dtype.strip(), cfg, hw)]
    print("| loop | aten ops/step | tensor->Python/step | ms/step | ops the trainer adds per step (top 6) |")
    print("|---|---|---|---|---|")
    for name, ops, conversions, seconds, added in rows:
        print(f"| {name} | {ops:.0f} | {conversions:g} | {seconds * 1000:.0f} | {added} |")
    return 0


if __name__ == "__main__":
    sys.exit(run_guarded(lambda: run(sys.argv[1:])))
