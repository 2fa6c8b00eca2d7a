"""The step's end (ops_step_end_qwen3vl_graph.py): the one-launch kernel against the torch reference."""

import pytest
import torch
from ops_checks import DEVICE, DTYPES, Torch, Triton, needs_triton, randn

pytestmark = needs_triton


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "drawn"])
def test_finish_step(dtype, greedy):
    """The greedy token is the first of equal maxima, also when a later one comes first in the kernel's scan or lies
    in another part of the vocabulary; finished rows emit the pad token, EOS finishes a row, the token is fed and
    recorded in the current column."""
    rows, vocab = 4, 140000  # 64 parts of 3 blocks of 1024
    logits = randn(rows, vocab, dtype=dtype)
    logits[0, [1027, 5, 3100]] = 50.0  # 1027 is in lane 3 of part 0's second block; 5 in lane 5 of its first
    logits[1, [3071, 3072]] = 50.0  # the last of part 0, the first of part 1
    drawn = torch.tensor([7, 9, 11, 13], device=DEVICE)
    eos_ids = torch.tensor([11, 3072, 13, -1, -1, -1, -1, -1], device=DEVICE)
    states = []
    for ops in (Torch, Triton):
        unfinished = torch.tensor([True, True, False, True], device=DEVICE)
        input_ids = torch.full((rows, 1), -5, device=DEVICE)
        out_tokens = torch.full((rows, 4), -5, device=DEVICE)
        out_unfinished = torch.zeros(rows, 4, dtype=torch.bool, device=DEVICE)
        chunk_step = torch.tensor([2], device=DEVICE)
        positions = torch.arange(3 * 6, device=DEVICE).view(3, 6, 1)  # the runner's buffer has more rows than the step
        cache_lens = torch.tensor([40, 41, 7, 40, 9, 9], device=DEVICE)
        ops.finish_step(logits, None if greedy else drawn, unfinished, torch.tensor(3, device=DEVICE), eos_ids, input_ids,
                        out_tokens, out_unfinished, chunk_step, cache_lens[:rows], positions[:, :rows])
        states.append((unfinished, input_ids, out_tokens, out_unfinished, chunk_step, cache_lens, positions))
    for got, expected in zip(*reversed(states)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)
    unfinished, input_ids, out_tokens, _, chunk_step, cache_lens, positions = states[1]
    assert cache_lens.tolist() == [41, 42, 8, 41, 9, 9]  # every row of the step moved on, finished ones too
    assert positions[:, :, 0].tolist() == [[1, 2, 3, 4, 4, 5], [7, 8, 9, 10, 10, 11], [13, 14, 15, 16, 16, 17]]
    assert chunk_step.item() == 3 and (out_tokens[:, 2] == input_ids[:, 0]).all() and (out_tokens[:, [0, 1, 3]] == -5).all()
    if greedy:
        assert input_ids[:2, 0].tolist() == [5, 3071] and input_ids[2, 0] == 3  # row 2 was finished: pad
    else:
        assert input_ids[:, 0].tolist() == [7, 9, 3, 13] and unfinished.tolist() == [True, True, False, False]
    assert not Triton.ticket(torch.device(DEVICE)).any()  # back at zero for the next launch
