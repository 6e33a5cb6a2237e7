"""SegMetric: dataset-level IoU / Dice from a confusion matrix, checked against smp.metrics."""
import math

import pytest
import segmentation_models_pytorch as smp
import torch

import train_unet
from train_unet import SegMetric


def random_batches(num_classes, sizes=(3, 2, 4), hw=(9, 11), seed=0):
    """Several (logits, target) batches of different batch sizes."""
    g = torch.Generator().manual_seed(seed)
    channels = 1 if num_classes == 1 else num_classes
    labels = 2 if num_classes == 1 else num_classes
    return [(torch.randn(n, channels, *hw, generator=g),
             torch.randint(0, labels, (n, *hw), generator=g)) for n in sizes]


def smp_multiclass(logits, target, num_classes):
    pred = logits.argmax(1)
    tp, fp, fn, tn = smp.metrics.get_stats(pred, target, mode="multiclass", num_classes=num_classes)
    per_class = [t.sum(0, keepdim=True) for t in (tp, fp, fn, tn)]
    return {
        "iou": smp.metrics.iou_score(tp, fp, fn, tn, reduction="macro").item(),
        "dice": smp.metrics.f1_score(tp, fp, fn, tn, reduction="macro").item(),
        "per_class_iou": smp.metrics.iou_score(*per_class, reduction="none")[0].tolist(),
        "per_class_dice": smp.metrics.f1_score(*per_class, reduction="none")[0].tolist(),
    }


def smp_binary(logits, target):
    pred = (logits > 0).long()
    tp, fp, fn, tn = smp.metrics.get_stats(pred, target.unsqueeze(1), mode="binary")
    return {"iou": smp.metrics.iou_score(tp, fp, fn, tn, reduction="micro").item(),
            "dice": smp.metrics.f1_score(tp, fp, fn, tn, reduction="micro").item()}


@pytest.mark.parametrize("num_classes", [2, 3, 5])
def test_multiclass_matches_smp_over_the_whole_dataset(num_classes):
    batches = random_batches(num_classes)
    metric = SegMetric(num_classes, "cpu")
    for logits, target in batches:
        metric.update(logits, target)
    got = metric.compute()
    logits = torch.cat([b[0] for b in batches])
    target = torch.cat([b[1] for b in batches])
    want = smp_multiclass(logits, target, num_classes)
    assert got["iou"] == pytest.approx(want["iou"], abs=1e-6)
    assert got["dice"] == pytest.approx(want["dice"], abs=1e-6)
    assert got["per_class_iou"] == pytest.approx(want["per_class_iou"], abs=1e-6)
    assert got["per_class_dice"] == pytest.approx(want["per_class_dice"], abs=1e-6)
    assert len(got["per_class_iou"]) == num_classes


