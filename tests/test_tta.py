"""Test-time augmentation (tta=none|flip|d4): the views of a batch go through the model in ONE forward,
their logits are mapped back to the input's orientation and averaged as fp32 logits, the same way in
every inference path (fit validation, the sliding window, predict).

Numerics are checked with small models whose answer is known: a 1x1 convolution commutes with every
turn and mirror, so TTA must change nothing; a 3x3 convolution does not, so TTA must change its logits,
to the average of the views as reference_tta computes them here, independently of train_unet.
"""
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest
import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import train_unet  # noqa: E402
from train_unet import TTA, TTA_VIEWS, UserError  # noqa: E402

FP32 = train_unet.Precision(torch.float32, False, "test")
SIZE = 32
TTA_ON = ("flip", "d4")


@pytest.fixture(scope="module")
def hw():
    return train_unet.detect_hardware("cpu")


def conv_model(kernel, classes=1, seed=0):
    """1x1: commutes with turns and mirrors. 3x3 (random weights, 'same' padding): does not."""
    torch.manual_seed(seed)
    layers = [nn.Conv2d(3, classes, 1)] if kernel == 1 else \
        [nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, classes, 3, padding=1)]
    return nn.Sequential(*layers).eval()


def identity(t):
    return t


def reference_views(name):
    """(forth, back) pairs, written apart from train_unet: flip = the 4 mirror images (each its own
    inverse), d4 = the 4 quarter turns and the 4 quarter turns of the transposed image."""
    if name == "none":
        return [(identity, identity)]
    mirrors = [identity] + [lambda t, dims=dims: t.flip(dims) for dims in ((-1,), (-2,), (-2, -1))]
    if name == "flip":
        return [(m, m) for m in mirrors]
    turns = [(lambda t, k=k: torch.rot90(t, k, (-2, -1)), lambda t, k=k: torch.rot90(t, -k, (-2, -1)))
             for k in range(4)]
    transposed = [(lambda t, k=k: torch.rot90(t.transpose(-2, -1), k, (-2, -1)),
                   lambda t, k=k: torch.rot90(t, -k, (-2, -1)).transpose(-2, -1)) for k in range(4)]
    return turns + transposed


class ReferenceTTA(nn.Module):
    """A model wrapped in the reference TTA: each view in its own forward, mapped back, averaged."""

    def __init__(self, model, name):
        super().__init__()
        self.model, self.name = model, name

    def forward(self, x):
        return torch.stack([back(self.model(forth(x))) for forth, back in reference_views(self.name)]).mean(0)


class CountingModel(nn.Module):
    """Records the batch size of every forward."""

    def __init__(self, model):
        super().__init__()
        self.model, self.batches = model, []

    def forward(self, x):
        self.batches.append(x.shape[0])
        return self.model(x)


def window_cfg(**overrides):
    """The keys the sliding window reads, at a 32 px window."""
    return {**train_unet.CONFIG, "image_size": SIZE, "tile_overlap": 0.5, "tile_batch_size": 3, "num_classes": 1,
            "in_channels": 3, "channels_last": False, "patch_scale": 1.0, "data_mode": "patch", **overrides}


def rng_image(h, w, seed=0):
    return np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)


# ---------------------------------------------------------------------------------------------------
# a. the views: which they are, and that each is undone exactly
# ---------------------------------------------------------------------------------------------------
def test_the_choices_are_the_views():
    assert set(train_unet.CHOICES["tta"]) == set(TTA_VIEWS) == {"none", "flip", "d4"}
    assert train_unet.CONFIG["tta"] == train_unet.PREDICT_CONFIG["tta"] == "none"


@pytest.mark.parametrize("name", ["none", "flip", "d4"])
def test_the_views_are_the_mirrors_or_the_symmetries_of_the_square(name):
    """expand stacks exactly the reference's views (all distinct), view-major: row v * B + i."""
    x = torch.randn(2, 3, 5, 5)
    views = TTA(name).expand(x).chunk(len(TTA(name)))
    expected = [forth(x) for forth, _ in reference_views(name)]
    assert len(views) == len(expected) == {"none": 1, "flip": 4, "d4": 8}[name]
    assert all(any(torch.equal(v, e) for e in expected) for v in views)
    assert len({v.numpy().tobytes() for v in views}) == len(views)


