"""Numerical safety: a non-finite step is skipped, a streak of them rolls back to a safer precision
(fp16 -> bf16 -> fp32), and fp32 stops with a diagnosis. With nan_guard=False every object here does nothing."""
from __future__ import annotations

import copy
import math

import torch

from unet_amp.common import UserError
from unet_amp.distributed import DIST, all_reduce_
from unet_amp.precision import make_scaler, precision_for


class NonFiniteStreak(Exception):
    """nan_patience bad optimizer steps in a row: the epoch loop falls back to a safer precision."""

    def __init__(self, step, batch):
        super().__init__(f"non-finite loss or gradients up to step {step}")
        self.step, self.batch = step, batch


class BatchNormSnapshot:
    """BatchNorm running statistics as they were before a group's forwards: a NaN batch poisons them even
    though its step is skipped. One grouped copy per dtype, no per-buffer ops."""

    def __init__(self, model, enabled):
        groups = {}
        for b in model.buffers():
            if enabled and b.is_floating_point():
                groups.setdefault((b.device, b.dtype), []).append(b)
        self.live = list(groups.values())
        self.saved = [[b.detach().clone() for b in group] for group in self.live]

    def save(self):
        for live, saved in zip(self.live, self.saved):
            torch._foreach_copy_(saved, live)

    def restore(self):
        for live, saved in zip(self.live, self.saved):
            torch._foreach_copy_(live, saved)


class StepGuard:
    """One optimizer step per accumulation group: unscale (fp16), clip, and step only where the loss and the
    gradient norm are finite; the one host sync per optimizer step reads both together."""

    def __init__(self, model, cfg, streak=0):
        self.enabled, self.patience, self.clip = cfg["nan_guard"], cfg["nan_patience"], cfg["grad_clip_norm"]
        self.snapshot = BatchNormSnapshot(model, self.enabled)
        self.streak, self.steps, self.skipped, self.norm_sum = streak, 0, 0, 0.0

    def start_group(self):
        self.snapshot.save()

    def step(self, model, optimizer, scaler, loss_ok, batch):
        """Step the optimizer if the group's losses (a device bool) and gradients are finite."""
        if scaler is not None:
            scaler.unscale_(optimizer)
        if DIST.enabled:  # one process's overflow is every process's: they all skip, roll back and fall back alike
            loss_ok = all_reduce_((~loss_ok).float()) == 0
        params = [p for p in model.parameters() if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(params, self.clip if self.clip else math.inf)
        if not self.enabled:  # plain PyTorch: no check, no sync
            scaler.step(optimizer) if scaler is not None else optimizer.step()
            self._done(scaler, True, True, norm, batch)
            return
        scale = scaler._scale if scaler is not None else norm.new_ones(())  # read in the same sync
        loss_fine, norm_value, scale = torch.stack([loss_ok.to(norm.dtype), norm, scale.to(norm.dtype)]).tolist()
        applied = bool(loss_fine) and math.isfinite(norm_value)
        if applied:
            optimizer.step()
        # fp16: an overflow the scaler backs off from is its normal business; bad only when the loss itself
        # overflowed or the gradients overflow even with the loss scaled below 1
        bad = not applied if scaler is None else (not loss_fine or (not applied and scale < 1))
        self._done(scaler, applied, not bad, norm_value if applied else None, batch, bool(loss_fine))

    def _done(self, scaler, applied, good, norm, batch, loss_fine=True):
        if scaler is not None:  # backs the scale off where unscale_ found inf, grows it otherwise
            scaler.update()
        if not loss_fine:
            self.snapshot.restore()
        self.steps += 1
        self.skipped += not applied
        self.norm_sum = self.norm_sum + norm if norm is not None else self.norm_sum  # a tensor without the guard
        self.streak = 0 if good else self.streak + 1
        if self.enabled and self.streak >= self.patience:
            raise NonFiniteStreak(self.steps, batch)

    @property
    def grad_norm(self):
        """Mean pre-clip norm of the applied steps (one read at the epoch's end where nan_guard is off)."""
        return float(self.norm_sum) / max(1, self.steps - self.skipped)


def rollback_point(run_state, enabled):
    """A CPU copy of the run's state to roll back to, taken once per epoch (nan_guard on; else None)."""
    return to_cpu(run_state) if enabled else None


def to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return copy.deepcopy(obj)


def safer_precision(prec, hw):
    """fp16 -> bf16 where native, else fp32; bf16 -> fp32; fp32 -> None (nothing safer)."""
    if prec.name == "fp16" and hw.bf16_native:
        return precision_for("bfloat16", prec.channels_last, "fallback from fp16 (non-finite)")
    if prec.amp:
        return precision_for("float32", prec.channels_last, f"fallback from {prec.name} (non-finite)")
    return None


def fall_back(prec, hw, bad, cfg, epoch, diagnose):
    """(the safer precision, its scaler) after a streak; in fp32 a UserError with what went non-finite."""
    safer = safer_precision(prec, hw)
    if safer is None:
        raise UserError(f"training went non-finite in fp32 at step {bad.step} of epoch {epoch}: {diagnose(bad.batch)}; "
                        f"lower learning_rate (now {cfg['learning_rate']}) or check the data for NaN/inf "
                        f"(detect_anomaly=True names the operation); last.pt holds the last good epoch")
    return safer, make_scaler(safer, hw)


def diagnose(model, loss_fn, batch):
    """Where a batch first goes non-finite: the input, the forward (its first module), or the loss."""
    x, y = batch
    if not torch.isfinite(x).all():
        return "the input images hold NaN/inf"
    bad = []
    hooks = [m.register_forward_hook(lambda m, i, o, name=name: bad.append(name) if torch.is_tensor(o) and
                                     not torch.isfinite(o).all() and not bad else None)
             for name, m in model.named_modules() if name]
    try:
        with torch.no_grad():
            logits = model(x.float())
    finally:
        for h in hooks:
            h.remove()
    if bad:
        return f"the forward pass, first at module {bad[0]}"
    with torch.no_grad():
        loss = loss_fn(logits, y)
    return "the loss" if not torch.isfinite(loss) else "the gradients (the forward and loss were finite)"
