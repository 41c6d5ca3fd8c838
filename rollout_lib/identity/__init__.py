"""Every ingredient of a cache key or a recorded identity, in one room.

- `training`: a training chain's identity (the settings that decide the weights, the base model's content, the
  content of every served frozen model and reward model), and what identifies a served model's weights.
- `sources`: what an RL task's result depends on besides settings and content ids: the source of user code
  (reward functions, outside algorithms, environments) it runs, and the files it reads.

A file's digest itself is on the ground floor (rollout_lib/digests.py): reward/locate.py keys user modules by it.
- `code`: the code version, the source of every project module a task can run.

tasks/common.py composes them into Prefect cache keys; checkpoint manifests record the training identity.
"""
