"""Results: the Parquet dataset (schema, store) and pandas analysis helpers.

``load(path, filters=...)`` reads ``results/<sweep>``; ``pareto(df, objectives)`` keeps the
non-dominated rows; ``best_per(df, by=...)`` keeps the best feasible row per group.
"""

from stage_dse.results.analysis import best_per, load, pareto
from stage_dse.results.schema import RESULT_SCHEMA, config_hash
from stage_dse.results.store import ResultStore

__all__ = ["RESULT_SCHEMA", "ResultStore", "best_per", "config_hash", "load", "pareto"]
