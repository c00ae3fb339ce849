"""``python -m lightning_par.plan``: runs :func:`lightning_par.planner.cli.main`."""

import sys

from lightning_par.planner.cli import main

sys.exit(main())
