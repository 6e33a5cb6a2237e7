"""Losses for imbalanced data (issue 23, item 5): focal, Lovasz, Tversky and + combinations from smp's own
implementations, class_weights (a list, or auto from the training masks), every term in fp32 under any
autocast and blind to ignored pixels, exact under gradient accumulation where it was, and resumable."""
import json
import os
import re
from pathlib import Path

import cv2
import numpy as np
import pytest
import segmentation_models_pytorch as smp
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

import train_unet
from train_unet import IGNORE_INDEX, SegLoss, UserError

pytestmark = pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")

# Every term alone, today's default, and the combinations the issue names.
LOSSES = ["ce", "dice", "focal", "lovasz", "tversky", "dice+ce", "focal+dice", "lovasz+ce", "tversky+focal"]


def one_line_error(fn, *args, match):
    with pytest.raises(UserError, match=match) as info:
        fn(*args)
    assert "\n" not in str(info.value)
    return str(info.value)


def batch(num_classes, size=16, seed=0, void=True):
    """Random logits and targets; with void, a band of ignored pixels (padding or void) in image 0."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(2, num_classes, size, size, generator=g) * 3
    target = torch.randint(0, max(2, num_classes), (2, size, size), generator=g)
    if void:
        target[0, : size // 3] = IGNORE_INDEX
        target[1, :, : size // 4] = IGNORE_INDEX
    return logits, target


def smp_term(term, num_classes, **kwargs):
    """smp's loss for one term, as SegLoss configures it, with smp's own ignore_index."""
    mode = "binary" if num_classes == 1 else "multiclass"
    if term == "focal":
        return smp.losses.FocalLoss(mode, gamma=train_unet.FOCAL_GAMMA, ignore_index=IGNORE_INDEX, **kwargs)
    if term == "tversky":
        return smp.losses.TverskyLoss(mode, ignore_index=IGNORE_INDEX, alpha=train_unet.TVERSKY_ALPHA,
                                      beta=train_unet.TVERSKY_BETA)
    return {"dice": smp.losses.DiceLoss, "lovasz": smp.losses.LovaszLoss}[term](mode, ignore_index=IGNORE_INDEX)


def reference(kind, logits, target, num_classes):
    """The loss from smp's (and torch's, for CE) implementations, term by term, on the real pixels."""
    real = target != IGNORE_INDEX
    total = torch.zeros(())
    for term in kind.split("+"):
        if term == "ce" and num_classes == 1:
            total = total + nn.functional.binary_cross_entropy_with_logits(logits[:, 0][real], target[real].float())
        elif term == "ce":
            total = total + nn.functional.cross_entropy(logits, target, ignore_index=IGNORE_INDEX)
        else:
            total = total + smp_term(term, num_classes)(logits, target.unsqueeze(1) if num_classes == 1 else target)
    return total


# ----------------------------------------------------------------------------------------------------
# smp's own losses, ignored pixels left out by every term
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_classes", [1, 3])
@pytest.mark.parametrize("kind", LOSSES)
def test_each_loss_equals_smps_own_on_the_same_inputs(kind, num_classes):
    logits, target = batch(num_classes)
    torch.testing.assert_close(SegLoss(num_classes, kind)(logits, target), reference(kind, logits, target, num_classes))


@pytest.mark.parametrize("num_classes", [1, 3])
@pytest.mark.parametrize("kind", LOSSES)
def test_ignored_pixels_change_nothing_and_get_no_gradient(kind, num_classes):
    logits, target = batch(num_classes)
    ignored = (target == IGNORE_INDEX).unsqueeze(1).expand_as(logits)
    noisy = torch.where(ignored, 100 * torch.randn_like(logits), logits).requires_grad_()
    loss_fn = SegLoss(num_classes, kind)
    loss = loss_fn(noisy, target)
    torch.testing.assert_close(loss, loss_fn(logits, target), rtol=1e-6, atol=1e-6)
    loss.backward()
    assert torch.isfinite(noisy.grad).all()
    assert not noisy.grad[ignored].any()  # exactly zero: ignored, not merely down-weighted
    assert noisy.grad[~ignored].abs().sum() > 0


@pytest.mark.parametrize("num_classes", [1, 3])
def test_focal_masks_ignored_pixels_exactly_as_smps_ignore_index(num_classes):
    """SegLoss drops ignored pixels from focal without boolean indexing (no device sync); the sum is
    smp's own with ignore_index, which filters them, class weights included: each pixel weighted by its
    class's weight (multi-class: smp's per-class one-vs-rest terms, pixel by pixel, averaged over classes)."""
    logits, target = batch(num_classes, seed=3)
    weights = [0.5, 3.0] if num_classes == 1 else [0.5, 3.0, 1.5]
    real = (target != IGNORE_INDEX).sum()
    for class_weights in (None, weights):
        ours = SegLoss(num_classes, "focal", class_weights).parts(logits, target)[0]
        if class_weights is None:
            smps = smp_term("focal", num_classes, reduction="sum")
            expected = smps(logits, target.unsqueeze(1) if num_classes == 1 else target)
        elif num_classes == 1:  # smp takes no binary class_weights; its alpha = w_fg / (w_bg + w_fg), scaled back up
            alpha = weights[1] / sum(weights)
            expected = sum(weights) * smp_term("focal", 1, reduction="sum", alpha=alpha)(logits, target.unsqueeze(1))
        else:
            pixel_weights = torch.tensor(weights)[target[target != IGNORE_INDEX]]
            expected = sum((smp_term("focal", 1, reduction="none")(
                logits[:, c:c + 1], torch.where(target == IGNORE_INDEX, target, (target == c).long()).unsqueeze(1))
                * pixel_weights).sum() for c in range(num_classes)) / num_classes
        torch.testing.assert_close(ours, expected)
        assert ours / real > 0


@pytest.mark.parametrize("num_classes", [1, 3])
@pytest.mark.parametrize("kind", ["ce", "focal"])
def test_class_weights_follow_one_rule_in_every_weighted_term(kind, num_classes):
    """Ones are no weights, and the weights' scale counts as their ratios do, in CE and focal, binary and
    multi-class alike: smp's multi-class focal divided by the weights' sum, so 5,5,5 trained as no weights
    while binary focal 5,5 and CE 2,2,2 were x5 and x2."""
    logits, target = batch(num_classes, seed=5)
    weights = [0.5, 3.0] if num_classes == 1 else [0.5, 3.0, 1.5]
    pixels = lambda w: SegLoss(num_classes, kind, w).parts(logits, target)[0]  # noqa: E731
    torch.testing.assert_close(pixels([1.0] * len(weights)), pixels(None))
    torch.testing.assert_close(pixels([5.0 * w for w in weights]), 5 * pixels(weights))
    torch.testing.assert_close(pixels([5.0] * len(weights)), 5 * pixels(None))


class RecordOps(TorchDispatchMode):
    """Every aten op dispatched, with whether it took a boolean index (a data-dependent shape: on a GPU
    the host waits for the device to learn it)."""

    def __init__(self):
        super().__init__()
        self.ops, self.bool_indexed = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        flat = [a for arg in args for a in (arg if isinstance(arg, (list, tuple)) else [arg])]
        if "index" in str(func) and any(isinstance(a, torch.Tensor) and a.dtype == torch.bool for a in flat):
            self.bool_indexed.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("num_classes", [1, 3])
def test_no_term_but_lovasz_makes_the_host_wait_for_the_device(num_classes, monkeypatch):
    """CE, Dice, Tversky and focal, weighted or not, run without boolean indexing (smp's focal with
    ignore_index uses it), nonzero or a tensor->Python conversion; Lovasz (smp's, sorting every pixel)
    does, which the README says."""
    conversions = []

    def counted(name, real):
        def conversion(self, *args):
            conversions.append(name)
            return real(self, *args)
        return conversion
    for name in ("item", "__bool__", "__float__", "__int__", "tolist"):
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    logits, target = batch(num_classes)
    weights = [0.5, 3.0, 1.5][:max(2, num_classes)]
    for kind in ("ce+dice+tversky+focal", "lovasz"):
        conversions.clear()
        logits.requires_grad_()
        with RecordOps() as seen:
            SegLoss(num_classes, kind, weights)(logits, target).backward()
        blocking = seen.bool_indexed + [op for op in seen.ops if "nonzero" in op or "masked_select" in op]
        if kind == "lovasz":
            assert blocking or conversions
        else:
            assert not blocking and not conversions, (blocking, conversions)
    with RecordOps() as seen:  # the test sees what it must: smp's own ignore_index indexes by a mask
        smp_term("focal", num_classes)(logits, target.unsqueeze(1) if num_classes == 1 else target)
    assert seen.bool_indexed


# ----------------------------------------------------------------------------------------------------
# fp32 under any autocast: smp #463 (a Dice sum over 512^2 overflows fp16)
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_classes", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_loss_is_finite_under_fp16_and_bf16_autocast_at_512(dtype, num_classes):
    """A 512x512 all-foreground batch, its logits in the autocast dtype (what the model gives) and the
    loss taken inside autocast: finite, equal to the fp32 loss, gradients finite."""
    g = torch.Generator().manual_seed(0)
    low = torch.randn(2, num_classes, 512, 512, generator=g).to(dtype)
    target = torch.ones(2, 512, 512, dtype=torch.long)  # all foreground (class 1)
    for kind in LOSSES:
        loss_fn = SegLoss(num_classes, kind)
        logits = low.clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            loss = loss_fn(logits, target)
        assert loss.dtype == torch.float32 and torch.isfinite(loss), (kind, loss)
        torch.testing.assert_close(loss, loss_fn(low.float(), target), rtol=1e-5, atol=1e-5)
        loss.backward()
        assert torch.isfinite(logits.grad).all(), kind


# ----------------------------------------------------------------------------------------------------
# Gradient accumulation: per-pixel terms (CE, focal) stay exact
# ----------------------------------------------------------------------------------------------------
def accumulated_grads(num_classes, kind, weights, splits):
    x, y = train_unet_padded_batch(num_classes)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, num_classes, 1))
    run = train_unet.Run(model, model, None, None, None, train_unet.Precision(torch.float32, False, "test"),
                         loss_fn=SegLoss(num_classes, kind, weights))
    hw = train_unet.detect_hardware("cpu")
    batches = [(x[i:j], y[i:j]) for i, j in zip(splits, splits[1:])]
    for group, group_valid in train_unet.accumulation_groups(batches, len(batches), "cpu"):
        for xb, yb in group:
            train_unet.forward_backward(run, xb, yb, hw, len(group), group_valid)
    return [p.grad.clone() for p in model.parameters()]


def train_unet_padded_batch(num_classes):
    """4 images, the first two mostly padding (a small image padded to a square)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 3, 16, 16, generator=g)
    y = torch.randint(0, max(2, num_classes), (4, 16, 16), generator=g)
    y[:2, 3:, :] = IGNORE_INDEX
    y[:2, :, 5:] = IGNORE_INDEX
    return x, y


