"""The ``memfit`` command: parses arguments, calls the library, prints. Nothing else.

Each verb lives in ``memfit/commands/<verb>.py`` with ``add_parser(subparsers)`` and
``run(args) -> int``; this file only wires them together and turns MemfitError into a
clear message and exit status 2.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import sys

from memfit.errors import MemfitError

# Verbs in the order --help lists them.
COMMANDS = ("presets", "plan", "verify", "compress", "finetune", "calibrate", "generate")

DESCRIPTION = """\
memfit makes LLM training, fine-tuning and inference fit in the GPU memory you have.

  memfit presets                                    model shapes known offline
  memfit plan --model llama-3.2-3b --task lora --seq 2048 --gpu-memory 8GiB
  memfit verify --model tiny --task lora --seq 256 --device cpu

Run `memfit VERB --help` for each verb's options.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfit", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("-v", "--verbose", action="store_true", help="show debug messages")
    sub = parser.add_subparsers(dest="command", metavar="VERB")
    for name in COMMANDS:
        module = importlib.import_module(f"memfit.commands.{name}")
        command = module.add_parser(sub)
        command.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # the built-in default job: plan the default model
        args = parser.parse_args([*argv, "plan"])
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="memfit: %(message)s")
    try:
        return int(args.handler(args) or 0)
    except MemfitError as err:
        print(f"memfit {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:                             # the disk or the file system (full, permissions): one line
        print(f"memfit {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
