// Signed requests (checkoutcache/signing.py; docs/http-api.md, "Authentication"), on WebCrypto
// (globalThis.crypto.subtle: Node 20+, workerd), no dependency.
//
// Why: while serve is down anyone in the pod may bind its address. A bearer token sent there is
// the squatter's, and so is any `ready` path it answers. A signed request carries an HMAC-SHA256
// of itself under the token instead of the token; serve answers with an HMAC of its answer bound
// to that request, which only the token's holder can make.
//
// The wire format, byte for byte the one of signing.py (test/signing.test.ts compares both):
//
//   Authorization: CheckoutCache-HMAC key=<token name>, ts=<unix seconds>, nonce=<32 hex>,
//                  body=<sha256 hex of the request body>, mac=<hex>
//   mac   = HMAC-SHA256(token, "checkoutcache-request-v1\n" METHOD "\n" TARGET "\n" ts "\n" nonce "\n" body)
//   X-CheckoutCache-Proof: HMAC-SHA256(token, "checkoutcache-answer-v1\n" mac "\n" STATUS "\n" sha256 hex of the answer)
//
// TARGET is the request target as sent (path, and `?query` when there is one); the token's name
// is `token-` and the first 12 hex digits of the token's sha256. Strings are UTF-8.

export const SCHEME = "CheckoutCache-HMAC";
export const PROOF_HEADER = "x-checkoutcache-proof";

const encoder = new TextEncoder();

function subtle(): SubtleCrypto {
  const crypto = (globalThis as { crypto?: Crypto }).crypto;
  if (!crypto?.subtle) {
    throw new TypeError("CheckoutCache: signed requests need WebCrypto (globalThis.crypto.subtle: Node 20+, the Workers runtime); "
      + "without it, auth: \"bearer\"");
  }
  return crypto.subtle;
}

/** UTF-8 for a string; bytes as WebCrypto takes them (a copy only of a view on a SharedArrayBuffer). */
function bytesOf(data: Uint8Array | string): Uint8Array<ArrayBuffer> {
  if (typeof data === "string") return encoder.encode(data);
  return data.buffer instanceof ArrayBuffer ? data as Uint8Array<ArrayBuffer> : new Uint8Array(data);
}

function hex(buffer: ArrayBuffer): string {
  let out = "";
  for (const byte of new Uint8Array(buffer)) out += byte.toString(16).padStart(2, "0");
  return out;
}

/** Equal hex strings, in time that does not depend on where they differ. */
function sameHex(a: string, b: string): boolean {
  if (a.length !== b.length) return false;
  let difference = 0;
  for (let i = 0; i < a.length; i++) difference |= a.charCodeAt(i) ^ b.charCodeAt(i);
  return difference === 0;
}

export async function sha256Hex(data: Uint8Array | string): Promise<string> {
  return hex(await subtle().digest("SHA-256", bytesOf(data)));
}

export async function hmacSha256Hex(key: Uint8Array | string, message: Uint8Array | string): Promise<string> {
  const imported = await subtle().importKey("raw", bytesOf(key), { name: "HMAC", hash: "SHA-256" }, false, ["sign"]);
  return hex(await subtle().sign("HMAC", imported, bytesOf(message)));
}

/** A token's name in serve's logs, hold accounting and signatures. */
export async function tokenName(token: string): Promise<string> {
  return "token-" + (await sha256Hex(token)).slice(0, 12);
}

export function requestMessage(method: string, target: string, ts: number, nonce: string, bodyDigest: string): string {
  return `checkoutcache-request-v1\n${method}\n${target}\n${ts}\n${nonce}\n${bodyDigest}`;
}

export function answerMessage(mac: string, status: number, bodyDigest: string): string {
  return `checkoutcache-answer-v1\n${mac}\n${status}\n${bodyDigest}`;
}

export function randomNonce(): string {
  const bytes = new Uint8Array(16);
  globalThis.crypto.getRandomValues(bytes);
  return hex(bytes.buffer);
}

export interface SignedRequest {
  /** The Authorization header's value. */
  authorization: string;
  /** The request's mac: what the answer's proof is bound to. */
  mac: string;
}

/**
 * One token's key, imported once: what signs requests and checks answers' proofs. A client keeps
 * the last one it used, so a token function's rotation costs one import, not one a request.
 */
export class TokenKey {
  private readonly key: Promise<CryptoKey>;
  private readonly name: Promise<string>;

  constructor(readonly token: string) {
    this.key = subtle().importKey("raw", encoder.encode(token), { name: "HMAC", hash: "SHA-256" }, false, ["sign"]);
    this.name = tokenName(token);
    this.key.catch(() => undefined); // awaited by each use: not an unhandled rejection meanwhile
    this.name.catch(() => undefined);
  }

  private async mac(message: string): Promise<string> {
    return hex(await subtle().sign("HMAC", await this.key, encoder.encode(message)));
  }

  /** Sign one request: its method, its target as sent (path and ?query) and its exact body bytes. */
  async sign(method: string, target: string, body: Uint8Array, options: { now?: number; nonce?: string } = {}): Promise<SignedRequest> {
    const ts = Math.floor((options.now ?? Date.now()) / 1000);
    const nonce = options.nonce ?? randomNonce();
    const digest = await sha256Hex(body);
    const mac = await this.mac(requestMessage(method, target, ts, nonce, digest));
    return { authorization: `${SCHEME} key=${await this.name}, ts=${ts}, nonce=${nonce}, body=${digest}, mac=${mac}`, mac };
  }

  /** The proof serve sends with its answer (status and exact body bytes) to the request of `mac`. */
  async answerProof(mac: string, status: number, body: Uint8Array): Promise<string> {
    return this.mac(answerMessage(mac, status, await sha256Hex(body)));
  }

  /** Whether an answer's proof header shows the token's holder made it for the request of `mac`. */
  async proves(mac: string, status: number, body: Uint8Array, proof: string | null): Promise<boolean> {
    if (!proof) return false;
    return sameHex(await this.answerProof(mac, status, body), proof.trim().toLowerCase());
  }
}