@pytest.mark.parametrize("num_classes", [1, 3])
@pytest.mark.parametrize("kind, weighted", [("focal", False), ("focal", True), ("focal+ce", True)])
def test_accumulated_focal_gradients_equal_one_big_batch_on_padded_images(num_classes, kind, weighted):
    weights = ([0.5, 4.0] if num_classes == 1 else [0.5, 4.0, 2.0]) if weighted else None
    big = accumulated_grads(num_classes, kind, weights, [0, 4])
    for a, b in zip(big, accumulated_grads(num_classes, kind, weights, [0, 2, 4])):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)


# ----------------------------------------------------------------------------------------------------
# class_weights: a list, or auto from the training masks
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_classes", [1, 3])
def test_class_weights_weight_each_pixel_of_ce_by_its_class(num_classes):
    logits, target = batch(num_classes, seed=1)
    weights = [0.5, 3.0] if num_classes == 1 else [0.5, 3.0, 1.5]
    real = target != IGNORE_INDEX
    w = torch.tensor(weights)[target.clamp(max=max(1, num_classes - 1)) * real]  # each real pixel's weight
    if num_classes == 1:
        per_pixel = nn.functional.binary_cross_entropy_with_logits(logits[:, 0], (target == 1).float(),
                                                                   reduction="none")
    else:
        per_pixel = nn.functional.cross_entropy(logits, target.clamp(max=2), reduction="none")
    expected = (w * per_pixel)[real].sum() / real.sum()  # weighted sum over the real pixels / their count
    torch.testing.assert_close(SegLoss(num_classes, "ce", weights)(logits, target), expected)
    for kind in LOSSES:  # equal weights are no weights, for every term
        ones = [1.0] * max(2, num_classes)
        torch.testing.assert_close(SegLoss(num_classes, kind, ones)(logits, target),
                                   SegLoss(num_classes, kind)(logits, target))


