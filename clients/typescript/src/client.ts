// The sidecar's HTTP API (`checkoutcache serve`, docs/http-api.md) for TypeScript: calls typed
// from the OpenAPI document, made by openapi-fetch through whatever fetch the caller gives (a
// Worker's `container.getTcpPort(8787).fetch`, Node's global fetch).
//
// What it promises:
// - ensure() and waitReady() return the checkout's answer as data (ready, cloning, failed: the
//   same JSON as the library and the CLI); everything that is not an answer about the checkout
//   (bad input, 401, 403, 404, 429, SERVER_BUSY, SHUTTING_DOWN, a transport error, a budget that
//   ran out) throws CheckoutCacheError with its code, message, next step and HTTP status.
// - Every call has a budget: its wait plus `timeout` (60 s) unless the caller gives `budget` or an
//   AbortSignal; when it runs out the call throws TIMEOUT at once, whatever the fetch underneath
//   does with the abort (a fetch that ignores its signal cannot make a call hang); and once it
//   has ended nothing of it runs on (no request, no token asked, no onProgress).
// - The token (a string or a function, asked at each request, so a rotated token is used from the
//   next request on) never crosses the wire by default: each request is signed (src/signing.ts,
//   checkoutcache/signing.py), public endpoints included, and an answer (but a 401) that does not
//   prove it comes from the token's holder throws NOT_THE_WRITER with nothing of it used (a 401,
//   which serve cannot prove, is UNAUTHORIZED in the error table's words, its body unused): while
//   serve is down, whatever binds its address learns no token and cannot answer `ready` with a
//   path of its own. With auth "bearer" the token is sent, only to endpoints that need it.
// - Answers keep every field the server sent, the ones the document does not name yet included.
import createClient from "openapi-fetch";
import { CheckoutCacheError, CLIENT_CODES } from "./errors.js";
import { durationSeconds } from "./durations.js";
import { PROOF_HEADER, TokenKey } from "./signing.js";
import type { paths } from "./generated/openapi.js";
import type {
  Answer, CloningAnswer, Duration, EnsureRequest, FailedAnswer, GcReport, GcRequest, Health, HeldAnswer,
  HoldRequest, Readiness, StatusReport, WorkspacesReport,
} from "./types.js";

export type TokenSource = string | (() => string | Promise<string>);
/** What the client calls to send a request: the global fetch, or one injected (a Worker's port fetch). */
export type FetchLike = (input: Request) => Promise<Response>;
/** Something with a fetch method, called as its method (a Worker's Fetcher: `container.getTcpPort(8787)`, `env.SERVICE`). */
export interface Fetcher {
  fetch(input: Request): Promise<Response>;
}

/**
 * How a request proves the caller holds the token: "signed" (an HMAC of the request; the answer
 * must prove it comes from the token's holder) or "bearer" (`Authorization: Bearer <token>`).
 */
export type Auth = "signed" | "bearer";

export interface CheckoutCacheOptions {
  /** Where serve answers, e.g. http://127.0.0.1:8787 (with an injected fetch: the URL it is given). */
  baseUrl: string;
  /** The API token, or a function returning it (or a promise of it), asked at each request. */
  token?: TokenSource | undefined;
  /**
   * "signed" (the default with a token): the token never crosses the wire, every request is signed
   * and every answer but a 401 must carry serve's proof (else NOT_THE_WRITER). "bearer": the token
   * is sent as it is, for a proxy that must see a bearer token, or where nothing but serve can hold
   * the address (a platform's own connection to its container).
   */
  auth?: Auth | undefined;
  /**
   * The fetch to send requests with: a function, or an object whose fetch method is called as its
   * method (pass `container.getTcpPort(8787)` itself, or `(r) => port.fetch(r)`: a Worker's
   * `port.fetch` taken alone has lost its `this`). Default the global fetch, looked up at each request.
   */
  fetch?: FetchLike | Fetcher | undefined;
  /** Seconds a call may take beyond the wait it asks for (default 60). */
  timeout?: number | undefined;
  /**
   * Given the work the client goes on with after a call ended: the release of a hold serve made
   * for a hold() whose call had ended (its budget, the caller's signal) before the answer came.
   * In a Worker pass `ctx.waitUntil.bind(ctx)`, so the invocation lives until it is done; in Node
   * it runs on its own (default: nothing is told). The promise never rejects.
   */
  waitUntil?: ((work: Promise<unknown>) => void) | undefined;
}

