"""The greedy pick (ops_argmax_qwen3vl_graph.py): the one-launch kernel against the torch reference."""

import pytest
import torch
from ops_checks import DEVICE, DTYPES, Torch, Triton, needs_triton, randn

from qwen3vl_static.ops_argmax_qwen3vl_graph import BLOCK, PARTS

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("vocab", [32000, 140000], ids=["draft-vocabulary", "parts-of-3-blocks"])
def test_argmax_picks_the_first_of_equal_maxima(dtype, vocab):
    """Ties go to the first index, also when the later one comes first in a program's scan or lies in another part;
    the offsets map the pick (a draft's d2t), and the pick is written into a strided row of the caller's buffer."""
    rows = 5
    logits = randn(rows, vocab, dtype=dtype)
    logits[0, [1027, 5, 3100]] = 50.0  # 1027 in lane 3 of part 0's second block; 5 in lane 5 of its first
    logits[1, [vocab - 1]] = 50.0  # the very last
    edge = -(-(-(-vocab // PARTS)) // BLOCK) * BLOCK  # part 1's first index
    logits[2, [edge, edge - 1]] = 50.0  # the last of part 0, the first of part 1
    offsets = torch.randint(0, 1000, (vocab,), device=DEVICE)
    for mapped in (None, offsets):
        expected = Torch.argmax(logits, mapped)
        buffer = torch.full((rows, 2), -7, dtype=torch.long, device=DEVICE)
        got = Triton.argmax(logits, mapped, buffer[:, 0])
        assert torch.equal(got, expected) and torch.equal(buffer[:, 0], expected) and (buffer[:, 1] == -7).all()
        assert torch.equal(Triton.argmax(logits, mapped), expected)
    assert Torch.argmax(logits)[:3].tolist() == [5, vocab - 1, edge - 1]
    assert not Triton.ticket(torch.device(DEVICE)).any()  # back at zero for the next launch
