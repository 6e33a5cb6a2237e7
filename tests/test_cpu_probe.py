"""Issue 21: on a CPU, amp_dtype="auto" and channels_last="auto" are confirmed by a short timed probe
(cached per machine and setting); fp16 stays out of CPU auto; predict uses the same probe; CUDA keeps
its rules. Timings and hardware are faked (conftest's fake_cpu_probe, or a test's own), except in the
one test marked real_cpu_probe."""
import dataclasses
import os
import pwd
import subprocess
import sys
import weakref
import json
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import train_unet
from train_unet import Hardware, Precision

BF16_CPU = Hardware("cpu", "cpu", "Fake Xeon", None, bf16=True, fp16=False, bf16_feature="AVX512-BF16")
PLAIN_CPU = Hardware("cpu", "cpu", "Fake Zen 3", None, bf16=False, fp16=False, bf16_feature="no AVX512-BF16")
AMPERE = Hardware("cuda:0", "cuda", "Fake A100", (8, 0), bf16=True, fp16=True, bf16_feature="compute capability 8.0")

# The Xeon at the default run (s/step): bf16 slower than fp32, NHWC faster.
XEON = {"fp32": 0.41, "fp32_cl": 0.36, "bf16": 0.53, "bf16_cl": 0.51}
EPYC = {"fp32": 0.60, "fp32_cl": 0.50, "bf16": 0.30, "bf16_cl": 0.22}  # bf16 2.3x fp32


def fake_timings(monkeypatch, times):
    """measure_cpu_modes answers `times` (only the labels asked for); returns the list of calls."""
    calls = []

    def measure(cfg, hw, labels, kind):
        calls.append((list(labels), kind, cfg["batch_size"]))
        return {label: times[label] for label in labels}
    monkeypatch.setattr(train_unet, "measure_cpu_modes", measure)
    return calls


def decide(cfg, hw, times=None, monkeypatch=None, kind="train", prec=None, cached=False):
    """cpu_probe_decision with faked timings: (precision, layout, notes, measure calls); the cache is
    emptied first unless `cached`."""
    if not cached:
        train_unet.cpu_probe_cache_path().unlink(missing_ok=True)
    calls = fake_timings(monkeypatch, times) if times is not None else None
    prec = prec or train_unet.decide_precision(hw, cfg["use_amp"], cfg["amp_dtype"], cfg["force_amp_dtype"])
    notes = []
    chosen, layout = train_unet.cpu_probe_decision(cfg, hw, prec, notes, kind)
    return chosen, layout, notes, calls


@pytest.fixture
def probe_cfg(make_cfg):
    """The default run's shape (batch 8 x 128 px: NHWC by the flag rule) with every auto on."""
    return make_cfg(use_amp=True, amp_dtype="auto", channels_last="auto", cpu_probe=True, image_size=128,
                    batch_size=8)


# ---------------------------------------------------------------------------------------------------
# The decision
# ---------------------------------------------------------------------------------------------------
def test_a_layout_kept_within_the_noise_says_why_it_is_kept(probe_cfg, monkeypatch):
    """bf16 0.155 s, bf16 + NHWC 0.157 s: 'NHWC measured 0.98x NCHW' and no word of why the slower one."""
    times = {"fp32": 0.60, "fp32_cl": 0.50, "bf16": 0.155, "bf16_cl": 0.157}
    prec, (nhwc, why), _, _ = decide(probe_cfg, BF16_CPU, times, monkeypatch)
    assert prec.name == "bf16" and nhwc is True
    assert why == (f"auto: NHWC measured 0.99x NCHW in bf16 here; kept: the rule of thumb's layout, unless the other "
                   f"measures {train_unet.CPU_PROBE_LAYOUT_MARGIN:.2f}x or faster")


def test_bf16_slower_than_fp32_trains_in_fp32_and_says_the_measured_ratio(probe_cfg, monkeypatch, capsys):
    prec, (nhwc, why), notes, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch)
    assert prec.name == "fp32" and not prec.use_scaler
    ratio = min(XEON["fp32"], XEON["fp32_cl"]) / min(XEON["bf16"], XEON["bf16_cl"])
    assert f"auto: bf16 measured {ratio:.2f}x fp32 here; not kept" in prec.reason
    assert nhwc is True and "NHWC measured 1.14x NCHW in fp32" in why
    assert calls == [(["fp32", "fp32_cl", "bf16", "bf16_cl"], "train", 8)]  # the run's own batch
    probe = dict(notes)["probe"]
    assert "fp32 + NHWC 0.360" in probe and "bf16 + NHWC 0.510" in probe and "measured in" in probe
    # said before it runs: the banner that says what it found comes seconds to a minute later
    assert "probe: timing 4 modes on this CPU, 16 training steps" in capsys.readouterr().out


def test_the_bf16_ratio_names_the_layouts_it_compares_where_they_differ(probe_cfg, monkeypatch):
    """fp32 0.223, fp32 + NHWC 0.239, bf16 0.169: the banner said 'bf16 measured 1.41x fp32' (fp32 in NHWC, the
    layout it keeps within the margin, against bf16 in NCHW), while the probe line's NCHW times gave 1.32x."""
    times = {"fp32": 0.223, "fp32_cl": 0.239, "bf16": 0.169, "bf16_cl": 0.200}
    prec, (nhwc, why), _, _ = decide(probe_cfg, BF16_CPU, times, monkeypatch)
    assert prec.name == "bf16" and nhwc is False
    assert prec.reason.startswith(f"auto: bf16 (NCHW) measured {0.239 / 0.169:.2f}x fp32 (NHWC) here; kept")


def test_bf16_faster_by_the_margin_stays_bf16(probe_cfg, monkeypatch):
    prec, (nhwc, why), _, _ = decide(probe_cfg, BF16_CPU, EPYC, monkeypatch)
    assert prec.name == "bf16" and "bf16 measured 2.27x fp32 here; kept" in prec.reason
    assert nhwc is True and "in bf16" in why


def test_bf16_faster_but_within_the_margin_stays_fp32(probe_cfg, monkeypatch):
    """fp32 is the safer mode: a gain below CPU_PROBE_BF16_MARGIN (the probe's noise) does not buy bf16."""
    just_below = 1.0 / (train_unet.CPU_PROBE_BF16_MARGIN - 0.03)
    times = {"fp32": 1.2, "fp32_cl": 1.0, "bf16": 1.3, "bf16_cl": just_below}
    prec, _, _, _ = decide(probe_cfg, BF16_CPU, times, monkeypatch)
    assert prec.name == "fp32" and f"needs {train_unet.CPU_PROBE_BF16_MARGIN:.2f}x" in prec.reason
    times["bf16_cl"] = 1.0 / (train_unet.CPU_PROBE_BF16_MARGIN + 0.01)
    prec, _, _, _ = decide(probe_cfg, BF16_CPU, times, monkeypatch)
    assert prec.name == "bf16"


