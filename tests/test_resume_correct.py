"""Resume is right across layouts, devices, GPU counts and extended epochs (issue 20, items 11-14):
AdamW's moments in the parameters' memory format, `fused` chosen for the device a run resumes on, an LR
schedule defined by training progress, and an extension in warm-up that still reaches the peak LR."""
import json
import shutil
from pathlib import Path

import pytest
import torch

import train_unet

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")


def layout(channels_last):
    return torch.channels_last if channels_last else torch.contiguous_format


def set_grads(model, seed):
    """The same gradient values on any layout, stored in the parameter's layout (as autograd does)."""
    g = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=g))


def fresh_run(cfg, channels_last):
    torch.manual_seed(0)
    model = train_unet.build_model(cfg).to(memory_format=layout(channels_last))
    optimizer = train_unet.build_optimizer(model, cfg)
    scheduler = train_unet.build_scheduler(optimizer, cfg, steps_per_epoch=1)
    prec = train_unet.decide_precision(train_unet.detect_hardware("cpu"), use_amp=False)
    return train_unet.Run(model, model, optimizer, scheduler, None, prec, [], [])


@pytest.fixture
def train_until(monkeypatch, interrupt_at):
    """train_until(cfg, epoch): train cfg and stop after `epoch` (as if interrupted there)."""
    def train(cfg, epoch):
        real = interrupt_at(epoch + 1)
        with pytest.raises(KeyboardInterrupt):
            train_unet.train(cfg)
        monkeypatch.setattr(train_unet, "run_epoch", real)
    return train


def lr_column(result):
    return [row["lr"] for row in result["history"]]


