"""cache_images (fit mode): each image decoded and resized once per run, the samples unchanged to the
bit; a full disk and an error inside a loader worker are one-line messages."""
import errno
import os
import types

import cv2
import numpy as np
import pytest
import torch

import train_unet
from train_unet import SegDataset, UserError, prepare_data


@pytest.fixture
def mixed_data(data_dir):
    """The 64x64 set with a 50x70 pair (padding), a 90x40 pair and a 16-bit image (the float path)."""
    images, masks = sorted((data_dir / "images").glob("*.png")), sorted((data_dir / "masks").glob("*.png"))
    for i, (w, h) in enumerate([(70, 50), (40, 90), (70, 50), (40, 90)]):
        cv2.imwrite(str(images[i]), cv2.resize(cv2.imread(str(images[i])), (w, h)))
        cv2.imwrite(str(masks[i]), cv2.resize(cv2.imread(str(masks[i]), 0), (w, h), interpolation=cv2.INTER_NEAREST))
    for i in (4, 9):
        cv2.imwrite(str(images[i]), cv2.imread(str(images[i])).astype(np.uint16) * 257)
    return data_dir


def samples(dataset, epochs=(0, 1, 2)):
    out = []
    for epoch in epochs:
        dataset.epoch = epoch
        out += [dataset[i] for i in range(len(dataset))]
    return out


@pytest.mark.parametrize("train, size", [(True, 32), (False, 32), (True, 96)])  # 96: upscaled
def test_cached_samples_equal_uncached_ones_to_the_bit(make_cfg, mixed_data, train, size):
    """Resized once and read back, with the augmentation's random draws unchanged: every sample of
    three epochs (the first decodes, the others read the cache) equals the uncached one."""
    cached, plain = make_cfg(image_size=size, cache_images=True), make_cfg(image_size=size, cache_images=False)
    train_pairs, val_pairs = prepare_data(plain)
    pairs = train_pairs if train else val_pairs + train_pairs[:4]
    got, want = samples(SegDataset(pairs, cached, train)), samples(SegDataset(pairs, plain, train))
    assert len(got) == len(want) == 3 * len(pairs)
    for (x, y), (x0, y0) in zip(got, want):
        assert x.dtype == x0.dtype and torch.equal(x, x0) and torch.equal(y, y0)
    if train:  # the augmentation really ran: epochs differ
        assert any(not torch.equal(got[i][0], got[i + len(pairs)][0]) for i in range(len(pairs)))


@pytest.mark.parametrize("cache, size", [(False, 32), (True, 32), (False, 96)])  # 96: upscaled
def test_validation_gives_the_model_predicts_input(make_cfg, mixed_data, monkeypatch, cache, size):
    """Fit-mode validation makes the model's input with predict's own function (fit_pair, behind
    fit_input), not a second normalisation; its items equal the augmentation-free pipeline's
    (build_transforms: training's normalisation) to the bit, masks included, for padded, 16-bit and
    cached images alike, and validation scores what predict would write."""
    cfg = make_cfg(image_size=size, cache_images=cache)
    pairs = sum(prepare_data(cfg), [])
    calls, real = [], train_unet.fit_pair
    monkeypatch.setattr(train_unet, "fit_pair", lambda *a: calls.append(1) or real(*a))
    items = [train_unet.ValidationImages(pairs, cfg)[i] for i in range(len(pairs))]
    assert len(calls) == len(pairs)
    pipeline = train_unet.build_transforms(cfg, train=False)
    for (x, y, mask_path), pair in zip(items, pairs):
        want = pipeline(**dict(zip(("image", "mask"), train_unet.read_pair(pair, cfg))))
        assert mask_path == str(pair[1]) and x.shape == (3, size, size) and y.dtype == torch.long
        assert torch.equal(x, train_unet.image_tensor(want["image"])), pair[0].name
        assert torch.equal(y, torch.from_numpy(want["mask"]).long()), pair[0].name
        assert torch.equal(x, train_unet.fit_input(train_unet.read_pair(pair, cfg)[0], cfg)), pair[0].name
    assert any((y == train_unet.IGNORE_INDEX).any() for _, y, _ in items), "test setup: no padded mask"