def test_layout_overrules_the_flag_rule_only_beyond_the_noise(probe_cfg, monkeypatch):
    margin = train_unet.CPU_PROBE_LAYOUT_MARGIN
    slower_nhwc = {"fp32": 1.0, "fp32_cl": margin + 0.02}  # the rule says NHWC at 8 x 128 px
    cfg = {**probe_cfg, "use_amp": False}
    _, (nhwc, why), _, _ = decide(cfg, PLAIN_CPU, slower_nhwc, monkeypatch)
    assert nhwc is False and "NCHW measured" in why and "the rule of thumb said otherwise" in why
    _, (nhwc, why), _, _ = decide(cfg, PLAIN_CPU, {"fp32": 1.0, "fp32_cl": margin - 0.03}, monkeypatch)
    assert nhwc is True and "otherwise" not in why  # within the noise: the rule's layout
    small = {**cfg, "image_size": 32, "batch_size": 2}  # the rule says NCHW; NHWC clearly faster
    _, (nhwc, _), _, _ = decide(small, PLAIN_CPU, {"fp32": 1.0, "fp32_cl": 0.5}, monkeypatch)
    assert nhwc is True


def test_precision_compares_each_at_its_fastest_layout(probe_cfg, monkeypatch):
    """bf16 NCHW vs fp32 NHWC: each precision at its own best layout, not both at one."""
    times = {"fp32": 1.0, "fp32_cl": 2.0, "bf16": 3.0, "bf16_cl": 0.5}
    prec, (nhwc, _), _, _ = decide(probe_cfg, BF16_CPU, times, monkeypatch)
    assert prec.name == "bf16" and "2.00x" in prec.reason and nhwc is True


def test_cpu_without_native_bf16_never_probes_bf16(probe_cfg, monkeypatch):
    prec, (nhwc, why), _, calls = decide(probe_cfg, PLAIN_CPU, XEON, monkeypatch)
    assert calls[0][0] == ["fp32", "fp32_cl"]
    assert prec.name == "fp32" and "no native bf16" in prec.reason and nhwc is True and "measured" in why


def test_hidden_bf16_is_a_cpu_without_it(probe_cfg, monkeypatch):
    """UNET_HIDE_NATIVE_BF16=1 hides the bf16 modes from the probe (and keys the cache apart)."""
    monkeypatch.setenv(train_unet.HIDE_NATIVE_BF16_ENV, "1")
    hw = train_unet.detect_hardware("cpu")
    _, _, _, calls = decide(probe_cfg, hw, XEON, monkeypatch)
    assert calls[0][0] == ["fp32", "fp32_cl"]
    shown = train_unet.cpu_probe_key(probe_cfg, dataclasses.replace(hw, bf16=True), "train")
    assert train_unet.cpu_probe_key(probe_cfg, hw, "train") != shown


@pytest.mark.parametrize("settings, probed", [
    ({"amp_dtype": "bfloat16"}, (False, True)),                   # explicit dtype: the layout only
    ({"channels_last": True}, (True, False)),                     # explicit layout: the precision only
    ({"amp_dtype": "bfloat16", "channels_last": False}, None),    # both explicit: no probe
    ({"cpu_probe": False}, None),                                  # the pure flag rule
    ({"use_amp": False}, (False, True)),                          # fp32 as set: the layout only
])
def test_explicit_settings_skip_their_dimension(probe_cfg, monkeypatch, settings, probed):
    cfg = {**probe_cfg, **settings}
    prec, (nhwc, why), notes, calls = decide(cfg, BF16_CPU, XEON, monkeypatch)
    assert train_unet.cpu_probe_dimensions(cfg, BF16_CPU, train_unet.decide_precision(
        BF16_CPU, cfg["use_amp"], cfg["amp_dtype"])) == (probed or (False, False))
    if probed is None:
        assert calls == [] and notes == []
        assert (nhwc, why) == train_unet.decide_channels_last(cfg, BF16_CPU, prec)
    if settings.get("amp_dtype") == "bfloat16":
        assert prec.name == "bf16"  # an explicit dtype is kept, however it measured
    if settings.get("channels_last") is True:
        assert nhwc is True and prec.name == "fp32"  # compared at the layout set: NHWC
        assert prec.reason.startswith(f"auto: bf16 measured {XEON['fp32_cl'] / XEON['bf16_cl']:.2f}x")


def test_cuda_and_a_forced_fp16_cpu_keep_their_rules(probe_cfg, monkeypatch):
    prec, layout, notes, calls = decide(probe_cfg, AMPERE, XEON, monkeypatch)
    assert calls == [] and prec.name == "bf16" and layout[0] is True and notes == []
    forced = {**probe_cfg, "amp_dtype": "float16", "force_amp_dtype": True}
    prec, (nhwc, why), _, calls = decide(forced, BF16_CPU, XEON, monkeypatch)
    assert calls == [] and prec.name == "fp16" and "measured" not in why  # no fp16 mode is ever probed


def test_a_resumed_run_that_fell_back_keeps_its_precision(probe_cfg, monkeypatch):
    kept = Precision(torch.float32, False, "kept from the checkpoint: this run fell back to fp32")
    prec, _, _, calls = decide(probe_cfg, BF16_CPU, EPYC, monkeypatch, prec=kept)
    assert prec is kept and calls[0][0]  # the layout is still probed, in fp32


def test_fp16_stays_out_of_cpu_auto_and_a_forced_one_says_why():
    assert train_unet.decide_precision(BF16_CPU).name == "bf16"
    assert train_unet.decide_precision(PLAIN_CPU).name == "fp32"  # not fp16, even with AVX512-FP16
    forced = train_unet.decide_precision(PLAIN_CPU, True, "float16", force=True)
    assert forced.name == "fp16" and f"{train_unet.CPU_FP16_SLOWDOWN} slower than fp32" in forced.reason
    unforced = train_unet.decide_precision(PLAIN_CPU, True, "float16")
    assert unforced.name == "fp32" and f"{train_unet.CPU_FP16_SLOWDOWN} slower" in unforced.warning


# ---------------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------------
def test_a_second_run_with_the_same_setting_does_not_probe(probe_cfg, monkeypatch):
    _, _, _, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert len(calls) == 1 and train_unet.cpu_probe_cache_path().is_file()
    prec, layout, notes, again = decide(probe_cfg, BF16_CPU, EPYC, monkeypatch,
                                            cached=True)  # would flip if measured
    assert again == [] and prec.name == "fp32" and "from " in dict(notes)["probe"]
    path = train_unet.cpu_probe_cache_path()
    assert str(path).startswith(str(Path(train_unet.os.environ["XDG_CACHE_HOME"]))) and path.name == "cpu_probe.json"