# ----------------------------------------------------------------------------------------------------
# 11. AdamW's moments follow the parameters' memory format on resume
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("saved_cl, resumed_cl", [(True, False), (False, True)])
def test_resume_with_another_layout_steps_like_an_uninterrupted_run(make_cfg, saved_cl, resumed_cl):
    cfg = make_cfg(learning_rate=0.1)
    straight = fresh_run(cfg, saved_cl)
    set_grads(straight.model, seed=1)
    straight.optimizer.step()
    state = train_unet.to_cpu(straight.state(cfg))  # what last.pt holds after that step
    set_grads(straight.model, seed=2)
    straight.optimizer.step()

    resumed = fresh_run(cfg, resumed_cl)
    resumed.load(state)
    set_grads(resumed.model, seed=2)
    resumed.optimizer.step()
    for (name, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert (a - b).abs().max() <= 1e-7, name  # the old code: off by about the learning rate
    for p in resumed.model.parameters():
        for value in resumed.optimizer.state[p].values():
            if value.shape == p.shape:
                assert value.stride() == p.stride()


# ----------------------------------------------------------------------------------------------------
# 12. `fused` is chosen for the device a run resumes on, not taken from the checkpoint
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("saved_fused, fused_here", [(False, True), (True, False)])
def test_resumed_optimizer_is_fused_as_built_for_this_device(make_cfg, monkeypatch, saved_fused, fused_here):
    cfg = make_cfg()
    saved = fresh_run(cfg, False)
    set_grads(saved.model, seed=1)
    saved.optimizer.step()
    state = train_unet.to_cpu(saved.state(cfg))
    for group in state["optimizer"]["param_groups"]:  # an older checkpoint, or one from another device
        group["fused"] = saved_fused or None
    if not fused_here:  # a device without fused AdamW (MPS): faked by the CPU not being in the list
        monkeypatch.setattr(train_unet, "FUSED_ADAMW_DEVICES", ("cuda",))
    resumed = fresh_run(cfg, False)
    built = [(g["fused"], g["foreach"]) for g in resumed.optimizer.param_groups]
    assert all(bool(fused) == fused_here for fused, _ in built)
    resumed.load(state)
    assert [(g["fused"], g["foreach"]) for g in resumed.optimizer.param_groups] == built
    set_grads(resumed.model, seed=2)
    resumed.optimizer.step()  # and it steps


def test_resumed_training_runs_the_fused_optimizer(make_cfg, monkeypatch, optimizer_steps, train_until):
    """End to end: a last.pt written unfused (an older checkpoint) resumes fused on a CPU."""
    cfg = make_cfg(epochs=2, early_stopping_patience=None, image_size=32)
    train_until(cfg, 1)
    path = Path(cfg["checkpoint_dir"]) / "last.pt"
    state = train_unet.load_checkpoint(path)
    for group in state["optimizer"]["param_groups"]:
        group["fused"] = None
    torch.save(state, path)
    flags = optimizer_steps(lambda group: group["fused"])
    train_unet.train({**cfg, "resume": True})
    assert flags and all(flags)


# ----------------------------------------------------------------------------------------------------
# 13. Extending a run still in warm-up: the warm-up goes on to the peak
# ----------------------------------------------------------------------------------------------------
def test_extension_in_warmup_reaches_the_peak_then_decays_over_the_new_length():
    """The issue's case: epochs=100 (warm-up 5 epochs), 10 steps/epoch, extended to 200 after epoch 1."""
    old = train_unet.lr_schedule(dict(train_unet.CONFIG, epochs=100, warmup_fraction=0.05))
    new = train_unet.extend_schedule(old, 1, 200)
    factors = [train_unet.lr_factor(s / 10, new) for s in range(2001)]
    assert factors[:11] == [train_unet.lr_factor(s / 10, old) for s in range(11)]  # the past is kept
    assert max(factors) == pytest.approx(1.0) and factors[50] == pytest.approx(1.0)  # at epoch 5, as before
    assert all(b >= a for a, b in zip(factors[:50], factors[1:51]))
    assert all(b <= a for a, b in zip(factors[50:], factors[51:]))
    assert factors[1000] > 0.5  # the cosine spans 200 epochs, not 100
    assert factors[-1] == pytest.approx(train_unet.LR_FLOOR)


def test_extended_run_in_warmup_trains_up_to_the_peak(make_cfg, monkeypatch, optimizer_steps, capsys, train_until,
                                                     interrupt_at):
    # Warm-up over 2 of 20 epochs, 2 steps per epoch; stopped after epoch 1, extended to 40.
    cfg = make_cfg(epochs=20, warmup_fraction=0.1, early_stopping_patience=None, image_size=32)
    lrs = optimizer_steps()
    train_until(cfg, 1)
    before = list(lrs)
    lrs.clear()
    real = interrupt_at(4)
    with pytest.raises(KeyboardInterrupt):
        train_unet.train({**cfg, "resume": True, "epochs": 40})
    monkeypatch.setattr(train_unet, "run_epoch", real)
    history = train_unet.load_checkpoint(Path(cfg["checkpoint_dir"]) / "last.pt")["history"]
    assert history[1]["lr"] == pytest.approx(cfg["learning_rate"])  # the peak (old code: 0.6x, then falling)
    assert max(lrs) == pytest.approx(cfg["learning_rate"])
    slope = before[1] - before[0]
    assert lrs[0] - before[-1] == pytest.approx(slope)  # the same linear warm-up, continued
    assert lrs[1] - lrs[0] == pytest.approx(slope)
    assert "the warm-up goes on to 2.00e-03 at epoch 2" in capsys.readouterr().out


# ----------------------------------------------------------------------------------------------------
# 14. Another GPU count on resume: the schedule follows training progress
# ----------------------------------------------------------------------------------------------------
def as_rank_0_of(world, monkeypatch):
    """Resume "under torchrun with `world` GPUs": rank 0's shard of the training set, so an epoch has
    1/world of the optimizer steps (the gradient all-reduce is what a single process cannot fake)."""
    real = train_unet.build_loaders

    def sharded(train_pairs, val_pairs, cfg, hw):
        train_loader, val_loader = real(train_pairs, val_pairs, cfg, hw)
        sampler = torch.utils.data.DistributedSampler(train_loader.dataset, world, 0, shuffle=True,
                                                      seed=cfg["seed"], drop_last=True)
        return torch.utils.data.DataLoader(train_loader.dataset, cfg["batch_size"], sampler=sampler,
                                           drop_last=True), val_loader
    monkeypatch.setattr(train_unet, "build_loaders", sharded)
    return real


def test_resume_on_four_times_the_gpus_keeps_the_lr_curve(make_data, make_cfg, tmp_path, monkeypatch, capsys, train_until):
    data = make_data("data20", count=20, size=32)  # 16 train images: 4 steps per epoch, 1 on rank 0 of 4
    common = dict(data_dir=str(data), image_size=32, epochs=4, early_stopping_patience=None,
                  warmup_fraction=0.25)
    straight = train_unet.train(make_cfg(checkpoint_dir=str(tmp_path / "straight"), **common))
    cfg = make_cfg(checkpoint_dir=str(tmp_path / "resumed"), **common)
    train_until(cfg, 2)
    shutil.copytree(tmp_path / "resumed", tmp_path / "extended")
    as_rank_0_of(4, monkeypatch)
    capsys.readouterr()

    resumed = train_unet.train({**cfg, "resume": True})
    assert resumed["history"][-1]["optimizer_steps"] == 1
    # The LR at each epoch's end is the same curve (old code: ended at 0.5x the peak, not the floor).
    assert lr_column(resumed) == pytest.approx(lr_column(straight), rel=1e-9)
    assert lr_column(resumed)[-1] == pytest.approx(cfg["learning_rate"] * train_unet.LR_FLOOR)

    extended = train_unet.train({**cfg, "resume": True, "epochs": 6, "checkpoint_dir": str(tmp_path / "extended")})
    out = capsys.readouterr().out
    assert "over the remaining 4 epochs (4 optimizer steps)" in out  # old code: "-2 optimizer steps"
    assert lr_column(extended)[:2] == pytest.approx(lr_column(straight)[:2], rel=1e-9)
    assert lr_column(extended)[-1] == pytest.approx(cfg["learning_rate"] * train_unet.LR_FLOOR)
    assert all(b < a for a, b in zip(lr_column(extended)[1:], lr_column(extended)[2:]))


# ----------------------------------------------------------------------------------------------------
# Checkpoints written before the schedule was kept in epochs still resume, on the same curve
# ----------------------------------------------------------------------------------------------------
def write_old_schedule(path, form):
    """Rewrite last.pt's LR schedule as older versions wrote it: in optimizer steps, or not at all."""
    state = train_unet.load_checkpoint(path)
    per = state["scheduler"]["last_epoch"] // state["epoch"]
    total = state["config"]["epochs"] * per
    if form == "steps":
        state["lr_schedule"] = {"total": total, "warmup": int(total * state["config"]["warmup_fraction"]),
                                "tails": []}
    else:
        del state["lr_schedule"]
    torch.save(state, path)


def test_checkpoints_with_an_old_schedule_resume_on_the_same_curve(make_cfg, tmp_path, monkeypatch, train_until):
    common = dict(epochs=4, early_stopping_patience=None, warmup_fraction=0.25, image_size=32)
    straight = train_unet.train(make_cfg(checkpoint_dir=str(tmp_path / "straight"), **common))
    cfg = make_cfg(checkpoint_dir=str(tmp_path / "steps"), **common)
    train_until(cfg, 2)
    shutil.copytree(tmp_path / "steps", tmp_path / "none")
    for form in ("steps", "none"):
        write_old_schedule(tmp_path / form / "last.pt", form)
        resumed = train_unet.train({**cfg, "resume": True, "checkpoint_dir": str(tmp_path / form)})
        assert lr_column(resumed) == pytest.approx(lr_column(straight), rel=1e-9), form


def test_old_extended_schedule_converts_to_epochs():
    """An extension written in optimizer steps (10 per epoch) means the same in epochs."""
    old = {"total": 100, "warmup": 5, "tails": [[80, 200, 0.3]]}
    state = {"lr_schedule": old, "scheduler": {"last_epoch": 120}, "epoch": 12, "config": {"epochs": 20}}
    schedule = train_unet.checkpoint_schedule(state, train_unet.CONFIG)
    assert schedule == {"epochs": 10, "warmup": 0.5, "tails": [[8, 20, 0.3]]}
    assert train_unet.lr_factor(8, schedule) == pytest.approx(0.3)
    assert train_unet.lr_factor(20, schedule) == pytest.approx(train_unet.LR_FLOOR)


# ----------------------------------------------------------------------------------------------------
# A run resumed on a CPU keeps the precision and layout its probe chose
# ----------------------------------------------------------------------------------------------------
FP32_NHWC_FASTEST = {"fp32": 1.0, "fp32_cl": 0.5, "bf16": 2.0, "bf16_cl": 2.0}
NCHW_FASTEST = {"fp32": 0.5, "fp32_cl": 1.0, "bf16": 0.2, "bf16_cl": 1.0}  # bf16 too, where it is native


def probe_answers(monkeypatch, times):
    """The CPU probe measures `times` from now on, with its cache emptied (a probe beside busy processes
    is not cached, and another machine has its own cache); returns the list of labels it was asked for."""
    train_unet.cpu_probe_cache_path().unlink(missing_ok=True)
    asked = []

    def measure(cfg, hw, labels, kind):
        asked.extend(labels)
        return {label: times[label] for label in labels}
    monkeypatch.setattr(train_unet, "measure_cpu_modes", measure)
    return asked


def test_a_resume_on_a_cpu_keeps_its_runs_probed_precision_and_layout(make_cfg, tmp_path, monkeypatch, capsys,
                                                                      train_until):
    """A resume whose probe would now pick the other layout (and bf16 where native) goes on in the
    modes its run began with, without probing, and ends with the uninterrupted run's weights."""
    cfg = make_cfg(epochs=2, batch_size=2, use_amp=True, amp_dtype="auto", channels_last="auto", cpu_probe=True)
    monkeypatch.setattr(train_unet, "training_job_steps", lambda *args: 10**6)  # probed, though a short run
    probe_answers(monkeypatch, FP32_NHWC_FASTEST)
    straight = train_unet.train({**cfg, "checkpoint_dir": str(tmp_path / "straight")})
    assert straight["precision"] == "fp32"
    probe_answers(monkeypatch, FP32_NHWC_FASTEST)
    train_until(cfg, 1)
    asked = probe_answers(monkeypatch, NCHW_FASTEST)
    capsys.readouterr()
    resumed = train_unet.train({**cfg, "resume": True})
    assert asked == [] and resumed["precision"] == "fp32"
    assert "kept from the checkpoint" in capsys.readouterr().out
    saved = json.loads((Path(cfg["checkpoint_dir"]) / "config.json").read_text())["config"]
    assert saved["channels_last"] is True
    weights = [train_unet.load_checkpoint(Path(folder) / "last.pt")["model"]
               for folder in (tmp_path / "straight", cfg["checkpoint_dir"])]
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])


