"""Trainer overhead made visible on the CPU (issue 10): aten ops per optimizer step against a bare
loop, and tensor->Python conversions (device->host syncs on a GPU) per micro-batch and per step.

Nothing here is timed: the machine is shared and noisy. Ops and conversions are counted.
"""
import contextlib
import sys
from pathlib import Path

import pytest
import torch

import train_unet
from train_unet import decide_precision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
import overhead  # noqa: E402  (tools/overhead.py: the trainer's and the bare loop's runners, the op count)
from overhead import count_ops_per_step, step_runners  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")

CONVERSIONS = ("item", "__float__", "__int__", "__bool__", "tolist")


def tiny(**overrides):
    cfg = dict(train_unet.CONFIG, image_size=32, batch_size=2, device="cpu", progress=False,
               encoder_name="resnet18", encoder_weights=None)
    cfg.update(overrides)
    return train_unet.validate_config(cfg)


def precision(hw, name):
    if name == "fp32":
        return decide_precision(hw, use_amp=False)
    # force: no assumption about native bf16 on this CPU (tiny sizes keep emulated bf16 affordable)
    return decide_precision(hw, True, {"bf16": "bfloat16", "fp16": "float16"}[name], force=True)


@contextlib.contextmanager
def counting_conversions():
    """Record every Tensor.item/__float__/__int__/__bool__/tolist call, with who made it.

    torch.optim reads its own `step` counters with .item(): those tensors stay on the CPU even when
    the model is on a GPU (non-capturable optimizers), so they are not device syncs and are left out.
    """
    calls = []

    def wrap(name, original):
        def counted(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if "torch/optim/" not in caller.replace("\\", "/"):
                calls.append((name, caller))
            return original(self, *args, **kwargs)
        return counted

    with pytest.MonkeyPatch.context() as mp:
        for name in CONVERSIONS:
            mp.setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
        yield calls


def conversions_per_step(run_steps, steps=3):
    """(conversions of 1 + steps) - (conversions of 1 step), per step, after a warm-up call."""
    run_steps(1)
    counts = []
    for n in (1, 1 + steps):
        with counting_conversions() as calls:
            run_steps(n)
        counts.append(calls)
    return (len(counts[1]) - len(counts[0])) / steps, counts[1]


@pytest.mark.parametrize("name", ["fp32", "bf16", "fp16"])
def test_nan_guard_costs_at_most_one_sync_per_optimizer_step(cpu_hw, name):
    cfg = tiny(nan_guard=True, accumulation_steps=2)  # two micro-batches per step: none of their own
    trainer, _ = step_runners(cfg, cpu_hw, precision(cpu_hw, name))
    per_step, calls = conversions_per_step(trainer)
    assert per_step <= 1, calls


@pytest.mark.parametrize("name", ["fp32", "bf16"])
def test_without_nan_guard_training_steps_never_sync(cpu_hw, name):
    cfg = tiny(nan_guard=False, accumulation_steps=2)
    trainer, _ = step_runners(cfg, cpu_hw, precision(cpu_hw, name))
    per_step, calls = conversions_per_step(trainer)
    assert per_step == 0, calls


def test_an_epoch_reads_back_only_at_its_end(cpu_hw):
    """progress=False: besides the guard's one read per step, a fixed few reads at the epoch's end
    (loss, metric, gradient health), however long the epoch."""
    cfg = tiny(nan_guard=True)
    trainer, _ = step_runners(cfg, cpu_hw, precision(cpu_hw, "fp32"))
    trainer(1)
    totals = []
    for steps in (2, 5):
        with counting_conversions() as calls:
            trainer(steps)
        totals.append(len(calls))
    assert totals[1] - totals[0] == 3  # exactly the guard's read on each of the 3 extra steps
    assert totals[0] - 2 <= 10  # loss, IoU/Dice, gradient health: once per epoch


def test_validation_batches_never_sync(cpu_hw):
    cfg = tiny()
    model = train_unet.prepare_model(cfg, cpu_hw)
    prec, loss_fn = precision(cpu_hw, "fp32"), train_unet.SegLoss(1)
    g = torch.Generator().manual_seed(0)
    batch = (torch.randn(2, 3, 32, 32, generator=g), torch.randint(0, 2, (2, 32, 32), generator=g))

    def validate(n):
        return train_unet.evaluate(model, [batch] * n, loss_fn, prec, cpu_hw, cfg)
    per_batch, calls = conversions_per_step(validate)
    assert per_batch == 0, calls


def test_segmetric_update_never_syncs():
    """torch.bincount reads its input's min and max back to the host (inside C++, so no Python
    conversion shows it): the update must dispatch no op that syncs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))
    metric, ops = train_unet.SegMetric(3), []
    logits, target = torch.randn(2, 3, 8, 8), torch.randint(0, 3, (2, 8, 8))
    target[0, 0] = train_unet.IGNORE_INDEX
    with counting_conversions() as calls, Record():
        metric.update(logits, target)
    assert calls == []
    syncing = ("bincount", "nonzero", "_local_scalar_dense", "masked_select", "unique", "histc")
    assert not [op for op in ops if any(s in op for s in syncing)], ops
    assert int(metric.matrix.sum()) == target.numel() - 8  # the ignored row is not counted


@pytest.mark.parametrize("name,size,batch", [("fp32", 64, 4), ("bf16", 32, 2)])
def test_trainer_ops_per_step_within_5_percent_of_a_bare_loop(cpu_hw, name, size, batch):
    """The defaults' safety features on (nan_guard, clipping, gradient health with its sampled
    zero-gradient count), against a bare loop that also clips."""
    cfg = tiny(image_size=size, batch_size=batch)
    assert cfg["nan_guard"] and cfg["grad_clip_norm"] is not None
    trainer, bare = step_runners(cfg, cpu_hw, precision(cpu_hw, name))
    ops, trainer_ops = count_ops_per_step(trainer, steps=train_unet.ZERO_GRAD_EVERY)
    bare_ops, bare_by_op = count_ops_per_step(bare)
    extra = {op: n - bare_by_op.get(op, 0) for op, n in trainer_ops.items() if n != bare_by_op.get(op, 0)}
    assert ops <= 1.05 * bare_ops, (ops, bare_ops, sorted(extra.items(), key=lambda kv: -kv[1])[:10])


def test_bare_loop_over_a_loader_steps_every_k_batches_in_the_runs_layout(cpu_hw, monkeypatch):
    """The bare reference loop over a real loader reads it as a plain PyTorch loop would: k batches
    per optimizer step (the last group of a pass may be short), moved to the device in the run's
    layout; without a loader it repeats its held batch."""
    cfg = tiny(accumulation_steps=2, channels_last=True)
    _, bare = step_runners(cfg, cpu_hw, precision(cpu_hw, "fp32"))
    groups = []
    monkeypatch.setattr(overhead, "bare_training_step", lambda model, group, *args: groups.append(group))
    batches = [(torch.full((2, 3, 32, 32), float(i)), torch.zeros(2, 32, 32, dtype=torch.long)) for i in range(5)]
    bare(3, batches)
    assert [[x[0, 0, 0, 0].item() for x, _ in g] for g in groups] == [[0, 1], [2, 3], [4]]
    assert all(x.is_contiguous(memory_format=torch.channels_last) for g in groups for x, _ in g)
    groups.clear()
    bare(3)
    assert [len(g) for g in groups] == [2, 2, 2] and all(g[0][0] is g[1][0] for g in groups)


def test_count_ops_per_step_counts_per_step_work():
    x = torch.ones(3)

    def run(n):
        x.sum()  # once per call: set-up, not per step
        for _ in range(n):
            (x * 2).add_(1)
    ops, by_op = count_ops_per_step(run, steps=4)
    assert ops == 2
    assert by_op == {"aten.mul.Tensor": 1, "aten.add_.Tensor": 1}


# ---------------------------------------------------------------------------------------------------
# On a GPU: the step path under CUDA's sync debug mode, with the guard's one read allowed
# ---------------------------------------------------------------------------------------------------
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("nan_guard", [True, False])
def test_cuda_training_and_validation_steps_do_not_sync(monkeypatch, nan_guard):
    hw = train_unet.detect_hardware("cuda")
    cfg = tiny(device="cuda", nan_guard=nan_guard, accumulation_steps=2)
    prec = decide_precision(hw, True, "auto")
    allowed = []

    def allow(fn, record=None):
        def call(*args, **kwargs):
            mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode(0)
            try:
                if record is not None:
                    record.append(1)
                return fn(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(mode)
        return call
    monkeypatch.setattr(train_unet, "host_flags", allow(train_unet.host_flags, allowed))
    # The first thing after each loop is a deliberate read-back: the epoch's end may sync.
    monkeypatch.setattr(train_unet, "synchronize", allow(train_unet.synchronize))
    monkeypatch.setattr(train_unet, "all_reduce_", allow(train_unet.all_reduce_))
    trainer, _ = step_runners(cfg, hw, prec)
    trainer(1)  # warm-up: lazy optimizer state, cuDNN autotuning
    allowed.clear()
    torch.cuda.set_sync_debug_mode("error")
    try:
        trainer(3)
        model = train_unet.prepare_model(cfg, hw)
        x, y = torch.randn(2, 3, 32, 32, device="cuda"), torch.randint(0, 2, (2, 32, 32), device="cuda")
        train_unet.evaluate(model, [(x, y)] * 3, train_unet.SegLoss(1), prec, hw, cfg)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(allowed) == (3 if nan_guard else 0)


def test_optimizer_is_fused_and_steps_like_adamw():
    """AdamW is fused (one kernel for all parameters; on a CPU PyTorch would otherwise loop over them
    in Python), and its steps match PyTorch's reference AdamW with the same groups."""
    cfg = tiny(learning_rate=1e-2, weight_decay=0.1)
    torch.manual_seed(0)
    model = train_unet.build_model(cfg)
    reference = train_unet.build_model(cfg)
    reference.load_state_dict(model.state_dict())
    fused = train_unet.build_optimizer(model, cfg)
    settings = ("lr", "weight_decay", "betas", "eps")
    plain = torch.optim.AdamW([{**{k: g[k] for k in settings}, "params": [dict(reference.named_parameters())[n]
                                                                         for n in names]}
                               for g, names in zip(fused.param_groups, param_names(model, fused))])
    assert all(g["fused"] for g in fused.param_groups) and not any(g["fused"] for g in plain.param_groups)
    for step in range(3):
        grads = {n: torch.randn_like(p) for n, p in model.named_parameters()}
        for m in (model, reference):
            for n, p in m.named_parameters():
                p.grad = grads[n].clone()
        fused.step()
        plain.step()
    for (n, p), q in zip(model.named_parameters(), reference.parameters()):
        assert torch.allclose(p, q, rtol=1e-5, atol=1e-6), n
    assert any(not torch.equal(p, q) for p, q in zip(model.parameters(), train_unet.build_model(cfg).parameters()))