@pytest.mark.parametrize("change", [{"batch_size": 4}, {"image_size": 64}, {"encoder_name": "resnet34"},
                                    {"num_classes": 3}, {"in_channels": 1}, {"arch": "FPN"}])
def test_another_setting_probes_again(probe_cfg, monkeypatch, change):
    decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    _, _, _, calls = decide({**probe_cfg, **change}, BF16_CPU, XEON, monkeypatch, cached=True)
    assert len(calls) == 1


def test_other_threads_cpu_or_predict_probe_again(probe_cfg, monkeypatch):
    decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        assert len(decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)[3]) == 1
    finally:
        torch.set_num_threads(threads)
    monkeypatch.setattr(train_unet, "cpu_name", lambda: "Another CPU")
    assert len(decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)[3]) == 1
    assert decide(probe_cfg, BF16_CPU, XEON, monkeypatch, kind="predict", cached=True)[3][0][1] == "predict"


def test_a_probe_beside_busy_processes_is_used_but_not_cached(probe_cfg, monkeypatch):
    """A probe run while other processes were busy on this process's cores decides this run only: the
    next run measures again rather than keep an answer the load may have flipped."""
    def beside(share):
        monkeypatch.setattr(train_unet, "timed_beside_others", lambda run: (run(), 7.0, (share, 2)))
    beside(0.6)
    prec, _, notes, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch)
    assert len(calls) == 1 and prec.name == "fp32"  # the measured answer is used
    assert ("not cached: other processes used 60% of this process's 2 core(s) meanwhile"
            in dict(notes)["probe"])
    prec, _, notes, calls = decide(probe_cfg, BF16_CPU, EPYC, monkeypatch, cached=True)  # measured again
    assert len(calls) == 1 and prec.name == "bf16" and "not cached: other processes" in dict(notes)["probe"]
    beside(train_unet.CPU_PROBE_BUSY_SHARE)  # at the limit: quiet enough
    prec, _, notes, calls = decide(probe_cfg, BF16_CPU, EPYC, monkeypatch, cached=True)
    assert len(calls) == 1 and prec.name == "bf16" and "cached in " in dict(notes)["probe"]
    beside(0.9)  # a busy machine now does not measure again: the quiet answer stands
    prec, _, notes, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert calls == [] and prec.name == "bf16" and "from " in dict(notes)["probe"]


def test_two_probes_beside_busy_processes_that_decide_the_same_are_cached(probe_cfg, monkeypatch):
    """On a machine that is always busy every run paid the probe (61 s for an 8 s debug epoch): a busy
    probe that decides as the previous busy one (fp32 and NHWC twice, from other times) is cached; one
    that decides otherwise is not, and the next compares with it."""
    monkeypatch.setattr(train_unet, "timed_beside_others", lambda run: (run(), 7.0, (0.6, 2)))
    slower = {label: 1.3 * t for label, t in XEON.items()}  # the same decision at other times
    _, _, notes, _ = decide(probe_cfg, BF16_CPU, XEON, monkeypatch)
    assert "not cached" in dict(notes)["probe"]
    prec, _, notes, _ = decide(probe_cfg, BF16_CPU, EPYC, monkeypatch, cached=True)  # bf16: another decision
    assert prec.name == "bf16" and "not cached" in dict(notes)["probe"]
    prec, (nhwc, _), notes, calls = decide(probe_cfg, BF16_CPU, slower, monkeypatch, cached=True)
    assert len(calls) == 1 and prec.name == "fp32" and "not cached" in dict(notes)["probe"]  # not as EPYC's
    prec, (nhwc, _), notes, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert (prec.name, nhwc) == ("fp32", True) and "cached in " in dict(notes)["probe"]
    assert "as in the previous probe, which decided the same" in dict(notes)["probe"]
    prec, (nhwc, _), notes, calls = decide(probe_cfg, BF16_CPU, EPYC, monkeypatch, cached=True)
    assert calls == [] and (prec.name, nhwc) == ("fp32", True) and "from " in dict(notes)["probe"]
    entries = json.loads(train_unet.cpu_probe_cache_path().read_text())["entries"]
    assert [entry.get("busy") for entry in entries.values()] == [None]
    assert train_unet.usable_probe_entry({**next(iter(entries.values())), "busy": "yes"}) is None


def test_others_share_subtracts_this_process_and_counts_only_its_cores(monkeypatch):
    """1.5 busy core-seconds on this process's two cores in 1 s, 0.9 of them this process's own: others
    used 0.6 of 2 core-seconds, 30 %."""
    busy = iter([100.0, 101.5])
    own = iter([10.0, 10.9])
    seen = []
    monkeypatch.setattr(train_unet.os, "sched_getaffinity", lambda pid: {3, 1}, raising=False)
    monkeypatch.setattr(train_unet, "cpu_busy_seconds", lambda cpus: seen.append(cpus) or next(busy))
    monkeypatch.setattr(train_unet.time, "process_time", lambda: next(own))
    result, seconds, (share, cores) = train_unet.timed_beside_others(lambda: train_unet.time.sleep(1.0) or "ran")
    assert result == "ran" and seen == [[1, 3], [1, 3]] and cores == 2
    assert share == pytest.approx(0.6 / (2 * seconds)) and 0.2 < share <= 0.3


def test_others_share_is_unknown_for_short_runs_or_without_proc_stat(monkeypatch):
    assert train_unet.timed_beside_others(lambda: 5)[2] is None  # under 0.5 s: 10 ms ticks are too coarse
    monkeypatch.setattr(train_unet, "cpu_busy_seconds", lambda cpus: None)
    assert train_unet.timed_beside_others(lambda: train_unet.time.sleep(0.6))[2] is None
    assert train_unet.busy_probe_note(None, None, {}, None) == (None, "")


def quota_tree(root, version, levels):
    """A fake /proc/self/cgroup and /sys/fs/cgroup: this process in the last of `levels`, [(name, quota
    in µs a period of 100 ms, or None for none)] from the top down."""
    where = "/".join(name for name, _ in levels)
    root.mkdir(parents=True, exist_ok=True)
    (root / "cgroup").write_text(f"0::/{where}\n" if version == 2 else f"5:memory:/{where}\n4:cpu,cpuacct:/{where}\n")
    folder = root / "sys" / ("" if version == 2 else "cpu")
    for name, quota in levels:
        folder = folder / name
        folder.mkdir(parents=True)
        if version == 2:
            (folder / "cpu.max").write_text(f"{quota or 'max'} 100000\n")
        else:
            (folder / "cpu.cfs_quota_us").write_text(f"{quota or -1}\n")
            (folder / "cpu.cfs_period_us").write_text("100000\n")
    return root / "cgroup", root / "sys"


