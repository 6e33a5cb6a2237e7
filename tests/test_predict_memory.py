"""Large images in predict: an image that cannot fit in memory is refused by name before it is decoded,
the others are predicted; image headers are read without decoding; the machine's and a container's free
memory; OpenCV's pixel limit is raised (the user's own limit stays) and named when an image exceeds it;
masks of large logits are made in bands of rows, equal to the whole-image rule."""
import os
import subprocess
import sys
import weakref
from pathlib import Path

import cv2
import numpy as np
import pytest
import tifffile
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import train_unet  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A fresh binary fit-mode model's checkpoint (nothing is trained: only which images get predicted
    matters here)."""
    folder = tmp_path_factory.mktemp("memory")
    cfg = train_unet.validate_config({**train_unet.CONFIG, "image_size": 32, "encoder_name": "resnet18",
                                      "device": "cpu"})
    torch.manual_seed(0)
    model = train_unet.build_model({**cfg, "encoder_weights": None})
    train_unet.save_checkpoint(folder / "m.pt", {"model": model.state_dict(), "config": cfg})
    return folder / "m.pt"


def predict_opts(checkpoint, inp, out):
    return {**train_unet.PREDICT_CONFIG, "checkpoint": str(checkpoint), "input": str(inp), "output": str(out),
            "device": "cpu", "use_amp": False, "progress": False, "cpu_probe": False}


def test_an_image_too_large_for_the_free_memory_is_refused_undecoded_and_the_others_are_predicted(
        checkpoint, tmp_path, monkeypatch, capsys):
    inp = tmp_path / "in"
    inp.mkdir()
    rng = np.random.default_rng(0)
    cv2.imwrite(str(inp / "small.png"), rng.integers(0, 256, (40, 30, 3), dtype=np.uint8))
    cv2.imwrite(str(inp / "large.png"), rng.integers(0, 256, (300, 200, 3), dtype=np.uint8))
    cfg = {"num_classes": 1}
    small, large = (train_unet.predict_memory(*train_unet.image_header(inp / n), cfg) for n in ("small.png", "large.png"))
    assert small == 40 * 30 * (3 + 4 + 1) and large == 300 * 200 * (3 + 4 + 1)
    monkeypatch.setattr(train_unet, "available_memory", lambda: (small + large) // 2)
    decoded, read_image = [], train_unet.read_image
    monkeypatch.setattr(train_unet, "read_image", lambda path, *a: decoded.append(Path(path).name) or read_image(path, *a))

    result = train_unet.predict(predict_opts(checkpoint, inp, tmp_path / "out"))

    assert result["predicted"] == 1 and (tmp_path / "out" / "small.png").is_file()
    assert not (tmp_path / "out" / "large.png").exists() and decoded == ["small.png"]
    [(path, reason)] = result["failed"]
    assert path.endswith("large.png")
    assert "large.png (200x300) needs at least" in reason and "cut it into parts" in reason
    assert f"failed: {reason}" in capsys.readouterr().out


def test_nothing_is_refused_where_the_free_memory_is_unknown(checkpoint, tmp_path, monkeypatch):
    inp = tmp_path / "in"
    inp.mkdir()
    cv2.imwrite(str(inp / "a.png"), np.zeros((50, 60, 3), np.uint8))
    monkeypatch.setattr(train_unet, "available_memory", lambda: None)
    headers = []
    monkeypatch.setattr(train_unet, "image_header", lambda path: headers.append(path))
    assert train_unet.predict(predict_opts(checkpoint, inp, tmp_path / "out"))["predicted"] == 1
    assert headers == []  # no header read either: nothing to compare it with


@pytest.mark.parametrize("room", [True, False])
def test_the_next_large_image_is_read_beside_this_one_only_where_both_fit(room, checkpoint, tmp_path, monkeypatch):
    """Patch mode reads the next image while the model works on this one; where this image's need and the
    next one's decoded pixels would not fit together, the next is read after this one is done."""
    import time

    cfg = train_unet.validate_config({**train_unet.CONFIG, "image_size": 32, "data_mode": "patch"})
    patch = tmp_path / "patch.pt"
    train_unet.save_checkpoint(patch, {**train_unet.load_checkpoint(checkpoint), "config": cfg})
    inp = tmp_path / "in"
    inp.mkdir()
    for name in ("a", "b"):
        cv2.imwrite(str(inp / f"{name}.png"), np.zeros((100, 100, 3), np.uint8))
    need, decoded = 100 * 100 * (3 + 4 + 1), 100 * 100 * 3
    monkeypatch.setattr(train_unet, "available_memory", lambda: need + decoded + (0 if room else -1))
    read, reading, images, held = [], train_unet.read_image, {}, {}

    def read_image(path, *args):  # notes which images are read, and which read before are still held
        read.append(Path(path).stem)
        held[Path(path).stem] = [name for name, image in images.items() if image() is not None]
        image = reading(path, *args)
        images[Path(path).stem] = weakref.ref(image)
        return image
    monkeypatch.setattr(train_unet, "read_image", read_image)
    seen, predicting = [], train_unet.predict_logits

    def slow_predict(model, image, *args):  # time enough for a read-ahead to happen
        time.sleep(0.3)
        seen.append(list(read))
        return predicting(model, image, *args)
    monkeypatch.setattr(train_unet, "predict_logits", slow_predict)
    monkeypatch.setattr(train_unet, "predict_host_threads", lambda hw: True)  # reads ahead (a core to spare)

    result = train_unet.predict({**predict_opts(patch, inp, tmp_path / "out"), "overlay": True})

    assert result["predicted"] == 2 and not result["failed"]
    assert seen == ([["a", "b"], ["a", "b"]] if room else [["a"], ["a", "b"]])
    if not room:  # and image a, its mask and overlay were let go, written, before b was decoded
        assert held == {"a": [], "b": []} and (tmp_path / "out" / "a_overlay.png").is_file()


