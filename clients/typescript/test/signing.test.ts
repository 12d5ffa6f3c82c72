// The wire format of signed requests (src/signing.ts) against its two references: Node's own
// crypto for the HMAC and the digest, and checkoutcache/signing.py (the code serve checks with)
// for every string, run on the same inputs. No serve here: test/signed.test.ts has that.
import assert from "node:assert/strict";
import { createHash, createHmac } from "node:crypto";
import { it } from "node:test";
import {
  answerMessage, hmacSha256Hex, PROOF_HEADER, requestMessage, SCHEME, sha256Hex, tokenName, TokenKey,
} from "@checkoutcache/client/signing";
import { TOKEN, python } from "./helpers/index.js";

const utf8 = (text: string) => new TextEncoder().encode(text);

it("HMAC-SHA256 and SHA-256 on WebCrypto are Node crypto's, for keys shorter, as long as and longer than a block", async () => {
  const keys = ["k", TOKEN, "x".repeat(64), "y".repeat(65), "z".repeat(200), "tök-🔑-" + "q".repeat(20)];
  const messages = ["", "abc", "checkoutcache-request-v1\nPOST\n/v1/ensure\n1\n00\n11", "m".repeat(1000), "ünïcode ✓"];
  let compared = 0;
  for (const key of keys) {
    for (const message of messages) {
      assert.equal(await hmacSha256Hex(key, message), createHmac("sha256", key).update(message).digest("hex"), `${key} / ${message}`);
      assert.equal(await hmacSha256Hex(utf8(key), utf8(message)), createHmac("sha256", key).update(message).digest("hex"));
      compared++;
    }
  }
  assert.equal(compared, keys.length * messages.length);
  const binary = Buffer.from([0, 255, 128, 10, 13, 0]);
  assert.equal(await sha256Hex(binary), createHash("sha256").update(binary).digest("hex"));
  assert.equal(await sha256Hex(""), createHash("sha256").update("").digest("hex"));
  // A changed byte is another MAC (the comparison above could fail).
  assert.notEqual(await hmacSha256Hex(TOKEN, "abc"), await hmacSha256Hex(TOKEN, "abd"));
});

// What signing.py makes of the same inputs: the strings, the MACs, and its own checks of ours.
const PYTHON_SIDE = String.raw`
import base64, json, sys
from checkoutcache import signing
out = []
for case in json.load(sys.stdin):
    token, body, answer = case["token"], base64.b64decode(case["body"]), base64.b64decode(case["answer"])
    message = signing._request_message(case["method"], case["target"], case["ts"], case["nonce"], signing.sha256_hex(body))
    signature = signing.parse_signature(case["authorization"][len(signing.SCHEME) + 1:])
    out.append({
        "name": signing.token_name(token),
        "body": signing.sha256_hex(body),
        "message": message.decode(),
        "mac": signing.hmac_sha256(token.encode(), message),
        "parsed": None if signature is None else [signature.key, signature.ts, signature.nonce, signature.body, signature.mac],
        "signed_by": signature is not None and signing.signed_by(token, signature, case["method"], case["target"]),
        "other_target": signature is not None and signing.signed_by(token, signature, case["method"], case["target"] + "x"),
        "proof": signing.answer_proof(token, case["mac"], case["status"], answer),
        "proves": signing.proves_answer(token, case["mac"], case["status"], answer, case["proof"]),
        "proves_upper": signing.proves_answer(token, case["mac"], case["status"], answer, " " + case["proof"].upper() + " "),
        "proves_other_status": signing.proves_answer(token, case["mac"], case["status"] + 1, answer, case["proof"]),
        "scheme": signing.SCHEME, "header": signing.PROOF_HEADER,
    })
json.dump(out, sys.stdout)
`;

