// The built package (dist/index.js, through the package's own name) against a real serve, a real
// git daemon and a real token file: every call, the answers as data, the errors thrown, budgets.
import assert from "node:assert/strict";
import { existsSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, before, describe, it } from "node:test";
import { execFileSync } from "node:child_process";
import http from "node:http";
import {
  CheckoutCache, CheckoutCacheError, type Answer, type CloningAnswer, type ReadyAnswer,
} from "@checkoutcache/client";
import {
  DOCUMENT, PACKAGE_DIR, SHORT_BACKOFF, Serve, TOKEN, freePort, git, recordingFetch, tempDir, waitUntil, world, type World,
} from "./helpers/index.js";

let w: World;
let client: CheckoutCache;

before(async () => {
  w = await world("client");
  client = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN });
});
after(async () => {
  await w?.close();
});

async function thrown(promise: Promise<unknown>): Promise<CheckoutCacheError> {
  try {
    await promise;
  } catch (error) {
    assert.ok(error instanceof CheckoutCacheError, `not a CheckoutCacheError: ${String(error)}`);
    return error;
  }
  assert.fail("the call did not throw");
}

function readyPath(answer: Answer): string {
  assert.equal(answer.state, "ready", JSON.stringify(answer));
  return (answer as ReadyAnswer).path;
}

