"""What every console script shares: composing the Hydra configuration, and turning bad input
into one line on stderr with exit code 2 (never a traceback)."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from omegaconf import DictConfig

from stage_dse.config.presets import conf_dir
from stage_dse.config.schema import register_schemas
from stage_dse.errors import ConfigError, StageDseError

__all__ = ["compose", "fail", "one_line_errors", "precheck"]


def fail(prog: str, message: str, code: int = 2) -> int:
    """Print ``prog: error: message`` on stderr; returns ``code`` for the caller to exit with."""
    print(f"{prog}: error: {message}", file=sys.stderr)
    return code


def one_line_errors(prog: str) -> Callable:
    """Decorate a ``main(argv) -> int``: a :class:`StageDseError` becomes one line and exit 2."""

    def wrap(main: Callable[..., int]) -> Callable[..., int]:
        @functools.wraps(main)
        def run(*args, **kwargs) -> int:
            try:
                return main(*args, **kwargs)
            except StageDseError as exc:
                return fail(prog, str(exc))
            except KeyboardInterrupt:
                print(f"{prog}: interrupted", file=sys.stderr)
                return 130

        return run

    return wrap


def compose(overrides: list[str]) -> DictConfig:
    """The configuration ``stage-dse`` would run with these overrides (schemas registered)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
            return hydra_compose(config_name="config", overrides=overrides)
    finally:
        GlobalHydra.instance().clear()


def precheck(overrides: list[str]) -> str | None:
    """Compose the config once to turn Hydra's multi-line composition errors (unknown preset,
    value of the wrong type) into one line naming the override; None when it composes."""
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        compose(overrides)
    except yaml.MarkedYAMLError as exc:
        return yaml_error_line(exc)
    except (HydraException, OmegaConfBaseException) as exc:
        if isinstance(exc.__cause__, yaml.MarkedYAMLError):
            return yaml_error_line(exc.__cause__)
        text = " ".join(str(exc).split())
        if "Could not find" in text and "Available options" in text:
            head, _, opts = text.partition("Available options in")
            group, _, names = opts.partition(":")
            names = ", ".join(
                n for n in names.split("Config search path")[0].split() if not n.endswith("_schema")
            )
            return f"{head.split(': ', 1)[-1].strip()}; valid {group.strip(chr(39) + ' ')}: {names}"
        cause = exc.__cause__
        if cause is not None:
            text = f"{text}: {str(cause).splitlines()[0]}"
        return text.split(" full_key:")[0]
    return None


def yaml_error_line(exc) -> str:
    """``file:line:col: problem`` of a YAML syntax error (lines and columns from 1)."""
    mark = exc.problem_mark or exc.context_mark
    where = f"{mark.name}:{mark.line + 1}:{mark.column + 1}" if mark else "YAML"
    problem = exc.problem or "syntax error"
    context = f" ({exc.context})" if exc.context else ""
    return f"{where}: {problem}{context}"


def multirun_jobs(overrides: list[str]) -> list[list[str]]:
    """The override lists of the jobs ``-m`` would run (Hydra's basic sweeper: the cartesian
    product of every comma-separated or range override)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    batches = BasicSweeper.split_arguments(parsed, None)
    return [list(job) for batch in batches for job in batch]


def check_jobs(overrides: list[str], validate: Callable[[DictConfig], None]) -> str | None:
    """Compose and validate every job of a multirun before any runs; the first problem as
    one line naming its job, or None."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from stage_dse.errors import StageDseError

    try:
        jobs = multirun_jobs(overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        return " ".join(str(exc).split())
    for job in jobs:
        message = precheck(job)
        if message is None:
            try:
                validate(compose(job))
            except StageDseError as exc:
                message = str(exc)
        if message:
            return f"job {' '.join(job)}: {message}"
    return None


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (a ``ConfigError``, exit 2 through
    :func:`one_line_errors`) instead of the usage text and an exit from inside argparse."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(f"{message} (see {self.prog} --help)")
