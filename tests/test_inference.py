"""Predict at the speed of the forward pass (issue 24): the sliding window cuts its tiles from the image as
read, normalises a batch at a time and blends on the device, with no host sync per tile batch; predict
reads ahead and writes behind on threads. Outputs are today's to the bit. Counted, not timed."""
import contextlib
import io
import os
import sys
import threading
import time
import types
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import train_unet
from train_unet import decide_precision

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
from overhead import OpCounter  # noqa: E402  (tools/overhead.py: counts dispatched aten ops)

CONVERSIONS = ("cpu", "item", "tolist", "__bool__", "__float__", "__int__", "numpy")


def window_cfg(**overrides):
    cfg = train_unet.validate_config(dict(train_unet.CONFIG, data_mode="patch", image_size=64, num_classes=3,
                                          tile_batch_size=4, encoder_name="resnet18", channels_last=False))
    return {**cfg, **overrides}


def reference_window(model, image, cfg, prec, hw):
    """The sliding window as it was before issue 24: each tile normalised alone, its weighted logits copied
    to the host per batch and added there. The new one must give these logits to the bit."""
    size, (h, w) = cfg["image_size"], image.shape[:2]
    padded = train_unet.pad_to(image, size, size, 0)
    ys, xs = (train_unet.tile_starts(n, size, cfg["tile_overlap"]) for n in padded.shape[:2])
    ramp, normalize = train_unet.gaussian_ramp(size), train_unet.normalizer(cfg)
    weight = ramp[:, None] * ramp[None, :]
    total = torch.zeros(cfg["num_classes"], *padded.shape[:2])
    tiles = [(y, x) for y in ys for x in xs]
    for i in range(0, len(tiles), cfg["tile_batch_size"]):
        batch = tiles[i:i + cfg["tile_batch_size"]]
        x = torch.stack([train_unet.image_tensor(normalize(padded[y:y + size, x:x + size])) for y, x in batch])
        logits = (train_unet.eval_forward(model, x, cfg, prec, hw).float() * weight).cpu()
        for (y, x), tile in zip(batch, logits):
            total[:, y:y + size, x:x + size] += tile
    total.div_(train_unet.coverage(ys, padded.shape[0], ramp)[None, :, None])
    return total.div_(train_unet.coverage(xs, padded.shape[1], ramp)[None, None, :])[:, :h, :w]


@pytest.mark.parametrize("channels, dtype, nhwc", [(3, np.uint8, False), (3, np.uint8, True), (1, np.uint8, False),
                                                   (3, np.float32, False), (1, np.float32, True)])
def test_sliding_window_logits_are_the_per_tile_ones_to_the_bit(cpu_hw, channels, dtype, nhwc):
    cfg = window_cfg(in_channels=channels, channels_last=nhwc, tile_batch_size=5)
    torch.manual_seed(0)
    model = train_unet.build_model(cfg).eval()
    model = model.to(memory_format=torch.channels_last) if nhwc else model
    rng = np.random.default_rng(0)
    shape = (150, 117, channels) if channels == 3 else (150, 117)
    image = rng.integers(0, 256, shape).astype(np.uint8) if dtype == np.uint8 else rng.random(shape, dtype=np.float32)
    prec = decide_precision(cpu_hw, use_amp=False)
    with torch.inference_mode():
        new, old = train_unet.sliding_window(model, image, cfg, prec, cpu_hw), reference_window(model, image, cfg, prec, cpu_hw)
    assert new.shape == old.shape == (3, 150, 117) and torch.equal(new, old)


@pytest.mark.parametrize("channels, nhwc", [(3, False), (3, True), (1, False)])
def test_tiles_normalised_on_the_device_give_the_same_logits_to_the_bit(cpu_hw, monkeypatch, channels, nhwc):
    """On CUDA an 8-bit image's tiles go to the device raw and are looked up there in the host's tables
    (DeviceNormalize); run here on the CPU (normalise_on_device forced), the logits equal the per-tile
    window's to the bit, in either layout and for one channel."""
    cfg = window_cfg(in_channels=channels, channels_last=nhwc, tile_batch_size=5)
    torch.manual_seed(0)
    model = train_unet.build_model(cfg).eval()
    model = model.to(memory_format=torch.channels_last) if nhwc else model
    shape = (150, 117, channels) if channels == 3 else (150, 117)
    image = np.random.default_rng(0).integers(0, 256, shape).astype(np.uint8)
    prec, made = decide_precision(cpu_hw, use_amp=False), []
    real = train_unet.DeviceNormalize.__call__
    monkeypatch.setattr(train_unet, "normalise_on_device", lambda image, hw: True)
    monkeypatch.setattr(train_unet.DeviceNormalize, "__call__",
                        lambda self, tiles: made.append(len(tiles)) or real(self, tiles))
    with torch.inference_mode():
        new = train_unet.sliding_window(model, image, cfg, prec, cpu_hw)
        old = reference_window(model, image, cfg, prec, cpu_hw)
    tiles = [len(train_unet.tile_starts(n, 64, cfg["tile_overlap"])) for n in (150, 117)]
    assert made == [5, 4] and tiles == [3, 3]  # every tile batch made on the "device"
    assert torch.equal(new, old)


def test_only_8_bit_images_are_normalised_on_a_cuda_device(cpu_hw):
    import types

    cuda = types.SimpleNamespace(kind="cuda", device="cuda:0")
    assert train_unet.normalise_on_device(np.zeros((4, 4, 3), np.uint8), cuda)
    assert not train_unet.normalise_on_device(np.zeros((4, 4, 3), np.float32), cuda)  # albumentations' arithmetic
    assert not train_unet.normalise_on_device(np.zeros((4, 4, 3), np.uint8), cpu_hw)


def window_counts(image_side, monkeypatch, cpu_hw, on_device=False):
    """(aten ops, host conversions) of one sliding window over a square image, a 1x1 conv as the model;
    on_device: its tiles normalised as on CUDA (DeviceNormalize)."""
    cfg = window_cfg(num_classes=2, tile_overlap=0.0)
    model = torch.nn.Conv2d(3, 2, 1).eval()
    image = np.zeros((image_side, image_side, 3), np.uint8)
    calls = []
    monkeypatch.setattr(train_unet, "normalise_on_device", lambda image, hw: on_device)
    for name in CONVERSIONS:
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: calls.append(_n) or _r(self, *a, **k))
    with torch.inference_mode(), OpCounter() as counter:
        train_unet.sliding_window(model, image, cfg, decide_precision(cpu_hw, use_amp=False), cpu_hw)
    monkeypatch.undo()
    return sum(counter.ops.values()), calls