def test_a_resume_on_another_number_of_processes_says_what_changes(monkeypatch):
    """Resumed from 2 processes to 1, the banner said only "resumed from ...": the effective batch halved.
    Where an epoch has fewer batches than accumulation_steps, its one step averages those it has: 16 images, batch 8
    and accumulation 2 on 2 processes is one batch each, 8 x 1 x 2 = 16 as on 1 process (8 x 2), which the note
    said was "16 instead of 32"."""
    cfg = {"batch_size": 2, "accumulation_steps": 3}
    monkeypatch.setattr(train_unet, "DIST", train_unet.Dist(rank=0, world=1))
    assert train_unet.other_world_size({"world_size": 2}, cfg, 100) == (
        ", trained on 2 process(es), now 1: the effective batch is 6 instead of 12, and the data order changes; "
        "the LR curve does not")
    assert train_unet.other_world_size({"world_size": 1}, cfg, 100) == ""
    assert train_unet.other_world_size({}, cfg, 100) == ""  # a checkpoint from before world_size was saved
    capped = {"batch_size": 8, "accumulation_steps": 2}
    assert train_unet.other_world_size({"world_size": 2}, capped, 16) == (
        ", trained on 2 process(es), now 1: the effective batch is the same (16), but the data order changes; "
        "the LR curve does not")
    monkeypatch.setattr(train_unet, "DIST", train_unet.Dist(rank=0, world=4))  # one batch each: 8 x 1 x 4
    assert "the effective batch is 32 instead of 16," in train_unet.other_world_size({"world_size": 1}, capped, 32)


