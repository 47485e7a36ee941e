"""Probe: where the time of Monarch's activation-aware projection goes. On the H200 (``earlier/blr_accuracy_f2dc988.json``)
it took 90.4 s for the small model's layers, against 4.3 s for the weight-space projection and 28-30 s for the same
shapes on a 2-core CPU (``results/cpu/``): its refinement takes a batched truncated SVD of every block column's
sub-blocks in every sweep (``_whitened_svd``), and torch's SVD of a batch of small matrices on CUDA runs matrix by
matrix. Per case (a batch of weights, one shared input covariance) it times the whitening and first SVD, then the
refinement's sweeps, with the SVDs timed apart (each call synchronised), and reports the SVDs' share. On CUDA it
also times the float64 eigendecomposition of a batch of Gram matrices of the refinement's most frequent SVD shape on
the GPU, and on the host with the copies there and back (best of three each): whether the small decompositions should
leave the GPU. Writes OUT/monarch_refine_time_<commit>.json:

    MEMFIT_COMMIT=<sha> OUT=/some/dir python benchmarks/probes/monarch_refine_time.py [cpu|cuda]
"""
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from memfit.compress import projection as proj  # noqa: E402
from memfit.measure.results import environment  # noqa: E402

OUT = Path(os.environ.get("OUT", "/tmp"))
# (name, weights, out, in, rank, sweeps): the small accuracy model's gate/up (6 layers, rank 128 at blocks 16: the
# benchmark's half of the parameters) and Llama-3.2-1B's down projection at the paper's rank, two layers
CASES = [("small gate/up", 6, 1024, 384, 128, 20), ("llama-3.2-1b down", 2, 2048, 8192, 768, 3)]
BLOCKS = 16


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def covariance(n: int, device: torch.device, gen: torch.Generator) -> torch.Tensor:
    """Inputs whose blocks correlate (a falling spectrum mixes every input), as a layer's do."""
    mix = torch.randn(n, n, generator=gen) * torch.logspace(0, -2, n)
    X = torch.randn(2 * n, n, generator=gen) @ mix.T
    return (X.T @ X).to(device)


def run_case(name, weights, out, inp, rank, sweeps, device) -> dict:
    gen = torch.Generator().manual_seed(0)
    W = torch.randn(weights, out, inp, generator=gen).to(device)
    C = covariance(inp, device, gen)
    svd_seconds, svd_calls, shapes = 0.0, 0, Counter()
    original = proj.truncated_svd

    def timed_svd(matrix, k):
        nonlocal svd_seconds, svd_calls
        shapes[tuple(matrix.shape)] += 1
        synchronize(device)
        start = time.perf_counter()
        result = original(matrix, k)
        synchronize(device)
        svd_seconds += time.perf_counter() - start
        svd_calls += 1
        return result

    proj.truncated_svd = timed_svd
    try:
        synchronize(device)
        start = time.perf_counter()
        chol = proj.whitening_factor(C, BLOCKS).unsqueeze(-4)
        L, R = proj._whitened_svd(proj._blocks(W, BLOCKS), chol, rank // BLOCKS)
        synchronize(device)
        whitened = time.perf_counter() - start
        first_svd, svd_seconds, svd_calls = svd_seconds, 0.0, 0
        shapes.clear()
        history = []
        start = time.perf_counter()
        proj.monarch_refine_output_error(W, L, R, C, sweeps, history)
        synchronize(device)
        refine = time.perf_counter() - start
    finally:
        proj.truncated_svd = original
    sub_blocks = f"{weights * BLOCKS} x ({out // BLOCKS} x {inp // BLOCKS})"
    shape = shapes.most_common(1)[0][0]
    eigh = eigh_seconds(shape, device) if device.type == "cuda" else {}
    return {**eigh, "case": name, "weights": weights, "out": out, "in": inp, "rank": rank, "blocks": BLOCKS,
            "sweeps": len(history), "whitened_s": whitened, "whitened_svd_s": first_svd, "refine_s": refine,
            "refine_svd_s": svd_seconds, "refine_svd_calls": svd_calls, "svd_share": svd_seconds / refine,
            "svd_batch": sub_blocks, "final_relative_error": float(history[-1].max()) if history else None}


def eigh_seconds(shape: tuple[int, ...], device: torch.device) -> dict:
    """Seconds of ``torch.linalg.eigh`` of a float64 batch of the Gram matrices ``truncated_svd`` decomposes for inputs
    of ``shape``: on ``device``, and on the host with the copies there and back; best of three each."""
    n = min(shape[-2:])
    a = torch.randn(*shape[:-2], n, n, dtype=torch.float64, device=device)
    gram = a @ a.transpose(-1, -2)
    times = {"device": [], "host": []}
    for _ in range(3):
        for where in times:
            synchronize(device)
            start = time.perf_counter()
            if where == "device":
                torch.linalg.eigh(gram)
            else:
                torch.linalg.eigh(gram.cpu())[1].to(device)
            synchronize(device)
            times[where].append(time.perf_counter() - start)
    return {"eigh_shape": list(shape[:-2]) + [n, n], "eigh_device_s": min(times["device"]),
            "eigh_host_s": min(times["host"])}


def main() -> None:
    name = sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")
    if name not in ("cpu", "cuda") or (name == "cuda" and not torch.cuda.is_available()):
        sys.exit(f"the device is cpu or cuda (with a GPU present), got {name!r}")
    device = torch.device(name)
    environment_now = environment()
    commit = environment_now["commit"]
    record = {"probe": "monarch_refine_time", **environment_now, "device": name, "threads": torch.get_num_threads(),
              "rows": []}
    OUT.mkdir(parents=True, exist_ok=True)
    for case in CASES:
        row = run_case(*case, device)
        print(json.dumps(row), flush=True)
        record["rows"].append(row)
        (OUT / f"monarch_refine_time_{commit}.json").write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
