// What a call throws when the sidecar gave no answer about the checkout: one error type with
// the documented code (docs/errors.md) or one of the client's own, the server's message and next
// step, and the HTTP status where there was one.
import type { CloningAnswer, FailedAnswer } from "./types.js";

/** Codes the client itself gives (the server never does). */
export const CLIENT_CODES = {
  /** The sidecar could not be reached, or what answered is not the API (a proxy's page, no JSON). */
  UNAVAILABLE: "UNAVAILABLE",
  /**
   * A signed request's answer (any status but 401) did not prove it comes from the holder of the
   * token: not the sidecar (a process squatting its address?), so nothing of it is used.
   */
  NOT_THE_WRITER: "NOT_THE_WRITER",
  /** The call's budget passed (its wait plus the client's timeout, or the caller's AbortSignal.timeout). */
  TIMEOUT: "TIMEOUT",
  /** The caller's AbortSignal was aborted (not by a timeout). */
  ABORTED: "ABORTED",
  /** hold(): the checkout was still cloning when the wait ended, so nothing is held (`answer` says how far). */
  NOT_HELD: "NOT_HELD",
  /** RepositoryBreaker.run(): the repository is down for the rest of this turn; `fn` was not called. */
  REPOSITORY_DOWN: "REPOSITORY_DOWN",
} as const;

export type ClientCode = (typeof CLIENT_CODES)[keyof typeof CLIENT_CODES];

export interface CheckoutCacheErrorInit {
  code: string;
  message: string;
  next: string;
  /** The HTTP status, when the server answered. */
  status?: number | undefined;
  /** Seconds the server asked the caller to wait before asking again (Retry-After, or the answer's retry_after). */
  retryAfter?: number | undefined;
  /** The server's answer object, when it was an answer (a failed or cloning checkout of hold(), an error object). */
  answer?: FailedAnswer | CloningAnswer | undefined;
  cause?: unknown;
}

export class CheckoutCacheError extends Error {
  /** A code of docs/errors.md (UNAUTHORIZED, SERVER_BUSY, ...) or a client one (CLIENT_CODES). */
  readonly code: string;
  readonly next: string;
  readonly status: number | undefined;
  readonly retryAfter: number | undefined;
  readonly answer: FailedAnswer | CloningAnswer | undefined;

  constructor(init: CheckoutCacheErrorInit) {
    super(init.message, init.cause === undefined ? undefined : { cause: init.cause });
    this.name = "CheckoutCacheError";
    this.code = init.code;
    this.next = init.next;
    this.status = init.status;
    this.retryAfter = init.retryAfter;
    this.answer = init.answer;
  }

  /** The same JSON object as a failed answer (`state`, `error`, `message`, `next`), for a tool's result. */
  toJSON(): Record<string, unknown> {
    const out: Record<string, unknown> = { state: "failed", error: this.code, message: this.message, next: this.next };
    if (this.status !== undefined) out["status"] = this.status;
    if (this.retryAfter !== undefined) out["retry_after"] = this.retryAfter;
    return out;
  }
}

export function isCheckoutCacheError(value: unknown): value is CheckoutCacheError {
  return value instanceof CheckoutCacheError;
}
