"""An S3-compatible endpoint for tests and benchmarks: moto's server (PyPI `moto[server]`) on
127.0.0.1, port 0, in a thread of this process. This module must not import pytest.

    with S3Endpoint() as s3:
        s3.create_bucket("ckpt")
        subprocess.run([...], env={**os.environ, **s3.env})
"""

from __future__ import annotations

from typing import Any

import boto3
from moto.server import ThreadedMotoServer

# moto accepts any credentials; boto3 insists on having some.
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}


class S3Endpoint:
    def __init__(self) -> None:
        self.server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        self.url = ""

    def __enter__(self) -> S3Endpoint:
        self.server.start()
        host, port = self.server.get_host_and_port()
        self.url = f"http://{host}:{port}"
        return self

    def __exit__(self, *exc: Any) -> None:
        self.server.stop()

    @property
    def env(self) -> dict[str, str]:
        """What a job process needs to reach this endpoint through boto3."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.url}

    def client(self) -> Any:
        return boto3.client(
            "s3",
            endpoint_url=self.url,
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
            region_name=CREDENTIALS["AWS_DEFAULT_REGION"],
        )

    def create_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)
