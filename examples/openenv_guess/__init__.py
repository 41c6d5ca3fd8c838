"""A tiny OpenEnv environment for rollout's tests and docs (docs/environments.md, "OpenEnv environments")."""