@pytest.mark.parametrize("name,shape", [("flip", (6, 10)), ("d4", (7, 7))])
def test_each_view_is_undone_exactly(name, shape):
    """A model that returns its input: the merged logits ARE the input, to the bit (whole-number values
    make the average exact). A view mapped back the wrong way would move pixels."""
    x = torch.randint(-50, 50, (2, 3, *shape)).float()
    tta = TTA(name)
    assert torch.equal(tta.merge(tta.expand(x)), x)
    for turns, mirrored in TTA_VIEWS[name]:
        assert torch.equal(train_unet.from_view(train_unet.to_view(x, turns, mirrored), turns, mirrored), x)


def test_tta_none_adds_no_op():
    x, logits = torch.randn(2, 3, 8, 8), torch.randn(2, 1, 8, 8, dtype=torch.bfloat16)
    assert TTA("none").expand(x) is x and TTA("none").merge(logits) is logits


def test_merge_averages_in_fp32():
    tta = TTA("flip")
    logits = tta.expand(torch.randn(2, 1, 8, 8)).to(torch.bfloat16)
    assert tta.merge(logits).dtype == torch.float32


def test_d4_on_a_non_square_input_is_a_clear_error_and_flip_takes_any_shape():
    with pytest.raises(UserError, match=r"tta=d4 .* square .* 32x64: use tta=flip"):
        TTA("d4").expand(torch.zeros(1, 3, 32, 64))
    assert TTA("flip").expand(torch.zeros(1, 3, 32, 64)).shape == (4, 3, 32, 64)


# ---------------------------------------------------------------------------------------------------
# b. every inference path: an equivariant model is unchanged, another one gets the views' average
# ---------------------------------------------------------------------------------------------------
def fit_logits(model, cfg, hw, x):
    """Fit validation's logits of a batch of image_size squares (fit_pieces, as evaluate calls it)."""
    y = torch.zeros(x.shape[0], *x.shape[2:], dtype=torch.long)
    with torch.no_grad():
        (logits, *_), = list(train_unet.fit_pieces(model, (x, y), cfg, FP32, hw))
    return logits


@pytest.mark.parametrize("name", TTA_ON)
def test_fit_validation_logits(name, make_cfg, hw):
    x = torch.randn(3, 3, SIZE, SIZE)
    cfg, plain = make_cfg(image_size=SIZE, tta=name), make_cfg(image_size=SIZE)
    equivariant = conv_model(1)
    assert torch.allclose(fit_logits(equivariant, cfg, hw, x), fit_logits(equivariant, plain, hw, x), atol=1e-5)
    other = conv_model(3)
    with_tta, without = fit_logits(other, cfg, hw, x), fit_logits(other, plain, hw, x)
    assert (with_tta - without).abs().max() > 1e-3  # TTA did something: the test can fail
    assert torch.allclose(with_tta, fit_logits(ReferenceTTA(other, name), plain, hw, x), atol=1e-5)


@pytest.mark.parametrize("name", TTA_ON)
def test_sliding_window_logits(name, hw):
    """Tiles of a 70x90 image (3 per forward, the last batch short): TTA inside each tile batch equals
    the sliding window of the TTA-averaged model."""
    image = rng_image(70, 90)
    equivariant = conv_model(1)
    a = train_unet.predict_logits(equivariant, image, window_cfg(tta=name), FP32, hw)
    assert torch.allclose(a, train_unet.predict_logits(equivariant, image, window_cfg(), FP32, hw), atol=1e-5)
    other = conv_model(3)
    with_tta = train_unet.predict_logits(other, image, window_cfg(tta=name), FP32, hw)
    assert (with_tta - train_unet.predict_logits(other, image, window_cfg(), FP32, hw)).abs().max() > 1e-3
    reference = train_unet.predict_logits(ReferenceTTA(other, name), image, window_cfg(), FP32, hw)
    assert torch.allclose(with_tta, reference, atol=1e-5)


@pytest.mark.parametrize("name", TTA_ON)
def test_the_views_share_each_forward_of_the_sliding_window(name, hw):
    image = rng_image(70, 90)  # 4 x 5 tiles of 32 at overlap 0.5 ... counted by tile_starts
    tiles = len(train_unet.tile_starts(70, SIZE, 0.5)) * len(train_unet.tile_starts(90, SIZE, 0.5))
    model = CountingModel(conv_model(3))
    train_unet.predict_logits(model, image, window_cfg(tta=name, tile_batch_size=3), FP32, hw)
    views = len(TTA_VIEWS[name])
    assert model.batches == [views * min(3, tiles - i) for i in range(0, tiles, 3)]


