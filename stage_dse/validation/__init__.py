"""Predictions against published measurements (data files beside this module cite sources)."""
