"""Fused linear cross-entropy: the loss of ``cross_entropy(hidden @ weight.T, labels)``
without ever holding the tokens x vocabulary logits.

Why: for a 128k vocabulary the logits of 8k tokens are 2 GiB in bf16 (4 GiB with their
fp32 softmax), more than the whole rest of a LoRA step. This op keeps them on chip.

How (exact mode):

* **Loss-token skipping.** Tokens whose label is ``ignore_index`` are dropped before any
  matmul (the kernels read hidden rows through an index), so every cost below scales with
  the number of loss tokens ``N``, not with all tokens ``T``. Each pass syncs with the host
  once, to count them (``_split_tokens``).
* **Forward** (``_lse_kernel``): each program owns a block of loss tokens and a slice of
  the vocabulary, computes logit tiles ``h @ w.T`` with fp32 accumulation, and folds them
  into a running (max, sum-exp) pair and the label logit (online softmax). Partials of
  the vocabulary slices are combined in PyTorch (a few bytes per token). Saved for
  backward: only the per-token log-sum-exp (fp32).
* **Backward**: the vocabulary is walked in steps of up to ``C`` columns (8192 when the
  weight trains; when it is frozen 2048, widened up to 8192 for few loss tokens, FROZEN_STEP_ELEMENTS).
  ``_dlogits_kernel``
  recomputes the step's logits on chip and writes ``d = g * (softmax - onehot)`` (with the
  soft-cap and z-loss chain rules) once, in the input dtype, into an ``N x w`` buffer. When
  the weight trains, that buffer is the weight gradient's own not-yet-written rows (rows past
  the step), so it costs no memory; steps shrink near the end of the vocabulary as those rows
  run out, and once a step would be narrower than STEP_ALIGN columns the rest goes through a
  side buffer of at most max(TAIL_ELEMENTS, N * STEP_ALIGN) elements (``_backward_plan``).
  Two matmuls consume it: ``dW[step] = d.T @ h``, summed over all loss tokens in fp32 and
  rounded once into the gradient (no fp32 V x H buffer, no atomics), by cuBLAS on a gathered
  copy of the loss-token rows that itself sits in the weight gradient's last N rows (so it
  costs no memory either; at 8K loss tokens on the H200 our Triton kernel took 5.2 ms and cuBLAS
  2.3 ms: benchmarks/results/linear_ce_profile.json),
  and, for the last steps, which write those rows, by ``_dweight_kernel``, which reads the
  rows of hidden through the index; and
  ``dH += d @ W[step]`` (cuBLAS, fp32 output) into an fp32 ``N x H`` accumulator, which
  lives in the hidden gradient's own buffer whenever it fits (fp32 inputs, or 16-bit inputs
  with at most half the tokens carrying a loss) and is rounded once, in place, at the end
  (``_finish_hidden_grad``: a temporary of at most FINISH_ELEMENTS, O(log N) launches for
  the usual label patterns). ``backward_memory`` gives the bytes
  held, for the ledger: beyond the two gradients, a few vectors, the side buffer (N x C when
  the weight is frozen) and the finish's temporary.

Cost: 2NVH FLOPs forward, 6NVH backward (recompute, dH, dW), 4NVH when the weight is
frozen (LoRA), where the weight-gradient matmul is skipped.

Approximate mode (opt-in): ``vocab_subset`` restricts the softmax to the labels plus a
candidate set (``frequent_token_subset``), padded to a multiple of SUBSET_ROWS_STEP ids;
``subset_loss_deviation`` reports what that costs in loss on a batch.

Paths (``takes_pytorch_path``): the Triton kernels, or the PyTorch path, the same steps with each chunk's logits
by a torch matmul (fp32, N x C at a time: cuBLAS SGEMMs on CUDA), the definition used on CPU. In auto mode fp32
inputs on CUDA at torch's default float32 matmul precision ("highest") take the PyTorch path, said once: there the
kernels' IEEE dots run as FMAs on CUDA cores, at 1.8-2.8x its time on the H200.

Layout: PyTorch reference (chunked fp32), the Triton kernels and launchers, then the custom ops with fake and
autograd registrations, then the public functions.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from memfit.errors import MemfitError
from memfit.kernels.dispatch import (
    dot_precision,
    fp32_matmul_is_ieee,
    interpreting,
    kernel_mode,
    triton_runnable,
    use_triton,
)
from memfit.log import warn_once

try:
    import triton
    import triton.language as tl
except ImportError:  # the reference still works
    triton = None

REDUCTIONS = ("mean", "sum", "none")
# Vocabulary columns per backward step (C), independent of the hidden size. With a frozen weight
# the N x C chunk is a buffer of its own: VOCAB_CHUNK, the fastest of C = 512 / 1024 / 2048 at all
# three benchmark shapes in the H200 run at 39f85a3. When the weight trains, the chunk lives in the
# weight gradient's unwritten rows (see ``_backward_plan``), so C costs no memory there and fewer,
# wider steps win: TRAINED_VOCAB_CHUNK (the H200 profile of 88652d2, linear_ce_profile.json: 8192
# took 19.6 / 54.2 / 140.8 ms against 20.1 / 57.7 / 144.5 for 2048).
VOCAB_CHUNK = 2048
TRAINED_VOCAB_CHUNK = 8192
# With few loss tokens a VOCAB_CHUNK-wide step's grid leaves much of the GPU idle: a step whose chunk is a buffer of
# its own takes FROZEN_STEP_ELEMENTS / (N's power-of-two bucket) columns, from VOCAB_CHUNK up to TRAINED_VOCAB_CHUNK,
# so a widened N x C chunk holds at most this many elements (32 MiB in fp32) and N's bucket, which the kernels tune
# for, sets the width.
# On the H200 (benchmarks/probes/linear_ce_fp32_paths.py, frozen weight) at 031b9b9, fp32 as TF32, 8192 columns took
# 7.69 ms against 2048's 16.83 at 1024 loss tokens, 17.37 against 18.66 at 2048 and 48.02 against 50.98 at 4096;
# at 4459d84 (8192 and 4096 columns, the widths this rule gives there) a step took 6.29 / 17.54 ms against 2048's
# 9.13 / 18.31 at 1024 / 2048 loss tokens, and in bf16 3.90 / 8.44 against 7.55 / 13.17.
FROZEN_STEP_ELEMENTS = 1 << 23
# Elements of the side buffer that holds the logit-gradient chunks of the last vocabulary rows
# (those whose chunk no longer fits in the weight gradient's unwritten rows): the tail goes through
# it in steps of max(STEP_ALIGN, TAIL_ELEMENTS // N) columns, so it holds at most
# max(TAIL_ELEMENTS, N * STEP_ALIGN) elements. When the weight is frozen it holds every chunk
# (then it is N x C).
TAIL_ELEMENTS = 1 << 18
# Widths of the shrinking steps near the end of the vocabulary are rounded down to a multiple of
# this, so the kernels' loads stay vectorised; a step that would be narrower goes to the side
# buffer instead (a step costs about the same at any width below this, so narrower ones only add
# launches).
STEP_ALIGN = 16
# Elements of the temporary that the in-place finish of the hidden gradient moves rows through
# where a row slice would overwrite rows it still reads (see ``_finish_hidden_grad``): its rows,
# FINISH_ELEMENTS // H, bound the launches of that finish. 256K elements (512 KiB in bf16) keeps
# the op's extra peak under Cut Cross-Entropy's at the benchmark shapes (1 << 20 did not: +1.5 MiB
# put it 0.2-1 MiB over at all three); the price is more launches where rows shift by a few places.
FINISH_ELEMENTS = 1 << 18
# The vocabulary-subset mode's id set (labels ∪ subset) is padded to a multiple of this many ids (or to the
# whole vocabulary), so that its size, which the kernels compile and tune for, takes few values over a run.
SUBSET_ROWS_STEP = 1024
SUBSET_IGNORE = -1          # the ignore label of the subset mode's renumbered labels, which are all >= 0
# Backward/forward alternatives kept so one benchmark run can time them (benchmarks/linear_ce.py):
#   DW_MATMUL  "triton": dW chunk = d.T @ hidden[rows] by ``_dweight_kernel``, reading hidden
#              rows through the loss-token index; "cublas": torch.mm on a gathered N x H copy
#              of the loss-token rows (2NH more bytes); "cublas-in-grad": that copy lives in the
#              weight gradient's last N rows, so cuBLAS runs every step before them at no memory
#              cost, and the last steps (over at least those N rows) use the Triton kernel; where
#              the loss rows are one range of hidden (every token, one response), cuBLAS reads that
#              slice in every step and there is no copy.
#   HIDDEN_ACC "in-buffer": the fp32 dH accumulator lives in dH's own buffer where it fits;
#              "separate": always its own 4NH-byte tensor (dH allocated after the vocabulary loop).
#   STEP_TILES "per-width": the step kernels are tuned per power-of-two bucket of the step's width
#              (``_width_key``); "per-chunk": every step uses the tiles tuned for a full chunk.
DW_MATMUL = "cublas-in-grad"
STEP_TILES = "per-width"
HIDDEN_ACC = "in-buffer"
# With DW_MATMUL "cublas-in-grad", the steps that use the gathered copy shrink as the rows in front
# of it fill up; once one would be narrower than this, the copy is given up and its rows join the
# last steps (Triton): a narrow step costs about as much as a wide one (launches, one pass over the
# loss rows), and ending here takes ~10 narrow steps off the benchmark shapes for ~2-5% more rows
# in the Triton steps.
COPY_MIN_WIDTH = 1024
# Tests set this to fill scratch buffers with NaN, so an unwritten element shows.
POISON = False


def _empty(shape, dtype, device) -> torch.Tensor:
    out = torch.empty(shape, dtype=dtype, device=device)
    return out.fill_(float("nan")) if POISON else out


def takes_pytorch_path(dtype: torch.dtype, device_type: str, path: str | None = None) -> bool:
    """Whether a job's fused loss runs the op's PyTorch path (``path="reference"``: chunked matmuls by torch, cuBLAS
    SGEMMs on CUDA) and not its Triton kernels, on inputs of ``dtype`` on ``device_type``, for the ledger, which has
    no tensors and plans for a CUDA machine with Triton: where ``path`` (or MEMFIT_KERNELS) says so, off CUDA where
    Triton cannot run here, and in auto mode for fp32 on CUDA at torch's default float32 matmul precision (IEEE,
    :func:`_ieee_fp32`). Says nothing; the op says its choice once (``_runs_triton``)."""
    mode = kernel_mode("linear_ce", path)
    if mode != "auto":
        return mode == "reference"
    return _ieee_fp32(dtype) if device_type == "cuda" else not triton_runnable(device_type)


def _ieee_fp32(dtype: torch.dtype) -> bool:
    """fp32 inputs at IEEE precision, where on CUDA auto mode takes the PyTorch path: the Triton kernels' dots run as
    FMAs on CUDA cores there, and on the H200 a step took 1.8-2.8x the PyTorch path's time at Llama-1B/3B/8B heads,
    which holds 8-64 MB more, a gathered fp32 copy of the loss rows (``benchmarks/probes/linear_ce_fp32_paths.py``,
    ``results/probes/linear_ce_fp32_paths_9c13911.jsonl``)."""
    return dtype == torch.float32 and fp32_matmul_is_ieee()


def _runs_triton(hidden: torch.Tensor, weight: torch.Tensor, path: str | None) -> bool:
    """The op's choice of path: ``use_triton``'s (its errors, its said-once fallback where Triton cannot run), then
    :func:`takes_pytorch_path`'s, which differs from it only in auto mode for fp32 CUDA inputs at IEEE precision,
    said once."""
    if not use_triton("linear_ce", hidden, weight, path=path):
        return False
    if not takes_pytorch_path(hidden.dtype, hidden.device.type, path):
        return True
    warn_once("linear_ce:ieee", "linear_ce: fp32 at torch's float32 matmul precision 'highest' (IEEE) runs the "
              "PyTorch path, cuBLAS SGEMMs on chunks of logits, about twice as fast as the Triton kernels' CUDA-core "
              "dots; torch.set_float32_matmul_precision('high') runs the Triton kernels on TF32 tensor cores")
    return False


def _vocab_chunk(vocab: int, chunk: int, weight_grad: bool, loss_tokens: int) -> int:
    """Columns per backward step: ``chunk`` if given (> 0), else TRAINED_VOCAB_CHUNK when the
    weight trains (``weight_grad``: on the Triton path, where the chunks live in its gradient)
    and otherwise FROZEN_STEP_ELEMENTS / (``loss_tokens``' power-of-two bucket), between VOCAB_CHUNK and
    TRAINED_VOCAB_CHUNK; at most V."""
    if not chunk and not weight_grad:
        chunk = max(VOCAB_CHUNK, min(TRAINED_VOCAB_CHUNK, FROZEN_STEP_ELEMENTS // _bucket(loss_tokens)))
    return min(vocab, chunk or TRAINED_VOCAB_CHUNK)


def _split_tokens(labels: torch.Tensor, ignore_index: int
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss rows, the same on the host, ignored rows, labels on the host), rows ascending, on
    ``labels``' device where not said otherwise. One host sync, a copy of the labels: the loss-token
    count decides the work, and every later host-side decision (label check, the finish's row
    moves) reads these host copies instead of syncing again."""
    host = labels.cpu()
    valid = host != ignore_index
    rows_host = valid.nonzero().squeeze(1)
    ignored = (~valid).nonzero().squeeze(1)
    if labels.device.type == "cpu":
        return rows_host, rows_host, ignored, host
    return (rows_host.to(labels.device, non_blocking=True), rows_host,
            ignored.to(labels.device, non_blocking=True), host)


# --------------------------------------------------------------------------------------
# Reference (PyTorch, fp32, chunked over the vocabulary)
# --------------------------------------------------------------------------------------


def _transform(z: torch.Tensor, bias: Optional[torch.Tensor], softcap: float) -> torch.Tensor:
    """The bias and soft cap applied to the fp32 logits ``z`` in their own buffer (the values of ``z + bias`` and
    ``softcap * tanh(z / softcap)``, bit for bit)."""
    if bias is not None:
        z.add_(bias.float())
    return z.div_(softcap).tanh_().mul_(softcap) if softcap else z


def _lse_reference(hs, weight, bias, labels_n, softcap, chunk):
    """Per-token log-sum-exp and label logit of the (soft-capped) logits, fp32. Each chunk's log-sum-exp is
    ``torch.logsumexp``'s own formula (max, exp of the difference, sum, log, max back; an infinite max taken as 0)
    computed in the logits' buffer, so a chunk holds one N x C fp32 tensor, as the backward's does."""
    hs = hs.float()
    lse = torch.full((hs.shape[0],), -math.inf, device=hs.device)
    tgt = torch.zeros(hs.shape[0], device=hs.device)
    for v0 in range(0, weight.shape[0], chunk):
        v1 = min(v0 + chunk, weight.shape[0])
        y = _transform(hs @ weight[v0:v1].float().T, None if bias is None else bias[v0:v1], softcap)
        inside = (labels_n >= v0) & (labels_n < v1)
        local = (labels_n - v0).clamp(0, v1 - v0 - 1)
        tgt += torch.where(inside, y.gather(1, local[:, None]).squeeze(1), 0.0)
        top = y.amax(dim=1)
        top.masked_fill_(top.isinf(), 0.0)
        lse = torch.logaddexp(lse, y.sub_(top[:, None]).exp_().sum(dim=1).log_().add_(top))
        del y                       # before the next chunk's logits exist
    return lse, tgt


def _dlogits_reference(hs, weight, bias, labels_n, lse, g, softcap, z_loss, v0, v1):
    """fp32 gradient of the loss w.r.t. the raw logits of vocabulary columns [v0, v1), computed in the logits'
    own buffer: one N x (v1 - v0) fp32 tensor (about three with a soft cap, which ``backward_memory`` does not
    count), where the kernel's side buffer holds one chunk in the model's dtype. In 16-bit it also copies the rows
    and the weight chunk to fp32 (``backward_memory(pytorch_path=True)`` counts both). The label's -1 is a scatter
    of -1 (and -0.0 off the chunk), so the values are the ones the out-of-place formula gives, bit for bit."""
    y = _transform(hs.float() @ weight[v0:v1].float().T, None if bias is None else bias[v0:v1], softcap)
    cap = 1.0 - (y / softcap) ** 2 if softcap else None
    d = y.sub_(lse[:, None]).exp_().mul_((1.0 + 2.0 * z_loss * lse)[:, None])
    inside = (labels_n >= v0) & (labels_n < v1)
    local = (labels_n - v0).clamp(0, v1 - v0 - 1)
    d.scatter_add_(1, local[:, None], -inside.float()[:, None])
    d.mul_(g[:, None])
    if softcap:
        d.mul_(cap)
    return d


# --------------------------------------------------------------------------------------
# Triton kernels
# --------------------------------------------------------------------------------------

if triton is not None:

    # (rows, columns, BLOCK_K, warps, stages) of the 128/256 tiles every matmul-shaped kernel here tries on the
    # tensor cores (16-bit inputs, or fp32 as TF32)
    WIDE_TILES = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 64, 4, 4), (128, 128, 64, 8, 4),
                  (64, 256, 64, 8, 4), (64, 256, 64, 4, 4), (128, 256, 64, 8, 4), (256, 128, 64, 8, 3)]
    # The tiles for fp32 at IEEE precision (torch's default "highest"; the Triton path there only when forced: auto
    # takes the PyTorch path, ``takes_pytorch_path``), where tl.dot runs as FMAs on CUDA cores and a wide tile's
    # unrolled FMA code kept ptxas busy for minutes. On the H200 (benchmarks/probes/linear_ce_first_call.py) a tiny
    # model's first fp32 step (weight trained) took 171 s with the wide tiles (22 binaries, fa2fabf) and 19.2 s with
    # these (13, fdaff5e); the first step at Llama-1B's head (2048 tokens, frozen weight) 15.1 s, and a later one
    # 97.2 ms against torch's F.linear + cross_entropy's 44.7 ms (cuBLAS SGEMM; both at ea3eb89). The wide tiles'
    # run time there was not measured.
    IEEE_TILES = [(64, 64, 32, 4, 2), (64, 128, 32, 8, 2), (128, 64, 32, 8, 2)]

    def _tile_configs(rows: str, cols: str, tiles) -> list:
        """``triton.Config``s of ``tiles``, their row and column blocks named ``rows`` and ``cols``."""
        return [triton.Config({rows: r, cols: c, "BLOCK_K": k}, num_warps=w, num_stages=st) for r, c, k, w, st in tiles]

    class _TileSets:
        """A kernel's autotune configs: the tensor-core tiles and the IEEE fp32 tiles, with the pruner that offers
        each only at its precision. ``narrow_block`` names the block that spans a backward step's columns (the
        kernel's ``rows`` or ``cols``); that block also gets 16-64-wide tiles for the shrinking steps near the end
        of the vocabulary (a 128/256-wide tile there computes mostly wasted columns), and the pruner keeps only the
        tiles that suit the step width's bucket (WIDTH_KEY): none more than twice as wide as the step, and on the
        tensor cores no narrow tile on a wide step."""

        def __init__(self, rows: str, cols: str, interpreter_tile: tuple, narrow_block: str | None = None):
            if interpreting():
                tensor_core, ieee = _tile_configs(rows, cols, [interpreter_tile]), []
                narrow_block = None
            else:
                tensor_core, ieee = _tile_configs(rows, cols, WIDE_TILES), _tile_configs(rows, cols, IEEE_TILES)
                if narrow_block is not None:            # (other block, narrow block) tiles
                    other = rows if narrow_block == cols else cols
                    tensor_core += _tile_configs(other, narrow_block, [(size, width, 64, 4, 4) for width in (16, 32, 64)
                                                                       for size in (64, 128, 256)])
                    ieee += _tile_configs(other, narrow_block, [(64, width, 32, 4, 2) for width in (16, 32)])
            self.configs, self.ieee_ids, self.narrow_block = tensor_core + ieee, {id(c) for c in ieee}, narrow_block

        def prune(self, configs, named_args, **kwargs):
            ieee = kwargs["PRECISION"] == "ieee"                  # every launcher passes PRECISION by keyword
            kept = [c for c in configs if (id(c) in self.ieee_ids) == ieee] or configs
            if self.narrow_block is not None:
                key, block = named_args["WIDTH_KEY"], self.narrow_block
                kept = [c for c in kept if c.kwargs[block] <= max(16, 2 * key)
                        and (ieee or key < 512 or c.kwargs[block] >= 128)] or kept
            return kept

        def autotune(self, key: list[str]):
            return triton.autotune(configs=self.configs, key=key, prune_configs_by={"early_config_prune": self.prune})

    @triton.jit
    def _logits_tile(h_ptr, w_ptr, b_ptr, rows, cols, H: tl.constexpr, stride_h, stride_w, softcap,
                     HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, EVEN_K: tl.constexpr,
                     PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                     BLOCK_K: tl.constexpr):
        """fp32 tile of (soft-capped) logits for hidden rows ``rows`` and vocab ``cols``.

        ``rows``/``cols`` must be in range (callers clamp them), so only K needs a mask.
        H is a compile-time constant (one compile per model shape, fully unrolled K loop)."""
        offs_k = tl.arange(0, BLOCK_K)
        h_ptrs = h_ptr + rows[:, None].to(tl.int64) * stride_h + offs_k[None, :]
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_w + offs_k[:, None]
        acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
        for k in range(0, (H + BLOCK_K - 1) // BLOCK_K):
            if EVEN_K:
                a = tl.load(h_ptrs)
                b = tl.load(w_ptrs)
            else:
                a = tl.load(h_ptrs, mask=offs_k[None, :] < H - k * BLOCK_K, other=0.0)
                b = tl.load(w_ptrs, mask=offs_k[:, None] < H - k * BLOCK_K, other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols).to(tl.float32)[None, :]
        if HAS_SOFTCAP:  # cap * tanh(z / cap), tanh written with exp (stable at both ends)
            acc = softcap * (1.0 - 2.0 / (tl.exp(2.0 * acc / softcap) + 1.0))
        return acc

    # Compiles and tunings depend on the model shape and on the loss-token count only through
    # its power-of-two bucket N_BUCKET: the count itself (N) is a runtime value that is not
    # specialised on, and the forward's vocabulary split is a function of the bucket, so a
    # fine-tuning run whose loss-token count changes every step tunes and compiles once per bucket.
    # Every compile-time knob is in the keys too, so a variant (e.g. the split count, a soft-capped
    # model) is tuned for itself rather than reusing the tiles another variant picked.
    @_TileSets("BLOCK_N", "BLOCK_V", (16, 256, 16, 4, 1)).autotune(
        key=["H", "V", "N_BUCKET", "SPLITS", "HAS_BIAS", "HAS_SOFTCAP", "PRECISION"])
    @triton.heuristics({"EVEN_K": lambda a: a["H"] % a["BLOCK_K"] == 0})
    @triton.jit(do_not_specialize=["N"])
    def _lse_kernel(h_ptr, w_ptr, b_ptr, rows_ptr, labels_ptr, m_ptr, s_ptr, t_ptr,
                    N, V: tl.constexpr, H: tl.constexpr, N_BUCKET, stride_h, stride_w, softcap,
                    SPLITS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr,
                    PRECISION: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
        """Online softmax over one vocabulary slice for one block of loss tokens.

        Writes the slice's running max ``m``, sum of exp(logit - m) ``s`` and the label
        logit ``t`` (0 where the label lies in another slice) at [slice, token]. The slice
        count SPLITS is a compile-time constant (a function of the token bucket)."""
        pid_n = tl.program_id(0)
        pid_s = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        n_mask = offs_n < N
        rows = tl.load(rows_ptr + offs_n, mask=n_mask, other=0)
        labels = tl.load(labels_ptr + offs_n, mask=n_mask, other=-1)
        tiles = (tl.cdiv(V, BLOCK_V) + SPLITS - 1) // SPLITS  # vocab tiles per slice
        m = tl.full((BLOCK_N,), -float("inf"), tl.float32)
        s = tl.zeros((BLOCK_N,), tl.float32)
        t = tl.zeros((BLOCK_N,), tl.float32)
        for i in range(0, tiles):
            cols = (pid_s * tiles + i) * BLOCK_V + tl.arange(0, BLOCK_V)
            c_mask = cols < V
            y = _logits_tile(h_ptr, w_ptr, b_ptr, rows, tl.where(c_mask, cols, 0), H, stride_h, stride_w,
                             softcap, HAS_BIAS, HAS_SOFTCAP, EVEN_K, PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
            y = tl.where(c_mask[None, :], y, -float("inf"))
            m_new = tl.maximum(m, tl.max(y, axis=1))
            m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)  # a tile past V leaves m at -inf
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(y - m_safe[:, None]), axis=1)
            m = m_new
            t += tl.sum(tl.where(cols[None, :] == labels[:, None], y, 0.0), axis=1)
        out = pid_s * N + offs_n
        tl.store(m_ptr + out, m, mask=n_mask)
        tl.store(s_ptr + out, s, mask=n_mask)
        tl.store(t_ptr + out, t, mask=n_mask)

    @_TileSets("BLOCK_N", "BLOCK_V", (16, 256, 16, 4, 1), narrow_block="BLOCK_V").autotune(
        key=["H", "WIDTH_KEY", "N_BUCKET", "HAS_BIAS", "HAS_SOFTCAP", "PRECISION"])
    @triton.heuristics({"EVEN_K": lambda a: a["H"] % a["BLOCK_K"] == 0})
    @triton.jit(do_not_specialize=["N", "v0"])
    def _dlogits_kernel(h_ptr, w_ptr, b_ptr, rows_ptr, labels_ptr, lse_ptr, g_ptr, d_ptr,
                        N, V, H: tl.constexpr, N_BUCKET, WIDTH_KEY, v0, width, stride_h, stride_w, stride_d,
                        softcap, z_loss,
                        HAS_BIAS: tl.constexpr, HAS_SOFTCAP: tl.constexpr, PRECISION: tl.constexpr,
                        EVEN_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr,
                        BLOCK_K: tl.constexpr):
        """d[n, j] = dloss_n / dz[n, v0 + j] for j < width, recomputing the logits on chip.

        ``width`` is specialised on (its divisibility by 16 lets the stores vectorise); WIDTH_KEY
        (``_width_key``) only keys the tuning."""
        pid_n = tl.program_id(0)
        pid_v = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_j = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
        n_mask = offs_n < N
        j_mask = offs_j < width
        rows = tl.load(rows_ptr + offs_n, mask=n_mask, other=0)
        labels = tl.load(labels_ptr + offs_n, mask=n_mask, other=-1)
        lse = tl.load(lse_ptr + offs_n, mask=n_mask, other=0.0)
        g = tl.load(g_ptr + offs_n, mask=n_mask, other=0.0)
        cols = v0 + offs_j
        y = _logits_tile(h_ptr, w_ptr, b_ptr, rows, tl.where(j_mask, cols, 0), H, stride_h, stride_w,
                         softcap, HAS_BIAS, HAS_SOFTCAP, EVEN_K, PRECISION, BLOCK_N, BLOCK_V, BLOCK_K)
        d = tl.exp(y - lse[:, None]) * (1.0 + 2.0 * z_loss * lse)[:, None]
        d = tl.where(cols[None, :] == labels[:, None], d - 1.0, d) * g[:, None]
        if HAS_SOFTCAP:
            r = y / softcap
            d = d * (1.0 - r * r)
        ptrs = d_ptr + offs_n[:, None].to(tl.int64) * stride_d + offs_j[None, :]
        tl.store(ptrs, d.to(d_ptr.dtype.element_ty), mask=n_mask[:, None] & j_mask[None, :])

    @_TileSets("BLOCK_M", "BLOCK_H", (128, 64, 32, 4, 1), narrow_block="BLOCK_M").autotune(
        key=["H", "WIDTH_KEY", "N_BUCKET", "PRECISION"])
    @triton.jit(do_not_specialize=["N"])
    def _dweight_kernel(d_ptr, h_ptr, rows_ptr, out_ptr, N, width, H: tl.constexpr, N_BUCKET, WIDTH_KEY,
                        stride_d, stride_h, stride_o, PRECISION: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr):
        """out[j, :] = sum_n d[n, j] * hidden[rows[n], :] for j < width: one weight-gradient step.

        The hidden rows are read through the loss-token index (no gathered N x H copy); the sum
        over all N tokens is accumulated in fp32 and rounded once. Column and feature offsets
        wrap (``%``) instead of being masked, so the K loop's loads stay unmasked and
        vectorised; wrapped rows and columns are computed but never stored."""
        pid_m = tl.program_id(0)
        pid_h = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        offs_k = tl.arange(0, BLOCK_K)
        cols = offs_m % width
        feats = offs_h % H
        acc = tl.zeros((BLOCK_M, BLOCK_H), dtype=tl.float32)
        full = N // BLOCK_K
        for k in range(full):
            toks = k * BLOCK_K + offs_k
            rows = tl.load(rows_ptr + toks)
            a = tl.load(d_ptr + toks[None, :].to(tl.int64) * stride_d + cols[:, None])
            b = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + feats[None, :])
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if full * BLOCK_K < N:
            toks = full * BLOCK_K + offs_k
            k_mask = toks < N
            rows = tl.load(rows_ptr + toks, mask=k_mask, other=0)
            a = tl.load(d_ptr + toks[None, :].to(tl.int64) * stride_d + cols[:, None], mask=k_mask[None, :],
                        other=0.0)
            b = tl.load(h_ptr + rows[:, None].to(tl.int64) * stride_h + feats[None, :], mask=k_mask[:, None],
                        other=0.0)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_o + offs_h[None, :]
        tl.store(ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < width) & (offs_h[None, :] < H))