def test_no_host_sync_per_tile_batch_and_few_ops(cpu_hw, monkeypatch):
    """4 tiles (1 batch) vs 16 tiles (4 batches) of 64 px: the same host conversions (one copy of the result
    at the end, none per tile batch: on a GPU each is a sync), and per extra tile batch only the forward
    (one conv), the blend (one weighting, two slices and an add per tile) and a few to make the input
    (from_numpy and permute over the batch's normalised memory; the rows' and columns' weight sums add a few
    per tile row)."""
    ops_1, calls_1 = window_counts(128, monkeypatch, cpu_hw)
    ops_4, calls_4 = window_counts(256, monkeypatch, cpu_hw)
    assert calls_4 == calls_1 and calls_1.count("cpu") <= 1
    per_batch = (ops_4 - ops_1) / 3
    # conv; unbind, to, mul (weighting); 4 x (2 slices, add_); from_numpy, permute, to; the weight sums'
    # few per tile row: 23.3 here (27.3 when the batch was normalised, then copied into its layout; the
    # per-tile normalising window before that: 40.3)
    assert per_batch <= 1 + 3 + 3 * 4 + 3 + 6, per_batch


def test_tiles_normalised_on_the_device_add_no_sync_and_few_ops(cpu_hw, monkeypatch):
    """DeviceNormalize per tile batch: no host conversion (on a GPU a sync), and in place of the host's
    from_numpy and permute: from_numpy, to (the copy), to int64, add the channels' offsets, the lookup,
    permute and clone (NCHW): 6 more ops a batch here (29.3 against 23.3), 5 small kernels on a GPU."""
    ops_1, calls_1 = window_counts(128, monkeypatch, cpu_hw, on_device=True)
    ops_4, calls_4 = window_counts(256, monkeypatch, cpu_hw, on_device=True)
    assert calls_4 == calls_1 and calls_1.count("cpu") <= 1
    host_1, _ = window_counts(128, monkeypatch, cpu_hw)
    host_4, _ = window_counts(256, monkeypatch, cpu_hw)
    assert (ops_4 - ops_1) / 3 <= (host_4 - host_1) / 3 + 6, ((ops_4 - ops_1) / 3, (host_4 - host_1) / 3)


@pytest.fixture
def on_threads(monkeypatch):
    """predict reads and writes on threads, as where the model leaves a core free (predict_host_threads): the
    suite's torch runs on one thread, but a machine whose cores are all torch's reads between the forwards."""
    monkeypatch.setattr(train_unet, "predict_host_threads", lambda hw: True)


def test_predict_reads_the_next_batch_while_this_one_is_predicted(on_threads, checkpoint_cfg, tmp_path, monkeypatch):
    """The second batch's images are read (on reader threads) before the first batch's masks are done,
    and masks are written on a writer thread, in order."""
    ckpt, data = checkpoint_cfg
    events, lock = [], threading.Lock()
    real_read, real_masks = train_unet.read_image, train_unet.predict_masks

    def read_image(path, *args):
        with lock:
            events.append(("read", path.name))
        return real_read(path, *args)

    def predict_masks(model, images, *args):
        time.sleep(0.3)  # the model's time: the next batch's reads run meanwhile
        with lock:
            events.append(("masks", len(images)))
        return real_masks(model, images, *args)
    writers = []
    real_save = train_unet.save_prediction
    monkeypatch.setattr(train_unet, "read_image", read_image)
    monkeypatch.setattr(train_unet, "predict_masks", predict_masks)
    monkeypatch.setattr(train_unet, "save_prediction",
                        lambda path, *a: writers.append((threading.current_thread().name, path.name)) or real_save(path, *a))
    out = tmp_path / "pred"
    result = train_unet.predict({"checkpoint": str(ckpt), "input": str(data / "images"), "output": str(out),
                                 "batch_size": 4, "device": "cpu", "use_amp": False, "progress": False})
    assert result["predicted"] == 12 and not result["failed"]
    first_masks = events.index(("masks", 4))
    reads_before = [e for e in events[:first_masks] if e[0] == "read"]
    assert len(reads_before) == 8  # the first batch, and the second read ahead
    assert all(name.startswith("unet-amp-write") for name, _ in writers)
    assert [name for _, name in writers] == sorted(name for _, name in writers)  # in order
    assert len(list(out.glob("*.png"))) == 12


@pytest.mark.parametrize("slow", ["reading", "writing"])
def test_predict_says_what_its_model_waited_for(on_threads, checkpoint_cfg, tmp_path, monkeypatch, capsys, slow):
    """Where the disk or decoding sets predict's pace (here a 150 ms read or write per image, one reader, two
    masks waiting at most), its last line says how long the model waited for images to be read and for
    masks to be written, and the result holds both (the benchmark's inference table shows them): the slow
    side's wait is the large one. Not counted: the first batch's reading and the last masks' writing,
    which nothing can overlap."""
    ckpt, data = checkpoint_cfg
    real_read, real_save = train_unet.read_image, train_unet.save_prediction
    monkeypatch.setattr(train_unet, "PREDICT_READERS", 1)
    monkeypatch.setattr(train_unet, "MAX_PENDING_MASKS", 2)
    if slow == "reading":
        monkeypatch.setattr(train_unet, "read_image", lambda *a: time.sleep(0.15) or real_read(*a))
    else:
        monkeypatch.setattr(train_unet, "save_prediction", lambda *a: time.sleep(0.15) or real_save(*a))
    result = train_unet.predict({"checkpoint": str(ckpt), "input": str(data / "images"), "output": str(tmp_path / "p"),
                                 "batch_size": 4, "device": "cpu", "use_amp": False, "progress": False})
    assert result["predicted"] == 12
    waits, other = result["waited_s"], "writing" if slow == "reading" else "reading"
    # 12 x 150 ms on one thread: 1.8 s, of which the first batch's reading (4 images, 0.6 s) is not a wait;
    # the model's forwards (slower on a loaded machine) overlap some of the rest
    assert waits[slow] >= 0.4 and waits[other] < waits[slow] / 2, waits
    assert slow == "writing" or waits[slow] <= 1.5, waits
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert f"the model waited {waits['reading']:.2f}s for images to be read, {waits['writing']:.2f}s for masks to " \
           f"be written" in last


def test_predicts_last_line_names_waits_only_where_they_count():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_unet.print_predict_summary(10, 2.0, {"reading": 0.1, "writing": 0.05}, [], Path("masks"))
        train_unet.print_predict_summary(10, 2.0, {"reading": 0.25, "writing": 0.05}, [], Path("masks"))
    quiet, waited = out.getvalue().splitlines()
    assert quiet == "predicted 10 image(s) in 2.0s (5.0 img/s) -> masks/"
    assert waited.endswith("(the model waited 0.25s for images to be read, 0.05s for masks to be written)")


