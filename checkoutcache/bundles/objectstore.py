"""Reading and writing one repository's folder of a bundle store.

Three kinds, one small interface (read, download, write, list, delete):
- s3://    boto3: credentials from the standard AWS chain, the endpoint from
           AWS_ENDPOINT_URL_S3 / AWS_ENDPOINT_URL (S3-compatible stores); an object
           appears whole when its PUT (or multipart upload) completes.
- file://  a directory on a shared volume: an object is written to a temp file in
           the same directory, flushed, then renamed into place.
- https:// read-only (a CDN or web server in front of the store): redirects are
           followed to https:// only; the system CAs (SSL_CERT_FILE) are trusted.

Every failure is a StoreError whose text names the location and the reason,
never a credential (none is in a location; the AWS chain's never reach here).
Every network call is bounded by a timeout.
"""

from __future__ import annotations

import errno
import http.client
import os
import shutil
import ssl
import stat
import time
import urllib.error
import urllib.parse
import urllib.request
from typing import Protocol

from checkoutcache.bundles.location import TMP_PREFIX, BundleLocation
from checkoutcache.credentials import strip_userinfo
from checkoutcache.testhooks import checkpoint

# An S3 endpoint (AWS_ENDPOINT_URL_S3) on plain http is refused unless this is "1".
ALLOW_HTTP_S3_VAR = "CHECKOUTCACHE_S3_ALLOW_HTTP"

CHUNK = 1 << 20
# S3 parts (5 MiB at least but for the last): a bundle larger than one part goes in parts.
MULTIPART_PART = 8 << 20


class StoreError(Exception):
    def __init__(self, why: str, missing: bool = False, late: bool = False, large: bool = False):
        super().__init__(why)
        self.missing = missing  # the object is not there (as opposed to: the store did not answer)
        self.late = late  # given up at the deadline
        self.large = large  # larger than the space seeding may use


class RepositoryFolder(Protocol):
    where: str  # shown in logs and reports

    def read(self, name: str, limit: int) -> bytes: ...

    def download(self, name: str, dest: str, deadline: float, max_bytes: int) -> int: ...

    def write(self, name: str, source: str | bytes) -> None: ...

    def list(self) -> list[tuple[str, float]]: ...

    def delete(self, name: str) -> None: ...

    def abort_stale_uploads(self, now: float, older_than: float) -> list[str]: ...


def _too_large(name: str, limit: int) -> StoreError:
    return StoreError(f"{name} is larger than {limit} bytes", large=True)


def copy_until(chunks, dest: str, deadline: float, max_bytes: int, name: str) -> int:
    """Write the chunks to dest; give up at the deadline (a store that sends a byte at a
    time must not hold a clone past its share of the timeout) or past max_bytes (the
    space seeding may use: a store's endless answer must not fill the root's disk)."""
    with open(dest, "wb") as target:
        for chunk in chunks:
            target.write(chunk)
            if time.monotonic() > deadline:
                raise StoreError(f"{name}: the download did not finish in the time seeding may take", late=True)
            if target.tell() > max_bytes:
                raise StoreError(f"{name} is larger than the {max_bytes} bytes seeding may use here", large=True)
        return target.tell()


def check_size(name: str, size: int | None, max_bytes: int) -> None:
    if size is not None and size > max_bytes:
        raise StoreError(f"{name} ({size} bytes) is larger than the {max_bytes} bytes seeding may use here",
                         large=True)


def _read_chunks(handle):
    return iter(lambda: handle.read(CHUNK), b"")


