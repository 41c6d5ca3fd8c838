"""`python -m rollout_cli ...` is the `rollout` command."""

import sys

from rollout_cli.main import main

sys.exit(main())
