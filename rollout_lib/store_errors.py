"""The errors the object store raises (rollout_lib/store.py, store_tensors.py)."""


class StoreError(Exception):
    """Base class of every error raised by the store."""


class ObjectNotFoundError(StoreError):
    """The requested object is not in the store."""


class CorruptObjectError(StoreError):
    """An object's bytes no longer hash to its id."""
