"""The ``memfit`` command: parses arguments, calls the library, prints. Nothing else.

Each verb lives in ``memfit/commands/<verb>.py`` with ``add_parser(subparsers)`` and
``run(args) -> int``; this file only wires them together and turns what ends a command into one line and an exit
status: a MemfitError 2, the disk or file system (an OSError) 1, Ctrl-C 130, SIGTERM 143 (both after the writers'
cleanups have run), and a reader that stopped reading 141, silently (what rich prints exits 1, silently: rich
handles that itself).
"""
from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import signal
import sys
import threading

import memfit
from memfit.errors import MemfitError

# Verbs in the order --help lists them.
COMMANDS = ("presets", "plan", "verify", "compress", "finetune", "calibrate", "generate")

DESCRIPTION = """\
memfit makes LLM training, fine-tuning and inference fit in the GPU memory you have.

  memfit presets                                    model shapes known offline
  memfit plan --model llama-3.2-3b --task lora --seq 2048 --gpu-memory 8GiB
  memfit verify --model tiny --task lora --seq 256 --device cpu

Run `memfit VERB --help` for each verb's options. `memfit` alone runs `memfit plan` on its built-in default job.
"""


def _add_global_options(parser: argparse.ArgumentParser, default) -> None:
    """The options every verb takes, before the verb (``default`` False) or after it (``default`` SUPPRESS: a verb's
    parser writes its defaults over what was parsed before the verb, so it must set none)."""
    parser.add_argument("-v", "--verbose", action="store_true", default=default, help="show debug messages")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfit", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_global_options(parser, default=False)
    parser.add_argument("--version", action="version", version=f"memfit {memfit.__version__}")
    sub = parser.add_subparsers(dest="command", metavar="VERB")
    for name in COMMANDS:
        module = importlib.import_module(f"memfit.commands.{name}")
        command = module.add_parser(sub)
        _add_global_options(command, default=argparse.SUPPRESS)
        command.set_defaults(handler=module.run)
    return parser


NEGATIVE_VALUE = re.compile(r"^-[0-9.]")      # an option's value, not an option: no memfit option starts so


def _negative_values_joined(argv: list[str]) -> list[str]:
    """``--gpu-memory -8GiB`` as ``--gpu-memory=-8GiB``: argparse reads a token that starts with '-' and is not a
    plain negative number as an option, so the value's own check never saw it and the user read "expected one
    argument" where the option's message says what it takes."""
    joined: list[str] = []
    for token in argv:
        if joined and NEGATIVE_VALUE.match(token) and joined[-1].startswith("--") and joined[-1] != "--" \
                and "=" not in joined[-1]:
            joined[-1] = f"{joined[-1]}={token}"
        else:
            joined.append(token)
    return joined


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(_negative_values_joined(list(argv)))
    if args.command is None:  # the built-in default job: plan the default model
        args = parser.parse_args([*argv, "plan"])
    level = logging.DEBUG if args.verbose else logging.INFO
    logging.basicConfig(level=level, format="memfit: %(message)s")
    memfit_logger = logging.getLogger("memfit")
    caller_level = memfit_logger.level                # main() from Python: the caller's level comes back after
    memfit_logger.setLevel(level)   # also where the root logger was set up before
    handled = _terminate_as_an_exception()
    try:
        return int(args.handler(args) or 0)
    except MemfitError as err:
        print(f"memfit {args.command}: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:                            # `memfit generate ... | head`: the reader has what it wanted
        try:                                           # no second error as Python flushes stdout at exit
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError):                  # a stdout with no file (a caller's in-process capture)
            pass
        return 128 + signal.SIGPIPE
    except OSError as err:                             # the disk or the file system (full, permissions): one line
        print(f"memfit {args.command}: error: {err}", file=sys.stderr)
        return 1
    except Terminated:
        print("memfit: terminated", file=sys.stderr)
        return 128 + signal.SIGTERM
    except KeyboardInterrupt:
        print("memfit: interrupted", file=sys.stderr)
        return 130
    finally:
        memfit_logger.setLevel(caller_level)
        if handled:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the command is, so that what cleans up after Ctrl-C cleans up after it too (kill's default
    had ended a run with its writers' temporary files left)."""


def _raise_terminated(signum, frame):
    raise Terminated


def _terminate_as_an_exception() -> bool:
    """Turn SIGTERM into :class:`Terminated` for the command, where that is this process's to decide: on the main
    thread (the only one that can set a handler), and where SIGTERM has its default action (a parent that ignores it,
    or a caller's own handler, is kept). Whether it was set."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        return False
    signal.signal(signal.SIGTERM, _raise_terminated)
    return True


if __name__ == "__main__":
    sys.exit(main())
