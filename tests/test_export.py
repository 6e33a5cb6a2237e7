"""`export`: a checkpoint as ONNX + a sidecar JSON, checked in onnxruntime; `predict backend=onnxruntime`.

Two tiny models are trained once for the module (32 px tiles, 1 epoch, fp32) and exported once: a binary
RGB fit-mode one, and a 3-class grayscale patch-mode one (predicted through the sliding window). Their
segmentation heads are re-centred first (centred_checkpoint), so their masks hold both answers: "masks
equal" is then not the vacuous all-background.
"""
import errno
import json
import re
import runpy
import shlex
import shutil
import subprocess
import sys
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

SIZE = 32
ODD_SIZES = ((96, 160), (224, 64))  # multiples of MODEL_STRIDE, neither square nor the training size


def one_line_error(fn, *args, match):
    with pytest.raises(train_unet.UserError, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def train_tiny(root, image_size=SIZE, **overrides):
    data = train_unet.generate_shapes_dataset(root / "data", count=10, size=overrides.pop("data_size", SIZE),
                                              num_classes=overrides.get("num_classes", 1))
    cfg = dict(data_dir=str(data), checkpoint_dir=str(root / "ckpt"), image_size=image_size, epochs=1,
               max_train_images=8, batch_size=2, use_amp=False, encoder_name="resnet18", encoder_weights=None,
               device="cpu", progress=False, num_workers=0, cpu_probe=False, logger="none")
    cfg.update(overrides)
    train_unet.train(cfg)
    return centred_checkpoint(root / "ckpt" / "last.pt", data), data


def centred_checkpoint(ckpt, data):
    """The checkpoint with its head's bias shifted by the median logit on its own images (per class), so
    a 1-epoch model's masks hold both sides of the threshold; saved as centred.pt."""
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    model, cfg = train_unet.load_model(ckpt, train_unet.detect_hardware("cpu"))
    images = [train_unet.read_image(p, cfg["in_channels"]) for p, _ in train_unet.find_pairs(data)[:4]]
    normalize = train_unet.normalizer(cfg)
    x = torch.stack([train_unet.image_tensor(normalize(cv2.resize(im, (SIZE, SIZE)))) for im in images])
    with torch.no_grad():
        logits = model(x)
        model.segmentation_head[0].bias -= logits.transpose(0, 1).flatten(1).median(dim=1).values
    state["model"] = model.state_dict()
    out = ckpt.with_name("centred.pt")
    torch.save(state, out)
    return out


def export(ckpt, output, **kw):
    return train_unet.export({**train_unet.EXPORT_CONFIG, "checkpoint": str(ckpt), "output": str(output), **kw})


@pytest.fixture(scope="module")
def binary(tmp_path_factory):
    """{ckpt, data, onnx, sidecar, check} of a binary RGB fit-mode model."""
    root = tmp_path_factory.mktemp("binary")
    ckpt, data = train_tiny(root)
    return {"ckpt": ckpt, "data": data, **export(ckpt, root / "export" / "model.onnx")}


@pytest.fixture(scope="module")
def patch(tmp_path_factory):
    """The same for a 3-class grayscale patch-mode model (64 px images, 32 px tiles)."""
    root = tmp_path_factory.mktemp("patch")
    ckpt, data = train_tiny(root, data_size=64, num_classes=3, in_channels=1, data_mode="patch")
    return {"ckpt": ckpt, "data": data, **export(ckpt, root / "export")}  # a folder: <folder>/model.onnx


@pytest.fixture(scope="module")
def hw():
    return train_unet.detect_hardware("cpu")


def predict_opts(ckpt, inp, out, **kw):
    return {**train_unet.PREDICT_CONFIG, "checkpoint": str(ckpt), "input": str(inp), "output": str(out),
            "device": "cpu", "use_amp": False, "progress": False, **kw}


def write_odd_images(folder, data, sizes):
    """The data set's images resized to awkward sizes: [(path, (h, w))]."""
    folder.mkdir(parents=True, exist_ok=True)
    sources = sorted((Path(data) / "images").glob("*.png"))
    written = []
    for i, (h, w) in enumerate(sizes):
        image = cv2.resize(cv2.imread(str(sources[i % len(sources)])), (w, h), interpolation=cv2.INTER_LINEAR)
        assert cv2.imwrite(str(folder / f"odd_{h}x{w}.png"), image)
        written.append((folder / f"odd_{h}x{w}.png", (h, w)))
    return written


def read_masks(folder):
    return {p.name: cv2.imread(str(p), cv2.IMREAD_UNCHANGED) for p in sorted(Path(folder).glob("*.png"))}


# ---------------------------------------------------------------------------------------------------
# a. the exported graph computes the checkpoint's logits, at any multiple of the stride
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["binary", "patch"])
def test_onnx_logits_match_pytorch_at_odd_sizes(which, request, hw):
    exported = request.getfixturevalue(which)
    model, cfg = train_unet.load_model(exported["ckpt"], hw)
    onnx_model = train_unet.OnnxModel(train_unet.onnx_session(exported["onnx"], hw))
    images = [train_unet.read_image(p, cfg["in_channels"]) for p, _ in train_unet.find_pairs(exported["data"])[:3]]
    normalize = train_unet.normalizer(cfg)
    for h, w in ODD_SIZES:
        x = torch.stack([train_unet.image_tensor(normalize(cv2.resize(im, (w, h)))) for im in images])
        with torch.no_grad():
            want = model(x)
        got = onnx_model(x)
        assert got.shape == want.shape == (3, cfg["num_classes"], h, w)
        tolerance = train_unet.LOGIT_ATOL + train_unet.LOGIT_RTOL * want.abs().max().item()
        assert (got - want).abs().max().item() <= tolerance


def test_the_export_command_checked_itself_on_the_val_images(binary):
    check = binary["check"]
    assert "val image(s)" in check["inputs"] and "96x160" in check["inputs"] and "224x64" in check["inputs"]
    assert check["max_abs_logit_difference"] <= check["tolerance"] < 0.01
    assert check["mask_agreement"] >= 0.999


# ---------------------------------------------------------------------------------------------------
# b. predict backend=onnxruntime: the same predict code, the same masks
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tta", ["none", "d4"])
def test_onnxruntime_predict_masks_equal_torch_fit_mode(tta, binary, tmp_path):
    """Also with test-time augmentation: the exported graph takes the views' batch as the module does."""
    images = write_odd_images(tmp_path / "in", binary["data"], [(45, 77), (100, 50), (32, 32), (131, 33)])
    torch_out = train_unet.predict(predict_opts(binary["ckpt"], tmp_path / "in", tmp_path / "torch", tta=tta))
    onnx_out = train_unet.predict(predict_opts(binary["onnx"], tmp_path / "in", tmp_path / "onnx",
                                               backend="onnxruntime", tta=tta))
    assert torch_out["predicted"] == onnx_out["predicted"] == len(images) and onnx_out["precision"] == "fp32"
    want, got = read_masks(tmp_path / "torch"), read_masks(tmp_path / "onnx")
    assert set(got) == set(want) == {p.name for p, _ in images}
    for name in want:
        assert got[name].shape == want[name].shape
        assert np.array_equal(got[name], want[name]), f"{name}: {int((got[name] != want[name]).sum())} pixels differ"
    assert set(np.unique(np.concatenate([m.ravel() for m in want.values()]))) == {0, 255}, \
        "test setup: the centred model's masks should hold both values"


def test_onnxruntime_predict_masks_equal_torch_through_the_sliding_window(patch, tmp_path):
    images = write_odd_images(tmp_path / "in", patch["data"], [(70, 90), (64, 64), (40, 100)])
    results = {backend: train_unet.predict(predict_opts(patch["onnx" if backend == "onnxruntime" else "ckpt"],
                                                        tmp_path / "in", tmp_path / backend, backend=backend))
               for backend in ("torch", "onnxruntime")}
    assert all(r["predicted"] == len(images) for r in results.values())
    want, got = read_masks(tmp_path / "torch"), read_masks(tmp_path / "onnxruntime")
    for name in want:
        assert np.array_equal(got[name], want[name]), f"{name}: {int((got[name] != want[name]).sum())} pixels differ"
    assert len(np.unique(np.concatenate([m.ravel() for m in want.values()]))) >= 2


def test_onnxruntime_predict_needs_neither_the_checkpoint_nor_smp(binary, tmp_path, monkeypatch):
    """Deployment: the two exported files alone, moved elsewhere, with segmentation_models_pytorch
    unimportable, give the torch backend's masks."""
    deploy = tmp_path / "deploy"
    deploy.mkdir()
    for path in (binary["onnx"], binary["sidecar"]):
        shutil.copy(path, deploy / path.name)
    images = write_odd_images(tmp_path / "in", binary["data"], [(50, 70), (32, 96)])
    train_unet.predict(predict_opts(binary["ckpt"], tmp_path / "in", tmp_path / "torch"))
    monkeypatch.setitem(sys.modules, "segmentation_models_pytorch", None)  # import now raises ImportError
    with pytest.raises(ImportError):
        train_unet.build_model(train_unet.CONFIG)
    result = train_unet.predict(predict_opts(deploy / "model.json", tmp_path / "in", tmp_path / "onnx",
                                             backend="onnxruntime"))
    assert result["predicted"] == len(images)
    want, got = read_masks(tmp_path / "torch"), read_masks(tmp_path / "onnx")
    assert all(np.array_equal(got[name], want[name]) for name in want)


