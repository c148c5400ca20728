"""Command-line faces of the package, one module per console script, sharing the Hydra
bootstrap and the one-line error handler of :mod:`stage_dse.cli._common`:

* ``sweep``: ``stage-dse``, the Hydra sweep app (also ``python -m stage_dse.cli``);
* ``trace``: ``stage-dse-trace``, write, check and inspect Chakra trace sets;
* ``plot``: ``stage-dse-plot``, PNG figures of a results folder;
* ``validate``: ``stage-dse-validate``, predictions against published measurements.
"""

from stage_dse.cli.sweep import main, run

__all__ = ["main", "run"]
