"""`python -m pipeline.cli ...`, as the tests and scripts run the command line."""

from pipeline.cli import app

app()
