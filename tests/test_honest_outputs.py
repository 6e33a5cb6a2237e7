"""Outputs that say what they are: fit-mode validation scores what `predict` writes (at each image's
original size, against its original mask); the benchmark archives only its own earlier outputs; predict
never counts a mask it could not write."""
import contextlib
import errno
import json
import os
import re
import shutil
import time
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch

import train_unet
from train_unet import UserError

ROOT = Path(__file__).resolve().parents[1]
# Not square, none image_size (32): shrunk 1.3-3x, one upscaled, one needing no padding on one side.
SIZES = [(70, 50), (40, 90), (97, 33), (20, 28), (64, 64), (33, 81)]


def odd_sizes(data_dir):
    """Resizes every pair of a shapes set to one of SIZES (w, h), masks by nearest neighbour."""
    images, masks = sorted((data_dir / "images").glob("*.png")), sorted((data_dir / "masks").glob("*.png"))
    for i, (image, mask) in enumerate(zip(images, masks)):
        w, h = SIZES[i % len(SIZES)]
        cv2.imwrite(str(image), cv2.resize(cv2.imread(str(image), cv2.IMREAD_UNCHANGED), (w, h)))
        cv2.imwrite(str(mask), cv2.resize(cv2.imread(str(mask), 0), (w, h), interpolation=cv2.INTER_NEAREST))
    return data_dir


def iou_of_files(pred_dir, pairs, num_classes):
    """Mean IoU (and per class) of predict's written masks against the original mask files, counted
    over the whole set, void (255) ignored, classes absent from both left out: computed here with
    numpy, independently of SegMetric."""
    n = 2 if num_classes == 1 else num_classes
    tp, fp, fn = np.zeros(n), np.zeros(n), np.zeros(n)
    for image_path, mask_path in pairs:
        pred = cv2.imread(str(pred_dir / f"{image_path.stem}.png"), cv2.IMREAD_UNCHANGED)
        truth = train_unet.read_mask(mask_path, num_classes)
        assert pred.shape == truth.shape, image_path.name  # written at the original size
        pred = (pred > 0).astype(np.uint8) if num_classes == 1 else pred
        keep = truth != train_unet.IGNORE_INDEX
        for c in range(n):
            p, t = (pred == c) & keep, (truth == c) & keep
            tp[c] += (p & t).sum()
            fp[c] += (p & ~t).sum()
            fn[c] += (~p & t).sum()
    union = tp + fp + fn
    iou = np.where(union > 0, tp / np.maximum(union, 1), np.nan)
    iou = iou[1:] if num_classes == 1 else iou
    return float(np.nanmean(iou)), iou


def train_odd(tmp_path, make_data, **overrides):
    data = odd_sizes(make_data("odd", num_classes=overrides.get("num_classes", 1)))
    cfg = dict(data_dir=str(data), checkpoint_dir=str(tmp_path / "ckpt"), image_size=32, epochs=2,
               val_fraction=0.25, batch_size=4, use_amp=False, encoder_name="resnet18", encoder_weights=None,
               device="cpu", progress=False, num_workers=0, logger="csv", channels_last=False, **overrides)
    result = train_unet.train(cfg)
    return result, train_unet.validate_config({**train_unet.CONFIG, **cfg})


# ---------------------------------------------------------------------------------------------------
# 10. Fit mode's val IoU is the IoU of what predict writes
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_classes, cache", [(1, False), (3, True)])
def test_fit_val_iou_is_the_iou_of_predicts_masks(tmp_path, make_data, num_classes, cache):
    """The val IoU that chose best.pt equals the IoU of best.pt's masks, written by predict at each
    image's original size, scored against the original mask files; per class too."""
    result, cfg = train_odd(tmp_path, make_data, num_classes=num_classes, cache_images=cache)
    _, val_pairs = train_unet.prepare_data(cfg)
    assert len(val_pairs) == 3 and len({cv2.imread(str(m), 0).shape for _, m in val_pairs}) > 1
    images = tmp_path / "val_images"
    images.mkdir()
    for image_path, _ in val_pairs:
        shutil.copy(image_path, images / image_path.name)
    out = tmp_path / "pred"
    done = train_unet.predict({"checkpoint": str(tmp_path / "ckpt" / "best.pt"), "input": str(images),
                               "output": str(out), "use_amp": False, "batch_size": 4, "device": "cpu",
                               "progress": False})
    assert done["predicted"] == 3 and done["precision"] == "fp32"
    want, per_class = iou_of_files(out, val_pairs, num_classes)
    assert 0 < want < 1, "test setup: the masks should be neither all right nor all wrong"
    best = max(result["history"], key=lambda row: row["val_iou"])
    assert result["best_iou"] == best["val_iou"] == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert train_unet.load_checkpoint(tmp_path / "ckpt" / "best.pt")["best_iou"] == pytest.approx(want, abs=1e-12)
    if num_classes > 1:
        names = train_unet.load_class_names(cfg)
        got = [best[f"val_iou_{train_unet.class_slug(n)}"] for n in names]
        np.testing.assert_allclose(got, per_class, rtol=0, atol=1e-12)


def val_counts(cfg, model, monkeypatch, rank=0, world=1):
    """The confusion matrix evaluate() counts on one rank (all_reduce_ captured, not summed)."""
    hw = train_unet.detect_hardware("cpu")
    train_pairs, val_pairs = train_unet.prepare_data(cfg)
    monkeypatch.setattr(train_unet, "DIST", train_unet.Dist(rank=rank, world=world))
    captured = []
    monkeypatch.setattr(train_unet, "all_reduce_", lambda t, op="sum": captured.append(t.clone()) or t)
    _, loader = train_unet.build_loaders(train_pairs, val_pairs, cfg, hw)
    fp32 = train_unet.decide_precision(hw, use_amp=False)
    result = train_unet.evaluate(model, loader, train_unet.SegLoss(cfg["num_classes"]), fp32, hw, cfg)
    monkeypatch.undo()
    return captured[-1], result


