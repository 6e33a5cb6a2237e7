"""What the trainer adds to a bare training step, counted and timed: the check that the trainer runs at a
bare loop's speed. For its developers; the user's script does not need it.

    python tools/overhead.py                                    # fp32, bf16, bf16_cl at the CONFIG defaults
    python tools/overhead.py configs=fp32,bf16 image_size=256 batch_size=8 encoder_name=resnet34

For each configuration (the benchmark's names: BENCHMARK_SETTINGS in train_unet.py), at its precision,
layout and batch:
- Ops/step vs bare: aten ops dispatched per optimizer step, the trainer's (train_one_epoch, with nan_guard,
  clipping and gradient health) over a bare loop's that also clips (bare_training_step). On a GPU nearly
  every op is a kernel launch. Counted, not timed.
- img/s vs bare: the trainer's training pass over the run's own loader against the bare loop over the same
  loader; vs held batch: against the bare loop on a batch held on the device (no data loading). `rounds`
  alternating rounds of `steps` optimizer steps (the order flipping each round, after an untimed round),
  median of the rounds' ratios: side by side, so a shared machine's drift falls on all alike.
Any other key=value is a training config override, as for train_unet.py.
"""
import itertools
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import train_unet  # noqa: E402
from train_unet import (BENCHMARK_SETTINGS, STRICT_FP32, ZERO_GRAD_EVERY, Precision, Run, SegLoss,  # noqa: E402
                        UserError, alternate_timings, apply_tf32, bare_training_step, benchmark_overrides,
                        build_datasets, build_optimizer, build_scaler, build_scheduler, decide_channels_last,
                        decide_precision, describe, detect_hardware, loader_options, markdown_table, normalize_key,
                        parse_overrides, prepare_data, prepare_model, setup_cudnn, skip_reason, to_device,
                        train_one_epoch, user_message, WeightEMA)

OVERHEAD_CONFIG = {
    "configs": "fp32,bf16,bf16_cl",  # names from BENCHMARK_SETTINGS (compiled ones are not counted)
    "steps": 6,                      # optimizer steps per timed round
    "rounds": 5,                     # timed rounds, alternating trainer / bare / held batch
}


def main(argv=None):
    train_unet.keep_freed_memory()  # freed memory kept for reuse, as the script's commands run
    argv = sys.argv[1:] if argv is None else argv
    try:
        rows = run(argv)
    except UserError as exc:
        print(f"error: {user_message(exc)}", file=sys.stderr)
        return 2
    print(format_table(rows))
    return 0


def run(args):
    """{config: its row} for each configuration in configs=..."""
    tool_args = [a for a in args if normalize_key(a.partition("=")[0]) in OVERHEAD_CONFIG]
    opts = parse_overrides(tool_args, defaults=OVERHEAD_CONFIG)
    base = parse_overrides([a for a in args if a not in tool_args])
    names = [n.strip() for n in opts["configs"].split(",") if n.strip()]
    unknown = [n for n in names if n not in BENCHMARK_SETTINGS or "compile" in n]
    if unknown or not names or opts["steps"] < 1 or opts["rounds"] < 1:
        raise UserError(f"configs={opts['configs']!r} (unknown or compiled: {', '.join(unknown) or 'none'}), "
                        f"steps={opts['steps']}, rounds={opts['rounds']}: use names of "
                        f"{', '.join(n for n in BENCHMARK_SETTINGS if 'compile' not in n)}, steps and rounds >= 1")
    hw = detect_hardware(base["device"])
    setup_cudnn(hw)
    apply_tf32(STRICT_FP32["tf32_matmul_precision"], Precision.of(torch.float32, "overhead"))
    pairs = prepare_data(base)
    print(f"[overhead] {describe(hw)}; {base['arch']}({base['encoder_name']}) at {base['image_size']}px, batch "
          f"{base['batch_size']}: {opts['rounds']} rounds of {opts['steps']} steps per configuration", flush=True)
    return {name: overhead_row(name, base, hw, opts, pairs) for name in names}