export interface CallOptions {
  /** Ends the call when aborted: TIMEOUT for an AbortSignal.timeout(), ABORTED otherwise. */
  signal?: AbortSignal | undefined;
  /** Seconds this call may take in all (default: its wait plus the client's timeout). */
  budget?: number | undefined;
}

export type EnsureOptions = EnsureRequest & CallOptions;

export type WaitReadyOptions = Omit<EnsureRequest, "wait"> & CallOptions & {
  /** How long to wait for the checkout in all (seconds or "15m"): waitReady's deadline. */
  wait: Duration;
  /** Called with each cloning answer while it waits (the clone's progress, and what the server says of it). */
  onProgress?: ((answer: CloningAnswer) => void) | undefined;
  /** Seconds between progress reports (default 5): each is a request that waits on the server meanwhile. */
  every?: number | undefined;
};

export type HoldOptions = HoldRequest & CallOptions;

/** A checkout held against gc: the server's answer, and release() to end the hold before its ttl. */
export type Hold = HeldAnswer & {
  /** true when this call released it, false when it had been released already; UNKNOWN_HOLD (404) if it expired. */
  release(options?: CallOptions): Promise<boolean>;
};

export type GcOptions = GcRequest & CallOptions;

const DEFAULT_TIMEOUT = 60;
/** Failed answers that are about the server, not the checkout: thrown, never returned. */
const SERVER_CONDITIONS = new Set(["SERVER_BUSY", "SHUTTING_DOWN"]);
/** Refusals by the HTTP server itself, before the API: no JSON body (docs/http-api.md, Listeners). */
const REFUSED_UNREAD = new Set([400, 413, 414, 431]);
const MAX_TIMER_MS = 2 ** 31 - 1; // setTimeout fires at once past this (~24.8 days): a budget that long is "no budget"
const MIN_ASK_INTERVAL_MS = 1000; // waitReady asks at most once a second, whatever the server does
const PUBLIC = new Set(["/healthz", "/readyz", "/openapi.json"]);

type Api = ReturnType<typeof createClient<paths>>;
type Reply = { data?: unknown; error?: unknown; response: Response };
/** What one request is sent with: its headers and the fetch that sends it (the signing one, when signed). */
type Transport = { headers: Record<string, string>; fetch: FetchLike };
/** Statuses whose Response must have no body. */
const NULL_BODY = new Set([101, 204, 205, 304]);

export class CheckoutCache {
  readonly baseUrl: string;
  readonly timeout: number;
  /** How requests carry the token ("signed" or "bearer"), undefined without one. */
  readonly auth: Auth | undefined;
  private readonly token: TokenSource | undefined;
  private readonly api: Api;
  private readonly send: FetchLike;
  private readonly waitUntil: ((work: Promise<unknown>) => void) | undefined;
  private key: TokenKey | undefined; // the last token's, reused while the token function gives the same