def test_a_predict_with_no_mask_written_names_no_waits():
    """Every image failed: 'predicted 0 image(s) in 0.0s' went on '(reading took 0.00s, writing 0.00s, ...)'."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        train_unet.print_predict_summary(0, 0.0, {"reading": 0.0, "writing": 0.0}, [("a.tif", "a.tif: a stack")],
                                         Path("masks"), threads=False)
    assert out.getvalue().splitlines() == ["predicted 0 image(s) in 0.0s (0.0 img/s) -> masks/; 1 failed:",
                                           "  failed: a.tif: a stack"]


def test_building_the_normalisation_is_not_counted_as_reading(checkpoint_cfg, tmp_path, monkeypatch):
    """Its first build imports albumentations (1.3 s): a one-image predict said 'reading took 1.16s' of a PNG
    that reads in 1.4 ms (user test). Here the build takes 1.5 s, the reading (between the forwards) far less."""
    ckpt, data = checkpoint_cfg
    real = train_unet.UnitRangeNormalize.__init__
    monkeypatch.setattr(train_unet.UnitRangeNormalize, "__init__", lambda *a: time.sleep(1.5) or real(*a))
    monkeypatch.setattr(train_unet, "predict_host_threads", lambda hw: False)
    train_unet.channel_normalizer.cache_clear()
    try:
        result = train_unet.predict({"checkpoint": str(ckpt), "input": str(data / "images"), "device": "cpu",
                                     "output": str(tmp_path / "p"), "use_amp": False, "progress": False})
    finally:
        train_unet.channel_normalizer.cache_clear()  # not kept built by the stand-in
    assert result["predicted"] == 12 and result["waited_s"]["reading"] < 1.0, result["waited_s"]


def test_the_last_masks_writing_is_not_a_wait(on_threads, checkpoint_cfg, tmp_path, monkeypatch):
    """12 masks at 100 ms each, all of them allowed to wait (MAX_PENDING_MASKS): the model never waited for
    the writer; the writing after the last forward (read_ahead's settle once counted it) is left out."""
    ckpt, data = checkpoint_cfg
    real_save = train_unet.save_prediction
    monkeypatch.setattr(train_unet, "save_prediction", lambda *a: time.sleep(0.1) or real_save(*a))
    result = train_unet.predict({"checkpoint": str(ckpt), "input": str(data / "images"), "output": str(tmp_path / "p"),
                                 "batch_size": 4, "device": "cpu", "use_amp": False, "progress": False})
    assert result["predicted"] == 12 and result["waited_s"]["writing"] < 0.3, result["waited_s"]


def test_a_failed_predict_ends_its_reader_threads_at_once(on_threads, checkpoint_cfg, tmp_path, monkeypatch):
    """A batch that cannot be predicted stops predict; the reader threads (and the images they read ahead)
    end then, not when the kept traceback goes (a notebook keeps the last one)."""
    ckpt, data = checkpoint_cfg
    calls = []

    def masks(*args):
        calls.append(1)
        if len(calls) == 2:
            raise train_unet.UserError("stand-in failure")
        return real_masks(*args)
    real_masks = train_unet.masks_within_memory
    monkeypatch.setattr(train_unet, "masks_within_memory", masks)
    with pytest.raises(train_unet.UserError) as kept:
        train_unet.predict({"checkpoint": str(ckpt), "input": str(data / "images"), "output": str(tmp_path / "p"),
                            "batch_size": 4, "device": "cpu", "use_amp": False, "progress": False})
    assert kept.value is not None  # the exception, its traceback and predict's frame are still held here
    alive = [t.name for t in threading.enumerate() if t.name.startswith("unet-amp-read")]
    assert not alive, alive


def test_the_inference_table_shows_predicts_waits():
    row = {"mode": "fp32", "data_mode": "fit", "status": "ok", "images": 2, "predict_s": 1.0, "vs_forward_only": 1.1,
           "images_per_s": 2.0, "megapixels_per_s": 0.1, "rounds": 3, "round_spread": 1.0}
    table = train_unet.format_inference_table([{**row, "reading_wait_s": 0.25, "writing_wait_s": 0.0}, row])
    assert "| Waited: read / write |" in table and "| 0.25s / 0.00s " in table
    assert table.splitlines()[-1].split("|")[6].strip() == "-"  # a row from an older inference.json


def test_fit_inputs_are_made_on_the_reader_threads_with_validations_preprocessing(on_threads, checkpoint_cfg,
                                                                                  tmp_path, monkeypatch):
    """Fit mode: each image is resized and normalised on a reader thread (fit_input), not by the main
    thread that feeds the model; the albumentations pipeline is built once per thread, not per batch; the
    masks are predict_batch's (made on the main thread) to the bit."""
    ckpt, data = checkpoint_cfg
    made, builds, lock = [], [], threading.Lock()
    real_input, real_build = train_unet.fit_input, train_unet.fit_transforms

    def fit_input(image, cfg):
        with lock:
            made.append(threading.current_thread().name)
        return real_input(image, cfg)

    def fit_transforms(*args, **kwargs):
        builds.append(threading.current_thread().name)
        return real_build(*args, **kwargs)
    monkeypatch.setattr(train_unet, "fit_input", fit_input)
    monkeypatch.setattr(train_unet, "fit_transforms", fit_transforms)
    train_unet.fit_geometry.cache_clear()
    out = tmp_path / "pred"
    result = train_unet.predict({"checkpoint": str(ckpt), "input": str(data / "images"), "output": str(out),
                                 "batch_size": 2, "device": "cpu", "use_amp": False, "progress": False})
    assert result["predicted"] == 12
    assert len(made) == 12 and all(name.startswith("unet-amp-read") for name in made)
    readers = [name for name in builds if name.startswith("unet-amp-read")]  # fit_region builds one too
    assert 1 <= len(readers) <= min(2, train_unet.PREDICT_READERS)  # per reader thread; 6 batches
    model, cfg = train_unet.load_model(ckpt, train_unet.detect_hardware("cpu"))
    paths = train_unet.list_images(data / "images")
    images = [train_unet.read_image(p, cfg["in_channels"], cfg["intensity_range"]) for p in paths]
    prec = decide_precision(train_unet.detect_hardware("cpu"), use_amp=False)
    expected = train_unet.predict_batch(model, images, cfg, prec, train_unet.detect_hardware("cpu"))
    for path, mask in zip(paths, expected):
        written = train_unet.cv2.imread(str(out / f"{path.stem}.png"), train_unet.cv2.IMREAD_UNCHANGED)
        assert np.array_equal(written, train_unet.mask_to_png(mask, cfg["num_classes"]))


def test_predict_reads_on_threads_only_where_the_model_leaves_a_core(monkeypatch):
    """Where torch's threads take every core, a reader thread takes a core from one of them and the others
    wait for it at the next barrier: predict reads and writes between the forwards there."""
    cores = train_unet.usable_cores() or 1
    monkeypatch.setattr(train_unet.torch, "get_num_threads", lambda: cores)
    cpu = train_unet.detect_hardware("cpu")
    assert train_unet.predict_host_threads(cpu) is False
    assert train_unet.predict_host_threads(types.SimpleNamespace(kind="cuda")) is True  # the GPU runs the model
    assert train_unet.predict_host_threads(types.SimpleNamespace(kind="mps")) is True
    monkeypatch.setattr(train_unet, "usable_cores", lambda: cores + 1)  # a core torch leaves free
    assert train_unet.predict_host_threads(cpu) is True


@pytest.mark.parametrize("slow", [None, "reading", "writing"])
def test_without_a_free_core_predict_reads_and_writes_between_the_forwards(checkpoint_cfg, tmp_path, monkeypatch,
                                                                           capsys, slow):
    """No reader or writer thread: batch k is read, predicted and its masks written before batch k + 1 is read;
    the masks are those of the threaded run to the bit; the last line says what reading and writing took."""
    ckpt, data = checkpoint_cfg
    args = {"checkpoint": str(ckpt), "input": str(data / "images"), "batch_size": 4, "device": "cpu",
            "use_amp": False, "progress": False}
    train_unet.predict({**args, "output": str(tmp_path / "threads")})  # the suite's torch leaves a core: threads
    events, real = [], {name: getattr(train_unet, name) for name in ("read_image", "predict_masks", "save_prediction")}

    def noted(kind, name):
        def call(*a):
            events.append((kind, threading.current_thread().name))
            time.sleep(0.1 if slow == {"read": "reading", "write": "writing"}.get(kind) else 0)
            return real[name](*a)
        return call
    monkeypatch.setattr(train_unet, "predict_host_threads", lambda hw: False)
    for kind, name in (("read", "read_image"), ("masks", "predict_masks"), ("write", "save_prediction")):
        monkeypatch.setattr(train_unet, name, noted(kind, name))
    capsys.readouterr()
    result = train_unet.predict({**args, "output": str(tmp_path / "between")})
    assert result["predicted"] == 12 and not result["failed"]
    assert {name for _, name in events} == {threading.current_thread().name}
    assert [kind for kind, _ in events] == (["read"] * 4 + ["masks"] + ["write"] * 4) * 3
    for mask in (tmp_path / "threads").glob("*.png"):
        assert np.array_equal(cv2.imread(str(mask), cv2.IMREAD_UNCHANGED),
                              cv2.imread(str(tmp_path / "between" / mask.name), cv2.IMREAD_UNCHANGED))
    last, waits = capsys.readouterr().out.strip().splitlines()[-1], result["waited_s"]
    if slow:  # every batch's reading counts (the model waited for each), and every mask's writing
        assert waits[slow] >= 12 * 0.1 and waits["reading" if slow == "writing" else "writing"] < waits[slow] / 2
        assert (f"(reading took {waits['reading']:.2f}s, writing {waits['writing']:.2f}s, between the forwards: "
                f"the model's threads use every core)") in last
    assert not [t.name for t in threading.enumerate() if t.name.startswith(("unet-amp-read", "unet-amp-write"))]


def test_without_a_free_core_a_failed_write_is_predicts_one_line_error(checkpoint_cfg, tmp_path, monkeypatch):
    ckpt, data = checkpoint_cfg
    monkeypatch.setattr(train_unet, "predict_host_threads", lambda hw: False)
    real_save, saved = train_unet.save_prediction, []

    def save(path, image, done):
        if len(saved) == 5:
            raise train_unet.UserError(f"cannot write {path} (No space left on device): stand-in; the {done} "
                                       f"image(s) predicted before it are kept")
        saved.append(path)
        return real_save(path, image, done)
    monkeypatch.setattr(train_unet, "save_prediction", save)
    with pytest.raises(train_unet.UserError, match=r"No space left on device.*the 5 image\(s\) predicted before it"):
        train_unet.predict({"checkpoint": str(ckpt), "input": str(data / "images"), "output": str(tmp_path / "p"),
                            "batch_size": 4, "device": "cpu", "use_amp": False, "progress": False})
    assert sorted(p.name for p in (tmp_path / "p").glob("*.png")) == sorted(p.name for p in saved)


@pytest.fixture
def checkpoint_cfg(make_cfg, data_dir, tmp_path):
    cfg = make_cfg(image_size=32, epochs=1, checkpoint_dir=str(tmp_path / "ckpt"))
    train_unet.train(cfg)
    return tmp_path / "ckpt" / "best.pt", data_dir


@pytest.mark.parametrize("channels", [3, 1])
@pytest.mark.parametrize("dtype", [np.uint8, np.float32])
def test_fit_input_is_validations_preprocessing_to_the_bit(channels, dtype):
    """fit_input's shortcuts (no resize or padding for an image at the model's size; uint8 looked up per
    channel straight into C x H x W) give what build_transforms' augmentation-free pipeline (training's
    normalisation) gives, at every shape."""
    rng, size = np.random.default_rng(0), 32
    cfg = {"image_size": size, "in_channels": channels}
    pipeline = train_unet.build_transforms(cfg, train=False)
    for shape in [(size, size), (size - 5, size), (size, 2 * size + 3), (7, 5), (3 * size, size)]:
        shape += (3,) if channels == 3 else ()
        image = (rng.integers(0, 256, shape).astype(np.uint8) if dtype == np.uint8
                 else rng.random(shape, dtype=np.float32))
        expected = train_unet.image_tensor(pipeline(image=image)["image"])
        made = train_unet.fit_input(image, cfg)
        assert made.shape == (channels, size, size) and made.dtype == torch.float32
        assert torch.equal(made, expected), shape


def test_a_failed_write_surfaces_as_predicts_one_line_error(checkpoint_cfg, tmp_path, monkeypatch):
    ckpt, data = checkpoint_cfg
    calls = []

    def write_png(path, image, mark=None):
        calls.append(path)
        if len(calls) == 3:
            raise OSError(28, "No space left on device")
        return real(path, image, mark)
    real = train_unet.write_png
    monkeypatch.setattr(train_unet, "write_png", write_png)
    with pytest.raises(train_unet.UserError) as err:
        train_unet.predict({"checkpoint": str(ckpt), "input": str(data / "images"), "output": str(tmp_path / "p"),
                            "batch_size": 2, "device": "cpu", "use_amp": False, "progress": False})
    assert "No space left" in str(err.value) and "the 2 image(s) predicted before it are kept" in str(err.value)
    assert len(list((tmp_path / "p").glob("*.png"))) == 2


@pytest.mark.parametrize("data_mode", ["fit", "patch"])
def test_the_benchmarks_forward_alone_runs_on_the_inputs_predict_feeds_the_model(cpu_hw, monkeypatch, data_mode):
    """model_inputs (the benchmark's and tools/predict_vs_monai.py's forward alone) makes, beforehand, the
    very batches predict's forwards take: the same count, shapes and values (not random numbers)."""
    cfg = window_cfg(data_mode=data_mode, patch_scale=0.5 if data_mode == "patch" else 1.0)
    torch.manual_seed(0)
    model = train_unet.build_model(cfg).eval()
    rng = np.random.default_rng(1)
    images = [rng.integers(0, 256, shape, dtype=np.uint8) for shape in [(150, 117, 3), (40, 90, 3), (64, 64, 3)]]
    fed, real_forward = [], train_unet.eval_forward
    monkeypatch.setattr(train_unet, "eval_forward", lambda m, x, *a: fed.append(x.clone()) or real_forward(m, x, *a))
    prec = decide_precision(cpu_hw, use_amp=False)
    train_unet.predict_masks(model, images, cfg, prec, cpu_hw) if data_mode == "patch" else \
        [train_unet.predict_masks(model, images[i:i + 2], cfg, prec, cpu_hw) for i in range(0, 3, 2)]
    made = train_unet.model_inputs(images, cfg, cpu_hw, 2)
    assert len(made) == len(fed) == (2 if data_mode == "fit" else len(made)) and len(made) > 1
    for a, b in zip(made, fed):
        assert torch.equal(a, b)


def test_the_peer_tools_keys_replace_its_defaults():
    """tools/predict_vs_monai.py (and tools/memory_reuse.py) take training keys; one its defaults also set
    (image_size=...) replaces the default instead of stopping with 'given twice'."""
    from predict_vs_monai import DEFAULTS, with_defaults
    args = with_defaults(["image_size=64", "use_amp=False"])
    cfg = train_unet.parse_overrides(args)
    assert cfg["image_size"] == 64 and cfg["use_amp"] is False and cfg["data_mode"] == "patch"
    assert len(args) == len(DEFAULTS) + 1


def test_the_monai_tool_without_monai_says_how_to_get_it(monkeypatch, capsys):
    """MONAI is the tool's own dependency: without it, one line and exit 2, not a ModuleNotFoundError."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import predict_vs_monai

    monkeypatch.setitem(sys.modules, "monai", None)  # an import of it fails, installed or not
    monkeypatch.setitem(sys.modules, "monai.inferers", None)
    assert predict_vs_monai.main(["size=64"]) == 2
    assert capsys.readouterr().err.strip() == ("error: this tool compares with MONAI, which is not installed here: "
                                               "pip install monai (the trainer itself does not need it)")


def test_the_predict_phases_tool_times_every_step(tmp_path, capsys):
    """tools/predict_phases.py (BENCHMARKS.md "Predict speed"): each of fit predict's steps timed, a row each;
    each pass writes every mask into a new file and over the previous pass's; an unknown mode is one line,
    exit 2."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import predict_phases

    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=3, size=48)
    ms, count, mode = predict_phases.measure({**predict_phases.TOOL_CONFIG, "input": str(data / "images"),
                                              "mode": "fp32", "rounds": 1, "batch_size": 2}, tmp_path)
    assert (count, mode) == (3, "fp32") and set(ms) == set(predict_phases.STEPS)
    assert all(value > 0 for value in ms.values())
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        f"{stem}{suffix}.png" for stem in ("shape_0000", "shape_0001", "shape_0002") for suffix in ("", "_0", "_1"))
    assert predict_phases.main([f"input={data / 'images'}", "mode=fp16"]) == 2
    assert "mode='fp16' is not allowed" in capsys.readouterr().err


