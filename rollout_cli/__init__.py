"""The `rollout` command line and the local Prefect stack it manages.

This package sits above `flows/`: it imports flows (lazily, in the commands that run them); flows never import it.
"""
