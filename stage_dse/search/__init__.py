"""Search over parallel plans: spaces, vectorized enumeration (and, later, Optuna)."""

from stage_dse.search.space import Enumeration, SearchSpace, divisors, enumerate_plans

__all__ = ["Enumeration", "SearchSpace", "divisors", "enumerate_plans"]
