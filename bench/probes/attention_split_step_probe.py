"""How should flash-decoding split the cache, measured in the whole decode step? (H200; JSON to $OUT.)

`split_tiles` gives each program the fewest tiles (a power of two) that keep a row within MAX_SPLITS_PER_ROW splits
and the launch within ONE_TILE_PROGRAMS programs of one tile or MAX_PROGRAMS of more. Alone, one-tile programs at
batch 8 of a 1024-slot bucket were faster with one pipeline stage, or with two tiles each
(`attention_launch_probe.py`); the step overlaps kernels, so this times the rule's variants where they change the
launch, each in a bf16 model built for the shape (decode ms/step as the benchmark's slope): every launch capped at
2048, 1024, 512 or 256 programs (2048: the rule before ONE_TILE_PROGRAMS), and one-tile programs launched with one
stage instead of Triton's default three. The shipped rule runs first and again last (run-to-run spread). Each variant
patches the module's names before its model is built and captured.
Run: python bench/probes/attention_split_step_probe.py
"""

from contextlib import contextmanager

import harness
from qwen3vl_static import ops_attention_qwen3vl_graph as attention
from qwen3vl_static.bench import LONG

SHAPES = [(1, 512), (4, 512), (8, 512), (16, 512), (64, 256), (8, 4000)]  # (batch, prompt tokens)
KV_HEADS = 8
SHIPPED_LAUNCH = attention.launch


def one_stage_single_tiles(kernel, grid, *args, **kwargs):
    """`launch`, with one pipeline stage for flash-decoding programs of one tile."""
    if kernel is attention._decode_attention_kernel and kwargs.get("TILES") == 1:
        kwargs["num_stages"] = 1
    return SHIPPED_LAUNCH(kernel, grid, *args, **kwargs)


@contextmanager
def rule(cap=None, one_stage=False):
    """The shipped split rule, or every launch capped at `cap` programs; one-tile programs at one stage."""
    caps = attention.ONE_TILE_PROGRAMS, attention.MAX_PROGRAMS
    if cap is not None:
        attention.ONE_TILE_PROGRAMS = attention.MAX_PROGRAMS = cap
    attention.launch = one_stage_single_tiles if one_stage else SHIPPED_LAUNCH
    try:
        yield
    finally:
        (attention.ONE_TILE_PROGRAMS, attention.MAX_PROGRAMS), attention.launch = caps, SHIPPED_LAUNCH


def kv_bucket(context) -> int:
    return 1 << (context + LONG - 1).bit_length()


def main() -> None:
    harness.require_cuda()
    rows = []
    for batch, context in SHAPES:
        kv_len = kv_bucket(context)
        row = {"batch_size": batch, "context_tokens": context, "kv_bucket": kv_len, "ms_per_step": {}, "tiles": {}}
        variants = [("shipped", None, False)]
        with rule():
            seen = {attention.split_tiles(batch, KV_HEADS, kv_len)}
        for cap in (2048, 1024, 512, 256):
            with rule(cap):
                tiles = attention.split_tiles(batch, KV_HEADS, kv_len)
            if tiles not in seen:
                seen.add(tiles)
                variants.append((f"every launch at most {cap} programs", cap, False))
        with rule():
            if attention.split_tiles(batch, KV_HEADS, kv_len) == 1:
                variants.append(("one stage for one-tile programs", None, True))
        variants.append(("shipped again", None, False))
        for name, cap, one_stage in variants:
            with rule(cap, one_stage):
                row["tiles"][name] = attention.split_tiles(batch, KV_HEADS, kv_len)
                row["ms_per_step"][name] = harness.decode_ms(batch, context, max_batch_size=max(8, batch),
                                                             static_cache_len=8192 if context > 1024 else 1024)
            print(f"batch {batch} at {context} ({kv_len} slots): {name} (tiles {row['tiles'][name]}) "
                  f"{row['ms_per_step'][name]:.3f} ms/step", flush=True)
        rows.append(row)
    harness.write_json({"rows": rows})


if __name__ == "__main__":
    main()