  constructor(options: CheckoutCacheOptions) {
    if (!options || typeof options.baseUrl !== "string" || !/^https?:\/\//i.test(options.baseUrl)) {
      throw new TypeError("CheckoutCache: baseUrl must be an http:// or https:// URL, e.g. http://127.0.0.1:8787");
    }
    const timeout = options.timeout ?? DEFAULT_TIMEOUT;
    if (!Number.isFinite(timeout) || timeout <= 0) throw new TypeError("CheckoutCache: timeout must be positive seconds");
    this.baseUrl = options.baseUrl.replace(/\/+$/, "");
    this.timeout = timeout;
    this.token = options.token;
    if (options.auth !== undefined && options.auth !== "signed" && options.auth !== "bearer") {
      throw new TypeError(`CheckoutCache: auth must be "signed" or "bearer", got ${JSON.stringify(options.auth)}`);
    }
    if (options.auth !== undefined && options.token === undefined) {
      throw new TypeError(`CheckoutCache: auth ${JSON.stringify(options.auth)} needs a token`);
    }
    this.auth = options.token === undefined ? undefined : options.auth ?? "signed";
    const injected = options.fetch;
    if (injected !== undefined && typeof injected !== "function" && typeof injected?.fetch !== "function") {
      throw new TypeError("CheckoutCache: fetch must be a function or an object with a fetch method");
    }
    const send: FetchLike = typeof injected === "function" ? (request) => injected(request)
      : injected ? (request) => injected.fetch(request)
      : (request) => globalThis.fetch(request); // looked up at each request, never captured
    this.send = send;
    if (options.waitUntil !== undefined && typeof options.waitUntil !== "function") {
      throw new TypeError("CheckoutCache: waitUntil must be a function (a Worker's ctx.waitUntil.bind(ctx))");
    }
    this.waitUntil = options.waitUntil;
    this.api = createClient<paths>({ baseUrl: this.baseUrl, fetch: send });
  }

  // ------------------------------------------------------------ checkouts

  /** POST /v1/ensure: the checkout's answer (ready, cloning or failed) as data. */
  async ensure(options: EnsureOptions): Promise<Answer> {
    const { signal, budget, ...request } = options;
    return this.call(budgetFor(budget, request.wait, this.timeout), signal, (sig) => this.ensureOnce(request, sig));
  }

  /**
   * Ask until the checkout is ready or `wait` has passed: the last answer (ready; cloning at the
   * deadline; failed when its retry_after falls past the deadline). Each ask waits on the server
   * for at most `every` seconds, so onProgress hears of the clone that often; a failed answer's
   * retry_after and a SERVER_BUSY's Retry-After are honoured (never asked again before), and after
   * SERVER_BUSY it asks without waiting on the server (which takes none of its waiting slots).
   */
  async waitReady(options: WaitReadyOptions): Promise<Answer> {
    const { signal, budget, wait, onProgress, every, ...request } = options;
    const total = durationSeconds(wait);
    if (total === undefined) {
      throw new CheckoutCacheError({ code: "BAD_ARGUMENT", message: `wait must be seconds or a form such as 15m, got ${JSON.stringify(wait)}`,
        next: "pass seconds (a number) or a form such as 90s, 15m, 1h" });
    }
    const step = every ?? 5;
    if (!Number.isFinite(step) || step <= 0) throw new TypeError("waitReady: every must be positive seconds");
    const deadline = Date.now() + total * 1000;
    return this.call(budget ?? total + this.timeout, signal, async (sig) => {
      // Once the call has ended (its budget, the caller's signal), nothing more runs: no ask, no
      // token asked, no onProgress, whatever the fetch underneath does with the abort. So the
      // signal is looked at before each ask and after each await, and a pause ends with it.
      let onServer = true; // wait on the server between asks, until it says it is busy
      for (;;) {
        sig.throwIfAborted();
        const asked = Date.now();
        const left = (deadline - asked) / 1000;
        let answer: Answer;
        try {
          answer = await this.ensureOnce({ ...request, wait: onServer ? round(Math.max(0, Math.min(left, step))) : 0 }, sig);
        } catch (error) {
          sig.throwIfAborted();
          if (!(error instanceof CheckoutCacheError) || !SERVER_CONDITIONS.has(error.code)) throw error;
          const pause = (error.retryAfter ?? 1) * 1000;
          if (Date.now() + pause >= deadline) throw error;
          if (error.code === "SERVER_BUSY") onServer = false;
          await sleep(pause, sig);
          continue;
        }
        sig.throwIfAborted(); // an answer that came after the call ended: nobody hears of it
        if (answer.state === "ready") return answer;
        if (answer.state === "cloning") onProgress?.(answer);
        const now = Date.now();
        const retryAfter = typeof answer["retry_after"] === "number" ? answer["retry_after"] * 1000 : 0;
        const pause = Math.max(retryAfter, MIN_ASK_INTERVAL_MS - (now - asked), 0);
        // After a failed answer, an ask with less than a second left could only start the retry (and
        // answer cloning), never see it end: the failed answer is the better last word.
        if (now >= deadline || (answer.state === "failed" && now + pause + MIN_ASK_INTERVAL_MS > deadline)) return answer;
        if (answer.state === "failed" && !retryAfter) return answer; // nothing says a later ask would do better
        await sleep(Math.min(pause, deadline - now), sig);
      }
    });
  }

