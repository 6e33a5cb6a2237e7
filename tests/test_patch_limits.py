"""Patch mode within the machine's limits: open files bounded however many training images, validation
images kept out of shared memory, every foreground pixel reachable as a patch centre, and temporary
disk estimated per node and removed even after a killed run."""
import collections
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import threading
import types

import cv2
import numpy as np
import pytest
import torch

import train_unet
from train_unet import IGNORE_INDEX, PatchDataset, UserError, cut_patch


def write_pairs(root, count, size=(40, 48), seed=0):
    """`count` small image/mask pairs, each mask with a square of foreground."""
    rng = np.random.default_rng(seed)
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    for i in range(count):
        mask = np.zeros(size, np.uint8)
        y, x = rng.integers(0, size[0] - 8), rng.integers(0, size[1] - 8)
        mask[y:y + 8, x:x + 8] = 255
        cv2.imwrite(str(root / "images" / f"p{i:03d}.png"), rng.integers(0, 255, size + (3,), dtype=np.uint8))
        cv2.imwrite(str(root / "masks" / f"p{i:03d}.png"), mask)
    return root


def patch_cfg(make_cfg, root, **overrides):
    return make_cfg(**{**dict(data_dir=str(root), data_mode="patch", image_size=32, batch_size=2,
                              val_fraction=0.2, tile_batch_size=2), **overrides})


