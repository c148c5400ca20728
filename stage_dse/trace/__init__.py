"""Chakra execution traces of a configuration: schema, encoder, mesh groups, writer, checker."""

from stage_dse.trace.build import (
    TraceConfig,
    TraceSet,
    build_trace_set,
    stage_layers,
    write_trace_set,
)
from stage_dse.trace.check import check_trace_dir

__all__ = [
    "TraceConfig",
    "TraceSet",
    "build_trace_set",
    "check_trace_dir",
    "stage_layers",
    "write_trace_set",
]