def test_the_predict_phases_tool_times_each_step_to_its_end(tmp_path, monkeypatch):
    """On CUDA a step's kernels run after its call returns: each step's time includes a synchronize (here a
    10 ms stand-in), so "forward" is the GPU's time and "to numpy" not also the forward's wait
    (tools/gpu_check.py runs the tool on the GPU)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import predict_phases

    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=2, size=32)
    monkeypatch.setattr(train_unet, "synchronize", lambda hw: time.sleep(0.01))
    ms, _, _ = predict_phases.measure({**predict_phases.TOOL_CONFIG, "input": str(data / "images"),
                                       "mode": "fp32", "rounds": 1, "batch_size": 2}, tmp_path)
    assert all(value >= 10 / 2 for value in ms.values()), ms  # per image: one 10 ms wait a batch, or more


def test_gpu_check_times_fit_predicts_steps(tmp_path):
    """gpu-check's phases line (run here on the CPU, on a tiny copy of the shapes set it would make)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import gpu_check

    train_unet.generate_shapes_dataset(tmp_path / "shapes", count=3, size=32)
    line = gpu_check.check_phases(train_unet.detect_hardware("cpu"), tmp_path)
    assert ", 3 images of the shapes set, batch 8, ms per image: read " in line and "write, over a file" in line