def test_validation_reports_the_iou_of_the_averaged_logits(make_cfg, hw):
    """evaluate() with tta=d4 gives the loss and IoU of the reference TTA model, and differs from no TTA."""
    cfg = make_cfg(image_size=SIZE, tta="d4")
    torch.manual_seed(1)
    x = torch.randn(4, 3, SIZE, SIZE)
    y = (torch.randn(4, SIZE, SIZE) > 0).long()
    model, loss_fn = conv_model(3), train_unet.SegLoss(1)
    with_tta = train_unet.evaluate(model, [(x, y)], loss_fn, FP32, hw, cfg)
    reference = train_unet.evaluate(ReferenceTTA(model, "d4"), [(x, y)], loss_fn, FP32, hw, make_cfg(image_size=SIZE))
    plain = train_unet.evaluate(model, [(x, y)], loss_fn, FP32, hw, make_cfg(image_size=SIZE))
    assert with_tta["iou"] == pytest.approx(reference["iou"], abs=1e-6)
    assert with_tta["loss"] == pytest.approx(reference["loss"], abs=1e-5)
    assert with_tta["loss"] != pytest.approx(plain["loss"], abs=1e-4)


def test_training_validates_with_the_views_in_one_forward(make_cfg, monkeypatch, capsys):
    """tta=flip in training: every validation forward holds 4x the images of the val batch (the model
    in eval mode), training forwards are untouched, and the banner says so."""
    seen, build = [], train_unet.build_model

    def counting_build(cfg):
        model = build(cfg)
        model.register_forward_pre_hook(lambda module, args: seen.append((module, module.training, args[0].shape[0])))
        return model
    monkeypatch.setattr(train_unet, "build_model", counting_build)
    result = train_unet.train(make_cfg(tta="flip", max_train_images=4, batch_size=2))
    assert 0 <= result["history"][0]["val_iou"] <= 1
    # the trained model's forwards only: the start-up's size check runs a model of its own at batch 1, once a
    # process (model_takes_side, cached): the test failed run alone, passed after a test that had run it
    trained = {id(module) for module, training, _ in seen if training}
    train_batches = {n for module, training, n in seen if training}
    val_batches = [n for module, training, n in seen if not training and id(module) in trained]
    assert train_batches == {2} and val_batches and all(n % 4 == 0 and n <= 4 * 4 for n in val_batches)
    assert "tta=flip: 4 views" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------------
# c. predict
# ---------------------------------------------------------------------------------------------------
def train_tiny(root, **overrides):
    data = train_unet.generate_shapes_dataset(root / "data", count=8, size=64, num_classes=1)
    cfg = dict(data_dir=str(data), checkpoint_dir=str(root / "ckpt"), image_size=SIZE, epochs=1,
               max_train_images=4, batch_size=2, use_amp=False, encoder_name="resnet18",
               encoder_weights=None, device="cpu", progress=False, num_workers=0, cpu_probe=False)
    train_unet.train({**cfg, **overrides})
    return root / "ckpt" / "last.pt", data


@pytest.fixture(scope="module")
def fit_model(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("fit"))


@pytest.fixture(scope="module")
def patch_model(tmp_path_factory):
    return train_tiny(tmp_path_factory.mktemp("patch"), data_mode="patch", tile_batch_size=2)


def write_images(folder, data, sizes):
    folder.mkdir(parents=True, exist_ok=True)
    src = cv2.imread(str(sorted((Path(data) / "images").glob("*.png"))[0]), cv2.IMREAD_COLOR)
    for i, (h, w) in enumerate(sizes):
        assert cv2.imwrite(str(folder / f"img{i}.png"), cv2.resize(src, (w, h)))


def counted_predict(monkeypatch, **opts):
    """predict() with the loaded model's forward batch sizes recorded."""
    batches, load = [], train_unet.load_model

    def counting_load(checkpoint, hw):
        model, cfg = load(checkpoint, hw)
        model.register_forward_pre_hook(lambda module, args: batches.append(args[0].shape[0]))
        return model, cfg
    monkeypatch.setattr(train_unet, "load_model", counting_load)
    result = train_unet.predict({**train_unet.PREDICT_CONFIG, "device": "cpu", "use_amp": False,
                                 "progress": False, "cpu_probe": False, **opts})
    return result, batches


