"""cache_images (fit mode): each image decoded and resized once per run, the samples unchanged to the
bit; a full disk and an error inside a loader worker are one-line messages."""
import errno

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


@pytest.mark.parametrize("train", [True, False])
def test_cached_samples_equal_uncached_ones_to_the_bit(make_cfg, mixed_data, train):
    """Resized once and read back, with the augmentation's random draws unchanged: every sample of
    three epochs (the first decodes, the others read the cache) equals the uncached one."""
    cached, plain = make_cfg(image_size=32, cache_images=True), make_cfg(image_size=32, cache_images=False)
    train_pairs, val_pairs = prepare_data(plain)
    pairs = train_pairs if train else val_pairs + train_pairs[:4]
    got, want = samples(SegDataset(pairs, cached, train)), samples(SegDataset(pairs, plain, train))
    assert len(got) == len(want) == 3 * len(pairs)
    for (x, y), (x0, y0) in zip(got, want):
        assert x.dtype == x0.dtype and torch.equal(x, x0) and torch.equal(y, y0)
    if train:  # the augmentation really ran: epochs differ
        assert any(not torch.equal(got[i][0], got[i + len(pairs)][0]) for i in range(len(pairs)))


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


def test_a_full_disk_is_a_one_line_error_with_the_fixes(make_cfg, monkeypatch):
    cfg = make_cfg()
    train, _ = prepare_data(cfg)
    dataset = SegDataset(train, cfg, train=True)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(train_unet.np, "save", full)
    with pytest.raises(UserError) as info:
        dataset[0]
    message = str(info.value)
    assert "\n" not in message and "No space left on device" in message
    assert "TMPDIR" in message and "cache_images=False" in message
    assert not list(dataset.resized.decoded.folder.iterdir())  # no half-written file left behind
    monkeypatch.undo()
    assert torch.equal(dataset[0][1], SegDataset(train, make_cfg(cache_images=False), train=True)[0][1])


@pytest.mark.parametrize("cache", [True, False])
def test_an_error_in_a_loader_worker_is_printed_as_one_line(data_dir, tmp_path, monkeypatch, capsys, cache):
    """A file that breaks after the data check fails inside a worker; PyTorch re-raises it in the main
    process with the worker's traceback as its text. The user sees the message, not the traceback."""
    def broken(pair, cfg):
        raise UserError(f"cannot read image {pair[0]} (corrupt or not an image): fix or remove it")
    monkeypatch.setattr(train_unet, "read_pair", broken)  # the forked worker inherits it
    rc = train_unet.main([f"data_dir={data_dir}", f"checkpoint_dir={tmp_path / 'ck'}", "image_size=32",
                          "epochs=1", "batch_size=4", "num_workers=1", "progress=False", "device=cpu",
                          "use_amp=False", "logger=csv", f"cache_images={cache}"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: cannot read image ") and err.endswith(": fix or remove it\n")
    assert err.count("\n") == 1 and "Traceback" not in err and "DataLoader worker" not in err
