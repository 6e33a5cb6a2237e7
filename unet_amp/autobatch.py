"""batch_size=auto on CUDA: the largest batch whose real training steps fit in GPU memory, minus headroom."""
from __future__ import annotations

import gc

import torch

from unet_amp.common import UserError, say

START = 2          # BatchNorm needs two values per channel
CAP = 1024         # no search past this
HEADROOM = 0.10    # room for fragmentation, validation and other processes on the GPU
TRIAL_STEPS = 2    # the second step holds the optimizer's state too


def _free(hw):
    gc.collect()
    if hw.kind == "cuda":
        torch.cuda.empty_cache()


def fits(make_step, batch, hw):
    """Whether TRIAL_STEPS training steps at `batch` run without running out of GPU memory."""
    try:
        step = make_step(batch)
        for _ in range(TRIAL_STEPS):
            step()
        if hw.kind == "cuda":
            torch.cuda.synchronize(hw.device)
        ok = True
    except torch.cuda.OutOfMemoryError:
        ok = False
    step = None  # noqa: F841  (the model and its activations go before the cache is emptied)
    _free(hw)  # outside the except block: the traceback no longer pins tensors
    return ok


def largest_fitting(make_step, hw, cap=CAP):
    """Double from START until a batch fails, then bisect between the last fit and the first failure; 0 if none fit."""
    if not fits(make_step, START, hw):
        return 0
    good, bad = START, None
    while bad is None and good < cap:
        n = min(2 * good, cap)
        good, bad = (n, None) if fits(make_step, n, hw) else (good, n)
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(make_step, mid, hw) else (good, mid)
    return good


def with_headroom(largest):
    """~HEADROOM less than the largest that fit, rounded down to an even number, at least START."""
    return max(START, int(largest * (1 - HEADROOM)) // 2 * 2)


def find_batch_size(cfg, hw, make_step, cap=CAP):
    """The batch size to train with: make_step(batch) -> a callable running one real training step;
    `cap`: the most worth trying (e.g. the training set's size)."""
    devices = [hw.device.index or 0] if hw.kind == "cuda" else []
    with torch.random.fork_rng(devices=devices):  # the trials leave the run's random state as it was
        largest = largest_fitting(make_step, hw, max(START, cap))
    if largest == 0:
        raise UserError(f"batch_size=auto: not even a batch of {START} fits in {hw.name}'s memory at image_size="
                        f"{cfg['image_size']}; lower image_size, use a smaller encoder_name or use_amp=True")
    use = largest if largest >= cap else with_headroom(largest)  # the whole set fits: no headroom needed
    why = f"the cap of {cap}" if largest >= cap else f"{HEADROOM:.0%} headroom"
    say(f"batch_size=auto: the largest batch that fit is {largest}; using {use} ({why})")
    return use
