"""DDP under torchrun on the CPU (2 processes, gloo): a short run, exact validation, cross-loading."""
import contextlib
import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import train_unet

ROOT = Path(__file__).resolve().parents[1]


def torchrun(*args, nproc=2, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
           str(ROOT / "train_unet.py"), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def history(ckpt):
    with open(Path(ckpt) / "history.csv") as f:
        return list(csv.DictReader(f))


def single_process_val_iou(ckpt_path):
    hw = train_unet.detect_hardware("cpu")
    model, cfg = train_unet.load_model(ckpt_path, hw)
    cfg = {**cfg, "progress": False}
    train_pairs, val_pairs = train_unet.prepare_data(cfg)
    _, val_loader = train_unet.build_loaders(train_pairs, val_pairs, cfg, hw)
    prec = train_unet.decide_precision(hw, use_amp=False)
    return train_unet.evaluate(model, val_loader, train_unet.SegLoss(cfg["num_classes"], cfg["loss"]),
                               prec, hw, cfg)["iou"]


@pytest.fixture
def ddp_args(make_data, tmp_path):
    # 9 val images: 5 on rank 0 and 4 on rank 1, so an uneven split is exercised.
    data = make_data(count=30, size=32)
    return [f"data_dir={data}", "image_size=32", "batch_size=2", "device=cpu", "progress=False",
            "encoder_name=resnet18", "val_fraction=0.3", "accumulation_steps=2"]


def test_ddp_run_matches_single_process_evaluation_and_cross_loads(ddp_args, tmp_path):
    ckpt = tmp_path / "ddp"
    out = torchrun(*ddp_args, "epochs=1", f"checkpoint_dir={ckpt}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines().count("unet-amp") == 1, "only rank 0 prints the banner"  # its title line
    assert "distributed: 2 processes (gloo)" in out.stdout
    assert sorted(p.name for p in ckpt.iterdir()) == ["best.pt", "config.json", "history.csv", "last.pt",
                                                      "tensorboard"]
    assert len(list((ckpt / "tensorboard").iterdir())) == 1, "only rank 0 writes TensorBoard events"
    rows = history(ckpt)
    assert len(rows) == 1
    # 21 train images -> 10 per rank -> 5 batches of 2 -> 3 optimizer steps (2 + a short group of 1)
    assert int(rows[0]["optimizer_steps"]) == 3
    assert single_process_val_iou(ckpt / "last.pt") == pytest.approx(float(rows[0]["val_iou"]), abs=1e-12)

    # A DDP checkpoint resumes in a single process ...
    cfg = train_unet.parse_overrides(ddp_args + ["epochs=2", "resume=True", f"checkpoint_dir={ckpt}"])
    result = train_unet.train(cfg)
    assert [int(r["epoch"]) for r in result["history"]] == [1, 2]
    # ... and a single-process checkpoint resumes under DDP.
    out = torchrun(*ddp_args, "epochs=3", "resume=True", f"checkpoint_dir={ckpt}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert [int(r["epoch"]) for r in history(ckpt)] == [1, 2, 3]
    state = torch.load(ckpt / "last.pt", weights_only=True)
    assert not any(k.startswith(("module.", "_orig_mod.")) for k in state["model"])
    assert single_process_val_iou(ckpt / "last.pt") == pytest.approx(float(history(ckpt)[-1]["val_iou"]),
                                                                     abs=1e-12)


def test_ddp_patch_mode_validates_whole_images_exactly_once(tmp_path):
    """Patch mode: each rank validates its share of whole images by sliding window; the all-reduced
    IoU equals one process's over every image (3 val images: 2 on rank 0, 1 on rank 1)."""
    from test_patch import write_scenes

    data, ckpt = write_scenes(tmp_path / "scenes", count=8, size=(70, 100)), tmp_path / "ddp_patch"
    out = torchrun(f"data_dir={data}", "data_mode=patch", "image_size=32", "batch_size=2", "device=cpu",
                   "progress=False", "val_fraction=0.3", "epochs=1", "tile_batch_size=4", f"checkpoint_dir={ckpt}")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "patch mode: " in out.stdout and "sliding window" in out.stdout
    assert single_process_val_iou(ckpt / "last.pt") == pytest.approx(float(history(ckpt)[0]["val_iou"]), abs=1e-12)


@pytest.mark.parametrize("bad", ["missing", "mask"])
def test_a_data_error_every_process_meets_stops_the_group_with_its_message_once(tmp_path, bad):
    """A data_dir not found, or a mask every process judged from the exchanged data check, was printed by each
    process, tagged [rank 0] and [rank 1]: now once, untagged, as a config error."""
    data = tmp_path / "missing"
    if bad == "mask":
        data = train_unet.generate_shapes_dataset(tmp_path / "data", count=6, size=32)
        first = sorted((data / "masks").iterdir())[0]
        cv2.imwrite(str(first), np.where(cv2.imread(str(first), cv2.IMREAD_GRAYSCALE) > 0, 7, 0).astype(np.uint8))
    out = torchrun(f"data_dir={data}", "device=cpu", f"checkpoint_dir={tmp_path / 'c'}", "cpu_probe=False",
                   timeout=120)
    assert out.returncode != 0
    # Our one-line message comes before anything else torchrun prints about the failed group.
    lines = out.stderr.splitlines()
    errors = [i for i, line in enumerate(lines) if line.startswith("error:")]
    said = r"data_dir .*missing not found: create" if bad == "missing" else r"mask .* holds values \[0, 7\]"
    assert len(errors) == 1 and re.match(rf"error: {said}", lines[errors[0]]), out.stderr
    assert not any("Traceback" in line for line in lines[:errors[0]])


def test_an_error_only_rank_0_checks_leaves_no_traceback_on_the_others(tmp_path):
    """checkpoint_dir is checked on rank 0 alone: rank 1, waiting at the next collective, printed gloo's
    'Connection closed by peer' in 25 lines of traceback after rank 0's one-line error."""
    (tmp_path / "a_file").write_text("x")
    out = torchrun(f"data_dir={tmp_path / 'data'}", "device=cpu", f"checkpoint_dir={tmp_path / 'a_file' / 'c'}",
                   "cpu_probe=False", timeout=120)
    assert out.returncode != 0
    assert re.search(r"^error: \[rank 0\] checkpoint_dir .* is not writable", out.stderr, re.M), out.stderr
    assert "Connection closed by peer" not in out.stderr and "[rank1]: Traceback" not in out.stderr, out.stderr
    # rank 1 stops unsaid: it had said 'another process ... ended; last.pt is intact: resume=True continues', a
    # resume into the same folder that fails alike
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "resume=True" not in out.stderr, out.stderr


def test_a_resume_refusal_every_process_meets_is_printed_once(tmp_path):
    """The README's 'a config error is printed once' held for the command line's keys only: a resume refusal
    (here: no last.pt), which every process meets alike, was printed by each, tagged [rank 0] and [rank 1]."""
    out = torchrun(f"data_dir={tmp_path / 'data'}", "device=cpu", f"checkpoint_dir={tmp_path / 'c'}", "resume=True",
                   "cpu_probe=False", timeout=120)
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: resume=True but {tmp_path / 'c' / 'last.pt'} does "
                                                     f"not exist"), out.stderr
    assert "Traceback" not in out.stderr.split(errors[0])[0], out.stderr  # torchrun's own report comes after


def test_sync_batchnorm_on_cpu_is_a_clear_error(make_cfg):
    with pytest.raises(train_unet.UserError, match="sync_batchnorm=True needs CUDA"):
        train_unet.train(make_cfg(sync_batchnorm=True))


def test_processes_on_gpus_of_different_generations_train_alike(monkeypatch):
    """A V100 rank decides fp16 + GradScaler, an A100 rank bf16 and NHWC: DDP averaged scaled with unscaled
    gradients and NCHW with NHWC element orders, and the replicas drifted apart without a word. All now
    take the safest precision each runs natively (here fp32: bf16 is not native on the V100) and rank 0's
    layout."""
    import types

    volta = types.SimpleNamespace(fp16=True, bf16=False)
    fp16 = train_unet.Precision.of(torch.float16, "auto")
    others = [("fp16", {"fp16": True, "bf16": False, "fp32": True}, (False, "rule")),
              ("bf16", {"fp16": True, "bf16": True, "fp32": True}, (True, "rule"))]
    monkeypatch.setattr(train_unet, "gather_setup", lambda obj: others)
    notes = []
    prec, layout = train_unet.ranks_agree(fp16, (False, "rule"), volta, notes)
    assert prec.name == "fp32" and not prec.use_scaler and layout == (False, "rank 0's, shared by every process (rule)")
    assert notes == [("ranks", "agreed by the 2 processes, which decided fp16, bf16 on their devices: all train "
                                "in fp32, the safest all run natively")]
    others[0] = ("fp16", {"fp16": True, "bf16": True, "fp32": True}, (False, "rule"))  # both run bf16 natively
    assert train_unet.ranks_agree(fp16, (False, "rule"), volta, [])[0].name == "bf16"
    same = [("bf16", {"fp16": True, "bf16": True, "fp32": True}, (True, "rule"))] * 2
    monkeypatch.setattr(train_unet, "gather_setup", lambda obj: same)
    bf16 = train_unet.Precision.of(torch.bfloat16, "auto")
    assert train_unet.ranks_agree(bf16, (True, "rule"), volta, notes) == (bf16, (True, "rule"))


@pytest.mark.parametrize("resume, world, fix", [
    (False, 2, "lower batch_size or add images"),
    (True, 2, "resume on at most 1 process(es) (batch_size is the run's)"),  # lowering batch_size was refused
    (True, 1, "the run trained on more: were files removed from data_dir? put them back, or start a new run"),
])
def test_too_few_images_per_process_gives_a_fix_a_resume_accepts(make_cfg, monkeypatch, resume, world, fix):
    """Resumed on 2 processes, 14 images (7 each) for batch_size=8 said 'lower batch_size', which the resume
    then refused: a dead end."""
    monkeypatch.setattr(train_unet, "DIST", train_unet.Dist(rank=0, world=world))
    pairs = [(f"{i}.png", f"{i}.png") for i in range(14 if world == 2 else 7)]
    with pytest.raises(train_unet.UserError) as info:
        train_unet.check_enough_samples(pairs, make_cfg(batch_size=8, resume=resume))
    assert str(info.value).endswith(f"fewer than batch_size=8: {fix}")


def test_images_left_out_under_torchrun_are_said_to_even_the_shares(make_cfg, monkeypatch, capsys):
    """3 images on 2 processes at batch_size=1: one left out to give each process as many, which the line
    called 'a full last batch only' (user test)."""
    monkeypatch.setattr(train_unet, "DIST", train_unet.Dist(rank=1, world=2))  # not rank 0: writes no config.json
    train_unet.announce_run(make_cfg(batch_size=1), train_unet.detect_hardware("cpu"), None, (3, 1, 1, 1, 3), {})
    assert "1 random training image(s) left out each epoch (full batches only, an equal share per process)" in \
        capsys.readouterr().out
    assert train_unet.patch_summary(make_cfg(), 3, 1).startswith(
        "patch mode: 3 patches of 64x64 per epoch (1 more left out at random each epoch: full batches only, an equal "
        "share per process)")


@pytest.mark.parametrize("batch_size, resume, fix", [
    (1, False, "run on at most 3 process(es), or add images"),
    (2, False, "lower batch_size or add images"),  # 3 processes would hold 1 each: still fewer than 2
    (1, True, "resume on at most 3 process(es) (batch_size is the run's)"),
    (2, True, "resume on at most 1 process(es) (batch_size is the run's)"),
])
def test_fewer_images_than_processes_says_to_run_on_fewer(make_cfg, monkeypatch, batch_size, resume, fix):
    """3 training images on 4 processes at batch_size=1 said 'lower batch_size or add images' (user test):
    batch_size cannot go below 1."""
    monkeypatch.setattr(train_unet, "DIST", train_unet.Dist(rank=0, world=4))
    pairs = [(f"{i}.png", f"{i}.png") for i in range(3)]
    with pytest.raises(train_unet.UserError) as info:
        train_unet.check_enough_samples(pairs, make_cfg(batch_size=batch_size, resume=resume))
    assert str(info.value).endswith(f"(0 per process), fewer than batch_size={batch_size}: {fix}")


def test_the_effective_batch_counts_the_accumulation_an_epoch_can_fill(make_cfg, monkeypatch, capsys):
    """batch_size=7, accumulation_steps=3, one batch an epoch, 2 processes: the banner said 7 x 3 x 2 while
    every optimizer step covered 7 x 1 x 2 images."""
    monkeypatch.setattr(train_unet, "DIST", train_unet.Dist(rank=1, world=2))  # not rank 0: writes no config.json
    cfg = make_cfg(batch_size=7, accumulation_steps=3)
    train_unet.announce_run(cfg, train_unet.detect_hardware("cpu"), None, (14, 6, 1, 1, 14), {})
    assert "effective batch 7 x 1 x 2" in capsys.readouterr().out


@pytest.mark.parametrize("rank, world, shown", [("0", "2", True), ("1", "2", False), ("1", None, True)])
def test_a_config_error_under_torchrun_is_printed_once(monkeypatch, capsys, rank, world, shown):
    """Every rank reads the same keys: an unknown key was printed by each, with no rank to tell them apart.
    Outside torchrun (no WORLD_SIZE: a pod that sets RANK for its own reasons) every error is printed."""
    monkeypatch.setenv("RANK", rank)
    if world is None:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("WORLD_SIZE", world)
    assert train_unet.main(["batchsize=2", "device=cpu"]) == 2
    assert ("error: unknown key 'batchsize'" in capsys.readouterr().err) is shown


@pytest.mark.parametrize("text, said", [
    ("DataLoader worker (pid 4242) is killed by signal: Killed. ", "[rank 1] a data loader worker"),
    ("[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:15790",
     "[rank 1] stopped: another process of this torchrun job ended"),
])
def test_a_ranks_own_failure_is_printed_with_its_rank(make_cfg, monkeypatch, capsys, text, said):
    """A worker's death on rank 1 came without [rank 1], and main() then printed nothing for it."""
    monkeypatch.setattr(train_unet, "DIST", train_unet.Dist(rank=1, world=2))
    monkeypatch.setattr(train_unet, "setup_distributed", lambda device: None)
    monkeypatch.setattr(train_unet, "cleanup_distributed", lambda: None)
    monkeypatch.setattr(train_unet, "train", lambda cfg, explicit=(): (_ for _ in ()).throw(RuntimeError(text)))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train_unet, "parse_overrides", lambda args: make_cfg())
    assert train_unet.main(["device=cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {said}") and err.count("\n") == 1, err


def test_a_peer_that_died_is_said_even_when_torchrun_stops_this_rank_meanwhile(make_cfg, monkeypatch, capsys):
    """A worker killed (kill -9) in epoch 1: torchrun's SIGTERM reached rank 0 in its grace wait, and the run
    ended 'stopped by SIGTERM ...: checkpoints written so far are intact; resume=True continues', with no
    checkpoint to resume (user test)."""
    monkeypatch.setattr(train_unet, "DIST", train_unet.Dist(rank=0, world=2))
    monkeypatch.setattr(train_unet, "setup_distributed", lambda device: None)
    monkeypatch.setattr(train_unet, "cleanup_distributed", lambda: None)
    peer = RuntimeError("[../gloo/transport/tcp/pair.cc:561] Connection closed by peer [127.0.0.1]:15790")
    monkeypatch.setattr(train_unet, "train", lambda cfg, explicit=(): (_ for _ in ()).throw(peer))
    monkeypatch.setattr(train_unet.time, "sleep", lambda s: (_ for _ in ()).throw(KeyboardInterrupt))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(train_unet, "parse_overrides", lambda args: make_cfg())
    assert train_unet.main(["device=cpu"]) == 2
    assert capsys.readouterr().err == ("error: [rank 0] stopped: another process of this torchrun job ended (its "
                                       "error, where it printed one, and torchrun's report say which); no checkpoint "
                                       "of this run was written yet\n")
    last = Path(make_cfg()["checkpoint_dir"]) / "last.pt"
    last.parent.mkdir(parents=True, exist_ok=True)
    last.write_bytes(b"")
    os.utime(last, (1e9, 1e9))  # an earlier run's, not yet moved to previous/ (a peer died in start-up)
    assert train_unet.main(["device=cpu"]) == 2
    assert capsys.readouterr().err.endswith("; no checkpoint of this run was written yet (the last.pt there is an "
                                            "earlier run's)\n")
    last.write_bytes(b"")  # this run's: a worker killed after an epoch's end
    assert train_unet.main(["device=cpu"]) == 2
    assert re.search(r"; last.pt is intact: resume=True .*epochs=1 .*continues from it\n$", capsys.readouterr().err)


def test_help_under_torchrun_is_printed_once(monkeypatch, capsys):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # RANK alone (a pod, a Slurm script): not torchrun
    assert train_unet.main(["--help"]) == 0 and "keys and defaults" in capsys.readouterr().out
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert train_unet.main(["--help"]) == 0 and train_unet.main(["predict", "--help"]) == 0
    assert capsys.readouterr().out == ""
    monkeypatch.setenv("RANK", "0")
    assert train_unet.main(["--help"]) == 0 and "keys and defaults" in capsys.readouterr().out


def test_a_stop_by_sigterm_is_not_called_an_interruption(monkeypatch):
    monkeypatch.setattr(train_unet, "STOP_SIGNAL", [])
    assert train_unet.stop_word() == "interrupted"
    monkeypatch.setattr(train_unet, "STOP_SIGNAL", ["SIGTERM"])
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert train_unet.stop_word() == "stopped by SIGTERM"
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert train_unet.stop_word().endswith("(under torchrun: another process ended, or the job was stopped)")


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc; a shell wrapper, a process group")
def test_a_ctrl_c_while_a_peer_has_not_joined_ends_the_job_at_once(make_data, tmp_path):
    """Ctrl-C in start-up, one rank late (a slow node or file system): the other waited in C++ to join the group,
    deaf to the signal, until torchrun killed it 30 s later, and said nothing. Joined on a thread, it stops at
    once with the start-up's line."""
    import os
    import signal
    import time

    data = make_data(count=12, size=32)
    late = tmp_path / "late_rank.sh"  # rank 1 starts 90 s late; the Ctrl-C comes while rank 0 waits for it
    late.write_text(f'[ "$LOCAL_RANK" = 1 ] && sleep 90\nexec "{sys.executable}" "{ROOT / "train_unet.py"}" "$@"\n')
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "--no-python",
           "sh", str(late), f"data_dir={data}", "image_size=32", "batch_size=2", "device=cpu", "progress=False",
           "encoder_name=resnet18", "epochs=1", f"checkpoint_dir={tmp_path / 'c'}"]  # sh: a noexec /tmp too
    job = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        waiting_to_join(job.pid)
        sent = time.monotonic()
        os.killpg(job.pid, signal.SIGINT)
        _, err = job.communicate(timeout=120)
    finally:  # nothing left running, whatever failed
        with contextlib.suppress(ProcessLookupError):
            os.killpg(job.pid, signal.SIGKILL)
    assert time.monotonic() - sent < 15, err[-2000:]  # it was 30 s and more, until torchrun's SIGKILL
    assert "interrupted: " in err and "forcefully exiting via 9" not in err, err[-2000:]


def waiting_to_join(torchrun_pid, limit_s=80):
    """Until rank 0 (the busiest python below torchrun; rank 1 sleeps in its shell) has done its start-up and
    sits idle, waiting for its peer: its CPU time still for a second."""
    import time

    def cpu(pid):
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
    end, seen = time.monotonic() + limit_s, []
    while time.monotonic() < end:
        try:
            seen.append(max(cpu(pid) for pid in proc_children(torchrun_pid) if "python" in
                            Path(f"/proc/{pid}/comm").read_text()))
        except (OSError, ValueError):  # a process gone meanwhile, or none yet
            seen.append(None)
        still = len(seen) >= 3 and seen[-1] is not None and seen[-3] == seen[-1]  # two seconds without CPU
        if still and seen[-1] >= os.sysconf("SC_CLK_TCK") // 2:  # and half a second of it before: its imports
            return
        time.sleep(1)
    raise AssertionError(f"rank 0 was not seen waiting for its peer within {limit_s} s")


def proc_children(pid):
    """The pids below `pid`, all levels (torchrun's python, its workers), from /proc."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for entry in os.listdir("/proc"):
            if entry.isdigit():
                try:
                    ppid = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]
                except OSError:
                    continue
                if int(ppid) == parent:
                    found.append(int(entry))
                    todo.append(int(entry))
    return found


@pytest.mark.skipif(torch.cuda.is_available(), reason="device=cuda runs where a GPU is")
def test_a_device_no_process_has_is_said_once(make_data, tmp_path):
    """device=cuda on CPUs: every process met it alike, and each printed it, tagged [rank 0], [rank 1]."""
    data = make_data(count=8, size=32)
    out = torchrun(f"data_dir={data}", "image_size=32", "batch_size=2", "device=cuda", "progress=False",
                   f"checkpoint_dir={tmp_path / 'c'}")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert out.returncode != 0 and errors == ["error: device='cuda' but PyTorch sees no CUDA GPU: use device=auto "
                                              "or device=cpu"], out.stderr[-2000:]


def test_a_file_one_rank_cannot_read_is_said_once(make_data, tmp_path):
    """The data check splits the files between the ranks: the rank that met a truncated image said it, tagged
    [rank 1], and rank 0 'stopped: another process of this torchrun job ended'. The failures are exchanged with
    the facts: every rank has the same error, said once, as a bad mask value is."""
    data = make_data(count=8, size=32)
    broken = sorted((data / "images").iterdir())[5]  # checked by rank 1 (pairs r, r + 2, ...)
    broken.write_bytes(broken.read_bytes()[:100])
    out = torchrun(f"data_dir={data}", "image_size=32", "batch_size=2", "device=cpu", "progress=False",
                   f"checkpoint_dir={tmp_path / 'c'}")
    errors = [line for line in out.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith(f"error: cannot read image {broken} (a truncated PNG"), \
        out.stderr[-2000:]
