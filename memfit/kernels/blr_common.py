"""Pieces the block-low-rank kernels (lowrank, monarch, blast) share: shape binding and the Triton-or-reference
choice, the dot precision, tile helpers, and the chaining of stages. The pipelines' timed pick is
:mod:`memfit.kernels.autotune`, their shared GEMM :mod:`memfit.kernels.batched_gemm`, their backward
:mod:`memfit.kernels.recompute`.

* ``n_bucket``: the token count rounded up to a power of two, at least 16 (one 16-token tile), the
  tile autotune key for N; ``pick_bucket``: the same without the floor, the variant pick's key, since
  which pipeline wins can change between 1 and 16 tokens where the tiles do not.
* Shapes are runtime ints in the kernels, so one compile (two where a loop drops its K mask
  when K allows) serves every layer shape
  (keeps a cold autotune short); a stride equal to 1 is specialised by Triton to the
  constant 1, so unit-stride loads and stores vectorise.
* Chained stages (the ``*_pdl`` pipelines, small N): a pipeline's second kernel is
  launched with programmatic dependent launch (Hopper+): the first calls
  ``gdc_launch_dependents`` as it starts, so the second is scheduled while the first runs;
  a GEMM stage asks L2 for its own weight slice (``prefetch_l2``: no registers held), the
  mixing stage loads its S tile, and only then does it wait (``gdc_wait``) for the
  previous kernel's output. At decode, where each kernel is a
  launch plus one dependent read of its weights, the second stage's launch and weight read
  overlap the first stage instead of following it. Off the GPU (the interpreter) the
  kernels run without it, so the tests cover the same arithmetic.
  Tried and taken out (817fdcf): every stage of a chain, the first too, launched dependent on whatever kernel came
  before it (its weight slice prefetched, then the wait) and letting the next kernel start after its wait (the last
  stage too, so that the next layer's first stage, or a compiled kernel built with inductor's ``enable_pdl``, could
  start early). In the end-to-end decode with memfit's attention
  (``earlier/blr_e2e_memfit_attention_chain_ends_817fdcf.json``) Monarch's step took 1.220 ms, against 1.215 before
  it (44a54ef) and 1.221 after it was taken out (0cdc726); BLAST's 1.400 against 1.304 and 1.306, with two of its four
  picks different (``z_mixgemm_pdl`` at q/o, ``bgemm_mix_bgemm_pdl`` at down, where both other runs took
  ``bgemm_mix_gemv_pdl``: the picks time back-to-back calls, which the change let overlap); the dense model's 1.410
  against 1.412 and 1.409; the free model's, which runs no BLR kernel, 0.787 against 0.599 and 0.601 (not traced).
  With inductor's PDL on too (the setting it was built for;
  ``earlier/blr_e2e_memfit_attention_inductor_pdl_chain_ends_817fdcf.json`` against 0cdc726's
  ``blr_e2e_memfit_attention_inductor_pdl.json``) Monarch's decode took 1.163 ms against 1.239 (6% faster, the fastest
  Monarch decode of any run; down's pick differed, ``two_stage_pdl`` against ``gemv_gemv_pdl``), BLAST's 1.346
  against 1.339, dense 1.298 and free 0.766-0.768 in both. Taken out: in the default setting no gain for Monarch and
  BLAST slower with two picks changed (not traced which), and where it helps, inductor's PDL speeds the dense model
  more (Monarch 1.116x dense there, against 1.154x in the default setting). A candidate again if memfit compiles
  with inductor's PDL.
"""
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from memfit.errors import MemfitError
from memfit.kernels.dispatch import (
    dot_precision,
    interpreting,
    outside_the_dispatcher,
    use_triton,
)