def test_a_resume_keeps_only_a_precision_its_run_chose_by_auto(make_cfg):
    """The probe's rule: a run that began with auto keeps its precision; one that began in fp32 because
    use_amp=False is not auto's (keep_chosen_precision keeps it unless use_amp or amp_dtype is given)."""
    hw = train_unet.Hardware("cpu", "cpu", "Fake EPYC", None, bf16=True, fp16=False, bf16_feature="AVX512-BF16")
    cfg = make_cfg(use_amp=True, amp_dtype="auto", channels_last="auto", cpu_probe=True)
    prec = train_unet.decide_precision(hw, True, "auto")
    state = {"device_kind": "cpu", "precision": "fp32", "config": {**cfg, "channels_last": True}}
    kept, layout = train_unet.resumed_cpu_modes(cfg, hw, prec, state)
    assert kept.name == "fp32" and layout[0] is True
    state["config"]["use_amp"] = False
    assert train_unet.resumed_cpu_modes(cfg, hw, prec, state)[0].name == "bf16"


AMX_CPU = train_unet.Hardware("cpu", "cpu", "Fake Xeon", None, bf16=True, fp16=False, bf16_feature="AMX")


@pytest.mark.parametrize("was, explicit, expected", [
    ({"use_amp": False, "preset": "stable"}, (), "fp32"),  # preset=stable left out on resume: fp32 kept
    ({"use_amp": False}, ("use_amp",), "bf16"),  # use_amp=True given: auto decides again
    ({"use_amp": True, "amp_dtype": "auto"}, (), "bf16"),  # an auto run: auto again (the probe keeps its own)
])
def test_a_resumed_run_keeps_the_precision_it_was_given(make_cfg, monkeypatch, was, explicit, expected):
    """A preset=stable (fp32) run resumed without repeating the preset went on in bf16, and config.json then
    recorded use_amp=True: nothing said the precision had changed."""
    monkeypatch.setattr(train_unet, "detect_hardware", lambda device="auto": AMX_CPU)
    cfg = make_cfg(use_amp=True, amp_dtype="auto")
    state = {"precision": "fp32", "config": {**cfg, **was}}
    out, _, prec, notes = train_unet.setup_precision(cfg, state, explicit)
    assert prec.name == expected
    kept = expected == "fp32"
    assert out["use_amp"] is not kept
    assert ("kept from the checkpoint: last.pt trained in fp32 as set (use_amp=False, from preset=stable); "
            "give use_amp=True on the command line, or an amp_dtype, to change it" in prec.reason) is kept
    assert not any("kept from the checkpoint" in str(n) for n in notes)  # said in the precision line, once