def write_masks(root, masks):
    """A data set of the given masks (and grey images)."""
    for sub in ("images", "masks"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    for i, mask in enumerate(masks):
        cv2.imwrite(str(root / "images" / f"m{i}.png"), np.full(mask.shape + (3,), 90, np.uint8))
        cv2.imwrite(str(root / "masks" / f"m{i}.png"), mask.astype(np.uint8))
    return root


@pytest.mark.parametrize("num_classes", [1, 3])
def test_class_weights_auto_is_the_inverse_class_frequency_of_the_training_masks(make_cfg, tmp_path, num_classes):
    """Known pixel counts, train/ and val/ folders: the weights come from the training masks only, void
    left out, with mean pixel weight 1 (w_c = 1 / (K f_c))."""
    counts = np.zeros(max(2, num_classes), np.int64)
    train = []
    for i in range(4):
        mask = np.zeros((32, 32), np.uint8)
        mask[: 4 + 2 * i] = 255 if num_classes == 1 else 1  # foreground / class 1 rows
        if num_classes > 1:
            mask[-3:] = 2  # class 2: 3 rows
            mask[-5:-3] = IGNORE_INDEX  # void: 2 rows
        train.append(mask)
        for value, n in zip(*np.unique(mask, return_counts=True)):
            if value != IGNORE_INDEX or num_classes == 1:
                counts[min(int(value), 1) if num_classes == 1 else int(value)] += n
    root = tmp_path / "known"
    write_masks(root / "train", train)
    write_masks(root / "val", [np.full((32, 32), 255 if num_classes == 1 else 2, np.uint8)] * 2)  # not counted
    cfg = make_cfg(data_dir=str(root), num_classes=num_classes, class_weights="auto", batch_size=2, image_size=32)
    pairs, _ = train_unet.prepare_data(cfg)
    notes = []
    weights = train_unet.run_class_weights(cfg, None, pairs, notes)
    shares = counts / counts.sum()
    assert weights == pytest.approx(1 / (len(counts) * shares), rel=1e-3)
    assert float(np.sum(shares * np.array(weights))) == pytest.approx(1.0, rel=1e-3)  # mean pixel weight 1
    assert "class_weights=auto" in notes[0][1]


def test_absent_classes_get_weight_one():
    expected = [1 / (2 * 0.75), 1.0, 1 / (2 * 0.25)]  # 2 classes present, with shares 75% and 25%
    assert train_unet.inverse_frequency_weights([30, 0, 10]) == pytest.approx(expected, rel=1e-3)


def test_the_data_check_records_mask_counts_and_rechecks_an_entry_without_them(make_cfg, data_dir):
    cfg = make_cfg()
    pairs, _ = train_unet.prepare_data(cfg)
    cache_path = data_dir / train_unet.CHECK_CACHE_NAME
    cache = json.loads(cache_path.read_text())
    mask = os.path.abspath(pairs[0][1])
    decoded = cv2.imread(mask, cv2.IMREAD_UNCHANGED)
    assert cache["files"][mask]["counts"] == np.unique(decoded, return_counts=True)[1].tolist()
    del cache["files"][mask]["counts"]  # an entry from before the counts: checked again, not trusted
    cache_path.write_text(json.dumps(cache))
    train_unet.CHECKED_HERE.clear()
    assert train_unet.class_pixel_counts(pairs, cfg).sum() == decoded.size * len(pairs)  # every pixel, once


# ----------------------------------------------------------------------------------------------------
# One-line errors
# ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("loss", ["dise+ce", "focal+focal", "", "ce+", "bce", "dice,ce"])
def test_a_bad_loss_name_is_a_one_line_error_listing_the_terms(loss):
    message = one_line_error(train_unet.validate_config, {"loss": loss}, match="loss=")
    assert all(term in message for term in train_unet.LOSS_TERMS) and "focal+dice" in message


@pytest.mark.parametrize("loss, hint", [("bce", "ce"), ("dise+ce", "dice+ce"), ("Dice+BCE", "dice+ce"),
                                        ("focl", "focal"), ("dce", "dice"), ("tverski+focal", "tversky+focal"),
                                        ("dice,ce", "dice+ce")])
def test_a_misspelt_loss_gets_a_did_you_mean(loss, hint):
    """loss=bce and loss=dce had only the list of terms, where tta=hflip and logger=tensorbord had a guess."""
    one_line_error(train_unet.validate_config, {"loss": loss}, match=f"^loss='{re.escape(loss)}' is not allowed: did "
                                                                     f"you mean {re.escape(hint)}\\? use terms from")


@pytest.mark.parametrize("loss", ["focal+focal", "ce+bce", "", "softmax", "dice+"])
def test_a_loss_with_no_single_fix_gets_no_guess(loss):
    assert "did you mean" not in one_line_error(train_unet.validate_config, {"loss": loss}, match="loss=")


@pytest.mark.parametrize("num_classes, weights", [
    (1, [5.0]), (1, [1.0, 2.0, 3.0]), (3, [1.0, 2.0]), (1, [-1.0, 1.0]), (1, [0.0, 0.0]), (3, [1, "a", 2]),
    (1, [1.0, float("nan")]),
])
def test_a_bad_weight_list_is_a_one_line_error(num_classes, weights):
    message = one_line_error(train_unet.validate_config, {"class_weights": weights, "num_classes": num_classes},
                             match="class_weights=")
    assert f"{max(2, num_classes)} weights" in message and "auto" in message
    assert ("[background, foreground]" in message) == (num_classes == 1)


def test_class_weights_of_another_type_is_a_one_line_error():
    one_line_error(train_unet.validate_config, {"class_weights": "median"},
                   match="class_weights='median' must be a list of numbers, auto or None")


def test_loss_and_class_weights_parse_from_the_command_line():
    cfg = train_unet.parse_overrides(["loss=focal+dice", "class_weights=1,5"])
    assert cfg["loss"] == "focal+dice" and cfg["class_weights"] == [1.0, 5.0]
    assert train_unet.parse_overrides(["class_weights=auto"])["class_weights"] == "auto"
    assert train_unet.parse_overrides(["class_weights=None"])["class_weights"] is None
    one_line_error(train_unet.parse_overrides, ["class_weights=1,x"], match="class_weights")
    assert train_unet.main(["loss=lovasz+dise"]) == 2


# ----------------------------------------------------------------------------------------------------
# End to end: loss=focal+dice class_weights=auto trains, saves its weights, resumes exactly
# ----------------------------------------------------------------------------------------------------
def test_focal_dice_with_auto_weights_trains_and_resumes_exactly(make_cfg, tmp_path, monkeypatch, interrupt_at):
    def run(name, stop_at=None):
        cfg = make_cfg(loss="focal+dice", class_weights="auto", epochs=2, early_stopping_patience=None,
                       checkpoint_dir=str(tmp_path / name))
        if stop_at:
            real = interrupt_at(stop_at)
            with pytest.raises(KeyboardInterrupt):
                train_unet.train(cfg)
            monkeypatch.setattr(train_unet, "run_epoch", real)
            train_unet.train({**cfg, "resume": True})
        else:
            train_unet.train(cfg)
        return cfg, train_unet.load_checkpoint(Path(cfg["checkpoint_dir"]) / "last.pt")
    cfg, straight = run("straight")
    _, resumed = run("resumed", stop_at=2)
    weights = straight["config"]["class_weights"]
    assert isinstance(weights, list) and len(weights) == 2 and weights[1] > 1 > weights[0]  # small foreground
    assert resumed["config"]["class_weights"] == weights
    assert json.loads((tmp_path / "straight" / "config.json").read_text())["config"]["class_weights"] == weights
    assert all(np.isfinite(r["train_loss"]) and np.isfinite(r["val_loss"]) for r in straight["history"])
    assert [r["train_loss"] for r in straight["history"]] == [r["train_loss"] for r in resumed["history"]]
    for key in straight["model"]:
        assert torch.equal(straight["model"][key], resumed["model"][key]), key
    assert resumed["auto_keys"] == ["class_weights"]  # kept through the resume, which gave auto again
    resume = {**cfg, "resume": True, "epochs": 3, "checkpoint_dir": str(tmp_path / "straight")}
    # the fix names what the run was given, auto, not its list of weights (which the user never typed)
    one_line_error(train_unet.train, {**resume, "class_weights": [1.0, 1.0]}, match=r"\(class_weights=auto\), or")
    one_line_error(train_unet.train, {**resume, "class_weights": None}, match=r"\(class_weights=auto\), or")


def test_a_resumed_auto_weights_run_names_its_weights_in_the_banner(make_cfg, tmp_path, capsys):
    """The first run's banner said 'class_weights=auto -> [...]'; a resume of it said nothing of them."""
    cfg = make_cfg(class_weights="auto", epochs=1, checkpoint_dir=str(tmp_path / "run"))
    train_unet.train(cfg)
    weights = train_unet.load_checkpoint(tmp_path / "run" / "last.pt")["config"]["class_weights"]
    capsys.readouterr()
    train_unet.train({**cfg, "resume": True, "epochs": 2})
    assert f"class_weights=auto -> {weights} (last.pt's" in capsys.readouterr().out


def test_a_run_with_typed_weights_resumed_with_auto_is_refused(make_cfg, tmp_path, capsys):
    """class_weights=1,5 resumed with class_weights=auto trained on with [1, 5] while the banner called them
    'of the training masks as the run began' (auto weighs these masks otherwise): refused, with the list to give."""
    cfg = make_cfg(class_weights=[1.0, 5.0], epochs=1, checkpoint_dir=str(tmp_path / "run"))
    train_unet.train(cfg)
    message = one_line_error(train_unet.train, {**cfg, "resume": True, "epochs": 2, "class_weights": "auto"},
                             match="^cannot resume exactly: ")
    assert "class_weights=[1.0, 5.0]" in message and "(class_weights=1.0,5.0)" in message
    assert len(train_unet.train({**cfg, "resume": True, "epochs": 2})["history"]) == 2  # the list given again


def test_a_checkpoint_from_before_class_weights_resumes(make_cfg, tmp_path):
    cfg = make_cfg(epochs=1)
    train_unet.train(cfg)
    path = Path(cfg["checkpoint_dir"]) / "last.pt"
    state = train_unet.load_checkpoint(path)
    del state["config"]["class_weights"]  # written before the key existed
    torch.save(state, path)
    result = train_unet.train({**cfg, "resume": True, "epochs": 2})
    assert len(result["history"]) == 2
    one_line_error(train_unet.train, {**cfg, "resume": True, "epochs": 3, "class_weights": "auto"},
                   match="without class_weights")


@pytest.mark.parametrize("num_classes, weights", [(3, [0.5, 1.0, 2.0]), (1, [1.0, 3.0])])
@pytest.mark.parametrize("kind", ["dice+ce", "ce", "focal"])
def test_weighted_losses_score_host_logits_of_a_cuda_run(num_classes, weights, kind):
    """Patch-mode validation scores the window's blended logits on the host, while a CUDA run's class
    weights live on the GPU: the weighted CE mixed the two devices and stopped the run at its first
    validation. Checked with fake CUDA tensors (no GPU needed)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        loss = train_unet.SegLoss(num_classes, kind, weights, device="cuda:0")
        assert loss.weights.device.type == "cuda"
        value = loss(torch.randn(2, num_classes, 8, 8), torch.randint(0, max(num_classes, 2), (2, 8, 8)))
        assert value.device.type == "cpu" and value.shape == ()


def test_a_run_resumed_across_the_focal_weights_rule_says_its_loss_changes(make_cfg, make_data, capsys):
    """A multi-class focal run with class_weights, begun when they averaged smp's per-class terms, resumed
    as 'exact' while its loss changed scale (review)."""
    data = make_data("multi", num_classes=3)
    cfg = make_cfg(data_dir=str(data), num_classes=3, loss="focal+dice", class_weights=[1.0, 2.0, 3.0])
    train_unet.train(cfg)
    path = Path(cfg["checkpoint_dir"]) / "last.pt"
    assert train_unet.load_checkpoint(path)["loss_rules"] == train_unet.LOSS_RULES
    capsys.readouterr()
    train_unet.train({**cfg, "epochs": 2, "resume": True})
    assert "focal term averaged its per-class terms" not in capsys.readouterr().out
    state = train_unet.load_checkpoint(path)
    del state["loss_rules"]  # written before the rule
    train_unet.save_checkpoint(path, state)
    train_unet.train({**cfg, "epochs": 3, "resume": True})
    assert "last.pt's focal term averaged its per-class terms by class_weights; from here each pixel is weighted" in \
        capsys.readouterr().out
