"""Command line: `python -m qwen3vl_static <command> ...`. Not uploaded to the Hub."""

import argparse
import sys

from .convert import convert


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qwen3vl_static")
    commands = parser.add_subparsers(dest="command", required=True)

    converter = commands.add_parser(
        "convert",
        help="turn a stock Qwen3-VL checkpoint into a custom-code repo",
        description="Copy a stock Qwen3-VL checkpoint to DST as a ready custom-code repo for this package "
        "(same weights; new config.json, module files and model card).",
    )
    converter.add_argument("src", metavar="SRC", help="checkpoint folder or Hub repo id")
    converter.add_argument("dst", metavar="DST", help="output folder: new, empty or a previous conversion")
    converter.add_argument("--push-to-hub", metavar="REPO_ID", help="upload DST to this Hub repo when done")
    converter.add_argument("--private", action="store_true", help="create the Hub repo as private")
    converter.set_defaults(run=_convert)

    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except Exception as error:  # a command line reports any failure as one line, not a traceback
        print(f"error: {' '.join(str(error).split())}", file=sys.stderr)
        return 1


def _convert(args) -> int:
    dst = convert(args.src, args.dst, push_to_hub=args.push_to_hub, private=args.private)
    print(f"converted {args.src} to {dst}" + (f" and pushed it to {args.push_to_hub}" if args.push_to_hub else ""))
    return 0
