"""Tests run on the CPU: Triton kernels go through the interpreter at small shapes.

On a CUDA machine, ``MEMFIT_TEST_DEVICE=cuda`` makes CUDA torch's default device, so the tests that build their
tensors without naming a device run the compiled kernels on the GPU at the same awkward shapes (a study, not part
of ``make test``: ``benchmarks/gpu_runs.sh gpu_tests_blr gpu_tests_blr_compile gpu_tests_other gpu_tests_swiglu
gpu_tests_timing gpu_tests_linear_ce gpu_tests_rest``).
Tests that assume the CPU are marked ``cpu_only`` and skipped there, so that a failure there is a kernel's.
"""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
elif os.environ.get("MEMFIT_TEST_DEVICE") == "cuda":
    torch.set_default_device("cuda")

import contextlib  # noqa: E402
import importlib  # noqa: E402
import importlib.util  # noqa: E402
import pkgutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

import memfit.kernels  # noqa: E402

# Every kernel module imported now, under the interpreter: a module first imported inside a test that unsets
# TRITON_INTERPRET (test_finetune runs the loss's CPU reference) would build its tuners for a GPU, and later
# interpreter tests in the same process would fail on them ("0 active drivers").
for module in pkgutil.iter_modules(memfit.kernels.__path__):
    importlib.import_module(f"memfit.kernels.{module.name}")


def pytest_configure(config):
    config.addinivalue_line("markers", "cpu_only(reason): the test assumes the CPU (a CPU stand-in for the GPU, the "
                            "interpreter's one launch, a CPU memory tracker); skipped under MEMFIT_TEST_DEVICE=cuda")


@pytest.fixture(autouse=True)
def _float32_matmul_precision_kept():
    """torch's float32 matmul precision put back after every test: a benchmark's ``main`` run in-process
    (finetune_memory.py and finetune_steps.py set ``torch.backends.cuda.matmul.allow_tf32``) turns TF32 on for the
    rest of the worker. On the H200 an fp32 partial-FFN test ran its decode attention in TF32 (memfit said so once in
    its log) and missed its 1e-4 tolerance (gpu_tests_rest_0b1eb37.log); which earlier test of its worker had turned
    TF32 on, the log does not show."""
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def pytest_collection_modifyitems(config, items):
    """Under MEMFIT_TEST_DEVICE=cuda, skip the tests marked ``cpu_only``, saying why, so that a failure there is a
    kernel's."""
    if torch.get_default_device().type != "cuda":
        return
    for item in items:
        if (mark := item.get_closest_marker("cpu_only")) is not None:
            item.add_marker(pytest.mark.skip(reason=f"assumes the CPU: {mark.kwargs['reason']}"))


# Sweeps that run Triton kernels on CPU tensors through the interpreter (a CUDA machine has none to run them).
ON_THE_INTERPRETER = pytest.mark.cpu_only(reason="runs its Triton kernels on CPU tensors through the interpreter")

# Tests of memfit verify's CPU measurement: under a CUDA default device some of the run's tensors are made on CUDA,
# outside the CPU memory tracker (which ones: not traced).
MEASURES_A_CPU_RUN = pytest.mark.cpu_only(reason="the CPU memory tracker measures a run on the CPU")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture
def interpreter_frees_at_return(monkeypatch):
    """Memory measured on the CPU under the Triton interpreter: a garbage collection after every launch.

    The interpreter keeps each launch's argument storages in a reference cycle (``GridExecutor``'s recursive
    ``_to_cpu``/``_from_cpu`` closures hold them) until the next collection, so a buffer a kernel's caller has let go
    of stays allocated, for some layers of a backward; a compiled launch on the GPU keeps none."""
    import gc

    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__

    def launch_then_collect(self, *args, **kwargs):
        try:
            return launch(self, *args, **kwargs)
        finally:
            gc.collect()

    monkeypatch.setattr(interpreter.GridExecutor, "__call__", launch_then_collect)


ROOT = Path(__file__).resolve().parents[1]


def rel(a, b):
    """Relative error (Frobenius) of ``a`` against the reference ``b``, both read in float64 (an all-zero reference
    divides by 1e-12, not 0)."""
    b = b.double()
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-12)).item()


def load_on_test_device(model_dir, *args, **kwargs):
    """``memfit.infer.partial_load.load_model`` onto the tests' device: the CPU, or CUDA under
    ``MEMFIT_TEST_DEVICE=cuda``."""
    from memfit.infer.partial_load import load_model

    return load_model(model_dir, *args, device=torch.get_default_device(), **kwargs)


@contextlib.contextmanager
def default_device(device: str):
    """torch's default device set to ``device`` for the block, then the one before put back."""
    previous = torch.get_default_device()
    torch.set_default_device(device)
    try:
        yield
    finally:
        torch.set_default_device(None if previous.type == "cpu" else previous)


def seeded(seed: int) -> torch.Generator:
    """A generator on torch's default device, seeded: the CPU's in ``make test`` (the same numbers as
    ``torch.Generator().manual_seed(seed)``), CUDA's under ``MEMFIT_TEST_DEVICE=cuda``, where a CPU generator
    cannot draw the tests' tensors."""
    return torch.Generator(device=torch.get_default_device()).manual_seed(seed)


class PassingDispatchMode(torch.utils._python_dispatch.TorchDispatchMode):
    """A dispatch mode that runs every op as it is: what memfit's ops must treat as a mode being on (they go through
    their custom ops), with results unchanged."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a module, the folder on ``sys.path`` while it loads (some import their
    siblings, e.g. bgemm_tiles from blr_layers)."""
    folder = str(ROOT / "benchmarks")
    sys.path.insert(0, folder)
    try:
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path.remove(folder)
