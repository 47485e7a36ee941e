"""The ``memfit`` command: parses arguments, calls the library, prints. Nothing else.

Each verb lives in ``memfit/commands/<verb>.py`` with ``add_parser(subparsers)`` and
``run(args) -> int``; this file only wires them together and turns MemfitError into a
clear message and exit status 2.
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import signal
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


def _add_global_options(parser: argparse.ArgumentParser, default) -> None:
    """The options every verb takes, before the verb (``default`` False) or after it (``default`` SUPPRESS: a verb's
    parser writes its defaults over what was parsed before the verb, so it must set none)."""
    parser.add_argument("-v", "--verbose", action="store_true", default=default, help="show debug messages")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfit", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_global_options(parser, default=False)
    sub = parser.add_subparsers(dest="command", metavar="VERB")
    for name in COMMANDS:
        module = importlib.import_module(f"memfit.commands.{name}")
        command = module.add_parser(sub)
        _add_global_options(command, default=argparse.SUPPRESS)
        command.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # the built-in default job: plan the default model
        args = parser.parse_args([*argv, "plan"])
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="memfit: %(message)s")
    previous = signal.signal(signal.SIGTERM, _interrupt)   # as Ctrl-C: the writers' cleanups run (kill's default
    try:                                                   # had left their temporary files)
        return int(args.handler(args) or 0)
    except MemfitError as err:
        print(f"memfit {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:                            # `memfit generate ... | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())   # no second error as Python flushes stdout
        return 128 + signal.SIGPIPE
    except OSError as err:                             # the disk or the file system (full, permissions): one line
        print(f"memfit {args.command}: error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    sys.exit(main())