  /**
   * POST /v1/hold: the checkout, ready and held against gc until release() or its ttl.
   *
   * serve does not stop a hold when its caller goes away, and names the hold only in its answer:
   * a hold whose call ends first (its budget, the caller's signal) would be made for nobody, and
   * stay until its ttl. So its request is not cut when the call ends: it runs on (for at most its
   * wait plus the client's timeout, what serve needs to answer), and a hold its answer makes is
   * released at once (given to `waitUntil`). A hold whose answer never arrives (the connection
   * lost, the process or the Worker's invocation gone) stays until its ttl: keep the ttl short.
   */
  async hold(options: HoldOptions): Promise<Hold> {
    const { signal, budget, ...request } = options;
    const needed = budgetFor(undefined, request.wait, this.timeout); // what serve takes to answer, at most
    return this.call(budget ?? needed, signal, async (sig) => {
      // The request's own signal: cut once both the call has ended and serve's time to answer has passed.
      const own = new AbortController();
      let due = false;
      const cut = () => {
        if (due && sig.aborted) own.abort(sig.reason);
      };
      const timer = setTimeout(() => { due = true; cut(); }, Math.min(MAX_TIMER_MS, needed * 1000));
      sig.addEventListener("abort", cut, { once: true });
      let reply: { status: number; body: unknown; response: Response };
      try {
        reply = await this.exchange("/v1/hold", sig,
          (transport) => this.api.POST("/v1/hold", { body: request, signal: own.signal, ...transport }));
      } finally {
        clearTimeout(timer);
        sig.removeEventListener("abort", cut);
      }
      const { status, body, response } = reply;
      const held = status === 200 && isObject(body) && body["state"] === "ready" && typeof body["hold"] === "string";
      if (sig.aborted) {
        // The call has ended: nobody will have this hold. Released now, rather than left to its ttl.
        if (held) this.afterwards(this.release(body["hold"] as string, { budget: this.timeout }));
        throw sig.reason;
      }
      if (held) return this.held(body as HeldAnswer);
      if (status === 202 && isObject(body) && body["state"] === "cloning") {
        throw new CheckoutCacheError({ code: CLIENT_CODES.NOT_HELD, status,
          message: "the checkout is still cloning: nothing is held", answer: body as CloningAnswer,
          next: "hold again with a longer wait (or waitReady first, then hold)" });
      }
      throw errorFrom("POST /v1/hold", response, body);
    });
  }

  /** POST /v1/release: true when released; UNKNOWN_HOLD (404) when it expired or was never this token's. */
  async release(hold: string | { hold: string }, options: CallOptions = {}): Promise<true> {
    const id = typeof hold === "string" ? hold : hold.hold;
    return this.call(options.budget ?? this.timeout, options.signal, async (sig) => {
      const { status, body, response } = await this.exchange("/v1/release", sig,
        (transport) => this.api.POST("/v1/release", { body: { hold: id }, signal: sig, ...transport }));
      if (status === 200 && isObject(body) && body["released"] === true) return true as const;
      throw errorFrom("POST /v1/release", response, body);
    });
  }

  // ------------------------------------------------------------ the store and the server

  /** GET /v1/status: what the root holds (a token sees its own scopes only). */
  async status(options: CallOptions = {}): Promise<StatusReport> {
    return this.json("/v1/status", options, (sig, transport) => this.api.GET("/v1/status", { signal: sig, ...transport })) as Promise<StatusReport>;
  }