@pytest.mark.parametrize("version", [1, 2])
def test_a_cpu_quota_is_read_from_the_processs_cgroups_the_tightest(tmp_path, version):
    """docker --cpus=1.5 writes 150000 per 100000 µs; a Slurm job's or a pod's limit may sit a level up."""
    proc, sys_root = quota_tree(tmp_path, version, [("pod", 250000), ("job", 150000), ("task", None)])
    assert train_unet.cpu_quota(proc, sys_root) == 1.5
    proc, sys_root = quota_tree(tmp_path / "none", version, [("job", None)])
    assert train_unet.cpu_quota(proc, sys_root) == float("inf")
    assert train_unet.cpu_quota(tmp_path / "missing", sys_root) == float("inf")
    (tmp_path / "odd").write_text("garbage\n12:cpu\n")
    assert train_unet.cpu_quota(tmp_path / "odd", sys_root) == float("inf")


@pytest.fixture
def torch_threads():
    """torch's thread count restored after the test."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def test_torch_threads_are_cut_to_a_cpu_quota(monkeypatch, torch_threads, capsys, make_cfg):
    """torch counts the cores of the CPU affinity, not a container's quota: 2 threads under a quota of 1 core
    took 1.24-3.4x as long a step as 1 (BENCHMARKS.md "CPU quota"). The start-up cuts them to the quota,
    rounded up, and says so; OMP_NUM_THREADS, the user's choice, stays; no quota, no change."""
    monkeypatch.setattr(train_unet.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7}, raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(train_unet, "cpu_quota", lambda *a: 1.5)
    assert train_unet.usable_cores() == 2
    assert train_unet.worker_count({"num_workers": None}, train_unet.detect_hardware("cpu")) == 1
    torch.set_num_threads(8)
    note = train_unet.fit_cpu_threads()
    assert torch.get_num_threads() == 2 and note.startswith("torch threads 8 -> 2: the cores this process may "
                                                            "use (a CPU quota of 1.5 core(s), from its cgroup)")
    assert train_unet.fit_cpu_threads() is None  # fitted once: nothing more to say
    torch.set_num_threads(8)
    train_unet.train(make_cfg(epochs=1, cpu_probe=False))
    assert torch.get_num_threads() == 2 and "torch threads 8 -> 2" in capsys.readouterr().out
    torch.set_num_threads(8)
    monkeypatch.setenv("OMP_NUM_THREADS", "8")
    assert train_unet.fit_cpu_threads() is None and torch.get_num_threads() == 8
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(train_unet, "cpu_quota", lambda *a: float("inf"))
    assert train_unet.usable_cores() == 8 and train_unet.fit_cpu_threads() is None and torch.get_num_threads() == 8


def test_others_under_a_cpu_quota_count_only_past_the_cores_it_leaves(monkeypatch):
    """Quota 2 cores of 4: others used 2.6 of the 4 core-seconds in 1 s, this process 1.0; 0.6 of theirs
    came out of the 2 cores' worth this process may use: 30 %."""
    busy, own = iter([100.0, 103.6]), iter([10.0, 11.0])
    monkeypatch.setattr(train_unet.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(train_unet, "cpu_busy_seconds", lambda cpus: next(busy))
    monkeypatch.setattr(train_unet.time, "process_time", lambda: next(own))
    monkeypatch.setattr(train_unet, "cpu_quota", lambda *a: 2.0)
    _, seconds, (share, cores) = train_unet.timed_beside_others(lambda: train_unet.time.sleep(1.0))
    assert cores == 2 and share == pytest.approx((2.6 / seconds - 2) / 2) and 0.2 < share <= 0.3


@pytest.mark.skipif(not Path("/proc/stat").is_file() or not hasattr(os, "sched_getaffinity"),
                    reason="/proc/stat and CPU affinity are Linux's")
def test_others_share_sees_real_busy_processes_on_its_cores():
    """One spinning process per core of this process's, pinned to them, while this process sleeps: they
    used (nearly) all of those cores, whatever else the machine runs."""
    cpus = sorted(os.sched_getaffinity(0))
    if train_unet.cpu_busy_seconds(cpus) is None or train_unet.cpu_quota() != float("inf"):
        pytest.skip("/proc/stat does not number this process's CPUs (lxcfs), or a CPU quota throttles spinners")
    assert train_unet.cpu_busy_seconds(cpus) > 0 and train_unet.cpu_busy_seconds([max(cpus) + 10_000]) is None
    spin = "import os, time; os.sched_setaffinity(0, {%s}); end = time.time() + 3\nwhile time.time() < end: pass"
    procs = [subprocess.Popen([sys.executable, "-c", spin % cpu]) for cpu in cpus]
    try:
        train_unet.time.sleep(0.5)  # the spinners have started
        _, _, (share, cores) = train_unet.timed_beside_others(lambda: train_unet.time.sleep(1.0))
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
    assert cores == len(cpus) and share > 0.6


def test_a_torch_upgrade_makes_the_entry_stale(probe_cfg, monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.0.0")
    decide(probe_cfg, BF16_CPU, EPYC, monkeypatch, cached=True)
    monkeypatch.setattr(torch, "__version__", "2.9.1")
    prec, _, notes, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert len(calls) == 1 and prec.name == "fp32" and "measured in" in dict(notes)["probe"]
    entries = json.loads(train_unet.cpu_probe_cache_path().read_text())["entries"]
    assert [e["torch"] for e in entries.values()] == ["2.9.1"]  # the stale one is dropped


def test_a_stale_entry_under_the_same_key_is_not_used(probe_cfg, monkeypatch):
    """An entry whose recorded torch differs (a file edited or written by another tool) is measured anew."""
    decide(probe_cfg, BF16_CPU, EPYC, monkeypatch, cached=True)
    path = train_unet.cpu_probe_cache_path()
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        entry["torch"] = "1.13.0"
    path.write_text(json.dumps(data))
    prec, _, _, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert len(calls) == 1 and prec.name == "fp32"


def test_a_damaged_entry_is_measured_anew(probe_cfg, monkeypatch):
    decide(probe_cfg, BF16_CPU, EPYC, monkeypatch)
    path = train_unet.cpu_probe_cache_path()
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        del entry["times"]["bf16_cl"]
    path.write_text(json.dumps(data))
    _, _, notes, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert calls == [(["fp32", "fp32_cl", "bf16", "bf16_cl"], "train", 8)]  # side by side again
    entry, = json.loads(path.read_text())["entries"].values()
    assert entry["times"] == XEON


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 999, "entries": {}}), "[]"])
def test_a_corrupt_or_foreign_cache_is_measured_anew_and_rewritten(probe_cfg, monkeypatch, content):
    path = train_unet.cpu_probe_cache_path()
    path.parent.mkdir(parents=True)
    path.write_text(content)
    _, _, _, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert len(calls) == 1
    assert json.loads(path.read_text())["version"] == train_unet.CPU_PROBE_VERSION