def test_binary_matches_smp_micro():
    batches = random_batches(1)
    metric = SegMetric(1, "cpu")
    for logits, target in batches:
        metric.update(logits, target)
    got = metric.compute()
    want = smp_binary(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    assert got["iou"] == pytest.approx(want["iou"], abs=1e-6)
    assert got["dice"] == pytest.approx(want["dice"], abs=1e-6)
    # binary reports only the foreground class
    assert got["per_class_iou"] == pytest.approx([want["iou"]], abs=1e-6)
    assert got["per_class_dice"] == pytest.approx([want["dice"]], abs=1e-6)


@pytest.mark.parametrize("num_classes", [1, 4])
def test_accumulation_equals_one_update_on_the_concatenation(num_classes):
    """Dataset-level: not the mean of per-batch scores."""
    batches = random_batches(num_classes, sizes=(1, 5, 2, 3), seed=3)
    many, one = SegMetric(num_classes), SegMetric(num_classes)
    for logits, target in batches:
        many.update(logits, target)
    one.update(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    assert torch.equal(many.matrix, one.matrix)
    assert many.compute() == one.compute() or _close_dicts(many.compute(), one.compute())
    # and it differs from averaging per-batch IoUs (so the test above can tell them apart)
    per_batch = []
    for logits, target in batches:
        m = SegMetric(num_classes)
        m.update(logits, target)
        per_batch.append(m.compute()["iou"])
    assert many.compute()["iou"] != pytest.approx(sum(per_batch) / len(per_batch), abs=1e-12)


def _close_dicts(a, b):
    return all(a[k] == pytest.approx(b[k], nan_ok=True) for k in a)


def test_binary_threshold_is_logit_above_zero():
    target = torch.tensor([[[1, 1, 0, 0]]])
    logits = torch.tensor([[[[0.0, 0.1, -0.1, 0.0]]]])  # 0.0 is not foreground
    metric = SegMetric(1)
    metric.update(logits, target)
    tp, fp, fn = metric.counts()
    assert (tp[1].item(), fp[1].item(), fn[1].item()) == (1, 0, 1)
    assert metric.compute()["iou"] == pytest.approx(0.5)
    assert metric.compute()["dice"] == pytest.approx(2 / 3)


def test_absent_class_is_nan_and_left_out_of_the_mean():
    num_classes = 4
    # classes 0 and 1 only, in both target and prediction; 2 predicted once (a false positive)
    target = torch.tensor([[[0, 0, 1, 1], [0, 1, 1, 0]]])
    pred = torch.tensor([[[0, 1, 1, 1], [0, 1, 2, 0]]])
    logits = torch.nn.functional.one_hot(pred, num_classes).permute(0, 3, 1, 2).float()
    metric = SegMetric(num_classes)
    metric.update(logits, target)
    out = metric.compute()
    iou = out["per_class_iou"]
    # class 0: tp 3, fp 0, fn 1 -> 3/4; class 1: tp 3, fp 1, fn 1 -> 3/5; class 2: fp 1 -> 0
    assert iou[0] == pytest.approx(3 / 4)
    assert iou[1] == pytest.approx(3 / 5)
    assert iou[2] == 0.0                      # present in the prediction only: counts, as 0
    assert math.isnan(iou[3])                 # absent from both: NaN
    assert math.isnan(out["per_class_dice"][3])
    assert out["iou"] == pytest.approx((3 / 4 + 3 / 5 + 0.0) / 3)
    dice = [2 * 3 / (6 + 1), 2 * 3 / (6 + 2), 0.0]
    assert out["dice"] == pytest.approx(sum(dice) / 3)


def test_class_only_in_target_counts_as_zero():
    target = torch.tensor([[[0, 2]]])
    pred = torch.tensor([[[0, 0]]])
    logits = torch.nn.functional.one_hot(pred, 3).permute(0, 3, 1, 2).float()
    metric = SegMetric(3)
    metric.update(logits, target)
    out = metric.compute()
    assert out["per_class_iou"][2] == 0.0
    assert math.isnan(out["per_class_iou"][1])
    assert out["iou"] == pytest.approx((0.5 + 0.0) / 2)


def test_binary_all_absent_is_one():
    """No foreground in target or prediction: nothing to find, nothing found -> 1.0."""
    metric = SegMetric(1)
    metric.update(-torch.ones(2, 1, 4, 4), torch.zeros(2, 4, 4, dtype=torch.long))
    out = metric.compute()
    assert out["iou"] == 1.0 and out["dice"] == 1.0
    assert math.isnan(out["per_class_iou"][0])


def test_no_updates_is_one():
    out = SegMetric(3).compute()
    assert out["iou"] == 1.0 and out["dice"] == 1.0
    assert all(math.isnan(v) for v in out["per_class_iou"])


def test_binary_foreground_predicted_but_absent_is_zero():
    metric = SegMetric(1)
    metric.update(torch.ones(1, 1, 2, 2), torch.zeros(1, 2, 2, dtype=torch.long))
    assert metric.compute()["iou"] == 0.0


def test_counts_are_int64():
    metric = SegMetric(3)
    assert metric.matrix.dtype == torch.int64
    logits, target = random_batches(3)[0]
    metric.update(logits.to(torch.bfloat16), target.to(torch.int32))
    assert metric.matrix.dtype == torch.int64
    for count in metric.counts():
        assert count.dtype == torch.int64
    assert metric.matrix.sum().item() == target.numel()


def test_counts_do_not_overflow_int32():
    """The confusion matrix must hold more than 2**31 pixels per cell (a large data set)."""
    metric = SegMetric(2)
    metric.matrix[0, 0] = 2**31 + 5
    logits, target = random_batches(2)[0]
    metric.update(logits, target)
    assert metric.matrix[0, 0].item() >= 2**31 + 5


def test_ignored_pixels_count_nowhere():
    """Padding (IGNORE_INDEX in the target) changes neither the counts nor the loss."""
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 8, 8)
    target = torch.randint(0, 3, (2, 8, 8))
    padded_logits = torch.cat([logits, torch.randn(2, 3, 8, 4)], dim=3)
    padded_target = torch.cat([target, torch.full((2, 8, 4), train_unet.IGNORE_INDEX)], dim=2)
    plain, padded = train_unet.SegMetric(3), train_unet.SegMetric(3)
    plain.update(logits, target)
    padded.update(padded_logits, padded_target)
    assert torch.equal(plain.matrix, padded.matrix)
    for num_classes, lg, plg, tg, ptg in (
            (3, logits, padded_logits, target, padded_target),
            (1, logits[:, :1], padded_logits[:, :1], target.clamp(max=1),
             torch.where(padded_target == train_unet.IGNORE_INDEX, padded_target, padded_target.clamp(max=1)))):
        loss = train_unet.SegLoss(num_classes)
        assert loss(plg, ptg).item() == pytest.approx(loss(lg, tg).item(), rel=1e-5)


@pytest.mark.parametrize("num_classes", [1, 3])
def test_score_masks_scores_a_predicted_mask_as_validation_scores_its_logits(num_classes):
    """The notebook's per-image IoU: it counted void (255) as foreground (gt > 0) in class runs."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, num_classes, 12, 10, generator=gen)
    truth = torch.randint(0, max(2, num_classes), (12, 10), generator=gen)
    truth[:2] = train_unet.IGNORE_INDEX if num_classes > 1 else truth[:2]
    pred = (logits[0, 0] > 0).long() if num_classes == 1 else logits[0].argmax(0)
    validation = SegMetric(num_classes)
    validation.update(logits, truth[None])
    assert train_unet.score_masks(pred.numpy().astype("uint8"), truth.numpy().astype("uint8"),
                                  num_classes) == validation.compute()
