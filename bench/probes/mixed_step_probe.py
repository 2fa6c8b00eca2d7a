"""Would a mixed step pay: one layer walk over B decoding rows and T tokens of a prompt (projections, norms and MLP
over both; each kind its own attention), against the decode step and the prefill run one after the other?

Decoding is bound by memory (weights and KV) and prefill by compute, so together they could take about the longer of
the two (docs/design.md, continuous batching). The mixed forward here is built from the runners' own pieces
(`DecodeRunner.layer_inputs`, `PrefillRunner.layer_inputs`, `decoder_layers`): the decoding rows' QKV projection stays
fused into their attention, so the QKV weights are read twice. B rows hold P-token text contexts; the prompt is a
fresh text prompt of T tokens in a row of its own.

On the H200 (bf16 2B, CUDA graphs of each of the three, replays timed with CUDA events; JSON to $OUT): for each B and
T, the decode step, the prefill, both one after the other, the mixed step, and the mixed forward's logits against the
two apart. `--check` instead runs the tiny model in fp32 on the CPU: the mixed forward's logits and cache writes
against the two apart (no timing). Run: `python bench/probes/mixed_step_probe.py [--check] [--batches 64 256 512]
[--prompt-tokens 256 512 1024] [--context 300]`.
"""

import argparse
import statistics

import torch

from qwen3vl_static.decoder_qwen3vl_graph import decoder_layers


class Setup:
    """`rows` decoding rows of `context` cached tokens each (rows 0..rows-1), and a prompt for the row after them
    (`prompt`), on `model`'s engine."""

    def __init__(self, model, rows: int, context: int, generator):
        engine = model.graph_engine()
        self.engine, self.rows, self.generator = engine, rows, generator
        self.decode, self.prefill, self.ops, self.text = engine.decode, engine.prefill, engine.ops, engine.text
        self.deepstack_layers = len(model.config.vision_config.deepstack_visual_indexes)
        device = engine.device
        # The decoding rows' contexts, prefilled (eagerly, at their exact size) into cache rows 0..rows-1.
        ids, positions = self.text_prompt(rows, context)
        cache_rows = torch.arange(rows, device=device)
        self.prefill.run(ids, None, positions, torch.zeros_like(ids), rows=cache_rows)
        decode = self.decode
        decode.open_slots(0)
        decode.admit(cache_rows, ids[:, -1], torch.full((3, rows), context, device=device),
                     torch.ones(rows, context, dtype=torch.long, device=device))
        decode.continue_rows(rows, context)
        self.kv_len = next(size for size in decode.cache_buckets if size > context)
        self.decode_logits = self.prompt_logits = None

    def text_prompt(self, batch: int, length: int) -> tuple:
        """Random token ids `(batch, length)` and their text M-RoPE positions, on the device."""
        device, vocab = self.engine.device, self.text.embed.shape[0]
        ids = torch.randint(0, vocab, (batch, length), generator=self.generator).to(device)
        return ids, torch.arange(length, device=device).expand(3, batch, length).contiguous()

    def prompt(self, tokens: int) -> None:
        """A fresh `tokens`-token text prompt for the row after the decoding rows: static tensors, as a prefill
        graph's buffers would hold them."""
        device = self.engine.device
        self.tokens = tokens
        self.ids, self.positions = self.text_prompt(1, tokens)
        self.modality = torch.zeros_like(self.ids)
        self.visual = torch.zeros(1, self.text.embed.shape[1], device=device, dtype=self.engine.dtype)
        self.deepstack = [self.visual] * self.deepstack_layers
        self.attendable = torch.ones(1, tokens, dtype=torch.bool, device=device)
        self.start = torch.zeros(1, dtype=torch.long, device=device)
        self.last = torch.full((1,), tokens - 1, dtype=torch.long, device=device)
        self.row = torch.full((1,), self.rows, dtype=torch.long, device=device)

    def decode_step(self):
        self.decode_logits = self.decode.forward(self.rows, self.kv_len)

    def prefill_step(self):
        self.prompt_logits = self.prefill.forward(self.ids, self.positions, self.attendable, self.modality, self.visual,
                                                  self.deepstack, self.start, self.last, self.row, False)

    def both(self):
        self.decode_step()
        self.prefill_step()

    def mixed_step(self):
        """One walk over the decoding rows and the prompt's tokens."""
        ops, text, rows = self.ops, self.text, self.rows
        decode_hidden, decode_x, decode_attend = self.decode.layer_inputs(rows, self.kv_len)
        prompt_hidden, prompt_attend, added = self.prefill.layer_inputs(
            self.ids, self.positions, self.attendable, self.modality, self.visual, self.deepstack, self.start,
            self.row, False)
        hidden = torch.cat([decode_hidden, prompt_hidden])
        x = torch.cat([decode_x, ops.rms_norm(prompt_hidden, *text.first_norm)])

        def attend(layer, keys, values, x):
            return torch.cat([decode_attend(layer, keys, values, x[:rows]),
                              prompt_attend(layer, keys, values, x[rows:])])

        added = [torch.cat([features.new_zeros(rows, features.shape[1]), features]) for features in added]
        x = decoder_layers(ops, text.layers, self.engine.cache.full_keys, self.engine.cache.full_values, hidden, x,
                           attend, added)
        self.decode_logits = ops.linear(x[:rows], text.lm_head)
        self.prompt_logits = ops.linear(x[rows + self.tokens - 1:], text.lm_head).float()

    def cache_rows(self) -> list:
        """The K/V this setup's steps write: the decoding rows' next slot and the prompt's row."""
        slot, caches = self.decode.cache_lens[0].item(), self.engine.cache.full_keys + self.engine.cache.full_values
        return [cache[: self.rows, :, slot].clone() for cache in caches] + \
               [cache[self.rows, :, : self.tokens].clone() for cache in caches]