def test_an_unwritable_cache_does_not_fail_the_run(probe_cfg, monkeypatch, tmp_path):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))
    prec, _, notes, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert prec.name == "fp32" and "not cached: " in dict(notes)["probe"]
    assert len(decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)[3]) == 1  # measured again next time


def test_without_xdg_the_cache_is_in_the_home_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert train_unet.cpu_probe_cache_path() == tmp_path / ".cache" / "unet-amp" / "cpu_probe.json"


# ---------------------------------------------------------------------------------------------------
# torchrun: rank 0 probes, the others use its answer
# ---------------------------------------------------------------------------------------------------
def test_other_ranks_use_rank_0s_answer(probe_cfg, monkeypatch):
    shared = []

    def gather(obj):
        shared.append(obj)
        return [(XEON, "from rank 0"), obj]
    monkeypatch.setattr(train_unet, "DIST", train_unet.Dist(rank=1, world=2))
    monkeypatch.setattr(train_unet, "gather_setup", gather)
    prec, (nhwc, _), notes, calls = decide(probe_cfg, BF16_CPU, EPYC, monkeypatch)
    assert calls == [] and shared == [None] and not train_unet.cpu_probe_cache_path().exists()
    assert prec.name == "fp32" and nhwc is True and dict(notes)["probe"].endswith("from rank 0")


def test_rank_0_measures_and_shares(probe_cfg, monkeypatch):
    shared = []
    monkeypatch.setattr(train_unet, "DIST", train_unet.Dist(rank=0, world=2))
    monkeypatch.setattr(train_unet, "gather_setup", lambda obj: shared.append(obj) or [obj, None])
    prec, _, _, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch)
    assert len(calls) == 1 and shared[0][0] == XEON and prec.name == "fp32"


# ---------------------------------------------------------------------------------------------------
# train() and predict()
# ---------------------------------------------------------------------------------------------------
class Announced(Exception):
    pass


def banner_of_train(cfg, monkeypatch, capsys, epochs=100):
    """train(cfg) up to announce_run (the banner is printed before it): (stdout, the run's precision). Its
    epochs set to `epochs`, 100 unless given: a run shorter than the probe is not probed (training_job_steps)."""
    seen = {}

    def announce(cfg, hw, run, sizes, extra):
        seen.update(prec=run.prec.name, channels_last=cfg["channels_last"])
        raise Announced
    monkeypatch.setattr(train_unet, "announce_run", announce)
    with pytest.raises(Announced):
        train_unet.train({**cfg, "epochs": epochs})
    return capsys.readouterr().out, seen


def test_the_default_run_on_a_slow_bf16_cpu_trains_in_fp32_with_the_ratio_in_the_banner(
        make_cfg, monkeypatch, capsys):
    monkeypatch.setattr(train_unet, "detect_hardware", lambda device="auto": BF16_CPU)
    calls = fake_timings(monkeypatch, XEON)
    cfg = make_cfg(use_amp=True, channels_last="auto", cpu_probe=True, batch_size="auto", image_size=128)
    out, seen = banner_of_train(cfg, monkeypatch, capsys)
    assert seen == {"prec": "fp32", "channels_last": True}
    assert calls[0][2] == train_unet.AUTO_BATCH_FALLBACK  # probed at the resolved batch
    assert "precision    fp32 (auto: bf16 measured 0.71x fp32 here; not kept: needs 1.15x)" in out
    assert "layout       channels_last (NHWC) (auto: NHWC measured 1.14x NCHW in fp32 here)" in out
    assert "probe        s/step at batch 8 x 128px: fp32 0.410, fp32 + NHWC 0.360" in out
    out, seen = banner_of_train(cfg, monkeypatch, capsys)  # the same machine and setting: the cache
    assert len(calls) == 1 and seen["prec"] == "fp32" and "probe" in out and "from " in out


