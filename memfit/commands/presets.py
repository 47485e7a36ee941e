"""``memfit presets``: the model shapes memfit knows offline."""
from __future__ import annotations

import json


def add_parser(sub):
    parser = sub.add_parser("presets", help="list the built-in model shapes",
                            description="List the model shapes memfit knows without a download.")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    return parser


def run(args) -> int:
    from rich.console import Console
    from rich.table import Table

    from memfit.models import PRESETS
    from memfit.units import format_count

    if args.json:
        print(json.dumps({name: {**spec.to_dict(), "params": spec.num_params()} for name, spec in PRESETS.items()},
                         indent=1))
        return 0
    table = Table(title="memfit presets")
    for column in ("name", "type", "params", "layers", "hidden", "intermediate", "heads/kv", "head dim", "vocab", "tied",
                   "dtype"):
        table.add_column(column, justify="left" if column in ("name", "type", "dtype") else "right")
    for spec in PRESETS.values():
        table.add_row(spec.name, spec.model_type, format_count(spec.num_params()), str(spec.num_layers), str(spec.hidden),
                      str(spec.intermediate), f"{spec.num_heads}/{spec.num_kv_heads}", str(spec.head_dim), str(spec.vocab),
                      "yes" if spec.tied_embeddings else "no", spec.dtype)
    # never shorten a cell (a name is what --model takes): wider than the terminal, or than a pipe's 80 columns,
    # the table is printed at its natural width
    natural = Console(width=1000).measure(table).maximum
    Console(width=max(Console().width, natural)).print(table)
    return 0