def test_the_predict_profile_tool_splits_the_main_threads_time(tmp_path, monkeypatch, capsys):
    """tools/predict_profile.py: a whole fit predict against the forwards alone; the main thread's wall time
    split into ran / waited for a core / slept, with predict's own waits for reads and writes taken out of
    the sleep: a 0.1 s sleep a batch in the main thread (a stand-in for a GIL wait) shows as slept, not
    as run; the profiler's busiest calls include the model's convolutions. An unknown mode is one line."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import predict_profile

    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=4, size=32)
    on_host = train_unet.on_host

    def slow_on_host(masks, hw):
        time.sleep(0.1)
        return on_host(masks, hw)
    monkeypatch.setattr(train_unet, "on_host", slow_on_host)
    found = predict_profile.measure({**predict_profile.TOOL_CONFIG, "input": str(data / "images"), "mode": "fp32",
                                     "batch_size": 2, "top": 40}, tmp_path / "work")
    assert found["images"] == 4 and found["mode"] == "fp32" and found["forward_s"] > 0
    assert found["slept_s"] - found["waited_s"] >= 0.2 - 0.02  # two batches, 0.1 s each
    assert found["ran_s"] + found["queued_s"] + found["slept_s"] == pytest.approx(found["wall_s"], abs=1e-6)
    assert found["ran_s"] < found["wall_s"] - 0.15
    names = [name for name, _, _ in found["calls"]]
    assert any("convolution" in name for name in names) and all(count > 0 for _, count, _ in found["calls"])
    lines = predict_profile.report(found).splitlines()
    assert lines[0].startswith("fp32, 4 images: predict ") and "the forwards alone" in lines[0]
    assert lines[1].startswith("main thread: ran ") and "for the GIL, the first batch's reading or a blocking " \
                                                       "call" in lines[1]
    assert lines[2].startswith("busiest calls under torch.profiler (self CPU ms, calls): ")
    assert predict_profile.main([f"input={data / 'images'}", "mode=fp16"]) == 2
    assert "mode='fp16' is not allowed" in capsys.readouterr().err


def test_gpu_check_profiles_fit_predict(tmp_path):
    """gpu-check's profile lines (run here on the CPU, on a tiny copy of the shapes set it would make)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import gpu_check

    train_unet.generate_shapes_dataset(tmp_path / "shapes", count=3, size=32)
    lines = gpu_check.check_profile(train_unet.detect_hardware("cpu"), tmp_path).splitlines()
    assert len(lines) == 3 and ", 3 images: predict " in lines[0] and lines[1].startswith("      main thread: ran ")
    assert [name for name, _ in gpu_check.CHECKS].index("predict profile (fit)") < \
        [name for name, _ in gpu_check.CHECKS].index("inference table")  # before the long table: a cut run has it