def _bucket(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _lse_splits(n_tokens: int, vocab: int, device: torch.device) -> int:
    """Vocabulary slices of the forward grid (``_balanced_splits`` for 128 x 256 tiles).

    A function of the token bucket, so it takes few distinct values (each is a compile-time
    constant of the kernel, hence a compile per bucket)."""
    if device.type != "cuda":
        return 2
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return _balanced_splits(triton.cdiv(_bucket(n_tokens), 128), triton.cdiv(vocab, 256), sms)


def _balanced_splits(row_blocks: int, tiles: int, sms: int, most: int = 64) -> int:
    """The fewest slices (at most ``most``) whose grid of ``row_blocks`` x slices programs, each
    over ceil(tiles / slices) vocabulary tiles, finishes within 2% of the best: the busiest SM
    runs ceil(programs / sms) waves of that many tiles. The H200 profile at 47cfa3b had 4 x
    the SM count as the target (17 slices at 4096 loss tokens: 544 programs, 4.1 waves, so the
    last wave ran 16 programs and the busiest SM 150 tiles where 4 slices give one wave of 126)."""
    def busiest(slices: int) -> int:
        return -(-row_blocks * slices // sms) * -(-tiles // slices)

    best = min(busiest(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if busiest(s) <= 1.02 * best)


def _lse_triton(hidden, weight, bias, rows, labels_n, softcap):
    n, (vocab, hdim) = rows.numel(), weight.shape
    splits = _lse_splits(n, vocab, hidden.device)
    m, s, t = (_empty((splits, n), torch.float32, hidden.device) for _ in range(3))
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), splits)  # noqa: E731
    _lse_kernel[grid](hidden, weight, bias if bias is not None else weight, rows, labels_n, m, s, t,
                      n, vocab, hdim, _bucket(n), hidden.stride(0), weight.stride(0), float(softcap),
                      SPLITS=splits, HAS_BIAS=bias is not None, HAS_SOFTCAP=bool(softcap),
                      PRECISION=dot_precision(hidden.dtype, "linear_ce"))
    m_max = m.max(dim=0).values
    lse = m_max + torch.log((s * torch.exp(m - m_max)).sum(dim=0))
    return lse, t.sum(dim=0)


def _width_key(width: int, chunk: int) -> int:
    """The step kernels' tuning key for a step ``width`` columns wide: its power-of-two bucket
    (at most the chunk's), so the shrinking steps at the end of the vocabulary get tiles of
    their own width; with STEP_TILES "per-chunk" every step shares the chunk's tiles."""
    return chunk if STEP_TILES == "per-chunk" else min(_bucket(width), _bucket(chunk))


def _dlogits_triton(hidden, weight, bias, rows, labels_n, lse, g, softcap, z_loss, v0, out, chunk):
    """Writes the logit gradient of columns [v0, v0 + width) into ``out`` (n x width)."""
    n, width = out.shape
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(width, meta["BLOCK_V"]))  # noqa: E731
    _dlogits_kernel[grid](hidden, weight, bias if bias is not None else weight, rows, labels_n, lse, g, out,
                          n, weight.shape[0], weight.shape[1], _bucket(n), _width_key(width, chunk), v0, width,
                          hidden.stride(0), weight.stride(0), out.stride(0), float(softcap), float(z_loss),
                          HAS_BIAS=bias is not None, HAS_SOFTCAP=bool(softcap),
                          PRECISION=dot_precision(hidden.dtype, "linear_ce"))
    return out


