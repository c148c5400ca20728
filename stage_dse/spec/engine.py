"""``EngineSpec``: what an inference engine adds to the model's kernels, and its limits.

An engine runs the serving program's kernels one iteration at a time (continuous batching,
:mod:`stage_dse.cost.batching`). Between and around the GPU work of an iteration it schedules
the next batch, prepares inputs, samples, detokenizes and streams; what of that the engine does
not hide behind the GPU (overlap or asynchronous schedulers) lengthens every step. Two costs
describe it: a fixed one per iteration and one per running request per iteration. The limits
(``max_running``, ``prefill_budget``) are the engine's documented defaults, used where a
measurement does not state its own. Profiles live in ``conf/engine/<name>.yaml`` with their
citations; ``none`` adds nothing (the kernels alone).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from stage_dse.errors import ConfigError

__all__ = ["EngineSpec"]


@dataclass(frozen=True, kw_only=True)
class EngineSpec:
    name: str = "none"
    step_overhead_s: float = 0.0
    """Per iteration, not hidden behind the GPU: scheduling, input preparation, launch."""
    request_overhead_s: float = 0.0
    """Per running request per iteration: sampling, detokenization, output processing."""
    max_running: int = 256
    """Default running-request limit (``max_num_seqs``, ``max_batch_size``)."""
    prefill_budget: int = 8192
    """Default tokens per iteration (``max_num_batched_tokens``, ``max_num_tokens``)."""
    cuda_graph_max_batch: int = 0
    """Largest decode batch captured in a CUDA graph (0: not stated); informational."""
    scheduling: str = ""
    """The scheduling policy in words (what runs first, what is chunked)."""

    def __post_init__(self) -> None:
        for field in ("step_overhead_s", "request_overhead_s"):
            v = getattr(self, field)
            if not (isinstance(v, int | float) and 0 <= v < 1):
                raise ConfigError(
                    f"engine.{field} must be seconds in [0, 1) (e.g. 0.0005), got {v!r}"
                )
        for field in ("max_running", "prefill_budget"):
            v = getattr(self, field)
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 1):
                raise ConfigError(f"engine.{field} must be an integer >= 1, got {v!r}")
        v = self.cuda_graph_max_batch
        if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
            raise ConfigError(f"engine.cuda_graph_max_batch must be an integer >= 0, got {v!r}")

    def replace(self, **changes: object) -> EngineSpec:
        return dataclasses.replace(self, **changes)