def write_formats(folder):
    """{file: the array its decoder returns at the stored depth} in the formats predict reads."""
    rng = np.random.default_rng(1)
    arrays = {"rgb8.png": rng.integers(0, 256, (21, 34, 3), dtype=np.uint8),
              "gray16.png": rng.integers(0, 4096, (21, 34), dtype=np.uint16),  # 12-bit data, 16-bit file
              "rgba8.png": rng.integers(0, 256, (21, 34, 4), dtype=np.uint8),
              "photo.jpg": rng.integers(0, 256, (21, 34, 3), dtype=np.uint8),
              "gray.bmp": rng.integers(0, 256, (21, 34), dtype=np.uint8),
              "rgb16.tif": rng.integers(0, 65536, (21, 34, 3), dtype=np.uint16),
              "float.tiff": rng.random((21, 34), dtype=np.float32)}
    for name, array in arrays.items():
        if name.endswith((".tif", ".tiff")):
            tifffile.imwrite(folder / name, array)
        else:
            assert cv2.imwrite(str(folder / name), array)
    tifffile.imwrite(folder / "planar.tif", arrays["rgb16.tif"].transpose(2, 0, 1), photometric="rgb",
                     planarconfig="separate")
    tifffile.imwrite(folder / "tiled.tif", arrays["rgb8.png"], tile=(16, 16), compression="zlib")
    return {**arrays, "planar.tif": arrays["rgb16.tif"], "tiled.tif": arrays["rgb8.png"]}


def test_image_headers_give_the_size_and_bytes_a_sample(tmp_path):
    for name, array in write_formats(tmp_path).items():
        assert train_unet.image_header(tmp_path / name) == (*array.shape[:2], array.itemsize), name


def test_the_counted_image_is_read_images_own_size(tmp_path):
    """predict_memory's image term is the array read_image returns: in_channels of uint8, or float32."""
    for name in write_formats(tmp_path):
        for channels in (1, 3):
            cfg = {"num_classes": 2, "in_channels": channels}
            h, w, depth = train_unet.image_header(tmp_path / name)
            image = train_unet.read_image(tmp_path / name, channels, (0, 1) if name == "float.tiff" else None)
            assert train_unet.image_bytes(depth, cfg) * h * w == image.nbytes, (name, channels)
            assert train_unet.predict_memory(h, w, depth, cfg) == image.nbytes + h * w * (4 * 2 + 1)


