"""qwen3vl-static: Qwen3-VL with a static-cache, CUDA-graph decode loop, as a plain transformers model.

Importing the package registers the classes with the Auto classes, so `from_pretrained` on a converted
checkpoint resolves to them with or without `trust_remote_code`.
"""

import sys

__version__ = "0.1.0"
__all__ = ["ASStaticCache", "Qwen3VLGraphConfig", "Qwen3VLGraphForConditionalGeneration", "Qwen3VLGraphModel"]


def _cli_starting() -> bool:
    """Whether `python -m qwen3vl_static` is importing the package on its way to `__main__` (sys.argv[0] is "-m"
    while Python locates the main module). The command line then imports torch and transformers only in a command
    that needs them (`auto_classes`), so `--help` and argument errors answer at once."""
    argv = getattr(sys, "orig_argv", [])
    return sys.argv[:1] == ["-m"] and any(flag == "-m" and name == __name__ for flag, name in zip(argv, argv[1:]))


if not _cli_starting():
    from .auto_classes import (
        ASStaticCache, Qwen3VLGraphConfig, Qwen3VLGraphForConditionalGeneration, Qwen3VLGraphModel,
    )