def test_each_image_is_decoded_once_per_run(make_cfg, monkeypatch):
    cfg = make_cfg(image_size=32)
    train, _ = prepare_data(cfg)
    reads = []
    real = train_unet.read_pair
    monkeypatch.setattr(train_unet, "read_pair", lambda pair, cfg: reads.append(pair) or real(pair, cfg))
    dataset = SegDataset(train, cfg, train=True)
    samples(dataset)
    assert sorted(reads) == sorted(train)
    reads.clear()
    samples(SegDataset(train, make_cfg(image_size=32, cache_images=False), train=True), epochs=(0, 1))
    assert len(reads) == 2 * len(train)


def test_the_cache_folder_goes_with_the_data_set(make_cfg):
    cfg = make_cfg()
    train, _ = prepare_data(cfg)
    dataset = SegDataset(train, cfg, train=True)
    dataset[0]
    folder = dataset.resized.decoded.folder
    assert len(list(folder.glob("*.npy"))) == 2
    del dataset
    import gc
    gc.collect()
    assert not folder.exists()
    assert SegDataset(train, make_cfg(cache_images=False), train=True).resized is None


@pytest.mark.parametrize("code, advice", [(errno.ENOSPC, "free disk space there, point TMPDIR at a larger disk"),
                                          (errno.ENOENT, "check that it still exists and is writable")])
def test_a_failed_cache_write_is_a_one_line_error_with_the_fixes(make_cfg, monkeypatch, code, advice):
    cfg = make_cfg()
    train, _ = prepare_data(cfg)
    dataset = SegDataset(train, cfg, train=True)

    def failing(*args, **kwargs):
        raise OSError(code, "No space left on device" if code == errno.ENOSPC else "No such file or directory")
    monkeypatch.setattr(train_unet.np, "save", failing)
    with pytest.raises(UserError) as info:
        dataset[0]
    message = str(info.value)
    assert "\n" not in message and str(dataset.resized.decoded.folder) in message
    assert advice in message and message.endswith(" or set cache_images=False")
    assert not list(dataset.resized.decoded.folder.iterdir())  # no half-written file left behind
    monkeypatch.undo()
    assert torch.equal(dataset[0][1], SegDataset(train, make_cfg(cache_images=False), train=True)[0][1])


@pytest.mark.parametrize("size, channels, bits", [(32, 3, 8), (64, 1, 8), (32, 3, 16)])
def test_the_size_estimate_is_what_the_cache_takes(make_cfg, data_dir, size, channels, bits):
    if bits == 16:
        for path in (data_dir / "images").glob("*.png"):
            cv2.imwrite(str(path), cv2.imread(str(path)).astype(np.uint16) * 257)
    cfg = make_cfg(image_size=size, in_channels=channels)
    train, _ = prepare_data(cfg)
    dataset = SegDataset(train, cfg, train=True)
    samples(dataset, epochs=(0,))
    files = list(dataset.resized.decoded.folder.glob("*.npy"))
    written = sum(f.stat().st_size for f in files)
    need = train_unet.cache_bytes(train, cfg)
    assert len(files) == 2 * len(train) and need <= written <= need + 256 * len(files)  # + .npy headers


def test_without_room_on_the_disk_images_are_decoded_every_epoch(make_cfg, monkeypatch, capsys):
    cfg = make_cfg()
    train, _ = prepare_data(cfg)
    need = train_unet.cache_bytes(train, cfg)
    monkeypatch.setattr(train_unet.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=2 * need - 1))
    dataset = SegDataset(train, cfg, train=True)
    assert dataset.resized is None and "decoding them every epoch instead" in capsys.readouterr().out
    assert torch.equal(dataset[1][0], SegDataset(train, make_cfg(cache_images=False), train=True)[1][0])
    monkeypatch.setattr(train_unet.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=2 * need))
    assert SegDataset(train, cfg, train=True).resized is not None