  /** GET /v1/workspaces: the workspaces directory as the sidecar sees it. */
  async workspaces(options: CallOptions = {}): Promise<WorkspacesReport> {
    return this.json("/v1/workspaces", options, (sig, transport) => this.api.GET("/v1/workspaces", { signal: sig, ...transport })) as Promise<WorkspacesReport>;
  }

  /** POST /v1/gc: one gc run with the limits given (they can only tighten the operator's). */
  async gc(options: GcOptions = {}): Promise<GcReport> {
    const { signal, budget, ...limits } = options;
    return this.json("/v1/gc", { signal, budget }, (sig, transport) => this.api.POST("/v1/gc", { body: limits, signal: sig, ...transport })) as Promise<GcReport>;
  }

  /** GET /healthz: whether the process answers (no token). */
  async health(options: CallOptions = {}): Promise<Health> {
    return this.probe("/healthz", options, (sig, transport) => this.api.GET("/healthz", { signal: sig, ...transport })) as Promise<Health>;
  }

  /** GET /readyz: whether the root is usable; `ok: false` with the checks saying why (no token). */
  async ready(options: CallOptions = {}): Promise<Readiness> {
    return this.probe("/readyz", options, (sig, transport) => this.api.GET("/readyz", { signal: sig, ...transport })) as Promise<Readiness>;
  }

  /** GET /openapi.json: the OpenAPI document this server answers by (no token). */
  async openapi(options: CallOptions = {}): Promise<Record<string, unknown>> {
    return this.json("/openapi.json", options, (sig, transport) => this.api.GET("/openapi.json", { signal: sig, ...transport })) as Promise<Record<string, unknown>>;
  }

  /** GET /metrics: the Prometheus text exposition. */
  async metrics(options: CallOptions = {}): Promise<string> {
    return this.call(options.budget ?? this.timeout, options.signal, async (sig) => {
      const { status, body, response } = await this.exchange("/metrics", sig,
        (transport) => this.api.GET("/metrics", { signal: sig, ...transport, parseAs: "text" }));
      const type = response.headers.get("content-type") ?? "";
      if (status === 200 && typeof body === "string" && type.startsWith("text/plain")) return body;
      throw errorFrom("GET /metrics", response, typeof body === "string" ? parseJson(body) : body);
    });
  }

  // ------------------------------------------------------------ transport

  private async ensureOnce(request: EnsureRequest, signal: AbortSignal): Promise<Answer> {
    const { status, body, response } = await this.exchange("/v1/ensure", signal,
      (transport) => this.api.POST("/v1/ensure", { body: request, signal, ...transport }));
    if (isObject(body)) {
      const state = body["state"];
      if ((status === 200 && state === "ready") || (status === 202 && state === "cloning")) return body as Answer;
      if (status === 503 && state === "failed" && typeof body["error"] === "string" && !SERVER_CONDITIONS.has(body["error"])) {
        return body as FailedAnswer;
      }
    }
    throw errorFrom("POST /v1/ensure", response, body);
  }

  /** Work that goes on after its call ended: never a rejection, and given to `waitUntil`. */
  private afterwards(work: Promise<unknown>): void {
    const done = work.then(() => undefined, () => undefined);
    this.waitUntil?.(done);
  }

  private held(answer: HeldAnswer): Hold {
    let releasing: Promise<boolean> | undefined;
    const release = (options: CallOptions = {}): Promise<boolean> => {
      if (releasing) return releasing.then(() => false, () => false);
      const attempt = this.release(answer.hold, options).then(() => true);
      releasing = attempt;
      attempt.catch((error: unknown) => {
        // The server no longer has it (expired): gone all the same. Anything else may be retried.
        if (!(error instanceof CheckoutCacheError && error.code === "UNKNOWN_HOLD")) releasing = undefined;
      });
      return attempt;
    };
    return Object.assign({}, answer, { release }) as Hold;
  }