def param_names(model, optimizer):
    ids = {id(p): n for n, p in model.named_parameters()}
    return [[ids[id(p)] for p in g["params"]] for g in optimizer.param_groups]


@pytest.fixture(scope="module")
def overhead_rows(tmp_path_factory):
    data = train_unet.generate_shapes_dataset(tmp_path_factory.mktemp("overhead") / "data", count=12, size=32)
    return overhead.run(["configs=fp32,bf16,fp16", "steps=1", "rounds=3", "image_size=32", "batch_size=2",
                         "encoder_name=resnet18", "max_train_images=8", "cpu_probe=False", f"data_dir={data}"])


def test_overhead_tool_counts_and_times_trainer_against_a_bare_loop(overhead_rows, capsys):
    """tools/overhead.py: per configuration, ops per optimizer step counted for the trainer and a bare
    loop, and the trainer's images/s over the bare loop's (over the run's own loader) and over a held
    batch's, at the configuration's precision, layout and batch: the median of alternating rounds."""
    rows, hw = overhead_rows, train_unet.detect_hardware("cpu")
    assert rows["fp32"]["status"] == "ok" and rows["fp32"]["precision"] == "fp32"
    assert rows["bf16"]["status"] == ("ok" if hw.bf16 else rows["bf16"]["status"])
    assert rows["fp16"]["status"].startswith("skipped:")  # no fast fp16 on a CPU
    for row in [r for r in rows.values() if r["status"] == "ok"]:
        assert row["ops_per_step"] > row["bare_ops_per_step"] > 100
        assert row["ops_vs_bare"] == pytest.approx(row["ops_per_step"] / row["bare_ops_per_step"])
        assert row["ops_vs_bare"] <= 1.05
        assert row["bare_images_per_s"] > 0 and row["trainer_images_per_s"] > 0 and row["held_batch_images_per_s"] > 0
        assert len(row["round_ratios"]) == len(row["held_round_ratios"]) == 3
        assert row["images_per_s_vs_bare"] == pytest.approx(sorted(row["round_ratios"])[1])
        assert row["images_per_s_vs_held_batch"] == pytest.approx(sorted(row["held_round_ratios"])[1])
    table = overhead.format_table(rows)
    assert table.splitlines()[0].split("|")[5].strip() == "Ops/step vs bare"
    assert f"{rows['fp32']['ops_vs_bare']:.2f}x" in table and "skipped:" in table


def test_overhead_tool_refuses_unknown_and_compiled_configurations(capsys):
    assert overhead.main(["configs=fp32,bf16_compile"]) == 2
    assert "bf16_compile" in capsys.readouterr().err


def test_overhead_is_timed_over_the_runs_own_loader(tmp_path):
    """The trainer's timed pass reads the run's data through its own loader settings (workers,
    augmentation), cut to bare_steps steps; a set smaller than that is repeated."""
    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=5, size=32)
    cfg = train_unet.parse_overrides([f"data_dir={data}", "image_size=32", "batch_size=2", "num_workers=1",
                                      "val_fraction=0.2"])
    hw = train_unet.detect_hardware("cpu")
    loader = overhead.timing_loader(cfg, hw, 3, train_unet.prepare_data(cfg))
    batches = list(loader)
    assert len(loader) == 3 and [tuple(x.shape) for x, _ in batches] == [(2, 3, 32, 32)] * 3
    assert loader.num_workers == 1 and loader.persistent_workers
    assert loader.worker_init_fn is train_unet.start_worker
