"""`python -m rollout_cli ...` is the `rollout` command."""

from rollout_cli.main import run

run()
