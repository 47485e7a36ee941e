"""The memory ledger: a job's bytes per component over its timeline, techniques, planner, verify."""
from memfit.ledger.job import Job, Knobs
from memfit.ledger.planner import Plan, plan
from memfit.ledger.predict import Ledger, predict

__all__ = ["Job", "Knobs", "Plan", "plan", "Ledger", "predict"]
