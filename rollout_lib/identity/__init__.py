"""Every ingredient of a cache key or a recorded identity, in one room.

- `training`: a training chain's identity (the settings that decide the weights, projected out of a config and
  hashed; the base model's content; the content of every served frozen model and reward model), and what
  identifies a served model's weights.
- `claims`: a run name claimed for one training identity in the run's store.
- `sources`: what a task reads besides the training identity: a data task's settings and data, the source of user
  code an RL task runs (reward functions, outside algorithms, environments) and the files it reads.
- `digests`: what stands for a file's content: a file's digest, a table source's, a user module's source.
- `code`: the code version, the source of every project module a task can run.

tasks/common.py composes them into Prefect cache keys; checkpoint manifests record the training identity. One
ingredient lives below: a model's content digest (model/loading.model_content_digest), which model loading needs
itself to check that an adapter's base is still what it was trained on.
"""