@pytest.mark.parametrize("num_classes", [1, 3])
def test_validation_counts_each_original_pixel_once_on_every_path(make_data, make_cfg, monkeypatch, num_classes):
    """Every pixel of every original val mask is counted exactly once: with and without cache_images,
    and with validation sharded over two ranks (the shards' counts add up to one process's)."""
    data = odd_sizes(make_data("odd", num_classes=num_classes))
    cfg = make_cfg(data_dir=str(data), image_size=32, val_fraction=0.5, num_classes=num_classes, batch_size=2)
    torch.manual_seed(0)
    model = train_unet.prepare_model(cfg, train_unet.detect_hardware("cpu"))
    single, result = val_counts(cfg, model, monkeypatch)
    _, val_pairs = train_unet.prepare_data(cfg)
    pixels = sum(int((train_unet.read_mask(m, num_classes) != train_unet.IGNORE_INDEX).sum()) for _, m in val_pairs)
    assert int(single.sum()) == pixels
    cached, cached_result = val_counts({**cfg, "cache_images": True}, model, monkeypatch)
    assert torch.equal(cached, single) and (cached_result["loss"], cached_result["iou"]) == (result["loss"], result["iou"])
    shards = [val_counts(cfg, model, monkeypatch, rank, 2)[0] for rank in (0, 1)]
    assert torch.equal(shards[0] + shards[1], single) and all(s.sum() > 0 for s in shards)


def test_predict_and_validation_share_the_way_back_to_the_original_size(monkeypatch, make_cfg):
    """predict_batch turns logits into masks through original_size, the function validation scores by
    (original_size_scores): replacing it changes predict's output and validation's logits alike."""
    cfg = make_cfg(image_size=32)
    hw = train_unet.detect_hardware("cpu")
    model = train_unet.prepare_model(cfg, hw).eval()
    fp32 = train_unet.decide_precision(hw, use_amp=False)
    image = np.random.default_rng(0).integers(0, 255, (50, 70, 3), np.uint8)
    monkeypatch.setattr(train_unet, "original_size", lambda logits, h, w, cfg: torch.full((len(logits), 1, h, w), 5.0))
    assert (train_unet.predict_batch(model, [image], cfg, fp32, hw)[0] == 1).all()
    masks = [torch.zeros(5, 6, dtype=torch.uint8)] * 2
    scored = list(train_unet.original_size_scores(torch.zeros(2, 1, 32, 32), masks, cfg, hw))
    assert scored and all((logits == 5).all() for logits, _ in scored)


# ---------------------------------------------------------------------------------------------------
# 19. benchmark output=DIR archives only the benchmark's own outputs
# ---------------------------------------------------------------------------------------------------
def fake_run(name, base, train_args, out_dir):
    """run_benchmark_config without the training: writes what a run writes."""
    run = out_dir / name
    run.mkdir(parents=True, exist_ok=True)
    for file in ("best.pt", "last.pt", "history.csv", "config.json"):
        (run / file).write_text(f"{name} {file}")
    (out_dir / f"{name}.log").write_text(f"{name} log")
    return {"config": name, "status": "failed (exit 1): fake"}, []


def user_files(folder):
    (folder / "photos").mkdir()
    (folder / "photos" / "cat.jpg").write_bytes(b"\xff\xd8 a cat")
    (folder / "thesis.tex").write_text("\\chapter{Results}")
    (folder / "notes.log").write_text("mine")
    (folder / "fp16").mkdir()  # named like a configuration this benchmark does not run, holds no run
    (folder / "fp16" / "slides.pdf").write_text("mine")
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def files_in(folder):
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


