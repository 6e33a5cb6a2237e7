"""unet_amp.model: the model's shapes, every loss term, the optimizer groups, the LR schedule and the EMA."""
import math

import pytest
import torch
from torch import nn

from unet_amp.common import IGNORE_INDEX, UserError
from unet_amp.model import (EMA, EMA_WARMUP, LOSS_TERMS, build_loss, build_model, build_optimizer,
                            build_scheduler)


def cfg_for(**kw):
    cfg = {"arch": "Unet", "encoder_name": "resnet18", "encoder_weights": None, "in_channels": 3,
           "num_classes": 1, "image_size": 64, "loss": "dice+ce", "learning_rate": 1e-3,
           "weight_decay": 1e-4, "epochs": 10, "warmup_fraction": 0.1}
    return {**cfg, **kw}


def batch(num_classes, seed=0, n=2, hw=16):
    g = torch.Generator().manual_seed(seed)
    channels, labels = (1, 2) if num_classes == 1 else (num_classes, num_classes)
    return torch.randn(n, channels, hw, hw, generator=g), torch.randint(0, labels, (n, hw, hw), generator=g)


def perfect_logits(target, num_classes, scale=50.0):
    if num_classes == 1:
        return ((target == 1).float() * 2 - 1).unsqueeze(1) * scale
    one_hot = nn.functional.one_hot(target.clamp(max=num_classes - 1), num_classes).permute(0, 3, 1, 2)
    return (one_hot.float() * 2 - 1) * scale  # certain also per class: focal is one-vs-rest


@pytest.mark.parametrize("in_channels", [1, 3])
@pytest.mark.parametrize("num_classes", [1, 3])
def test_build_model_output_shape(in_channels, num_classes):
    model = build_model(cfg_for(in_channels=in_channels, num_classes=num_classes)).eval()
    with torch.no_grad():
        out = model(torch.randn(2, in_channels, 64, 64))
    assert out.shape == (2, num_classes, 64, 64)


@pytest.mark.parametrize("key,value", [("arch", "Unett"), ("encoder_name", "resnet19")])
def test_unknown_arch_or_encoder_is_a_user_error(key, value):
    with pytest.raises(UserError, match=key):
        build_model(cfg_for(**{key: value}))


def test_image_size_not_a_multiple_of_32_is_a_user_error():
    with pytest.raises(UserError, match="image_size"):
        build_model(cfg_for(image_size=100))


@pytest.mark.parametrize("num_classes", [1, 3])
@pytest.mark.parametrize("term", LOSS_TERMS)
def test_each_term_finite_and_small_on_a_perfect_prediction(term, num_classes):
    loss_fn = build_loss(cfg_for(loss=term, num_classes=num_classes), None, "cpu")
    logits, target = batch(num_classes)
    logits.requires_grad_(True)
    loss = loss_fn(logits, target)
    assert loss.dtype == torch.float32 and loss.ndim == 0 and torch.isfinite(loss)
    loss.backward()
    assert torch.isfinite(logits.grad).all()
    assert loss_fn(perfect_logits(target, num_classes), target).item() < 1e-3


@pytest.mark.parametrize("num_classes", [1, 3])
@pytest.mark.parametrize("term", LOSS_TERMS)
def test_ignored_pixels_do_not_count(term, num_classes):
    loss_fn = build_loss(cfg_for(loss=term, num_classes=num_classes), None, "cpu")
    logits, target = batch(num_classes)
    target[:, :8] = IGNORE_INDEX
    base = loss_fn(logits, target)
    changed = logits.clone()
    changed[:, :, :8] = torch.randn_like(changed[:, :, :8]) * 10  # only where the target is ignored
    assert torch.allclose(loss_fn(changed, target), base, atol=1e-5)
    all_ignored = torch.full_like(target, IGNORE_INDEX)
    logits.requires_grad_(True)
    loss = loss_fn(logits, all_ignored)
    loss.backward()
    assert loss.item() == 0.0 and torch.isfinite(logits.grad).all()


