"""Compiles, without a GPU, every Triton kernel the model launches on each GPU target named on the command line (sm80
sm89 sm90 sm100), in every form its kernel tuner offers: the decode steps (greedy at batch sizes 1 to 64, and sampled,
top-k sampled), a speculative cycle with an EAGLE-3 draft, a prefill of more tokens than SMs and the vision tower, on
the Qwen3-VL-2B's shapes (one decoder layer and one vision block: the others launch the same kernels), with bf16
weights and, where the target has float8 e4m3 (`takes_e4m3`), FP8 ones. A form is a kernel with one set of on/off
switches, pipeline stages and argument types, compiled at the first tiling met; `--every-tiling` compiles each tiling
and row count (about 400 variants a target, minutes each).

The engine runs on CPU tensors while kernels compile ahead (`compiling_ahead`: the tuner runs every candidate and
times none); each launch compiles for the target instead, with programmatic dependent launch where the target has it
(`takes_pdl`), at the tilings that the SM counts of the target's GPUs give, and checks the shared memory it takes
against the target's. On a target without e4m3 it checks that the FP8 kernels indeed fail to compile there (the model
gives them the torch ops). `test_compile_for_gpus.py` runs this in a process without TRITON_INTERPRET, which would
make the kernels Python functions. Exits non-zero, naming the launch, if a compilation fails, a kernel that no tuner
candidate replaces needs more shared memory than the target has, or a kernel the model has was never launched."""

import argparse
import sys
import time
from contextlib import ExitStack
from unittest import mock

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from qwen3vl_static import Qwen3VLGraphForConditionalGeneration, engine_qwen3vl_graph
from qwen3vl_static.draft_qwen3vl_graph import DraftSpec, Eagle3Draft
from qwen3vl_static.engine_qwen3vl_graph import GraphEngine
from qwen3vl_static.fp8_quantize import quantize_fp8
from qwen3vl_static.ops_qwen3vl_graph import TritonOps
from qwen3vl_static.presets import real_config
from qwen3vl_static.triton_qwen3vl_graph import compiling_ahead, takes_e4m3, takes_pdl
from qwen3vl_static.workloads import eagle3_config

# Compute capability, shared memory a block may take (bytes), SM counts of the GPUs users run (the skinny matmul's K
# split follows them).
TARGETS = {
    "sm80": ((8, 0), 166_912, (108,)),  # A100
    "sm89": ((8, 9), 101_376, (142, 128, 58)),  # L40S, RTX 4090, L4
    "sm90": ((9, 0), 232_448, (132,)),  # H100, H200
    "sm100": ((10, 0), 232_448, (148,)),  # B200
}
# The kernels of the tuner's candidates other than its first (cuBLAS or the unfused kernels): a tiling that needs
# more shared memory than the GPU has is passed over there (`KernelTuner.time_calls`). Every other kernel must fit.
MEASURED_ONLY = {"_skinny_matmul_kernel", "_qkv_norm_rope_write_kernel"}
# Each form of the skinny matmul's rows: unrolled for 1, 2 and 4 (FP8 FMA form), padded to 16, 32 and 64 (`tl.dot`).
BATCH_SIZES = (1, 2, 4, 32, 64)
SIGNATURE_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
                   torch.int32: "i32", torch.int64: "i64", torch.bool: "i1"}
OP_MODULES = [module for name, module in sys.modules.items() if name.startswith("qwen3vl_static.ops_")]


class CompileFailed(Exception):
    """A launch that does not compile for the target, or would not run there."""


class Compiler:
    """`launch` for one target: compiles what `launch` would compile on that GPU (tensors as 16-byte-aligned pointers,
    integers divisible by 16 marked so, as Triton specializes them; constexprs and launch options as given), each
    form once, or with `every_tiling` each variant once."""

    def __init__(self, capability, shared_memory, every_tiling: bool):
        self.target = GPUTarget("cuda", 10 * capability[0] + capability[1], 32)
        self.shared_memory = shared_memory
        self.too_large = 0  # measured-only variants that need more shared memory than the GPU has
        self.pdl = takes_pdl(capability)
        self.every_tiling = every_tiling
        self.compiled = set()

    def __call__(self, kernel, grid, *args, **kwargs):
        options = {name: kwargs.pop(name) for name in ("num_warps", "num_stages") if name in kwargs}
        if "PDL" in kernel.arg_names:
            kwargs["PDL"] = self.pdl
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
        switches = kwargs if self.every_tiling else {name: on for name, on in kwargs.items() if type(on) is bool}
        key = (kernel.fn.__name__, tuple(sorted(signature.items())), tuple(sorted(switches.items())),
               options.get("num_stages"), *((tuple(sorted(options.items())), tuple(sorted(attrs))) if self.every_tiling
                                            else ()))
        if key in self.compiled:
            return
        described = f"{kernel.fn.__name__} {kwargs} {options}"
        try:
            shared = triton.compile(ASTSource(kernel, signature, kwargs, attrs), target=self.target,
                                    options=options).metadata.shared
        except Exception as error:
            raise CompileFailed(f"{described}: {type(error).__name__}: {str(error)[-3000:]}") from error
        self.compiled.add(key)
        if shared > self.shared_memory:
            if kernel.fn.__name__ not in MEASURED_ONLY:
                raise CompileFailed(f"{described} needs {shared} bytes of shared memory, the GPU has "
                                    f"{self.shared_memory}")
            self.too_large += 1

    def kernels(self) -> set:
        """The names of the kernels compiled."""
        return {key[0] for key in self.compiled}