@pytest.mark.parametrize("given", ["onnx", "folder"])
def test_main_predict_with_onnxruntime_returns_0(given, binary, tmp_path, capsys):
    """checkpoint= the .onnx, or export's output folder (export output=folder/ writes folder/model.onnx)."""
    checkpoint = binary["onnx"] if given == "onnx" else binary["onnx"].parent
    code = train_unet.main(["predict", "backend=onnxruntime", f"checkpoint={checkpoint}",
                            f"input={binary['data'] / 'images'}", f"output={tmp_path / 'out'}", "progress=False",
                            "device=cpu"])
    assert code == 0
    assert "onnxruntime" in capsys.readouterr().out
    assert len(list((tmp_path / "out").glob("*.png"))) == len(list((binary["data"] / "images").glob("*.png")))


# ---------------------------------------------------------------------------------------------------
# c. the sidecar holds what predict needs, and its numbers are predict's
# ---------------------------------------------------------------------------------------------------
def test_the_sidecars_class_names_are_the_checkpoints_not_the_data_folders_now(patch, tmp_path):
    """The sidecar read class_names.txt in the data folder at export: with the data moved (a deploy machine) it
    said 0, 1, 2; after an edit, the edited names; a file broken since stopped the export ('has 4 line(s) but
    num_classes=3 needs 3'), though the checkpoint holds the names the run trained with."""
    data = tmp_path / "data"
    shutil.copytree(patch["data"], data)
    (data / "class_names.txt").write_text("bg\ncircle\nsquare\nextra\n")  # broken since the run
    state = train_unet.load_checkpoint(patch["ckpt"])
    state["config"]["data_dir"], state["class_names"] = str(data), ["background", "circle", "box"]
    train_unet.save_checkpoint(tmp_path / "run.pt", state)
    meta = json.loads(export(tmp_path / "run.pt", tmp_path / "deploy")["sidecar"].read_text())
    assert meta["class_names"] == ["background", "circle", "box"]
    shutil.rmtree(data)  # moved away: the names stay the run's
    meta = json.loads(export(tmp_path / "run.pt", tmp_path / "deploy2")["sidecar"].read_text())
    assert meta["class_names"] == ["background", "circle", "box"]


@pytest.mark.parametrize("which", ["binary", "patch"])
def test_sidecar_holds_the_fields_predict_needs(which, request, hw):
    exported = request.getfixturevalue(which)
    meta = json.loads(exported["sidecar"].read_text())
    _, cfg = train_unet.load_model(exported["ckpt"], hw)
    assert exported["sidecar"] == exported["onnx"].with_suffix(".json")
    assert meta["onnx"] == exported["onnx"].name and meta["onnx_sha256"] == train_unet.file_sha256(exported["onnx"])
    for key in ("in_channels", "num_classes", "image_size", "intensity_range", "data_mode", "patch_scale",
                "tile_overlap", "tile_batch_size", "arch", "encoder_name"):
        assert meta["config"][key] == cfg[key], key
    assert meta["class_names"] == train_unet.load_class_names(cfg)
    assert meta["input"]["shape"] == ["batch", cfg["in_channels"], "height", "width"]
    assert meta["output"]["shape"] == ["batch", cfg["num_classes"], "height", "width"]
    assert meta["mask"]["rule"] == ("threshold" if cfg["num_classes"] == 1 else "argmax")
    assert meta["preprocessing"]["geometry"]["mode"] == cfg["data_mode"]
    assert meta["check"]["max_abs_logit_difference"] <= meta["check"]["tolerance"]
    assert meta["exported_from"] == str(exported["ckpt"])


def sidecar_input(image, spec):
    """The model's input from the sidecar's numbers alone (what a deployment in another language does)."""
    scale = spec["to_unit_range"]
    if image.dtype == np.uint8:
        low, high = scale["uint8"]
    elif np.issubdtype(image.dtype, np.integer):
        low, high = scale["wider integers"]
    else:
        low, high = float(image.min()), float(image.max())
    unit = (image.astype(np.float64) - low) / (high - low)
    return ((unit - np.array(spec["normalize"]["mean"])) / np.array(spec["normalize"]["std"])).astype(np.float32)


def test_the_sidecar_says_an_8_bit_image_is_resized_as_uint8_as_predict_does(make_cfg):
    """Done as the sidecar read ([0, 1] first, then the resize, in float32), a user's runtime matched predict on
    none of 12 images (99.4 % of pixels at worst): predict resizes 8-bit images as uint8, rounded."""
    cfg = make_cfg(image_size=64)
    spec = train_unet.preprocessing(cfg)
    assert "an 8-bit image as uint8, rounded, and to_unit_range after" in spec["geometry"]["resize"]
    image = np.random.default_rng(1).integers(0, 256, (40, 120, 3)).astype(np.uint8)  # 64 x 21 resized
    got = np.asarray(train_unet.fit_input(train_unet.scale_image(image), cfg))[:, :21, :]
    mean, std = (np.array(spec["normalize"][k], np.float32)[:, None, None] for k in ("mean", "std"))
    resized = cv2.resize(image, (64, 21), interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1)
    assert np.allclose(got, (resized / np.float32(255) - mean) / std, atol=1e-5)
    float_first = cv2.resize(image.astype(np.float32) / 255, (64, 21),
                             interpolation=cv2.INTER_LINEAR).transpose(2, 0, 1)
    assert not np.allclose(got, (float_first - mean) / std, atol=1e-5)


def test_the_sidecar_says_what_pads_a_fit_image_and_predict_pads_so(make_cfg):
    """"pad ... with 0" was read as 0 after normalising by a user's own runtime, which then agreed with
    predict on 98.6 % of a 120x40 image's mask pixels: the padding is 0 in [0, 1], then normalised."""
    for dtype, span in ((np.uint8, None), (np.uint16, [1000, 4000])):  # pixel 0 is not 0 in [0, 1] there
        cfg = make_cfg(image_size=64, intensity_range=span)
        spec = train_unet.preprocessing(cfg)
        assert "0 after to_unit_range, before normalize" in spec["geometry"]["resize"]
        image = np.random.default_rng(0).integers(1000, 4001, (40, 120, 3)).astype(dtype)  # 64 x 22 resized
        padded = train_unet.fit_input(train_unet.scale_image(image, intensity_range=span), cfg)
        by_hand = (0 - np.array(spec["normalize"]["mean"])) / np.array(spec["normalize"]["std"])
        assert np.allclose(np.asarray(padded)[:, 30:, :], by_hand[:, None, None], atol=1e-6), dtype


@pytest.mark.parametrize("kind", ["uint8", "uint16", "float32"])
def test_sidecar_preprocessing_gives_predicts_input(kind, tmp_path, make_cfg):
    """The sidecar's scaling and normalisation numbers, applied by hand, give what read_image and
    normalizer give predict: the sidecar describes the one scaling rule, it does not restate another."""
    cfg = make_cfg(intensity_range=[100, 4000] if kind == "uint16" else None)
    rng = np.random.default_rng(0)
    image = {"uint8": lambda: rng.integers(0, 256, (20, 30, 3)).astype(np.uint8),
             "uint16": lambda: rng.integers(100, 4001, (20, 30, 3)).astype(np.uint16),
             "float32": lambda: rng.normal(5, 2, (20, 30, 3)).astype(np.float32)}[kind]()
    path = tmp_path / "image.tif"
    tifffile.imwrite(path, image, photometric="rgb")
    spec = json.loads(json.dumps(train_unet.preprocessing(cfg)))  # as read back from the JSON file
    want = train_unet.normalizer(cfg)(train_unet.read_image(path, 3, cfg["intensity_range"]))
    np.testing.assert_allclose(sidecar_input(image, spec), want, atol=1e-5)


# ---------------------------------------------------------------------------------------------------
# d. it fails loudly: a model that differs, a bad checkpoint, a bad sidecar, missing packages
# ---------------------------------------------------------------------------------------------------
def test_the_check_fails_loudly_when_the_exported_model_differs(binary, tmp_path, monkeypatch, capsys):
    """A weight changed after the graph was written: the check sees it, the command exits non-zero with
    one line, and nothing is left behind."""
    real = train_unet.export_onnx

    def export_then_change(model, cfg, path):
        real(model, cfg, path)
        with torch.no_grad():
            model.segmentation_head[0].bias += 0.5
    monkeypatch.setattr(train_unet, "export_onnx", export_then_change)
    out = tmp_path / "out"
    code = train_unet.main(["export", f"checkpoint={binary['ckpt']}", f"output={out}"])
    captured = capsys.readouterr()
    assert code == 2
    assert "max |logit difference| 5.00e-01" in captured.out
    assert captured.err.startswith("error: the exported model does not match") and captured.err.count("\n") == 1
    assert not list(out.iterdir()), "a failed export leaves no file"


def fail_to_run(self, x):
    raise RuntimeError("[ONNXRuntimeError] : 2 : INVALID_ARGUMENT : Got invalid dimensions\nsecond line")


