"""A real S3-compatible server for tests: moto's threaded server on 127.0.0.1, on a free port.

moto keeps its state per process, so tests isolate themselves by uuid-named buckets
(`new_bucket`), never by sharing one.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import aioboto3
from moto.server import ThreadedMotoServer

REGION = "us-east-1"


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    region: str = REGION
    _session: Any = field(default=None, repr=False)

    def session(self) -> Any:
        """An aioboto3 session with the dummy credentials moto accepts (one per server, so
        botocore loads its service models once)."""
        return self._session

    async def new_bucket(self) -> str:
        """Create a bucket with a fresh uuid name and return the name."""
        name = f"rf-test-{uuid.uuid4().hex}"
        async with self.session().client("s3", endpoint_url=self.endpoint_url) as s3:
            await s3.create_bucket(Bucket=name)
        return name

    async def head(self, bucket: str, key: str) -> dict[str, Any]:
        """`head_object` on the raw object key (for ETags and other S3-only facts)."""
        async with self.session().client("s3", endpoint_url=self.endpoint_url) as s3:
            resp: dict[str, Any] = await s3.head_object(Bucket=bucket, Key=key)
        return resp

    async def multipart_uploads(self, bucket: str) -> list[dict[str, Any]]:
        """Multipart uploads started and neither completed nor aborted."""
        async with self.session().client("s3", endpoint_url=self.endpoint_url) as s3:
            resp = await s3.list_multipart_uploads(Bucket=bucket)
        uploads: list[dict[str, Any]] = resp.get("Uploads", [])
        return uploads


@contextmanager
def running_s3_server() -> Iterator[S3Server]:
    """Start moto's server on 127.0.0.1 with an OS-chosen port; stop it on exit."""
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        session = aioboto3.Session(
            aws_access_key_id="testing", aws_secret_access_key="testing", region_name=REGION
        )
        yield S3Server(endpoint_url=f"http://{host}:{port}", _session=session)
    finally:
        server.stop()
