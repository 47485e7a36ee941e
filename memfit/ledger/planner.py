"""The planner: every combination of technique variants, replayed, filtered by the budget,
ranked by predicted time.

Predicted time is the step's FLOPs times (1 + recompute) plus overheads, plus PCIe
traffic at a nominal 25 GB/s, all relative to the plain step. Plans that compute the job's
own numbers (no approximate technique) rank before every approximate one, however much
faster that is: an approximation is offered where nothing exact fits, or after the exact
plans. Among exact (or among approximate) plans the faster ranks first, then the smaller peak.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

from memfit.errors import MemfitError, is_count
from memfit.ledger.job import Job, Knobs
from memfit.ledger.predict import Ledger, check_knobs_fit_job, predict
from memfit.ledger.techniques import REGISTRY, Cost, active, approximate, step_flops, total_cost
from memfit.log import logger
from memfit.units import format_bytes

PCIE_BYTES_PER_S = 25e9
NOMINAL_FLOPS = 400e12  # a typical achieved bf16 training rate, to weigh PCIe seconds against compute


@dataclass
class Plan:
    knobs: Knobs
    base: Knobs
    ledger: Ledger
    cost: Cost
    relative_time: float

    @property
    def techniques(self) -> list[str]:
        return active(self.knobs, self.base)

    def to_dict(self) -> dict:
        return {"techniques": self.techniques, "relative_time": round(self.relative_time, 4),
                "recompute_fraction": round(self.cost.recompute, 4), "pcie_bytes_per_step": self.cost.pcie_bytes,
                **self.ledger.to_dict()}


def relative_time(job: Job, cost: Cost) -> float:
    compute_s = step_flops(job, Knobs()) / NOMINAL_FLOPS
    return 1.0 + cost.recompute + cost.overhead + cost.pcie_bytes / PCIE_BYTES_PER_S / compute_s


def candidates(job: Job, base: Knobs, allowed: tuple[str, ...] | None = None,
               keep: Callable[[Knobs], bool] | None = None) -> list[Knobs]:
    """``base`` itself (the job as asked, which no technique's variants need include: an asked --checkpoint-layers 5
    is none of checkpoint's counts) and every combination of the registered techniques' variants (or only the
    ``allowed`` ones) on top of it, less those ``keep`` refuses and those the job cannot take together
    (:func:`predict.check_knobs_fit_job`: memfit's decode loop and a 4-bit base, each a variant of its own, had made
    a plan `memfit generate` cannot run). A name ``allowed`` gives that no technique has is refused: it had been left
    out of the search, unsaid, so a misspelt list planned the job as asked alone."""
    if allowed is not None:
        if isinstance(allowed, str):       # "checkpoint" would match by substring, letter by letter
            allowed = (allowed,)
        if unknown := [name for name in allowed if name not in REGISTRY]:
            raise MemfitError(f"allowed: no technique named {', '.join(map(repr, unknown))}; the techniques are "
                              f"{', '.join(REGISTRY)}")
    options = [t.variants(job, base) or [{}] for name, t in REGISTRY.items() if allowed is None or name in allowed]
    out, seen = [], set()
    for combo in [(), *itertools.product(*options)]:
        changes = {k: v for part in combo for k, v in part.items()}
        knobs = base.with_(**changes)
        if knobs not in seen and (keep is None or keep(knobs)) and (not changes or _fits_job(job, knobs)):
            seen.add(knobs)
            out.append(knobs)
    return out


def _fits_job(job: Job, knobs: Knobs) -> bool:
    try:
        check_knobs_fit_job(job, knobs)
    except MemfitError:
        return False
    return True


def plan(job: Job, base: Knobs, budget: int | None = None, limit: int = 5,
         progress: Callable[[int, int], None] | None = None,
         allowed: tuple[str, ...] | None = None,
         keep: Callable[[Knobs], bool] | None = None) -> tuple[Ledger, list[Plan]]:
    """The ledger of the job as asked, and up to ``limit`` plans fitting ``budget``: exact ones first, then
    approximate ones, each fastest first.

    A technique's time cost is known without replaying the job, so candidates are replayed
    in order of predicted time (:func:`time_rank`) and the search stops once ``limit`` plans fit and the next
    candidate ranks after the last of them: the ones tied with it are replayed too, since among those the smaller
    peak ranks first (stopping at the limit-th, a search for one plan returned the job as asked where one at the
    same time needed less: ``memfit plan --model llama-3.2-1b --task lora --seq 2048 --gpu-memory 80GiB
    --limit 1``, and the first plan changed with ``limit``). Only when
    nothing fits is every candidate replayed, to name the smallest reachable peak in the
    error. ``progress(done, total)`` is called after each replay. ``allowed`` limits the search to
    those technique names (a caller that can apply only some of them), ``keep`` to the candidates it accepts (a
    caller that refuses one variant of a technique: finetune's --offload none).
    """
    if limit < 1:
        raise MemfitError(f"limit must be at least 1, got {limit}")
    if budget is not None and not is_count(budget):
        raise MemfitError(f"budget must be a positive number of bytes (e.g. memfit.parse_bytes('16GiB')), got "
                          f"{budget!r}")
    asked = predict(job, base)
    if budget is None:
        return asked, []
    ranked = []
    for knobs in candidates(job, base, allowed, keep):
        cost = total_cost(job, knobs)
        ranked.append((relative_time(job, cost), knobs, cost))
    ranked.sort(key=lambda item: time_rank(item[0], item[1], base))
    fitting, tried, last_rank = [], [], None
    for done, (rel, knobs, cost) in enumerate(ranked, 1):
        if last_rank is not None and time_rank(rel, knobs, base) != last_rank:
            break
        candidate = Plan(knobs, base, predict(job, knobs), cost, rel)
        tried.append(candidate)
        if progress:
            progress(done, len(ranked))
        if candidate.ledger.device_total <= budget:
            fitting.append(candidate)
            if len(fitting) == limit:
                last_rank = time_rank(rel, knobs, base)
    logger.debug("plan: %d candidate technique sets ranked by predicted time, %d replayed, %d fit in %s",
                 len(ranked), len(tried), len(fitting), format_bytes(budget))
    if not tried:
        raise MemfitError("no candidate plan passes keep")
    if not fitting:
        smallest = min(tried, key=lambda p: p.ledger.device_total)
        with_what = ", ".join(smallest.techniques) or "the job as asked"
        raise MemfitError(
            f"no plan fits {format_bytes(budget)}; the smallest needs {format_bytes(smallest.ledger.device_total)} "
            f"(peak {format_bytes(smallest.ledger.total)} + allocator{' and CUDA context' if job.device == 'cuda' else ''}"
            f") with: {with_what}"
        )
    fitting.sort(key=lambda p: (*time_rank(p.relative_time, p.knobs, p.base), p.ledger.device_total))
    return asked, fitting[:limit]


def undominated(plans: list[Plan]) -> list[Plan]:
    """The plans, in their order (exact first, each group fastest first), that need less of the GPU (the device
    total a budget is held against) than every plan before them. Among exact plans, one as fast or faster that
    needs no more leaves a later one nothing to offer (`memfit plan` of a job that fit had listed the job as asked
    after fused cross-entropy at the same time with more, and a checkpointed plan at 1.13x the time for the same
    need); an approximate plan is listed only where it needs less than every exact one, however much faster it is."""
    kept, lowest = [], math.inf
    for candidate in plans:
        if candidate.ledger.device_total < lowest:
            kept.append(candidate)
            lowest = candidate.ledger.device_total
    return kept


def time_rank(relative: float, knobs: Knobs, base: Knobs) -> tuple[bool, float]:
    """How a plan ranks before its peak is known: exact before approximate, then its predicted time (to 0.1%: closer
    is a tie). Time first had put partial FFN (fewer bytes a token, so faster) ahead of the job as asked at any
    budget: `memfit verify --plan` then picked an approximate plan the budget did not need."""
    return approximate(knobs, base), round(relative, 3)