# ---------------------------------------------------------------------------------------------------
# Item 2: open files
# ---------------------------------------------------------------------------------------------------
def test_patches_of_more_images_than_the_open_file_limit_allows(tmp_path):
    """Each mapped image holds a file descriptor: a process limited to 64 (macOS gives 256, many
    containers 1024) reads patches of 80 images, twice over, in an order that revisits them."""
    pytest.importorskip("resource")
    root = write_pairs(tmp_path / "many", 80)
    script = textwrap.dedent(f"""
        import resource, sys
        sys.path.insert(0, {str(train_unet.Path(train_unet.__file__).parent)!r})
        import train_unet
        from pathlib import Path
        cfg = dict(train_unet.CONFIG, data_dir={str(root)!r}, data_mode="patch", image_size=32,
                   patches_per_image=1, device="cpu", num_workers=0, progress=False, use_amp=False)
        cfg = train_unet.validate_config(cfg)
        pairs = sorted(zip(sorted(Path(cfg["data_dir"], "images").iterdir()),
                           sorted(Path(cfg["data_dir"], "masks").iterdir())))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        dataset = train_unet.PatchDataset(pairs, cfg, [(40, 48)] * len(pairs))
        for i in [*range(len(dataset)), *reversed(range(len(dataset)))]:
            dataset[i]
        print("open images", len(dataset.maps), "of", len(dataset))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TMPDIR": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]
    assert "open images 4 of 80" in run.stdout  # 64 descriptors // (2 per image * OPEN_FILES_SHARE)


def test_the_open_image_limit_follows_the_descriptor_limit(monkeypatch):
    resource = pytest.importorskip("resource")
    for soft, want in ((64, 4), (256, 16), (1024, 64), (2 ** 20, 8192), (resource.RLIM_INFINITY, 8192), (8, 1)):
        monkeypatch.setattr(resource, "getrlimit", lambda kind, soft=soft: (soft, resource.RLIM_INFINITY))
        assert train_unet.open_images_limit() == want, soft


def test_patches_are_the_same_whether_images_stay_open_or_not(make_cfg, tmp_path, monkeypatch):
    root = write_pairs(tmp_path / "few", 6)
    cfg = patch_cfg(make_cfg, root, patches_per_image=3, patch_foreground=0.5)
    train, _ = train_unet.prepare_data(cfg)
    sizes = train_unet.image_sizes(train, cfg)
    kept = PatchDataset(train, cfg, sizes)
    monkeypatch.setattr(train_unet, "MAX_OPEN_IMAGES", 1)
    reopened = PatchDataset(train, cfg, sizes)
    order = [0, 5, 3, 0, 14, 7, 1]
    for i in order:
        (x, y), (x1, y1) = kept[i], reopened[i]
        assert torch.equal(x, x1) and torch.equal(y, y1)
    assert len(reopened.maps) == 1 and len(kept.maps) == len({i // 3 for i in order})


# ---------------------------------------------------------------------------------------------------
# Item 8: validation images do not cross shared memory
# ---------------------------------------------------------------------------------------------------
def test_patch_validation_reads_whole_images_in_this_process(make_cfg, tmp_path, monkeypatch, cpu_hw):
    """A loader worker would hand a whole image over through /dev/shm (64 MB in a default Docker
    container; an 8000² RGB image is 192 MB: a bus error). Every validation image is read here, in
    validation_shard's order, and equals the data set's item."""
    root = write_pairs(tmp_path / "val", 10)
    cfg = patch_cfg(make_cfg, root, num_workers=2, val_fraction=0.4)
    train, val = train_unet.prepare_data(cfg)
    readers, real = [], train_unet.read_pair
    monkeypatch.setattr(train_unet, "read_pair", lambda pair, cfg: readers.append(os.getpid()) or real(pair, cfg))
    train_loader, val_loader = train_unet.build_loaders(train, val, cfg, cpu_hw)
    assert train_loader.num_workers == 2  # training patches still come from workers
    items = list(val_loader)
    assert readers == [os.getpid()] * len(val) and len(items) == len(val_loader) == len(val)
    whole = train_unet.WholeImages(val, cfg)
    for (image, mask), i in zip(items, train_unet.validation_shard(val, cfg)):
        assert torch.equal(image, whole[i][0]) and torch.equal(mask, whole[i][1])


def test_a_failed_validation_read_reaches_the_caller(make_cfg, tmp_path, cpu_hw):
    root = write_pairs(tmp_path / "bad", 10)
    cfg = patch_cfg(make_cfg, root, val_fraction=0.4)
    train, val = train_unet.prepare_data(cfg)
    _, val_loader = train_unet.build_loaders(train, val, cfg, cpu_hw)
    val[1][0].write_bytes(b"not a png")
    with pytest.raises(UserError, match="cannot read image"):
        list(val_loader)


# ---------------------------------------------------------------------------------------------------
# Item 18: every foreground pixel can be a centre
# ---------------------------------------------------------------------------------------------------
def coordinate_image(h, w):
    """Each pixel's (row, col) in its channels: a patch tells where it was cut."""
    rows, cols = np.indices((h, w))
    return np.stack([rows % 256, cols % 256, rows // 256 * 16 + cols // 256], axis=-1).astype(np.uint8)


def patch_corner(patch):
    r, c, high = (int(v) for v in patch[0, 0])
    return r + 256 * (high // 16), c + 256 * (high % 16)


def many_objects(side=30, step=60, per_row=10):
    """100 objects of 30x30 on a 640x640 mask: 90,000 foreground pixels, far more than a fixed sample
    keeps, none so near the edge that a patch centred on it would be moved inside the image."""
    mask = np.zeros((640, 640), np.uint8)
    for y in range(step // 2, step * per_row, step):
        for x in range(step // 2, step * per_row, step):
            mask[y:y + side, x:x + side] = 1
    return mask


def test_centred_patches_reach_every_foreground_pixel_over_many_draws(make_cfg, tmp_path, monkeypatch):
    """The patch centres come from all of a class's pixels: 30,000 centred patches on 90,000 foreground
    pixels land on about 26,000 distinct centres (a fixed sample of 4,096 positions: at most 4,096),
    on every object, each object's share close to its share of the pixels."""
    mask, size = many_objects(), 32
    image = coordinate_image(*mask.shape)
    root = tmp_path / "objects"
    (root / "images").mkdir(parents=True)
    (root / "masks").mkdir()
    cv2.imwrite(str(root / "images" / "a.png"), image[..., ::-1])  # RGB as read_image gives it
    cv2.imwrite(str(root / "masks" / "a.png"), mask * 255)
    cfg = patch_cfg(make_cfg, root, image_size=size, patch_foreground=1.0)
    pairs = [(root / "images" / "a.png", root / "masks" / "a.png")]
    image_map, mask_map, foreground = PatchDataset(pairs, cfg, [mask.shape]).load(0)
    assert np.array_equal(image_map, image)
    centres = set()
    for i in range(30000):
        patch, _ = cut_patch(image_map, mask_map, foreground, cfg, np.random.default_rng(i))
        top, left = patch_corner(patch)
        centres.add((top + size // 2, left + size // 2))
    assert all(mask[c] == 1 for c in centres)
    assert len(centres) > 20000, len(centres)
    objects = {(r // 60, c // 60) for r, c in centres}
    assert len(objects) == 100


def test_the_foreground_index_maps_draws_onto_each_pixel_exactly_once():
    rng = np.random.default_rng(0)
    mask = rng.choice([0, 0, 0, 1, 2, IGNORE_INDEX], size=(70, 90)).astype(np.uint8)
    mask[10:20] = 0  # rows without foreground
    index = train_unet.foreground_index(mask, band_rows=16)
    assert [entry[0] for entry in index] == [1, 2]
    for c, rows, cumulative in index:
        total = int(cumulative[-1])
        got = [train_unet.foreground_pixel(mask, (c, rows, cumulative), (k + 0.5) / total) for k in range(total)]
        assert sorted(got) == sorted(zip(*(a.tolist() for a in np.nonzero(mask == c))))


def test_the_foreground_index_grows_with_the_rows_not_the_pixels():
    mask = np.ones((2000, 3000), np.uint8)  # 6 M foreground pixels
    (_, rows, cumulative), = train_unet.foreground_index(mask)
    assert rows.nbytes + cumulative.nbytes <= 12 * 2000
    assert int(cumulative[-1]) == mask.size


# ---------------------------------------------------------------------------------------------------
# Item 21: temporary disk
# ---------------------------------------------------------------------------------------------------
def test_the_cache_estimate_counts_every_process_on_the_node(make_cfg, monkeypatch, capsys):
    """Under torchrun each of a node's LOCAL_WORLD_SIZE processes caches every image it reads: four
    caches must fit, not one."""
    cfg = make_cfg()
    train, _ = train_unet.prepare_data(cfg)
    need = train_unet.cache_bytes(train, cfg)
    monkeypatch.setattr(train_unet.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=2 * need * 3))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert train_unet.SegDataset(train, cfg, train=True).resized is None
    assert "(4 processes on this machine, a copy each)" in capsys.readouterr().out
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert train_unet.SegDataset(train, cfg, train=True).resized is not None


def test_patch_mode_estimates_its_cache_and_stops_where_it_would_not_fit(make_cfg, tmp_path, monkeypatch):
    root = write_pairs(tmp_path / "scenes", 8, size=(50, 70))
    cfg = patch_cfg(make_cfg, root, patch_scale=0.5)
    train, _ = train_unet.prepare_data(cfg)
    sizes = train_unet.image_sizes(train, cfg)
    need = train_unet.cache_bytes(train, cfg, sizes)
    dataset = PatchDataset(train, cfg, sizes)
    for i in range(len(dataset)):
        dataset[i]
    files = list(dataset.decoded.folder.glob("*.npy"))
    written = sum(f.stat().st_size for f in files)
    assert len(files) == 2 * len(train) and need <= written <= need + 256 * len(files)  # + .npy headers
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(train_unet.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=2 * need - 1))
    with pytest.raises(UserError) as info:
        PatchDataset(train, cfg, sizes)
    message = str(info.value)
    assert "\n" not in message and f"{train_unet.size_text(2 * need)} (2 processes on this machine" in message
    assert message.endswith("point TMPDIR at a larger disk, lower patch_scale or max_train_images")
    monkeypatch.setattr(train_unet.shutil, "disk_usage", lambda path: types.SimpleNamespace(free=2 * need))
    PatchDataset(train, cfg, sizes)


def plant(root, name):
    folder = root / name
    folder.mkdir()
    (folder / "0_image.npy").write_bytes(b"x" * 100)
    return folder


def test_caches_left_by_killed_runs_are_removed_and_live_ones_kept(tmp_path, monkeypatch):
    """A run killed outright (kill -9, the OOM killer) cannot remove its cache; the next run does. A
    cache whose lock another process holds (a run in another container sharing /tmp) stays, and so do
    folders named as older versions named them, whose owner nothing identifies."""
    pytest.importorskip("fcntl")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    stale, live = plant(tmp_path, "unet_amp_decoded_4242-deadbeef"), plant(tmp_path, "unet_amp_decoded_77-alive123")
    older = plant(tmp_path, "unet_amp_decoded_k3j_8x2a")
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import fcntl, os, sys
        fd = os.open({str(live)!r}, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        sys.stdin.read()
    """)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        first = train_unet.DecodedImages()
        assert not stale.exists() and live.exists() and older.exists()
        assert first.folder.name.startswith(f"unet_amp_decoded_{os.getpid()}-")
        second = train_unet.DecodedImages()  # this process's own live cache is not taken for stale
        assert first.folder.exists() and second.folder.exists()
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    train_unet.DecodedImages()
    assert not live.exists()  # its owner is gone
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([first.folder.name, second.folder.name, older.name])


# ----------------------------------------------------------------------------------------------------
# Review: a removed cache file, a killed run's cache before the estimates, fit validation's masks
# ----------------------------------------------------------------------------------------------------
def test_a_decoded_file_removed_during_the_run_is_decoded_again(tmp_path, monkeypatch):
    """A temporary-file cleaner removes a cached image a worker has already mapped once: the next read
    decodes it again, as the first did, instead of a FileNotFoundError from inside a loader worker."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    cache, decodes = train_unet.DecodedImages(), []
    pair = np.arange(12, dtype=np.uint8).reshape(3, 4), np.ones((3, 4), np.uint8)

    def decode():
        decodes.append(1)
        return pair
    first = cache.get(0, decode)
    for path in cache.folder.iterdir():
        path.unlink()
    again = cache.get(0, decode)
    assert len(decodes) == 2 and all(np.array_equal(a, b) for a, b in zip(again, first))


@pytest.mark.parametrize("data_mode", ["fit", "patch"])
def test_a_killed_runs_cache_is_removed_before_the_free_space_is_estimated(make_cfg, tmp_path, monkeypatch,
                                                                           data_mode):
    """The estimates (image_cache, check_patch_cache_room) must not count a dead run's decoded images as
    used space; in fit mode with caching off, no DecodedImages would ever remove them otherwise."""
    pytest.importorskip("fcntl")
    temp = tmp_path / "temp"
    temp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    stale = plant(temp, "unet_amp_decoded_4242-deadbeef")
    seen = []
    real = shutil.disk_usage
    monkeypatch.setattr(train_unet.shutil, "disk_usage", lambda path: seen.append(stale.exists()) or real(path))
    cfg = make_cfg(data_mode=data_mode, cache_images=data_mode == "patch")
    train, val = train_unet.prepare_data(cfg)
    train_unet.build_datasets(train, val, cfg)
    assert not stale.exists() and seen == ([False] if data_mode == "patch" else [])


def test_fit_validation_reads_original_masks_in_this_process(make_cfg, monkeypatch):
    """Loader workers hand over resized images and the masks' paths only; the original masks (any size)
    are read by the training process, never through shared memory."""
    cfg = make_cfg(num_workers=1, cache_images=False)
    train, val = train_unet.prepare_data(cfg)
    reads, real = [], train_unet.read_classes
    monkeypatch.setattr(train_unet, "read_classes", lambda path, c: reads.append(os.getpid()) or real(path, c))
    _, loader = train_unet.build_loaders(train, val, cfg, train_unet.detect_hardware("cpu"))
    batches = list(loader)
    assert all(isinstance(p, str) for batch in batches for p in batch[2])
    reads.clear()
    model = train_unet.build_model(cfg).eval()
    prec = train_unet.decide_precision(train_unet.detect_hardware("cpu"), use_amp=False)
    for batch in batches:
        list(train_unet.fit_pieces(model, batch, cfg, prec, train_unet.detect_hardware("cpu")))
    assert reads == [os.getpid()] * len(val)


def test_sizes_in_messages_are_readable():
    assert [train_unet.size_text(n) for n in (5 * 2**20, 1536 * 2**20, 3 * 2**40)] == ["5 MB", "1.5 GB", "3.0 TB"]


def test_fit_validation_decodes_original_masks_while_the_model_runs(make_cfg, monkeypatch):
    """The original masks of a batch are decoded on threads started before the forward pass (a 12 MP
    mask takes ~50 ms): the forward below waits until a read has begun, as it would overlap on a GPU."""
    cfg = make_cfg(num_workers=0)
    train, val = train_unet.prepare_data(cfg)
    _, loader = train_unet.build_loaders(train, val, cfg, train_unet.detect_hardware("cpu"))
    batch = next(iter(loader))  # the loader reads its masks too (resized): watched from here on
    started, real_read, real_forward = threading.Event(), train_unet.read_classes, train_unet.eval_forward
    monkeypatch.setattr(train_unet, "read_classes", lambda path, c: started.set() or real_read(path, c))

    def forward(*args):
        assert started.wait(timeout=5), "no mask read had begun when the forward pass ran"
        return real_forward(*args)
    monkeypatch.setattr(train_unet, "eval_forward", forward)
    model = train_unet.build_model(cfg).eval()
    prec = train_unet.decide_precision(train_unet.detect_hardware("cpu"), use_amp=False)
    pieces = list(train_unet.fit_pieces(model, batch, cfg, prec, train_unet.detect_hardware("cpu")))
    assert sum(len(target) for _, target in pieces[0][3]) == len(batch[2])


@pytest.mark.parametrize("mode", ["fit", "patch"])
def test_a_start_up_stats_each_file_once(make_cfg, monkeypatch, mode):
    """The data check stats every file (file_stamp) and loads its cache; the start-up's later questions
    (intensity range, int32 images, cache size, image sizes) take its facts: they statted every file
    again each, 3 to 4 times in all, a second's work each on a large set."""
    stamped, real = collections.Counter(), train_unet.file_stamp
    monkeypatch.setattr(train_unet, "file_stamp", lambda path: (stamped.update([path]), real(path))[1])
    cfg = make_cfg(data_mode=mode, cache_images=True, class_weights="auto", loss="ce")
    train_unet.train(cfg)
    assert len(stamped) == 24 and set(stamped.values()) == {1}, stamped


def test_a_failed_start_up_leaves_no_facts_behind(make_cfg, monkeypatch):
    """start_up_facts trusts CHECKED_HERE without statting: a start-up stopped after the data check must not
    leave its facts for a later call in the same process (a notebook) to take once files have changed."""
    def stop(*args):
        raise UserError("stopped after the data check")
    monkeypatch.setattr(train_unet, "build_loaders", stop)
    with pytest.raises(UserError, match="stopped after the data check"):
        train_unet.train(make_cfg())
    assert train_unet.CHECKED_HERE == {}


def test_the_start_ups_facts_are_let_go_once_the_loaders_are_built(make_cfg):
    cfg = make_cfg()
    train, val = train_unet.prepare_data(cfg)
    assert train_unet.CHECKED_HERE
    train_unet.build_loaders(train, val, cfg, train_unet.detect_hardware("cpu"))
    assert train_unet.CHECKED_HERE == {}
