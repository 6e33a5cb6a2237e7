"""Model, loss, optimizer, LR schedule and weight EMA: the pieces a training step is built from."""
from __future__ import annotations

import contextlib
import difflib
import math

import segmentation_models_pytorch as smp
import torch
from torch import nn

from unet_amp.common import IGNORE_INDEX, UserError

MODEL_STRIDE = 32  # smp encoders downsample 5 times
LOSS_TERMS = ("ce", "dice", "focal", "lovasz", "tversky")
TVERSKY_ALPHA, TVERSKY_BETA = 0.3, 0.7  # false positives, false negatives: missed foreground costs more
EMA_WARMUP = 10  # update n uses decay min(decay, (1+n)/(10+n)): early updates forget the random init


def _choices(key, value, valid):
    """UserError for `key=value` not among `valid`, with the close matches first."""
    close = difflib.get_close_matches(str(value), valid, n=3, cutoff=0.5)
    hint = f"did you mean {' or '.join(close)}? " if close else ""
    return UserError(f"{key}: unknown value {value!r}; {hint}choose one of {', '.join(valid)}")


def build_model(cfg):
    """smp.create_model for cfg's arch/encoder; random weights unless encoder_weights names a set."""
    size = cfg.get("image_size")
    if isinstance(size, int) and size % MODEL_STRIDE:
        raise UserError(f"image_size: {size} is not a multiple of {MODEL_STRIDE}; use e.g. "
                        f"{max(MODEL_STRIDE, round(size / MODEL_STRIDE) * MODEL_STRIDE)}")
    archs = {key: cls.__name__ for key, cls in smp.MODEL_ARCHITECTURES_MAPPING.items()}
    if str(cfg["arch"]).lower() not in archs:
        raise _choices("arch", cfg["arch"], list(archs.values()))
    encoders = smp.encoders.get_encoder_names()
    name = cfg["encoder_name"]
    if name not in encoders and not str(name).startswith("tu-"):  # tu-*: any timm encoder
        raise _choices("encoder_name", name, encoders)
    try:
        return smp.create_model(cfg["arch"], encoder_name=name, encoder_weights=cfg.get("encoder_weights"),
                                in_channels=cfg["in_channels"], classes=cfg["num_classes"])
    except (KeyError, ValueError, OSError) as exc:  # weights unknown for the encoder, or unreachable
        raise UserError(f"encoder_name/encoder_weights: cannot build {cfg['arch']}({name}, "
                        f"{cfg.get('encoder_weights')!r}): {str(exc)[:160]}; use encoder_weights=None "
                        f"(random init, no download) or another encoder") from None


class SegLoss(nn.Module):
    """Sum of the loss terms, in fp32, with IGNORE_INDEX pixels left out of every term.

    Binary (one logit channel): ce is BCE, class_weights = [background, foreground] weigh each pixel.
    A batch whose pixels are all ignored scores 0 (not NaN)."""

    def __init__(self, terms, num_classes, class_weights=None, device=None):
        super().__init__()
        self.binary = num_classes == 1
        mode = "binary" if self.binary else "multiclass"
        weights = None if class_weights is None else torch.tensor(class_weights, dtype=torch.float32,
                                                                  device=device)
        self.register_buffer("weights", weights, persistent=False)
        self.ce = "ce" in terms
        make = {
            "dice": lambda: smp.losses.DiceLoss(mode, ignore_index=IGNORE_INDEX),
            "tversky": lambda: smp.losses.TverskyLoss(mode, ignore_index=IGNORE_INDEX,
                                                      alpha=TVERSKY_ALPHA, beta=TVERSKY_BETA),
            "lovasz": lambda: smp.losses.LovaszLoss(mode, ignore_index=IGNORE_INDEX),
            "focal": lambda: self._focal(mode, class_weights),
        }
        self.terms = nn.ModuleList(make[t]() for t in terms if t != "ce")

    @staticmethod
    def _focal(mode, class_weights):
        """smp's focal loss; binary class weights become its alpha (smp takes no binary class_weights)."""
        if class_weights is None or mode == "multiclass":
            return smp.losses.FocalLoss(mode, ignore_index=IGNORE_INDEX, class_weights=class_weights)
        background, foreground = class_weights
        return smp.losses.FocalLoss(mode, ignore_index=IGNORE_INDEX, alpha=foreground / (background + foreground))

    def forward(self, logits, target):
        with torch.autocast(logits.device.type, enabled=False):
            logits = logits.float()
            valid = target != IGNORE_INDEX
            total = self._ce(logits, target, valid) if self.ce else logits.new_zeros(())
            for term in self.terms:
                total = total + term(logits, target).sum()  # multi-class Lovasz may return a 1-element tensor
            # focal averages over zero pixels (NaN) when all are ignored: 0 then, with no host sync
            return torch.where(valid.any(), total, logits.new_zeros(()))

    def _ce(self, logits, target, valid):
        """Cross-entropy (BCE when binary) summed over the real pixels, divided by their count."""
        count = valid.sum().clamp(min=1)
        weights = None if self.weights is None else self.weights.to(logits.device)  # val may run on the host
        if not self.binary:
            return nn.functional.cross_entropy(logits, target, weight=weights, ignore_index=IGNORE_INDEX,
                                               reduction="sum") / count
        fg = (target == 1).unsqueeze(1)
        weight = valid.unsqueeze(1).float()
        if self.weights is not None:
            weight = weight * weights[fg.long()]
        return nn.functional.binary_cross_entropy_with_logits(logits, fg.float(), weight,
                                                              reduction="sum") / count