class FileFolder:
    def __init__(self, directory: str):
        self.directory = directory
        self.where = f"file://{directory}"

    def _path(self, name: str) -> str:
        return os.path.join(self.directory, name)

    def read(self, name: str, limit: int) -> bytes:
        try:
            fd = os.open(self._path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as handle:
                if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                    raise StoreError(f"{self.where}/{name} is not a regular file")
                data = handle.read(limit + 1)
        except FileNotFoundError:
            raise StoreError(f"{self.where}/{name} does not exist", missing=True) from None
        except OSError as exc:
            raise StoreError(f"{self.where}/{name}: {exc.strerror}") from None
        if len(data) > limit:
            raise _too_large(name, limit)
        return data

    def download(self, name: str, dest: str, deadline: float, max_bytes: int) -> int:
        try:
            # A regular file of the folder only: not a symlink out of it, a FIFO or a device.
            fd = os.open(self._path(name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as source:
                info = os.fstat(source.fileno())
                if not stat.S_ISREG(info.st_mode):
                    raise StoreError(f"{self.where}/{name} is not a regular file")
                check_size(name, info.st_size, max_bytes)
                return copy_until(_read_chunks(source), dest, deadline, max_bytes, name)
        except FileNotFoundError:
            raise StoreError(f"{self.where}/{name} does not exist", missing=True) from None
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise StoreError(f"{self.where}/{name} is a symbolic link: not followed") from None
            raise StoreError(f"{self.where}/{name}: {exc.strerror}") from None

    def write(self, name: str, source: str | bytes) -> None:
        try:
            os.makedirs(self.directory, exist_ok=True)
            tmp = self._path(f"{TMP_PREFIX}{os.getpid()}-{os.urandom(4).hex()}-{name}")
            try:
                with open(tmp, "wb") as target:
                    if isinstance(source, bytes):
                        target.write(source)
                    else:
                        with open(source, "rb") as handle:
                            shutil.copyfileobj(handle, target, CHUNK)
                    target.flush()
                    os.fsync(target.fileno())  # a crash never leaves a named object half-written
                os.replace(tmp, self._path(name))
            except BaseException:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
                raise
        except OSError as exc:
            raise StoreError(f"{self.where}/{name}: {exc.strerror}") from None

    def list(self) -> list[tuple[str, float]]:
        try:
            with os.scandir(self.directory) as found:
                return [(e.name, e.stat().st_mtime) for e in found if e.is_file(follow_symlinks=False)]
        except FileNotFoundError:
            return []
        except OSError as exc:
            raise StoreError(f"{self.where}: {exc.strerror}") from None

    def abort_stale_uploads(self, now: float, older_than: float) -> list[str]:
        return []  # a file store's objects in the making are temp files, pruned with the rest

    def delete(self, name: str) -> None:
        try:
            os.unlink(self._path(name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            raise StoreError(f"{self.where}/{name}: {exc.strerror}") from None


class S3Folder:
    def __init__(self, bucket: str, prefix: str, timeout: float):
        import boto3  # only a node that uses an s3:// store pays for the import
        from botocore.config import Config as BotoConfig

        self.bucket, self.prefix = bucket, prefix
        self.where = f"s3://{bucket}/{prefix}"
        # A store that does not answer costs each new mirror at most ~2 x (connect + read) timeouts.
        self.client = boto3.session.Session().client("s3", config=BotoConfig(
            connect_timeout=min(timeout, 10.0), read_timeout=timeout, retries={"max_attempts": 2, "mode": "standard"}))
        endpoint = str(self.client.meta.endpoint_url)
        if urllib.parse.urlsplit(endpoint).scheme.lower() != "https" and os.environ.get(ALLOW_HTTP_S3_VAR) != "1":
            # Signatures protect the request, not the answer: bundles over http could be anyone's.
            raise StoreError(f"the S3 endpoint {strip_userinfo(endpoint)} is not https:// (set {ALLOW_HTTP_S3_VAR}=1 "
                             f"for a store on a trusted network)")

    def _key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def _error(self, name: str, exc: Exception) -> StoreError:
        from botocore.exceptions import ClientError

        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            missing = code in ("NoSuchKey", "404", "NotFound")
            return StoreError(f"{self.where}/{name}: {code or 'error'} "
                              f"({exc.response.get('Error', {}).get('Message', '')[:200]})", missing=missing)
        return StoreError(f"{self.where}/{name}: {type(exc).__name__}: {str(exc)[:300]}")

    def read(self, name: str, limit: int) -> bytes:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            body = self.client.get_object(Bucket=self.bucket, Key=self._key(name))["Body"]
            data = body.read(limit + 1)
            body.close()
        except (BotoCoreError, ClientError) as exc:
            raise self._error(name, exc) from None
        if len(data) > limit:
            raise _too_large(name, limit)
        return data

    def download(self, name: str, dest: str, deadline: float, max_bytes: int) -> int:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self._key(name))
            body = answer["Body"]
            try:
                check_size(name, answer.get("ContentLength"), max_bytes)
                return copy_until(body.iter_chunks(CHUNK), dest, deadline, max_bytes, name)
            finally:
                body.close()
        except (BotoCoreError, ClientError) as exc:
            raise self._error(name, exc) from None

    def write(self, name: str, source: str | bytes) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            if isinstance(source, bytes) or os.path.getsize(source) <= MULTIPART_PART:
                body = source if isinstance(source, bytes) else open(source, "rb").read()
                self.client.put_object(Bucket=self.bucket, Key=self._key(name), Body=body)
            else:  # a large bundle: the object appears when the upload completes
                self._multipart(name, source)
        except (BotoCoreError, ClientError) as exc:
            raise self._error(name, exc) from None

    def _multipart(self, name: str, source: str) -> None:
        """An upload of parts, aborted on any failure; one its publisher could not abort
        (killed) is aborted by a later publish (abort_stale_uploads)."""
        key = self._key(name)
        upload = self.client.create_multipart_upload(Bucket=self.bucket, Key=key)["UploadId"]
        try:
            parts = []
            with open(source, "rb") as handle:
                while chunk := handle.read(MULTIPART_PART):
                    answer = self.client.upload_part(Bucket=self.bucket, Key=key, UploadId=upload,
                                                     PartNumber=len(parts) + 1, Body=chunk)
                    parts.append({"PartNumber": len(parts) + 1, "ETag": answer["ETag"]})
                    checkpoint("during-upload")
            self.client.complete_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload,
                                                  MultipartUpload={"Parts": parts})
        except BaseException:
            try:
                self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload)
            except Exception:  # the store went away: a later publish aborts it
                pass
            raise

    def abort_stale_uploads(self, now: float, older_than: float) -> list[str]:
        """Abort the folder's multipart uploads begun more than older_than before now (the
        store's clock): a killed publisher's. Returns their object names."""
        from botocore.exceptions import BotoCoreError, ClientError

        prefix = self._key("")
        aborted = []
        try:
            for page in self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket,
                                                                                      Prefix=prefix):
                for upload in page.get("Uploads", []):
                    if now - upload["Initiated"].timestamp() >= older_than:
                        self.client.abort_multipart_upload(Bucket=self.bucket, Key=upload["Key"],
                                                           UploadId=upload["UploadId"])
                        aborted.append(upload["Key"][len(prefix):])
        except (BotoCoreError, ClientError) as exc:
            raise self._error("", exc) from None
        return aborted

    def list(self) -> list[tuple[str, float]]:
        from botocore.exceptions import BotoCoreError, ClientError

        found = []
        prefix = self._key("")
        try:
            for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    name = item["Key"][len(prefix):]
                    if "/" not in name:
                        found.append((name, item["LastModified"].timestamp()))
        except (BotoCoreError, ClientError) as exc:
            raise self._error("", exc) from None
        return found

    def delete(self, name: str) -> None:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(name))
        except (BotoCoreError, ClientError) as exc:
            raise self._error(name, exc) from None


