"""Data loading that keeps up (issue 10): the worker-count rule, persistent workers, pinned memory."""
import dataclasses
from pathlib import Path

import pytest
import torch

import train_unet


def cuda_hw(cpu_hw):
    return dataclasses.replace(cpu_hw, device="cuda:0", kind="cuda", capability=(8, 0))


@pytest.mark.parametrize("cores,local_world,kind,expected", [
    (16, None, "cuda", 8),     # one process: half the cores, at most 8
    (16, "8", "cuda", 1),      # torchrun, 8 GPUs on 16 cores: 2 cores per process -> 1 worker each
    (64, "4", "cuda", 8),      # 16 cores per process -> capped at 8
    (4, "2", "cuda", 1),       # at least one worker on a GPU
    (2, None, "cpu", train_unet.CPU_WORKERS),
    (16, "8", "cpu", train_unet.CPU_WORKERS),
    (1, None, "cpu", 0),       # one core: a worker could only steal from the model
    (8, "8", "cpu", 0),        # one core per process under torchrun
    (None, None, "cpu", 0),    # the core count unknown
])
def test_default_worker_count_shares_the_nodes_cores(monkeypatch, cpu_hw, cores, local_world, kind, expected):
    monkeypatch.setattr(train_unet, "usable_cores", lambda: cores)
    if local_world is None:
        monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    else:
        monkeypatch.setenv("LOCAL_WORLD_SIZE", local_world)
    hw = cuda_hw(cpu_hw) if kind == "cuda" else cpu_hw
    cfg = dict(train_unet.CONFIG, num_workers=None)
    assert train_unet.worker_count(cfg, hw) == expected
    assert train_unet.worker_count({**cfg, "num_workers": 3}, hw) == 3  # an explicit value wins


def test_8_gpus_on_16_cores_no_longer_start_64_workers(monkeypatch, cpu_hw):
    monkeypatch.setattr(train_unet, "usable_cores", lambda: 16)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    per_process = train_unet.worker_count(dict(train_unet.CONFIG), cuda_hw(cpu_hw))
    assert 8 * per_process <= 16


def test_loaders_keep_workers_and_pin_memory_on_cuda(make_cfg, cpu_hw):
    cfg = make_cfg(num_workers=2)
    train, val = train_unet.prepare_data(cfg)
    for hw, pinned in ((cpu_hw, False), (cuda_hw(cpu_hw), True)):
        loaders = train_unet.build_loaders(train, val, cfg, hw)
        assert all(loader.persistent_workers and loader.pin_memory == pinned for loader in loaders)
    loaders = train_unet.build_loaders(train, val, make_cfg(num_workers=0), cpu_hw)
    assert not any(loader.persistent_workers for loader in loaders)


def test_persistent_workers_see_each_new_epoch(make_cfg, cpu_hw):
    """Workers kept alive across epochs hold their own copy of the dataset: the epoch (which seeds
    augmentation) must still reach them. Two epochs through one 2-worker loader equal fresh
    0-worker loaders for the same epochs."""
    def batches(loader, epoch):
        train_unet.start_epoch_data(loader, epoch, cfg["seed"])
        return [(x.clone(), y.clone()) for x, y in loader]

    cfg = make_cfg(num_workers=2, batch_size=4)
    train, val = train_unet.prepare_data(cfg)
    kept, _ = train_unet.build_loaders(train, val, cfg, cpu_hw)
    for epoch in (1, 2):
        fresh, _ = train_unet.build_loaders(train, val, make_cfg(num_workers=0, batch_size=4), cpu_hw)
        got, want = batches(kept, epoch), batches(fresh, epoch)
        assert len(got) == len(want) == 2
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want)), epoch


class OpenCVThreads(torch.utils.data.Dataset):
    """Reports, from wherever it is read, how many threads OpenCV would use."""

    def __len__(self):
        return 2

    def __getitem__(self, index):
        import cv2
        return cv2.getNumThreads()


def test_workers_run_opencv_on_one_thread(make_cfg, cpu_hw):
    """OpenCV starts a thread per core in every process; in a DataLoader worker on a CPU those would
    take cores from the model's own threads. Every loader's workers run it on one thread, and the
    main process keeps its own setting."""
    import cv2
    import numpy as np
    before = cv2.getNumThreads()
    cv2.resize(np.zeros((512, 512, 3), np.float32), (1024, 1024))  # this process's OpenCV pool has started
    options = train_unet.loader_options(make_cfg(num_workers=2), cpu_hw)
    # timeout: a worker stuck in its set-up fails the test instead of hanging the suite
    seen = list(torch.utils.data.DataLoader(OpenCVThreads(), batch_size=None, timeout=60, **options))
    assert seen == [1, 1]
    assert cv2.getNumThreads() == before
    assert train_unet.loader_options(make_cfg(num_workers=0), cpu_hw)["worker_init_fn"] is None


@pytest.mark.parametrize("hard", [20, 4096])
def test_a_low_open_file_limit_is_raised_or_refused_in_one_line(make_data, tmp_path, hard):
    """At ulimit -n 20 a run with a loader worker printed a multiprocessing traceback and hung for good. The
    soft limit is now raised to the hard one; where the hard one is that low too, one line says what to do."""
    import resource
    import subprocess
    import sys

    data = make_data(count=8, size=32)
    limit = lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (20, hard))  # noqa: E731
    run = subprocess.run([sys.executable, str(Path(train_unet.__file__)), f"data_dir={data}", "image_size=32",
                          f"checkpoint_dir={tmp_path / 'ck'}", "epochs=1", "batch_size=2", "num_workers=1",
                          "progress=False", "device=cpu", "use_amp=False", "cpu_probe=False", "encoder_name=resnet18"],
                         capture_output=True, text=True, timeout=300, preexec_fn=limit)
    if hard == 20:
        assert run.returncode == 2 and run.stderr == (
            "error: the open-file limit here is 20 (ulimit -n, its hard limit too): too few for 1 data loader "
            "worker(s), whose pipes and shared batches need about 8 each: raise it (ulimit -n 4096; in Docker "
            "--ulimit nofile=4096) or set num_workers=0\n")
        assert not (tmp_path / "ck").exists()
    else:
        assert run.returncode == 0, run.stderr[-2000:]
        assert (tmp_path / "ck" / "best.pt").is_file()


def test_room_for_socket_files_is_counted_for_the_workers_that_would_run(monkeypatch, cpu_hw):
    """On a 16-core CPU num_workers=None starts one worker: room for its socket files is enough. The check had
    counted a GPU's 8 workers there, and read in the training process where one worker had room."""
    monkeypatch.setattr(train_unet, "usable_cores", lambda: 16)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    one_worker = train_unet.WORKER_FILES * train_unet.LOADERS
    monkeypatch.setattr(train_unet, "files_left", lambda folder: one_worker)
    cfg = dict(train_unet.CONFIG, num_workers=None)
    assert train_unet.worker_count(cfg, cpu_hw) == train_unet.CPU_WORKERS == 1
    assert train_unet.worker_count(cfg, cuda_hw(cpu_hw)) == 0  # 8 workers' files do not fit: none
    monkeypatch.setattr(train_unet, "files_left", lambda folder: one_worker - 1)
    assert train_unet.worker_count(cfg, cpu_hw) == 0