@pytest.mark.parametrize("case", ["nan", "runtime_error"])
def test_the_check_fails_on_nan_and_on_a_graph_that_cannot_run(case, binary, tmp_path, monkeypatch):
    real = train_unet.OnnxModel.__call__
    wrong = (lambda self, x: real(self, x) * float("nan")) if case == "nan" else fail_to_run
    monkeypatch.setattr(train_unet.OnnxModel, "__call__", wrong)
    match = "does not match" if case == "nan" else "onnxruntime cannot run the exported model"
    with pytest.raises(train_unet.UserError, match=match) as info:
        export(binary["ckpt"], tmp_path / "model.onnx")
    assert "\n" not in str(info.value)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("case", ["missing", "garbage", "foreign"])
def test_export_of_a_bad_checkpoint_is_one_line(case, tmp_path, capsys):
    path = tmp_path / "best.pt"
    if case == "garbage":
        path.write_bytes(b"not a checkpoint\x00\x01" * 20)
    elif case == "foreign":
        torch.save({"state_dict": {"w": torch.zeros(2)}}, path)
    code = train_unet.main(["export", f"checkpoint={path}", f"output={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("error: ") and err.count("\n") == 1 and str(path) in err
    assert "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_an_architecture_the_exporter_cannot_trace_is_one_line(tmp_path, make_cfg, capfd):
    """PSPNet's adaptive pooling has no ONNX form for any height and width: one line, and none of the
    exporter's graph dump (C++, straight to file descriptor 1)."""
    cfg = make_cfg(arch="PSPNet")
    model = train_unet.build_model(cfg).eval()
    with pytest.raises(train_unet.UserError, match="cannot export arch=PSPNet") as info:
        train_unet.export_onnx(model, cfg, tmp_path / "model.onnx")
    assert "\n" not in str(info.value)
    assert "graph" not in capfd.readouterr().out


@pytest.mark.parametrize("case", ["no_sidecar", "not_json", "other_format", "other_model", "a_pt_file", "a_typo",
                                  "cut_short", "cut_short_old_sidecar", "damaged", "smaller_other_model"])
def test_a_bad_export_is_refused_by_predict_in_one_line(case, binary, tmp_path, capfd):
    folder = tmp_path / "export"
    folder.mkdir()
    onnx, sidecar = (shutil.copy(p, folder / p.name) for p in (binary["onnx"], binary["sidecar"]))
    onnx, sidecar, given = Path(onnx), Path(sidecar), Path(onnx)
    meta = json.loads(sidecar.read_text())
    if case == "no_sidecar":
        sidecar.unlink()
    elif case == "not_json":
        sidecar.write_text("{ not json")
    elif case == "other_format":
        sidecar.write_text(json.dumps({**meta, "version": 99}))
    elif case == "other_model":  # the sidecar of another export of the same model: all but its SHA-256 alike
        sidecar.write_text(json.dumps({**meta, "onnx_sha256": "0" * 64}))
    elif case == "smaller_other_model":  # a patch-mode .onnx (fewer bytes) beside a fit-mode sidecar: "cut short"
        sidecar.write_text(json.dumps({**meta, "onnx_sha256": "0" * 64, "onnx_bytes": meta["onnx_bytes"] + 1000}))
    elif case == "damaged":  # it was said to belong to another export
        onnx.write_bytes(onnx.read_bytes()[:-1] + b"\x00")
    elif case.startswith("cut_short"):  # an interrupted copy: it was said to belong to another export
        onnx.write_bytes(onnx.read_bytes()[:4000])
        if case == "cut_short_old_sidecar":  # from before onnx_bytes: onnxruntime cannot read it
            sidecar.write_text(json.dumps({k: v for k, v in meta.items() if k != "onnx_bytes"}))
    elif case == "a_typo":  # it was said to lack its .json sidecar
        given = folder / "modle.onnx"
    else:
        given = binary["ckpt"]
    match = {"no_sidecar": "model.json not found: export writes it", "not_json": "not readable JSON",
             "other_format": "not a sidecar", "other_model": "belongs to another", "a_pt_file": "runs an exported model",
             "smaller_other_model": "belongs to another model.onnx",
             "a_typo": "checkpoint=.*modle.onnx not found: give the .onnx",
             "cut_short": f"model.onnx is cut short: 4000 of the {binary['onnx'].stat().st_size} bytes export wrote "
                          r"\(an interrupted copy\?\): copy it again",
             "cut_short_old_sidecar": r"model.onnx is damaged \(\w+: .*\), and its SHA-256 is not the one model.json "
                                      r"records: copy it again",
             "damaged": r"model.onnx is damaged \(\w+: .*\), and its SHA-256 is not the one"}[case]
    with pytest.raises(train_unet.UserError, match=match) as info:
        train_unet.predict(predict_opts(given, binary["data"] / "images", tmp_path / "out", backend="onnxruntime"))
    assert "\n" not in str(info.value)
    assert "onnxruntime" not in capfd.readouterr().err  # none of its C++ log lines before the one line


@pytest.mark.parametrize("edit, match", [
    ({"num_classes": 3}, r"model.json says num_classes=3 but model.onnx has 1 output channel\(s\): the two files"),
    ({"in_channels": 1}, r"model.json says in_channels=1 but model.onnx has 3 input channel\(s\)"),
    ({"image_size": None}, r"model.json lacks image_size, which predict needs: export again"),
    ({"image_size": 48}, r"export/model.json holds settings predict refuses \(image_size=48 must be a multiple of 32"
                         r".*\): export again rather than edit it$"),  # it named neither file nor fix (review)
])
def test_a_sidecar_that_does_not_match_its_onnx_is_refused(binary, tmp_path, edit, match):
    """A model.json edited to num_classes=3 for a binary model predicted all-0 masks with exit 0; without
    image_size, images were resized to the default 256 unsaid."""
    folder = tmp_path / "export"
    folder.mkdir()
    onnx, sidecar = (Path(shutil.copy(p, folder / p.name)) for p in (binary["onnx"], binary["sidecar"]))
    meta = json.loads(sidecar.read_text())
    config = {k: v for k, v in {**meta["config"], **edit}.items() if not (k in edit and v is None)}
    sidecar.write_text(json.dumps({**meta, "config": config}))
    with pytest.raises(train_unet.UserError, match=match) as info:
        train_unet.predict(predict_opts(onnx, binary["data"] / "images", tmp_path / "out", backend="onnxruntime"))
    assert "\n" not in str(info.value) and not (tmp_path / "out").exists()


def test_a_sidecars_edited_preprocessing_or_mask_rule_gets_a_note(binary, tmp_path, capsys):
    """predict reads the sidecar's config, not its preprocessing numbers or mask rule (written for other
    runtimes): a mean or a threshold edited there changed nothing, unsaid. An unedited sidecar, and an older
    one with fewer keys, get no note."""
    folder = tmp_path / "export"
    folder.mkdir()
    onnx, sidecar = (Path(shutil.copy(p, folder / p.name)) for p in (binary["onnx"], binary["sidecar"]))
    meta = json.loads(sidecar.read_text())
    opts = predict_opts(onnx, binary["data"] / "images", tmp_path / "out", backend="onnxruntime")
    del meta["preprocessing"]["to_unit_range"]["float"]  # as an older export might lack
    sidecar.write_text(json.dumps(meta))
    train_unet.predict(opts)
    assert "note: model.json" not in capsys.readouterr().out
    meta["preprocessing"]["normalize"]["mean"] = [0.5, 0.5, 0.5]
    meta["mask"]["logit"] = 1.5
    sidecar.write_text(json.dumps(meta))
    train_unet.predict({**opts, "output": str(tmp_path / "out2")})
    assert ("note: model.json's mask.logit, preprocessing.normalize.mean differ from what its config gives (edited by "
            "hand?): predict goes by its config, as the model was trained, not by those, so the masks are as without "
            "the edit; export again to make them agree") in capsys.readouterr().out


def test_a_full_disk_during_export_is_said_as_such(binary, tmp_path, monkeypatch, capsys):
    """No space left while the exporter wrote the .onnx read 'torch.onnx cannot export arch=Unet ...'."""
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(torch.onnx, "export", full)
    code = train_unet.main(["export", f"checkpoint={binary['ckpt']}", f"output={tmp_path / 'e' / 'model.onnx'}"])
    err = capsys.readouterr().err
    assert code == 2 and "No space left on device): free disk space there" in err and "cannot export arch" not in err
    assert f"error: cannot write the ONNX model into {tmp_path / 'e'} (No space left on device)" in err  # where


def test_exporting_an_exported_model_says_so(binary, tmp_path):
    """export checkpoint=model.onnx said the file was 'not a readable checkpoint ... or cut short in a copy'."""
    with pytest.raises(train_unet.UserError, match=r"model.onnx is already an exported model: give the PyTorch "
                                                   r"checkpoint \(.pt\) to export$"):
        export(binary["onnx"], tmp_path / "again")
    assert not (tmp_path / "again").exists()


@pytest.mark.parametrize("command", ["predict", "predict_onnxruntime", "export"])
def test_a_training_runs_config_json_given_as_the_checkpoint_names_the_checkpoint_beside_it(binary, tmp_path,
                                                                                            command):
    """predict called it an exported model; with backend=onnxruntime added, as told, 'not a sidecar... export
    again', which could not help."""
    record = Path(binary["ckpt"]).parent / "config.json"
    assert record.is_file()
    best = re.escape(str(record.parent / 'best.pt'))
    message = (rf"^checkpoint={re.escape(str(record))} is the config.json a training run writes, not a model: "
               + (rf"give the model.onnx that python train_unet.py export checkpoint={best} writes$"
                  if command == "predict_onnxruntime" else rf"give checkpoint={best}$"))  # onnxruntime refused the .pt
    with pytest.raises(train_unet.UserError, match=message):
        if command == "export":
            export(record, tmp_path / "e")
        else:
            backend = {"backend": "onnxruntime"} if command.endswith("onnxruntime") else {}
            train_unet.predict(predict_opts(record, binary["data"] / "images", tmp_path / "out", **backend))
    assert not (tmp_path / "out").exists() and not (tmp_path / "e").exists()


def test_predict_batch_takes_an_exported_model(binary, hw):
    """load_exported's OnnxModel has no torch layers: predict_batch's check of the cfg raised AttributeError."""
    model, cfg = train_unet.load_exported(binary["onnx"], hw)
    image = train_unet.read_image(sorted((binary["data"] / "images").glob("*.png"))[0], 3)
    torch_model, torch_cfg = train_unet.load_model(binary["ckpt"], hw)
    fp32 = train_unet.decide_precision(hw, use_amp=False)
    want = train_unet.predict_batch(torch_model, [image], torch_cfg, fp32, hw)[0]
    assert np.array_equal(train_unet.predict_batch(model, [image], cfg, fp32, hw)[0], want)


def test_the_predict_command_export_prints_can_be_pasted_where_the_path_has_spaces(binary, tmp_path, capsys):
    """'checkpoint=/tmp/my data/deploy/model.onnx', pasted, gave predict two arguments."""
    out = tmp_path / "my models" / "dep loy"
    export(binary["ckpt"], out)
    command = capsys.readouterr().out.split("predict with it: ")[1].strip()
    assert shlex.split(command)[:5] == ["python", "train_unet.py", "predict", "backend=onnxruntime",
                                        f"checkpoint={out / 'model.onnx'}"]


def test_onnxruntime_predict_of_a_missing_or_renamed_export_says_what_is_missing(binary, tmp_path):
    """checkpoint= a path that is not there, without .onnx (the default's checkpoints/best.pt too), read 'give
    checkpoint=model.onnx (python train_unet.py export checkpoint=<that path> writes it)'; a renamed pair's
    .json said its model.onnx was not found, without saying why or what to give."""
    def onnx_predict(checkpoint):
        train_unet.predict(predict_opts(checkpoint, binary["data"] / "images", tmp_path / "out", backend="onnxruntime"))
    gone = tmp_path / "deploy" / "model"
    one_line_error(onnx_predict, gone, match=rf"^checkpoint={re.escape(str(gone))} not found: give the \.onnx file")
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    shutil.copy(binary["onnx"], renamed / "seg.onnx")
    shutil.copy(binary["sidecar"], renamed / "seg.json")
    one_line_error(onnx_predict, renamed / "seg.json",
                   match=rf"^exported model {re.escape(str(renamed / 'model.onnx'))} not found \(its name in "
                         rf"seg\.json\): give checkpoint={re.escape(str(renamed / 'seg.onnx'))}$")
    onnx_predict(renamed / "seg.onnx")  # as told
    assert len(list((tmp_path / "out").glob("*.png"))) == len(list((binary["data"] / "images").iterdir()))


def test_the_sidecar_gives_the_smallest_side_the_graph_takes(binary, make_cfg):
    """The sidecar said 'any multiples of 32' for PAN, whose graph failed in onnxruntime at 32x32 (user report)."""
    assert json.loads(Path(binary["sidecar"]).read_text())["input"]["height_width"] == "any multiples of 32"
    pan = train_unet.validate_config({**make_cfg(), "arch": "PAN", "image_size": 128})
    least = train_unet.smallest_model_side(pan)
    assert least > 32 and train_unet.input_sides(pan) == f"any multiples of 32, each at least {least}"


def test_a_deeply_nested_json_given_as_the_checkpoint_is_still_one_line(binary, tmp_path):
    """Review: check_not_run_record parsed it and raised RecursionError, a traceback."""
    odd = tmp_path / "odd.json"
    odd.write_text("[" * 200000)
    with pytest.raises(train_unet.UserError, match="is an exported model: add backend=onnxruntime"):
        train_unet.predict(predict_opts(odd, binary["data"] / "images", tmp_path / "out"))
    with pytest.raises(train_unet.UserError, match=r"odd.json is not readable JSON \(RecursionError\): export again"):
        train_unet.predict(predict_opts(odd, binary["data"] / "images", tmp_path / "out", backend="onnxruntime"))


def test_a_corrupt_onnx_file_is_one_line(binary, tmp_path, hw):
    bad = tmp_path / "model.onnx"
    bad.write_bytes(b"\x08\x07garbage" * 50)
    with pytest.raises(train_unet.UserError, match="onnxruntime cannot load") as info:
        train_unet.onnx_session(bad, hw)
    assert "\n" not in str(info.value)


def test_the_torch_backend_given_an_exported_model_says_which_backend(binary, tmp_path):
    with pytest.raises(train_unet.UserError, match="add backend=onnxruntime"):
        train_unet.predict(predict_opts(binary["onnx"], binary["data"] / "images", tmp_path / "out"))
    with pytest.raises(train_unet.UserError, match="backend='tensorrt' is not allowed"):
        train_unet.predict(predict_opts(binary["onnx"], binary["data"] / "images", tmp_path / "out",
                                        backend="tensorrt"))


@pytest.mark.parametrize("missing", ["onnxruntime", "onnx"])
def test_without_onnxruntime_export_and_its_predict_say_what_to_install(missing, binary, tmp_path, monkeypatch,
                                                                         capsys):
    monkeypatch.setitem(sys.modules, missing, None)
    code = train_unet.main(["export", f"checkpoint={binary['ckpt']}", f"output={tmp_path / 'out'}"])
    err = capsys.readouterr().err
    other = {"onnx": "onnxruntime", "onnxruntime": "onnx"}[missing]  # installed: not named (it was, as missing)
    # onnx alone missing: predict backend=onnxruntime runs without it (it said that needed onnx too)
    who = "export and backend=onnxruntime need it" if missing == "onnxruntime" else "export needs it"
    assert code == 2 and err == (f"error: {missing} not installed ({who}, training does not): pip install "
                                 f"{missing}\n") and other not in err.replace("onnxruntime", "")
    if missing == "onnx":
        assert train_unet.predict(predict_opts(binary["onnx"], binary["data"] / "images", tmp_path / "o",
                                               backend="onnxruntime"))["failed"] == []
    if missing == "onnxruntime":
        with pytest.raises(train_unet.UserError, match="pip install onnxruntime"):
            train_unet.predict(predict_opts(binary["onnx"], binary["data"] / "images", tmp_path / "o",
                                            backend="onnxruntime"))


def test_the_trainer_imports_and_trains_without_onnx_packages(tmp_path, make_cfg, monkeypatch):
    blocked = "import sys; sys.modules.update(onnx=None, onnxruntime=None); import train_unet; print('ok')"
    done = subprocess.run([sys.executable, "-c", blocked], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
    monkeypatch.setitem(sys.modules, "onnx", None)
    monkeypatch.setitem(sys.modules, "onnxruntime", None)
    result = train_unet.train(make_cfg(max_train_images=4, image_size=32, batch_size=2))
    assert len(result["history"]) == 1


def test_the_numpy_deployment_example_gives_predicts_masks_without_torch(binary, tmp_path):
    """tools/onnx_predict.py (numpy, OpenCV, onnxruntime; torch unimportable) reads only the sidecar and
    the graph, and writes the masks predict backend=onnxruntime writes: 8-bit RGB, gray and 16-bit images."""
    import tifffile

    images = write_odd_images(tmp_path / "in", binary["data"], [(45, 77), (100, 50), (131, 33), (7, 10)])
    eight_bit = cv2.imread(str(images[0][0]))
    gray = cv2.cvtColor(cv2.resize(eight_bit, (40, 60)), cv2.COLOR_BGR2GRAY)
    cv2.imwrite(str(tmp_path / "in" / "gray_60x40.png"), gray)
    cv2.imwrite(str(tmp_path / "in" / "deep_50x90.png"), cv2.resize(eight_bit, (90, 50)).astype(np.uint16) * 257)
    # MinIsWhite TIFFs (0 for white): OpenCV shows an 8-bit one inverted, as viewers do, but not a 16-bit one,
    # which the tool predicted from the stored values, its masks unlike predict's; BigTIFF too
    for name, depth, big in (("white8.tif", 1, False), ("white16.tif", 257, False), ("white16big.tif", 257, True)):
        tifffile.imwrite(tmp_path / "in" / name, (255 - gray).astype(np.uint8 if depth == 1 else np.uint16) * depth,
                         photometric="miniswhite", bigtiff=big)
    train_unet.predict(predict_opts(binary["onnx"], tmp_path / "in", tmp_path / "predict", backend="onnxruntime"))
    done = run_tool(binary["sidecar"], tmp_path / "in", tmp_path / "numpy")
    assert done.returncode == 0, done.stderr[-2000:]
    want, got = read_masks(tmp_path / "predict"), read_masks(tmp_path / "numpy")
    assert set(got) == set(want) and len(want) == 9
    assert np.array_equal(want["white8.png"], want["gray_60x40.png"]) and (want["gray_60x40.png"] > 0).any()
    assert (want["white16.png"] == want["gray_60x40.png"]).mean() > 0.98  # resized in float, not as uint8
    for name in want:
        assert np.array_equal(got[name], want[name]), f"{name}: {int((got[name] != want[name]).sum())} pixels differ"


def run_tool(sidecar, source, output, disk_full_for=None):
    """tools/onnx_predict.py in a process where torch cannot be imported; disk_full_for: a mask's name whose
    write fails as on a full disk (ENOSPC)."""
    tool = str(ROOT / "tools" / "onnx_predict.py")
    full = ("import errno, pathlib; write = pathlib.Path.write_bytes; pathlib.Path.write_bytes = lambda self, data: "
            f"(_ for _ in ()).throw(OSError(errno.ENOSPC, 'No space left on device')) if self.name.startswith("
            f"{'.' + str(disk_full_for) + '.tmp'!r}) else write(self, data); ") if disk_full_for else ""
    run = ("import runpy, sys; sys.modules.update(torch=None, train_unet=None, segmentation_models_pytorch=None); "
           f"{full}sys.argv = ['onnx_predict.py'] + sys.argv[1:]; runpy.run_path({tool!r}, run_name='__main__')")
    return subprocess.run([sys.executable, "-c", run, str(sidecar), str(source), str(output)], capture_output=True,
                          text=True, timeout=300)


def test_the_numpy_tool_refuses_a_mismatched_or_cut_pair_and_common_slips_in_one_line(binary, patch, tmp_path):
    """A patch-mode .onnx beside a fit-mode sidecar gave fit-preprocessed masks, unsaid (predict checks the
    SHA-256); the .onnx given for the .json, an input folder not there and a cut-short .onnx were tracebacks."""
    pair = tmp_path / "pair"
    pair.mkdir()
    shutil.copy(patch["onnx"], pair / "model.onnx")
    shutil.copy(binary["sidecar"], pair / "model.json")
    images = binary["data"] / "images"
    cut = tmp_path / "cut"
    cut.mkdir()
    shutil.copy(binary["sidecar"], cut / "model.json")
    (cut / "model.onnx").write_bytes(Path(binary["onnx"]).read_bytes()[:1000])
    for args, said in [((pair / "model.json", images), "model.onnx is not the model its sidecar belongs to (its "
                                                          "SHA-256 differs): keep each export's .onnx and .json"),
                       ((cut / "model.json", images), "model.onnx is cut short: 1000 of the "),
                       ((binary["onnx"], images), f"is the model; give its sidecar, the .json export wrote beside it: "
                                                  f"{binary['sidecar']}"),
                       ((binary["sidecar"], tmp_path / "nothere"), "nothere not found: give an image, or a folder")]:
        done = run_tool(*args, tmp_path / "out")
        assert done.returncode == 1 and done.stderr.startswith("error: ") and said in done.stderr, done.stderr
        assert done.stderr.count("\n") == 1 and not (tmp_path / "out").exists()
    flip = tmp_path / "flip"  # a run that predicts with tta=flip: the tool's masks are without it, said
    flip.mkdir()
    shutil.copy(binary["onnx"], flip / "model.onnx")
    meta = json.loads(Path(binary["sidecar"]).read_text())
    (flip / "model.json").write_text(json.dumps({**meta, "config": {**meta["config"], "tta": "flip"}}))
    done = run_tool(flip / "model.json", images, tmp_path / "out")
    assert done.returncode == 0 and "note: the export's run validated with tta=flip; this tool predicts each " \
        "image once, without it (train_unet.py predict backend=onnxruntime tta=flip applies it)" in done.stderr


def test_the_numpy_tool_refuses_a_mask_file_name_for_its_output_and_a_folder_without_images(binary, tmp_path):
    """output=m.png became a folder holding the masks, and a folder without images (only hidden ones, or a
    folder named like one) made the output folder and said '0 mask(s)', exit status 0; predict refuses both."""
    empty = tmp_path / "empty"
    (empty / "x.png").mkdir(parents=True)
    shutil.copy(sorted((binary["data"] / "images").iterdir())[0], empty / "._a.png")
    for source, output, said in [(binary["data"] / "images", tmp_path / "m.png", f"error: {tmp_path / 'm.png'} names "
                                  f"a file, but this tool writes one <stem>.png mask per image into the folder given: "
                                  f"give a folder, e.g. {tmp_path / 'm'}\n"),
                                 (empty, tmp_path / "out", f"error: no images (.png, .jpg, .jpeg, .tif, .tiff, .bmp) "
                                  f"in {empty}: give a folder of images, or one\n")]:
        done = run_tool(binary["sidecar"], source, output)
        assert done.returncode == 1 and done.stderr == said and not output.exists()


def test_the_numpy_tool_skips_what_it_cannot_read_and_never_overwrites_a_mask(binary, tmp_path):
    """One unreadable file stopped the tool at it, the images after it unpredicted; a multi-page TIFF would
    have given its first page's mask; a.jpg beside a.png wrote one a.png for both. Now unreadable files are
    named and skipped (exit status 1), and a shared stem is refused before anything is written."""
    import tifffile

    folder = tmp_path / "in"
    folder.mkdir()
    image = cv2.imread(str(sorted((binary["data"] / "images").iterdir())[0]))
    (folder / "a_broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    tifffile.imwrite(folder / "b_stack.tif", np.stack([image[..., 0]] * 4), photometric="minisblack")
    cv2.imwrite(str(folder / "c_fine.png"), image)
    done = run_tool(binary["sidecar"], folder, tmp_path / "out")
    assert done.returncode == 1 and sorted(p.name for p in (tmp_path / "out").iterdir()) == ["c_fine.png"]
    assert "skipped" in done.stderr and "a_broken.png" in done.stderr
    assert "b_stack.tif: a multi-page TIFF" in done.stderr
    assert "1 mask(s) -> " in done.stdout and "2 image(s) skipped" in done.stdout
    cv2.imwrite(str(folder / "c_fine.jpg"), image)
    done = run_tool(binary["sidecar"], folder, tmp_path / "out2")
    assert done.returncode != 0 and "c_fine.jpg and c_fine.png would both write c_fine.png" in done.stderr
    assert not (tmp_path / "out2").exists()


def test_the_numpy_tool_reads_signed_and_float64_tiffs_as_predict_and_skips_a_depth_opencv_cuts(binary, tmp_path):
    """An int16 or float64 TIFF for an RGB model was a traceback (cv2.cvtColor: 'Unsupported depth'), every
    image after it left without a mask; a 16-bit grey-and-alpha TIFF, which OpenCV reads as 8-bit, got the
    8-bit rule's masks, unlike predict's in 13% of pixels, unsaid. Without onnxruntime: one line, not a
    traceback; OpenCV's own log line no longer comes before the tool's."""
    import tifffile

    folder = tmp_path / "in"
    folder.mkdir()
    rgb = cv2.imread(str(sorted((binary["data"] / "images").iterdir())[0]))[..., ::-1]
    grey = cv2.cvtColor(np.ascontiguousarray(rgb), cv2.COLOR_RGB2GRAY)
    tifffile.imwrite(folder / "a_int16.tif", grey.astype(np.int16) * 100 - 12000)
    tifffile.imwrite(folder / "b_float64.tif", rgb.astype(np.float64) / 255, photometric="rgb")
    cv2.imwrite(str(folder / "d_fine.png"), rgb[..., ::-1])
    train_unet.predict(predict_opts(binary["onnx"], folder, tmp_path / "predict", backend="onnxruntime"))
    tifffile.imwrite(folder / "c_grey_alpha.tif", np.dstack([grey.astype(np.uint16) * 16, np.full_like(grey, 4095,
                     np.uint16)]), photometric="minisblack", extrasamples=[2])
    done = run_tool(binary["sidecar"], folder, tmp_path / "numpy")
    assert done.returncode == 1 and "Traceback" not in done.stderr and "[ERROR" not in done.stderr, done.stderr
    assert f"skipped {folder / 'c_grey_alpha.tif'}: OpenCV cuts its 16-bit samples to 8 bits as it reads them " \
           f"(a TIFF of grey and alpha?): train_unet.py predict backend=onnxruntime checkpoint=model.onnx reads " \
           f"it" in done.stderr
    assert "3 mask(s) -> " in done.stdout and "1 image(s) skipped" in done.stdout
    want, got = read_masks(tmp_path / "predict"), read_masks(tmp_path / "numpy")
    assert sorted(got) == sorted(want) == ["a_int16.png", "b_float64.png", "d_fine.png"]
    for name in want:
        assert np.array_equal(got[name], want[name]), f"{name}: {int((got[name] != want[name]).sum())} pixels differ"
    tool = str(ROOT / "tools" / "onnx_predict.py")
    done = subprocess.run([sys.executable, "-c", f"import runpy, sys; sys.modules['onnxruntime'] = None; "
                           f"sys.argv = ['onnx_predict.py', 'a', 'b', 'c']; runpy.run_path({tool!r}, "
                           f"run_name='__main__')"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and done.stderr == "error: onnxruntime not installed (this tool runs the export " \
                                                   "with it): pip install onnxruntime\n"


def test_the_numpy_tool_makes_a_colour_tiff_grey_for_a_grey_model_as_predict_does(tmp_path_factory, tmp_path):
    """A grey model's 3-channel int16 TIFF: OpenCV's own grey of it wrapped around (-29905 to 27464), and a
    float TIFF's min/max was its grey's, not its colours': masks unlike predict's, unsaid. Now colour TIFFs are
    made grey as train_unet.py makes them (after scaling), other files as OpenCV makes them, as predict does."""
    root = tmp_path_factory.mktemp("grey")
    ckpt, data = train_tiny(root, in_channels=1)
    sidecar = export(ckpt, root / "export" / "model.onnx")["sidecar"]
    folder = tmp_path / "in"
    folder.mkdir()
    rgb = cv2.imread(str(sorted((data / "images").iterdir())[0]))[..., ::-1]
    wide = rgb.astype(np.int32) * 256 - 32768  # a colour image over the whole int16 range, dark to bright
    tifffile.imwrite(folder / "a_int16.tif", wide.astype(np.int16), photometric="rgb")
    tifffile.imwrite(folder / "b_uint16.tif", (wide + 32768).astype(np.uint16), photometric="rgb")
    tifffile.imwrite(folder / "c_float32.tif", rgb.astype(np.float32) * np.float32([1, 2, 4]), photometric="rgb")
    tifffile.imwrite(folder / "d_uint8.tif", rgb, photometric="rgb")
    tifffile.imwrite(folder / "e_grey16.tif", (wide[..., 1] + 32768).astype(np.uint16), photometric="minisblack")
    cv2.imwrite(str(folder / "f_colour.png"), rgb[..., ::-1])
    cv2.imwrite(str(folder / "g_colour16.png"), (wide[..., ::-1] + 32768).astype(np.uint16))
    train_unet.predict(predict_opts(sidecar.with_suffix(".onnx"), folder, tmp_path / "predict", backend="onnxruntime"))
    done = run_tool(sidecar, folder, tmp_path / "numpy")
    assert done.returncode == 0, done.stderr[-2000:]
    want, got = read_masks(tmp_path / "predict"), read_masks(tmp_path / "numpy")
    assert sorted(got) == sorted(want) and len(want) == 7
    assert all(0 < (want[name] > 0).mean() < 1 for name in ("a_int16.png", "c_float32.png"))  # both sides
    for name in want:
        assert np.array_equal(got[name], want[name]), f"{name}: {int((got[name] != want[name]).sum())} pixels differ"


def test_the_numpy_tool_skips_a_tiff_stored_plane_by_plane_that_opencv_misreads(binary, tmp_path):
    """A 16-bit RGB TIFF stored plane by plane (PlanarConfiguration 2, as some microscopes and GIS tools write):
    OpenCV read other pixels' values for it, and the tool wrote that mask, unlike predict's, unsaid. 8-bit RGB
    planes OpenCV reads right: still predicted, equal to predict's."""
    folder = tmp_path / "in"
    folder.mkdir()
    rgb = cv2.imread(str(sorted((binary["data"] / "images").iterdir())[0]))[..., ::-1]
    planes = np.moveaxis(rgb, -1, 0)
    tifffile.imwrite(folder / "a_planes16.tif", planes.astype(np.uint16) * 257, photometric="rgb",
                     planarconfig="separate")
    tifffile.imwrite(folder / "b_planes_rgba.tif", np.concatenate([planes, planes[:1] * 0 + 255]), photometric="rgb",
                     planarconfig="separate", extrasamples=[2])
    tifffile.imwrite(folder / "c_planes8.tif", planes, photometric="rgb", planarconfig="separate")
    train_unet.predict(predict_opts(binary["onnx"], folder, tmp_path / "predict", backend="onnxruntime"))
    done = run_tool(binary["sidecar"], folder, tmp_path / "numpy")
    assert done.returncode == 1 and "1 mask(s) -> " in done.stdout and "2 image(s) skipped" in done.stdout
    for name, samples in (("a_planes16.tif", 3), ("b_planes_rgba.tif", 4)):
        assert f"skipped {folder / name}: OpenCV misreads its {samples} channels stored as separate planes " \
               f"(PlanarConfiguration 2) but for 8-bit RGB: train_unet.py predict backend=onnxruntime " \
               f"checkpoint=model.onnx reads it" in done.stderr, done.stderr
    got, want = read_masks(tmp_path / "numpy"), read_masks(tmp_path / "predict")
    assert list(got) == ["c_planes8.png"] and np.array_equal(got["c_planes8.png"], want["c_planes8.png"])
    assert (want["a_planes16.png"] == want["c_planes8.png"]).mean() > 0.98  # predict reads them right (tifffile)


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16])
def test_the_numpy_tool_reads_a_tiff_as_stored_whatever_its_orientation_tag_as_predict_does(binary, tmp_path,
                                                                                              dtype):
    """OpenCV turns a TIFF by its Orientation tag, whatever the flags; train_unet.py reads TIFFs as stored: a
    mirrored or upside-down one's mask was mirrored, unlike predict's, unsaid. Those turned by 90 degrees
    OpenCV cannot read: skipped and named (a palette one, which predict too leaves to OpenCV, as OpenCV turns it)."""
    folder = tmp_path / "in"
    folder.mkdir()
    rgb = cv2.imread(str(sorted((binary["data"] / "images").iterdir())[0]))[..., ::-1]
    rgb = np.ascontiguousarray(rgb[:, : rgb.shape[1] * 3 // 4]).astype(dtype) * (257 if dtype is np.uint16 else 1)
    for orientation in range(1, 9):
        tifffile.imwrite(folder / f"o{orientation}.tif", rgb, photometric="rgb",
                         extratags=[(274, 3, 1, orientation, True)])
    train_unet.predict(predict_opts(binary["onnx"], folder, tmp_path / "predict", backend="onnxruntime"))
    done = run_tool(binary["sidecar"], folder, tmp_path / "numpy")
    assert done.returncode == 1 and "4 mask(s) -> " in done.stdout and "4 image(s) skipped" in done.stdout
    assert f"skipped {folder / 'o6.tif'}: OpenCV reads a TIFF whose Orientation tag turns it by 90 degrees (6) " \
           f"turned, or not at all: train_unet.py predict backend=onnxruntime checkpoint=model.onnx reads it" in \
           done.stderr
    got, want = read_masks(tmp_path / "numpy"), read_masks(tmp_path / "predict")
    assert sorted(got) == ["o1.png", "o2.png", "o3.png", "o4.png"] and len(want) == 8
    assert not np.array_equal(want["o1.png"], want["o1.png"][:, ::-1])  # a mirrored mask would differ
    for name in got:
        assert np.array_equal(got[name], want[name]), f"{name}: {int((got[name] != want[name]).sum())} pixels differ"


def test_the_numpy_tool_skips_a_tiled_turned_tiff_and_a_tiff_cut_short_in_one_line(binary, tmp_path):
    """A tiled 8-bit TIFF with Orientation 2: OpenCV mirrors each tile on its own, and the flip of the whole
    left a mask unlike predict's, unsaid. A TIFF cut short before its directory (a partial copy of what
    cv2.imwrite writes, its directory last) stopped the tool with a traceback (struct.error), every image after
    it unpredicted. Both are skipped and named; a tiled TIFF as stored is read as predict reads it."""
    folder = tmp_path / "in"
    folder.mkdir()
    rgb = cv2.resize(cv2.imread(str(sorted((binary["data"] / "images").iterdir())[0])), (64, 64))[..., ::-1]
    tifffile.imwrite(folder / "a_tiled_mirrored.tif", rgb, photometric="rgb", tile=(16, 16),
                     extratags=[(274, 3, 1, 2, True)])
    tifffile.imwrite(folder / "b_tiled.tif", rgb, photometric="rgb", tile=(16, 16))
    cv2.imwrite(str(tmp_path / "whole.tif"), rgb[..., ::-1])
    data = (tmp_path / "whole.tif").read_bytes()
    (folder / "c_cut.tif").write_bytes(data[:len(data) // 2])
    done = run_tool(binary["sidecar"], folder, tmp_path / "numpy")
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert "1 mask(s) -> " in done.stdout and "2 image(s) skipped" in done.stdout
    assert f"skipped {folder / 'a_tiled_mirrored.tif'}: OpenCV reads a tiled TIFF whose Orientation tag (2) " \
           f"mirrors or turns it tile by tile: " in done.stderr and f"skipped {folder / 'c_cut.tif'}: " in done.stderr
    (folder / "a_tiled_mirrored.tif").unlink()
    (folder / "c_cut.tif").unlink()
    train_unet.predict(predict_opts(binary["onnx"], folder, tmp_path / "predict", backend="onnxruntime"))
    got, want = read_masks(tmp_path / "numpy"), read_masks(tmp_path / "predict")
    assert list(got) == list(want) == ["b_tiled.png"] and np.array_equal(got["b_tiled.png"], want["b_tiled.png"])


def test_the_numpy_tool_skips_a_damaged_jpeg_and_reads_a_cameras_filler_as_predict_does(binary, tmp_path):
    """A JPEG cut short (a partial copy) or damaged in its middle: libjpeg decodes it into made-up pixels and
    prints a line that names no file; the tool wrote its mask. Now skipped and named, as predict refuses it;
    filler before the end marker (a camera's) and a trailer after it are whole images, predicted as predict's."""
    folder = tmp_path / "in"
    folder.mkdir()
    source = cv2.imread(str(sorted((binary["data"] / "images").iterdir())[0]))
    data = cv2.imencode(".jpg", cv2.resize(source, (64, 48)))[1].tobytes()
    damaged = bytearray(data)
    for i in range(len(data) // 3, len(data) // 3 + 100):
        damaged[i] ^= 0x33
    for name, content in [("a_cut.jpg", data[:len(data) // 2]), ("b_damaged.jpg", bytes(damaged)),
                          ("c_filler.jpg", data[:-2] + b"\x00" * 5 + data[-2:]), ("d_whole.jpg", data),
                          ("e_trailer.jpg", data + b"\x00" * 7 + b"ftypmp42" + bytes(range(256)))]:
        (folder / name).write_bytes(content)
    done = run_tool(binary["sidecar"], folder, tmp_path / "numpy")
    assert done.returncode == 1 and "3 mask(s) -> " in done.stdout and "2 image(s) skipped" in done.stdout
    assert f"skipped {folder / 'a_cut.jpg'}: a damaged JPEG: libjpeg says 'Premature end of JPEG file' and fills " \
           f"what it cannot read with made-up pixels: replace it with an intact copy\n" in done.stderr
    assert f"skipped {folder / 'b_damaged.jpg'}: a damaged JPEG: libjpeg says 'Corrupt JPEG data: " in done.stderr
    assert len(done.stderr.splitlines()) == 2, done.stderr  # libjpeg's own lines not among them
    (folder / "a_cut.jpg").unlink()
    (folder / "b_damaged.jpg").unlink()
    train_unet.predict(predict_opts(binary["onnx"], folder, tmp_path / "predict", backend="onnxruntime"))
    got, want = read_masks(tmp_path / "numpy"), read_masks(tmp_path / "predict")
    assert sorted(got) == sorted(want) == ["c_filler.png", "d_whole.png", "e_trailer.png"]
    for name in want:
        assert np.array_equal(got[name], want[name]), f"{name}: {int((got[name] != want[name]).sum())} pixels differ"
    # filler is told from damage as train_unet.py tells it (this libjpeg may not warn of the filler above)
    level = cv2.utils.logging.getLogLevel()  # the tool quiets OpenCV's log on import: not for the other tests
    jpeg_filler = runpy.run_path(str(ROOT / "tools" / "onnx_predict.py"))["jpeg_filler"]
    cv2.utils.logging.setLogLevel(level)
    warning = b"Corrupt JPEG data: 5 extraneous bytes before marker 0xd9"
    for content in (data[:-2] + b"\x00" * 5 + data[-2:], data[:-2] + b"\xff" * 5 + data[-2:],
                    data[:-2] + b"\x00\x00\x12\x00\x00" + data[-2:], data[:-2] + b"\x00" * 4 + data[-2:], data[:40]):
        assert jpeg_filler(warning, content) == train_unet.jpeg_padding(warning, content)
    assert jpeg_filler(warning, data[:-2] + b"\x00" * 5 + data[-2:]) and not jpeg_filler(warning, data[:40])


def test_the_numpy_tool_never_writes_a_mask_beside_predicts_overlay_of_the_image(binary, tmp_path):
    """predict overlay=True, then the tool into the same folder: the masks were replaced, predict's overlays of
    the same images left beside them, a folder holding two runs' results for one image."""
    images = binary["data"] / "images"
    train_unet.predict(predict_opts(binary["onnx"], images, tmp_path / "out", backend="onnxruntime", overlay=True))
    before = {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()}
    done = run_tool(binary["sidecar"], images, tmp_path / "out")
    assert done.returncode == 1 and done.stderr.startswith(f"error: {tmp_path / 'out'} holds ") and \
        "_overlay.png and " in done.stderr and "predict's overlay of an image this tool would write a mask of" \
        in done.stderr and done.stderr.count("\n") == 1, done.stderr
    assert {p.name: p.read_bytes() for p in (tmp_path / "out").iterdir()} == before
    # the tool's own mask of an input named <stem>_overlay is no overlay: a rerun replaces it (review)
    both = tmp_path / "both"
    both.mkdir()
    first = sorted(images.iterdir())[0]
    shutil.copy(first, both / "cell.png")
    shutil.copy(first, both / "cell_overlay.png")
    for _ in range(2):
        done = run_tool(binary["sidecar"], both, tmp_path / "masks")
        assert done.returncode == 0 and "2 mask(s)" in done.stdout, done.stderr
    only = tmp_path / "only"
    only.mkdir()
    shutil.copy(first, only / "cell.png")
    done = run_tool(binary["sidecar"], only, tmp_path / "masks")
    assert done.returncode == 0 and "(1 earlier one(s) replaced)" in done.stdout, done.stderr


def test_the_numpy_tool_never_writes_over_images_or_ground_truth_and_names_a_mask_it_cannot_write(binary,
                                                                                                   tmp_path):
    """The tool wrote its masks over whatever had their names: output= the input folder replaced the images
    with their own masks, output= a data set's masks/ its ground truth, and a mask it failed to write was
    counted as written (cv2.imwrite's False ignored), exit status 0 (user report). Now those are refused
    before anything is written, its own (and predict's) earlier masks are replaced and counted, and a mask
    that cannot be written (a full disk) is named, no half file left, exit status 1."""
    data = tmp_path / "set"
    shutil.copytree(binary["data"], data)
    before = {p: p.read_bytes() for folder in ("images", "masks") for p in (data / folder).iterdir()}
    for output, said in ((data / "images", "holds the input images"), (data / "masks", "with no mark of this tool's")):
        done = run_tool(binary["sidecar"], data / "images", output)
        assert done.returncode != 0 and said in done.stderr and "Traceback" not in done.stderr
    assert {p: p.read_bytes() for folder in ("images", "masks") for p in (data / folder).iterdir()} == before
    first = run_tool(binary["sidecar"], data / "images", tmp_path / "out")
    assert first.returncode == 0 and "earlier" not in first.stdout
    masks = sorted((tmp_path / "out").iterdir())
    assert masks and all(train_unet.written_by_predict(p) for p in masks)  # predict's mark: it moves them aside
    again = run_tool(binary["sidecar"], data / "images", tmp_path / "out")
    assert again.returncode == 0 and f"({len(masks)} earlier one(s) replaced)" in again.stdout
    full = run_tool(binary["sidecar"], data / "images", tmp_path / "out", disk_full_for=masks[0].name)
    assert full.returncode == 1 and f"skipped {data / 'images' / masks[0].stem}" in full.stderr
    assert "No space left on device" in full.stderr and "1 image(s) skipped" in full.stdout
    assert f"({len(masks) - 1} earlier one(s) replaced)" in full.stdout  # the one not written is not counted
    assert sorted((tmp_path / "out").iterdir()) == masks and cv2.imread(str(masks[0])) is not None


@pytest.mark.parametrize("part, name", [("images", ""), ("masks", "seg.onnx"), ("images/sub", "")])
def test_an_export_into_a_data_sets_folder_is_refused(binary, tmp_path, part, name):
    """predict and benchmark refused a data set's images/ and masks/ folders; export wrote model.onnx and
    model.json among the images, and every later training run noted them as entries not read."""
    data = tmp_path / "set"
    shutil.copytree(binary["data"], data)
    (data / part).mkdir(exist_ok=True)
    before = sorted(p.relative_to(data) for p in data.rglob("*"))
    onnx = name or "model.onnx"
    one_line_error(export, binary["ckpt"], data / part / name,
                   match=rf"^output=.*set/{part} (is|is inside .*) a data set's {part[:6]} folder: "
                         rf"{re.escape(onnx)} and "
                         rf"{re.escape(Path(onnx).stem)}\.json would go among its files; choose another output "
                         rf"\(e\.g\. .*deploy/set\)$")
    assert sorted(p.relative_to(data) for p in data.rglob("*")) == before


def test_a_lone_earlier_model_onnx_is_named_alone_when_moved(binary, tmp_path, capsys):
    """A folder holding someone's own model.onnx and no model.json: the move named a model.json too."""
    out = tmp_path / "deploy"
    out.mkdir()
    (out / "model.onnx").write_bytes(b"mine")
    export(binary["ckpt"], out)
    said = capsys.readouterr().out
    assert "the earlier model.onnx moved to " in said and "model.json moved" not in said
    assert [p.read_bytes() for p in (out / "previous").glob("*/model.onnx")] == [b"mine"]


def test_an_earlier_export_is_moved_aside_only_once_the_new_one_passed(binary, patch, tmp_path, monkeypatch):
    """A second export into one folder moves the first model.onnx and model.json, unchanged, to
    previous/<time>/; a second export that fails its check leaves the first in place."""
    out = tmp_path / "deploy"
    export(binary["ckpt"], out)
    first = {name: (out / name).read_bytes() for name in ("model.onnx", "model.json")}
    monkeypatch.setattr(train_unet, "check_export", lambda *a: (_ for _ in ()).throw(train_unet.UserError("differs")))
    with pytest.raises(train_unet.UserError, match="differs"):
        export(patch["ckpt"], out)
    assert {name: (out / name).read_bytes() for name in first} == first and not (out / "previous").exists()
    monkeypatch.undo()
    export(patch["ckpt"], out)
    [moved] = list((out / "previous").iterdir())
    assert {name: (moved / name).read_bytes() for name in first} == first
    assert json.loads((out / "model.json").read_text())["config"]["num_classes"] == 3


def test_an_export_whose_sidecar_cannot_be_written_leaves_the_earlier_export_in_place(binary, tmp_path,
                                                                                     monkeypatch):
    """A full disk at the sidecar's write moved the earlier model.onnx and model.json to previous/ unsaid, and
    the error named no file: predict with the earlier export then read 'not found' (user report)."""
    out = tmp_path / "deploy"
    export(binary["ckpt"], out)
    first = {name: (out / name).read_bytes() for name in ("model.onnx", "model.json")}

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(train_unet, "write_json", full)
    message = one_line_error(export, binary["ckpt"], out, match=r"cannot write .*deploy/model\.json \(No space left "
                                                                  r"on device\): free disk space there")
    assert message.endswith("nothing written or moved")
    assert sorted(p.name for p in out.iterdir()) == ["model.json", "model.onnx"]
    assert {name: (out / name).read_bytes() for name in first} == first


@pytest.mark.parametrize("output, match", [
    ("dot/.onnx", r"output=.*dot/\.onnx names no file before \.onnx: give .*dot/model\.onnx, or the folder"),
    ("run/config.onnx", r"output=.*run/config\.onnx would write its sidecar as .*run/config\.json, the name of a "
                        r"training run's record: choose another name \(.*run/model\.onnx\)"),
    ("x/foo.txt", r"output=.*x/foo\.txt names a \.txt file, where export writes an \.onnx file and its \.json: give "
                  r".*x/foo\.onnx, or a folder$")])  # it made a folder foo.txt/ (user test)
def test_an_export_name_predict_would_refuse_or_a_resume_overwrite_is_refused(binary, tmp_path, output, match):
    """output=dot/.onnx wrote a pair predict refused ('give checkpoint=model.onnx'); output=<run>/config.onnx
    moved the run's config.json aside, and the run's resume then wrote over the sidecar (user report)."""
    one_line_error(export, binary["ckpt"], tmp_path / output, match=match)
    assert not (tmp_path / output).parent.exists()


def test_an_onnx_name_with_a_trailing_slash_is_refused_unless_that_folder_is_there(binary, tmp_path):
    """output=x/model.onnx/ made a folder model.onnx holding model.onnx and model.json (a gap a session left)."""
    output = f"{tmp_path / 'x' / 'model.onnx'}/"
    with pytest.raises(train_unet.UserError, match=r"names a folder model\.onnx/, where export would write .*x/model"
                                                   r"\.onnx/model\.onnx: give output=.*x/model\.onnx for the file, "
                                                   r"or a folder name without \.onnx$"):
        train_unet.export_path(output)
    assert not (tmp_path / "x").exists()
    (tmp_path / "x" / "model.onnx").mkdir(parents=True)  # a folder of that name, made on purpose: it is used
    assert train_unet.export_path(output) == tmp_path / "x" / "model.onnx" / "model.onnx"
    assert train_unet.export_path(str(tmp_path / "y.onnx")) == tmp_path / "y.onnx"


def test_an_existing_folder_named_like_an_onnx_file_is_exported_into_not_moved_aside(binary, tmp_path):
    """output=x.onnx, x.onnx a folder (no trailing slash): export moved the folder, and the user's file in it,
    into previous/ as if it were an earlier export, and wrote the file x.onnx in its place."""
    folder = tmp_path / "x.onnx"
    folder.mkdir()
    (folder / "notes.txt").write_text("mine")
    written = export(binary["ckpt"], folder)
    assert written["onnx"] == folder / "model.onnx" and (folder / "model.json").is_file()
    assert (folder / "notes.txt").read_text() == "mine" and not (tmp_path / "previous").exists()


def test_an_export_whose_sidecar_name_is_an_earlier_pairs_moves_both_of_that_pair(binary, tmp_path, capsys):
    """m.ONNX beside an earlier m.onnx: both write m.json, and only m.json moved aside, leaving m.onnx without
    its sidecar (user test)."""
    out = tmp_path / "x2"
    export(binary["ckpt"], out / "m.onnx")
    first = {name: (out / name).read_bytes() for name in ("m.onnx", "m.json")}
    export(binary["ckpt"], out / "m.ONNX")
    (moved,) = (out / "previous").iterdir()
    assert {name: (moved / name).read_bytes() for name in first} == first
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == ["m.ONNX", "m.json"]


def test_an_export_folder_is_read_by_the_name_its_sidecar_gives(binary, tmp_path):
    """export output=folder/model.ONNX, then predict checkpoint=folder: 'exported model folder/model.onnx not
    found (its name in model.json)', while model.json names model.ONNX (user test)."""
    out = tmp_path / "up"
    export(binary["ckpt"], out / "model.ONNX")
    onnx_path, meta = train_unet.read_sidecar(out)
    assert onnx_path == out / "model.ONNX" and meta["onnx"] == "model.ONNX"
    (out / "model.json").unlink()  # the folder's model.onnx without its sidecar: that is what is missing
    (out / "model.ONNX").rename(out / "model.onnx")
    missing = re.escape(str(out / "model.json"))
    with pytest.raises(train_unet.UserError, match=rf"^{missing} not found: export writes it beside model.onnx"):
        train_unet.read_sidecar(out)


def test_predict_says_when_the_exported_checkpoint_has_changed_since(binary, tmp_path, capsys):
    """An export kept in a run's folder named that folder's best.pt as its source after a new run had replaced it
    (the masks differ): the sidecar keeps the file's identity and predict says it has changed."""
    ckpt = tmp_path / "run" / "best.pt"
    ckpt.parent.mkdir()
    shutil.copy(binary["ckpt"], ckpt)
    export(ckpt, tmp_path / "run")
    run = predict_opts(tmp_path / "run" / "model.onnx", binary["data"] / "images", tmp_path / "out",
                       backend="onnxruntime")
    capsys.readouterr()
    train_unet.predict(run)
    line = next(l for l in capsys.readouterr().out.splitlines() if "exported from" in l)
    assert line.endswith(f"exported from {ckpt}")
    ckpt.write_bytes(ckpt.read_bytes() + b"\0")  # another model now (size and time differ)
    train_unet.predict(run)
    assert f"exported from {ckpt} (changed since the export, as by a later run in its folder: this export keeps " \
           f"the model it held then)" in capsys.readouterr().out
    ckpt.unlink()  # gone, as on the machine an export is copied to: nothing to say
    train_unet.predict(run)
    assert next(l for l in capsys.readouterr().out.splitlines() if "exported from" in l).endswith(f"from {ckpt}")


def test_onnxruntime_predict_notes_a_tta_its_validation_averaged(binary, tmp_path, capsys):
    """The sidecar kept no tta: predict with the .pt said 'validated with tta=flip ...: add tta=flip', with its
    export nothing. A sidecar from before it holds none, and predict says nothing of it."""
    state = torch.load(binary["ckpt"], map_location="cpu", weights_only=True)
    state["config"]["tta"] = "flip"
    torch.save(state, tmp_path / "flip.pt")
    export(tmp_path / "flip.pt", tmp_path / "deploy")
    run = predict_opts(tmp_path / "deploy" / "model.onnx", binary["data"] / "images", tmp_path / "out",
                       backend="onnxruntime")
    capsys.readouterr()
    train_unet.predict(run)
    assert f"note: {tmp_path / 'deploy' / 'model.onnx'} was validated with tta=flip (the average of 4 views); " \
           f"predict runs tta=none: add tta=flip" in capsys.readouterr().out
    train_unet.predict({**run, "tta": "flip"})
    assert "validated with" not in capsys.readouterr().out
    sidecar = tmp_path / "deploy" / "model.json"
    meta = json.loads(sidecar.read_text())
    del meta["config"]["tta"]
    sidecar.write_text(json.dumps(meta))
    train_unet.predict(run)
    assert "validated with" not in capsys.readouterr().out


def test_onnxruntime_runs_on_the_gpu_the_device_names(monkeypatch):
    """device=cuda:1 put torch on GPU 1 and onnxruntime's CUDA provider, given no device_id, on GPU 0."""
    import types

    import onnxruntime

    seen = []
    monkeypatch.setattr(onnxruntime, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"])
    monkeypatch.setattr(onnxruntime, "InferenceSession", lambda path, options, providers: seen.append(providers))
    for device, index in (("cuda:1", 1), ("cuda", 0)):
        train_unet.onnx_session("model.onnx", types.SimpleNamespace(kind="cuda", device=torch.device(device)))
        assert seen.pop() == [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
    train_unet.onnx_session("model.onnx", types.SimpleNamespace(kind="cpu", device=torch.device("cpu")))
    assert seen.pop() == ["CPUExecutionProvider"]
