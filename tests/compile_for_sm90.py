"""Compiles the skinny matmul's kernels for an H200 (sm_90, PDL on) at the forms and tilings the tuner offers, without
a GPU: the launchers run on CPU tensors and each launch is compiled ahead of time instead (`test_compile_for_sm90.py`
runs this in a process without TRITON_INTERPRET, which would make the kernels Python functions). Exits non-zero,
naming the launch, if any compilation fails."""

import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from qwen3vl_static import ops_matmul_qwen3vl_graph as matmul
from qwen3vl_static.fp8_qwen3vl_graph import Fp8Weight

SM90 = GPUTarget("cuda", 90, 32)
SIGNATURE_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
                   torch.int32: "i32", torch.int64: "i64"}
compiled = set()


def compile_launch(kernel, grid, *args, **kwargs):
    """What `launch` would compile on an H200: tensors as 16-byte-aligned pointers, integers divisible by 16 marked
    so (as Triton specializes them), constexprs and launch options as given."""
    options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
    if "PDL" in kernel.arg_names:
        kwargs["PDL"] = True
    names = [name for name in kernel.arg_names if name not in kwargs]
    signature, attrs = {}, {}
    for name, arg in zip(names, args, strict=True):
        index = kernel.arg_names.index(name)
        if isinstance(arg, torch.Tensor):
            signature[name] = "*" + SIGNATURE_TYPES[arg.dtype]
            attrs[(index,)] = [["tt.divisibility", 16]]
        elif isinstance(arg, float):
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if arg % 16 == 0 and not kernel.params[index].do_not_specialize:
                attrs[(index,)] = [["tt.divisibility", 16]]
    key = (kernel.fn.__name__, tuple(sorted(signature.items())), tuple(sorted(kwargs.items())),
           tuple(sorted(options.items())), tuple(sorted(attrs)))
    if key in compiled:
        return
    compiled.add(key)
    try:
        triton.compile(ASTSource(kernel, signature, kwargs, attrs), target=SM90, options=options)
    except Exception as error:
        sys.exit(f"{kernel.fn.__name__} {kwargs} {options}: {type(error).__name__}: {str(error)[-3000:]}")


def random_fp8(n, k):
    data = torch.randn(n, k).to(torch.float8_e4m3fn)
    return Fp8Weight(data, torch.ones(triton.cdiv(n, 128), triton.cdiv(k, 128)), 128)


def main():
    matmul.launch = compile_launch
    n, k, heads, kv_heads, head_dim = 1024, 1024, 4, 2, 128
    fp8, bf16 = random_fp8(n, k), torch.randn(n, k, dtype=torch.bfloat16)
    ticket = torch.zeros(1 << 16, dtype=torch.int32)  # as TritonOps.TICKETS
    rule = matmul.skinny_config(n, k, 132)
    qkv = random_fp8((heads + 2 * kv_heads) * head_dim, k)
    norms = torch.ones(head_dim, dtype=torch.bfloat16), torch.ones(head_dim, dtype=torch.bfloat16), 1e-6
    for rows in (1, matmul.FMA_MAX_ROWS, 40):
        x, hidden = torch.randn(rows, k, dtype=torch.bfloat16), torch.randn(rows, n, dtype=torch.bfloat16)
        # The FP8 forms at their measured tilings, and unsplit.
        fp8_configs = [*matmul.fp8_dot_configs(fp8), *matmul.fma_configs(fp8, rows)[:2], rule,
                       rule._replace(split_k=1)]
        for config in fp8_configs:
            matmul.skinny_matmul(x, fp8, config, ticket=ticket)
            if config.split_k > 1 and rows <= matmul.DOT_ROWS:
                matmul.skinny_matmul(x, fp8, config, add_rms_norm=(hidden, hidden[0], 1e-6), ticket=ticket)
        for config in (fp8_configs[1], rule, rule._replace(split_k=1)):
            matmul.skinny_matmul(x, fp8, config, swiglu=True, ticket=ticket)
        cache = torch.zeros(rows, kv_heads, 4, head_dim, dtype=torch.bfloat16)
        rotary = (torch.randn(rows, head_dim, dtype=torch.bfloat16),) * 2
        slots = torch.zeros(rows, dtype=torch.int64)
        for config in (matmul.fp8_dot_configs(qkv)[1], *matmul.fma_configs(qkv, rows)[:2]):
            matmul.fused_qkv(x, qkv, heads, norms, rotary, cache, cache.clone(), slots, slots, config, ticket)
        matmul.skinny_matmul(x, bf16, rule, ticket=ticket)
    print(f"{len(compiled)} kernels compiled for sm_90")


if __name__ == "__main__":
    main()
