// A Worker that drives the built package (dist/, loaded as modules of this worker) against a real
// serve, reached only through a service binding (env.SIDECAR: an external service to serve's
// port, as a Worker reaches its container through container.getTcpPort(8787)), with the auth the
// test names (signed by default, on workerd's WebCrypto; or bearer). env.SQUATTER reaches a
// process that is not serve. It answers what each call gave; test/workerd.test.ts asserts on it.
import { CheckoutCache, CheckoutCacheError, RepositoryBreaker } from "./index.js";

async function outcome(promise) {
  try {
    const value = await promise;
    return { value };
  } catch (error) {
    if (error instanceof CheckoutCacheError) {
      return { error: { code: error.code, status: error.status ?? null, next: error.next, message: error.message,
        retryAfter: error.retryAfter ?? null, answerState: error.answer?.state ?? null } };
    }
    return { error: { code: "NOT_A_CHECKOUTCACHE_ERROR", message: String(error) } };
  }
}

async function calls(env, config) {
  const { baseUrl, token, auth, repo, sha, missing } = config;
  const sent = []; // the Authorization of each request the first client sent
  // The three forms of an injected fetch: an arrow, a bound method, the Fetcher itself.
  const client = new CheckoutCache({ baseUrl, token, auth, fetch: (request) => {
    sent.push(request.headers.get("authorization"));
    return env.SIDECAR.fetch(request);
  } });
  const bound = new CheckoutCache({ baseUrl, token, auth, fetch: env.SIDECAR.fetch.bind(env.SIDECAR) });
  const fetcher = new CheckoutCache({ baseUrl, token: async () => token, auth, fetch: env.SIDECAR });
  const out = { auth: client.auth };
  out.ready = await outcome(client.ensure({ repo, commit: sha, wait: 60 }));
  out.readyAgain = await outcome(bound.ensure({ repo, commit: sha }));
  out.fetcherForm = await outcome(fetcher.status());
  out.failed = await outcome(client.ensure({ repo, commit: missing, wait: 60 }));
  out.badInput = await outcome(client.ensure({ repo, commit: "not-a-commit" }));
  out.wrongToken = await outcome(new CheckoutCache({ baseUrl, token: "not-the-token-at-all-000", auth, fetch: env.SIDECAR }).status());
  const held = await client.hold({ repo, commit: sha, wait: 60, ttl: 600 });
  out.hold = { hold: held.hold, path: held.path, expires_in: held.expires_in, state: held.state };
  out.release = await outcome(held.release());
  out.releaseAgain = await outcome(held.release());
  out.releaseUnknown = await outcome(client.release(held.hold));
  out.status = await outcome(client.status());
  out.workspaces = await outcome(client.workspaces());
  out.gc = await outcome(client.gc({ dry_run: true }));
  out.health = await outcome(client.health());
  out.readyz = await outcome(client.ready());
  out.openapi = await outcome(client.openapi().then((doc) => ({ openapi: doc.openapi, paths: Object.keys(doc.paths) })));
  out.metrics = await outcome(client.metrics().then((text) => text.split("\n").filter((l) => l.startsWith("checkoutcache_holds ")).join("")));
  out.sent = { count: sent.length, schemes: [...new Set(sent.map((a) => a?.split(" ")[0] ?? null))],
    tokenSent: sent.some((a) => a?.includes(token)) };
  // An answer stripped of its proof on the way, and a process that is not serve answering ready.
  const stripping = new CheckoutCache({ baseUrl, token, auth, fetch: async (request) => {
    const response = await env.SIDECAR.fetch(request);
    const headers = new Headers(response.headers);
    headers.delete("x-checkoutcache-proof");
    return new Response(response.body, { status: response.status, headers });
  } });
  out.stripped = await outcome(stripping.ensure({ repo, commit: sha }));
  out.squatter = await outcome(new CheckoutCache({ baseUrl, token, auth, fetch: env.SQUATTER }).ensure({ repo, commit: sha }));
  // Budgets: a fetch that never answers, and the caller's abort.
  const deaf = new CheckoutCache({ baseUrl, token, auth, fetch: () => new Promise(() => undefined), timeout: 0.3 });
  out.timeout = await outcome(deaf.status());
  const controller = new AbortController();
  const pending = new CheckoutCache({ baseUrl, token, auth, fetch: () => new Promise(() => undefined) }).status({ signal: controller.signal });
  controller.abort();
  out.aborted = await outcome(pending);
  // Nothing listening behind the binding: UNAVAILABLE (workerd says "Network connection lost", not a TypeError).
  const nobody = new CheckoutCache({ baseUrl, token, auth, fetch: env.DEAD });
  out.unavailable = await outcome(nobody.health());
  // A Fetcher's fetch taken off its object has lost its `this`: the runtime refuses the call.
  out.unbound = await outcome(new CheckoutCache({ baseUrl, token, auth, fetch: env.SIDECAR.fetch }).health());
  // The breaker in a tool executor: down at the first unavailable call, refused at once after.
  const breaker = new RepositoryBreaker();
  let called = 0;
  out.breakerFirst = await outcome(breaker.run(repo, () => { called++; return nobody.ensure({ repo, commit: sha, wait: 30 }); }));
  out.breakerRefused = await outcome(breaker.run(repo, () => { called++; return client.ensure({ repo, commit: sha }); }));
  out.breakerCalled = called;
  const failedTurn = new RepositoryBreaker();
  out.breakerFailed = await outcome(failedTurn.run(repo, () => client.ensure({ repo, commit: missing, wait: 60 })));
  out.breakerFailedDown = failedTurn.state(repo);
  const nextTurn = new RepositoryBreaker();
  out.nextTurn = await outcome(nextTurn.run(repo, () => client.ensure({ repo, commit: sha })));
  return out;
}

async function waitForIt(env, config) {
  const { baseUrl, token, auth, repo, sha } = config;
  const client = new CheckoutCache({ baseUrl, token, auth, fetch: env.SIDECAR });
  const progress = [];
  const first = await outcome(client.ensure({ repo, commit: sha }));
  const answer = await outcome(client.waitReady({ repo, commit: sha, wait: 120, every: 0.3, onProgress: (a) => progress.push(a.state) }));
  return { first, answer, progress };
}

export default {
  async fetch(request, env) {
    const url = new URL(request.url);
    const config = await request.json();
    try {
      if (url.pathname === "/calls") return Response.json(await calls(env, config));
      if (url.pathname === "/wait") return Response.json(await waitForIt(env, config));
      return new Response("no such scenario", { status: 404 });
    } catch (error) {
      return Response.json({ crashed: String(error), stack: error?.stack ?? null }, { status: 500 });
    }
  },
};
