"""A real S3 API on 127.0.0.1: moto in server mode, in a process of its own, so a
test can stop it (the store down) and every clone worker reaches it over HTTP
as it would reach S3. Credentials are test values, passed by environment only."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request

from .daemons import free_port

AWS_TEST_SECRET = "moto-test-secret-d41d8cd98f00b204"


class MotoS3:
    def __init__(self, logdir: str):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._log = open(os.path.join(logdir, f"moto-{self.port}.log"), "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto did not start (see {self._log.name})") from None
                time.sleep(0.1)

    @property
    def env(self) -> dict[str, str]:
        """The standard AWS environment a node is given (no CHECKOUTCACHE_ setting names a credential)."""
        return {"AWS_ACCESS_KEY_ID": "moto-test-key", "AWS_SECRET_ACCESS_KEY": AWS_TEST_SECRET,
                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL_S3": self.endpoint,
                "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}

    def client(self):
        import boto3

        return boto3.session.Session(aws_access_key_id="moto-test-key", aws_secret_access_key=AWS_TEST_SECRET,
                                     region_name="us-east-1").client("s3", endpoint_url=self.endpoint)

    def make_bucket(self, name: str) -> None:
        self.client().create_bucket(Bucket=name)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._log.close()