def overhead_row(name, base, hw, opts, pairs):
    """One configuration's counts and timings, at its precision, layout (auto resolved as a run would)
    and batch; or why it was skipped here."""
    reason = skip_reason(name, base, hw)
    if reason:
        return {"config": name, "status": f"skipped: {reason}"}
    cfg = parse_overrides(benchmark_overrides(name, base), base=base)
    prec = decide_precision(hw, cfg["use_amp"], cfg["amp_dtype"], cfg["force_amp_dtype"])
    cfg = {**cfg, "channels_last": decide_channels_last(cfg, hw, prec)[0]}
    row = {"config": name, "precision": prec.name, "batch": cfg["batch_size"],
           "channels_last": cfg["channels_last"], "status": "ok"}
    return {**row, **measure_overhead(cfg, hw, prec, opts["steps"], opts["rounds"], pairs)}


def format_table(rows):
    header = ("Config", "Precision", "Batch", "NHWC", "Ops/step vs bare", "img/s vs bare", "vs held batch")
    lines = [header]
    for r in rows.values():
        if r["status"] != "ok":
            lines.append((r["config"], "-", "-", "-", "-", "-", r["status"]))
            continue
        lines.append((r["config"], r["precision"], str(r["batch"]), str(r["channels_last"]),
                      f"{r['ops_vs_bare']:.2f}x ({r['ops_per_step']:.0f}/{r['bare_ops_per_step']:.0f})",
                      f"{r['images_per_s_vs_bare']:.2f}x", f"{r['images_per_s_vs_held_batch']:.2f}x"))
    return markdown_table(lines)


def measure_overhead(cfg, hw, prec, steps, rounds, pairs):
    """Trainer vs bare loop at one configuration.

    Ops: aten ops per optimizer step, counted on one held batch (the zero-gradient sampling averaged
    in). Speed: `steps` optimizer steps each of the trainer and of the bare loop, both over the run's
    own loader (its workers, decoding and augmentation), and of the bare loop on a batch held on the
    device (no data loading at all), timed in alternating rounds. img/s vs bare (and vs held batch) is
    the median of the rounds' ratios: side by side, so the machine's drift in speed falls on all alike.
    """
    trainer, bare = step_runners(cfg, hw, prec)
    ops, _ = count_ops_per_step(trainer, steps=ZERO_GRAD_EVERY)
    bare_ops, _ = count_ops_per_step(bare)
    loader = timing_loader(cfg, hw, steps, pairs)  # alternate_timings' untimed round starts its workers
    times = alternate_timings({"trainer": lambda: trainer(steps, loader), "bare": lambda: bare(steps, loader),
                               "held": lambda: bare(steps)}, rounds, hw)
    images = steps * cfg["batch_size"] * cfg["accumulation_steps"]
    ratios = {name: [b / t for b, t in zip(times[name], times["trainer"])] for name in ("bare", "held")}
    speed = {name: images / float(np.median(times[name])) for name in times}
    return {"ops_per_step": ops, "bare_ops_per_step": bare_ops, "ops_vs_bare": ops / bare_ops,
            "trainer_images_per_s": speed["trainer"], "bare_images_per_s": speed["bare"],
            "held_batch_images_per_s": speed["held"], "images_per_s_vs_bare": float(np.median(ratios["bare"])),
            "images_per_s_vs_held_batch": float(np.median(ratios["held"])),
            "round_ratios": ratios["bare"], "held_round_ratios": ratios["held"]}


# Overhead: what the trainer adds to a bare training step, counted (aten ops) and timed.
class OpCounter(TorchDispatchMode):
    """Counts the aten ops dispatched while it is on: {op name: calls} in .ops."""

    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func)] += 1
        return func(*args, **(kwargs or {}))


