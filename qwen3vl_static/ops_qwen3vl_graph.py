# TEMPORARY SHIM until the op split lands
from .kernels_qwen3vl_graph import decode_ops


def make_ops(device, dtype, allow_triton, tuner):
    ops = decode_ops(device, dtype, allow_triton)
    ops.tuner = tuner
    return ops
