"""unet_amp.metrics.ConfusionMatrix: dataset-level IoU / Dice against hand-computed and smp values."""
import math

import pytest
import segmentation_models_pytorch as smp
import torch
from torch import nn

from unet_amp.common import IGNORE_INDEX
from unet_amp.metrics import ConfusionMatrix

I = IGNORE_INDEX


def logits_of(pred, num_classes):
    """Logits whose prediction (logit > 0, or argmax) is `pred`."""
    pred = torch.as_tensor(pred)
    if num_classes == 1:
        return (pred.float() * 2 - 1).unsqueeze(1)
    return nn.functional.one_hot(pred, num_classes).permute(0, 3, 1, 2).float()


def scores(pred, target, num_classes):
    metric = ConfusionMatrix(num_classes, "cpu")
    metric.update(logits_of(pred, num_classes), torch.as_tensor(target))
    return metric.all_reduce().compute()  # one process: all_reduce changes nothing


@pytest.mark.parametrize("num_classes", [1, 2, 4])
def test_perfect_prediction(num_classes):
    target = torch.randint(0, max(2, num_classes), (2, 8, 8), generator=torch.Generator().manual_seed(0))
    result = scores(target, target, num_classes)
    assert result["iou"] == 1.0 and result["dice"] == 1.0


def test_known_multiclass_confusion():
    target = [[[0, 0, 1, 1, 2, I]]]
    pred = [[[0, 1, 1, 1, 0, 2]]]  # the ignored pixel's prediction does not count
    result = scores(pred, target, 3)
    assert result["confusion"] == [[1, 1, 0], [0, 2, 0], [1, 0, 0]]
    assert result["per_class_iou"] == pytest.approx([1 / 3, 2 / 3, 0.0])
    assert result["per_class_dice"] == pytest.approx([0.5, 0.8, 0.0])
    assert result["iou"] == pytest.approx(1 / 3) and result["dice"] == pytest.approx(1.3 / 3)


def test_absent_class_is_left_out_of_the_mean():
    result = scores([[[0, 1, 1]]], [[[0, 0, 1]]], 4)  # classes 2 and 3 neither true nor predicted
    assert math.isnan(result["per_class_iou"][2]) and math.isnan(result["per_class_iou"][3])
    assert result["iou"] == pytest.approx((1 / 2 + 1 / 2) / 2)


def test_known_binary_confusion_is_the_foreground():
    result = scores([[[1, 0, 1, 0, 1]]], [[[1, 1, 0, 0, I]]], 1)
    assert result["iou"] == pytest.approx(1 / 3) and result["dice"] == pytest.approx(0.5)
    assert result["per_class_iou"] == pytest.approx([1 / 3])


def test_binary_with_no_foreground_anywhere_is_perfect():
    assert scores([[[0, 0]]], [[[0, I]]], 1)["iou"] == 1.0


def test_all_ignored_counts_nothing():
    result = scores([[[1, 2]]], [[[I, I]]], 3)
    assert result["confusion"] == [[0] * 3] * 3 and result["iou"] == 1.0


@pytest.mark.parametrize("num_classes", [1, 3])
def test_sums_over_batches_like_smp(num_classes):
    g = torch.Generator().manual_seed(1)
    channels, labels = (1, 2) if num_classes == 1 else (num_classes, num_classes)
    batches = [(torch.randn(n, channels, 9, 11, generator=g), torch.randint(0, labels, (n, 9, 11), generator=g))
               for n in (3, 2, 4)]
    metric = ConfusionMatrix(num_classes, "cpu")
    for logits, target in batches:
        metric.update(logits, target)
    result = metric.compute()
    logits, target = (torch.cat(t) for t in zip(*batches))
    if num_classes == 1:
        stats = smp.metrics.get_stats((logits > 0).long(), target.unsqueeze(1), mode="binary")
        reduction = "micro"
    else:
        stats = smp.metrics.get_stats(logits.argmax(1), target, mode="multiclass", num_classes=num_classes)
        stats, reduction = [s.sum(0, keepdim=True) for s in stats], "macro"
    assert result["iou"] == pytest.approx(smp.metrics.iou_score(*stats, reduction=reduction).item())
    assert result["dice"] == pytest.approx(smp.metrics.f1_score(*stats, reduction=reduction).item())