def test_the_host_blend_waits_for_each_copy_on_the_copys_own_gpu(monkeypatch):
    """CUDA, blended sum too large for the device: each batch's weighted logits are copied to pinned host
    memory without blocking, and added one batch later once that copy's event has passed. On cuda:1 the
    event was recorded on the current device's stream (cuda:0's, idle), so the host could add a buffer
    still being written. Fake CUDA tensors and events: the order of events is what is checked."""
    import types
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = []

    class Event:
        def __init__(self):
            self.n = sum(c[0] == "record" for c in calls)

        def record(self, stream=None):
            calls.append(("record", stream))

        def synchronize(self):
            calls.append(("wait", self.n))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    monkeypatch.setattr(train_unet, "cuda_free_memory", lambda device: 1)  # nothing fits on the device
    real_accumulate = train_unet.TileBlend.accumulate
    monkeypatch.setattr(train_unet.TileBlend, "accumulate",
                        lambda self, tiles, w: (calls.append(("add", tiles[0])), real_accumulate(self, tiles, w)))
    hw = types.SimpleNamespace(kind="cuda", device=torch.device("cuda:1"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        blend = train_unet.TileBlend(2, (64, 64), 32, hw)
        assert blend.total.device.type == "cpu"
        for tile in ((0, 0), (0, 32)):
            blend.add([tile], torch.randn(1, 2, 32, 32, device="cuda:1"))
        blend.result([0, 32], [0, 32])
    assert calls == [("record", "stream of cuda:1"), ("record", "stream of cuda:1"), ("wait", 0), ("add", (0, 0)),
                     ("wait", 1), ("add", (0, 32))]


def test_the_blend_counts_torchs_cached_gpu_memory_as_free(monkeypatch):
    """After a training epoch torch's allocator holds most of the GPU; the driver's free figure alone sent
    validation's blend to the slower host path though the sum fit in the cache."""
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (1 << 20, 80 << 30))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 60 << 30)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 2 << 30)
    assert train_unet.cuda_free_memory("cuda:0") == (1 << 20) + (58 << 30)


def fit_logits(sizes, classes, nhwc=False, image_size=64):
    """A batch of fit-mode logits (random) for images of these sizes, and its cfg."""
    cfg = {**window_cfg(data_mode="fit", num_classes=classes, image_size=image_size), "channels_last": nhwc}
    logits = torch.randn(len(sizes), classes, image_size, image_size, generator=torch.Generator().manual_seed(0))
    return (logits.contiguous(memory_format=torch.channels_last) if nhwc else logits), cfg


def each_alone(logits, sizes, cfg):
    """Each image's fp32 logits at its original size, the image alone (original_size of a batch of one)."""
    return [train_unet.original_size(logits[i:i + 1].float(), h, w, cfg)[0] for i, (h, w) in enumerate(sizes)]


def test_fit_region_is_where_the_pipeline_puts_the_image():
    """fit_region works out where fit mode's resize and padding put an image: for every size here, the
    rows and columns of an all-ones mask that fit_transforms' pipeline leaves at 1 (sides below, at and
    above the model's, every aspect, odd sides whose rounding lands on .5)."""
    import albumentations as A

    rng = np.random.default_rng(0)
    sizes = {(h, w) for h in (1, 2, 3, 63, 64, 65, 127, 128, 129, 255, 383) for w in (1, 5, 64, 100, 129, 1000)}
    sizes |= {tuple(int(v) for v in rng.integers(1, 2000, 2)) for _ in range(150)}
    for size in (64, 100):
        pipeline = A.Compose(train_unet.fit_transforms(size))
        for h, w in sorted(sizes):
            placed = pipeline(image=np.zeros((h, w, 3), np.uint8), mask=np.ones((h, w), np.uint8))["mask"] == 1
            rows, cols = np.flatnonzero(placed.any(axis=1)), np.flatnonzero(placed.any(axis=0))
            assert placed[:rows[-1] + 1, :cols[-1] + 1].all() and rows[0] == cols[0] == 0, (size, h, w)
            assert train_unet.fit_region(size, h, w) == (rows[-1] + 1, cols[-1] + 1), (size, h, w)