describe("checkouts", () => {
  it("answers ready with the checkout's path, which holds the commit's files", async () => {
    const sha = w.upstream.shas[0]!;
    const answer = await client.ensure({ repo: w.repo, commit: sha, wait: 60 });
    assert.equal(answer.state, "ready");
    if (answer.state !== "ready") return; // narrowed by the discriminant: path and commit are typed
    assert.equal(answer.commit, sha);
    assert.equal(answer.repo, w.repo);
    assert.match(readFileSync(join(answer.path, "README.md"), "utf8"), /version 0/);
    const again = await client.ensure({ repo: w.repo, commit: sha }); // wait 0: ready at once
    assert.equal(readyPath(again), answer.path);
  });

  it("answers cloning, then waitReady reports progress until ready", async () => {
    const sha = w.fresh();
    w.proxy.shut();
    const heldBefore = w.proxy.held;
    const first = await client.ensure({ repo: w.gatedRepo, commit: sha });
    assert.equal(first.state, "cloning", JSON.stringify(first));
    const progress: CloningAnswer[] = [];
    const waiting = client.waitReady({ repo: w.gatedRepo, commit: sha, wait: 120, every: 0.3, onProgress: (a) => progress.push(a) });
    await waitUntil(() => w.proxy.held > heldBefore && progress.length >= 2, 30_000, "the clone held in its fetch, and progress");
    w.proxy.open();
    const answer = await waiting;
    assert.equal(answer.state, "ready", JSON.stringify(answer));
    assert.ok(progress.length >= 2 && progress.every((a) => a.state === "cloning" && a.commit === sha), JSON.stringify(progress));
    assert.ok(existsSync(readyPath(answer)));
  });

  it("answers failed for a commit the repository does not have, with its retry_after", async () => {
    const missing = "0123456789abcdef0123456789abcdef01234567";
    const answer = await client.ensure({ repo: w.repo, commit: missing, wait: 60 });
    assert.equal(answer.state, "failed", JSON.stringify(answer));
    if (answer.state !== "failed") return;
    assert.equal(answer.error, "UNKNOWN_COMMIT");
    assert.ok(answer.message.includes(missing) && answer.next.length > 0);
    assert.ok(typeof answer.retry_after === "number" && answer.retry_after >= 1);
  });

  it("waitReady honours a failed answer's retry_after before asking again, and returns failed at its deadline", async () => {
    const missing = "1123456789abcdef0123456789abcdef01234567";
    const recorder = recordingFetch();
    const times: number[] = [];
    const spy = async (request: Request) => { times.push(Date.now()); return recorder.fetch(request); };
    const timed = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, fetch: spy });
    const answer = await timed.waitReady({ repo: w.repo, commit: missing, wait: 4, every: 1 });
    assert.equal(answer.state, "failed");
    assert.equal((answer as { error: string }).error, "UNKNOWN_COMMIT");
    assert.ok(times.length >= 2, `asked ${times.length} times`);
    const retryAfter = 1000 * ((answer as { retry_after?: number }).retry_after ?? 1);
    for (let i = 1; i < times.length; i++) assert.ok(times[i]! - times[i - 1]! >= retryAfter - 50, `asked again after ${times[i]! - times[i - 1]!} ms`);
    assert.ok(recorder.calls.every((c) => c.status === 503));
  });

  it("waitReady returns a failed answer rather than ask again with less than a second left (that ask could only start the retry)", async () => {
    // A server that answers failed (retry after 1 s) and then cloning: the retry it would start.
    const answers: string[] = [];
    const canned = async (request: Request) => {
      const body = JSON.parse(await request.text()) as { commit: string };
      const failed = answers.length === 0;
      answers.push(failed ? "failed" : "cloning");
      return Response.json(failed ? { state: "failed", error: "UNKNOWN_COMMIT", message: "not there", next: "retried later", retry_after: 1, commit: body.commit }
        : { state: "cloning", commit: body.commit, progress: {} }, { status: failed ? 503 : 202 });
    };
    const answer = await new CheckoutCache({ baseUrl: w.serve.baseUrl, fetch: canned })
      .waitReady({ repo: w.repo, commit: "4123456789abcdef0123456789abcdef01234567", wait: 1.5 });
    assert.equal(answer.state, "failed", JSON.stringify(answers));
    assert.deepEqual(answers, ["failed"]);
  });

  it("throws bad input as CheckoutCacheError with the code, next step and 400, and makes nothing", async () => {
    const bad = await thrown(client.ensure({ repo: w.repo, commit: "not-a-commit" }));
    assert.equal(bad.code, "BAD_COMMIT");
    assert.equal(bad.status, 400);
    assert.ok(bad.message.length > 0 && bad.next.length > 0);
    const transport = await thrown(client.ensure({ repo: "ftp://127.0.0.1/x", commit: w.upstream.shas[0]! }));
    assert.equal(transport.status, 400);
    assert.ok(["UNSAFE_TRANSPORT", "BAD_REPO"].includes(transport.code), transport.code);
    const wait = await thrown(client.ensure({ repo: w.repo, commit: w.upstream.shas[0]!, wait: "soon" }));
    assert.equal(wait.code, "BAD_ARGUMENT");
    const gc = await thrown(client.gc({ dry_run: "yes" as unknown as boolean }));
    assert.equal(gc.code, "BAD_ARGUMENT");
    const local = await thrown(client.ensure({ repo: w.upstream.path, commit: w.upstream.shas[0]! }));
    assert.equal(local.code, "FORBIDDEN_REPOSITORY"); // local paths need --allow-local
    assert.equal(local.status, 403);
    const status = await client.status();
    assert.ok(!JSON.stringify(status).includes("ftp://"), "a refused repository left nothing in the store");
  });

  it("sends history and base when given, and the answer names the merge base", async () => {
    const sha = w.upstream.shas[1]!;
    const base = w.upstream.shas[0]!;
    const recorder = recordingFetch();
    const watched = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, fetch: recorder.fetch });
    const answer = await watched.waitReady({ repo: w.repo, commit: sha, wait: 120, history: "full", base });
    const sent = JSON.parse(recorder.calls.at(-1)!.body!);
    assert.equal(sent.history, "full");
    assert.equal(sent.base, base);
    assert.equal(answer.state, "ready");
    assert.equal(answer.history, "complete");
    assert.equal(answer.merge_base, git(["merge-base", sha, base], w.upstream.path));
    const plain = await client.ensure({ repo: w.repo, commit: sha }); // not given: not sent
    assert.equal(plain.state, "ready");
    const recorder2 = recordingFetch();
    await new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, fetch: recorder2.fetch }).ensure({ repo: w.repo, commit: sha });
    assert.deepEqual(Object.keys(JSON.parse(recorder2.calls[0]!.body!)).sort(), ["commit", "repo"]);
  });

  it("keeps a field the document does not name (a newer server's) as the server sent it", async () => {
    const sha = w.upstream.shas[0]!;
    const coming = { position: 2, of: 3 };
    const recorder = recordingFetch((json) => json["state"] === "ready" ? { ...json, from_a_newer_server: coming } : json);
    // bearer: an answer rewritten on its way proves nothing, and a signed client refuses it (signed.test.ts)
    const watched = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, auth: "bearer", fetch: recorder.fetch });
    const answer = await watched.ensure({ repo: w.repo, commit: sha, wait: 60 });
    assert.equal(answer.state, "ready");
    assert.deepEqual(answer["from_a_newer_server"], coming);
  });
});