def thin_2b(fp8: bool):
    """The 2B's shapes with one decoder layer and one vision block in bf16, uninitialized (nothing runs on the
    weights), its text linears in FP8 if `fp8`."""
    config = real_config("2b", max_batch_size=max(BATCH_SIZES), static_cache_len=512)
    config.text_config.num_hidden_layers = 1
    config.vision_config.depth = 1
    config.vision_config.deepstack_visual_indexes = [0]
    with torch.device("meta"):
        model = Qwen3VLGraphForConditionalGeneration(config)
    model = model.to_empty(device="cpu").to(torch.bfloat16)
    # The text rotary table (float32, computed at init; `to_empty` left it unwritten), whose layout of the M-RoPE
    # sections picks the decode step's rotary kernel (`rotary_components`).
    text = model.model.language_model
    text.rotary_emb = type(text.rotary_emb)(config.text_config)
    return quantize_fp8(model) if fp8 else model


def run_steps(model, fp8_kernels: bool) -> None:
    """The decode, prefill and vision steps of `model`'s engine (the fused ops on CPU tensors), compiling ahead."""
    with mock.patch.object(engine_qwen3vl_graph, "make_ops",
                           lambda device, dtype, allow, tuner: TritonOps(tuner, fp8_kernels=fp8_kernels)):
        engine = GraphEngine(model, bucketed=True)
    decode, prefill, vision = engine.runners
    # A speculative cycle with a draft of the published format: its layer's kernels (no QK-norm) and the acceptance.
    with torch.device("cpu"):
        spec = DraftSpec.from_config(eagle3_config(model.config, layer_ids=[0, 0, 0]), model.config)
        draft = Eagle3Draft(spec, model.get_input_embeddings()).to(torch.bfloat16)
    speculative = engine.use_draft(draft, 4)
    draft.prepare(engine.ops, engine.cache.capacity + 4, decode.text.rotary_emb, decode.rotary_components)
    # The sampling modes launch the same kernels at every batch size.
    keys = [(speculative, (512, "greedy"))]
    keys += [(decode, key) for key in decode.warmup_keys(BATCH_SIZES, [512], ("greedy",))]
    keys += [(decode, key) for key in decode.warmup_keys([1], [512], ("sample", "sample_top_k"))]
    keys += [(prefill, key) for key in prefill.warmup_keys([1], [256])]  # more tokens than SMs
    keys += [(vision, key) for key in vision.warmup_keys([256], [1])]
    with compiling_ahead(), torch.no_grad():
        for runner, key in keys:
            runner.graph_step(key)[0]()


def launched_kernels() -> set:
    """The names of the kernels the op files launch (their other jitted functions are inlined into them)."""
    return {value.fn.__name__ for module in OP_MODULES for value in vars(module).values()
            if isinstance(value, JITFunction) and value.fn.__name__.endswith("_kernel")}


def compile_target(name, models, every_tiling: bool) -> Compiler:
    """Compile what `models` ({FP8 or not: the thin 2B}) launch on target `name`; returns its compiler."""
    capability, shared_memory, sm_counts = TARGETS[name]
    compiler = Compiler(capability, shared_memory, every_tiling)
    fp8 = takes_e4m3(capability)
    for sms in sm_counts if every_tiling else sm_counts[:1]:  # the SM count changes tilings, not forms
        with ExitStack() as patches:
            for module in OP_MODULES:
                if hasattr(module, "launch"):
                    patches.enter_context(mock.patch.object(module, "launch", compiler))
                if hasattr(module, "sm_count"):
                    patches.enter_context(mock.patch.object(module, "sm_count", lambda device, sms=sms: sms))
            for quantized in (False, True) if fp8 else (False,):
                run_steps(models[quantized], fp8_kernels=fp8)
            if not fp8:  # the FP8 forms, which the model does not launch here, must indeed not compile
                try:
                    run_steps(models[True], fp8_kernels=True)
                except CompileFailed as error:
                    if "fp8e4nv" not in str(error):
                        raise
                else:
                    raise CompileFailed("the FP8 kernels compile: `takes_e4m3` should say so")
    missing = launched_kernels() - compiler.kernels() - (set() if fp8 else {"_dequantize_kernel"})
    if missing:
        raise CompileFailed(f"no step launched {', '.join(sorted(missing))}")
    return compiler


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("targets", nargs="*", help=f"of {', '.join(TARGETS)} (default: all)")
    parser.add_argument("--every-tiling", action="store_true",
                        help="compile each tiling and row count the tuner offers, not each form once")
    args = parser.parse_args()
    if unknown := set(args.targets) - set(TARGETS):
        parser.error(f"unknown targets {', '.join(sorted(unknown))}: the targets are {', '.join(TARGETS)}")
    models = {quantized: thin_2b(fp8=quantized) for quantized in (False, True)}
    for name in args.targets or TARGETS:
        began = time.perf_counter()
        try:
            compiler = compile_target(name, models, args.every_tiling)
        except CompileFailed as error:
            sys.exit(f"{name}: {error}")
        print(f"{name}: {len(compiler.compiled)} kernels compiled in {time.perf_counter() - began:.1f} s ("
              f"{compiler.too_large} tuner candidates need more shared memory than the GPU has)")


if __name__ == "__main__":
    main()
