"""benchmarks/finetune_memory.py's row choice: ``--rows`` picks 4-bit-model rows by name, each measured on a
model of its own; a choice that names none (or clashes with ``--lowest-only``), or bad contexts or dtypes,
is a usage error before any GPU work."""
import subprocess
import sys

import pytest
from conftest import ROOT, load_benchmark


@pytest.fixture(scope="module")
def finetune_memory():
    return load_benchmark("finetune_memory")


def test_rows_are_chosen_by_name(finetune_memory):
    assert finetune_memory.chosen_rows("exact") == ["+ fused linear CE (exact)"]
    assert finetune_memory.chosen_rows("+") == list(finetune_memory.FOUR_BIT_ROWS)
    assert finetune_memory.chosen_rows("") == [] and finetune_memory.chosen_rows("nothing") == []
    names = [name for name, *_ in finetune_memory.rows_settings(2, 64, "cpu")]
    assert names == list(finetune_memory.FOUR_BIT_ROWS)


@pytest.mark.parametrize("arguments,message", [(["--rows", "nothing"], "names none of the 4-bit-model rows"),
                                               (["--rows", ""], "names none of the 4-bit-model rows"),
                                               (["--rows", "exact", "--lowest-only"], "both choose rows"),
                                               (["--contexts", "1k"], "comma-separated token counts"),
                                               (["--contexts", "0"], "positive token counts"),
                                               (["--dtypes", "fp8"], "float32 and/or bfloat16"),
                                               (["--repeats", "0"], "positive count")])
def test_bad_row_choices_are_usage_errors(arguments, message):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "finetune_memory.py"), "--smoke", *arguments],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2 and message in done.stderr, done.stderr[-500:]
