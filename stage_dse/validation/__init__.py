"""The model against the published record.

``corpus/`` holds one YAML file per source of published, measured runs (training and serving),
each figure with its citation, the setup the source states, what it leaves unstated and the
target with its definition (:mod:`stage_dse.validation.corpus` reads and checks them).
:mod:`~stage_dse.validation.training` and :mod:`~stage_dse.validation.serving` predict the
cases (vectorized: one plan table for every training case, one serving table for every serving
case), :mod:`~stage_dse.validation.report` summarizes errors per group and the published
rankings, :mod:`~stage_dse.validation.fit` fits the few physical parameters of
``parameters.yaml`` and gives the leave-one-source-out error. ``stage-dse-validate`` runs it.
"""
