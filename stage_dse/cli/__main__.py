"""``python -m stage_dse.cli``: the ``stage-dse`` sweep app."""

from stage_dse.cli.sweep import main

main()