describe("tokens and the injected fetch", () => {
  it("throws UNAUTHORIZED (401) for a wrong token; public endpoints need none", async () => {
    const wrong = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: "not-the-token-at-all-000" });
    const calls = [() => wrong.ensure({ repo: w.repo, commit: w.upstream.shas[0]! }), () => wrong.status(), () => wrong.metrics(),
      () => wrong.hold({ repo: w.repo, commit: w.upstream.shas[0]! }), () => wrong.gc({ dry_run: true }), () => wrong.workspaces()];
    for (const call of calls) {
      const error = await thrown(call());
      assert.equal(error.code, "UNAUTHORIZED");
      assert.equal(error.status, 401);
    }
    const none = new CheckoutCache({ baseUrl: w.serve.baseUrl });
    assert.equal((await none.health()).ok, true);
    assert.equal((await none.ready()).ok, true);
    assert.equal((await thrown(none.status())).status, 401);
  });

  it("sends every request through the injected fetch: signed, the token never in it; bearer, only where it is needed", async () => {
    const every = ["POST /v1/ensure", "GET /v1/status", "GET /healthz", "GET /readyz", "GET /openapi.json", "GET /metrics"];
    const drive = async (auth: "signed" | "bearer" | undefined) => {
      const recorder = recordingFetch();
      let asked = 0;
      const watched = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: () => { asked++; return TOKEN; }, auth, fetch: recorder.fetch });
      await watched.ensure({ repo: w.repo, commit: w.upstream.shas[0]! });
      await watched.status();
      await watched.health();
      await watched.ready();
      await watched.openapi();
      await watched.metrics();
      assert.deepEqual(recorder.calls.map((c) => `${c.method} ${new URL(c.url).pathname}`), every);
      return { calls: recorder.calls, asked, client: watched };
    };
    const signed = await drive(undefined); // the default with a token
    assert.equal(signed.client.auth, "signed");
    assert.equal(signed.calls.length, every.length);
    for (const call of signed.calls) {
      assert.match(call.authorization ?? "", /^CheckoutCache-HMAC key=token-[0-9a-f]{12}, ts=\d+, nonce=[0-9a-f]{32}, body=[0-9a-f]{64}, mac=[0-9a-f]{64}$/);
      assert.ok(!JSON.stringify(call).includes(TOKEN), "the token is in no request");
    }
    assert.equal(signed.asked, every.length); // public endpoints are signed too: the token is asked at each request
    const bearer = await drive("bearer");
    assert.equal(bearer.client.auth, "bearer");
    const withToken = bearer.calls.filter((c) => c.authorization === `Bearer ${TOKEN}`).map((c) => new URL(c.url).pathname);
    assert.deepEqual(withToken, ["/v1/ensure", "/v1/status", "/metrics"]);
    assert.ok(bearer.calls.every((c) => c.authorization === null || c.authorization === `Bearer ${TOKEN}`));
    assert.equal(bearer.asked, 3); // asked at each request that needs it
    assert.equal(new CheckoutCache({ baseUrl: w.serve.baseUrl }).auth, undefined);
    assert.throws(() => new CheckoutCache({ baseUrl: w.serve.baseUrl, auth: "signed" }), /needs a token/);
    assert.throws(() => new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, auth: "hmac" as "signed" }), /auth must be/);
  });

  it("is refused by serve when a fetch adds an Origin header (FORBIDDEN_ORIGIN, 403)", async () => {
    const browserish = (request: Request) => {
      const headers = new Headers(request.headers);
      headers.set("Origin", "https://example.invalid");
      return fetch(new Request(request, { headers }));
    };
    const refused = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, auth: "bearer", fetch: browserish });
    const error = await thrown(refused.status());
    assert.equal(error.code, "FORBIDDEN_ORIGIN");
    assert.equal(error.status, 403);
    // serve reads a signature before it refuses an Origin, so that 403 carries its proof too.
    const signed = await thrown(new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, fetch: browserish }).status());
    assert.equal(signed.code, "FORBIDDEN_ORIGIN");
    assert.equal(signed.status, 403);
  });

  it("is refused by serve for a Host other than its listen address (FORBIDDEN_ORIGIN, 403, proved to a signed client)", async () => {
    // A transport that names another host (a DNS rebinding's): Node's fetch sets Host from the URL, so node:http.
    const otherHost = (request: Request) => request.arrayBuffer().then((body) => new Promise<Response>((done, fail) => {
      const url = new URL(request.url);
      const headers: Record<string, string> = {};
      request.headers.forEach((value, name) => { headers[name] = value; });
      const sent = http.request({ host: url.hostname, port: url.port, path: url.pathname + url.search, method: request.method,
        headers: { ...headers, host: `rebound.example:${url.port}` } }, (answer) => {
        const chunks: Buffer[] = [];
        answer.on("data", (chunk: Buffer) => chunks.push(chunk));
        answer.on("end", () => {
          const received = new Headers();
          for (const [name, value] of Object.entries(answer.headers)) if (typeof value === "string") received.set(name, value);
          done(new Response(Buffer.concat(chunks), { status: answer.statusCode ?? 0, headers: received }));
        });
      });
      sent.on("error", fail);
      sent.end(Buffer.from(body));
    }));
    for (const auth of ["signed", "bearer"] as const) {
      const refused = await thrown(new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, auth, fetch: otherHost }).status());
      assert.deepEqual([refused.code, refused.status], ["FORBIDDEN_ORIGIN", 403], auth);
      assert.match(refused.message, /rebound\.example/, auth); // serve's own words: proved, so used
    }
  });

  it("throws UNAVAILABLE when nothing listens, and for an answer that is not the API's", async () => {
    const port = await freePort();
    const nobody = new CheckoutCache({ baseUrl: `http://127.0.0.1:${port}`, token: TOKEN });
    const error = await thrown(nobody.ensure({ repo: w.repo, commit: w.upstream.shas[0]! }));
    assert.equal(error.code, "UNAVAILABLE");
    assert.equal(error.status, undefined);
    const proxyPage = async () => new Response("<html>502 Bad Gateway</html>", { status: 502, headers: { "content-type": "text/html" } });
    const behind = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, auth: "bearer", fetch: proxyPage });
    const page = await thrown(behind.ensure({ repo: w.repo, commit: w.upstream.shas[0]! }));
    assert.equal(page.code, "UNAVAILABLE");
    assert.equal(page.status, 502);
    const signedBehind = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, fetch: proxyPage });
    assert.equal((await thrown(signedBehind.ensure({ repo: w.repo, commit: w.upstream.shas[0]! }))).code, "NOT_THE_WRITER"); // unproven
    const notJson = async () => new Response("ok", { status: 200, headers: { "content-type": "text/plain" } });
    assert.equal((await thrown(new CheckoutCache({ baseUrl: w.serve.baseUrl, fetch: notJson }).status())).code, "UNAVAILABLE");
  });
});

