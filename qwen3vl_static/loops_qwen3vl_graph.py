# Copyright 2026 The qwen3vl-static Authors. All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""The decode loops: what runs after prefill until every row stops.

- `device_plan` reads transformers' logits processors and stopping criteria and says whether the device loop can
  reproduce them (greedy, or temperature / top-k / top-p in the sampler's order, max length, a few EOS ids);
- `device_loop` then runs `steps_per_sync` decode steps per host read, sampling and EOS checks inside the graphs, one
  chunk queued ahead;
- `host_loop` otherwise runs transformers' `_sample` loop body with the decode runner's graph-replayed step as its
  forward, so any processor or criterion works.
"""

from collections import deque

import torch
from torch import nn
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import EosTokenCriteria, MaxLengthCriteria

MAX_EOS_IDS = 8  # EOS ids the decode step checks in the graph
# Candidates of the "sample_top_k" mode: rows whose top-k keeps at most this many tokens draw from the largest this
# many scores (a partial selection) instead of the whole sorted vocabulary, the same distribution.
TOP_K_CANDIDATES = 64


def device_plan(logits_processor, stopping_criteria, generation_config) -> dict | None:
    """What the device loop needs to reproduce these processors and criteria, or None when it cannot.

    Covered: greedy, or sampling with temperature, top-k, top-p and min-p, each at most once and in that order (the
    sampler's, which is transformers' own when it builds them from the generation config), stopping on max length
    and up to MAX_EOS_IDS EOS ids. The mode: "greedy", "sample_top_k" (a top-k of at most TOP_K_CANDIDATES) or
    "sample". Anything else (other processors or orders, stop strings, custom criteria,
    returned scores) runs the host loop.
    """
    if generation_config.return_dict_in_generate and (generation_config.output_scores or generation_config.output_logits):
        return None
    plan = {"mode": "sample" if generation_config.do_sample else "greedy",
            "temperature": 1.0, "top_k": None, "top_p": None, "min_p": None, "eos_ids": [], "max_length": None}
    applied = -1  # the sampler's step of the last warper seen
    for processor in logits_processor:
        kind = type(processor)
        if kind is TemperatureLogitsWarper:
            step, name, value = 0, "temperature", float(processor.temperature)
        elif kind is TopKLogitsWarper and processor.filter_value == -float("inf"):
            step, name, value = 1, "top_k", int(processor.top_k)
        elif kind is TopPLogitsWarper and processor.filter_value == -float("inf") and processor.min_tokens_to_keep == 1:
            step, name, value = 2, "top_p", float(processor.top_p)
        elif kind is MinPLogitsWarper and processor.filter_value == -float("inf") and processor.min_tokens_to_keep == 1:
            step, name, value = 3, "min_p", float(processor.min_p)
        else:
            return None
        if step <= applied:
            return None
        applied, plan[name] = step, value
    if plan["mode"] == "greedy" and len(logits_processor):
        return None
    for criteria in stopping_criteria:
        if type(criteria) is MaxLengthCriteria:
            plan["max_length"] = criteria.max_length
        elif type(criteria) is EosTokenCriteria:
            plan["eos_ids"] = criteria.eos_token_id.tolist()
        else:
            return None
    if plan["max_length"] is None or len(plan["eos_ids"]) > MAX_EOS_IDS:
        return None
    if plan["mode"] == "sample" and plan["top_k"] is not None and plan["top_k"] <= TOP_K_CANDIDATES:
        plan["mode"] = "sample_top_k"
    return plan


def first_tokens(runner, logits, mode: str, rows) -> torch.Tensor:
    """The tokens after a prefill's `logits` for the runner's `rows` (a slice or an index tensor): the argmax, or
    drawn eagerly with the same sampler and the rows' own parameters."""
    if mode == "greedy":
        return logits.argmax(dim=-1)
    return runner.sample(logits, rows, mode)


def candidates(mode: str) -> int | None:
    """The sampler's candidates in a sampling `mode` (None: the whole vocabulary)."""
    return TOP_K_CANDIDATES if mode.startswith("sample_top_k") else None


def device_loop(runner, input_ids, logits, plan, generation_config, streamer) -> torch.Tensor:
    """Sampling and EOS checks on the device, `steps_per_sync` steps per host read, one chunk queued ahead, from the
    prefill's `logits`; returns the sequences (prompt and new tokens) on the host."""
    pad_id = generation_config._pad_token_tensor
    runner.set_sampling(plan["temperature"], plan["top_k"], plan["top_p"], plan["eos_ids"], pad_id, plan["min_p"])
    batch = input_ids.shape[0]
    tokens = first_tokens(runner, logits, plan["mode"], slice(0, batch))
    unfinished = ~(tokens[:, None] == runner.eos_ids).any(dim=-1)  # the in-graph rule, on the first token
    runner.unfinished[:batch] = unfinished
    sequences = [input_ids.cpu(), tokens[:, None].cpu()]
    if streamer is not None:
        streamer.put(sequences[-1][:, 0])
    remaining = plan["max_length"] - input_ids.shape[1] - 1
    if remaining > 0 and bool(unfinished.any()):
        runner.input_ids[:batch, 0] = tokens
        # One chunk ahead: the next chunk is queued before this one's tokens are read, so the GPU never waits for the
        # host. When every row finishes, the chunk already queued is computed and dropped.
        chunks, queued = deque(), 0
        while queued < remaining or chunks:
            while queued < remaining and len(chunks) < 2:
                steps = min(runner.steps_per_sync, remaining - queued)
                chunks.append((steps, runner.issue(steps, plan["mode"])))
                queued += steps
            steps, handle = chunks.popleft()
            chunk, alive = runner.collect(handle)
            all_done = (~alive.any(dim=0)).nonzero()
            keep = int(all_done[0]) + 1 if len(all_done) else steps  # stock stops at the step all rows finish
            sequences.append(chunk[:, :keep])
            if streamer is not None:
                for column in chunk[:, :keep].T:
                    streamer.put(column)
            if len(all_done):
                break
    return torch.cat(sequences, dim=1)


def host_loop(runner, input_ids, logits, logits_processor, stopping_criteria, generation_config, streamer):
    """Transformers' `_sample` loop body with the decode runner's (graph-replayed) step as the forward; returns
    (sequences, scores or None, raw logits or None) as the generation config asks to return them."""
    keep_scores = generation_config.return_dict_in_generate and generation_config.output_scores
    keep_logits = generation_config.return_dict_in_generate and generation_config.output_logits
    pad_token_id = generation_config._pad_token_tensor
    has_eos_stopping_criteria = any(hasattr(criteria, "eos_token_id") for criteria in stopping_criteria)
    scores, raw_logits = [], []
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=input_ids.device)
    while True:
        next_scores = logits_processor(input_ids, logits)
        if keep_scores:
            scores.append(next_scores)
        if keep_logits:
            raw_logits.append(logits)
        if generation_config.do_sample:
            next_tokens = torch.multinomial(nn.functional.softmax(next_scores, dim=-1), num_samples=1).squeeze(1)
        else:
            next_tokens = torch.argmax(next_scores, dim=-1)
        if has_eos_stopping_criteria:
            next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        if streamer is not None:
            streamer.put(next_tokens.cpu())
        unfinished = unfinished & ~stopping_criteria(input_ids, tuple(scores) if keep_scores else None)
        if unfinished.max() == 0:
            break
        logits = runner.logits_step(next_tokens).clone()
    return input_ids, (scores if keep_scores else None), (raw_logits if keep_logits else None)
