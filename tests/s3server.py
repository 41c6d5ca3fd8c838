"""A local S3 (moto) for tests: the bucket they share and credentials that can never reach real AWS."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import fsspec
import pytest

BUCKET = "rollout-test"
AWS_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@contextlib.contextmanager
def moto_s3() -> Iterator[dict]:
    """A moto S3 server on a free local port with one bucket, BUCKET; yields s3fs storage options for it. The
    AWS_* environment is set meanwhile (subprocesses inherit it), so nothing falls through to real credentials."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for key, value in AWS_ENV.items():
            mp.setenv(key, value)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        try:
            host, port = server.get_host_and_port()
            options = {"client_kwargs": {"endpoint_url": f"http://{host}:{port}"}, "key": "testing",
                       "secret": "testing"}
            fsspec.filesystem("s3", skip_instance_cache=True, **options).mkdir(BUCKET)
            yield options
        finally:
            server.stop()