def test_a_resumed_bf16_run_set_so_says_it_is_kept_not_chosen_by_auto(make_cfg, monkeypatch):
    """amp_dtype=bfloat16 resumed without it said 'bf16 (auto: native bf16 ...)', a choice auto had not made:
    on a CPU the probe can choose fp32 (a 2-core Xeon with AMX measured bf16 at 0.89-1.09x fp32)."""
    monkeypatch.setattr(train_unet, "detect_hardware", lambda device="auto": AMX_CPU)
    cfg = make_cfg(use_amp=True, amp_dtype="auto")
    state = {"precision": "bf16", "config": {**cfg, "amp_dtype": "bfloat16"}}
    out, _, prec, _ = train_unet.setup_precision(cfg, state, ())
    assert prec.name == "bf16" and out["amp_dtype"] == "bfloat16"
    assert prec.reason == ("kept from the checkpoint: last.pt trained in bf16 as set (amp_dtype=bfloat16); give "
                           "use_amp=False or another amp_dtype to change it")


def test_a_preset_given_on_resume_sets_the_precision(make_cfg, monkeypatch):
    """preset=fast (use_amp=True, amp_dtype=auto) given to resume a preset=stable run still trained in fp32."""
    monkeypatch.setattr(train_unet, "detect_hardware", lambda device="auto": AMX_CPU)
    cfg = make_cfg(use_amp=True, amp_dtype="auto", preset="fast")
    state = {"precision": "fp32", "config": {**cfg, "use_amp": False, "preset": "stable"}}
    assert train_unet.setup_precision(cfg, state)[2].name == "bf16"


def test_a_set_precision_not_native_here_is_not_kept(make_cfg, monkeypatch):
    """amp_dtype=bfloat16 trained on a bf16 machine, resumed on one without: auto's choice, not emulated bf16."""
    no_bf16 = train_unet.Hardware("cpu", "cpu", "Fake Zen 3", None, bf16=False, fp16=False, bf16_feature="no")
    monkeypatch.setattr(train_unet, "detect_hardware", lambda device="auto": no_bf16)
    cfg = make_cfg(use_amp=True, amp_dtype="auto")
    _, _, prec, _ = train_unet.setup_precision(cfg, {"precision": "bf16", "config": {**cfg, "amp_dtype": "bfloat16"}})
    assert prec.name == "fp32"


def test_the_resume_note_says_what_mode_changed():
    was = {"channels_last": False, "preset": "stable"}
    prec = train_unet.Precision.of(torch.bfloat16, "bfloat16 as requested")
    now = {"channels_last": True, "preset": None, "use_amp": True, "compile_model": False, "grad_clip_norm": 1.0,
           "nan_guard": True}
    said = train_unet.other_modes({"precision": "fp32", "config": was}, now, prec)
    assert said == ("; it trained in fp32, this run in bf16; it trained NCHW, this run NHWC (channels_last=True); "
                    "it ran with preset=stable, this run with none (use_amp=True): give preset=stable to keep that "
                    "preset's settings")
    assert "preset" not in train_unet.other_modes({"precision": "bf16", "config": was}, {**now, "use_amp": False},
                                                  prec)  # every one of its settings kept: nothing to give
    assert train_unet.other_modes({"precision": "bf16", "config": {**was, "preset": None}},
                                  {"channels_last": False, "preset": None}, prec) == ""