describe("holds", () => {
  it("holds a checkout and releases it, once", async () => {
    const sha = w.upstream.shas[0]!;
    const held = await client.hold({ repo: w.repo, commit: sha, wait: 60, ttl: 600 });
    assert.equal(held.state, "ready");
    assert.equal(typeof held.hold, "string");
    assert.equal(held.expires_in, 600);
    assert.ok(existsSync(held.path));
    assert.equal(await w.serve.sample("checkoutcache_holds"), 1);
    assert.equal(await held.release(), true);
    assert.equal(await w.serve.sample("checkoutcache_holds"), 0);
    assert.equal(await held.release(), false); // already released by this object: nothing sent
    const again = await thrown(client.release(held.hold)); // the server no longer has it
    assert.equal(again.code, "UNKNOWN_HOLD");
    assert.equal(again.status, 404);
  });

  it("a hold not released within its ttl expires: release() then says UNKNOWN_HOLD", async () => {
    const held = await client.hold({ repo: w.repo, commit: w.upstream.shas[0]!, wait: 60, ttl: 1 });
    assert.equal(await w.serve.sample("checkoutcache_holds"), 1);
    await waitUntil(async () => (await w.serve.sample("checkoutcache_holds")) === 0, 30_000, "the hold to expire");
    const error = await thrown(held.release());
    assert.equal(error.code, "UNKNOWN_HOLD");
    assert.equal(await held.release(), false); // gone: not asked again
  });

  it("a hold whose call ended first (its budget) is released when serve's answer comes: nothing is left held", async () => {
    const sha = w.fresh();
    w.proxy.shut();
    const heldBefore = w.proxy.held;
    const recorder = recordingFetch();
    const afterwards: Array<Promise<unknown>> = [];
    const watched = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, fetch: recorder.fetch,
      waitUntil: (work) => { afterwards.push(work); } });
    const error = await thrown(watched.hold({ repo: w.gatedRepo, commit: sha, wait: 60, ttl: "1h", budget: 1 }));
    assert.equal(error.code, "TIMEOUT");
    await waitUntil(() => w.proxy.held > heldBefore, 30_000, "the hold's clone held in its fetch");
    assert.equal(afterwards.length, 0);
    w.proxy.open(); // serve finishes the hold that nobody waits for any more
    await waitUntil(() => recorder.calls.some((c) => c.url.endsWith("/v1/release") && c.status === 200), 60_000,
      "the hold serve made after the call ended to be released");
    assert.equal(recorder.calls.filter((c) => c.url.endsWith("/v1/hold")).length, 1);
    assert.equal(recorder.calls.find((c) => c.url.endsWith("/v1/hold"))?.status, 200, "serve did make the hold");
    assert.equal(afterwards.length, 1, "the release was given to waitUntil");
    assert.equal(await afterwards[0], undefined);
    assert.equal(await w.serve.sample("checkoutcache_holds"), 0);
  });

  it("throws NOT_HELD (with the cloning answer) and the failed answer's code when nothing could be held", async () => {
    const sha = w.fresh();
    w.proxy.shut();
    const cloning = await thrown(client.hold({ repo: w.gatedRepo, commit: sha, wait: 0.2 }));
    assert.equal(cloning.code, "NOT_HELD");
    assert.equal(cloning.status, 202);
    assert.equal(cloning.answer?.state, "cloning");
    w.proxy.open();
    const missing = await thrown(client.hold({ repo: w.repo, commit: "2123456789abcdef0123456789abcdef01234567", wait: 60 }));
    assert.equal(missing.code, "UNKNOWN_COMMIT");
    assert.equal(missing.status, 503);
    assert.equal(missing.answer?.state, "failed");
    assert.equal(await w.serve.sample("checkoutcache_holds"), 0);
    assert.equal((await client.waitReady({ repo: w.gatedRepo, commit: sha, wait: 120 })).state, "ready");
  });
});

