"""Chakra execution traces of a configuration: schema, encoder, mesh groups, writer, checker."""

from stage_dse.trace.build import TraceConfig, build_trace_set
from stage_dse.trace.check import check_trace_dir
from stage_dse.trace.schedule import stage_layers
from stage_dse.trace.write import TraceSet, write_trace_set

__all__ = [
    "TraceConfig",
    "TraceSet",
    "build_trace_set",
    "check_trace_dir",
    "stage_layers",
    "write_trace_set",
]