def test_a_file_that_breaks_after_the_data_check_is_a_one_line_error(data_dir, tmp_path, capsys):
    """The data check caches its verdict by size and modification time; a file whose bytes change with
    neither (a network share, a copy tool) first fails inside a loader worker, and PyTorch re-raises
    the error in the main process with the worker's traceback as its text. The user sees the message."""
    args = [f"data_dir={data_dir}", f"checkpoint_dir={tmp_path / 'ck'}", "image_size=32", "epochs=1",
            "batch_size=2", "num_workers=1", "progress=False", "device=cpu", "use_amp=False", "logger=csv"]
    train, _ = prepare_data(train_unet.parse_overrides(args))  # the data check's verdicts are cached
    stat = train[0][0].stat()
    train[0][0].write_bytes(b"\0" * stat.st_size)
    os.utime(train[0][0], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert train_unet.main(args) == 2
    err = capsys.readouterr().err
    assert err == f"error: cannot read image {train[0][0]} (corrupt or not an image): fix or remove it\n"


@pytest.mark.parametrize("text, want", [
    ("a plain message: fix it", "a plain message: fix it"),
    ("Caught UserError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
     '  File "x.py", line 1, in f\n    raise UserError("it: fix")\ntrain_unet.UserError: it: fix\n', "it: fix"),
    ("Caught UserError in DataLoader worker process 1.\nOriginal Traceback (most recent call last):\n"
     "__main__.UserError: two\nlines\n", "two\nlines"),
    ("Caught UserError in DataLoader worker process 0.\nOriginal Traceback (most recent call last):\n"
     "train_unet.UserError\n", None),  # no message to extract: the text as it came
])
def test_user_message_takes_the_workers_message_out_of_its_traceback(text, want):
    assert train_unet.user_message(UserError(text)) == (text if want is None else want)


@pytest.mark.parametrize("sent", ["SIGTERM", "SIGHUP"])
def test_a_terminated_run_removes_its_caches(data_dir, tmp_path, sent):
    """SIGTERM (torchrun stopping the other ranks, a cluster pre-empting the job) ends a run like Ctrl-C,
    so the exit handlers remove its temporary caches instead of leaving them on the disk. SIGHUP (a closed
    terminal, a dropped ssh session) ended the process at once: its epoch lost, its caches left, no word."""
    import signal
    import subprocess
    import sys
    import time

    temp = tmp_path / "tmp"
    temp.mkdir()
    run = subprocess.Popen([sys.executable, str(train_unet.Path(train_unet.__file__)), f"data_dir={data_dir}",
                            f"checkpoint_dir={tmp_path / 'ck'}", "image_size=32", "epochs=500", "batch_size=2",
                            "num_workers=1", "progress=False", "device=cpu", "use_amp=False", "logger=csv",
                            "cpu_probe=False"],  # a subprocess: conftest's fake probe does not reach it
                           env={**os.environ, "TMPDIR": str(temp)}, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list(temp.glob("unet_amp_decoded_*/*.npy")) and time.monotonic() < deadline and run.poll() is None:
        time.sleep(0.2)
    assert list(temp.glob("unet_amp_decoded_*/*.npy")), "the run made no cache"
    run.send_signal(getattr(signal, sent))
    _, err = run.communicate(timeout=60)
    resumable = (tmp_path / "ck" / "last.pt").is_file()
    assert run.returncode == 130, err
    said = "stopped by SIGTERM" if sent == "SIGTERM" else "stopped by SIGHUP (its terminal closed: nohup, tmux or " \
                                                          "screen keep a run going)"
    assert (f"{said}: checkpoints written so far are intact" if resumable else  # not a Ctrl-C
            f"{said}: no epoch had finished, so there is no checkpoint to resume: train again") in err
    assert not list(temp.glob("unet_amp_decoded_*"))
