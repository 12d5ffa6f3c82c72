// SERVER_BUSY: serve with --max-waiting 1 and one request parked on a clone held in its fetch;
// a queued clone: --max-clones 1, a second commit while the first clone is held.
import assert from "node:assert/strict";
import { after, before, it } from "node:test";
import { CheckoutCache, CheckoutCacheError, RepositoryBreaker, type CloningAnswer } from "@checkoutcache/client";
import { TOKEN, recordingFetch, waitUntil, world, type World } from "./helpers/index.js";

let w: World;
let client: CheckoutCache;

before(async () => {
  w = await world("busy", { args: ["--max-waiting", "1", "--max-clones", "1"] });
  client = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN });
});
after(async () => {
  await w?.close();
});

it("throws SERVER_BUSY (503, Retry-After) past --max-waiting; waitReady then polls and gets the checkout", async () => {
  const sha = w.fresh();
  w.proxy.shut();
  const heldBefore = w.proxy.held;
  const parked = client.ensure({ repo: w.gatedRepo, commit: sha, wait: 120 });
  await waitUntil(async () => w.proxy.held > heldBefore && (await w.serve.sample("checkoutcache_requests_waiting")) === 1,
    30_000, "one request waiting on the clone");

  let busy: CheckoutCacheError | undefined;
  try {
    await client.ensure({ repo: w.gatedRepo, commit: sha, wait: 30 });
  } catch (error) {
    busy = error as CheckoutCacheError;
  }
  assert.ok(busy instanceof CheckoutCacheError, String(busy));
  assert.equal(busy.code, "SERVER_BUSY");
  assert.equal(busy.status, 503);
  assert.equal(busy.retryAfter, 1);
  assert.ok(busy.next.length > 0);
  // Without a wait it is answered (no waiting slot taken): cloning.
  assert.equal((await client.ensure({ repo: w.gatedRepo, commit: sha })).state, "cloning");

  // waitReady meets SERVER_BUSY, honours Retry-After, then asks without waiting on the server.
  const recorder = recordingFetch();
  const polling = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN, fetch: recorder.fetch });
  const progress: CloningAnswer[] = [];
  const waiting = polling.waitReady({ repo: w.gatedRepo, commit: sha, wait: 120, every: 5, onProgress: (a) => progress.push(a) });
  await waitUntil(() => progress.length >= 1, 30_000, "waitReady's first progress after SERVER_BUSY");
  const statuses = recorder.calls.map((c) => c.status);
  assert.equal(statuses[0], 503, JSON.stringify(statuses));
  assert.ok(statuses.includes(202));
  const asked = recorder.calls.map((c) => JSON.parse(c.body!).wait);
  assert.equal(asked[0], 5);
  assert.ok(asked.slice(1).every((wait) => wait === 0), JSON.stringify(asked));

  // A breaker takes SERVER_BUSY for the sidecar unavailable.
  const breaker = new RepositoryBreaker();
  await assert.rejects(breaker.run(w.gatedRepo, () => client.ensure({ repo: w.gatedRepo, commit: sha, wait: 30 })),
    (error: unknown) => error instanceof CheckoutCacheError && error.code === "SERVER_BUSY");
  assert.equal(breaker.state(w.gatedRepo).reason, "SERVER_BUSY");

  w.proxy.open();
  assert.equal((await parked).state, "ready");
  assert.equal((await waiting).state, "ready");
});

it("types a queued clone's place: progress.phase queued and queue (position, bounds)", async () => {
  const first = w.fresh();
  const second = w.fresh();
  w.proxy.shut();
  const heldBefore = w.proxy.held;
  assert.equal((await client.ensure({ repo: w.gatedRepo, commit: first })).state, "cloning");
  await waitUntil(() => w.proxy.held > heldBefore, 30_000, "the first clone held in its fetch");
  const queued = await client.ensure({ repo: w.gatedRepo, commit: second });
  assert.equal(queued.state, "cloning", JSON.stringify(queued));
  if (queued.state !== "cloning") return;
  assert.equal(queued.progress?.phase, "queued");
  assert.equal(queued.queue?.position, 1);
  assert.equal(queued.queue?.max_clones, 1);
  assert.equal(typeof queued.queue?.max_clones_per_token, "number");
  w.proxy.open();
  for (const commit of [first, second]) {
    assert.equal((await client.waitReady({ repo: w.gatedRepo, commit, wait: 120 })).state, "ready");
  }
});
