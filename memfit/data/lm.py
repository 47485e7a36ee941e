"""Causal-LM training and perplexity on token streams (the small-model benchmarks' loop).

``train_lm`` samples random windows from a 1-D token stream and runs AdamW with warm-up
and cosine decay (bf16 autocast on CUDA); ``perplexity`` scores non-overlapping windows.
The small-model trainer and the compression-recovery fine-tune share them.
"""
from __future__ import annotations

import math
import time
from typing import Callable

import torch
import torch.nn.functional as F

from memfit.errors import MemfitError, is_count


def random_windows(stream: torch.Tensor, batch: int, seq_len: int, generator: torch.Generator | None = None) -> torch.Tensor:
    """``batch`` windows of ``seq_len + 1`` tokens (inputs and shifted targets) from ``stream``, any start alike (the
    bound had left out the last one: the stream's last token was never a target, and a stream of exactly one window
    ended in torch's "from must be less than to")."""
    if stream.numel() < seq_len + 1:
        raise MemfitError(f"random_windows: the stream has {stream.numel()} tokens, fewer than one window of "
                          f"seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(0, stream.numel() - seq_len, (batch,), generator=generator, device="cpu")
    return stream[starts.to(stream.device)[:, None] + torch.arange(seq_len + 1, device=stream.device)]


def _loss(model, window: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=window[:, :-1]).logits
    return F.cross_entropy(logits.float().flatten(0, 1), window[:, 1:].flatten())


@torch.no_grad()
def perplexity(model, stream: torch.Tensor, seq_len: int = 512, batch: int = 16, max_windows: int | None = None) -> float:
    """exp(mean next-token NLL) over the non-overlapping windows of ``stream``."""
    n = (stream.numel() - 1) // seq_len
    if n < 1:   # no window would score as a perfect 1.0, which early stopping would take as the best
        raise MemfitError(f"perplexity: the stream has {stream.numel()} tokens, fewer than one window of "
                          f"seq_len + 1 = {seq_len + 1}; give a longer stream or a shorter seq_len")
    was_training = model.training
    model.eval()
    if max_windows:
        n = min(n, max_windows)
    starts = torch.arange(n, device=stream.device) * seq_len
    total, count = 0.0, 0
    for chunk in starts.split(batch):
        window = stream[chunk[:, None] + torch.arange(seq_len + 1, device=stream.device)]
        with torch.autocast("cuda", torch.bfloat16, enabled=stream.is_cuda):
            loss = _loss(model, window)
        total += float(loss) * window.shape[0]
        count += window.shape[0]
    model.train(was_training)
    return math.exp(total / max(count, 1))


def train_lm(model, stream: torch.Tensor, steps: int, batch: int = 16, seq_len: int = 512, lr: float = 2e-3,
             warmup: int = 100, weight_decay: float = 0.1, params=None, max_seconds: float | None = None,
             seed: int = 0, log: Callable[[int, float], None] | None = None, log_every: int = 100,
             validate: Callable[[], float] | None = None, validate_every: int = 50) -> dict:
    """Train ``model`` (or only ``params``) for ``steps`` steps; stop early past ``max_seconds``.

    With ``validate`` (a () -> held-out loss or perplexity, lower is better) the trained
    parameters are scored before training, every ``validate_every`` steps and at the end,
    and end as they were at the best score (early stopping): for text small enough to be
    memorised, as memfit.data's offline corpus is by benchmarks/train_small_model.py's model
    (benchmarks/results/train_small_model.json holds its dev scores, falling, then rising).
    ``seconds`` and ``max_seconds`` include the scoring after step 0 (``validate_seconds``:
    scores and snapshots); ``tokens_per_s`` is over the training time alone.
    """
    if not is_count(steps):       # 0 had ended in a ZeroDivisionError building the schedule
        raise MemfitError(f"train_lm: steps={steps!r}; give a positive number of steps")
    if validate is not None and validate_every < 1:
        raise MemfitError(f"train_lm: validate_every={validate_every}; give a positive number of steps")
    params = [p for p in (params if params is not None else model.parameters()) if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    rest = [p for p in params if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.95), fused=stream.is_cuda)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(warmup, 1)) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(s / steps, 1.0)))))
    gen = torch.Generator().manual_seed(seed)
    best = _Best(params, validate)
    best.check(0)
    model.train()
    start, done, scored = time.perf_counter(), 0, best.seconds      # the step-0 score is not timed
    for step in range(steps):
        window = random_windows(stream, batch, seq_len, gen)
        with torch.autocast("cuda", torch.bfloat16, enabled=stream.is_cuda):
            loss_t = _loss(model, window)
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        schedule.step()
        opt.zero_grad(set_to_none=True)
        done = step + 1
        if log and (done % log_every == 0 or done == steps):
            log(done, float(loss_t.detach()))
        if max_seconds is not None and time.perf_counter() - start > max_seconds:
            break
        if validate is not None and done % validate_every == 0 and done < steps:
            best.check(done)
            model.train()
    best.check(done)
    best.restore()
    model.eval()
    if stream.is_cuda:
        torch.cuda.synchronize()
    seconds, validate_seconds = time.perf_counter() - start, best.seconds - scored
    return {"steps": done, "seconds": seconds, "tokens": done * batch * seq_len, "last_loss": float(loss_t.detach()),
            "tokens_per_s": done * batch * seq_len / (seconds - validate_seconds), "validate_seconds": validate_seconds,
            **best.stats()}


class _Best:
    """Early stopping for :func:`train_lm`: a copy of the parameters at the best validation score
    (the earliest of equal ones; a NaN score is never the best)."""

    def __init__(self, params: list[torch.Tensor], validate: Callable[[], float] | None):
        self.params, self.validate = params, validate
        self.scores: list[tuple[int, float]] = []
        self.kept: list[torch.Tensor] | None = None
        self.best: tuple[int, float] | None = None
        self.seconds = 0.0                                  # wall time spent scoring and keeping snapshots

    def check(self, step: int) -> None:
        if self.validate is None or (self.scores and self.scores[-1][0] == step):
            return
        if self.params and self.params[0].is_cuda:
            torch.cuda.synchronize()                        # the queued training steps are not validation time
        start = time.perf_counter()
        score = float(self.validate())
        if not math.isnan(score) and (self.best is None or score < self.best[1]):
            self.best = (step, score)
            self.kept = [p.detach().clone() for p in self.params]
        self.scores.append((step, score))
        self.seconds += time.perf_counter() - start

    def restore(self) -> None:
        if self.kept is not None:
            with torch.no_grad():
                for p, kept in zip(self.params, self.kept):
                    p.copy_(kept)

    def stats(self) -> dict:
        if not self.scores:
            return {}
        step, score = self.best or (None, math.nan)
        return {"best_step": step, "best_validation": score, "validations": self.scores}
