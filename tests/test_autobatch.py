"""batch_size=auto's search, on the CPU: a fake training step that runs out of memory above a batch size."""
import types

import pytest
import torch

from unet_amp import autobatch
from unet_amp.common import UserError

HW = types.SimpleNamespace(kind="cpu", device=torch.device("cpu"), name="fake GPU")
CFG = {"image_size": 64}


def fake_steps(limit, tried):
    """make_step(batch): its step runs out of memory when batch > limit, on the second call like a real one."""
    def make_step(batch):
        calls = []

        def step():
            calls.append(1)
            tried.append(batch)
            if batch > limit and len(calls) == 2:
                raise torch.cuda.OutOfMemoryError("CUDA out of memory (fake)")
        return step
    return make_step


@pytest.mark.parametrize("limit, largest, used", [(2, 2, 2), (3, 3, 2), (37, 37, 32), (100, 100, 90),
                                                  (64, 64, 56), (5000, 1024, 1024)])
def test_largest_fitting_batch_with_headroom(limit, largest, used):
    tried = []
    assert autobatch.largest_fitting(fake_steps(limit, tried), HW) == largest
    assert autobatch.find_batch_size(CFG, HW, fake_steps(limit, [])) == used
    assert used % 2 == 0 and used <= largest  # the cap (1024) is not memory: no headroom
    assert tried[:4] == [2, 2, 4, 4]  # doubling from 2, each batch run twice


def test_nothing_fits_is_a_user_error():
    with pytest.raises(UserError, match="batch_size"):
        autobatch.find_batch_size(CFG, HW, fake_steps(1, []))


def test_search_leaves_the_random_state_as_it_was():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)

    def make_step(batch):
        return lambda: torch.randn(batch) if batch <= 8 else (_ for _ in ()).throw(torch.cuda.OutOfMemoryError())
    assert autobatch.find_batch_size(CFG, HW, make_step) == 6
    assert torch.equal(torch.rand(3), expected)


def test_other_errors_are_not_taken_for_out_of_memory():
    def make_step(batch):
        def step():
            raise ValueError("a bug, not memory")
        return step
    with pytest.raises(ValueError):
        autobatch.find_batch_size(CFG, HW, make_step)


def test_cap_stops_the_search_and_needs_no_headroom():
    tried = []
    assert autobatch.find_batch_size(CFG, HW, fake_steps(5000, tried), cap=20) == 20
    assert max(tried) == 20