describe("the server's TIMEOUT and the budget's", () => {
  it("a clone over serve's time limit is a failed answer of ensure, and thrown by hold with status 503 and the answer", async () => {
    const dir = tempDir("clone-timeout");
    const timed = await Serve.start(dir, { env: { ...SHORT_BACKOFF, CHECKOUTCACHE_BACKOFF: "30", CHECKOUTCACHE_CLONE_TIMEOUT: "1" } });
    try {
      const quick = new CheckoutCache({ baseUrl: timed.baseUrl, token: TOKEN });
      assert.equal((await quick.ensure({ repo: w.gatedRepo, commit: w.upstream.shas[0]!, wait: 60 })).state, "ready"); // first contact, gate open
      const sha = w.fresh();
      w.proxy.shut();
      const error = await thrown(quick.hold({ repo: w.gatedRepo, commit: sha, wait: 60 }));
      assert.deepEqual([error.code, error.status, error.answer?.state], ["TIMEOUT", 503, "failed"]);
      assert.ok(typeof error.retryAfter === "number" && error.retryAfter > 0);
      const answer = await quick.ensure({ repo: w.gatedRepo, commit: sha }); // within its back-off: the same failure, as data
      assert.equal(answer.state === "failed" && answer.error, "TIMEOUT", JSON.stringify(answer));
      // The budget's TIMEOUT has no status: nothing answered.
      const budget = await thrown(quick.hold({ repo: w.gatedRepo, commit: w.fresh(), wait: 60, budget: 0.3 }));
      assert.deepEqual([budget.code, budget.status, budget.answer], ["TIMEOUT", undefined, undefined]);
    } finally {
      w.proxy.open();
      assert.equal(await timed.stop(), 0);
    }
    rmSync(dir, { recursive: true, force: true });
  });
});