@pytest.mark.parametrize("orientation", [1, 3, 6, 8])
def test_an_exif_turned_jpegs_header_gives_the_size_read_image_decodes(tmp_path, orientation):
    """A phone's JPEG stored on its side with an EXIF orientation is decoded upright: the header's size
    (in the refusal's W x H) is the decoded one, not the stored one."""
    from PIL import Image

    exif = Image.Exif()
    exif[train_unet.EXIF_ORIENTATION] = orientation
    Image.fromarray(np.zeros((20, 40, 3), np.uint8)).save(tmp_path / "phone.jpg", exif=exif)
    image = train_unet.read_image(tmp_path / "phone.jpg", 3)
    assert image.shape[:2] == ((40, 20) if orientation in (6, 8) else (20, 40))
    assert train_unet.image_header(tmp_path / "phone.jpg") == (*image.shape[:2], 1)


def test_fit_modes_logits_on_a_gpu_are_not_counted_as_host_memory(monkeypatch):
    gpu, cpu = (type("HW", (), {"kind": kind})() for kind in ("cuda", "cpu"))
    header = (1000, 1000, 1)
    monkeypatch.setattr(train_unet, "image_header", lambda path: header)
    image_and_mask, logits = 1000 * 1000 * (3 + 1), 1000 * 1000 * 4 * 3
    for mode, hw, need in [("fit", gpu, image_and_mask), ("fit", cpu, image_and_mask + logits),
                           ("patch", gpu, image_and_mask + logits)]:  # the blended sum comes back to the host
        cfg = {"num_classes": 3, "in_channels": 3, "data_mode": mode}
        train_unet.MemoryBudget(need, cfg, hw).check("a.png")
        with pytest.raises(train_unet.UserError, match="needs at least"):
            train_unet.MemoryBudget(need - 1, cfg, hw).check("a.png")


def test_a_truncated_tiff_is_named_and_the_other_images_are_predicted(checkpoint, tmp_path):
    inp = tmp_path / "in"
    inp.mkdir()
    cv2.imwrite(str(inp / "a.png"), np.zeros((20, 20, 3), np.uint8))
    (inp / "b.tif").write_bytes(b"II*\0")  # an interrupted copy
    assert train_unet.image_header(inp / "b.tif") is None
    result = train_unet.predict(predict_opts(checkpoint, inp, tmp_path / "out"))
    assert result["predicted"] == 1 and (tmp_path / "out" / "a.png").is_file()
    [(path, reason)] = result["failed"]
    assert path.endswith("b.tif") and reason.startswith("cannot read image")


def test_an_unreadable_header_is_left_to_the_decoder(tmp_path):
    (tmp_path / "broken.png").write_bytes(b"not a png")
    (tmp_path / "broken.tif").write_bytes(b"II*\0garbage")
    assert train_unet.image_header(tmp_path / "broken.png") is None
    assert train_unet.image_header(tmp_path / "broken.tif") is None
    train_unet.MemoryBudget(1, {"num_classes": 1, "data_mode": "fit"}, None).check(tmp_path / "broken.png")  # no error: read_image names it
    with pytest.raises(train_unet.UserError, match="cannot read image .*broken.png"):
        train_unet.read_image(tmp_path / "broken.png", 3)


def write_cgroup(root, version, levels):
    """A fake /proc/self/cgroup and cgroup tree, cgroup v2 or v1's memory controller: the process sits in
    the last of `levels`, [(name, limit, usage, page cache)] from the top down."""
    where = "/".join(name for name, *_ in levels)
    (root / "cgroup").write_text(f"0::/{where}\n" if version == 2 else f"5:memory:/{where}\n4:cpu,cpuacct:/{where}\n")
    names = ("memory.max", "memory.current", "file") if version == 2 else \
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_cache")
    folder = root / "sys" / ("" if version == 2 else "memory")
    for name, limit, usage, cache in levels:
        folder = folder / name
        folder.mkdir(parents=True)
        (folder / names[0]).write_text(f"{limit}\n")
        (folder / names[1]).write_text(f"{usage}\n")
        (folder / "memory.stat").write_text(f"anon 5\n{names[2]} {cache}\nother 7\n")
    return root / "cgroup", root / "sys"


NO_LIMIT = {1: 9223372036854771712, 2: "max"}


