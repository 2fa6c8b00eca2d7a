"""What does one kernel boundary of the decode step cost, and would finer-grained waiting shorten it? (H200; JSON
to $OUT.)

The batch-1 step is ~250 dependent kernels. In its timeline small kernels (the merge, add + RMSNorm) take 2-3 µs
each from their predecessor's end to their own, for a few KB of work. Timed here: a CUDA graph of CHAIN small
kernels, each of PROGRAMS programs, each program reading a slice that other programs of the previous kernel wrote
(a rotation of a 2048-float vector) and writing its own slice; µs per kernel:
- "stream": plain launches (each kernel starts when the previous one has finished);
- "pdl": programmatic dependent launch as the decode kernels use it (`griddepcontrol.wait`, then release the next);
- "flag": launched as "pdl", but instead of waiting for the whole previous grid to finish (and flush), each program
  spins on a counter the previous kernel's programs increment after their stores (release / acquire), then
  releases the next kernel;
- "flag-release-first": the same, releasing the next kernel before spinning.
The result is checked against torch (`max_error`). Run: python bench/probes/boundary_probe.py
"""

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

import harness

N, SHIFT, CHAIN = 2048, 1031, 252


@triton.jit
def step_kernel(src, dst, flag_in, flag_out, expected, n, shift, MODE: tl.constexpr, BLOCK: tl.constexpr):
    # MODE 0: stream order; 1: PDL wait then release; 2: spin on flag_in, then release; 3: release, then spin.
    if MODE == 1:
        gdc_wait()
        gdc_launch_dependents()
    if MODE == 3:
        gdc_launch_dependents()
    if MODE >= 2:
        count = tl.atomic_add(flag_in, 0, sem="acquire")
        spins = 0
        while (count < expected) & (spins < 1048576):  # bounded: a wrong count shows as an error, not a hang
            count = tl.atomic_add(flag_in, 0, sem="acquire")
            spins += 1
    if MODE == 2:
        gdc_launch_dependents()
    cols = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = cols < n
    value = tl.load(src + (cols + shift) % n, mask=keep, other=0.0, cache_modifier=".cg")
    tl.store(dst + cols, value + 1.0, mask=keep)
    if MODE >= 2:
        tl.debug_barrier()  # every thread's stores before the release
        tl.atomic_add(flag_out, 1, sem="release")


def run(mode, programs):
    block = triton.next_power_of_2(triton.cdiv(N, programs))
    grid = (triton.cdiv(N, block),)
    start_vector = torch.randn(N, device="cuda")
    buffers = [torch.empty(N, device="cuda") for _ in range(2)]
    flags = torch.zeros(CHAIN + 1, dtype=torch.int32, device="cuda")
    pdl = {"launch_pdl": True} if mode else {}

    def chain():
        flags.zero_()
        flags[1:2].fill_(grid[0])  # the first kernel (plain launch) signals nothing; the second starts after it finishes
        buffers[0].copy_(start_vector)
        for index in range(CHAIN):
            src, dst = buffers[index % 2], buffers[(index + 1) % 2]
            # The first kernel follows torch kernels, which release nothing: it waits in stream order.
            kernel_mode = mode if index else 0
            step_kernel[grid](src, dst, flags[index:], flags[index + 1:], grid[0], N, SHIFT, MODE=kernel_mode,
                              BLOCK=block, **(pdl if index else {}))

    graph = harness.capture(chain)
    us = harness.replay_us(graph) / CHAIN
    expected = torch.roll(start_vector, -SHIFT * CHAIN) + CHAIN
    error = (buffers[CHAIN % 2] - expected).abs().max().item()
    return {"us_per_kernel": us, "max_error": error, "programs": grid[0]}


def main() -> None:
    harness.require_cuda()
    rows = {}
    for programs in (1, 16, 128):
        for name, mode in (("stream", 0), ("pdl", 1), ("flag", 2), ("flag-release-first", 3)):
            try:
                row = run(mode, programs)
            except Exception as error:  # noqa: BLE001 - a probe reports what failed
                row = {"error": f"{type(error).__name__}: {str(error)[:300]}"}
            rows[f"{programs} programs/{name}"] = row
            print(programs, name, row, flush=True)
    harness.write_json({"chain": CHAIN, "rows": rows})


if __name__ == "__main__":
    main()