def test_a_run_shorter_than_the_probe_is_not_probed(make_cfg, monkeypatch, capsys):
    """A short run (a debug run of a few steps) paid the probe, on a busy machine a minute uncached every
    time, for seconds of training: fewer training steps left than the probe takes, the flag rule."""
    monkeypatch.setattr(train_unet, "detect_hardware", lambda device="auto": BF16_CPU)
    calls = fake_timings(monkeypatch, XEON)
    train_unet.cpu_probe_cache_path().unlink(missing_ok=True)
    cfg = make_cfg(use_amp=True, channels_last="auto", cpu_probe=True, image_size=128, batch_size=8, epochs=1)
    n_train = len(train_unet.split_pairs(cfg)[0])
    steps = n_train // 8
    assert steps < 16  # 4 modes x (1 + 3) training steps
    out, _ = banner_of_train(cfg, monkeypatch, capsys, epochs=1)
    assert calls == [] and f"probe        skipped: this job is {steps} training step(s), the probe 16" in out
    banner_of_train(cfg, monkeypatch, capsys, epochs=-(-16 // steps))  # as long as the probe: probed
    assert len(calls) == 1


def test_a_fast_bf16_cpu_stays_bf16(make_cfg, monkeypatch, capsys):
    monkeypatch.setattr(train_unet, "detect_hardware", lambda device="auto": BF16_CPU)
    fake_timings(monkeypatch, EPYC)
    cfg = make_cfg(use_amp=True, channels_last="auto", cpu_probe=True, image_size=128, batch_size=8)
    out, seen = banner_of_train(cfg, monkeypatch, capsys)
    assert seen == {"prec": "bf16", "channels_last": True} and "bf16 measured 2.27x fp32 here; kept" in out


def test_predict_uses_the_inference_probe(make_cfg, monkeypatch, tmp_path, data_dir, capsys):
    cfg = make_cfg(epochs=1)
    train_unet.train(cfg)
    monkeypatch.setattr(train_unet, "detect_hardware", lambda device="auto": BF16_CPU)
    calls = fake_timings(monkeypatch, {"fp32": 0.2, "fp32_cl": 0.3, "bf16": 0.4, "bf16_cl": 0.5})
    monkeypatch.setattr(train_unet, "CPU_PROBE_ROUNDS", 2)  # a probe of 4 x 3 forwards: the 12 images' job
    opts = {"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(data_dir / "images"),
            "output": str(tmp_path / "pred"), "progress": False, "batch_size": 1}
    capsys.readouterr()
    result = train_unet.predict(opts)
    out = capsys.readouterr().out
    assert calls == [(["fp32", "fp32_cl", "bf16", "bf16_cl"], "predict", 1)]
    assert result["precision"] == "fp32" and result["predicted"] == 12
    assert "contiguous layout, fp32 (auto: bf16 measured 0.50x fp32 here" in out
    train_unet.predict(opts)
    assert len(calls) == 1  # cached
    assert train_unet.predict({**opts, "cpu_probe": False})["precision"] == "bf16"  # the flag rule


def test_predict_follows_the_probe_layout(make_cfg, monkeypatch):
    model_cfg = make_cfg(image_size=64)
    fake_timings(monkeypatch, {"fp32": 0.2, "fp32_cl": 0.1})
    opts = {"batch_size": 1, "use_amp": False, "amp_dtype": "auto", "cpu_probe": True}
    fp32 = train_unet.decide_precision(PLAIN_CPU, use_amp=False)
    prec, layout = train_unet.predict_modes(model_cfg, opts, PLAIN_CPU, fp32, [])
    model, cfg = train_unet.predict_layout(train_unet.build_model(model_cfg).eval(), model_cfg, opts,
                                           PLAIN_CPU, prec, layout)
    assert cfg["channels_last"] is True  # batch 1 x 64 px: NCHW by the rule, NHWC as measured
    assert model.encoder.conv1.weight.is_contiguous(memory_format=torch.channels_last)


# ---------------------------------------------------------------------------------------------------
# The real probe, once, on tiny settings
# ---------------------------------------------------------------------------------------------------
@pytest.mark.real_cpu_probe
def test_the_real_probe_end_to_end(make_cfg, cpu_hw):
    cfg = make_cfg(use_amp=True, channels_last="auto", cpu_probe=True, image_size=32, batch_size=2)
    prec = train_unet.decide_precision(cpu_hw)
    rng = torch.random.get_rng_state()
    notes = []
    chosen, (nhwc, why) = train_unet.cpu_probe_decision(cfg, cpu_hw, prec, notes)
    assert torch.equal(torch.random.get_rng_state(), rng)  # a probed run trains like a cached one
    entry, = json.loads(train_unet.cpu_probe_cache_path().read_text())["entries"].values()
    expected = ["fp32", "fp32_cl"] + (["bf16", "bf16_cl"] if cpu_hw.bf16 else [])
    assert sorted(entry["times"]) == sorted(expected) and all(t > 0 for t in entry["times"].values())
    assert entry["torch"] == torch.__version__ and entry["seconds"] > 0
    assert "measured in" in dict(notes)["probe"] and "measured" in why
    assert chosen.name in (("fp32", "bf16") if cpu_hw.bf16 else ("fp32",))
    again = []
    assert train_unet.cpu_probe_decision(cfg, cpu_hw, prec, again) == (chosen, (nhwc, why))
    assert "from " in dict(again)["probe"]


# ---------------------------------------------------------------------------------------------------
# Review of the probe (the suite's hermeticity, damaged caches, the banner's notes, wasted modes, no
# home folder, memory, small predict jobs)
# ---------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def seen_by_a_module_fixture():
    """What a module-scoped fixture that trains (test_predict's models, test_notebooks' run) sees."""
    return train_unet.measure_cpu_modes, os.environ.get("XDG_CACHE_HOME")


def test_module_fixtures_train_with_the_fake_probe_and_a_temporary_cache(seen_by_a_module_fixture,
                                                                          tmp_path_factory):
    measure, xdg = seen_by_a_module_fixture
    assert measure.__name__ == "rule_confirming_timings"
    assert xdg and Path(xdg).is_relative_to(tmp_path_factory.getbasetemp())


def write_cache(entries):
    path = train_unet.cpu_probe_cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"version": train_unet.CPU_PROBE_VERSION, "entries": entries}))
    return path


def edit_entries(edit):
    path = train_unet.cpu_probe_cache_path()
    data = json.loads(path.read_text())
    for entry in data["entries"].values():
        edit(entry)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("entry", ["garbage", None, 3, {"torch": torch.__version__, "times": "garbage"},
                                   {"torch": torch.__version__, "times": {"fp32": 1.0}, "date": 5, "seconds": 1}])
def test_a_malformed_entry_of_another_setting_is_skipped(probe_cfg, monkeypatch, entry):
    path = write_cache({"someone else's key": entry})
    prec, _, _, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert len(calls) == 1 and prec.name == "fp32"
    assert list(json.loads(path.read_text())["entries"]) == [train_unet.cpu_probe_key(probe_cfg, BF16_CPU, "train")]


@pytest.mark.parametrize("extra", [0.5, "fast", None])
def test_an_unknown_mode_in_a_cached_entry_is_ignored(probe_cfg, monkeypatch, extra):
    """A future version's mode or a hand edit: the entry's own modes are still used, the banner lists
    only the modes compared."""
    decide(probe_cfg, BF16_CPU, XEON, monkeypatch)
    edit_entries(lambda entry: entry["times"].update(fp16=extra))
    prec, _, notes, calls = decide(probe_cfg, BF16_CPU, EPYC, monkeypatch, cached=True)
    assert calls == [] and prec.name == "fp32" and "fp16" not in dict(notes)["probe"]


@pytest.mark.parametrize("field, value", [("seconds", "7"), ("date", None), ("seconds", None)])
def test_a_cached_entry_with_a_bad_field_is_measured_anew(probe_cfg, monkeypatch, field, value):
    decide(probe_cfg, BF16_CPU, XEON, monkeypatch)
    edit_entries(lambda entry: entry.update({field: value}))
    _, _, notes, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert len(calls) == 1 and "measured in" in dict(notes)["probe"]


def test_a_bad_time_of_one_mode_measures_the_compared_modes_again_side_by_side(probe_cfg, monkeypatch):
    decide(probe_cfg, BF16_CPU, XEON, monkeypatch)
    edit_entries(lambda entry: entry["times"].update(bf16="0.5", fp32=-1))
    _, _, _, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert calls == [(["fp32", "fp32_cl", "bf16", "bf16_cl"], "train", 8)]