def test_fit_region_of_a_large_scene_allocates_nothing_its_size():
    """A 20,000 x 30,000 scene's region came from running the pipeline on a stand-in image as large as the
    scene (2.4 GB, 1.4 GB of it resident, and 1.9 s) beside the scene itself; it is worked out now."""
    import tracemalloc

    train_unet.fit_region.cache_clear()
    tracemalloc.start()
    try:
        region = train_unet.fit_region(256, 20_000, 30_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert region == (171, 256) and peak < 1 << 20


@pytest.mark.parametrize("classes, nhwc", [(1, False), (3, False), (3, True)])
def test_fit_masks_of_a_batch_are_each_images_own_to_the_bit(classes, nhwc, monkeypatch):
    """fit_masks crops, resizes back and thresholds the images of one size together; the masks are those of
    each image alone (original_size, mask_tensor), mixed sizes and an image
    over a group's pixel limit (alone, in bands) included."""
    monkeypatch.setattr(train_unet, "SCORE_BAND_PIXELS", 150 * 117 * 2)  # at most two of the largest a group
    sizes = [(150, 117), (40, 90), (150, 117), (64, 64), (150, 117), (40, 90), (300, 117)]
    logits, cfg = fit_logits(sizes, classes, nhwc)
    with torch.inference_mode():
        masks = train_unet.fit_masks(logits, sizes, cfg)
        alone = [train_unet.mask_tensor(logit, classes) for logit in each_alone(logits, sizes, cfg)]
    assert [tuple(m.shape) for m in masks] == sizes
    for mask, reference in zip(masks, alone):
        assert mask.dtype == torch.uint8 and torch.equal(mask, reference)


def test_fit_masks_take_a_few_ops_a_batch_not_seven_an_image():
    """Eight images of one size: the masks of the batch in a handful of aten ops (on a GPU each a kernel
    launch or a view; the forward of fit mode's resnet18 Unet is ~107). Each image alone took 58: an unbind,
    then a float, two slices, an unsqueeze, the resize, a select, the threshold and the cast to uint8 per image."""
    sizes = [(100, 120)] * 8
    logits, cfg = fit_logits(sizes, 1)
    with torch.inference_mode(), OpCounter() as counter:
        train_unet.fit_masks(logits, sizes, cfg)
    assert sum(counter.ops.values()) <= 9, dict(counter.ops)
    assert counter.ops["aten.upsample_bilinear2d.vec"] == 1


@pytest.mark.parametrize("classes, nhwc", [(1, False), (3, False), (3, True)])
@pytest.mark.parametrize("as_tensor", [False, True])
def test_validation_scores_a_batch_as_each_image_alone(classes, nhwc, as_tensor, monkeypatch):
    """Fit validation scores the images of one size together (original_size_scores): the confusion counts
    equal those of each image scored alone, mixed sizes and an image over a group's limit (in bands) included;
    masks read from their files (a list) or a batch of image_size squares (a tensor)."""
    monkeypatch.setattr(train_unet, "SCORE_BAND_PIXELS", 150 * 117 * 2)
    sizes = [(64, 64)] * 4 if as_tensor else [(150, 117), (40, 90), (150, 117), (64, 64), (150, 117), (300, 117)]
    logits, cfg = fit_logits(sizes, classes, nhwc)
    rng = np.random.default_rng(1)
    masks = [torch.from_numpy(rng.integers(0, max(2, classes), size, np.uint8)) for size in sizes]
    masks[0][:3] = train_unet.IGNORE_INDEX
    hw = train_unet.detect_hardware("cpu")
    together, alone = train_unet.SegMetric(classes), train_unet.SegMetric(classes)
    for scored, target in train_unet.original_size_scores(logits, torch.stack(masks) if as_tensor else masks, cfg, hw):
        together.update(scored, target)
    for logit, mask in zip(each_alone(logits, sizes, cfg), masks):
        alone.update(logit[None], mask[None])
    assert torch.equal(together.flat, alone.flat) and together.flat[-1] == 3 * sizes[0][1]


def test_validation_scores_a_batch_in_a_few_ops_not_nine_an_image():
    """Eight validation images of one size: resized back and counted in a handful of aten ops (on a GPU each
    a kernel launch or a view, beside the forward's ~107): 17 here. One image at a time took 130, 56 of them
    kernels on a GPU: per image the resize, the copy of its mask and five of the metric's."""
    sizes = [(100, 120)] * 8
    logits, cfg = fit_logits(sizes, 1)
    masks = [torch.zeros(size, dtype=torch.uint8) for size in sizes]
    metric, hw = train_unet.SegMetric(1), train_unet.detect_hardware("cpu")
    with torch.inference_mode(), OpCounter() as counter:
        for scored, target in train_unet.original_size_scores(logits, masks, cfg, hw):
            metric.update(scored, target)
    assert sum(counter.ops.values()) <= 20, dict(counter.ops)
    assert counter.ops["aten.upsample_bilinear2d.vec"] == 1 and counter.ops["aten.scatter_add_.default"] == 1


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_validation_masks_go_to_a_gpu_from_page_locked_memory(kind, monkeypatch):
    """A copy to the GPU from pageable memory waits for the kernels queued before it: validation's masks,
    read from their files, are stacked in page-locked memory on CUDA (not on a CPU, where nothing is copied)."""
    import types

    pinned = []
    monkeypatch.setattr(train_unet, "page_locked",
                        lambda shape, dtype: pinned.append(shape) or torch.empty(shape, dtype=dtype))
    sizes = [(100, 120)] * 3 + [(40, 90)]
    logits, cfg = fit_logits(sizes, 1)
    masks = [torch.full(size, i, dtype=torch.uint8) for i, size in enumerate(sizes)]
    hw = types.SimpleNamespace(kind=kind, device=torch.device("cpu"))  # a stand-in: the copy itself stays here
    targets = [target for _, target in train_unet.original_size_scores(logits, masks, cfg, hw)]
    assert pinned == ([(3, 100, 120), (1, 40, 90)] if kind == "cuda" else []) and [len(t) for t in targets] == [3, 1]
    assert torch.equal(targets[0], torch.stack(masks[:3])) and targets[0].dtype == torch.uint8


def test_masks_go_to_the_host_without_a_wait_on_the_models_thread(monkeypatch, tmp_path):
    """CUDA: a batch's masks are copied to page-locked host memory without blocking and one event is
    recorded on their device's stream; the writer thread waits on that event before it reads a mask, the
    model's thread never. (Before, the writer's .cpu() per mask waited for every kernel queued by then.)
    Fake CUDA tensors and events; then a real MaskWriter with a stand-in event, masks on the CPU."""
    import types
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = []

    class Event:
        def record(self, stream=None):
            calls.append(("record", stream))

        def synchronize(self):
            calls.append(("wait", threading.current_thread() is threading.main_thread()))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: f"stream of {device}")
    hw = types.SimpleNamespace(kind="cuda", device=torch.device("cuda:1"))
    with FakeTensorMode(allow_non_fake_inputs=True):
        masks = [torch.zeros(5, 6, dtype=torch.uint8, device="cuda:1") for _ in range(3)]
        host, ready = train_unet.on_host(masks, hw)
        assert [m.device.type for m in host] == ["cpu"] * 3
    assert calls == [("record", "stream of cuda:1")]
    cpu = types.SimpleNamespace(kind="cpu", device=torch.device("cpu"))
    assert train_unet.on_host(host, cpu) == (host, None)

    real_save = train_unet.save_prediction
    monkeypatch.setattr(train_unet, "save_prediction",
                        lambda path, *a: (calls.append(("write", Path(path).name)), real_save(path, *a)))
    batch = [(Path(f"{name}.png"), np.zeros((5, 6, 3), np.uint8), None) for name in "ab"]
    outputs = {path: tmp_path / path.name for path, _, _ in batch}
    with train_unet.MaskWriter(1, False) as writer:
        writer.write_all(batch, [torch.ones(5, 6, dtype=torch.uint8)] * 2, ready, outputs, tmp_path)
    assert calls[1:] == [("wait", False), ("write", "a.png"), ("wait", False), ("write", "b.png")]
    assert (train_unet.cv2.imread(str(tmp_path / "a.png"), train_unet.cv2.IMREAD_UNCHANGED) == 255).all()


def test_predicts_main_thread_parses_only_the_first_two_batches_headers(monkeypatch, tmp_path):
    """The memory budget's image headers (room_to_read_ahead) of batch k + 2 are read on the reader threads
    beside batch k + 1's images (MemoryBudget.look_ahead): predict's main thread, which on a GPU launches the
    model's kernels, parses the first two batches' only, and the later ones are parsed once each."""
    paths = []
    for i in range(12):
        paths.append(tmp_path / f"{i:02}.png")
        train_unet.write_png(paths[-1], np.full((8, 8, 3), i, np.uint8))
    parsed, real_header = [], train_unet.image_header
    monkeypatch.setattr(train_unet, "image_header", lambda path: parsed.append(
        (Path(path).name, threading.current_thread() is threading.main_thread())) or real_header(path))
    cfg = {**window_cfg(data_mode="fit"), "intensity_range": None}
    budget = train_unet.MemoryBudget(1 << 40, cfg, None)
    batches = [[p for p, _, _ in batch] for batch, _ in train_unet.read_ahead(paths, 2, cfg, budget)]
    assert batches == [paths[i:i + 2] for i in range(0, 12, 2)]
    assert {name for name, main in parsed if main} <= {p.name for p in paths[:4]}
    later = sorted(name for name, _ in parsed if name >= paths[4].name)
    assert later == [p.name for p in paths[4:]]  # each once (the first batch's readers may beat the main thread)


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_predicts_fit_batch_is_stacked_by_numpy_into_page_locked_memory(kind, monkeypatch):
    """A fit batch's inputs are stacked on predict's own thread by numpy, into page-locked memory on CUDA:
    torch.stack's parallel copy (aten.cat on torch's thread team) took a third to a half of a fit predict's
    time on an H100's host, beside the reader threads. The batch the model gets is torch.stack's, to the bit.
    page_locked is faked here (no GPU): real pinning and the non-blocking copy run in gpu-check."""
    import types

    pinned, seen = [], []
    monkeypatch.setattr(train_unet, "page_locked",
                        lambda shape, dtype: pinned.append(tuple(shape)) or torch.empty(shape, dtype=dtype))
    hw = types.SimpleNamespace(kind=kind, device=torch.device("cpu"))  # a stand-in: the copy itself stays here
    cfg = {**window_cfg(data_mode="fit", num_classes=1, image_size=32), "channels_last": False, "tta": "none"}
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (40, 50, 3), dtype=np.uint8) for _ in range(5)]
    inputs = [train_unet.fit_input(image, cfg) for image in images]
    model = torch.nn.Conv2d(3, 1, 1)
    model.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    prec = train_unet.Precision.of(torch.float32, "test")
    with torch.inference_mode(), OpCounter() as counter:
        masks = train_unet.predict_masks(model, images, cfg, prec, hw, inputs)
    assert not {op for op in counter.ops if op.startswith(("aten.cat", "aten.stack"))}, dict(counter.ops)
    assert pinned == ([(5, 3, 32, 32)] if kind == "cuda" else []) and len(masks) == 5
    assert torch.equal(seen[0], torch.stack(inputs))