def test_all_terms_summed_is_finite_under_bf16_autocast():
    loss_fn = build_loss(cfg_for(loss="+".join(LOSS_TERMS), num_classes=3), [1.0, 2.0, 0.5], "cpu")
    logits, target = batch(3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_fn(logits.bfloat16(), target)
    assert loss.dtype == torch.float32 and torch.isfinite(loss)


@pytest.mark.parametrize("num_classes,weights", [(1, [1.0, 5.0]), (3, [1.0, 5.0, 0.2])])
def test_class_weights_change_ce(num_classes, weights):
    logits, target = batch(num_classes)
    plain = build_loss(cfg_for(loss="ce", num_classes=num_classes), None, "cpu")(logits, target)
    weighted = build_loss(cfg_for(loss="ce", num_classes=num_classes), weights, "cpu")(logits, target)
    ones = build_loss(cfg_for(loss="ce", num_classes=num_classes), [1.0] * len(weights), "cpu")(logits, target)
    assert not torch.allclose(plain, weighted) and torch.allclose(plain, ones)


def test_multiclass_ce_is_torch_cross_entropy_over_real_pixels():
    logits, target = batch(3)
    target[0, 0] = IGNORE_INDEX
    got = build_loss(cfg_for(loss="ce", num_classes=3), None, "cpu")(logits, target)
    assert torch.allclose(got, nn.functional.cross_entropy(logits, target, ignore_index=IGNORE_INDEX))


@pytest.mark.parametrize("loss", ["dice+bce", "dice,ce", "ce+ce", ""])
def test_unknown_loss_is_a_user_error(loss):
    with pytest.raises(UserError, match="loss"):
        build_loss(cfg_for(loss=loss), None, "cpu")


def test_optimizer_no_decay_on_biases_and_norms():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))
    groups = build_optimizer(model, cfg_for()).param_groups
    assert groups[0]["weight_decay"] == 1e-4 and [p.ndim for p in groups[0]["params"]] == [4]
    assert groups[1]["weight_decay"] == 0.0 and len(groups[1]["params"]) == 3


def lrs(scheduler, optimizer, steps):
    seen = []
    for _ in range(steps):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return seen


def test_schedule_warmup_then_cosine_and_extended_epochs():
    cfg = cfg_for(epochs=10, warmup_fraction=0.1, learning_rate=1.0)  # 100 steps, 10 of warm-up
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, cfg, steps_per_epoch=10)
    seen = lrs(scheduler, optimizer, 101)
    assert seen[0] == pytest.approx(0.1) and seen[4] == pytest.approx(0.5) and seen[9] == pytest.approx(1.0)
    assert seen[10] == pytest.approx(1.0)
    assert seen[55] == pytest.approx(0.5)  # half-way through the 90 cosine steps
    assert seen[100] == pytest.approx(0.0, abs=1e-12)
    state = scheduler.state_dict()

    cfg["epochs"] = 20  # a resume with more epochs: 200 steps, 20 of warm-up
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = build_scheduler(optimizer, cfg, steps_per_epoch=10)
    scheduler.load_state_dict(state)
    optimizer.step()
    scheduler.step()  # the next step, of 200 now
    expected = 0.5 * (1 + math.cos(math.pi * (scheduler.last_epoch - 20) / 180))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(expected)


def tiny_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 2, 1), nn.BatchNorm2d(2))


def test_ema_off_does_nothing():
    model = tiny_model()
    ema = EMA(model, None)
    before = [t.clone() for t in model.state_dict().values()]
    ema.update()
    with ema.swapped():
        pass
    ema.load_state_dict(None)
    assert ema.state_dict() is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.state_dict().values()))


def test_ema_averages_and_swaps():
    model = tiny_model()
    ema = EMA(model, 0.5)
    weight = model[0].weight
    start = weight.detach().clone()
    with torch.no_grad():
        weight.add_(1.0)
        model[1].running_mean.fill_(3.0)
    ema.update()
    decay = min(0.5, 2 / (EMA_WARMUP + 1))  # the warm-up's decay at the first update
    expected = start * decay + (start + 1) * (1 - decay)
    live = weight.detach().clone()
    with ema.swapped():
        assert torch.allclose(model[0].weight, expected)
        assert torch.equal(model[1].running_mean, torch.full((2,), 3.0))  # buffers copied
    assert torch.equal(weight, live)

    for _ in range(20):  # past the warm-up: decay 0.5 each step
        ema.update()
    with torch.no_grad():
        weight.add_(2.0)
    ema.update()
    state = ema.state_dict()
    assert torch.allclose(state["shadow"]["0.weight"], live * 0.5 + (live + 2) * 0.5, atol=1e-6)

    other = EMA(tiny_model(), 0.5)
    other.load_state_dict(state)
    assert other.updates == state["updates"]
    assert torch.equal(other.shadow["0.weight"], state["shadow"]["0.weight"])