def pick_bucket(n: int) -> int:
    """The variant pick's key for N: rounded up to a power of two, 1 and 16 apart. With n_bucket's floor of 16,
    a table timing N = 1 first reused that pick at N = 16. At Llama-7B down the Monarch pick read 6-10% slower than
    ``bmm_perm_bmm`` at N = 16 in three runs (43f911d, 04677cb, 9f70ccb), and about as fast as ``bmm``, which leads
    at N = 1 by 1.4-2.9%. Keyed apart (6a18df8), the pick there takes ``bmm`` at N = 1 and ``bmm_perm_bmm`` at
    N = 16, which the table read at 20.03 us against that pipeline's own row's 19.89."""
    return _next_pow2(n)


def _next_pow2(n: int) -> int:
    """``triton.next_power_of_2`` of max(1, n) in plain Python: Triton's is a ConstexprFunction, whose call from the
    host unwraps its arguments as constexprs, and the ops ask it several times at every call (the pick's bucket,
    the tiles' N bucket, the block sizes)."""
    return 1 << (max(1, int(n)) - 1).bit_length()


def n_bucket(n: int) -> int:
    return max(16, pick_bucket(n))


def contiguous_bias(bias: torch.Tensor | None) -> torch.Tensor | None:
    """The bias as the BLR kernels read it, with a unit stride: a strided view is copied (the Triton pipelines read
    one as if it were contiguous, which gave wrong outputs and no error before the ops called this)."""
    return None if bias is None else bias.contiguous()


def bind_shapes(op: str, x: torch.Tensor, bias: torch.Tensor | None, factors: dict[str, tuple[torch.Tensor, str]],
                x_letters: str, bias_letters: str) -> dict[str, int]:
    """The sizes of the letters in the factors' shape patterns (name -> (tensor, e.g. "b m r")), refusing a factor
    with another number of dimensions or a letter two places give different sizes; x's last dimension must be the
    product of ``x_letters``' sizes and ``bias``, if given, a vector of the product of ``bias_letters``'. A BLR op's
    kernels index its factors by these sizes, so a mismatch read out of bounds (or corrupted memory) unchecked. x must
    be floating point: the op computes in x's dtype, so integer x truncated the weights to integers, unsaid."""
    if not x.is_floating_point():
        raise MemfitError(f"{op}: x must be floating point (the op computes in x's dtype), got {x.dtype}")
    sizes, source = {}, {}
    for name, (tensor, pattern) in factors.items():
        letters = pattern.split()
        if tensor.dim() != len(letters):
            raise MemfitError(f"{op}: {name} has shape {tuple(tensor.shape)}; expected ({', '.join(letters)})")
        for letter, size in zip(letters, tensor.shape):
            if sizes.setdefault(letter, size) != size:
                raise MemfitError(f"{op}: {name} has shape {tuple(tensor.shape)}, expected ({', '.join(letters)}) "
                                  f"with {letter} = {sizes[letter]} as in {source[letter]}")
            source.setdefault(letter, name)

    def product(letters: str) -> int:
        total = 1
        for letter in letters.split():       # a loop, not math.prod over a generator: torch.compile breaks its graph there
            total *= sizes[letter]
        return total

    if x.dim() == 0 or x.shape[-1] != product(x_letters):
        raise MemfitError(f"{op}: x has shape {tuple(x.shape)}; its last dimension must be "
                          f"{' * '.join(x_letters.split())} = {product(x_letters)}")
    if bias is not None and tuple(bias.shape) != (product(bias_letters),):
        raise MemfitError(f"{op}: bias has shape {tuple(bias.shape)}; expected ({product(bias_letters)},)")
    return sizes


def in_compute_dtype(x: torch.Tensor, *weights: torch.Tensor | None) -> tuple[torch.Tensor, list]:
    """``x`` and a BLR op's weights (a None bias kept) in the dtype the op computes in: x's, or autocast's where
    autocast is on for x's device, as autocast casts F.linear's inputs (float64 excepted). Under bf16 autocast a
    layer with fp32 weights had computed in fp32 and returned fp32 where nn.Linear returns bf16."""
    # autocast has no meta device, which shape inference runs on; memfit runs on the CPU and CUDA alone. A string test,
    # not torch.amp.is_autocast_available: torch 2.11's dynamo cannot trace that (a graph break in every BLR op)
    device = x.device.type
    if device in ("cpu", "cuda") and torch.is_autocast_enabled(device) and x.is_floating_point() \
            and x.dtype != torch.float64:
        x = x.to(torch.get_autocast_dtype(device))
    return x, [w if w is None else w.to(x.dtype) for w in weights]


