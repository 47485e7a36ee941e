"""Train a small byte-level Llama on Python's own documentation and save it (<= 3 min on an H200).

The model the accuracy benchmarks compress (blr_accuracy) and the partial-inference work
reads: 6 layers, hidden 384, GQA 6/2 heads, SwiGLU 1024, vocab 259 (memfit's
ByteTokenizer), trained on the offline corpus of memfit.data (pydoc topics + standard
library docstrings), every 20th document held out: the first half of that stream (dev)
picks the checkpoint (early stopping: the model overfits the corpus, about 1.1M training
bytes; the results JSON holds every dev score), the second half (test) gives the reported
validation perplexity. Writes the model directory (config.json, model.safetensors,
memfit_tokenizer.json, train_info.json) to --out, atomically, and
benchmarks/results/train_small_model.json.

    python benchmarks/train_small_model.py --out benchmarks/results/small_llama
    python benchmarks/train_small_model.py --smoke          # CPU, tiny, seconds
"""
from __future__ import annotations

import argparse
import json
import secrets
import sys
import tempfile
import time
from pathlib import Path

import torch

from memfit.data import ByteTokenizer, dev_test_split, token_splits
from memfit.data.corpus import python_version
from memfit.data.lm import perplexity, train_lm
from memfit.files import atomic_dir, follow_umask
from memfit.measure.results import RESULTS_DIR, check_out_dir, out_dir_problem, target, write_results
from memfit.models import ModelSpec, build_model

DEFAULT_OUT = RESULTS_DIR / "small_llama"


def small_spec(smoke: bool) -> ModelSpec:
    vocab = ByteTokenizer.vocab_size
    if smoke:
        return ModelSpec("small-bytes-smoke", "llama", 2, 64, 176, 4, 2, 16, vocab, dtype="float32", max_position=1024)
    return ModelSpec("small-bytes", "llama", 6, 384, 1024, 6, 2, 64, vocab, dtype="float32", max_position=1024)


def model_dir_problem(out: Path, force: bool) -> str | None:
    """Why ``out`` cannot take the model, or None: it needs a name of its own (not '.', '..' or empty, which the save
    would replace with the model), no symbolic link there, a parent where results can go (results.out_dir_problem),
    and where it exists, ``force`` and a train_info.json in it: only a directory an earlier run wrote is replaced."""
    if out.name in ("", ".", "..") or out.is_symlink():
        return f"--out {out}: name the model directory itself (not '.', '..', or a symbolic link)"
    if problem := out_dir_problem(out, "--out"):
        return problem
    if out.exists() and not force:
        return f"--out {out} exists; pass --force to replace it"
    if out.exists() and not (out / "train_info.json").is_file():
        return f"--out {out} exists and holds no train_info.json, so no earlier run wrote it; it is never replaced"
    return None


def save_dir(model, out: Path, info: dict) -> Path:
    """Write the model directory to a temp sibling and put it in place (:func:`memfit.files.atomic_dir`; replacing
    one there: main refused it without --force before training)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out, out.with_name(f".{out.name}.{secrets.token_hex(8)}")) as tmp:
        model.save_pretrained(tmp)
        follow_umask(*tmp.glob("*.safetensors"))            # safetensors writes them 0600
        ByteTokenizer().save_pretrained(tmp)
        (tmp / "train_info.json").write_text(json.dumps(info, indent=1))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=None, help=f"model directory (default {DEFAULT_OUT})")
    parser.add_argument("--results", type=Path, default=None, help="where the results JSON goes")
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--max-seconds", type=float, default=160.0, help="stop training early past this")
    parser.add_argument("--force", action="store_true", help="replace an existing --out")
    parser.add_argument("--validate-every", type=int, default=25,
                        help="steps between dev-set scores; the saved model is the best-scoring one")
    parser.add_argument("--smoke", action="store_true", help="tiny model, a few steps, CPU")
    args = parser.parse_args(argv)
    check_out_dir(parser, args.results, "--results")
    if args.smoke:
        args.steps, args.batch, args.seq = 20, 4, 64
    out = args.out or (Path(tempfile.mkdtemp()) / "small_llama" if args.smoke else DEFAULT_OUT)
    if problem := model_dir_problem(out, args.force):          # before minutes of training, not at the save
        parser.error(problem)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    torch.manual_seed(0)
    spec = small_spec(args.smoke)
    model = build_model(spec, dtype="float32", device=device)
    train, held_out = (t.to(device) for t in token_splits())
    if args.smoke:
        train, held_out = train[:20000], held_out[:4000]
    dev, test = dev_test_split(held_out)
    start = time.perf_counter()
    stats = train_lm(model, train, args.steps, args.batch, args.seq, args.lr, warmup=min(100, args.steps // 10),
                     max_seconds=args.max_seconds, log=lambda s, l: print(f"step {s:5d}  loss {l:.3f}", flush=True),
                     validate=lambda: perplexity(model, dev, args.seq), validate_every=args.validate_every)
    val_ppl = perplexity(model, test, args.seq)
    train_ppl = perplexity(model, train, args.seq, max_windows=len(test) // args.seq)
    elapsed = time.perf_counter() - start
    params = sum(p.numel() for p in model.parameters())
    info = {"spec": spec.to_dict(), "params": params, "python": python_version(), "train_tokens": train.numel(),
            "val_tokens": test.numel(), "dev_tokens": dev.numel(), "seq_len": args.seq, "val_ppl": val_ppl,
            "train_ppl": train_ppl, **stats}
    save_dir(model, out, info)
    print(f"{params / 1e6:.1f}M params, {stats['steps']} steps in {stats['seconds']:.0f}s "
          f"({stats['tokens_per_s'] / 1e3:.0f}k tok/s), kept step {stats['best_step']} (dev ppl "
          f"{stats['best_validation']:.3f}); test ppl {val_ppl:.3f} (train {train_ppl:.3f}); saved {out}")
    rows = [{"case": "small-llama", "params": params, "val_ppl": val_ppl, "train_ppl": train_ppl,
             "uniform_byte_ppl": float(ByteTokenizer.vocab_size), **stats}]
    targets = [target("train time (s)", elapsed, 180.0, "s", "lower"),
               target("val ppl vs uniform bytes", val_ppl, 0.1 * ByteTokenizer.vocab_size, "ppl", "lower")]
    path = write_results("train_small_model" + ("_smoke" if args.smoke else ""), rows, targets,
                         out_dir=args.results or (out.parent if args.smoke else None))
    print(f"results: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