def test_the_predict_threads_tool_times_each_setting_and_restores_them(tmp_path, capsys):
    """tools/predict_threads.py: one row per (switch interval, readers, torch threads), each predict against the
    forwards alone; Python's switch interval, PREDICT_READERS and torch's threads are as they were afterwards;
    a bad value is one line."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import predict_threads

    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=3, size=32)
    before = sys.getswitchinterval(), train_unet.PREDICT_READERS, torch.get_num_threads()
    before = (*before, train_unet.read_ahead, train_unet.predict_host_threads)
    settings = [(5.0, 4, 0, "threads"), (5.0, 4, 0, "between"), (0.2, 1, 2, "processes")]
    found = predict_threads.measure({**predict_threads.TOOL_CONFIG, "input": str(data / "images"), "mode": "fp32",
                                     "batch_size": 2, "rounds": 1}, settings, tmp_path / "work")
    assert (sys.getswitchinterval(), train_unet.PREDICT_READERS, torch.get_num_threads(), train_unet.read_ahead,
            train_unet.predict_host_threads) == before
    assert found["images"] == 3 and found["forward_s"] > 0
    assert [r[:4] for r in found["rows"]] == settings
    lines = predict_threads.report(found).splitlines()
    assert lines[0].startswith("fp32, 3 images, 1 alternating rounds") and "| 0.2 ms " in lines[-1]
    assert "(its own)" in lines[-2] and "| 2 " in lines[-1] and "| processes |" in lines[-1]
    assert predict_threads.settings_of({"switch_ms": "5", "readers": "4", "torch_threads": "0,1", "rounds": 1,
                                        "read_in": "threads"}) == [(5.0, 4, 0, "threads"), (5.0, 4, 1, "threads")]
    assert predict_threads.main([f"input={data / 'images'}", "readers=two"]) == 2
    assert "give comma-separated numbers, e.g. switch_ms=5,0.2 readers=4,1" in capsys.readouterr().err
    assert predict_threads.main(["rounds=0"]) == 2 and "rounds=0 must be 1 or more" in capsys.readouterr().err
    assert predict_threads.main(["read_in=forks"]) == 2
    assert "give threads, between, processes" in capsys.readouterr().err


def test_predict_reading_in_processes_writes_the_same_masks(tmp_path):
    """predict_threads' read_in=processes (the experiment for a GPU host) reads the batches predict's threads
    read, in other processes: the same masks to the bit, the same unreadable image reported, and predict's
    read_ahead put back."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import predict_phases
    import predict_profile
    import predict_threads

    data = train_unet.generate_shapes_dataset(tmp_path / "data", count=5, size=32)
    (data / "images" / "broken.png").write_bytes(b"not a png")
    run = predict_profile.predict_options({"batch_size": 2, "device": "cpu"}, "fp32",
                                          predict_phases.fresh_checkpoint(tmp_path), data / "images")
    processes, results = predict_threads.ReaderProcesses(2), []
    try:
        for name, pool in (("threads", None), ("processes", processes)):
            predict_threads.one_predict(run, tmp_path / name, 5.0, 2, 0, pool, results)
    finally:
        processes.close()
    assert train_unet.read_ahead.__module__ == "train_unet"
    assert processes.pids and os.getpid() not in processes.pids
    assert [r["predicted"] for r in results] == [5, 5]
    assert [[Path(path).name for path, _ in r["failed"]] for r in results] == [["broken.png"]] * 2
    names = sorted(p.name for p in (tmp_path / "threads").glob("*.png"))
    assert len(names) == 5 and names == sorted(p.name for p in (tmp_path / "processes").glob("*.png"))
    for name in names:
        assert np.array_equal(cv2.imread(str(tmp_path / "threads" / name), cv2.IMREAD_UNCHANGED),
                              cv2.imread(str(tmp_path / "processes" / name), cv2.IMREAD_UNCHANGED))


def test_gpu_check_skips_the_checks_named(capsys):
    """gpu-check skip=compile,bare leaves out the checks whose names hold those words (a short lease); a word
    that names no check, or another key, is a one-line error (exit 2), before any GPU is looked for."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import gpu_check

    names = [name for name, _ in gpu_check.selected_checks("compile,bare")]
    assert "torch.compile (bf16/auto)" not in names and "bare loop" not in names and "inference table" in names
    assert [name for name, _ in gpu_check.selected_checks("")] == [name for name, _ in gpu_check.CHECKS]
    assert gpu_check.main(["skip=compile,nonsense"]) == 2
    assert "nonsense names no check" in capsys.readouterr().err
    assert gpu_check.main(["skpi=compile"]) == 2


def test_gpu_check_times_fit_predict_with_torchs_threads_and_one(tmp_path):
    """gpu-check's threads lines (run here on the CPU, on a tiny copy of the shapes set it would make): three
    rows, torch's own thread count and 1 with reader threads, then reads in processes, before the long
    inference table."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    import gpu_check

    train_unet.generate_shapes_dataset(tmp_path / "shapes", count=3, size=32)
    lines = gpu_check.check_threads(train_unet.detect_hardware("cpu"), tmp_path).splitlines()
    assert ", 3 images, 3 alternating rounds" in lines[0] and len(lines) == 6
    assert "(its own)" in lines[3] and lines[4].split("|")[3].strip() == "1"
    assert [line.split("|")[4].strip() for line in lines[3:]] == ["threads", "threads", "processes"]
    names = [name for name, _ in gpu_check.CHECKS]
    assert names.index("predict threads (fit)") < names.index("inference table")
