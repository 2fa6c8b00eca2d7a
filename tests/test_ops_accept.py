"""The speculative cycle's acceptance kernel (ops_accept_qwen3vl_graph.py) against its torch reference."""

import pytest
import torch
from ops_checks import DEVICE, Torch, Triton, needs_triton

from qwen3vl_static.ops_accept_qwen3vl_graph import CycleState

pytestmark = needs_triton


def state(k, proposals, produced, max_new, alive, eos, start=40, cycle=1):
    def tensor(value, dtype=torch.long):
        return torch.tensor(value, dtype=dtype, device=DEVICE)

    return CycleState(
        proposals=tensor(proposals), eos_ids=tensor(eos + [-1] * (8 - len(eos))), produced=tensor(produced),
        max_new=tensor(max_new), alive=tensor(alive, torch.bool), chunk_cycle=tensor([cycle]),
        out_tokens=torch.full((4, k + 1), -7, dtype=torch.long, device=DEVICE),
        out_counts=torch.full((4,), -7, dtype=torch.long, device=DEVICE),
        cache_lens=start + torch.arange(k + 1, device=DEVICE), positions=torch.full((3, k + 1, 1), -7, device=DEVICE),
        input_ids=torch.full((k + 1, 1), -7, device=DEVICE), first_position=tensor([[30], [31], [32]]),
        prompt_len=tensor(25), kept=tensor(-7), draft_slots=torch.full((2 * k,), -7, device=DEVICE),
        draft_positions=torch.full((3, 2 * k, 1), -7, device=DEVICE))


@pytest.mark.parametrize("k", [1, 4, 7])
@pytest.mark.parametrize("case", ["all-kept", "some-kept", "none-kept", "eos-inside", "eos-after-the-kept",
                                  "limit-inside", "stopped"])
def test_accept_matches_the_reference(k, case):
    generator = torch.Generator().manual_seed(k)
    predicted = torch.randint(100, 200, (k + 1,), generator=generator)
    proposals = predicted[:k].clone()
    produced, max_new, alive, eos = 10, 100, True, [3]
    if case == "some-kept":
        proposals[k // 2] += 1
    elif case == "none-kept":
        proposals[0] += 1
    elif case == "eos-inside":
        eos = [5, int(predicted[k // 2])]
    elif case == "eos-after-the-kept":  # an EOS id the target predicts past the first miss is not output
        proposals[0] += 1
        eos = [int(predicted[k])]
    elif case == "limit-inside":
        max_new = produced + max(1, k // 2)
    elif case == "stopped":
        alive = False
    results = []
    for ops in (Torch, Triton):
        cycle = state(k, proposals.tolist(), produced, max_new, alive, eos)
        ops.accept(predicted.to(DEVICE), cycle)
        results.append(cycle)
    reference, fused = results
    for name, expected, got in zip(CycleState._fields, reference, fused):
        assert torch.equal(got, expected), name
    count = int(reference.out_counts[1])
    expected = {"all-kept": k + 1, "some-kept": k // 2 + 1, "none-kept": 1, "eos-inside": k // 2 + 1,
                "eos-after-the-kept": 1, "limit-inside": max(1, k // 2), "stopped": 0}[case]
    assert count == expected and int(reference.produced) == produced + count
    assert bool(reference.alive) == (case not in ("eos-inside", "limit-inside", "stopped"))
    assert reference.cache_lens.tolist() == [40 + count + i for i in range(k + 1)]
    kept = {"some-kept": k // 2, "none-kept": 0, "eos-after-the-kept": 0}.get(case, k)
    # the draft's slots: the cycle's verified ones, then its chain's after the last kept token
    assert reference.draft_slots.tolist() == [40 + i for i in range(k + 1)] + [40 + kept + 1 + i for i in range(k - 1)]
    assert reference.draft_positions[:, :, 0].tolist() == [[first - 25 + slot for slot in reference.draft_slots.tolist()]
                                                          for first in (30, 31, 32)]