@pytest.mark.parametrize("times, note", [(XEON, False), (EPYC, True)])
def test_the_tf32_note_follows_the_measured_precision(make_cfg, monkeypatch, capsys, restore_matmul_precision,
                                                      times, note):
    """tf32_matmul_precision "has no effect on autocast ops" only where the probe kept bf16. On a GPU before
    Ampere it changes nothing at all (it said it changes fp32 matmuls/convolutions, the banner 'strict fp32')."""
    monkeypatch.setattr(train_unet, "detect_hardware", lambda device="auto": BF16_CPU)
    fake_timings(monkeypatch, times)
    cfg = make_cfg(use_amp=True, channels_last="auto", cpu_probe=True, image_size=128, batch_size=8,
                   tf32_matmul_precision="high")
    out, seen = banner_of_train(cfg, monkeypatch, capsys)
    assert seen["prec"] == ("bf16" if note else "fp32")
    assert ("has no effect on autocast ops" in out) is note
    assert "changes nothing here" not in out  # on a CPU 'medium' lets oneDNN run fp32 matmuls in bf16
    t4 = train_unet.Hardware("cuda:0", "cuda", "Fake T4", (7, 5), False, True, "compute capability 7.5")
    said = train_unet.tf32_note("high", train_unet.decide_precision(t4, False), t4)
    assert said == "tf32_matmul_precision=high changes nothing here: TF32 needs a CUDA GPU of compute capability 8.0 " \
                   "or more"


@pytest.mark.parametrize("times, used", [(XEON, "float32"), (EPYC, "bfloat16")])
def test_a_float16_fallback_on_a_cpu_is_probed_as_auto(probe_cfg, monkeypatch, times, used):
    """amp_dtype=float16 falls back to auto's bf16 on a CPU: the probe decides it as for auto, and the
    warning names what is used."""
    cfg = {**probe_cfg, "amp_dtype": "float16"}
    prec, _, _, calls = decide(cfg, BF16_CPU, times, monkeypatch)
    assert calls[0][0] == ["fp32", "fp32_cl", "bf16", "bf16_cl"]
    assert prec.name == {"float32": "fp32", "bfloat16": "bf16"}[used]
    assert f"using {used} instead" in prec.warning and "amp_dtype=float16" in prec.warning


def test_the_banner_warns_about_the_precision_used(make_cfg, monkeypatch, capsys):
    monkeypatch.setattr(train_unet, "detect_hardware", lambda device="auto": BF16_CPU)
    fake_timings(monkeypatch, XEON)
    cfg = make_cfg(use_amp=True, amp_dtype="float16", channels_last="auto", cpu_probe=True, image_size=128,
                   batch_size=8)
    out, seen = banner_of_train(cfg, monkeypatch, capsys)
    assert seen["prec"] == "fp32" and "using float32 instead" in out and "using bfloat16" not in out


@pytest.mark.parametrize("settings, modes", [
    ({"use_amp": False}, ["fp32", "fp32_cl"]),
    ({"amp_dtype": "bfloat16"}, ["bf16", "bf16_cl"]),
    ({"channels_last": True}, ["fp32_cl", "bf16_cl"]),
    ({"channels_last": False}, ["fp32", "bf16"]),
    ({}, ["fp32", "fp32_cl", "bf16", "bf16_cl"]),
])
def test_the_probe_times_only_the_modes_it_compares(probe_cfg, monkeypatch, settings, modes):
    _, _, notes, calls = decide({**probe_cfg, **settings}, BF16_CPU, XEON, monkeypatch)
    assert calls == [(modes, "train", 8)]
    per_step = dict(notes)["probe"].split(": ", 1)[1].split(";")[0]
    assert per_step.count(",") + 1 == len(modes)  # one time per mode compared


def test_a_later_run_comparing_modes_not_cached_measures_them_all_side_by_side(probe_cfg, monkeypatch):
    """A ratio of times from different runs would carry their different loads: a run that compares a mode
    the cache lacks times every mode it compares, together; the entry then holds all of them."""
    assert decide({**probe_cfg, "use_amp": False}, BF16_CPU, XEON, monkeypatch)[3] == [(["fp32", "fp32_cl"], "train", 8)]
    assert decide({**probe_cfg, "use_amp": False}, BF16_CPU, XEON, monkeypatch, cached=True)[3] == []
    prec, _, _, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert calls == [(["fp32", "fp32_cl", "bf16", "bf16_cl"], "train", 8)] and prec.name == "fp32"
    assert decide(probe_cfg, BF16_CPU, EPYC, monkeypatch, cached=True)[3] == []  # all four cached now


@pytest.fixture
def no_home(monkeypatch):
    """A container user with no $HOME and no passwd entry."""
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.delenv("HOME", raising=False)

    def missing(uid):
        raise KeyError(f"getpwuid(): uid not found: {uid}")
    monkeypatch.setattr(pwd, "getpwuid", missing)


def test_without_a_home_folder_the_probe_runs_uncached(probe_cfg, monkeypatch, no_home):
    assert train_unet.cpu_probe_cache_path() is None
    prec, _, notes, calls = decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    assert len(calls) == 1 and prec.name == "fp32" and "not cached: no home folder" in dict(notes)["probe"]


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert train_unet.cpu_probe_cache_path() == tmp_path / ".cache" / "unet-amp" / "cpu_probe.json"


def test_other_cpu_flags_probe_again(probe_cfg, monkeypatch):
    decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)
    flags = train_unet.cpu_flags()
    # Toggle a flag, whatever this CPU has: adding amx_tile changed nothing on a Xeon that shows AMX.
    monkeypatch.setattr(train_unet, "cpu_flags", lambda: set(flags) ^ {"amx_tile"})
    assert len(decide(probe_cfg, BF16_CPU, XEON, monkeypatch, cached=True)[3]) == 1


def test_patch_mode_predict_probes_at_the_tile_batch(make_cfg, monkeypatch):
    model_cfg = {**make_cfg(), "data_mode": "patch", "tile_batch_size": 5}
    calls = fake_timings(monkeypatch, XEON)
    opts = {"batch_size": 1, "use_amp": False, "amp_dtype": "auto", "cpu_probe": True}
    fp32 = train_unet.decide_precision(PLAIN_CPU, use_amp=False)
    train_unet.predict_modes(model_cfg, opts, PLAIN_CPU, fp32, [])
    assert calls == [(["fp32", "fp32_cl"], "predict", 5)]


