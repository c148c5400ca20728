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

__all__ = ["check_jobs", "compose", "fail", "one_line_errors", "precheck", "split_args"]


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


def compose(
    overrides: list[str], config_dir: str | None = None, config_name: str = "config"
) -> DictConfig:
    """The configuration ``stage-dse`` would run with these overrides (schemas registered);
    ``config_dir`` is Hydra's ``--config-dir`` (an extra folder of config groups, searched as
    Hydra searches it), ``config_name`` its ``--config-name``."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schemas()
    GlobalHydra.instance().clear()
    try:
        if config_dir is None:
            with initialize_config_dir(config_dir=str(conf_dir()), version_base="1.3"):
                return hydra_compose(config_name=config_name, overrides=overrides)
        return _compose_with_dir(overrides, config_dir, config_name)
    finally:
        GlobalHydra.instance().clear()


def _compose_with_dir(overrides: list[str], config_dir: str, config_name: str) -> DictConfig:
    """Compose as Hydra's ``--config-dir`` does: the folder goes on the search path where
    Hydra's command line puts it (``hydra._internal.utils.run_hydra``)."""
    import os

    from hydra._internal.hydra import Hydra
    from hydra._internal.utils import create_config_search_path
    from hydra.core.config_search_path import SearchPathQuery
    from hydra.types import RunMode
    from omegaconf import open_dict, read_write

    search_path = create_config_search_path(f"file://{conf_dir()}")
    search_path.prepend(
        provider="command-line",
        path=f"file://{os.path.abspath(config_dir)}",
        anchor=SearchPathQuery(provider="schema"),
    )
    hydra = Hydra.create_main_hydra2(task_name="stage-dse", config_search_path=search_path)
    cfg = hydra.compose_config(
        config_name=config_name,
        overrides=overrides,
        run_mode=RunMode.RUN,
        with_log_configuration=False,
    )
    with read_write(cfg), open_dict(cfg):
        del cfg["hydra"]
    return cfg


def precheck(
    overrides: list[str], config_dir: str | None = None, config_name: str = "config"
) -> str | None:
    """Compose the config once to turn Hydra's multi-line composition errors (unknown preset,
    value of the wrong type, YAML syntax) into one line naming the override or the file; None
    when it composes."""
    import yaml
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    try:
        compose(overrides, config_dir, config_name)
    except yaml.MarkedYAMLError as exc:
        return yaml_error_line(exc)
    except (HydraException, OmegaConfBaseException) as exc:
        if isinstance(exc.__cause__, yaml.MarkedYAMLError):
            return yaml_error_line(exc.__cause__)
        text = " ".join(str(exc).split())
        if text.startswith("Cannot find primary config"):
            name = text.split("'")[1] if "'" in text else config_name
            return (
                f"--config-name {name}: no such config in {conf_dir()} or --config-dir "
                "(give the name of a YAML file there, without .yaml)"
            )
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


def check_jobs(
    overrides: list[str],
    validate: Callable[[DictConfig], None],
    config_dir: str | None = None,
    config_name: str = "config",
    multirun: bool = True,
) -> str | None:
    """Compose and validate every job of a run before any starts; the first problem as one
    line (naming its job when a multirun has several), or None. Without ``multirun`` the
    overrides must make one job."""
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from stage_dse.errors import StageDseError

    try:
        jobs = multirun_jobs(overrides)
    except (HydraException, OmegaConfBaseException) as exc:
        return " ".join(str(exc).split())
    if not multirun and len(jobs) > 1:
        swept = next((o for o in overrides if "," in o.partition("=")[2]), overrides[0])
        key, _, value = swept.partition("=")
        return (
            f"{swept}: a comma list runs one job per value with -m (stage-dse -m {swept}); "
            f"one job over all of them is {key}=[{value}]"
        )
    for job in jobs:
        message = precheck(job, config_dir, config_name)
        if message is None:
            try:
                validate(compose(job, config_dir, config_name))
            except StageDseError as exc:
                message = str(exc)
        if message:
            return f"job {' '.join(job)}: {message}" if len(jobs) > 1 else message
    return None


def quote_non_ascii(override: str) -> str:
    """``results_dir=/data/résultats`` as Hydra's grammar accepts it: an unquoted value may
    hold ASCII only, so each comma-separated element with other characters is quoted
    (``results_dir='/data/résultats'``). Values already quoted, bracketed or escaped are
    left as written."""
    key, eq, value = override.partition("=")
    if not eq or value.isascii() or any(c in value for c in "'\"\\[]{}()"):
        return override
    return key + "=" + ",".join(v if v.isascii() else f"'{v}'" for v in value.split(","))


def split_args(args: list[str]) -> tuple[list[str], list[str], dict[str, str | bool]]:
    """A Hydra app's command line as (overrides, flags it does not know, known flags): ``-m``,
    ``--config-dir``/``-cd`` and ``--config-name``/``-cn`` (with their values, also written
    ``--config-dir=DIR``). Hydra wants its flags before the overrides; this accepts them
    anywhere. Non-ASCII values are quoted for Hydra (:func:`quote_non_ascii`)."""
    overrides: list[str] = []
    unknown: list[str] = []
    known: dict[str, str | bool] = {}
    names = {
        "-cd": "config_dir", "--config-dir": "config_dir",
        "-cn": "config_name", "--config-name": "config_name",
    }  # fmt: skip
    it = iter(args)
    for a in it:
        flag, eq, value = a.partition("=")
        if a in ("-m", "--multirun"):
            known["multirun"] = True
        elif flag in names and a.startswith("-"):
            if not eq:
                value = next(it, None)
                if value is None or "=" in value:  # the end, or an override: no value given
                    raise ConfigError(f"{flag} needs a value (e.g. {flag} my_conf)")
            known[names[flag]] = value
        elif a.startswith("-"):
            unknown.append(a)
        else:
            overrides.append(quote_non_ascii(a))
    return overrides, unknown, known


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line (a ``ConfigError``, exit 2 through
    :func:`one_line_errors`) instead of the usage text and an exit from inside argparse."""

    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(f"{message} (see {self.prog} --help)")
