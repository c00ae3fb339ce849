"""``python -m lightning_par.plan``: the planner's command line, which lives in :mod:`lightning_par.planner.cli`."""

from lightning_par.planner.cli import main

__all__ = ["main"]