  private async json(path: string, options: CallOptions, send: (signal: AbortSignal, transport: Transport) => Promise<Reply>): Promise<unknown> {
    return this.call(options.budget ?? this.timeout, options.signal, async (sig) => {
      const { status, body, response } = await this.exchange(path, sig, (transport) => send(sig, transport));
      if (status === 200 && isObject(body) && isJson(response)) return body;
      throw errorFrom(path, response, body);
    });
  }

  /** /healthz and /readyz answer their report with 200 and with 503 (not ready): both are data. */
  private async probe(path: string, options: CallOptions, send: (signal: AbortSignal, transport: Transport) => Promise<Reply>): Promise<unknown> {
    return this.call(options.budget ?? this.timeout, options.signal, async (sig) => {
      const { status, body, response } = await this.exchange(path, sig, (transport) => send(sig, transport));
      if ((status === 200 || status === 503) && isObject(body) && typeof body["ok"] === "boolean" && !("error" in body)) return body;
      throw errorFrom(path, response, body);
    });
  }

  /**
   * One request: the token asked for (the caller's function: what it throws is its own), then
   * the exchange, where whatever fails (the fetch rejects, the connection drops mid-body, a body
   * that is not JSON) is UNAVAILABLE, whichever runtime's error type it came as, and an unproven
   * answer to a signed request is NOT_THE_WRITER.
   */
  private async exchange(path: string, signal: AbortSignal, send: (transport: Transport) => Promise<Reply>):
      Promise<{ status: number; body: unknown; response: Response }> {
    const transport = await this.transport(path, signal);
    signal.throwIfAborted(); // the call ended while the token was asked for: nothing is sent
    let reply: Reply;
    try {
      reply = await send(transport);
    } catch (error) {
      if (error instanceof CheckoutCacheError || signal.aborted) throw error; // an abort: call() says which
      throw unavailable(path, error);
    }
    return { status: reply.response.status, body: bodyOf(reply), response: reply.response };
  }

  private async transport(path: string, signal: AbortSignal): Promise<Transport> {
    if (this.token === undefined || (this.auth === "bearer" && PUBLIC.has(path))) return { headers: {}, fetch: this.send };
    const token = typeof this.token === "function" ? await this.token() : this.token;
    if (typeof token !== "string" || !token) {
      throw new TypeError("CheckoutCache: the token function must return a non-empty string");
    }
    if (this.auth === "bearer") return { headers: { Authorization: `Bearer ${token}` }, fetch: this.send };
    if (this.key?.token !== token) this.key = new TokenKey(token);
    const key = this.key;
    return { headers: {}, fetch: (request) => this.signed(request, key, signal) };
  }

  /**
   * Send one request signed, as it stands (its method, its target as sent, its exact body bytes),
   * and give back its answer only once the answer proves it comes from the token's holder (a 401
   * proves nothing, and tells nothing a squatter could use). A redirect is not followed: it is
   * an answer like any other, unproven unless serve made it.
   */
  private async signed(request: Request, key: TokenKey, signal: AbortSignal): Promise<Response> {
    const body = new Uint8Array(await request.arrayBuffer());
    const url = new URL(request.url);
    const { authorization, mac } = await key.sign(request.method, url.pathname + url.search, body);
    signal.throwIfAborted(); // the call ended while it was signed: nothing is sent
    const headers = new Headers(request.headers);
    headers.set("Authorization", authorization);
    const response = await this.send(new Request(request.url, {
      method: request.method, headers, body: request.method === "GET" || request.method === "HEAD" ? null : body,
      signal: request.signal, redirect: "manual",
    }));
    if (response.status === 401) {
      // The one answer serve cannot prove (a token it does not hold): whoever made it, nothing of
      // it is used (a squatter's message, next step, Retry-After), only that it is a 401.
      response.body?.cancel().catch(() => undefined);
      throw unauthorized();
    }
    const answer = new Uint8Array(await response.arrayBuffer());
    if (!(await key.proves(mac, response.status, answer, response.headers.get(PROOF_HEADER)))) {
      throw new CheckoutCacheError({ code: CLIENT_CODES.NOT_THE_WRITER,
        message: `${request.method} ${url.pathname}: the answer (HTTP ${response.status}) does not prove it comes from the holder `
          + "of the token: not the sidecar; nothing of it is used",
        next: "the sidecar could not prove it holds the token: a process squatting its address (serve down or restarting)? "
          + "Treat the sidecar as unavailable for now; if it persists, check that serve runs at baseUrl with this token "
          + "(serve's 403 for a Host or Origin it refuses, and its public endpoints asked with a token it does not hold, carry no proof)" });
    }
    return new Response(NULL_BODY.has(response.status) ? null : answer,
      { status: response.status, statusText: response.statusText, headers: response.headers });
  }