@pytest.mark.parametrize("kind", ["train", "predict"])
def test_the_probe_builds_one_model_per_layout_and_frees_them(make_cfg, monkeypatch, kind):
    """Autocast does not change the model: fp32 and bf16 of one layout share it (2 models, not 4)."""
    import conftest
    built = []
    real_build = train_unet.build_model

    def build(cfg):
        model = real_build(cfg)
        built.append(weakref.ref(model))
        return model
    monkeypatch.setattr(train_unet, "build_model", build)
    monkeypatch.setattr(train_unet, "alternate_timings", lambda runs, rounds, hw: {name: [1.0] for name in runs})
    cfg = make_cfg(image_size=32, batch_size=2)
    times = conftest.REAL_MEASURE_CPU_MODES(cfg, PLAIN_CPU, list(train_unet.CPU_PROBE_MODES), kind)
    assert sorted(times) == sorted(train_unet.CPU_PROBE_MODES) and len(built) == 2
    assert all(ref() is None for ref in built)  # freed on return


def test_a_predict_job_shorter_than_the_probe_is_not_probed(make_cfg, monkeypatch):
    model_cfg = make_cfg(image_size=64)
    calls = fake_timings(monkeypatch, XEON)
    opts = {"batch_size": 8, "use_amp": True, "amp_dtype": "auto", "cpu_probe": True}
    bf16, notes = train_unet.decide_precision(BF16_CPU), []
    images = [Path(f"{i}.png") for i in range(16 * 8)]  # fit mode counts them, never opens them
    prec, (nhwc, why) = train_unet.predict_modes(model_cfg, opts, BF16_CPU, bf16, notes, images[:20])
    assert calls == [] and prec is bf16 and "measured" not in why  # 3 forwards: the flag rule
    assert "skipped: this job is 3 forward(s), the probe 16" in dict(notes)["probe"]
    train_unet.predict_modes(model_cfg, opts, BF16_CPU, bf16, [], images)
    assert len(calls) == 1  # a job as long as the probe is probed, and cached ...
    notes = []
    prec, _ = train_unet.predict_modes(model_cfg, opts, BF16_CPU, bf16, notes, images[:3])
    assert len(calls) == 1 and prec.name == "fp32" and "from " in dict(notes)["probe"]  # ... for small jobs too


def test_a_patch_mode_job_counts_its_tiles_so_one_large_image_is_probed(make_cfg, monkeypatch, tmp_path):
    """One 600² image through 64 px tiles at overlap 0.25 is 13 x 13 tiles, 43 forwards of 4: longer than
    the probe (it used to count as 1 forward, and a single large image was never probed)."""
    model_cfg = {**make_cfg(image_size=64, data_mode="patch"), "tile_batch_size": 4, "tile_overlap": 0.25}
    cv2.imwrite(str(tmp_path / "large.png"), np.zeros((600, 600, 3), np.uint8))
    cv2.imwrite(str(tmp_path / "small.png"), np.zeros((60, 70, 3), np.uint8))
    (tmp_path / "broken.png").write_bytes(b"not a png")
    opts = {"batch_size": 8, "use_amp": True, "amp_dtype": "auto", "cpu_probe": True}
    assert train_unet.predict_forwards([tmp_path / "large.png"], model_cfg, opts, enough=10**6) == 43
    assert train_unet.predict_forwards([tmp_path / "small.png", tmp_path / "broken.png"], model_cfg, opts) == 2
    assert train_unet.predict_forwards([tmp_path / "large.png"], {**model_cfg, "patch_scale": 0.5}, opts,
                                       enough=10**6) == 9  # 300²: 6 x 6 tiles
    calls, bf16 = fake_timings(monkeypatch, EPYC), train_unet.decide_precision(BF16_CPU)
    notes = []
    train_unet.predict_modes(model_cfg, opts, BF16_CPU, bf16, notes, [tmp_path / "small.png"])
    assert calls == [] and "skipped: this job is 1 forward(s)" in dict(notes)["probe"]
    prec, _ = train_unet.predict_modes(model_cfg, opts, BF16_CPU, bf16, [], [tmp_path / "large.png"])
    assert len(calls) == 1 and calls[0][2] == 4 and prec.name == "bf16"  # probed at 4 tiles a forward


@pytest.mark.real_cpu_probe
def test_the_real_inference_probe(make_cfg, cpu_hw, monkeypatch):
    cfg = make_cfg(use_amp=True, channels_last="auto", cpu_probe=True, image_size=32, batch_size=2)
    forwards, real_forward = [], train_unet.eval_forward

    def forward(model, x, layout, prec, hw):
        forwards.append((x.shape[0], layout["channels_last"], prec.name, model.training))
        return real_forward(model, x, layout, prec, hw)
    monkeypatch.setattr(train_unet, "eval_forward", forward)
    rng, notes = torch.random.get_rng_state(), []
    chosen, (nhwc, why) = train_unet.cpu_probe_decision(cfg, cpu_hw, train_unet.decide_precision(cpu_hw), notes,
                                                       kind="predict")
    assert torch.equal(torch.random.get_rng_state(), rng)
    entry, = json.loads(train_unet.cpu_probe_cache_path().read_text())["entries"].values()
    expected = ["fp32", "fp32_cl"] + (["bf16", "bf16_cl"] if cpu_hw.bf16 else [])
    assert sorted(entry["times"]) == sorted(expected) and all(t > 0 for t in entry["times"].values())
    modes = {(2, train_unet.CPU_PROBE_MODES[label][1], train_unet.CPU_PROBE_MODES[label][0], False)
             for label in expected}
    assert len(forwards) == len(expected) * (1 + train_unet.CPU_PROBE_ROUNDS) and set(forwards) == modes
    assert dict(notes)["probe"].startswith("s/forward at batch 2 x 32px") and "measured" in why
    assert chosen.name in (("fp32", "bf16") if cpu_hw.bf16 else ("fp32",))


def test_a_cached_answer_never_mixes_times_of_different_runs(probe_cfg, monkeypatch):
    """A (use_amp=False: fp32's two layouts, a quiet machine), then B (channels_last=True: both precisions
    in NHWC, a loaded machine: bf16 NHWC is not cached), then A again: B's times replaced the entry, so A
    measures its two modes side by side again rather than set its quiet fp32 NCHW beside B's loaded fp32
    NHWC (which would make NCHW look 3x faster)."""
    fp32_only = {**probe_cfg, "use_amp": False}
    decide(fp32_only, BF16_CPU, XEON, monkeypatch)
    loaded = {"fp32_cl": 1.2, "bf16_cl": 1.5}
    decide({**probe_cfg, "channels_last": True}, BF16_CPU, loaded, monkeypatch, cached=True)
    entry, = json.loads(train_unet.cpu_probe_cache_path().read_text())["entries"].values()
    assert entry["times"] == loaded
    _, (nhwc, _), _, calls = decide(fp32_only, BF16_CPU, XEON, monkeypatch, cached=True)
    assert calls == [(["fp32", "fp32_cl"], "train", 8)] and nhwc is True
