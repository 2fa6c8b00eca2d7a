"""`bench --speculative`: speculative decoding's parts on the GPU, beside the plain decode step of the same run.

Random weights make a draft's acceptance meaningless, so the loop is measured in parts and as a whole at known
acceptance: a cycle does the same work whatever the draft proposes (one graph: a verify step of K + 1 rows, the
draft's layer over them and its K-step chain), so ms per generated token at a mean of A tokens a cycle is the cycle's
time / A. Measured, per K: the verify step alone, the draft alone, the cycle graph, and `generate` end to end with
(a) a random draft of the published 2B format (few proposals kept: its output must be the plain loop's) and (b) the
same draft and target with their final norms at zero, so both always pick token 0 and every cycle keeps K + 1 tokens
(the loop's whole overhead, host included). Rows at acceptance 1.5 / 2.5 / 3.5 are projected from (b)'s cycle time
and say so.
"""

import statistics
import tempfile
import time

import torch

from .capture_qwen3vl_graph import GraphCapturer
from .workloads import build_ours, generate_exactly_as_asked, image_prompt, save_random_draft

SHORT, LONG = 64, 320  # new tokens of the two timed calls; their difference gives ms per token
DRAFT_TOKENS = range(1, 8)  # K: verify steps of 2..8 rows
ACCEPTANCE = (1.5, 2.5, 3.5)  # mean tokens kept per cycle, the projected rows


def replay_ms(graph, state, counter, chunk: int, rounds: int = 15) -> dict:
    """Median (and spread) over `rounds` chunks of ms per replay of `graph`, replayed `chunk` times back to back as the
    loops do. Each chunk starts from the same `state` (what the graph advances; restored afterwards), with `counter`
    (the index its outputs are written at: its buffers hold one chunk) at zero."""
    times = []
    for _ in range(rounds):
        with GraphCapturer.restoring(state):
            counter.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(chunk):
                graph.replay()
            end.record()
            end.synchronize()
        times.append(start.elapsed_time(end) / chunk)
    return {"median": statistics.median(times), "min": min(times), "max": max(times)}


def per_token_ms(model, prompt) -> tuple:
    """ms per generated token (the slope between SHORT and LONG new tokens, after an untimed call), median of 3, with
    the LONG call's output."""
    slopes = []
    for _ in range(3):
        times = {}
        for new in (SHORT, SHORT, LONG):
            torch.cuda.synchronize()
            began = time.perf_counter()
            out = model.generate(**prompt, max_new_tokens=new)
            torch.cuda.synchronize()
            times[new] = time.perf_counter() - began
            assert out.shape[1] - prompt["input_ids"].shape[1] == new
        slopes.append(1000 * (times[LONG] - times[SHORT]) / (LONG - SHORT))
    return {"median": statistics.median(slopes), "min": min(slopes), "max": max(slopes)}, out


def part_times(model, k: int, kv_len: int) -> dict:
    """The cycle's parts, each captured as a graph of its own and replayed: verify (with acceptance), draft, cycle."""
    engine = model._engine
    runner, capturer = engine.speculative, engine.capturer
    predicted = torch.zeros(k + 1, dtype=torch.long, device="cuda")
    runner.chunk_cycle.zero_()  # the captures' warm-up cycles write their outputs from there on
    graphs = {
        "verify_ms": capturer.capture(lambda: runner.verify_and_accept(kv_len, "greedy"), runner.state(),
                                       name="verify"),
        "draft_ms": capturer.capture(lambda: runner.propose(kv_len, predicted), name="draft"),
        "cycle_ms": runner.graph((kv_len, "greedy")),
    }
    return {name: replay_ms(graph, runner.state(), runner.chunk_cycle, runner.cycles_per_sync)
            for name, graph in graphs.items()}


@torch.no_grad()
def speculative_rows(args) -> dict:
    """The measurements above on the `args.model` preset (bf16, an image prompt of 448x448 + 30 tokens)."""
    device = torch.device("cuda")
    model = build_ours(device, torch.bfloat16, args.model, static_cache_len=1024)
    generate_exactly_as_asked(model)
    prompt = image_prompt(model.config, device, torch.Generator().manual_seed(0))
    kv_len = 1024  # the cache bucket of the LONG call's last cycles
    plain, plain_out = per_token_ms(model, prompt)
    decode = model._engine.decode
    plain_step = replay_ms(decode.graph((1, kv_len, "greedy")), decode.state(), decode.chunk_step, decode.steps_per_sync)
    folder = save_random_draft(model.config, tempfile.mkdtemp(), torch.Generator().manual_seed(1))
    draft, rows = model.load_draft(folder), []
    for k in DRAFT_TOKENS:
        model.use_draft(draft, k)
        random_draft, out = per_token_ms(model, prompt)
        kept = model.speculative_stats["kept_per_cycle"]
        same = (out == plain_out)[0, prompt["input_ids"].shape[1]:]
        model.set_cuda_graphs(False)
        eager = model.generate(**prompt, max_new_tokens=LONG)
        model.set_cuda_graphs(True)
        parts = part_times(model, k, kv_len)
        # Always accepted: both final norms at zero, so every logit is 0 and both pick token 0.
        norms = (model.model.language_model.norm.weight, draft.norm.weight)
        saved = [norm.clone() for norm in norms]
        for norm in norms:
            norm.zero_()
        accepted, _ = per_token_ms(model, prompt)
        always = model.speculative_stats["kept_per_cycle"]
        for norm, value in zip(norms, saved):
            norm.copy_(value)
        cycle = accepted["median"] * (k + 1)  # ms per cycle, host included
        rows.append({
            "num_draft_tokens": k, "verify_rows": k + 1, **{name: value for name, value in parts.items()},
            "random_draft_ms_per_token": random_draft, "random_draft_mean_kept": sum(kept) / len(kept),
            "random_draft_tokens_equal_plain_before_first_difference": int(same.long().cumprod(0).sum()),
            "graph_equals_eager": bool(torch.equal(out, eager)),
            "always_accepted_ms_per_token": accepted, "always_accepted_kept_per_cycle": sorted(set(always)),
            "cycle_ms_end_to_end": cycle,
            "projected_ms_per_token": {str(a): cycle / a for a in ACCEPTANCE if a <= k + 1},
        })
        print(f"K={k}: verify {parts['verify_ms']['median']:.3f} ms, draft {parts['draft_ms']['median']:.3f} ms, "
              f"cycle {parts['cycle_ms']['median']:.3f} ms (graph) / {cycle:.3f} ms (end to end); always accepted "
              f"{accepted['median']:.3f} ms/token; projected at 2.5: {cycle / 2.5:.3f} ms/token", flush=True)
    model.use_draft(None)
    return {"prompt_tokens": prompt["input_ids"].shape[1], "new_tokens": [SHORT, LONG], "kv_bucket": kv_len,
            "plain_ms_per_token": plain, "plain_step_graph_ms": plain_step, "rows": rows}