  /**
   * Run one call within its budget: `work` gets a signal aborted when the budget runs out or the
   * caller's signal aborts, and the call settles then whether or not `work` heeds it.
   */
  private async call<T>(seconds: number, outer: AbortSignal | undefined, work: (signal: AbortSignal) => Promise<T>): Promise<T> {
    const controller = new AbortController();
    let timedOut = false;
    const timer = setTimeout(() => {
      timedOut = true;
      controller.abort(new CheckoutCacheError({ code: CLIENT_CODES.TIMEOUT,
        message: `no answer within the call's budget of ${round(seconds)}s`,
        next: "the sidecar did not answer in time: treat it as unavailable for now (a longer wait asks the server to wait, not the client)" }));
    }, Math.min(MAX_TIMER_MS, Math.max(0, seconds * 1000)));
    const onOuterAbort = () => controller.abort(outer?.reason);
    if (outer?.aborted) onOuterAbort();
    else outer?.addEventListener("abort", onOuterAbort, { once: true });
    const stopped = new Promise<never>((_, reject) => {
      const fail = () => reject(abortedError(controller.signal.reason, timedOut));
      if (controller.signal.aborted) fail();
      else controller.signal.addEventListener("abort", fail, { once: true });
    });
    const running = controller.signal.aborted ? stopped : Promise.resolve().then(() => work(controller.signal));
    running.catch(() => undefined); // settled after the race was lost: not an unhandled rejection
    stopped.catch(() => undefined);
    try {
      return await Promise.race([running, stopped]);
    } catch (error) {
      if (error instanceof CheckoutCacheError) throw error;
      if (controller.signal.aborted) throw abortedError(controller.signal.reason, timedOut);
      throw error; // the caller's own (its token function, its onProgress)
    } finally {
      clearTimeout(timer);
      outer?.removeEventListener("abort", onOuterAbort);
    }
  }
}

// ------------------------------------------------------------ helpers (pure)

function budgetFor(budget: number | undefined, wait: Duration | undefined, timeout: number): number {
  return budget ?? (durationSeconds(wait) ?? 0) + timeout;
}

function round(seconds: number): number {
  return Math.round(seconds * 1000) / 1000;
}

function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

function isJson(response: Response): boolean {
  return (response.headers.get("content-type") ?? "").toLowerCase().startsWith("application/json");
}

function bodyOf(reply: Reply): unknown {
  return reply.data !== undefined ? reply.data : reply.error;
}

function parseJson(text: string): unknown {
  try {
    return JSON.parse(text);
  } catch {
    return text;
  }
}

function retryAfterOf(response: Response, body: unknown): number | undefined {
  const header = response.headers.get("retry-after");
  if (header !== null) {
    if (/^\d+$/.test(header.trim())) return Number(header.trim());
    const at = Date.parse(header);
    if (!Number.isNaN(at)) return Math.max(0, Math.ceil((at - Date.now()) / 1000));
  }
  if (isObject(body) && typeof body["retry_after"] === "number") return body["retry_after"];
  return undefined;
}