@pytest.mark.parametrize("version", [1, 2])
def test_a_containers_memory_limit_bounds_the_free_memory(tmp_path, version):
    proc, sys_root = write_cgroup(tmp_path, version, [("job", 8 << 30, 6 << 30, 1 << 30)])
    assert train_unet.cgroup_room(proc, sys_root) == 3 << 30  # the page cache counts as free


@pytest.mark.parametrize("version", [1, 2])
def test_a_limit_above_the_processs_own_cgroup_counts(tmp_path, version):
    """Slurm puts a job's limit on job_N and runs its tasks in cgroups below it, without limits."""
    proc, sys_root = write_cgroup(tmp_path, version, [("job_7", 4 << 30, 3 << 30, 0),
                                                      ("step_0", 6 << 30, 1 << 30, 0),
                                                      ("task_0", NO_LIMIT[version], 1 << 30, 0)])
    assert train_unet.cgroup_room(proc, sys_root) == 1 << 30  # the tightest: the job's 4 GB, 3 GB used


@pytest.mark.parametrize("version", [1, 2])
def test_no_container_limit_leaves_the_machines_free_memory(tmp_path, version):
    proc, sys_root = write_cgroup(tmp_path, version, [("job", NO_LIMIT[version], 6 << 30, 0)])
    assert train_unet.cgroup_room(proc, sys_root) == float("inf")
    assert train_unet.cgroup_room(tmp_path / "missing", sys_root) == float("inf")
    (tmp_path / "odd").write_text("garbage\n12:memory\n")
    assert train_unet.cgroup_room(tmp_path / "odd", sys_root) == float("inf")


@pytest.mark.skipif(not Path("/proc/meminfo").exists(), reason="MemAvailable is Linux's")
def test_the_free_memory_is_the_kernels_available_memory_at_most():
    free = train_unet.available_memory()
    kernel = int(next(line.split()[1] for line in Path("/proc/meminfo").read_text().splitlines()
                      if line.startswith("MemAvailable:"))) * 1024
    assert 0 < free <= kernel * 1.05  # read a moment apart


def run_python(code, **env):
    environ = {k: v for k, v in os.environ.items() if k != "OPENCV_IO_MAX_IMAGE_PIXELS"}
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**environ, **env}, capture_output=True,
                          text=True, timeout=120)


def test_opencvs_pixel_limit_is_raised_before_it_loads_and_a_users_own_limit_stays():
    code = "import os, train_unet; print(os.environ['OPENCV_IO_MAX_IMAGE_PIXELS'])"
    assert run_python(code).stdout.split() == [str(1 << 40)]
    assert run_python(code, OPENCV_IO_MAX_IMAGE_PIXELS="5000").stdout.split() == ["5000"]
    after_cv2 = run_python("import os, cv2, train_unet; print(os.environ.get('OPENCV_IO_MAX_IMAGE_PIXELS'))")
    assert after_cv2.stdout.split() == ["None"]  # too late to change OpenCV's: not pretended


def test_an_image_over_opencvs_pixel_limit_is_named_with_the_fix(checkpoint, tmp_path):
    inp = tmp_path / "in"
    inp.mkdir()
    cv2.imwrite(str(inp / "big.png"), np.zeros((64, 64, 3), np.uint8))
    cv2.imwrite(str(inp / "ok.png"), np.zeros((20, 20, 3), np.uint8))
    cv2.imwrite(str(tmp_path / "mask.png"), np.zeros((64, 64), np.uint8))
    code = (f"import train_unet as t\nr = t.predict({predict_opts(checkpoint, inp, tmp_path / 'out')!r})\n"
            f"print('predicted', r['predicted'])\n"
            f"try:\n    t.decode_mask({str(tmp_path / 'mask.png')!r})\nexcept t.UserError as e:\n    print(e)")
    run = run_python(code, OPENCV_IO_MAX_IMAGE_PIXELS="1000")  # 20x20 passes, 64x64 does not
    assert run.returncode == 0, run.stderr
    assert "predicted 1" in run.stdout and "Traceback" not in run.stdout + run.stderr
    assert "big.png has more pixels than OpenCV may read here (OPENCV_IO_MAX_IMAGE_PIXELS" in run.stdout
    assert "mask " + str(tmp_path / "mask.png") + " has more pixels than OpenCV may read" in run.stdout