describe("budgets", () => {
  it("a call past its budget throws TIMEOUT at once and aborts its request", async () => {
    const sha = w.fresh();
    w.proxy.shut();
    const recorder = recordingFetch();
    const watched = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, fetch: recorder.fetch });
    const error = await thrown(watched.ensure({ repo: w.gatedRepo, commit: sha, wait: 300, budget: 1 }));
    assert.equal(error.code, "TIMEOUT");
    assert.equal(error.status, undefined);
    assert.equal(recorder.signals.length, 1);
    assert.equal(recorder.signals[0]!.aborted, true); // the request itself was ended, not left waiting
    const byTimeout = await thrown(watched.waitReady({ repo: w.gatedRepo, commit: sha, wait: 300, signal: AbortSignal.timeout(500) }));
    assert.equal(byTimeout.code, "TIMEOUT");
    const controller = new AbortController();
    const pending = watched.ensure({ repo: w.gatedRepo, commit: sha, wait: 300, signal: controller.signal });
    await waitUntil(() => recorder.calls.length >= 3, 10_000, "the request to be sent");
    controller.abort();
    assert.equal((await thrown(pending)).code, "ABORTED");
    w.proxy.open();
    assert.equal((await client.waitReady({ repo: w.gatedRepo, commit: sha, wait: 120 })).state, "ready");
  });

  it("a fetch that ignores its signal cannot make a call hang past the budget", async () => {
    let sent = 0;
    const deaf = (_request: Request) => { sent++; return new Promise<Response>(() => undefined); };
    const stuck = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, fetch: deaf, timeout: 0.3 });
    assert.equal((await thrown(stuck.status())).code, "TIMEOUT");
    assert.equal((await thrown(stuck.ensure({ repo: w.repo, commit: w.upstream.shas[0]!, wait: 0.2 }))).code, "TIMEOUT");
    assert.equal(sent, 2);
  });

  it("waitReady does nothing once it has ended: no request, no token asked, no progress, whatever the fetch does with its signal", async () => {
    const commit = "5123456789abcdef0123456789abcdef01234567";
    const cloning = { state: "cloning", repo: w.repo, commit, pid: 1, progress: {} };
    const failed = { state: "failed", error: "UNREACHABLE", message: "m", next: "n", retry_after: 5 };
    // Each case: a fetch (one that ignores its signal, or one that honours it as Node's does), when
    // the caller's signal aborts the call, and what the canned server answers.
    const cases = [
      { name: "aborted while a request that ignores its signal is in flight", abortAt: 200, honours: false, delay: 400, body: cloning, status: 202 },
      { name: "aborted during the pause between asks", abortAt: 300, honours: true, delay: 0, body: { ...cloning, retry_after: 3 }, status: 202 },
      { name: "aborted during a failed answer's retry_after", abortAt: 300, honours: false, delay: 1, body: failed, status: 503 },
    ];
    const lateByCase: Record<string, unknown> = {};
    for (const c of cases) {
      let cut = false;
      const late = { requests: 0, tokens: 0, progress: 0 };
      const canned = async (request: Request) => {
        if (cut) late.requests++;
        if (c.honours) request.signal.throwIfAborted();
        await new Promise((done) => setTimeout(done, c.delay));
        if (c.honours) request.signal.throwIfAborted();
        return Response.json(c.body, { status: c.status });
      };
      const cache = new CheckoutCache({ baseUrl: w.serve.baseUrl, auth: "bearer", fetch: canned,
        token: () => { if (cut) late.tokens++; return TOKEN; } });
      const controller = new AbortController();
      setTimeout(() => { cut = true; controller.abort(); }, c.abortAt);
      const error = await thrown(cache.waitReady({ repo: w.repo, commit, wait: 30, every: 0.2, signal: controller.signal,
        onProgress: () => { if (cut) late.progress++; } }));
      assert.equal(error.code, "ABORTED", c.name);
      await new Promise((done) => setTimeout(done, 1200));
      lateByCase[c.name] = late;
    }
    const none = { requests: 0, tokens: 0, progress: 0 };
    assert.deepEqual(lateByCase, Object.fromEntries(cases.map((c) => [c.name, none])));
  });

  it("a budget longer than a timer can hold is not a budget of nothing", async () => {
    const deaf = (_request: Request) => new Promise<Response>(() => undefined);
    const patient = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, fetch: deaf });
    const controller = new AbortController();
    const pending = patient.ensure({ repo: w.repo, commit: w.upstream.shas[0]!, wait: "5w", signal: controller.signal });
    setTimeout(() => controller.abort(), 200);
    assert.equal((await thrown(pending)).code, "ABORTED"); // not TIMEOUT at once (setTimeout past 2^31 ms fires at 1 ms)
  });

  it("the default budget is the wait plus the client's timeout", async () => {
    let seen: AbortSignal | undefined;
    const slowAnswer = async (request: Request) => { seen = request.signal; return new Promise<Response>(() => undefined); };
    const started = Date.now();
    const quick = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, fetch: slowAnswer, timeout: 0.2 });
    assert.equal((await thrown(quick.ensure({ repo: w.repo, commit: w.upstream.shas[0]!, wait: "500ms" }))).code, "TIMEOUT");
    assert.ok(Date.now() - started >= 650, "it waited the wait and the timeout, not less"); // a lower bound only
    assert.equal(seen?.aborted, true);
  });
});