def skips_dispatcher(*tensors: torch.Tensor | None) -> bool:
    """Whether a BLR op's wrapper may call the op's function directly instead of through its custom op: where
    :func:`memfit.kernels.dispatch.outside_the_dispatcher` allows it and no gradient is recorded (the custom op
    registers the backward). The eager prefill of a compressed model was host-bound on the H200's host at a93ab16."""
    grad = torch.is_grad_enabled()
    return outside_the_dispatcher(*tensors) and not any(grad and t is not None and t.requires_grad for t in tensors)


def runs_triton(op: str, x: torch.Tensor, tensors: tuple, path: str | None, variant: str) -> bool:
    """Whether a BLR op runs its Triton op (:func:`memfit.kernels.dispatch.use_triton`) rather than its reference; no
    tokens run the reference (which returns an empty output). A ``variant=`` names a Triton pipeline: asked where
    the reference runs, it is refused rather than ignored."""
    if x.numel() and use_triton(op, x, *tensors, path=path):
        return True
    if variant != "auto" and x.numel():
        raise MemfitError(f"{op}: variant={variant!r} names a Triton pipeline, and this call runs the PyTorch "
                          f"reference (path={path or 'auto'}, {x.dtype} tensors on {x.device.type}); leave "
                          "variant='auto'")
    return False


def require_offered(op: str, variant: str, offered: Callable[[], dict], where: str) -> None:
    """Refuse a ``variant=`` an op does not offer ``where`` (e.g. "at this token count"), naming the ones it does.
    ``offered`` is called only for a named variant: an op's Python wrapper runs at every call, inside
    torch.compile'd models too, and ``auto`` needs no offer there (the op works it out)."""
    if variant == "auto":
        return
    names = offered()
    if variant not in names:
        raise MemfitError(f"{op}: variant {variant!r} is not available {where}; available: {', '.join(names)}")