@pytest.mark.parametrize("name, shape", [("wide.png", (2, 1_000_001)), ("tall.png", (1_000_001, 2)),
                                         ("wide.bmp", (1, (1 << 20) + 1))])
def test_an_image_over_opencvs_side_limit_is_named_as_such_not_as_corrupt(tmp_path, name, shape):
    """libpng refuses PNGs over 1,000,000 px a side and OpenCV any image over 2**20 px: a sound file, so
    the error says so and what to do, for images and masks alike."""
    from PIL import Image

    Image.fromarray(np.zeros(shape, np.uint8)).save(tmp_path / name)
    for read in (lambda p: train_unet.read_image(p, 1), train_unet.decode_mask):
        with pytest.raises(train_unet.UserError) as err:
            read(tmp_path / name)
        message = str(err.value)
        assert f"{shape[1]}x{shape[0]} px" in message and "px a side" in message and "TIFF" in message
        assert "corrupt" not in message and "\n" not in message
    tifffile.imwrite(tmp_path / "same.tif", np.zeros(shape, np.uint8))  # the fix it names works
    assert train_unet.read_image(tmp_path / "same.tif", 1).shape == shape


@pytest.mark.parametrize("classes", [1, 3])
def test_masks_of_large_logits_are_made_in_bands_equal_to_the_whole_image_rule(classes, monkeypatch):
    torch.manual_seed(classes)
    logits = torch.randn(classes, 70, 40)
    whole = train_unet.mask_tensor(logits, classes)
    assert torch.equal(whole, ((logits[0] > 0) if classes == 1 else logits.argmax(0)).to(torch.uint8))
    monkeypatch.setattr(train_unet, "SCORE_BAND_PIXELS", 40 * 16)  # 16 rows a band: 5 bands
    assert len(train_unet.score_bands(70, 40)) == 5
    banded = train_unet.mask_tensor(logits, classes)
    assert banded.dtype == torch.uint8 and torch.equal(banded, whole)


@pytest.mark.parametrize("gray", [False, True])
def test_overlays_are_made_in_bands_equal_to_the_whole_image_blend(gray, monkeypatch):
    rng = np.random.default_rng(2)
    image = rng.integers(0, 256, (70, 40) if gray else (70, 40, 3), dtype=np.uint8)
    mask = rng.integers(0, 16, (70, 40), dtype=np.uint8)  # more classes than colours: the palette wraps
    rgb = np.repeat(image[..., None], 3, axis=2) if gray else image
    palette = train_unet.OVERLAY_PALETTE
    colour = palette[1:][(mask.astype(np.int64) - 1) % (len(palette) - 1)]
    whole = cv2.cvtColor(np.where(mask[..., None] > 0, (1 - 0.45) * rgb + 0.45 * colour, rgb).astype(np.uint8),
                         cv2.COLOR_RGB2BGR)
    assert np.array_equal(train_unet.overlay_image(image, mask), whole)
    monkeypatch.setattr(train_unet, "SCORE_BAND_PIXELS", 40 * 16)
    assert np.array_equal(train_unet.overlay_image(image, mask), whole)


def test_the_first_twelve_classes_are_drawn_in_twelve_colours():
    """Six colours: class 7 was drawn in class 1's, class 8 in class 2's (user test)."""
    mask = np.arange(1, 13, dtype=np.uint8)[None]
    drawn = train_unet.overlay_image(np.zeros((1, 12, 3), np.uint8), mask)[0]
    assert len({tuple(pixel) for pixel in drawn}) == 12


def test_the_memory_tool_reports_both_mask_rules_above_the_lower_bound(tmp_path):
    run = subprocess.run([sys.executable, "tools/predict_memory.py", "side=600", "classes=3",
                          f"folder={tmp_path}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    rows = {line.split("|")[1].strip(): [cell.strip() for cell in line.split("|")[2:-1]]
            for line in run.stdout.splitlines() if line.startswith("| banded") or line.startswith("| whole")}
    assert set(rows) == {"banded", "whole"}
    bound = 600 * 600 * (3 + 4 * 3 + 1) / 2**20
    for predict_s, before, peak, share, lower in rows.values():
        assert float(share.split()[0]) >= bound and lower == train_unet.size_text(bound * 2**20)
    assert (tmp_path / "600_3ch" / "out_banded" / "scene.png").is_file()
