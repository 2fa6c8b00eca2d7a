"""What does one chunk of streaming rows cost the batch's thread on the host, beside the model? The continuous batch of a
tiny model on the CPU with its decode forward stubbed out (a logits row that draws one token: the steps' sampling and
bookkeeping stay), `--rows` streaming requests of `--new-tokens` tokens each, every output handed to a result handler
on an asyncio loop as `serve`'s engine process takes them: every token so far (the default) and only the new tokens
(`register_result_handler(..., delta=True)`, what the engine uses). Reported per form: the batch's wall time per
chunk, median of the runs. On a GPU the forward is a graph replay instead; the rest is the same host work. CPU only.

Usage: python bench/probes/stream_turn_probe.py [--rows 64] [--new-tokens 128 1500] [--runs 3]
"""

import argparse
import asyncio
import statistics
import time

import torch

import harness
from qwen3vl_static import Qwen3VLGraphForConditionalGeneration
from qwen3vl_static.decode_qwen3vl_graph import DecodeRunner
from qwen3vl_static.presets import tiny_config, tiny_inputs

TOKEN = 5  # what the stubbed forward draws: not an EOS id of the requests


def stubbed_forward(self, rows: int, kv_len: int, record=()) -> torch.Tensor:
    logits = torch.zeros(rows, self.text.lm_head.shape[0])
    logits[:, TOKEN] = 1.0
    return logits


def chunk_ms(rows: int, new_tokens: int, delta: bool) -> float:
    """The batch's wall time per chunk while `rows` streaming requests of `new_tokens` tokens run to their end."""
    torch.manual_seed(0)
    model = Qwen3VLGraphForConditionalGeneration(
        tiny_config(max_batch_size=rows, static_cache_len=new_tokens + 64)).eval()
    inputs = tiny_inputs([[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]])
    manager = model.init_continuous_batching()

    async def stream() -> float:
        ended, left = asyncio.Event(), [rows]

        def handler(output):
            if output.status.name in ("FINISHED", "FAILED"):
                left[0] -= 1
                if not left[0]:
                    ended.set()

        manager.start()
        for index in range(rows):
            manager.register_result_handler(f"r{index}", handler, delta=delta)
            manager.add_request(**inputs, request_id=f"r{index}", max_new_tokens=new_tokens, streaming=True,
                                eos_token_id=[TOKEN + 1])
        began = time.perf_counter()
        await ended.wait()
        return time.perf_counter() - began

    try:
        seconds = asyncio.run(stream())
    finally:
        manager.stop()
    return 1000 * seconds / manager.stats["chunks"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, nargs="+", default=[128, 1500])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    DecodeRunner.forward = stubbed_forward
    rows = []
    for new_tokens in args.new_tokens:
        for form in ("every_token", "delta"):
            runs = [chunk_ms(args.rows, new_tokens, form == "delta") for _ in range(args.runs)]
            rows.append({"new_tokens": new_tokens, "outputs": form, "chunk_ms": statistics.median(runs),
                         "runs_ms": runs})
            print(f"{new_tokens} tokens, outputs with {form.replace('_', ' ')}: {statistics.median(runs):.3f} ms a "
                  f"chunk (runs {min(runs):.3f}-{max(runs):.3f})")
    harness.write_cpu_json({"rows": args.rows, "forms": rows})


if __name__ == "__main__":
    main()