def compare(setup) -> dict:
    """The mixed forward's logits and cache writes against the decode step's and the prefill's."""
    setup.both()
    decode_logits, prompt_logits, written = setup.decode_logits.float(), setup.prompt_logits.float(), setup.cache_rows()
    setup.mixed_step()

    def relative(got, expected):
        return ((got.float() - expected.float()).norm() / expected.float().norm()).item()

    return {"decode_logits_relative_error": relative(setup.decode_logits, decode_logits),
            "prompt_logits_relative_error": relative(setup.prompt_logits, prompt_logits),
            "decode_argmax_equal": (setup.decode_logits.float().argmax(-1) == decode_logits.argmax(-1)).float()
            .mean().item(),
            "cache_relative_error": max(relative(got, expected) for got, expected in zip(setup.cache_rows(), written))}


def check() -> None:
    from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
    from qwen3vl_static.presets import tiny_config

    torch.manual_seed(0)
    model = Qwen3VLGraphForConditionalGeneration(tiny_config(static_cache_len=64, max_batch_size=4)).eval()
    with torch.no_grad():
        setup = Setup(model, rows=3, context=20, generator=torch.Generator().manual_seed(1))
        setup.prompt(16)
        result = compare(setup)
    print(result)
    assert result["decode_argmax_equal"] == 1.0 and max(
        result[key] for key in ("decode_logits_relative_error", "prompt_logits_relative_error",
                                "cache_relative_error")) < 1e-5, result


def replay_ms(graph, replays: int = 20) -> float:
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(replays)]
    torch.cuda._sleep(2_000_000)
    for start, end in events:
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def measure(args) -> None:
    import harness
    from qwen3vl_static.workloads import build_ours

    harness.require_cuda()
    rows_needed = max(args.batches) + 1
    model = build_ours(torch.device("cuda"), torch.bfloat16, max_batch_size=rows_needed,
                       static_cache_len=max(max(args.prompt_tokens), args.context + 64))
    results, graphs = [], []  # every graph kept: a graph pool whose graphs are all gone cannot take a new capture
    with torch.no_grad():
        for rows in args.batches:
            setup = Setup(model, rows, args.context, torch.Generator().manual_seed(rows))
            for tokens in args.prompt_tokens:
                setup.prompt(tokens)
                row = {"decode_rows": rows, "context": args.context, "prompt_tokens": tokens, **compare(setup)}
                capturer = setup.engine.capturer
                for name, step in (("decode_ms", setup.decode_step), ("prefill_ms", setup.prefill_step),
                                   ("both_ms", setup.both), ("mixed_ms", setup.mixed_step)):
                    graphs.append(capturer.capture(step, name=f"{name} {rows} x {tokens}"))
                    row[name] = replay_ms(graphs[-1])
                row["mixed_saves_ms"] = row["both_ms"] - row["mixed_ms"]
                print(row, flush=True)
                results.append(row)
            del setup
            torch.cuda.empty_cache()
    harness.write_json({"rows": results})


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--batches", type=int, nargs="+", default=[64, 256, 512])
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--context", type=int, default=300)
    args = parser.parse_args()
    check() if args.check else measure(args)


if __name__ == "__main__":
    main()