it("requests are signed and answers proved exactly as checkoutcache/signing.py signs and checks them", async () => {
  const cases = [
    { token: TOKEN, method: "POST", target: "/v1/ensure", body: utf8(JSON.stringify({ repo: "git://h/p", commit: "a".repeat(40), wait: 60 })),
      status: 200, answer: utf8('{"state": "ready", "path": "/cache/checkouts/x"}') },
    { token: TOKEN, method: "GET", target: "/v1/status", body: new Uint8Array(), status: 401, answer: new Uint8Array() },
    { token: "y".repeat(100), method: "GET", target: "/healthz?verbose=1&x=%2F", body: new Uint8Array(), status: 503, answer: utf8("{}") },
    { token: "tök-🔑-" + "q".repeat(20), method: "POST", target: "/v1/hold", body: utf8('{"repo": "ünï"}'), status: 202,
      answer: new Uint8Array([0, 255, 10, 13]) },
  ];
  const now = 1_767_225_600_123; // ms: ts is its whole seconds, as Python's int(time.time())
  const ours = [];
  for (const c of cases) {
    const key = new TokenKey(c.token);
    const nonce = (await sha256Hex(c.target)).slice(0, 32); // fixed, so that both sides sign the same string
    const signed = await key.sign(c.method, c.target, c.body, { now, nonce });
    const proof = await key.answerProof(signed.mac, c.status, c.answer);
    ours.push({ ...c, nonce, ts: Math.floor(now / 1000), signed, proof, key,
      message: requestMessage(c.method, c.target, Math.floor(now / 1000), nonce, await sha256Hex(c.body)) });
  }
  const theirs = python(PYTHON_SIDE, ours.map((o) => ({
    token: o.token, method: o.method, target: o.target, ts: o.ts, nonce: o.nonce, authorization: o.signed.authorization,
    mac: o.signed.mac, status: o.status, proof: o.proof,
    body: Buffer.from(o.body).toString("base64"), answer: Buffer.from(o.answer).toString("base64"),
  }))) as Array<Record<string, unknown>>;
  assert.equal(theirs.length, cases.length);
  for (const [i, o] of ours.entries()) {
    const py = theirs[i]!;
    assert.equal(py["scheme"], SCHEME);
    assert.equal(py["header"], PROOF_HEADER);
    assert.equal(await tokenName(o.token), py["name"]);
    assert.equal(o.message, py["message"], "the request string");
    assert.equal(o.signed.mac, py["mac"], "the request's MAC");
    const bodyDigest = await sha256Hex(o.body);
    assert.equal(bodyDigest, py["body"]);
    assert.equal(o.signed.authorization,
      `${SCHEME} key=${py["name"]}, ts=${o.ts}, nonce=${o.nonce}, body=${bodyDigest}, mac=${o.signed.mac}`);
    assert.deepEqual(py["parsed"], [py["name"], o.ts, o.nonce, bodyDigest, o.signed.mac], "serve parses our header");
    assert.equal(py["signed_by"], true, "serve takes our signature");
    assert.equal(py["other_target"], false, "and only for the target signed");
    assert.equal(o.proof, py["proof"], "the answer's proof");
    assert.equal(answerMessage(o.signed.mac, o.status, await sha256Hex(o.answer)).split("\n")[0], "checkoutcache-answer-v1");
    assert.equal(py["proves"], true);
    assert.equal(py["proves_upper"], true);
    assert.equal(py["proves_other_status"], false);
    // Our check takes what Python takes and refuses what it refuses.
    assert.equal(await o.key.proves(o.signed.mac, o.status, o.answer, String(py["proof"])), true);
    assert.equal(await o.key.proves(o.signed.mac, o.status, o.answer, ` ${String(py["proof"]).toUpperCase()} `), true);
    assert.equal(await o.key.proves(o.signed.mac, o.status + 1, o.answer, String(py["proof"])), false);
    assert.equal(await o.key.proves(o.signed.mac, o.status, new Uint8Array([...o.answer, 32]), String(py["proof"])), false);
    assert.equal(await o.key.proves(o.signed.mac, o.status, o.answer, null), false);
    assert.equal(await o.key.proves(o.signed.mac, o.status, o.answer, ""), false);
    assert.equal(await new TokenKey(o.token + "-other").proves(o.signed.mac, o.status, o.answer, String(py["proof"])), false);
  }
});

it("each signature has its own nonce, and its ts is the clock's whole seconds", async () => {
  const key = new TokenKey(TOKEN);
  const before = Math.floor(Date.now() / 1000);
  const signatures = await Promise.all(Array.from({ length: 20 }, () => key.sign("GET", "/v1/status", new Uint8Array())));
  const after = Math.floor(Date.now() / 1000);
  const fields = signatures.map((s) => Object.fromEntries(s.authorization.slice(SCHEME.length + 1).split(", ").map((f) => f.split("="))));
  assert.equal(new Set(fields.map((f) => f["nonce"])).size, 20);
  assert.ok(fields.every((f) => /^[0-9a-f]{32}$/.test(f["nonce"]) && Number(f["ts"]) >= before && Number(f["ts"]) <= after));
  assert.equal(new Set(signatures.map((s) => s.mac)).size, 20);
  assert.ok(signatures.every((s) => !s.authorization.includes(TOKEN)), "the token is not in the header");
});
