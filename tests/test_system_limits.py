"""What the machine refuses, said in one line: files this user may not read, shared memory that cannot be
made, memory that runs out (ulimit -v, a GPU's), a file-size limit (ulimit -f), a checkpoint folder that is a
broken link. Each was a traceback from inside torch, numpy or OpenCV, or a message naming another cause.

Tests run as root here, whom file permissions do not stop: a read refused is the OSError the reader raises."""
import errno
import math
import multiprocessing
import os
import resource
import subprocess
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import train_unet
from train_unet import SegDataset, UserError

ROOT = Path(__file__).resolve().parent.parent


def denied(path):
    return PermissionError(errno.EACCES, "Permission denied", str(path))


@pytest.fixture
def refuse_reading(monkeypatch):
    """refuse_reading(name): reading a file of that name raises what open() raises for a file of mode 000."""
    names = set()
    real = train_unet.opencv_decode

    def decode(path, flags, kind):
        if Path(path).name in names:
            raise denied(path)
        return real(path, flags, kind)
    monkeypatch.setattr(train_unet, "opencv_decode", decode)
    return names.add


def test_the_data_check_names_every_file_this_user_may_not_read(make_cfg, refuse_reading, tmp_path):
    cfg = make_cfg()
    images = sorted((Path(cfg["data_dir"]) / "images").iterdir())
    masks = sorted((Path(cfg["data_dir"]) / "masks").iterdir())
    refuse_reading(images[0].name)
    refuse_reading(masks[3].name)  # a mask of the same name as its image: both read by their own readers
    with pytest.raises(UserError) as info:
        train_unet.train(cfg)
    message = str(info.value)
    assert "\n" not in message and "cannot read image " in message and images[0].name in message
    assert "permission denied: this user may not read it" in message and "chmod a+r" in message
    assert "other file(s) fail the check too" in message  # every unreadable file counted, not one per run


def test_predict_names_an_image_it_may_not_read_and_predicts_the_others(make_cfg, refuse_reading, tmp_path,
                                                                        capsys):
    cfg = make_cfg()
    train_unet.train(cfg)
    inputs = tmp_path / "in"
    inputs.mkdir()
    for i, image in enumerate(sorted((Path(cfg["data_dir"]) / "images").iterdir())[:3]):
        (inputs / image.name).write_bytes(image.read_bytes())
    refuse_reading(sorted(inputs.iterdir())[1].name)
    result = train_unet.predict({"checkpoint": str(Path(cfg["checkpoint_dir"]) / "best.pt"), "input": str(inputs),
                                 "output": str(tmp_path / "out"), "progress": False, "device": "cpu"})
    assert len(result["failed"]) == 1 and len(list((tmp_path / "out").glob("*.png"))) == 2
    assert "permission denied" in capsys.readouterr().out


