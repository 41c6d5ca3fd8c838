"""Training machinery shared by every entry point: optimizers, checkpoints, live training state."""
