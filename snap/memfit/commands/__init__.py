"""One module per ``memfit`` verb: ``add_parser(subparsers)`` and ``run(args) -> int``."""