def test_the_resume_note_says_where_torch_compile_changed():
    """The README says compile_model is decided anew with a note where it differs from last.pt's; a run
    trained with compile_model=True resumed without it had no word (its kernels, and its steps, differ)."""
    prec = train_unet.Precision.of(torch.bfloat16, "bfloat16 as requested")
    state = {"precision": "bf16", "config": {"channels_last": False, "preset": None, "compile_model": True}}
    now = {"channels_last": False, "preset": None, "compile_model": False}
    assert train_unet.other_modes(state, now, prec) == \
        "; it trained compiled, this run uncompiled (compile_model=False)"
    state["config"]["compile_model"] = False
    assert train_unet.other_modes(state, {**now, "compile_model": True}, prec) == \
        "; it trained uncompiled, this run compiled (compile_model=True)"
    assert train_unet.other_modes(state, now, prec) == ""
    fast = {"precision": "bf16", "config": {**train_unet.PRESETS["fast"], "preset": "fast"}}
    said = train_unet.other_modes(fast, {**now, "channels_last": True, "use_amp": True, "amp_dtype": "auto"}, prec)
    assert "compiled" not in said and "(compile_model=False): give preset=fast" in said  # said once, with the preset
    same = {**train_unet.PRESETS["fast"], "preset": "fast"}  # the run's own preset, compile turned off: said (review)
    assert train_unet.other_modes({"precision": "bf16", "config": same}, {**same, "compile_model": False}, prec) == \
        "; it trained compiled, this run uncompiled (compile_model=False)"


def test_a_stable_run_resumed_without_its_preset_goes_on_in_fp32(make_cfg, capsys):
    """End to end, on whatever this CPU is: every epoch in fp32, config.json saying use_amp=False."""
    cfg = make_cfg(epochs=1, preset="stable")
    train_unet.train(cfg)
    capsys.readouterr()
    resumed = train_unet.train({**cfg, "preset": None, "use_amp": True, "amp_dtype": "auto", "epochs": 2,
                                "resume": True})
    assert resumed["precision"] == "fp32" and [row["precision"] for row in resumed["history"]] == ["fp32", "fp32"]
    saved = json.loads((Path(cfg["checkpoint_dir"]) / "config.json").read_text())["config"]
    assert saved["use_amp"] is False
    out = capsys.readouterr().out
    # every setting of the preset as it set it: no note; fp32 said kept once where bf16 is native (auto would choose
    # it), and not at all where it is not (auto's own choice is fp32)
    assert "give preset=stable" not in out and out.count("kept from the checkpoint") == int(train_unet.detect_hardware(
        "cpu").bf16)
    other = {**cfg, "checkpoint_dir": str(Path(cfg["checkpoint_dir"]).with_name("other"))}
    train_unet.train(other)
    train_unet.train({**other, "preset": None, "epochs": 2, "resume": True, "grad_clip_norm": 0.5})
    assert "it ran with preset=stable, this run with none (grad_clip_norm=0.5): give preset=stable" in \
        capsys.readouterr().out


def test_keys_the_run_did_not_read_are_noted_and_not_compared_on_resume(make_cfg, tmp_path, capsys):
    """A fit-mode run given patch_scale=0.5 (no note that fit mode reads none of it), or data with train/ and
    val/ folders given val_fraction=0.99 (noted unused), was refused on resume without them: 'cannot resume
    exactly: ... was trained with val_fraction=0.99' for values that had changed nothing."""
    split = tmp_path / "split"
    for part, count in (("train", 8), ("val", 4)):
        train_unet.generate_shapes_dataset(split / part, count=count, size=64, seed=len(part))
    cfg = make_cfg(data_dir=str(split), val_fraction=0.9, patch_scale=0.5, patches_per_image=3, epochs=1)
    train_unet.train(cfg)
    out = capsys.readouterr().out
    assert "val_fraction=0.9 not used" in out
    assert "patch_scale=0.5, patches_per_image=3 not used: data_mode=fit resizes each image whole" in out
    resumed = train_unet.train(make_cfg(data_dir=str(split), epochs=2, resume=True))
    assert [row["epoch"] for row in resumed["history"]] == [1, 2]
    with pytest.raises(train_unet.UserError, match="was trained with image_size=64"):  # what it read still counts
        train_unet.train(make_cfg(data_dir=str(split), epochs=3, resume=True, image_size=96))