def _dweight_triton(d, hidden, rows, out, chunk):
    """out (width x H) = d.T @ hidden[rows], d (n x width), fp32-accumulated."""
    n, width = d.shape
    hdim = hidden.shape[1]
    grid = lambda meta: (triton.cdiv(width, meta["BLOCK_M"]), triton.cdiv(hdim, meta["BLOCK_H"]))
    _dweight_kernel[grid](d, hidden, rows, out, n, width, hdim, _bucket(n), _width_key(width, chunk), d.stride(0),
                          hidden.stride(0), out.stride(0), PRECISION=dot_precision(hidden.dtype, "linear_ce"))


# --------------------------------------------------------------------------------------
# Shared forward / backward drivers (reference and Triton differ only in the two steps above)
# --------------------------------------------------------------------------------------

_FP32_OUT_MM: dict[str, bool] = {}


def _accumulate_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc += a @ b with fp32 accumulation and no rounding of the partial product.

    16-bit inputs use cuBLAS's fp32-output GEMM (``addmm(out_dtype=float32)``) where this
    torch build has it; otherwise the product is rounded once to the input dtype (logged)."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
        return
    kind = acc.device.type
    if _FP32_OUT_MM.get(kind, True):
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _FP32_OUT_MM[kind] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _FP32_OUT_MM[kind] = False
            warn_once(f"linear_ce:fp32out:{kind}", "linear_ce: no fp32-output matmul for 16-bit inputs on "
                      f"{kind}; the hidden-gradient partial products are rounded to {a.dtype} before summing")
    acc += torch.mm(a, b)