def test_a_folder_this_user_may_not_list_is_one_line_from_main(make_cfg, monkeypatch, capsys):
    cfg = make_cfg()
    folder = Path(cfg["data_dir"]) / "images"

    def index(path):
        raise denied(path)
    monkeypatch.setattr(train_unet, "index_by_stem", index)
    assert train_unet.main([f"data_dir={cfg['data_dir']}", f"checkpoint_dir={cfg['checkpoint_dir']}",
                            "image_size=64", "epochs=1", "device=cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and f"{folder}: permission denied for this user" in err and "Traceback" not in err


def test_a_checkpoint_this_user_may_not_read_is_not_called_damaged(tmp_path, monkeypatch):
    path = tmp_path / "best.pt"
    torch.save({"model": {}, "config": {}}, path)
    monkeypatch.setattr(torch, "load", lambda *a, **k: (_ for _ in ()).throw(denied(path)))
    with pytest.raises(UserError) as info:
        train_unet.load_checkpoint(path)
    assert "permission denied" in str(info.value) and "chmod a+r" in str(info.value)
    assert "not a readable checkpoint" not in str(info.value)


def test_an_image_opencv_has_no_memory_for_is_not_called_damaged(tmp_path, monkeypatch):
    path = tmp_path / "a.bmp"
    cv2.imwrite(str(path), np.zeros((8, 8, 3), np.uint8))

    def decode(*args):
        raise cv2.error("OpenCV(4.10.0) alloc.cpp:73: error: (-4:Insufficient memory) Failed to allocate 768000000 "
                        "bytes in function 'OutOfMemoryError'")
    monkeypatch.setattr(train_unet, "opencv_decode", decode)
    with pytest.raises(UserError, match="not enough memory here to decode it") as info:
        train_unet.read_image(path, 3)
    assert "fix or remove it" not in str(info.value)


# ------------------------------------------------------------------------------------------------
# Shared memory (/dev/shm) that cannot be made
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def no_shared_memory(monkeypatch):
    def refused(*args):
        raise OSError(errno.EROFS, "Read-only file system", "/dev/shm/pym-123-abc")
    monkeypatch.setattr(multiprocessing, "RawValue", refused)
    train_unet.shared_memory_problem.cache_clear()
    yield
    train_unet.shared_memory_problem.cache_clear()


def test_without_shared_memory_training_reads_in_its_own_process(make_cfg, no_shared_memory, capsys):
    """A read-only /dev/shm: every run crashed at the dataset's shared epoch number, num_workers=0 too."""
    result = train_unet.train(make_cfg(num_workers=None, epochs=2))
    assert len(result["history"]) == 2
    assert "shared memory cannot be made here (Read-only file system in /dev/shm)" in capsys.readouterr().out
    with pytest.raises(UserError, match=r"num_workers=1: loader workers pass batches through shared memory.*"
                                        r"num_workers=0"):
        train_unet.train(make_cfg(num_workers=1, checkpoint_dir=str(Path(make_cfg()["checkpoint_dir"]) / "b")))


# ------------------------------------------------------------------------------------------------
# Memory that runs out
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("error, words", [
    (RuntimeError("[enforce fail at alloc_cpu.cpp:127] data. DefaultCPUAllocator: can't allocate memory: you tried "
                  "to allocate 268435456 bytes. Error code 12 (Cannot allocate memory)"), "ran out of memory"),
    (MemoryError("Unable to allocate 732. MiB for an array"), "ran out of memory"),
    (torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "ran out of GPU memory"),
    (RuntimeError("can't start new thread"), "could not start a thread"),
])
def test_memory_that_runs_out_in_training_is_one_line(make_cfg, monkeypatch, capsys, error, words):
    cfg = make_cfg()
    monkeypatch.setattr(train_unet, "train", lambda *a, **k: (_ for _ in ()).throw(error))
    with pytest.raises(UserError) as info:
        train_unet.train_main(cfg)
    message = str(info.value)
    assert words in message and "batch_size=4, image_size=64" in message
    assert "no checkpoint of this run was written" in message
    assert ("batch_size=auto" in message) == ("GPU" in words)
    monkeypatch.setattr(train_unet, "train", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("a bug")))
    with pytest.raises(RuntimeError, match="a bug"):  # an internal error still raises
        train_unet.train_main(cfg)


def test_predicts_memory_room_counts_the_address_space_limit(monkeypatch):
    """ulimit -v: predict's check let a 16000² image through on the machine's free memory, and numpy failed
    with a traceback before any mask was written."""
    free = train_unet.available_memory()
    if free is None:
        pytest.skip("no /proc/meminfo on this system")
    monkeypatch.setattr(train_unet, "address_space_limit", lambda: 2**30 + train_unet_vm_size())
    assert train_unet.available_memory() <= 2**30 + 2**24  # what the process maps may grow a little meanwhile
    monkeypatch.setattr(train_unet, "address_space_limit", lambda: None)
    assert train_unet.address_space_room() == math.inf


def train_unet_vm_size():
    import re
    return int(re.search(r"^VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)[1]) * 1024


def test_a_real_address_space_limit_in_training_is_one_line(make_data, tmp_path):
    """The run under a real ulimit -v, in its own process: the first batch cannot be allocated."""
    if not hasattr(resource, "RLIMIT_AS") or not Path("/proc/self/status").exists():
        pytest.skip("no address-space limit on this system")
    data = make_data(count=10, size=32)
    vm = train_unet_vm_size()  # this process has torch and OpenCV loaded, as the child will
    limit = vm + 1536 * 2**20

    def cap():
        resource.setrlimit(resource.RLIMIT_AS, (limit, resource.getrlimit(resource.RLIMIT_AS)[1]))
    done = subprocess.run([sys.executable, str(ROOT / "train_unet.py"), f"data_dir={data}", "image_size=1024",
                           "batch_size=8", "epochs=1", "num_workers=0", "use_amp=False", "progress=False",
                           "encoder_weights=None", "device=cpu", f"checkpoint_dir={tmp_path / 'ck'}"],
                          capture_output=True, text=True, preexec_fn=cap, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "ran out of memory" in done.stderr and "ulimit -v" in done.stderr


# ------------------------------------------------------------------------------------------------
# A file-size limit (ulimit -f)
# ------------------------------------------------------------------------------------------------
def test_a_file_size_limit_below_the_checkpoints_is_refused_before_training(make_data, tmp_path):
    """ulimit -f 100000 (98 MB): a whole epoch trained, then last.pt (164 MB) failed 'as on a full disk'
    beside 59 GB free."""
    data = make_data(count=10, size=32)

    def cap():
        resource.setrlimit(resource.RLIMIT_FSIZE, (20 * 2**20, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))
    done = subprocess.run([sys.executable, str(ROOT / "train_unet.py"), f"data_dir={data}", "image_size=32",
                           "batch_size=4", "epochs=1", "num_workers=0", "progress=False", "device=cpu",
                           f"checkpoint_dir={tmp_path / 'ck'}"],
                          capture_output=True, text=True, preexec_fn=cap, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 2 and "Traceback" not in done.stderr
    assert "larger than the file-size limit here (20 MB, ulimit -f)" in done.stderr
    assert "epoch   1/1" not in done.stdout and not (tmp_path / "ck" / "history.csv").exists()


def test_a_write_past_the_file_size_limit_is_not_called_a_full_disk(tmp_path):
    """A real limit in this process (Python ignores SIGXFSZ: the write fails with EFBIG)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (2**20, hard))
    try:
        with pytest.raises(UserError) as info:
            train_unet.save_checkpoint(tmp_path / "last.pt", {"model": {"w": torch.zeros(2**19)}})
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert not (tmp_path / "last.pt").exists() and not list(tmp_path.iterdir())  # no partial file left
    assert "larger than the file-size limit here (ulimit -f: 1 MB), not a full disk" in str(info.value)
    error = OSError(errno.EFBIG, "File too large", str(tmp_path / "history.csv"))
    assert "file-size limit" in train_unet.system_limit_message(error)


def test_small_sizes_are_not_zero_megabytes():
    assert [train_unet.size_text(n) for n in (0, 48 * 2**10, 2**20)] == ["0 kB", "48 kB", "1 MB"]


# ------------------------------------------------------------------------------------------------
# A checkpoint folder that is a broken link
# ------------------------------------------------------------------------------------------------
def test_a_checkpoint_dir_that_is_a_broken_link_says_so(tmp_path):
    link = tmp_path / "ck"
    link.symlink_to(tmp_path / "not_there")
    with pytest.raises(UserError, match=r"is a broken link \(it points to .*not_there, which is not there\)"):
        train_unet.check_writable(link, "checkpoint_dir")


def test_open_file_limits_are_not_called_a_bad_file(tmp_path, monkeypatch, capsys):
    """ENFILE (the machine's file table full) read 'cannot read image X (...): check the disk or share it is on,
    or remove it': the file is fine. It goes to main's line for the limit, as EMFILE does."""
    path = tmp_path / "a.png"
    cv2.imwrite(str(path), np.zeros((8, 8, 3), np.uint8))
    for code in (errno.EMFILE, errno.ENFILE):
        def decode(*args, code=code):
            raise OSError(code, os.strerror(code), str(path))
        monkeypatch.setattr(train_unet, "opencv_decode", decode)
        with pytest.raises(OSError) as info:
            train_unet.read_image(path, 3)
        assert not isinstance(info.value, UserError) and info.value.errno == code
    assert "all processes together (ENFILE)" in train_unet.system_limit_message(OSError(errno.ENFILE, "x"))


def test_out_of_memory_advice_fits_the_run(make_cfg):
    gpu = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    said = str(train_unet.out_of_memory(gpu, {**make_cfg(), "batch_size": "auto"}))
    assert "batch_size=auto" not in said.split(": use ")[1]  # the setting in use is no fix
    assert "batch_size=auto" in str(train_unet.out_of_memory(gpu, make_cfg())).split(": use ")[1]
    mps = RuntimeError("MPS backend out of memory (MPS allocated: 17.5 GB, other allocations: 1.2 GB)")
    assert "ran out of GPU memory" in str(train_unet.out_of_memory(mps, make_cfg()))


# ------------------------------------------------------------------------------------------------
# A temporary directory whose file system can create no more files (its inodes used up)
# ------------------------------------------------------------------------------------------------
@pytest.fixture
def files_left_here(monkeypatch):
    """files_left_here(n): every file system here can create only n more files (bytes to spare)."""
    return lambda n: monkeypatch.setattr(train_unet, "files_left", lambda folder: n)


def test_workers_without_room_for_their_socket_files_are_refused_or_left_out(make_cfg, files_left_here, capsys):
    """Each loader worker makes a socket file in the temporary directory: where none could be made, the worker's
    batch failed in a traceback on its feeder thread, and training waited for that batch for ever."""
    files_left_here(3)
    with pytest.raises(UserError, match=r"^num_workers=2: each loader worker makes a socket file in the temporary "
                                        r"directory, and .* can create only 3 more file\(s\) \(its inodes; 8 wanted\):"
                                        r" point TMPDIR at .*, delete files there or set num_workers=0$"):
        train_unet.train(make_cfg(num_workers=2, epochs=1))
    result = train_unet.train(make_cfg(num_workers=None, epochs=1, checkpoint_dir=make_cfg()["checkpoint_dir"] + "2"))
    assert len(result["history"]) == 1
    assert "images are read in the training process (num_workers=0)" in capsys.readouterr().out
    assert train_unet.worker_count(make_cfg(num_workers=None), train_unet.detect_hardware("cpu")) == 0
    files_left_here(None)  # a file system that keeps no count (btrfs): nothing is checked
    assert train_unet.worker_files_problem(8) is None


def test_a_cache_of_more_files_than_are_left_decodes_every_epoch(make_cfg, files_left_here, capsys):
    """The train and validation caches' files together, and files kept for the workers, must fit."""
    cfg = make_cfg(cache_images=True)
    train, val = train_unet.prepare_data(cfg)
    files_left_here(2 * len(train) + train_unet.CACHE_SPARE_FILES + 2 * len(val) - 1)
    first = SegDataset(train, cfg, train=True)
    assert first.resized is not None and not capsys.readouterr().out
    second = train_unet.ValidationImages(val, cfg)  # the training set's files are still to come
    assert second.resized is None
    said = capsys.readouterr().out
    assert (f"the decoded copies would make {2 * len(val)} files in" in said and f"beside the {2 * len(train)} "
            f"still to come from the other set's" in said and "decoding them every epoch instead" in said)
    for i in range(len(first)):  # written: no longer to come
        first[i]
    assert train_unet.ValidationImages(val, cfg).resized is not None
    files_left_here(10)
    with pytest.raises(UserError, match=r"patch mode decodes the training images once, and the decoded copies "
                                        r"would make \d+ files in .* only 10 more"):
        train_unet.check_patch_cache_room(train, [(64, 64)] * len(train), {**cfg, "data_mode": "patch"})


def test_a_write_where_no_file_can_be_made_says_so_beside_the_bytes_free(make_cfg, files_left_here, monkeypatch,
                                                                         tmp_path):
    """'No space left on device' with gigabytes free: the fix is to delete files, not to free disk space."""
    files_left_here(0)
    full = OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "x.tmp"))
    assert train_unet.write_fix(full, "output").startswith("delete files there (its file system can create no more "
                                                           "files: every inode is in use, with ")
    assert "delete files there" in train_unet.system_limit_message(full)

    def refused(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(train_unet.torch, "save", refused)
    with pytest.raises(UserError) as info:
        train_unet.save_checkpoint(tmp_path / "last.pt", {"w": torch.zeros(4)})
    assert "delete files there" in str(info.value) and "it needs about" not in str(info.value)
    files_left_here(None)
    cfg = make_cfg(cache_images=True)
    dataset = SegDataset(train_unet.prepare_data(cfg)[0], cfg, train=True)  # made while files were left
    files_left_here(0)
    monkeypatch.setattr(train_unet.np, "save", refused)
    with pytest.raises(UserError, match=r"cannot write decoded images to .*: delete files there \(its file system "
                                        r"can create no more files.*point TMPDIR at a larger disk or set "
                                        r"cache_images=False$"):
        dataset[0]
    files_left_here(None)
    assert train_unet.write_fix(full, "output") == "free disk space there or choose another output=..."


@pytest.fixture
def few_inodes(tmp_path):
    """A real tmpfs of 100 files (inodes), where this machine lets the tests mount one (root, Linux)."""
    folder = tmp_path / "tmpfs"
    folder.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64m,nr_inodes=100", "tmpfs",
                                            str(folder)], capture_output=True).returncode != 0:
        pytest.skip("cannot mount a tmpfs here (not root, or no mount); the faked tests above cover the rules")
    yield folder
    subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def test_training_with_workers_and_a_cache_in_a_tmpfs_of_few_inodes_ends(make_data, few_inodes, tmp_path):
    """The user test that found it: 2 of 4 such runs printed a traceback from a worker and then waited for ever;
    now the cache stays within the files left, and the workers have their socket files."""
    data = make_data(count=60, size=32)
    done = subprocess.run([sys.executable, str(ROOT / "train_unet.py"), f"data_dir={data}", "image_size=32",
                           "batch_size=4", "epochs=1", "num_workers=2", "cache_images=True", "progress=False",
                           "cpu_probe=False", "device=cpu", f"checkpoint_dir={tmp_path / 'ck'}"],
                          capture_output=True, text=True, timeout=240,
                          env={**os.environ, "TMPDIR": str(few_inodes), "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "Traceback" not in done.stderr and "decoding them every epoch instead" in done.stdout
    assert (tmp_path / "ck" / "last.pt").exists()