@contextlib.contextmanager
def locked_as_another_process_would(folder):
    """The folder's flock taken on a descriptor of its own, as another process (a running command) holds it."""
    fcntl = pytest.importorskip("fcntl")  # no flock on Windows: nothing is held there

    fd = os.open(folder, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        yield
    finally:
        os.close(fd)


def benchmark(monkeypatch, data, output, configs="fp32,fp32_cl"):
    monkeypatch.setattr(train_unet, "run_benchmark_config", fake_run)
    return train_unet.run_benchmark([f"configs={configs}", "bare_steps=0", "inference=", "epochs=1", "image_size=32",
                                     f"data_dir={data}", f"output={output}"])


@pytest.mark.usefixtures("restore_matmul_precision")
def test_benchmark_archives_its_own_outputs_and_nothing_else(tmp_path, data_dir, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    mine = user_files(out)
    benchmark(monkeypatch, data_dir, out)
    first = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    benchmark(monkeypatch, data_dir, out)
    for path, data in mine.items():
        assert (out / path).read_bytes() == data, f"{path} was moved"
    archived = list((out / "previous").iterdir())
    assert len(archived) == 1
    moved = {p.relative_to(archived[0]): p.read_bytes() for p in archived[0].rglob("*") if p.is_file()}
    assert moved == {path: data for path, data in first.items() if path not in mine}  # all of it, only it
    assert {"benchmark.json", "benchmark.csv", "fp32.log", "fp32_cl.log"} <= {str(p) for p in moved}
    assert (out / "benchmark.json").is_file() and (out / "fp32" / "best.pt").is_file()  # the new run's


@pytest.mark.usefixtures("restore_matmul_precision")
def test_benchmark_in_the_current_folder_leaves_the_script_alone(tmp_path, data_dir, monkeypatch):
    cwd = tmp_path / "project"
    cwd.mkdir()
    shutil.copy(ROOT / "train_unet.py", cwd / "train_unet.py")
    mine = user_files(cwd)
    monkeypatch.chdir(cwd)
    for _ in range(2):
        benchmark(monkeypatch, data_dir, ".")
    assert (cwd / "train_unet.py").read_bytes() == (ROOT / "train_unet.py").read_bytes()
    for path, data in mine.items():
        assert (cwd / path).read_bytes() == data, f"{path} was moved"
    assert (cwd / "previous").is_dir() and not list((cwd / "previous").rglob("train_unet.py"))


@pytest.mark.usefixtures("restore_matmul_precision")
def test_a_second_benchmark_into_a_folder_in_use_is_refused_and_moves_nothing(tmp_path, data_dir, monkeypatch):
    """Two benchmarks into one output folder: the second moved the first's files aside mid-run, and both then
    wrote the same rows. The running one holds the folder's lock (here a lock taken on the folder as another
    process would hold it); the second is refused before anything moves, and the folder is free after."""
    out = tmp_path / "out"
    benchmark(monkeypatch, data_dir, out)
    before = files_in(out)
    with locked_as_another_process_would(out), pytest.raises(
            UserError, match=r"output=.*out is in use by another benchmark or training run .*choose another output="):
        benchmark(monkeypatch, data_dir, out)
    assert files_in(out) == before
    benchmark(monkeypatch, data_dir, out)  # the lock went with the first one; this one lets its own go
    assert len(list((out / "previous").iterdir())) == 1 and not train_unet.HELD_FOLDERS


@pytest.mark.usefixtures("restore_matmul_precision")
def test_an_earlier_run_folder_still_training_is_not_moved_away(tmp_path, data_dir, monkeypatch):
    """A training run still writing in <output>/fp32 (a user's, or a row of a killed benchmark) had its folder
    moved to previous/ under it: the benchmark is refused, and nothing moves."""
    out = tmp_path / "out"
    benchmark(monkeypatch, data_dir, out)
    before = files_in(out)
    with locked_as_another_process_would(out / "fp32"), pytest.raises(  # as hold_checkpoint_dir holds it
            UserError, match=r"out/fp32 is in use by a training run .*choose another output=") as err:
        benchmark(monkeypatch, data_dir, out)
    assert "\n" not in str(err.value) and files_in(out) == before
    assert not train_unet.HELD_FOLDERS


@pytest.mark.usefixtures("restore_matmul_precision")
def test_a_benchmark_refused_by_its_data_leaves_the_earlier_results_in_place(tmp_path, data_dir, monkeypatch):
    """The earlier benchmark's results were moved to previous/ before the data check; each retry of a user
    fixing their data then buried them deeper, under a new record of no rows."""
    out = tmp_path / "out"
    benchmark(monkeypatch, data_dir, out)
    before = files_in(out)
    for _ in range(2):
        with pytest.raises(UserError, match="not found"):
            benchmark(monkeypatch, tmp_path / "no_such_data", out)
    assert files_in(out) == before


@pytest.mark.usefixtures("restore_matmul_precision")
def test_an_interrupted_benchmark_keeps_the_rows_that_ended_before(tmp_path, data_dir, monkeypatch):
    """benchmark.json held the rows only once all had trained: a stop in the second row lost the first."""
    def stopped_in_the_second(name, base, train_args, out_dir):
        if name == "fp32_cl":
            raise KeyboardInterrupt
        return fake_run(name, base, train_args, out_dir)

    out = tmp_path / "out"
    monkeypatch.setattr(train_unet, "run_benchmark_config", stopped_in_the_second)
    with pytest.raises(KeyboardInterrupt):
        train_unet.run_benchmark(["configs=fp32,fp32_cl", "bare_steps=0", "inference=", "epochs=1", "image_size=32",
                                  f"data_dir={data_dir}", f"output={out}"])
    record = json.loads((out / "benchmark.json").read_text())
    assert [r["config"] for r in record["rows"]] == ["fp32"] and record["complete"] is False


@pytest.mark.usefixtures("restore_matmul_precision")
def test_a_folder_in_the_way_of_a_run_is_refused_before_anything_moves(tmp_path, data_dir, monkeypatch):
    out = tmp_path / "out"
    out.mkdir()
    (out / "fp32").mkdir()
    (out / "fp32" / "holiday.jpg").write_bytes(b"mine")
    (out / "benchmark.json").write_text("{}")  # an earlier benchmark's
    with pytest.raises(UserError, match="fp32 is not a benchmark run") as err:
        benchmark(monkeypatch, data_dir, out)
    assert "\n" not in str(err.value) and "output=" in str(err.value)
    assert (out / "fp32" / "holiday.jpg").read_bytes() == b"mine" and (out / "benchmark.json").is_file()
    assert not (out / "previous").exists()


# ---------------------------------------------------------------------------------------------------
# 22. predict never counts a mask it could not write
# ---------------------------------------------------------------------------------------------------
@pytest.fixture
def checkpoint(make_cfg, tmp_path):
    cfg = make_cfg(image_size=32)
    model = train_unet.prepare_model(cfg, train_unet.detect_hardware("cpu"))
    path = tmp_path / "model.pt"
    train_unet.save_checkpoint(path, {"model": model.state_dict(), "config": cfg})
    return path


def run_predict(checkpoint, data_dir, out, **extra):
    return train_unet.predict({"checkpoint": str(checkpoint), "input": str(data_dir / "images"),
                               "output": str(out), "batch_size": 2, "device": "cpu", "use_amp": False,
                               "progress": False, **extra})


def test_a_second_predict_into_a_folder_in_use_is_refused_and_moves_nothing(checkpoint, data_dir, tmp_path):
    """Two predicts into one output folder each moved the other's masks aside and wrote over them, and both
    said they had predicted every image: 25 of 80 masks were one model's, the rest the other's. The one
    running holds the folder's lock (here taken as another process holds it)."""
    out = tmp_path / "out"
    run_predict(checkpoint, data_dir, out)
    before = files_in(out)
    with locked_as_another_process_would(out), pytest.raises(
            UserError, match=r"output=.*out is in use by another predict, training run or benchmark \(it holds the "
                             r"folder's lock\): let it finish, or choose another output="):
        run_predict(checkpoint, data_dir, out)
    assert files_in(out) == before
    assert run_predict(checkpoint, data_dir, out)["predicted"] == len(before) and not train_unet.HELD_FOLDERS


def test_a_predict_into_a_folder_in_use_is_refused_before_the_model_loads(checkpoint, data_dir, tmp_path,
                                                                          monkeypatch):
    """The lock was taken after the model had loaded and the CPU probe had timed it: seconds to minutes
    before the refusal."""
    out = tmp_path / "out"
    out.mkdir()

    def load_predictor(*args):
        raise AssertionError("the model was loaded for a predict that is refused")
    monkeypatch.setattr(train_unet, "load_predictor", load_predictor)
    with locked_as_another_process_would(out), pytest.raises(UserError, match=r"output=.*out is in use by another"):
        run_predict(checkpoint, data_dir, out)
    assert not train_unet.HELD_FOLDERS


def held_by_a_background_thread(folder, given):
    """(release, thread): a thread whose run_folders_held scope holds the folder until release.set()."""
    import threading

    held, release = threading.Event(), threading.Event()

    def background():
        with train_unet.run_folders_held():
            train_unet.hold_folder(folder, given, "a background run")
            held.set()
            release.wait(30)
    thread = threading.Thread(target=background)
    thread.start()
    assert held.wait(30)
    return release, thread


def test_a_folder_one_thread_holds_is_refused_to_another_and_let_go_by_its_own_scope_alone(tmp_path):
    """The held folders were the process's: a notebook's predict in one thread into the folder a background
    benchmark wrote in was let in, and the first scope to end let go of the other thread's locks too."""
    mine, theirs = tmp_path / "mine", tmp_path / "theirs"
    mine.mkdir(), theirs.mkdir()
    release, thread = held_by_a_background_thread(theirs, "theirs")
    try:
        with train_unet.run_folders_held():
            train_unet.hold_folder(mine, "mine", "a background run")
            with pytest.raises(UserError, match="^theirs is in use by a background run "):
                train_unet.hold_folder(theirs, "theirs", "a background run")
        assert os.path.realpath(theirs) in train_unet.HELD_FOLDERS  # not let go by this thread's scope
        assert os.path.realpath(mine) not in train_unet.HELD_FOLDERS
    finally:
        release.set()
        thread.join(30)
    assert not train_unet.HELD_FOLDERS


def test_a_scope_lets_go_of_a_folder_it_took_after_another_thread_let_it_go(tmp_path):
    """A folder another thread held as this thread's scope began, let go there and then taken by this
    thread, stayed held after the scope (its key was among those held before): every later command into
    it was refused for the life of the kernel."""
    folder = tmp_path / "shared"
    folder.mkdir()
    release, thread = held_by_a_background_thread(folder, "shared")
    with train_unet.run_folders_held():
        release.set()
        thread.join(30)
        train_unet.hold_folder(folder, "shared", "a run")
    assert not train_unet.HELD_FOLDERS and not train_unet.held_by_another(folder)


def test_a_scope_that_fails_removes_only_the_empty_folders_its_own_thread_made(tmp_path):
    """A refusal in one thread removed the empty checkpoint folder another thread's run had just made: its
    checkpoints then had nowhere to go."""
    import threading

    theirs = tmp_path / "theirs"
    made, release = threading.Event(), threading.Event()

    def background():
        with train_unet.run_folders_held():
            theirs.mkdir()
            train_unet.MADE_FOLDERS[theirs] = threading.get_ident()
            made.set()
            release.wait(30)
    thread = threading.Thread(target=background)
    thread.start()
    try:
        assert made.wait(30)
        with pytest.raises(UserError), train_unet.run_folders_held():
            raise UserError("a data error")
        assert theirs.is_dir() and theirs in train_unet.MADE_FOLDERS
    finally:
        release.set()
        thread.join(30)
    assert not train_unet.MADE_FOLDERS


def break_after_first_batch(monkeypatch, breaks, out=None, written=2):
    """breaks() as predict starts its second batch; with `out`, once the first batch's `written` masks are
    there (predict writes them on a thread while the model works on the next batch)."""
    real, calls = train_unet.predict_masks, []

    def predict_masks(*args):
        calls.append(1)
        if len(calls) == 2:
            deadline = time.monotonic() + 30
            while out is not None and len(list(out.glob("*.png"))) < written and time.monotonic() < deadline:
                time.sleep(0.01)
            breaks()
        return real(*args)
    monkeypatch.setattr(train_unet, "predict_masks", predict_masks)


@pytest.mark.parametrize("how", ["removed", "now a file"])
def test_predict_stops_when_the_output_folder_goes_away(checkpoint, data_dir, tmp_path, monkeypatch, how):
    out = tmp_path / "pred"

    def breaks():
        shutil.rmtree(out)
        if how == "now a file":
            out.write_text("in the way")
    break_after_first_batch(monkeypatch, breaks, out)
    with pytest.raises(UserError) as err:
        run_predict(checkpoint, data_dir, out)
    message = str(err.value)
    assert "\n" not in message and str(out / "shape_0002.png") in message and "output=" in message
    assert "2 image(s) predicted before it" in message


def failing_replace(monkeypatch, fail_on):
    """os.replace in train_unet failing with a full disk from the `fail_on`-th call."""
    real, calls = train_unet.os.replace, []

    def replace(src, dst):
        calls.append(dst)
        if len(calls) >= fail_on:
            raise OSError(errno.ENOSPC, "No space left on device", str(src))
        return real(src, dst)
    monkeypatch.setattr(train_unet.os, "replace", replace)


@pytest.mark.parametrize("overlay, fail_on, name, kept", [(False, 4, "shape_0003.png", 3),
                                                        (True, 2, "shape_0000_overlay.png", 0)])
def test_a_full_disk_keeps_what_was_written_and_counts_honestly(checkpoint, data_dir, tmp_path, monkeypatch,
                                                                  overlay, fail_on, name, kept):
    out = tmp_path / "pred"
    failing_replace(monkeypatch, fail_on)
    with pytest.raises(UserError, match="free disk space") as err:
        run_predict(checkpoint, data_dir, out, overlay=overlay)
    monkeypatch.undo()
    assert str(out / name) in str(err.value) and f"the {kept} image(s) predicted before it" in str(err.value)
    assert not (out / name).exists()  # no partial file that looks like a prediction
    if overlay:  # the image's mask was written before its overlay failed: it stands, and the error says so
        assert str(err.value).endswith(f"are kept, and this image's mask {out / 'shape_0000.png'}")
    want = ["shape_0000.png"] if overlay else [f"shape_{i:04d}.png" for i in range(kept)]
    assert sorted(p.name for p in out.iterdir()) == want
    for path in out.iterdir():  # complete PNGs, no temporary files left
        assert cv2.imread(str(path), cv2.IMREAD_UNCHANGED).shape == (64, 64)


def test_an_overlay_that_fails_first_says_no_mask_stands_where_the_earlier_ones_are_put_back(checkpoint, data_dir,
                                                                                            tmp_path, monkeypatch):
    """A rerun whose first overlay failed put the earlier masks back over the new first mask, and its error
    said 'this image's mask ... [kept]' below 'the earlier masks are back' (user test)."""
    out = tmp_path / "pred"
    run_predict(checkpoint, data_dir, out, overlay=True)
    before = (out / "shape_0000.png").read_bytes()
    failing_replace(monkeypatch, 2)  # the earlier folder moved aside, then the new mask; its overlay fails
    with pytest.raises(UserError, match="free disk space") as err:
        run_predict(checkpoint, data_dir, out, overlay=True)
    monkeypatch.undo()
    assert f"cannot write {out / 'shape_0000_overlay.png'}" in str(err.value)
    assert "this image's mask" not in str(err.value) and "the 0 image(s) predicted before it" in str(err.value)
    assert (out / "shape_0000.png").read_bytes() == before
    # earlier masks of other images only: this image's new mask stands, and the error names it (review)
    shutil.rmtree(out)
    train_unet.predict({"checkpoint": str(checkpoint), "input": str(data_dir / "images" / "shape_0005.png"),
                        "output": str(out), "device": "cpu", "use_amp": False, "progress": False, "overlay": True})
    failing_replace(monkeypatch, 2)
    with pytest.raises(UserError, match="free disk space") as err:
        run_predict(checkpoint, data_dir, out, overlay=True)
    monkeypatch.undo()
    assert str(err.value).endswith(f"and this image's mask {out / 'shape_0000.png'}")
    assert (out / "shape_0000.png").is_file()


def test_a_predict_stopped_partway_says_how_many_it_wrote_and_where_the_others_are(checkpoint, data_dir, tmp_path,
                                                                                     monkeypatch):
    """Ctrl-C in a rerun after 2 masks: the earlier masks of every image were in previous/, and the stop said
    only 'the masks written so far are complete' (24 of 240 written, 216 earlier masks moved, unsaid)."""
    out = tmp_path / "pred"
    run_predict(checkpoint, data_dir, out)
    total = len(list((data_dir / "images").iterdir()))
    real, calls = train_unet.masks_within_memory, []

    def stopped_at_the_second_batch(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args)
    monkeypatch.setattr(train_unet, "masks_within_memory", stopped_at_the_second_batch)
    write = train_unet.MaskWriter.write

    def written_at_once(self, *args):  # the first batch's masks written before the stop, however slow the disk
        write(self, *args)
        self.wait()
    monkeypatch.setattr(train_unet.MaskWriter, "write", written_at_once)
    with pytest.raises(KeyboardInterrupt) as stop:
        run_predict(checkpoint, data_dir, out)
    moved = next((out / "previous").iterdir())
    assert str(stop.value) == (f"the masks written so far are complete; no partial file is left; 2 of {total} "
                               f"image(s) written; the earlier masks of the others are in {moved}/")
    assert len(list(out.glob("*.png"))) == 2


def test_a_library_predict_stopped_before_any_mask_says_what_the_command_line_says(checkpoint, data_dir, tmp_path,
                                                                                    monkeypatch):
    """A notebook's interrupt of predict() while it loaded or probed was a bare KeyboardInterrupt(): the command
    line said 'the masks written so far are complete; no partial file is left'."""
    def stopped(*args):
        raise KeyboardInterrupt
    monkeypatch.setattr(train_unet, "predict_modes", stopped)
    with pytest.raises(KeyboardInterrupt) as stop:
        run_predict(checkpoint, data_dir, tmp_path / "pred")
    assert str(stop.value) == train_unet.INTERRUPTED["predict"] == ("the masks written so far are complete; no "
                                                                    "partial file is left")


def failing_mask_writes(monkeypatch):
    """A full disk for predict's new files (write_png's temporary file renamed into place); moves of whole
    files, which need no room, still work."""
    real = train_unet.os.replace

    def replace(src, dst):
        if ".tmp" in Path(src).name:
            raise OSError(errno.ENOSPC, "No space left on device", str(src))
        return real(src, dst)
    monkeypatch.setattr(train_unet.os, "replace", replace)


@pytest.mark.parametrize("stop", ["full disk", "Ctrl-C"])
def test_a_predict_that_writes_nothing_leaves_the_earlier_masks_in_place(checkpoint, data_dir, tmp_path,
                                                                        monkeypatch, capsys, stop):
    """Each retry of a predict on a full disk moved the earlier masks to a new previous/<time>/ and then
    wrote nothing: after a few, the output folder held only previous/ folders."""
    out = tmp_path / "pred"
    run_predict(checkpoint, data_dir, out, overlay=True)
    before = files_in(out)
    if stop == "full disk":
        failing_mask_writes(monkeypatch)
    else:
        def interrupted(*args):
            raise KeyboardInterrupt
        monkeypatch.setattr(train_unet, "predict_masks", interrupted)
    for _ in range(2):
        with pytest.raises(KeyboardInterrupt if stop == "Ctrl-C" else UserError):
            run_predict(checkpoint, data_dir, out, overlay=True)
        assert "no mask was written: the earlier masks are back in" in capsys.readouterr().out
        assert files_in(out) == before and not (out / "previous").exists()


def test_a_predict_whose_every_image_fails_leaves_the_earlier_masks_in_place(checkpoint, data_dir, tmp_path, capsys):
    """Every input unreadable now (emptied files): each image was named as failed, yet the earlier masks had
    moved to previous/<time>/ and the output folder was left empty."""
    out = tmp_path / "pred"
    run_predict(checkpoint, data_dir, out)
    before = files_in(out)
    for image in (data_dir / "images").iterdir():
        image.write_bytes(b"")
    result = run_predict(checkpoint, data_dir, out)
    assert result["predicted"] == 0 and len(result["failed"]) == 12
    assert "no mask was written: the earlier masks are back in" in capsys.readouterr().out
    assert files_in(out) == before and not (out / "previous").exists()


def test_an_overlay_of_one_image_and_the_mask_of_another_move_aside_once(checkpoint, data_dir, tmp_path):
    """x.png's overlay from an earlier run is also the name of the mask of a new input named x_overlay.png:
    moved aside twice, the second move failed with 'fix its permissions'."""
    inp, out = tmp_path / "in", tmp_path / "pred"
    inp.mkdir()
    first = sorted((data_dir / "images").iterdir())[0]
    shutil.copy(first, inp / "x.png")
    run_predict(checkpoint, tmp_path, out, input=str(inp), overlay=True)
    earlier = files_in(out)
    shutil.copy(first, inp / "x_overlay.png")
    assert run_predict(checkpoint, tmp_path, out, input=str(inp))["predicted"] == 2
    (kept,) = (out / "previous").iterdir()
    assert files_in(kept) == earlier and sorted(p.name for p in out.glob("*.png")) == ["x.png", "x_overlay.png"]


def test_a_predict_that_wrote_masks_keeps_the_earlier_ones_moved(checkpoint, data_dir, tmp_path, monkeypatch, capsys):
    """Once a mask is written, the earlier masks stay in previous/ (none stands beside a new run's)."""
    out = tmp_path / "pred"
    run_predict(checkpoint, data_dir, out)
    before = files_in(out)
    failing_replace(monkeypatch, 3)
    with pytest.raises(UserError, match="the 2 image"):
        run_predict(checkpoint, data_dir, out)
    monkeypatch.undo()
    (kept,) = (out / "previous").iterdir()
    assert files_in(kept) == before and "back in" not in capsys.readouterr().out


def test_predicted_count_is_the_files_written(checkpoint, data_dir, tmp_path):
    out = tmp_path / "pred"
    result = run_predict(checkpoint, data_dir, out, overlay=True)
    assert result["predicted"] == 12 and result["failed"] == []
    assert len([p for p in out.iterdir() if not p.name.endswith("_overlay.png")]) == 12
    assert len(list(out.glob("*_overlay.png"))) == 12 and not list(out.glob(".*"))


def test_a_run_that_stopped_before_its_first_checkpoint_is_still_a_run(tmp_path):
    """A configuration's folder holding only the data check's cache (read-only data_dir, the run stopped
    before config.json): the benchmark's own, archived like the rest, not refused as the user's."""
    run = tmp_path / "fp32"
    run.mkdir()
    (run / train_unet.CHECK_CACHE_NAME).write_text("{}")
    assert train_unet.benchmark_outputs(tmp_path, ["fp32"]) == ["fp32"]


def test_a_users_data_folder_named_like_a_configuration_is_not_a_run(tmp_path):
    """Training writes the data check's cache into a writable data_dir: among images and masks it does
    not make the folder a benchmark run."""
    data = tmp_path / "default"
    (data / "images").mkdir(parents=True)
    (data / train_unet.CHECK_CACHE_NAME).write_text("{}")
    assert train_unet.benchmark_outputs(tmp_path, ["fp32"]) == []
    with pytest.raises(UserError, match="default is not a benchmark run"):
        train_unet.benchmark_outputs(tmp_path, ["default"])


def test_an_earlier_inference_table_is_archived_with_its_benchmark_and_a_users_folder_is_not(tmp_path):
    """The inference table's folder used to stay when an earlier benchmark moved aside: the next table
    predicted its 4 old images beside the 2 asked for and said 4."""
    (tmp_path / "inference" / "fit_images").mkdir(parents=True)
    (tmp_path / "benchmark.json").write_text("{}")
    assert sorted(train_unet.benchmark_outputs(tmp_path, ["fp32", "inference"])) == ["benchmark.json", "inference"]
    users = tmp_path / "mine" / "inference"
    (users / "notes").mkdir(parents=True)
    assert train_unet.benchmark_outputs(users.parent, ["fp32"]) == []  # no table this time: left alone
    with pytest.raises(UserError, match="inference is not an inference table, but the inference table writes"):
        train_unet.benchmark_outputs(users.parent, ["fp32", "inference"])


# Training's own outputs: one run per checkpoint folder, and a full disk said in one line.
def test_a_second_run_into_a_folder_in_use_is_refused_and_moves_nothing(make_cfg, tmp_path):
    """Another run holds the folder (its lock taken here through another descriptor, as another process
    would hold it): this run stops before anything moves, so the other run's files stay where it writes
    them (the second run used to move them to previous/, and both then wrote the same checkpoints)."""
    fcntl = pytest.importorskip("fcntl")  # no flock on Windows: nothing is held there

    folder = tmp_path / "in_use"
    folder.mkdir()
    (folder / "last.pt").write_bytes(b"the other run's")
    other = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(other, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(UserError, match=r"checkpoint_dir=.*in_use is in use by another training run, predict or "
                                            r"benchmark .*choose "
                                            r"another checkpoint_dir") as err:
            train_unet.train(make_cfg(checkpoint_dir=str(folder)))
        assert "\n" not in str(err.value)
        assert sorted(p.name for p in folder.iterdir()) == ["last.pt"]
        assert (folder / "last.pt").read_bytes() == b"the other run's"
    finally:
        os.close(other)
    result = train_unet.train(make_cfg(checkpoint_dir=str(folder)))  # the other run is over: the folder is free
    assert result["best_iou"] is not None and (folder / "best.pt").is_file()
    after = os.open(folder, os.O_RDONLY)  # this run is over too: another process could take the folder now
    try:
        fcntl.flock(after, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(after)


class FolderDescriptors(torch.utils.data.Dataset):
    """In a worker: how many of the process's descriptors are open on `folder`."""
    def __init__(self, folder):
        self.folder = os.path.realpath(folder)

    def __len__(self):
        return 1

    def __getitem__(self, i):
        fds = Path("/proc/self/fd")
        return sum(1 for fd in fds.iterdir() if os.path.realpath(fd) == self.folder) if fds.is_dir() else -1


def test_loader_workers_do_not_share_the_folders_lock(tmp_path):
    """A forked worker held a copy of the lock's descriptor: after the training process was killed (out of
    memory), the workers still alive for seconds kept the folder locked and resume=True was refused."""
    fcntl = pytest.importorskip("fcntl")  # no flock on Windows: nothing is held there

    folder = tmp_path / "run"
    folder.mkdir()
    train_unet.hold_checkpoint_dir(folder)
    try:
        loader = torch.utils.data.DataLoader(FolderDescriptors(folder), num_workers=1,
                                             worker_init_fn=train_unet.start_worker, multiprocessing_context="fork")
        in_worker = list(loader)[0].item()
        if in_worker == -1:
            pytest.skip("no /proc/self/fd here")
        assert in_worker == 0 and FolderDescriptors(folder)[0] == 1  # the training process keeps its own
        probe = os.open(folder, os.O_RDONLY)
        with pytest.raises(OSError):  # ... and with it the lock
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.close(probe)
    finally:
        os.close(train_unet.HELD_FOLDERS.pop(os.path.realpath(folder))[0])


def test_half_written_temporary_checkpoints_of_a_killed_run_are_removed(make_cfg, tmp_path):
    """A run killed mid-write left a hidden .last.pt.<random>.tmp as large as a checkpoint, for good; the next
    run in the folder removes such files, and only those."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".last.pt.lu0b5c1b.tmp").write_bytes(b"half a checkpoint")
    (folder / ".notes.tmp").write_text("mine")
    train_unet.train(make_cfg(epochs=1))
    assert not (folder / ".last.pt.lu0b5c1b.tmp").exists() and (folder / ".notes.tmp").read_text() == "mine"


def test_a_full_disk_while_saving_a_checkpoint_is_one_line_and_the_last_one_stays(make_cfg, tmp_path, monkeypatch):
    """torch's zip writer reports a full disk as a RuntimeError ("unexpected pos"): that was a 30-line
    traceback out of finish_epoch. Now one line; the checkpoint it would have replaced is intact."""
    cfg = make_cfg(epochs=1)
    train_unet.train(cfg)
    last = Path(cfg["checkpoint_dir"]) / "last.pt"
    before = last.read_bytes()
    real_save = torch.save

    def full_disk(obj, f, *args, **kwargs):
        real_save({"half": torch.zeros(10)}, f)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 98546880 vs 98546768")
    monkeypatch.setattr(train_unet.torch, "save", full_disk)
    with pytest.raises(UserError, match=r"cannot write .*last.pt \(the write stopped short, as on a full disk: it "
                                        r"needs about \d+ MB, [\d.]+ [MGT]B free\): free disk space there") as err:
        train_unet.train({**cfg, "resume": True, "epochs": 2})
    assert "\n" not in str(err.value) and "inline_container" not in str(err.value)  # torch's text says no more
    assert last.read_bytes() == before and not list(last.parent.glob(".last.pt.*"))


def test_a_disk_too_small_for_the_checkpoints_is_found_before_training(make_cfg, monkeypatch, capsys):
    """A 3 MB checkpoint_dir: the run trained its whole first epoch, then stopped at best.pt's write (a user's
    report). Refused before training, with the sizes; a note where only a later last.pt would not fit."""
    cfg = make_cfg(epochs=1)
    usage = train_unet.shutil.disk_usage

    def small(free):
        monkeypatch.setattr(train_unet.shutil, "disk_usage", lambda path: usage(path)._replace(free=free))
    trained = []
    monkeypatch.setattr(train_unet, "run_epoch", lambda *args, **kwargs: trained.append(1) or 1 / 0)
    small(3 * 2**20)
    with pytest.raises(UserError, match=r"checkpoint_dir=.*ckpt has 3 MB free, too little for the run's checkpoints "
                                        r"\(best.pt about \d+ MB, last.pt about \d+ MB\): free disk space there"):
        train_unet.train(cfg)
    assert not trained
    monkeypatch.undo()
    best, last = train_unet.checkpoint_sizes(type("Run", (), {"model": train_unet.build_model(cfg),
                                                              "ema": train_unet.WeightEMA()})())
    assert 0 < best < last < 4 * best
    small(best + last + 2**20)
    train_unet.train(cfg)
    assert "but not for a new last.pt written beside the one it replaces" in capsys.readouterr().out
    monkeypatch.undo()
    train_unet.train(cfg)
    assert "free:" not in capsys.readouterr().out


def test_a_new_run_refused_for_room_leaves_the_earlier_run_where_it_was(make_cfg, monkeypatch):
    """A new run on a disk without room for its checkpoints was refused only after the earlier run had moved to
    previous/<time>/, unsaid (resume=True then found no last.pt). And the earlier run's files, which move to
    previous/ on the same disk, were counted as room."""
    cfg = make_cfg(epochs=1)
    train_unet.train(cfg)
    folder = Path(cfg["checkpoint_dir"])
    before = files_in(folder)
    best, last = (folder / "best.pt").stat().st_size, (folder / "last.pt").stat().st_size
    usage = train_unet.shutil.disk_usage
    monkeypatch.setattr(train_unet.shutil, "disk_usage", lambda path: usage(path)._replace(free=last + 2**20))
    with pytest.raises(UserError, match=r"too little for the run's checkpoints"):
        train_unet.train(cfg)
    assert files_in(folder) == before and not (folder / "previous").exists() and best < last


@pytest.mark.parametrize("name", ["history.csv", "config.json", "best.pt"])
def test_a_folder_in_the_way_of_a_resumed_runs_file_is_refused_before_training(make_cfg, name, monkeypatch, capsys):
    """history.csv or config.json made a folder: the resume trained an epoch, then ended in a traceback
    (IsADirectoryError from the rename). Refused at the start now, in one line; one made meanwhile is one too."""
    cfg = make_cfg(epochs=1)
    train_unet.train(cfg)
    path = Path(cfg["checkpoint_dir"]) / name
    path.unlink()
    path.mkdir()
    trained = []
    monkeypatch.setattr(train_unet, "run_epoch", lambda *args, **kwargs: trained.append(1) or 1 / 0)
    with pytest.raises(UserError, match=rf"^{re.escape(str(path))} is a folder, where the resumed run writes its "
                                        rf"file of that name: move or rename it$"):
        train_unet.train({**cfg, "resume": True, "epochs": 2})
    assert not trained

    def in_the_way(*args):
        raise IsADirectoryError(errno.EISDIR, "Is a directory", "/runs/.history.csv.x.tmp", None, "/runs/history.csv")
    monkeypatch.setattr(train_unet, "train_main", in_the_way)
    assert train_unet.main(["epochs=1"]) == 2
    assert capsys.readouterr().err.endswith("error: cannot write /runs/history.csv: a folder of that name is in the "
                                            "way: move or rename it\n")


def test_a_full_disk_under_any_other_write_is_one_line(monkeypatch, capsys):
    def fails(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", "/runs/history.csv")
    monkeypatch.setattr(train_unet, "train_main", fails)
    assert train_unet.main(["epochs=1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: cannot write /runs/history.csv (No space left on device)")


def test_a_checkpoint_write_refused_for_another_reason_names_the_folder_not_the_disk(tmp_path, monkeypatch):
    """Only a full disk asks for disk space; a folder that refuses the write (permissions) is named as such,
    in the words predict uses for its masks (write_fix)."""
    def refused(obj, f, *args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied", str(f))
    monkeypatch.setattr(train_unet.torch, "save", refused)
    with pytest.raises(UserError) as err:
        train_unet.save_checkpoint(tmp_path / "last.pt", {})
    assert str(err.value) == (f"cannot write {tmp_path / 'last.pt'} (Permission denied): check that the folder still "
                              f"exists and is writable, or choose another folder; the files written before it are intact")