/** A CheckoutCacheError for a reply that is not the answer the call wants. */
function errorFrom(what: string, response: Response, body: unknown): CheckoutCacheError {
  const status = response.status;
  const retryAfter = retryAfterOf(response, body);
  if (isObject(body) && typeof body["error"] === "string") {
    return new CheckoutCacheError({
      code: body["error"], status, retryAfter,
      message: typeof body["message"] === "string" ? body["message"] : `${what}: HTTP ${status}`,
      next: typeof body["next"] === "string" ? body["next"] : "",
      answer: body["state"] === "failed" ? (body as FailedAnswer) : undefined,
    });
  }
  if (REFUSED_UNREAD.has(status)) {
    return new CheckoutCacheError({ code: "BAD_ARGUMENT", status,
      message: `${what}: the HTTP server refused the request before the API read it (HTTP ${status}, no answer body)`,
      next: "send a smaller request (a POST with a JSON body of a few fields)" });
  }
  return new CheckoutCacheError({ code: CLIENT_CODES.UNAVAILABLE, status, retryAfter,
    message: `${what}: HTTP ${status} is not an answer of the checkoutcache API (${response.headers.get("content-type") ?? "no content type"})`,
    next: "check that baseUrl (or the injected fetch) reaches `checkoutcache serve`: a proxy, or a sidecar not started, answers so" });
}

/**
 * UNAUTHORIZED as docs/errors.md's table says it: what a 401 to a signed request stands for,
 * in the words the CLI, the hand-off and the Python client use (checkoutcache/handoff.py).
 */
function unauthorized(): CheckoutCacheError {
  return new CheckoutCacheError({ code: "UNAUTHORIZED", status: 401, message: "this request needs a valid bearer token",
    next: "send `Authorization: Bearer <token>` with the token the platform gave this container" });
}

function unavailable(path: string, error: unknown): CheckoutCacheError {
  if (error instanceof SyntaxError) {
    return new CheckoutCacheError({ code: CLIENT_CODES.UNAVAILABLE, message: `${path}: the answer was not JSON (${error.message})`,
      next: "check that baseUrl (or the injected fetch) reaches `checkoutcache serve`, not a proxy's page", cause: error });
  }
  // Node's fetch: TypeError "fetch failed" with the cause (ECONNREFUSED...); Workers: Error "Network connection lost."
  const cause = isObject(error) ? (error as { cause?: unknown }).cause : undefined;
  const said = error instanceof Error ? error.message : String(error);
  const why = cause instanceof Error ? `${said}: ${cause.message}` : said;
  return new CheckoutCacheError({ code: CLIENT_CODES.UNAVAILABLE, message: `${path}: the sidecar could not be reached (${why})`,
    next: "check that checkoutcache serve runs and listens where baseUrl (or the injected fetch) points", cause: error });
}

function abortedError(reason: unknown, timedOut: boolean): CheckoutCacheError {
  if (reason instanceof CheckoutCacheError) return reason;
  const isTimeout = timedOut || (isObject(reason) && (reason as { name?: unknown }).name === "TimeoutError");
  if (isTimeout) {
    return new CheckoutCacheError({ code: CLIENT_CODES.TIMEOUT, message: "the call's signal timed out before an answer came",
      next: "the sidecar did not answer in time: treat it as unavailable for now", cause: reason });
  }
  return new CheckoutCacheError({ code: CLIENT_CODES.ABORTED, message: "the call was aborted by its caller's signal",
    next: "nothing to do: the caller ended it", cause: reason });
}

/** A pause that ends with the signal: rejected with its reason (never a pause cut short, then on). */
function sleep(ms: number, signal: AbortSignal): Promise<void> {
  return new Promise((resolve, reject) => {
    if (signal.aborted) return reject(signal.reason);
    if (ms <= 0) return resolve();
    const stop = () => {
      clearTimeout(timer);
      reject(signal.reason);
    };
    const timer = setTimeout(() => {
      signal.removeEventListener("abort", stop);
      resolve();
    }, Math.min(MAX_TIMER_MS, ms));
    signal.addEventListener("abort", stop, { once: true });
  });
}
