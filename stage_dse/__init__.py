"""stage_dse: design-space exploration of parallel plans for distributed LLM workloads."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("stage_dse")
except PackageNotFoundError:  # running from a source tree without installation
    __version__ = "0.0.0+unknown"

from stage_dse.errors import ConfigError, StageDseError

__all__ = ["ConfigError", "StageDseError", "__version__"]
