"""Runs inside a vLLM policy server, not in rollout: the worker extension every live-policy server gets
(`--worker-extension-cls rollout_lib.serving.worker_extension.PolicyServerExtension`, engine.py; vLLM mixes it into its
worker, and `POST /collective_rpc {"method": ...}` calls its methods in dev mode).

    fetch_from_store(source)      a state's files from the run's store to this server's machine (store_fetch.py)
    reload_policy_weights(dir)    the weights in `dir` loaded in place (engine_reload.py)

Imports nothing of rollout but those two files: vLLM's environment has no rollout.
"""

from __future__ import annotations

import os

from rollout_lib.serving.engine_reload import reload_policy_weights
from rollout_lib.serving.store_fetch import fetch, fetch_directory


class PolicyServerExtension:
    def fetch_from_store(self, source: str) -> str:
        """Copy the state under the store URL `source` into this process's own directory; that directory."""
        return fetch(source, fetch_directory(os.getpid()))

    def reload_policy_weights(self, directory: str) -> str:
        """Load the weights in `directory` in place; which path ran."""
        return reload_policy_weights(self, directory)
