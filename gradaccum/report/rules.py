"""Every threshold the report judges by, in one table: the verdicts compare against these, the prose formats them.

To change what the report calls "barely affected" or "within", change it here; no sentence types a number.
"""

from __future__ import annotations

from gradaccum.tutorial import CLAIM_TOLERANCE

CLAIM = CLAIM_TOLERANCE  # a tutorial's figure holds within this share of it, defined beside its claims
SAME_LOSS = 0.01  # a relative loss change called nothing: the same training
BARELY = 0.10  # a relative loss change called "barely affected", the tutorial's words
CLOSE = 0.05  # a prediction (the planner's, the trace's) called within this share of what was measured
SAME_ACTIVATIONS = 1.02  # GroupNorm keeping at most this times BatchNorm's activations costs no memory
CHANCE_P = 0.1  # a sign test's p above this: every round agreeing could be chance
GOALS = {"allocated": 0.03, "reserved": 0.10, "nvidia-smi": 0.10}  # how close a predicted GPU figure must come


def measured_by(row: dict) -> str:
    """Who measured a validation row: one source that states several setups is counted once."""
    return row.get("origin") or row["source"]