def count_ops_per_step(run_steps, steps=2):
    """Aten ops dispatched per optimizer step by `run_steps(n)`, a function that runs n steps.

    After a warm-up call, counted with a TorchDispatchMode as (ops of 1 + steps) - (ops of 1 step),
    over `steps`: per-epoch set-up and wrap-up cancel out. On a GPU every op is at least one kernel
    launch. Returns (ops per step, {op: extra per step} for the ops whose count differs).
    """
    run_steps(1)
    counts = []
    for n in (1, 1 + steps):
        with OpCounter() as counter:
            run_steps(n)
        counts.append(counter.ops)
    per_op = {op: (counts[1][op] - counts[0][op]) / steps for op in counts[1] | counts[0]}
    return (sum(counts[1].values()) - sum(counts[0].values())) / steps, {k: v for k, v in per_op.items() if v}


def step_runners(cfg, hw, prec):
    """(trainer, bare): functions that run n optimizer steps on one random batch held on the device,
    through train_one_epoch and through bare_training_step: same model, optimizer, loss, batch,
    precision, layout and clipping. run(n, loader) trains one pass over a real loader instead."""
    cfg = {**cfg, "progress": False}
    size, batch, k = cfg["image_size"], cfg["batch_size"], cfg["accumulation_steps"]
    g = torch.Generator().manual_seed(cfg["seed"])
    x = torch.randn(batch, cfg["in_channels"], size, size, generator=g).to(hw.device)
    y = torch.randint(0, max(2, cfg["num_classes"]), (batch, size, size), generator=g).to(hw.device)
    x = x.contiguous(memory_format=torch.channels_last) if cfg["channels_last"] else x
    runners = []
    for kind in ("trainer", "bare"):
        torch.manual_seed(cfg["seed"])
        model = prepare_model(cfg, hw)
        optimizer = build_optimizer(model, cfg)
        scheduler = build_scheduler(optimizer, cfg, 10**6)
        scaler, loss_fn = build_scaler(prec, hw, cfg), SegLoss(cfg["num_classes"], cfg["loss"])
        if kind == "trainer":
            r = Run(model, model, optimizer, scheduler, scaler, prec, loss_fn=loss_fn,
                    ema=WeightEMA(model, cfg["ema_decay"]))  # as a run's: off unless ema_decay is set

            def run(n, batches=None, r=r):
                train_one_epoch(r, [(x, y)] * (n * k) if batches is None else batches, cfg, hw)
        else:
            def run(n, batches=None, m=model, o=optimizer, sc=scaler, lf=loss_fn):
                for group in bare_groups(n, batches, (x, y), k):
                    group = [to_device(*xy, hw, cfg["channels_last"]) for xy in group]
                    bare_training_step(m, group, lf, o, sc, prec, hw, cfg["grad_clip_norm"])
        runners.append(run)
    return runners


def bare_groups(n, batches, held, k):
    """The bare loop's micro-batch groups: n groups of the held batch, or a loader's batches k at a
    time, as a plain loop over a DataLoader reads them."""
    if batches is None:
        yield from ([held] * k for _ in range(n))
        return
    batches = iter(batches)
    while group := list(itertools.islice(batches, k)):
        yield group


def timing_loader(cfg, hw, steps, pairs):
    """The run's training loader (same data set, transforms and worker settings) over `pairs`
    (prepare_data's), cut to `steps` optimizer steps: its first samples, repeated if the set is
    smaller, in a fixed order."""
    train_pairs, val_pairs = pairs
    train_set, _ = build_datasets(train_pairs, val_pairs[:1], cfg)
    need = steps * cfg["batch_size"] * cfg["accumulation_steps"]
    subset = torch.utils.data.Subset(train_set, [i % len(train_set) for i in range(need)])
    return DataLoader(subset, cfg["batch_size"], drop_last=True, **loader_options(cfg, hw))


if __name__ == "__main__":
    sys.exit(main())
