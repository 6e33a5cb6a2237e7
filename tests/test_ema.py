"""Weight EMA (issue 23, item 2): ema_decay keeps an fp32 shadow of the weights and BatchNorm buffers,
updated after each applied optimizer step with grouped ops and no host sync; validation, best.pt and
predict use it; it is saved, resumed and rolled back exactly; off, it costs nothing.

Steps run through the trainer's own train_one_epoch (one optimizer step per call, 32x32 images), and the
reference EMA is computed here in float64 from the live weights after each step.
"""
import contextlib
import io
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import train_unet

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from overhead import count_ops_per_step, step_runners  # noqa: E402
from test_overhead import counting_conversions  # noqa: E402  (Tensor->Python conversions: syncs on a GPU)

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)`")

SIZE = 32


def tiny(**overrides):
    cfg = dict(train_unet.CONFIG, image_size=SIZE, batch_size=2, device="cpu", progress=False,
               encoder_name="resnet18", encoder_weights=None, use_amp=False, channels_last=False)
    cfg.update(overrides)
    return train_unet.validate_config(cfg)


def fp16(hw):
    return train_unet.decide_precision(hw, True, "float16", force=True)


def make_run(cfg, hw, prec=None):
    """A Run as setup_run builds it (fresh), with its WeightEMA."""
    prec = prec or train_unet.decide_precision(hw, use_amp=False)
    torch.manual_seed(0)
    model = train_unet.prepare_model(cfg, hw)
    optimizer = train_unet.build_optimizer(model, cfg)
    scheduler = train_unet.build_scheduler(optimizer, cfg, steps_per_epoch=100)
    return train_unet.Run(model, model, optimizer, scheduler, train_unet.build_scaler(prec, hw, cfg), prec,
                          loss_fn=train_unet.SegLoss(1), ema=train_unet.WeightEMA(model, cfg["ema_decay"]))


def batch(seed, nan=False):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(2, 3, SIZE, SIZE, generator=g), torch.randint(0, 2, (2, SIZE, SIZE), generator=g)
    if nan:
        x[0, 0, 0, 0] = float("nan")
    return x, y


def optimizer_steps_taken(run):
    return int(run.optimizer.state[next(run.model.parameters())].get("step", 0))


def one_step(run, cfg, hw, xy):
    """One optimizer step through the trainer's loop; whether the optimizer applied it (AdamW's count)."""
    before = optimizer_steps_taken(run)
    train_unet.train_one_epoch(run, [xy], cfg, hw)
    return optimizer_steps_taken(run) == before + 1


def snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def reference_ema(start, live_states, applied, decay):
    """The EMA by hand, in float64: e = d_n e + (1 - d_n) w after the n-th applied step, with the
    warm-up d_n = min(decay, (1 + n) / (10 + n)); integer buffers copied. Skipped steps change nothing."""
    ema, n = {k: v.double() if v.is_floating_point() else v.clone() for k, v in start.items()}, 0
    for live, ok in zip(live_states, applied):
        if not ok:
            continue
        n += 1
        d = min(decay, (1 + n) / (10 + n))
        ema = {k: d * e + (1 - d) * live[k].double() if e.is_floating_point() else live[k].clone()
               for k, e in ema.items()}
    return ema


def assert_matches(shadow, reference, atol=1e-6):
    assert shadow.keys() == reference.keys()
    for key, value in shadow.items():
        if value.is_floating_point():
            assert value.dtype == torch.float32, key
            assert torch.allclose(value.double(), reference[key], rtol=1e-5, atol=atol), key
        else:
            assert torch.equal(value, reference[key]), key


def train_steps(run, cfg, hw, batches):
    """Steps one by one: (the live state after each, whether each was applied, the shadow after each)."""
    states, applied, shadows = [], [], []
    for xy in batches:
        applied.append(one_step(run, cfg, hw, xy))
        states.append(snapshot(run.model))
        shadows.append(snapshot(run.ema.model))
    return states, applied, shadows


def equal_states(a, b):
    return all(torch.equal(a[k], b[k]) for k in a)


# ----------------------------------------------------------------------------------------------------
# The update: formula, warm-up, skipped steps (host bool and device bool)
# ----------------------------------------------------------------------------------------------------
def test_update_matches_the_reference_formula_through_warmup_and_after(cpu_hw):
    """decay 0.3: the warm-up (2/11, 3/12) for the first two updates, then 0.3 itself."""
    cfg = tiny(ema_decay=0.3, nan_guard=True)
    run = make_run(cfg, cpu_hw)
    start = snapshot(run.model)
    assert equal_states(snapshot(run.ema.model), start)  # a copy of the weights at first
    states, applied, shadows = train_steps(run, cfg, cpu_hw, [batch(i) for i in range(4)])
    assert applied == [True] * 4 and run.ema.updates == 4
    assert_matches(shadows[-1], reference_ema(start, states, applied, 0.3))
    floats = [k for k in start if start[k].is_floating_point()]
    assert any(not torch.allclose(shadows[-1][k], states[-1][k]) for k in floats)  # an average, not a copy
    assert any(k.endswith("running_var") for k in floats) and any(k.endswith("num_batches_tracked") for k in start)
    assert not any(p.requires_grad for p in run.ema.model.parameters()) and not run.ema.model.training


def test_a_step_the_guard_skips_does_not_update_the_ema(cpu_hw):
    """nan_guard: a NaN batch's step is skipped (a host bool): the shadow stays as it was, bit for bit,
    the warm-up count does not move, and the next step continues the formula."""
    cfg = tiny(ema_decay=0.9, nan_guard=True)
    run = make_run(cfg, cpu_hw)
    start = snapshot(run.model)
    states, applied, shadows = train_steps(run, cfg, cpu_hw, [batch(0), batch(1, nan=True), batch(2)])
    assert applied == [True, False, True] and run.ema.updates == 2
    assert equal_states(shadows[1], shadows[0])
    assert_matches(shadows[2], reference_ema(start, states, applied, 0.9))
    assert all(torch.isfinite(v).all() for v in shadows[2].values() if v.is_floating_point())


def test_fp16_without_the_guard_weights_the_update_on_the_device(cpu_hw):
    """fp16 with nan_guard=False: the GradScaler decides on the device, and so does the EMA (no read-back).
    An init_scale of 2**32 (the largest allowed) overflows the first step's fp16 gradients (skipped: the shadow
    does not move); the scale then backs off to 16 and the next steps apply."""
    cfg = tiny(ema_decay=0.9, nan_guard=False, use_amp=True, amp_dtype="float16", force_amp_dtype=True,
               init_scale=2.0**32, backoff_factor=2.0**-28)
    run = make_run(cfg, cpu_hw, fp16(cpu_hw))
    start = snapshot(run.model)
    states, applied, shadows = train_steps(run, cfg, cpu_hw, [batch(i) for i in range(3)])
    assert applied == [False, True, True]
    assert isinstance(run.ema.updates, torch.Tensor) and int(run.ema.updates) == 2  # counted on the device
    floats = [k for k in start if start[k].is_floating_point()]
    assert all(torch.equal(shadows[0][k], start[k]) for k in floats)  # weighted by 0 (num_batches_tracked: copied)
    assert_matches(shadows[2], reference_ema(start, states, applied, 0.9))
    assert train_unet.to_cpu(run.ema.state())["updates"] == 2  # read back once, for the checkpoint


def test_ema_decay_is_checked_and_parsed():
    assert train_unet.parse_overrides(["ema_decay=0.99"])["ema_decay"] == 0.99
    assert train_unet.parse_overrides(["ema_decay=None"])["ema_decay"] is None
    for bad in ("1", "0", "-0.5", "1.5"):
        with pytest.raises(train_unet.UserError, match=r"ema_decay=.* must be in \(0, 1\)"):
            train_unet.parse_overrides([f"ema_decay={bad}"])


# ----------------------------------------------------------------------------------------------------
# Cost: off adds nothing; on adds two grouped ops per step and no host sync
# ----------------------------------------------------------------------------------------------------
def conversions_per_step(trainer, steps):
    trainer(1)
    counts = []
    for n in (1, 1 + steps):
        with counting_conversions() as calls:
            trainer(n)
        counts.append(len(calls))
    return (counts[1] - counts[0]) / steps


def test_ema_off_dispatches_nothing_and_on_adds_two_grouped_ops_per_step(cpu_hw, monkeypatch):
    """Aten ops per optimizer step (tools/overhead.py's count): off, exactly as if the update call were not
    there; on, one _foreach_lerp_ over every float tensor and one _foreach_copy_ of the integer buffers,
    however many tensors the model has."""
    prec = train_unet.decide_precision(cpu_hw, use_amp=False)
    per_step = {}
    for name, decay in (("off", None), ("on", 0.99)):
        trainer, _ = step_runners(tiny(ema_decay=decay), cpu_hw, prec)
        per_step[name] = count_ops_per_step(trainer, steps=train_unet.ZERO_GRAD_EVERY)
    monkeypatch.setattr(train_unet.WeightEMA, "update", lambda self, applied: None)
    trainer, _ = step_runners(tiny(), cpu_hw, prec)
    without_call = count_ops_per_step(trainer, steps=train_unet.ZERO_GRAD_EVERY)
    assert per_step["off"] == without_call
    (off, off_ops), (on, on_ops) = per_step["off"], per_step["on"]
    extra = {op: n - off_ops.get(op, 0) for op, n in on_ops.items() if n != off_ops.get(op, 0)}
    assert extra == {"aten._foreach_lerp_.Scalar": 1, "aten._foreach_copy_.default": 1}
    assert on == off + 2


@pytest.mark.parametrize("name,nan_guard,most", [("fp32", True, 1), ("fp32", False, 0), ("fp16", False, 0)])
def test_ema_makes_no_host_sync(cpu_hw, name, nan_guard, most):
    """Conversions per optimizer step with the EMA on: the guard's one read where it is on, none else;
    fp16 without the guard is the device-bool path (one micro-batch per step: fp16 is emulated on a CPU)."""
    prec = fp16(cpu_hw) if name == "fp16" else train_unet.decide_precision(cpu_hw, use_amp=False)
    cfg = tiny(ema_decay=0.99, nan_guard=nan_guard, accumulation_steps=1 if name == "fp16" else 2)
    trainer, _ = step_runners(cfg, cpu_hw, prec)
    assert conversions_per_step(trainer, steps=2 if name == "fp16" else 3) == most


def test_the_off_object_holds_and_does_nothing():
    ema = train_unet.WeightEMA()

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            ops.append(str(func))
            return func(*args, **(kwargs or {}))
    ops, model, on_device = [], torch.nn.Linear(2, 2), torch.tensor(True)
    with Record():
        ema.update(True)
        ema.update(on_device)
        assert ema.evaluated(model) is model
    assert ops == [] and ema.state() is None and ema.note(None) is None


# ----------------------------------------------------------------------------------------------------
# A run: validation, best.pt and predict use the EMA; exact resume; old checkpoints; rollback; DDP
# ----------------------------------------------------------------------------------------------------
STEPS_PER_EPOCH = 5  # 12 images: 10 train in batches of 2


def run_cfg(data, ckpt_dir, **overrides):
    return {**tiny(), "data_dir": str(data), "checkpoint_dir": str(ckpt_dir), "epochs": 2, "num_workers": 0,
            "early_stopping_patience": None, "ema_decay": 0.9, **overrides}


def load(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def train_logged(cfg):
    log = io.StringIO()
    with contextlib.redirect_stdout(log):
        result = train_unet.train(cfg)
    return result, log.getvalue()


@pytest.fixture(scope="module")
def ema_run(tmp_path_factory):
    """A 2-epoch run with ema_decay=0.9, the weights each validation ran with recorded."""
    root = tmp_path_factory.mktemp("ema_run")
    data = train_unet.generate_shapes_dataset(root / "data", count=12, size=SIZE)
    cfg, validated = run_cfg(data, root / "ckpt"), []
    real_evaluate = train_unet.evaluate

    def evaluate(model, *args, **kwargs):
        validated.append(snapshot(train_unet.unwrap(model)))
        return real_evaluate(model, *args, **kwargs)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(train_unet, "evaluate", evaluate)
        result, log = train_logged(cfg)
    return cfg, result, log, validated


def test_validation_and_best_pt_use_the_ema_weights(ema_run):
    cfg, result, log, validated = ema_run
    last, best = (load(Path(cfg["checkpoint_dir"]) / name) for name in ("last.pt", "best.pt"))
    assert len(validated) == 2 and equal_states(validated[-1], last["ema"]["model"])
    assert not equal_states(last["ema"]["model"], last["model"])  # the raw weights are kept for resume
    assert last["ema"]["decay"] == 0.9 and last["ema"]["updates"] == 2 * STEPS_PER_EPOCH
    best_epoch = max(result["history"], key=lambda r: r["val_iou"])["epoch"]
    assert equal_states(best["ema"]["model"], validated[best_epoch - 1])
    assert "ema          decay 0.9" in log and "predict use the EMA weights" in log


def test_predict_uses_the_ema_weights_and_says_so(ema_run, tmp_path, capsys):
    cfg, *_ = ema_run
    ckpt = Path(cfg["checkpoint_dir"]) / "best.pt"
    model, loaded = train_unet.load_model(ckpt, train_unet.detect_hardware("cpu"))
    assert loaded["ema_decay"] == 0.9 and equal_states(snapshot(model), load(ckpt)["ema"]["model"])
    images = Path(cfg["data_dir"]) / "images"
    done = train_unet.predict({"checkpoint": str(ckpt), "input": str(images), "output": str(tmp_path / "out"),
                               "device": "cpu", "progress": False, "use_amp": False})
    assert done["predicted"] == 12 and not done["failed"]
    assert "(its EMA weights, ema_decay=0.9)" in capsys.readouterr().out


def test_an_interrupted_run_resumes_to_the_same_ema_bit_for_bit(ema_run, tmp_path, monkeypatch, interrupt_at):
    cfg, *_ = ema_run
    straight = load(Path(cfg["checkpoint_dir"]) / "last.pt")
    cfg = {**cfg, "checkpoint_dir": str(tmp_path / "ckpt")}
    real = interrupt_at(2)
    with pytest.raises(KeyboardInterrupt):
        train_logged(cfg)
    assert load(tmp_path / "ckpt" / "last.pt")["ema"]["updates"] == STEPS_PER_EPOCH
    monkeypatch.setattr(train_unet, "run_epoch", real)
    train_logged({**cfg, "resume": True})
    resumed = load(tmp_path / "ckpt" / "last.pt")
    assert resumed["ema"]["updates"] == straight["ema"]["updates"]
    assert equal_states(resumed["ema"]["model"], straight["ema"]["model"])
    assert equal_states(resumed["model"], straight["model"])


def checkpoint_from_before_ema(ema_run, folder):
    """ema_run's last.pt as a checkpoint written before the EMA existed: no "ema", no ema_decay key."""
    cfg, *_ = ema_run
    state = load(Path(cfg["checkpoint_dir"]) / "last.pt")
    del state["ema"]
    state["config"] = {k: v for k, v in state["config"].items() if k != "ema_decay"}
    folder.mkdir()
    torch.save(state, folder / "last.pt")
    return state


@pytest.mark.parametrize("decay", [None, 0.9])
def test_a_checkpoint_without_ema_loads_and_resumes(ema_run, tmp_path, decay):
    """Without EMA it resumes as before; with ema_decay set the EMA starts from the resumed weights."""
    cfg, *_ = ema_run
    old = checkpoint_from_before_ema(ema_run, tmp_path / "ckpt")
    model, loaded = train_unet.load_model(tmp_path / "ckpt" / "last.pt", train_unet.detect_hardware("cpu"))
    assert loaded["ema_decay"] is None and equal_states(snapshot(model), old["model"])
    result, log = train_logged({**cfg, "checkpoint_dir": str(tmp_path / "ckpt"), "resume": True, "epochs": 3,
                                "ema_decay": decay})
    assert [row["epoch"] for row in result["history"]] == [1, 2, 3]
    last = load(tmp_path / "ckpt" / "last.pt")
    if decay is None:
        assert last["ema"] is None and "ema " not in log
    else:
        assert last["ema"]["updates"] == STEPS_PER_EPOCH and "last.pt holds no EMA" in log


def test_export_says_it_exports_the_ema_weights(ema_run, tmp_path, capsys):
    """predict said '(its EMA weights, ema_decay=0.9)'; export, which exports the same weights, said nothing."""
    cfg, *_ = ema_run
    train_unet.export({"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "output": str(tmp_path / "deploy")})
    assert "best.pt (its EMA weights, ema_decay=0.9) (" in capsys.readouterr().out


def test_resuming_with_ema_off_says_the_ema_is_dropped(ema_run, tmp_path):
    cfg, *_ = ema_run
    shutil.copytree(cfg["checkpoint_dir"], tmp_path / "ckpt")
    result, log = train_logged({**cfg, "checkpoint_dir": str(tmp_path / "ckpt"), "resume": True, "epochs": 3,
                                "ema_decay": None})
    assert "the EMA that last.pt holds is not carried on" in log
    assert load(tmp_path / "ckpt" / "last.pt")["ema"] is None
    assert train_unet.load_model(tmp_path / "ckpt" / "last.pt", train_unet.detect_hardware("cpu"))[1]["ema_decay"] is None


def test_resuming_with_another_decay_says_so_and_goes_on_from_the_averaged_weights(ema_run, tmp_path):
    """A changed ema_decay on resume had no word (the README lists it as changed with a note): the banner
    said only the new decay."""
    cfg, *_ = ema_run
    shutil.copytree(cfg["checkpoint_dir"], tmp_path / "ckpt")
    was = load(tmp_path / "ckpt" / "last.pt")["ema"]
    result, log = train_logged({**cfg, "checkpoint_dir": str(tmp_path / "ckpt"), "resume": True, "epochs": 3,
                                "ema_decay": 0.5})
    assert "decay 0.5 " in log and "changed from 0.9, last.pt's" in log and "about the last 2 steps, not 10" in log
    last = load(tmp_path / "ckpt" / "last.pt")["ema"]
    assert last["decay"] == 0.5 and last["updates"] == was["updates"] + STEPS_PER_EPOCH
    back, log = train_logged({**cfg, "checkpoint_dir": str(tmp_path / "ckpt"), "resume": True, "epochs": 4})
    assert [row["epoch"] for row in back["history"]] == [1, 2, 3, 4] and "changed from 0.5, last.pt's" in log


def test_a_precision_fallback_rolls_the_ema_back(ema_run, tmp_path, monkeypatch):
    """bf16 steps 2 and 3 get inf gradients (nan_patience=2) after step 1 was applied and averaged in:
    the rollback to the epoch's start must take the EMA back too, so that it holds exactly the fp32
    re-run's updates."""
    cfg, *_ = ema_run
    calls, build_model = [], train_unet.build_model

    def build(model_cfg):
        model = build_model(model_cfg)
        model.segmentation_head[0].weight.register_hook(
            lambda grad: grad * float("inf") if len(calls.append(1) or calls) in (2, 3) else grad)
        return model
    monkeypatch.setattr(train_unet, "build_model", build)
    result, _ = train_logged({**cfg, "checkpoint_dir": str(tmp_path / "ckpt"), "epochs": 1, "nan_patience": 2,
                              "use_amp": True, "amp_dtype": "bfloat16", "force_amp_dtype": True})
    assert [(f["from"], f["to"]) for f in result["fallbacks"]] == [("bf16", "fp32")]
    assert len(calls) == 3 + STEPS_PER_EPOCH
    assert load(tmp_path / "ckpt" / "last.pt")["ema"]["updates"] == STEPS_PER_EPOCH  # not 1 + STEPS_PER_EPOCH


def test_ddp_validates_and_saves_rank_0s_ema(ema_run, tmp_path):
    """Under torchrun (2 processes, gloo) each rank updates its own EMA; validation uses rank 0's BatchNorm
    averages, so a single process evaluating the saved EMA (load_model) gets the same IoU exactly."""
    cfg, *_ = ema_run
    args = [f"data_dir={cfg['data_dir']}", f"image_size={SIZE}", "batch_size=2", "device=cpu", "progress=False",
            "encoder_name=resnet18", "epochs=1", "ema_decay=0.9", f"checkpoint_dir={tmp_path / 'ddp'}"]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          train_unet.__file__, *args], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    hw = train_unet.detect_hardware("cpu")
    model, loaded = train_unet.load_model(tmp_path / "ddp" / "last.pt", hw)
    assert loaded["ema_decay"] == 0.9
    loaded = {**loaded, "progress": False, "num_workers": 0}
    _, val_loader = train_unet.build_loaders(*train_unet.prepare_data(loaded), loaded, hw)
    iou = train_unet.evaluate(model, val_loader, train_unet.SegLoss(1), train_unet.decide_precision(hw, use_amp=False),
                              hw, loaded)["iou"]
    history = train_unet.load_checkpoint(tmp_path / "ddp" / "last.pt")["history"]
    assert iou == pytest.approx(history[-1]["val_iou"], abs=1e-12)