@triton.jit
def mma(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b at :func:`blr_precision` (the interpreter's bf16 dot is fixed in kernels/interpreter.py)."""
    return tl.dot(a, b, acc, input_precision=PRECISION)


def blr_precision(dtype: torch.dtype) -> str:
    """The BLR kernels' dot precision: tensor cores for 16-bit inputs, fp32 per torch's matmul precision."""
    return dot_precision(dtype, "block-low-rank kernels")


def keep_small_n(configs, n: int, name: str = "BN"):
    """Decode-sized N (<= 16) keeps only BN == 16 tiles; larger N drops them."""
    keep = [c for c in configs if (c.kwargs[name] == 16) == (n <= 16)]
    return keep or configs


SMEM_BYTES = 227 * 1024  # Hopper's shared memory per block (opt-in maximum)


def fits_smem(config, tile_elems: int, elem_bytes: int) -> bool:
    """Whether ``num_stages`` copies of a ``tile_elems``-element operand set fit shared memory."""
    return config.num_stages * tile_elems * elem_bytes <= SMEM_BYTES


def pow2_at_least(n: int, floor: int = 16) -> int:
    return max(floor, _next_pow2(n))


TOKEN_MAJOR_MIN_N = 128  # from here Monarch and BLAST also offer intermediates stored token-contiguous, (b, r, N),
                         # through Triton stages: below it a row of tokens is too short to fill whole cache lines
                         # (Monarch's all-cuBLAS tbmm_tbmm is offered at every N)


# ---- chained stages: programmatic dependent launch and an L2 prefetch of the weights ----

PDL_MAX_N = 128          # token counts where a stage's launch and first read are a visible share of its time (Monarch's
                         # chain goes further: monarch.TWO_STAGE_PDL_MAX_N); offered up to 256 at ba0a9d7, BLAST's and
                         # low-rank's chains were the fastest of their structure at none of the five shapes timed
                         # there (blr_layers_subset_256_chained.json)
PREFETCH_BLOCK = tl.constexpr(128)  # L2 prefetch requests issued per step (one per thread at 4 warps)


def pdl_offered() -> bool:
    """Whether the ``*_pdl`` pipelines are offered: on GPUs with programmatic dependent launch
    (compute capability 9.0+), and under the interpreter, which runs them without it."""
    if interpreting():
        return True
    # get_device_properties, which dynamo folds to a constant (its constant_fold_functions); get_device_capability is
    # not on that list. A precaution: no graph break was measured there (BLAST's wrapper asked it at every decode call
    # at 1476f91, whose compiled end-to-end run showed no sign of one)
    return torch.cuda.is_available() and torch.cuda.get_device_properties().major >= 9


def pick_candidates(available: dict, never_close_on_h200: tuple[str, ...]) -> dict:
    """The pipelines ``pick_variant`` times: ``available`` (what the op can run, and what the layer table times),
    less ``never_close_on_h200`` on a GPU that offers the chained (``*_pdl``) pipelines (:func:`pdl_offered`),
    at every N (above PDL_MAX_N too, where no chained pipeline runs: the rule rests on the H200's tables alone).
    An op names there the pipelines that in four full layer tables on the H200 from 43f911d to 89a2ab1 and one
    stopped run (9f70ccb) were never the fastest nor within 5% of it at any N (``blr_layers.py --summarize``
    over those files lists them): each cost every cold pick its compiles, tile tuning and timings for nothing.
    The plain-PyTorch pipelines are kept although some never came close either: they are cheap to time and
    guard the pick against a Triton stage that runs badly on a new shape. The names stay available
    (``variant=...``); without PDL they are the decode pipelines and the pick times them."""
    if not pdl_offered():
        return available
    return {name: fn for name, fn in available.items() if name not in never_close_on_h200}


def chain_options(launch_dependents: bool | None = None, wait_for_previous: bool | None = None) -> dict:
    """Kernel keyword arguments for a stage in a chain: the GDC constexprs the kernel has (None:
    it has no such flag) and, for a stage that waits, the launch attribute that lets it start
    before the previous kernel ends (all off under the interpreter, which has no launches to
    overlap and no inline PTX)."""
    on = not interpreting()
    options = {}
    if launch_dependents is not None:
        options["LAUNCH_DEPENDENTS"] = launch_dependents and on
    if wait_for_previous is not None:
        options["WAIT_FOR_PREVIOUS"] = wait_for_previous and on
        options |= {"launch_pdl": True} if wait_for_previous and on else {}
    return options


@triton.jit
def prefetch_l2(base, rows, row_stride, row_len, LINE: tl.constexpr):
    """Ask L2 for ``rows`` rows of ``row_len`` unit-stride elements, ``row_stride`` apart, from
    ``base``: one ``prefetch.global.L2`` per 128-byte line (``LINE`` elements), fire and forget."""
    per_row = tl.cdiv(row_len, LINE) + 1             # + 1: a row not starting on a line boundary spans one more
    total = rows * per_row
    for start in range(0, total, PREFETCH_BLOCK):
        idx = tl.minimum(start + tl.arange(0, PREFETCH_BLOCK), total - 1)
        col = tl.minimum((idx % per_row) * LINE, row_len - 1)
        ptrs = base + (idx // per_row).to(tl.int64) * row_stride + col
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // dummy $0", "=r,l", [ptrs], dtype=tl.int32,
                                  is_pure=False, pack=1)


def line_elements(t: torch.Tensor) -> int:
    """Elements of ``t`` per 128-byte cache line."""
    return 128 // t.element_size()
