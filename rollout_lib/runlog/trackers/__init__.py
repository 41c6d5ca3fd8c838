"""Experiment trackers a run's steps also go to (`run.trackers`, docs/runs.md "Trackers"): MLflow, W&B, trackio.

`open_trackers` (build.py) makes one `TrackerThread` (thread.py) per tracker the run lists; each drives one
backend (mlflow_tracker.py, wandb_tracker.py, trackio_tracker.py) on a thread of its own, so a tracker never
slows, blocks or fails the training loop. Tracker packages are imported by their backend only, on that thread.
"""