def _forward(hidden, weight, labels, bias, ignore_index, softcap, z_loss, triton_path, vocab_chunk=0):
    """Per-token loss and log-sum-exp, length T, zero at ignored tokens."""
    loss = torch.zeros(hidden.shape[0], dtype=torch.float32, device=hidden.device)
    lse_all = torch.zeros_like(loss)
    rows, rows_host, _, labels_host = _split_tokens(labels, ignore_index)
    if rows.numel() == 0:
        return loss, lse_all
    lo, hi = torch.stack(labels_host[rows_host].aminmax()).tolist()
    if lo < 0 or hi >= weight.shape[0]:
        raise MemfitError(f"linear_cross_entropy: labels must lie in [0, {weight.shape[0]}) or equal "
                          f"ignore_index={ignore_index}; got values in [{lo}, {hi}]")
    labels_n = labels.index_select(0, rows)
    if triton_path:
        lse, tgt = _lse_triton(hidden, weight, bias, rows, labels_n, softcap)
    else:
        lse, tgt = _lse_reference(hidden.index_select(0, rows), weight, bias, labels_n, softcap,
                                  _vocab_chunk(weight.shape[0], vocab_chunk, False, rows.numel()))
    loss.index_copy_(0, rows, lse - tgt + z_loss * lse * lse)
    lse_all.index_copy_(0, rows, lse)
    return loss, lse_all