@pytest.mark.parametrize("name", TTA_ON)
def test_predict_fit_mode_writes_masks_with_the_views_in_one_batch(name, fit_model, tmp_path, monkeypatch, capsys):
    ckpt, data = fit_model
    sizes = [(45, 77), (50, 50), (20, 33)]
    write_images(tmp_path / "in", data, sizes)
    result, batches = counted_predict(monkeypatch, checkpoint=str(ckpt), input=str(tmp_path / "in"),
                                      output=str(tmp_path / "out"), batch_size=8, tta=name)
    assert result["predicted"] == 3 and not result["failed"]
    assert batches == [3 * len(TTA_VIEWS[name])]  # three images, all their views: one forward
    for i, (h, w) in enumerate(sizes):
        mask = cv2.imread(str(tmp_path / "out" / f"img{i}.png"), cv2.IMREAD_UNCHANGED)
        assert mask.shape == (h, w) and set(np.unique(mask)) <= {0, 255}
    assert f"tta={name}" in capsys.readouterr().out


@pytest.mark.parametrize("name", TTA_ON)
def test_predict_patch_mode_takes_the_views_inside_each_tile_batch(name, patch_model, tmp_path, monkeypatch):
    ckpt, data = patch_model
    write_images(tmp_path / "in", data, [(70, 90)])
    result, batches = counted_predict(monkeypatch, checkpoint=str(ckpt), input=str(tmp_path / "in"),
                                      output=str(tmp_path / "out"), tta=name)
    tiles = len(train_unet.tile_starts(70, SIZE, 0.25)) * len(train_unet.tile_starts(90, SIZE, 0.25))
    views = len(TTA_VIEWS[name])
    assert result["predicted"] == 1 and batches == [views * min(2, tiles - i) for i in range(0, tiles, 2)]
    assert cv2.imread(str(tmp_path / "out" / "img0.png"), cv2.IMREAD_UNCHANGED).shape == (70, 90)


def test_a_batch_size_given_to_predict_a_patch_model_is_named_as_ignored(patch_model, tmp_path, monkeypatch, capsys):
    """tile_overlap= given for a fit-mode checkpoint had a note; batch_size= for a patch-mode one, which the
    sliding window's tile_batch_size replaces, had none. Given on the command line, or in a dict away from
    PREDICT_CONFIG's value; the default in a dict copied from PREDICT_CONFIG is not 'given'."""
    ckpt, data = patch_model
    write_images(tmp_path / "in", data, [(70, 90)])
    args = [f"checkpoint={ckpt}", f"input={tmp_path / 'in'}", "device=cpu", "use_amp=False", "progress=False",
            "cpu_probe=False"]
    said = f"note: batch_size ignored: {ckpt} was trained with data_mode=patch (each image through a sliding " \
           f"window): tile_batch_size= sets the tiles per forward, 2 here"
    for output, extra in (("a", ["batch_size=8"]), ("b", ["batch_size=3"]), ("c", [])):
        assert train_unet.main(["predict", *args, f"output={tmp_path / output}", *extra]) == 0
        assert (said in capsys.readouterr().out) == bool(extra)
    _, batches = counted_predict(monkeypatch, checkpoint=str(ckpt), input=str(tmp_path / "in"),
                                 output=str(tmp_path / "d"), batch_size=3)
    assert said in capsys.readouterr().out and max(batches) == 2  # the tiles per forward, not batch_size's 3
    counted_predict(monkeypatch, checkpoint=str(ckpt), input=str(tmp_path / "in"), output=str(tmp_path / "e"))
    assert "batch_size ignored" not in capsys.readouterr().out
    assert train_unet.predict_keys_given({"intensity_range": np.array([0, 4095]), "batch_size": 8}) == {
        "intensity_range"}  # an array compared as the list it becomes (it raised numpy's 'truth value ... ambiguous')