def build_loss(cfg, class_weights, device):
    """The loss module for cfg["loss"] (terms of LOSS_TERMS joined by '+')."""
    terms = [t.strip().lower() for t in str(cfg["loss"]).split("+")]
    bad = [t for t in terms if t not in LOSS_TERMS]
    if bad or len(set(terms)) != len(terms):
        raise UserError(f"loss: {cfg['loss']!r} is not terms of {', '.join(LOSS_TERMS)} joined by '+' "
                        f"(each once); e.g. loss=dice+ce")
    expected = 2 if cfg["num_classes"] == 1 else cfg["num_classes"]
    if class_weights is not None and len(class_weights) != expected:
        raise UserError(f"class_weights: {len(class_weights)} values, needs {expected} (one per class"
                        f"{', background and foreground' if expected == 2 and cfg['num_classes'] == 1 else ''})")
    return SegLoss(terms, cfg["num_classes"], class_weights, device).to(device)


def build_optimizer(model, cfg):
    """AdamW; biases and norm weights (tensors of ndim <= 1) get no weight decay."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim > 1], "weight_decay": cfg["weight_decay"]},
              {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0}]
    fused = next(model.parameters()).device.type in ("cpu", "cuda") or None  # one kernel, not a Python loop
    return torch.optim.AdamW(groups, lr=cfg["learning_rate"], fused=fused)


def lr_factor(step, total, warmup_fraction):
    """LR multiplier at optimizer step `step` of `total`: linear warm-up to 1, then cosine to 0."""
    warm = int(warmup_fraction * total)
    if step < warm:
        return (step + 1) / warm
    return 0.5 * (1 + math.cos(math.pi * min(1.0, (step - warm) / max(1, total - warm))))


def build_scheduler(optimizer, cfg, steps_per_epoch):
    """LambdaLR stepped per optimizer step; total steps read from cfg["epochs"] at each step, so a resume
    with more epochs stretches the cosine."""
    def factor(step):
        return lr_factor(step, max(1, cfg["epochs"] * steps_per_epoch), cfg["warmup_fraction"])
    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def unwrap(model):
    """The plain module under DDP (.module) and torch.compile (._orig_mod) wrappers."""
    for attr in ("_orig_mod", "module", "_orig_mod"):  # compile(DDP(m)) and DDP(compile(m)) alike
        inner = getattr(model, attr, None)
        model = inner if isinstance(inner, nn.Module) else model
    return model


class EMA:
    """Exponential moving average of the parameters (buffers copied), with a short warm-up.
    decay None: off, every method does nothing."""

    def __init__(self, model, decay):
        self.decay, self.updates = decay, 0
        if decay is None:
            return
        self.model = unwrap(model)
        self.names = [n for n, _ in self.model.named_parameters()]
        self.shadow = {n: t.detach().clone() for n, t in self._live().items()}

    def _live(self):
        return {**dict(self.model.named_parameters()), **dict(self.model.named_buffers())}

    def _split(self):
        """(live params, shadow params, live buffers, shadow buffers) as lists in one order."""
        live = self._live()
        buffers = [n for n in self.shadow if n not in self.names]
        return ([live[n].detach() for n in self.names], [self.shadow[n] for n in self.names],
                [live[n] for n in buffers], [self.shadow[n] for n in buffers])

    @torch.no_grad()
    def update(self):
        if self.decay is None:
            return
        self.updates += 1
        decay = min(self.decay, (1 + self.updates) / (EMA_WARMUP + self.updates))
        live_p, ema_p, live_b, ema_b = self._split()
        torch._foreach_lerp_(ema_p, live_p, 1 - decay)
        if live_b:
            torch._foreach_copy_(ema_b, live_b)

    def state_dict(self):
        if self.decay is None:
            return None
        return {"shadow": self.shadow, "updates": self.updates, "decay": self.decay}

    @torch.no_grad()
    def load_state_dict(self, state):
        """Restore a saved EMA; None (a run saved without EMA) starts it from the model's weights."""
        if self.decay is None:
            return
        source = self._live() if state is None else state["shadow"]
        for name, tensor in self.shadow.items():
            tensor.copy_(source[name])
        self.updates = 0 if state is None else state["updates"]

    @contextlib.contextmanager
    def swapped(self):
        """The EMA weights in the model for the block (validation, saving best.pt); the live ones after."""
        if self.decay is None:
            yield
            return
        live = [t.detach() for t in self._live().values()]
        backup = [t.clone() for t in live]
        with torch.no_grad():
            torch._foreach_copy_(live, list(self.shadow.values()))
        try:
            yield
        finally:
            with torch.no_grad():
                torch._foreach_copy_(live, backup)