def _accumulator_in(d_hidden: torch.Tensor, n: int, first: int = 0) -> Optional[torch.Tensor]:
    """A zeroed fp32 (n, H) view of ``d_hidden``'s own storage, or None where it does not fit.

    The hidden gradient (T x H, input dtype) has to be allocated anyway; its bytes hold the
    fp32 accumulator of the n loss tokens whenever 4nH <= its size: always for fp32 inputs,
    for 16-bit inputs when at most half the tokens carry a loss (typical for fine-tuning).
    It starts at fp32 row ``first`` (the first loss token's row), pulled back as far as it must
    to fit: loss rows that already sit at their own row need no move in the finish (an ignored
    prefix or BOS token costs nothing there)."""
    hdim = d_hidden.shape[1]
    flat = d_hidden.view(-1)
    words = flat.numel() * flat.element_size() // 4
    if words < n * hdim:
        return None
    if flat.element_size() != 4:
        flat = flat[: words * 4 // flat.element_size()].view(torch.float32)
    first = min(first, words // hdim - n)
    return flat[first * hdim:(first + n) * hdim].view(n, hdim).zero_()


def _hidden_grad_buffers(hidden: torch.Tensor, rows_host: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(d_hidden or None, fp32 n x H accumulator): the accumulator in d_hidden's buffer where it
    fits and HIDDEN_ACC allows; else a separate one, and d_hidden is allocated after the loop.
    ``rows_host``: the loss rows on the host (the first one places the accumulator without a sync)."""
    n = rows_host.numel()
    if HIDDEN_ACC == "in-buffer":
        d_hidden = _empty(hidden.shape, hidden.dtype, hidden.device)
        acc = _accumulator_in(d_hidden, n, int(rows_host[0]))
        if acc is not None:
            return d_hidden, acc
        del d_hidden
    return None, torch.zeros(n, hidden.shape[1], dtype=torch.float32, device=hidden.device)


def _finish_block(hdim: int) -> int:
    """Rows of the finish's temporary (FINISH_ELEMENTS // H, at least one)."""
    return max(1, FINISH_ELEMENTS // hdim)


def _finish_hidden_grad(d_hidden, acc, rows, rows_host, ignored):
    """Write the hidden gradient: row i of the fp32 ``acc`` rounded into row ``rows[i]``,
    every ignored row zero, through a temporary of at most ``_finish_block`` rows.

    * ``acc`` separate (16-bit inputs with more than half the tokens carrying a loss, the usual
      fine-tuning case): with no ignored token one cast copy; else ``acc`` is rounded into the
      first half of its own bytes (``_round_rows``, 16-bit) and scattered by one index_copy_:
      O(log n) launches whatever the label pattern.
    * ``acc`` in ``d_hidden``'s storage at fp32 row ``first`` (``_accumulator_in``; fp32, or
      16-bit with at most half the tokens carrying a loss): rounded in place into d_hidden
      rows [first, first + n) (16-bit), then moved in place to its rows (``_move_rows``),
      O(log n) launches where rows move far or not at all (an ignored prefix); rows that move
      by fewer than a block (e.g. fp32 with the last token of every sequence ignored) cost two
      launches per block."""
    n, block = rows.numel(), _finish_block(d_hidden.shape[1])
    in_place = acc.untyped_storage().data_ptr() == d_hidden.untyped_storage().data_ptr()
    if not in_place and ignored.numel() == 0:
        d_hidden.copy_(acc)
        return
    first = (acc.data_ptr() - d_hidden.data_ptr()) // (acc.element_size() * acc.shape[1]) if in_place else 0
    out = d_hidden[first:first + n] if in_place else acc.view(-1).view(d_hidden.dtype)[:acc.numel()].view_as(acc)
    if acc.dtype != d_hidden.dtype:
        _round_rows(acc, out, block)
    if ignored.numel() == 0:
        return
    if in_place:
        _move_rows(d_hidden, rows, rows_host, first, block)
    else:
        d_hidden.index_copy_(0, rows, out)
    d_hidden.index_fill_(0, ignored, 0)


def _round_rows(acc, out, block):
    """out[i] = acc[i] rounded to out's (16-bit) dtype, in place: ``out`` starts at or before
    ``acc`` in the same storage, so out's row i lies below acc's row i and ascending slices only
    overwrite acc rows they have read. A slice [r0, r1) is disjoint from the unread acc rows
    when out row r1 - 1 ends before acc row r0 starts, which doubles the safe slice each time;
    where that allows fewer rows than a ``block``-row slice, the slice goes through a temporary
    of at most ``block`` rows. About log2(n / block) launches."""
    n = acc.shape[0]
    lead = (acc.data_ptr() - out.data_ptr()) // (out.element_size() * out.shape[1])  # out rows before acc
    ratio = acc.element_size() // out.element_size()
    r0 = 0
    while r0 < n:
        r1 = min(n, lead + ratio * r0)
        if r1 - r0 >= min(block, n - r0):
            out[r0:r1].copy_(acc[r0:r1])
        else:
            r1 = min(n, r0 + block)
            out[r0:r1].copy_(acc[r0:r1].to(out.dtype))
        r0 = r1


def _move_rows(d_hidden, rows, host, first, block):
    """Row first + i -> row rows[i] in place, descending i. ``rows`` is ascending with
    rows[i] >= first + i, so a destination never lies below its source. With r1 the rows still
    to move and r0 the first i whose rows[i] >= first + r1, the destinations of [r0, r1) lie above
    every unmoved source: one index_copy_ through a view that excludes the sources. Where that
    is fewer than ``block`` rows, the top ``block`` rows go through a clone instead (their
    destinations only land on rows already read). Once rows[i] = first + i the rest are in place.
    ``host`` is ``rows`` on the host (the plan is made there, without a sync)."""
    r1 = rows.numel()
    while r1 > 0 and int(host[r1 - 1]) != first + r1 - 1:
        top = first + r1
        r0 = int(torch.searchsorted(host, top))
        if r1 - r0 >= block:
            d_hidden[top:].index_copy_(0, rows[r0:r1] - top, d_hidden[first + r0:top])
        else:
            r0 = max(0, r1 - block)
            d_hidden.index_copy_(0, rows[r0:r1], d_hidden[first + r0:top].clone())
        r1 = r0


def _backward_plan(vocab: int, hdim: int, n: int, chunk: int, in_weight_grad: bool, copy_rows: int = 0
                   ) -> tuple[list[tuple[int, int, bool, bool]], int]:
    """The backward's vocabulary steps ``[(v0, v1, in_weight_grad, copied)]`` and the side buffer's width.

    A step's n x w logit-gradient chunk must live somewhere until both its matmuls have run.
    When the weight trains (and ``in_weight_grad``), it lives in the weight gradient's rows
    that are not written yet, rows >= v1, which hold it while n*w <= (V - v1)*H: steps are
    ``chunk`` wide while that holds, then shrink (``_in_weight_grad_width``) as the free rows
    run out. Once a step would be narrower than STEP_ALIGN, or the rest fits in TAIL_ELEMENTS,
    the rest goes through a side buffer in steps of max(STEP_ALIGN, TAIL_ELEMENTS // n) columns
    (at most ``chunk``), so that buffer holds at most max(TAIL_ELEMENTS, n * STEP_ALIGN)
    elements; a frozen weight has only the side buffer, n x chunk. The buffer's width is the
    widest side step.

    ``copy_rows`` > 0 (DW_MATMUL "cublas-in-grad"): the last ``copy_rows`` rows of the weight
    gradient first hold a gathered copy of the loss-token rows of hidden, so the steps before
    them (``copied``) run the weight-gradient matmul in cuBLAS; their chunks must then fit
    below those rows. Once a step would be narrower than COPY_MIN_WIDTH, the copy is given up
    and the remaining steps (over at least those rows) read hidden through the index, as above."""
    tail = min(chunk, max(STEP_ALIGN, TAIL_ELEMENTS // n)) if in_weight_grad else chunk
    reserved = copy_rows if in_weight_grad and copy_rows < vocab else 0
    steps, v0, side = [], 0, 0
    while v0 < vocab:
        free = vocab - v0
        if reserved:
            w = _in_weight_grad_width(free - reserved, hdim, n, chunk) if free > reserved else 0
            if w >= min(chunk, COPY_MIN_WIDTH):
                steps.append((v0, v0 + w, True, True))
                v0 += w
                continue
            reserved = 0
        fits = in_weight_grad and n * min(free, chunk) > TAIL_ELEMENTS
        w = _in_weight_grad_width(free, hdim, n, chunk) if fits else 0
        if w:
            steps.append((v0, v0 + w, True, False))
        else:
            w = min(tail, free)
            side = max(side, w)
            steps.append((v0, v0 + w, False, False))
        v0 += w
    return steps, side


def _copy_rows(n: int, triton_weight_grad: bool) -> int:
    """Rows of the weight gradient that hold the gathered loss-token rows first (DW_MATMUL
    "cublas-in-grad"), 0 otherwise."""
    return n if triton_weight_grad and DW_MATMUL == "cublas-in-grad" else 0


def _in_weight_grad_width(free: int, hdim: int, n: int, chunk: int) -> int:
    """Columns of a step whose n x w chunk lives in the ``free`` weight-gradient rows after it
    (n*w <= (free - w)*H): ``chunk``, or the largest multiple of STEP_ALIGN that fits, 0 if none."""
    w = min(chunk, free * hdim // (n + hdim))
    return w if w == chunk else w - w % STEP_ALIGN


def _logit_grad_buffer(d_weight, side, v1, n, width, in_weight_grad):
    """The n x width (contiguous) buffer of a step's logit gradient: in the weight gradient's
    unwritten rows from v1 on, or at the start of the side buffer."""
    if in_weight_grad:
        start = v1 * d_weight.shape[1]
        return d_weight.view(-1)[start:start + n * width].view(n, width)
    return side[: n * width].view(n, width)


def _weight_grad_step(d, hidden, rows, hs, out, chunk, triton_path):
    """out = d.T @ (loss-token rows of hidden), fp32-accumulated over all n, rounded once: by
    cuBLAS on the gathered rows ``hs`` where there are some, else by ``_dweight_kernel``."""
    if triton_path and hs is None:
        _dweight_triton(d, hidden, rows, out, chunk)
    elif d.dtype == out.dtype:
        torch.mm(d.T, hs, out=out)
    else:
        out.copy_(d.T @ hs)


def _backward(grad_loss, hidden, weight, labels, bias, lse_all, ignore_index, softcap, z_loss,
              need_weight_grad, vocab_chunk, triton_path):
    """Gradients for hidden (T, H), weight (V, H) (empty if not needed) and bias (V or empty).

    One pass over the vocabulary in steps (``_backward_plan``). Peak above the inputs: the
    two gradients, the side buffer (the logit-gradient chunks live in the weight gradient's
    unwritten rows, the side buffer only takes the last ones; N x C for a frozen weight),
    the finish's temporary, and the fp32 N x H
    hidden-gradient accumulator only where it does not fit in the hidden gradient's own
    buffer (see ``backward_memory``)."""
    vocab, hdim = weight.shape
    d_bias = torch.zeros_like(bias) if bias is not None else weight.new_empty(0)
    rows, rows_host, ignored, _ = _split_tokens(labels, ignore_index)
    n = rows.numel()
    if n == 0:
        d_weight = torch.zeros_like(weight) if need_weight_grad else weight.new_empty(0)
        return torch.zeros_like(hidden), d_weight, d_bias
    d_weight = _empty(weight.shape, weight.dtype, weight.device) if need_weight_grad else weight.new_empty(0)
    labels_n = labels.index_select(0, rows)
    lse = lse_all.index_select(0, rows)
    g = grad_loss.index_select(0, rows).float()
    compute = hidden.dtype if triton_path else torch.float32
    hs = copy = None  # the gathered loss-token rows, only where something reads them
    triton_weight_grad = need_weight_grad and triton_path
    first = int(rows_host[0])
    if not triton_path or (need_weight_grad and DW_MATMUL == "cublas"):
        hs = (hidden if n == hidden.shape[0] else hidden.index_select(0, rows)).to(compute)
    elif triton_weight_grad and DW_MATMUL == "cublas-in-grad" and int(rows_host[-1]) == first + n - 1:
        hs = hidden[first:first + n]  # the loss rows are one range (every token, or one response): no copy needed
    d_hidden, acc = _hidden_grad_buffers(hidden, rows_host)
    # the wider trained-weight chunk only where its chunks live in the weight gradient (the
    # reference's fp32 chunks are buffers of their own)
    chunk = _vocab_chunk(vocab, vocab_chunk, triton_weight_grad, n)
    steps, side_width = _backward_plan(vocab, hdim, n, chunk, triton_weight_grad,
                                       _copy_rows(n, triton_weight_grad) if hs is None else 0)
    if any(copied for *_, copied in steps):  # the copy sits in the weight gradient's last n rows
        copy = d_weight.view(-1)[(vocab - n) * hdim:].view(n, hdim)
        torch.index_select(hidden, 0, rows, out=copy)
    side = _empty((n * side_width,), compute, hidden.device) if triton_path and side_width else None
    for v0, v1, in_weight_grad, copied in steps:
        if triton_path:
            d = _logit_grad_buffer(d_weight, side, v1, n, v1 - v0, in_weight_grad)
            _dlogits_triton(hidden, weight, bias, rows, labels_n, lse, g, softcap, z_loss, v0, d, chunk)
        else:
            d = _dlogits_reference(hs, weight, bias, labels_n, lse, g, softcap, z_loss, v0, v1)
        if need_weight_grad:
            _weight_grad_step(d, hidden, rows, copy if copied else hs, d_weight[v0:v1], chunk, triton_path)
        if bias is not None:
            d_bias[v0:v1] = d.sum(dim=0, dtype=torch.float32)
        _accumulate_fp32(acc, d, weight[v0:v1].to(compute))
        del d                       # before the next step's chunk exists
    del side, hs, copy
    if d_hidden is None:
        d_hidden = _empty(hidden.shape, hidden.dtype, hidden.device)
    _finish_hidden_grad(d_hidden, acc, rows, rows_host, ignored)
    return d_hidden, d_weight, d_bias


def backward_memory(tokens: int, loss_tokens: int, hidden_size: int, vocab: int, dtype_bytes: int = 2, *,
                    weight_grad: bool = True, vocab_chunk: int | None = None, pytorch_path: bool = False) -> dict:
    """Bytes the op holds beyond its inputs (hidden, weight, labels), for the ledger: on the Triton path under the
    current DW_MATMUL / HIDDEN_ACC / TAIL_ELEMENTS settings, or on the PyTorch path (``pytorch_path``, see
    :func:`takes_pytorch_path`), whose steps hold their fp32 chunk (N x C, C as for a frozen weight) in a
    buffer of their own whether or not the weight trains, and a gathered fp32 copy of the loss rows (4NH) where
    some token is ignored or the inputs are 16-bit; in 16-bit also one fp32 copy of a weight chunk (4CH) at a time.
    Without a soft cap, whose temporaries (two more N x C fp32 on the PyTorch path) it does not count.

    T tokens, N loss tokens, H hidden, V vocabulary, e bytes per element, C vocab chunk:

    * saved for backward: the per-token log-sum-exp, 4T;
    * gradients (returned): dW e*V*H (when the weight trains), dH e*T*H;
    * backward transients: the side buffer e*N*S (S from ``_backward_plan``: N*S <=
      max(TAIL_ELEMENTS, N*STEP_ALIGN) when the weight trains, S = C when it is frozen),
      gathered loss rows e*N*H only for DW_MATMUL "cublas" with N < T, index/scale vectors
      ~24N + 8(T-N), the finish's temporary e*min(N, B)*H with B = FINISH_ELEMENTS // H rows
      where some token is ignored and the finish rounds or moves rows through it (at most: a
      label pattern whose loss rows need no move, e.g. only a prefix ignored, uses less; the
      move's index slices, up to 8N bytes, never coexist with it and stay below it while
      8N <= e*FINISH_ELEMENTS); the fp32 accumulator 4NH only when it does not sit in dH's
      buffer (4NH > e*T*H, or HIDDEN_ACC "separate") - then dH is allocated after the loop;
    * peak (backward, above inputs) = saved + dW + vectors + (accumulator in dH:
      dH + max(side + rows, finish)) | (separate: max(acc + side + rows, acc + dH + finish)).

    The forward peak (Triton: ~(8 + 12 * splits) N + 8T; PyTorch: the gathered rows, in 16-bit also their fp32 copy
    and a fp32 weight chunk, and one fp32 N x C chunk) is below the backward's."""
    t, n, h, v, e = tokens, loss_tokens, hidden_size, vocab, dtype_bytes
    c = _vocab_chunk(v, vocab_chunk or 0, weight_grad and not pytorch_path, n)
    saved = 4 * t
    d_weight = e * v * h if weight_grad else 0
    d_hidden = e * t * h
    if pytorch_path:   # a step's peak: its fp32 chunk and, in 16-bit, a weight chunk's fp32 copy, else its label
        # vectors (a mask, the chunk's label ids, the -1s scattered: 17 bytes a loss token)
        side = (4 * n * c + (4 * c * h if e != 4 else 17 * n)) if n else 0
        rows = 4 * n * h if n < t or e != 4 else 0
    else:
        # every token a loss token: the steps read hidden itself, no copy (a single loss range with n < t
        # does too; its side buffer may then differ from this plan's by up to e * max(TAIL_ELEMENTS, n * STEP_ALIGN))
        copy_rows = _copy_rows(n, weight_grad) if n < t else 0
        side = e * n * _backward_plan(v, h, n, c, weight_grad, copy_rows)[1] if n else 0
        rows = e * n * h if weight_grad and DW_MATMUL == "cublas" and n < t else 0
    vectors = 24 * n + 8 * (t - n)
    aliased = HIDDEN_ACC == "in-buffer" and 4 * n * h <= e * t * h
    finish = e * min(n, _finish_block(h)) * h if n < t and (aliased or e != 4) else 0
    acc = 0 if aliased else 4 * n * h
    if aliased:
        during = d_hidden + max(side + rows, finish)
    else:
        during = max(acc + side + rows, acc + d_hidden + finish)
    peak = saved + d_weight + vectors + during
    return {"saved": saved, "gradients": d_weight + d_hidden, "transient": peak - saved - d_weight - d_hidden,
            "peak": peak, "vocab_chunk": c, "side_buffer": side,
            "accumulator": "in hidden-gradient buffer" if aliased else "separate"}


# --------------------------------------------------------------------------------------
# Custom ops
# --------------------------------------------------------------------------------------


@torch.library.custom_op("memfit::linear_ce", mutates_args=())
def _linear_ce_op(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: Optional[torch.Tensor],
                  ignore_index: int, softcap: float, z_loss: float, vocab_chunk: int, path: Optional[str]
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """(per-token loss, per-token log-sum-exp), both fp32 of length T, 0 at ignored tokens.

    ``vocab_chunk``: backward columns per step (0: ``_vocab_chunk``'s default). ``path``: None follows
    MEMFIT_KERNELS (default auto), else "auto" | "triton" | "reference"."""
    triton_path = _runs_triton(hidden, weight, path)
    return _forward(hidden, weight, labels, bias, ignore_index, softcap, z_loss, triton_path, vocab_chunk)


@_linear_ce_op.register_fake
def _(hidden, weight, labels, bias, ignore_index, softcap, z_loss, vocab_chunk, path):
    out = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
    return out, torch.empty_like(out)


@torch.library.custom_op("memfit::linear_ce_backward", mutates_args=())
def _linear_ce_backward_op(grad_loss: torch.Tensor, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                           bias: Optional[torch.Tensor], lse: torch.Tensor, ignore_index: int, softcap: float,
                           z_loss: float, need_weight_grad: bool, vocab_chunk: int, path: Optional[str]
                           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    triton_path = _runs_triton(hidden, weight, path)
    return _backward(grad_loss, hidden, weight, labels, bias, lse, ignore_index, softcap, z_loss,
                     need_weight_grad, vocab_chunk, triton_path)


@_linear_ce_backward_op.register_fake
def _(grad_loss, hidden, weight, labels, bias, lse, ignore_index, softcap, z_loss, need_weight_grad, vocab_chunk,
      path):
    d_weight = torch.empty_like(weight) if need_weight_grad else weight.new_empty(0)
    d_bias = torch.empty_like(bias) if bias is not None else weight.new_empty(0)
    return torch.empty_like(hidden), d_weight, d_bias


def _setup_context(ctx, inputs, output):
    hidden, weight, labels, bias, ignore_index, softcap, z_loss, vocab_chunk, path = inputs
    ctx.save_for_backward(hidden, weight, labels, bias, output[1])
    ctx.args = (ignore_index, softcap, z_loss)
    ctx.vocab_chunk, ctx.path = vocab_chunk, path


def _linear_ce_grad(ctx, grad_loss, _grad_lse):
    hidden, weight, labels, bias, lse = ctx.saved_tensors
    d_hidden, d_weight, d_bias = _linear_ce_backward_op(
        grad_loss.contiguous(), hidden, weight, labels, bias, lse, *ctx.args, ctx.needs_input_grad[1],
        ctx.vocab_chunk, ctx.path)
    return (d_hidden if ctx.needs_input_grad[0] else None, d_weight if ctx.needs_input_grad[1] else None,
            None, d_bias if bias is not None and ctx.needs_input_grad[3] else None, None, None, None, None, None)


_linear_ce_op.register_autograd(_linear_ce_grad, setup_context=_setup_context)


# --------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------


def _check(hidden, weight, labels, reduction, softcap, z_loss, bias, vocab_subset, vocab_chunk):
    if reduction not in REDUCTIONS:
        raise MemfitError(f"linear_cross_entropy: reduction {reduction!r} is not one of {', '.join(REDUCTIONS)}")
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise MemfitError(f"linear_cross_entropy: hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} "
                          "must be (..., H) and (V, H)")
    if tuple(labels.shape) != tuple(hidden.shape[:-1]):
        raise MemfitError(f"linear_cross_entropy: labels {tuple(labels.shape)} must have hidden's leading shape "
                          f"{tuple(hidden.shape[:-1])}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise MemfitError(f"linear_cross_entropy: labels must be int64 or int32, got {labels.dtype}")
    if hidden.dtype != weight.dtype or hidden.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise MemfitError(f"linear_cross_entropy: hidden ({hidden.dtype}) and weight ({weight.dtype}) must share "
                          "one dtype out of float32, bfloat16, float16")
    if softcap is not None and not softcap > 0:
        raise MemfitError(f"linear_cross_entropy: softcap must be a positive number or None, got {softcap!r}")
    if not z_loss >= 0:
        raise MemfitError(f"linear_cross_entropy: z_loss must be >= 0, got {z_loss!r}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise MemfitError(f"linear_cross_entropy: bias {tuple(bias.shape)} must be ({weight.shape[0]},)")
    if vocab_subset is not None and (vocab_subset.dim() != 1 or vocab_subset.dtype not in (torch.int64, torch.int32)):
        raise MemfitError("linear_cross_entropy: vocab_subset must be a 1-D integer tensor of vocabulary ids")
    if vocab_chunk is not None and not (isinstance(vocab_chunk, int) and vocab_chunk > 0):
        raise MemfitError(f"linear_cross_entropy: vocab_chunk must be a positive int or None, got {vocab_chunk!r}")


def _restrict_vocab(weight, bias, labels, ignore_index, vocab_subset):
    """Weight/bias rows of labels ∪ subset and the labels renumbered into that set, ignored ones marked
    SUBSET_IGNORE (a renumbered label may equal a non-negative ignore_index: kept, it read as ignored).

    The set is padded with the lowest ids not in it up to a multiple of SUBSET_ROWS_STEP (the whole
    vocabulary at most: with a vocabulary that small the mode is exact), so that its size takes few
    values over a run: the kernels compile and tune per vocabulary size, and with the labels' ids in the
    set that size changed every step (on an H200 the 3B fine-tuning table's subset row took 5.2-9.4 s per
    fp32 step, the exact row 0.7-5.2 s: ``earlier/finetune_memory_78102c4.json``). The extra ids only add
    softmax terms, so the loss moves toward the exact one."""
    keep = _softmax_ids(weight.shape[0], labels, ignore_index, vocab_subset)
    local = torch.where(labels != ignore_index, torch.searchsorted(keep, labels.to(torch.int64)), SUBSET_IGNORE)
    return weight.index_select(0, keep), None if bias is None else bias.index_select(0, keep), local


def _softmax_ids(vocab, labels, ignore_index, vocab_subset):
    """The sorted ids the subset mode's softmax runs over: labels ∪ subset, padded with the lowest other ids to a
    multiple of SUBSET_ROWS_STEP (the whole vocabulary at most)."""
    valid = labels != ignore_index
    keep = torch.unique(torch.cat([vocab_subset.to(labels.device, torch.int64), labels[valid].to(torch.int64)]))
    if keep.numel() and (keep[0] < 0 or keep[-1] >= vocab):
        raise MemfitError(f"linear_cross_entropy: vocab_subset and labels must lie in [0, {vocab})")
    padded = min(vocab, max(1, -(-keep.numel() // SUBSET_ROWS_STEP)) * SUBSET_ROWS_STEP)
    if padded > keep.numel():
        outside = torch.ones(vocab, dtype=torch.int8, device=keep.device)
        outside[keep] = 0
        lowest = torch.argsort(1 - outside, stable=True)[:padded - keep.numel()]   # the ids outside, in order
        keep = torch.cat([keep, lowest]).sort().values
    return keep


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, *,
                         ignore_index: int = -100, reduction: str = "mean", softcap: float | None = None,
                         z_loss: float = 0.0, bias: torch.Tensor | None = None,
                         vocab_subset: torch.Tensor | None = None, vocab_chunk: int | None = None,
                         path: str | None = None) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``labels``, logits never stored.

    hidden (..., H), weight (V, H) as an ``nn.Linear``/lm_head weight, labels (...) integer.
    ``softcap``: logits become ``cap * tanh(logits / cap)``. ``z_loss``: adds
    ``z_loss * logsumexp**2`` per token. Tokens labelled ``ignore_index`` cost nothing and
    count for nothing; "mean" over zero loss tokens is 0. ``reduction="none"`` returns the
    per-token loss (fp32, 0 at ignored tokens) in ``labels``' shape; "mean"/"sum" an fp32 scalar.
    ``vocab_subset`` (approximate, opt-in): the softmax runs over labels ∪ subset only (padded with
    the lowest other ids to a multiple of SUBSET_ROWS_STEP, so that compiles and tunings are reused).
    ``vocab_chunk``: vocabulary columns per backward step (default TRAINED_VOCAB_CHUNK when the
    weight trains on the Triton path, else VOCAB_CHUNK widened for few loss tokens, ``_vocab_chunk``); with a frozen
    weight the backward holds one N x vocab_chunk logit-gradient chunk, with a trained one the
    chunks live in the weight gradient's unwritten rows (see ``backward_memory``).
    ``path``: "auto" | "triton" | "reference"; None follows env MEMFIT_KERNELS (see
    ``memfit.kernels.dispatch``); auto runs fp32 on CUDA at IEEE precision by the PyTorch path
    (``takes_pytorch_path``).
    """
    _check(hidden, weight, labels, reduction, softcap, z_loss, bias, vocab_subset, vocab_chunk)
    if vocab_subset is not None:
        warn_once("linear_ce:vocab_subset", "linear_cross_entropy: vocab_subset restricts the softmax to labels ∪ "
                  f"subset, padded to a multiple of {SUBSET_ROWS_STEP} ids; the loss and gradients are approximate "
                  "(see subset_loss_deviation)")
        weight, bias, labels = _restrict_vocab(weight, bias, labels, ignore_index, vocab_subset)
        ignore_index = SUBSET_IGNORE
    h2 = hidden.reshape(-1, hidden.shape[-1])
    if h2.stride(-1) != 1:
        h2 = h2.contiguous()
    loss, _ = _linear_ce_op(h2, weight.contiguous(), labels.reshape(-1).to(torch.int64).contiguous(),
                            None if bias is None else bias.contiguous(), ignore_index, float(softcap or 0.0),
                            float(z_loss), vocab_chunk or 0, path)
    if reduction == "none":
        return loss.view(labels.shape)
    total = loss.sum()
    if reduction == "sum":
        return total
    return total / (labels != ignore_index).sum().clamp(min=1)


def frequent_token_subset(token_ids: torch.Tensor, k: int, vocab_size: int | None = None) -> torch.Tensor:
    """The ``k`` most frequent ids of ``token_ids`` (e.g. a training set), a candidate set for
    ``vocab_subset``. Negative ids (ignore labels) are not counted."""
    if k < 1:
        raise MemfitError(f"frequent_token_subset: k must be >= 1, got {k}")
    ids = token_ids.reshape(-1)
    ids = ids[ids >= 0].to(torch.int64)
    counts = torch.bincount(ids, minlength=vocab_size or 0)
    k = min(k, int((counts > 0).sum()))
    return counts.topk(k).indices.sort().values


@torch.no_grad()
def subset_loss_deviation(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          vocab_subset: torch.Tensor, **kwargs) -> dict:
    """Loss of the vocabulary-subset mode against the exact loss on one batch.

    Returns {"exact", "approx", "abs_dev", "rel_dev", "subset_size", "softmax_ids"} (``softmax_ids``: the
    ids the approximate softmax ran over, labels ∪ subset padded to whole SUBSET_ROWS_STEP); the subset loss
    is never above the exact one, since dropping vocabulary terms only lowers the log-sum-exp."""
    kwargs = {**kwargs, "reduction": "mean"}
    exact = float(linear_cross_entropy(hidden, weight, labels, **kwargs))
    approx = float(linear_cross_entropy(hidden, weight, labels, vocab_subset=vocab_subset, **kwargs))
    dev = exact - approx
    ignore_index = kwargs.get("ignore_index", -100)
    softmax_ids = _softmax_ids(weight.shape[0], labels, ignore_index, vocab_subset).numel()
    return {"exact": exact, "approx": approx, "abs_dev": dev, "rel_dev": dev / max(abs(exact), 1e-12),
            "subset_size": int(vocab_subset.numel()), "softmax_ids": softmax_ids}