class _HttpsOnly(urllib.request.HTTPRedirectHandler):
    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if urllib.parse.urlsplit(newurl).scheme != "https":
            raise urllib.error.HTTPError(newurl, code, "a redirect away from https:// is refused", headers, fp)
        return super().redirect_request(req, fp, code, msg, headers, newurl)


class HttpsFolder:
    def __init__(self, base: str, timeout: float):
        self.base, self.timeout = base, timeout
        self.where = base
        self.opener = urllib.request.build_opener(urllib.request.HTTPSHandler(context=ssl.create_default_context()),
                                                  _HttpsOnly())

    def _open(self, name: str):
        url = f"{self.base}/{urllib.parse.quote(name)}"
        try:
            return self.opener.open(urllib.request.Request(url, headers={"User-Agent": "checkoutcache"}),
                                    timeout=self.timeout)
        except urllib.error.HTTPError as exc:
            raise StoreError(f"{url}: HTTP {exc.code} {exc.reason}", missing=exc.code in (404, 410)) from None
        except (urllib.error.URLError, OSError, ValueError, http.client.HTTPException) as exc:
            raise StoreError(f"{url}: {type(exc).__name__}: {str(getattr(exc, 'reason', exc))[:200]}") from None

    def read(self, name: str, limit: int) -> bytes:
        with self._open(name) as answer:
            try:
                data = answer.read(limit + 1)
            except (OSError, http.client.HTTPException) as exc:
                raise StoreError(f"{self.where}/{name}: {type(exc).__name__}: {str(exc)[:200]}") from None
        if len(data) > limit:
            raise _too_large(name, limit)
        return data

    def download(self, name: str, dest: str, deadline: float, max_bytes: int) -> int:
        with self._open(name) as answer:
            try:
                length = answer.headers.get("Content-Length")
                check_size(name, int(length) if length and length.isascii() and length.isdigit() else None,
                           max_bytes)
                return copy_until(_read_chunks(answer), dest, deadline, max_bytes, name)
            except (OSError, http.client.HTTPException) as exc:
                raise StoreError(f"{self.where}/{name}: {type(exc).__name__}: {str(exc)[:200]}") from None

    def _read_only(self, *_args) -> None:
        raise StoreError(f"{self.where} is read-only: publish to the s3:// or file:// location behind it")

    write = delete = abort_stale_uploads = _read_only

    def list(self) -> list[tuple[str, float]]:
        self._read_only()
        return []


def open_folder(location: BundleLocation, bundle_key: str, timeout: float = 30.0) -> RepositoryFolder:
    """The repository's folder of the store at location."""
    folder = location.repository(bundle_key)
    if location.scheme == "file":
        return FileFolder(folder)
    if location.scheme == "s3":
        try:
            return S3Folder(location.host, folder, timeout)
        except ImportError:
            raise StoreError("s3:// needs boto3: pip install 'checkoutcache[s3]'") from None
        except Exception as exc:  # no boto3, a broken AWS config file: the store is unusable
            raise StoreError(f"s3://{location.host}: {type(exc).__name__}: {str(exc)[:200]}") from None
    return HttpsFolder(f"https://{location.host}{urllib.parse.quote(folder)}", timeout)