describe("the store and the server", () => {
  it("status, workspaces, gc, health, ready, openapi and metrics answer as the document says", async () => {
    const status = await client.status();
    assert.ok(typeof status.root === "string" && Array.isArray(status.repos));
    assert.ok(JSON.stringify(status.repos).includes("project"), "our repository is listed");
    assert.equal(typeof status.totals["checkouts"], "number");
    const workspaces = await client.workspaces();
    assert.equal(typeof workspaces.dir, "string");
    assert.ok(Array.isArray(workspaces.workspaces));
    const gc = await client.gc({ dry_run: true, max_checkouts: 100 });
    assert.equal(gc.dry_run, true);
    assert.ok(Array.isArray(gc.removed) && typeof gc.bytes_freed === "number");
    const health = await client.health();
    assert.equal(health.ok, true);
    const ready = await client.ready();
    assert.equal(ready.ok, true);
    assert.equal(typeof ready.checks, "object");
    const document = await client.openapi();
    assert.deepEqual(document, JSON.parse(readFileSync(DOCUMENT, "utf8")));
    const metrics = await client.metrics();
    assert.match(metrics, /^checkoutcache_answers_total\{/m);
  });

  it("the types were generated from the very document this serve answers by", async () => {
    const served = join(w.dir, "served-openapi.json");
    writeFileSync(served, JSON.stringify(await client.openapi()));
    const out = join(w.dir, "served-openapi.ts");
    execFileSync(process.execPath, [join(PACKAGE_DIR, "scripts/generate.mjs"), "--from", served, "--out", out]);
    assert.equal(readFileSync(out, "utf8"), readFileSync(join(PACKAGE_DIR, "src/generated/openapi.ts"), "utf8"),
      "src/generated/openapi.ts is stale: run `npm run generate`");
  });
});
