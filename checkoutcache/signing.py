"""Signed API requests: a token proves itself without ever being sent, and an answer
proves it came from the token's holder (DESIGN invariants 8 and 18; issue 33, "The
hand-off over TCP gives the token to whoever holds the port").

A bearer token goes to whoever listens where its caller connects. While serve is down
(a restart, an OOM kill, a crash loop) anyone in the pod may bind 127.0.0.1:8787, and
the next bearer request hands that squatter the token; it could also answer `ready`
with any path. A signed request carries, instead of the token, an HMAC-SHA256 of the
request under the token; serve answers with an HMAC of its answer bound to that request:

- a squatter learns no token: only one request's MAC, good for that very request (its
  method, target and body) to the real serve within SIGNATURE_WINDOW, and only once
  (serve keeps the nonces it has seen, per token: serve/policy.py NonceBook);
- the caller takes no answer the token's holder did not make: without the token a
  squatter cannot make the proof (handoff.py and client.py refuse such an answer).

On the wire:

    Authorization: CheckoutCache-HMAC key=<token name>, ts=<unix seconds>, nonce=<32 hex>,
                   body=<sha256 hex of the request body>, mac=<hex>
    mac   = HMAC-SHA256(token, "checkoutcache-request-v1\\n" METHOD "\\n" TARGET "\\n" ts "\\n" nonce "\\n" body)
    X-CheckoutCache-Proof: HMAC-SHA256(token, "checkoutcache-answer-v1\\n" mac "\\n" STATUS "\\n" sha256 hex of the answer)

TARGET is the request target as sent (path, and `?query` when there is one); the token
name is `token-` and the first 12 hex digits of the token's sha256, as logs name it.
Bearer tokens stay accepted (curl, a proxy that must see one); this package's own callers
sign, the TypeScript client (clients/typescript) too, by default.

Standard library only, and not hashlib where `_sha256` is there: hashlib loads OpenSSL
(about 5 ms), and a read-only reader's ready answer signs its hand-off to the writer.
"""

from __future__ import annotations

import os
import re
import time

from _operator import _compare_digest as compare_digest  # hmac.compare_digest, without hmac's import

try:  # the small built-in sha256 (3.11: _sha256, 3.12+: _sha2), else hashlib's
    from _sha256 import sha256 as _sha256
except ImportError:  # pragma: no cover - depends on the Python build
    try:
        from _sha2 import sha256 as _sha256  # type: ignore[no-redef]
    except ImportError:
        from hashlib import sha256 as _sha256  # type: ignore[no-redef]

SCHEME = "CheckoutCache-HMAC"
PROOF_HEADER = "x-checkoutcache-proof"
# How old a signed request may be when serve reads it (the same host's clock; a caller signs as
# it sends), and how far ahead of serve's clock its time may be. Each nonce is remembered for as
# long as its signature could be taken (serve/policy.py NonceBook): the narrower, the fewer.
SIGNATURE_WINDOW = 60.0
SIGNATURE_AHEAD = 5.0
_BLOCK = 64
_FIELD = r"\s*([a-z]+)=([A-Za-z0-9_.-]{1,128})\s*"  # compiled by re's cache where parsed (serve), never at import


def sha256_hex(data: bytes) -> str:
    return _sha256(data).hexdigest()


EMPTY_BODY = sha256_hex(b"")


def hmac_sha256(key: bytes, message: bytes) -> str:
    """HMAC-SHA256 (RFC 2104) in hex, on the small sha256 (tests compare it with hmac's)."""
    if len(key) > _BLOCK:
        key = _sha256(key).digest()
    key = key.ljust(_BLOCK, b"\0")
    inner = _sha256(bytes(k ^ 0x36 for k in key) + message).digest()
    return _sha256(bytes(k ^ 0x5C for k in key) + inner).hexdigest()


def token_name(token: str) -> str:
    """A token's name in logs, hold accounting and signatures: its digest's first 12 hex digits."""
    return "token-" + sha256_hex(token.encode())[:12]


class Signature:
    """A signed request's fields (a plain class: typing's import is not on a reader's path)."""

    __slots__ = ("key", "ts", "nonce", "body", "mac")

    def __init__(self, key: str, ts: int, nonce: str, body: str, mac: str):
        self.key, self.ts, self.nonce, self.body, self.mac = key, ts, nonce, body, mac


def _request_message(method: str, target: str, ts: int, nonce: str, body: str) -> bytes:
    return f"checkoutcache-request-v1\n{method}\n{target}\n{ts}\n{nonce}\n{body}".encode()


def sign_request(token: str, method: str, target: str, body: bytes, now: float | None = None) -> tuple[str, str]:
    """(the Authorization header's value, the request's mac) for one request."""
    ts = int(time.time() if now is None else now)
    nonce = os.urandom(16).hex()
    digest = sha256_hex(body)
    mac = hmac_sha256(token.encode(), _request_message(method, target, ts, nonce, digest))
    return f"{SCHEME} key={token_name(token)}, ts={ts}, nonce={nonce}, body={digest}, mac={mac}", mac


def parse_signature(value: str) -> Signature | None:
    """The fields of a signed request's Authorization value (after the scheme); None when malformed."""
    fields = {}
    for part in value.split(","):
        match = re.fullmatch(_FIELD, part)
        if match is None or match.group(1) in fields:
            return None
        fields[match.group(1)] = match.group(2)
    if set(fields) != {"key", "ts", "nonce", "body", "mac"} or not fields["ts"].isdigit() \
            or not re.fullmatch(r"[0-9a-f]{32}", fields["nonce"]) or not re.fullmatch(r"[0-9a-f]{64}", fields["body"]) \
            or not re.fullmatch(r"[0-9a-f]{64}", fields["mac"]):
        return None
    return Signature(fields["key"], int(fields["ts"]), fields["nonce"], fields["body"], fields["mac"])


def signed_by(token: str, signature: Signature, method: str, target: str) -> bool:
    """Whether the signature is the token's over this method and target (constant time)."""
    expected = hmac_sha256(token.encode(), _request_message(method, target, signature.ts, signature.nonce,
                                                            signature.body))
    return compare_digest(expected, signature.mac)


def answer_proof(token: str, mac: str, status: int, body: bytes) -> str:
    return hmac_sha256(token.encode(), f"checkoutcache-answer-v1\n{mac}\n{status}\n{sha256_hex(body)}".encode())


def proves_answer(token: str, mac: str, status: int, body: bytes, proof: str | None) -> bool:
    """Whether an answer's proof header shows the token's holder made it for our request."""
    if not proof or not proof.isascii():
        return False
    return compare_digest(answer_proof(token, mac, status, body), proof.strip().lower())