def test_predict_batch_with_tta_is_the_averaged_model(fit_model, hw):
    """predict_batch's masks with tta=flip are the masks of the reference TTA model's logits (the head's
    bias moved so the logits straddle 0 and the comparison is not vacuous)."""
    ckpt, data = fit_model
    model, cfg = train_unet.load_model(ckpt, hw)
    images = [rng_image(40, 56, seed=s) for s in range(2)]
    x = torch.stack([train_unet.image_tensor(train_unet.build_transforms(cfg, train=False)(image=i)["image"])
                     for i in images])
    with torch.no_grad():
        model.segmentation_head[0].bias -= ReferenceTTA(model, "flip")(x).median()
        reference = ReferenceTTA(model, "flip")(x)
    masks = train_unet.predict_batch(model, images, {**cfg, "tta": "flip"}, FP32, hw)
    expected = [train_unet.logits_to_mask(logit, 1)
                for logit, image in zip(reference, images)
                for logit in train_unet.original_size(logit[None].float(), *image.shape[:2], cfg)]
    assert all(0 < m.mean() < 1 for m in expected)
    assert all((m != e).mean() < 1e-3 for m, e in zip(masks, expected))


@pytest.mark.parametrize("mode,batch", [("fit", 8), ("patch", 2)])
def test_the_cpu_probe_times_predict_at_a_forward_of_all_views(mode, batch, fit_model, hw):
    """predict's layout/precision probe times what one forward holds: images (or tiles) x views."""
    _, cfg = train_unet.load_model(fit_model[0], hw)
    cfg = {**cfg, "data_mode": mode, "tile_batch_size": 2}
    opts = {**train_unet.PREDICT_CONFIG, "batch_size": 8}
    for name, views in (("none", 1), ("flip", 4), ("d4", 8)):
        assert train_unet.predict_setting({**cfg, "tta": name}, opts)["batch_size"] == batch * views


def test_a_checkpoint_from_before_tta_predicts_without_it(fit_model, tmp_path, hw):
    ckpt, _ = fit_model
    state = torch.load(ckpt, weights_only=True)
    del state["config"]["tta"]
    torch.save(state, tmp_path / "old.pt")
    assert train_unet.load_model(tmp_path / "old.pt", hw)[1]["tta"] == "none"


# ---------------------------------------------------------------------------------------------------
# d. errors
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("command", [["predict"], []])
def test_a_bad_tta_value_is_a_one_line_error(command, capsys):
    assert train_unet.main(command + ["tta=flips"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "tta='flips' is not allowed: use one of none, flip, d4" in err


def test_tta_none_on_the_command_line_is_the_word_not_python_none():
    assert train_unet.parse_overrides(["tta=none"])["tta"] == "none"
    assert train_unet.parse_overrides(["tta=d4"], defaults=train_unet.PREDICT_CONFIG)["tta"] == "d4"


def test_the_measurement_tool_runs(fit_model, capsys):
    """tools/tta_measure.py (the README's TTA figures): one round on the tiny checkpoint, a row per tta."""
    sys.path.insert(0, str(ROOT / "tools"))
    import tta_measure

    assert tta_measure.main([f"checkpoint={fit_model[0]}", "rounds=1", "batch_size=4"]) == 0
    out = capsys.readouterr().out
    assert all(f"| `{name}`" in out for name in TTA_VIEWS) and "val IoU" in out


@pytest.mark.parametrize("predict_tta, noted", [("none", True), ("d4", True), ("flip", False)])
def test_predict_notes_when_its_views_differ_from_the_validated_ones(predict_tta, noted, fit_model, tmp_path,
                                                                     monkeypatch, capsys):
    """A checkpoint validated with tta=flip: predict at its default (none) or with other views says that the
    validation IoU describes other masks, and how to get them; with the same views it says nothing."""
    ckpt, data = fit_model
    state = train_unet.load_checkpoint(ckpt)
    state["config"] = {**state["config"], "tta": "flip"}
    train_unet.save_checkpoint(tmp_path / "flip.pt", state)
    write_images(tmp_path / "in", data, [(32, 32)])
    result, _ = counted_predict(monkeypatch, checkpoint=str(tmp_path / "flip.pt"), input=str(tmp_path / "in"),
                                output=str(tmp_path / "out"), tta=predict_tta)
    out = capsys.readouterr().out
    assert result["predicted"] == 1
    notes = [line for line in out.splitlines() if "was validated with tta=flip" in line]
    assert len(notes) == int(noted)
    if noted:
        assert f"predict runs tta={predict_tta}" in notes[0] and "add tta=flip" in notes[0]
