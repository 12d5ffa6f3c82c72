// Tokens from a real token file: a rotation (the file rewritten; serve rereads it within a second)
// reaches a client whose token is a function at its next request; a token limited to a scope gets
// 403 where it may not go; the hold limits answer 429.
import assert from "node:assert/strict";
import { readFileSync } from "node:fs";
import { after, before, it } from "node:test";
import { CheckoutCache, CheckoutCacheError } from "@checkoutcache/client";
import { SCOPED, TOKEN, waitUntil, world, type World } from "./helpers/index.js";

const NEW_TOKEN = "tok-" + "c".repeat(28);
let w: World;

before(async () => {
  w = await world("tokens", { args: ["--token-overlap", "0.5s", "--max-holds-per-token", "1"] });
});
after(async () => {
  await w?.close();
});

async function rejection(promise: Promise<unknown>): Promise<CheckoutCacheError> {
  try {
    await promise;
  } catch (error) {
    assert.ok(error instanceof CheckoutCacheError, String(error));
    return error;
  }
  assert.fail("the call did not throw");
}

it("a token function is asked at each request, so a rotated token is used at once", async () => {
  let asked = 0;
  const firstToken = () => {
    asked++;
    return readFileSync(w.serve.tokenFile, "utf8").split("\n")[0]!.split(" ")[0]!; // the mounted Secret, read each time
  };
  const rotating = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: firstToken });
  const fixed = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN });
  assert.ok(Array.isArray((await rotating.status()).repos));
  w.serve.rotate(`${NEW_TOKEN}\n${SCOPED} team-a\n`);
  // Once serve has reread the file and the old token's overlap has passed, the old token is refused...
  await waitUntil(async () => (await w.serve.request("GET", "/v1/status", undefined, TOKEN)).status === 401, 30_000,
    "the old token to be refused");
  assert.equal((await rejection(fixed.status())).code, "UNAUTHORIZED");
  // ...and the same client, unchanged, goes on with the new one.
  const before = asked;
  assert.ok(Array.isArray((await rotating.status()).repos));
  assert.equal((await rotating.ensure({ repo: w.repo, commit: w.upstream.shas[0]!, wait: 60 })).state, "ready");
  assert.equal(asked, before + 2);
  const asyncToken = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: async () => NEW_TOKEN });
  assert.equal((await asyncToken.health()).ok, true);
  assert.ok(Array.isArray((await asyncToken.workspaces()).workspaces));
});

it("a token limited to a scope gets 403 for gc and for another scope's checkouts", async () => {
  const scoped = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: SCOPED });
  const gc = await rejection(scoped.gc({ dry_run: true }));
  assert.equal(gc.status, 403);
  assert.equal(gc.code, "FORBIDDEN_SCOPE");
  const other = await rejection(scoped.ensure({ repo: w.repo, commit: w.upstream.shas[0]! })); // scope "default"
  assert.equal(other.status, 403);
  assert.equal(other.code, "FORBIDDEN_SCOPE");
  assert.equal((await scoped.ensure({ repo: w.repo, commit: w.upstream.shas[0]!, scope: "team-a", wait: 60 })).state, "ready");
  const status = await scoped.status();
  assert.ok(status.repos.every((repo) => repo["scope"] === "team-a"), JSON.stringify(status.repos));
  assert.ok(status.repos.length >= 1);
});

it("a hold past the per-token limit is TOO_MANY_HOLDS (429) with Retry-After", async () => {
  const holder = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: SCOPED });
  const held = await holder.hold({ repo: w.repo, commit: w.upstream.shas[0]!, scope: "team-a", wait: 60 });
  const refused = await rejection(holder.hold({ repo: w.repo, commit: w.upstream.shas[1]!, scope: "team-a", wait: 60 }));
  assert.equal(refused.code, "TOO_MANY_HOLDS");
  assert.equal(refused.status, 429);
  assert.equal(refused.retryAfter, 5);
  assert.equal(await held.release(), true);
  const next = await holder.hold({ repo: w.repo, commit: w.upstream.shas[1]!, scope: "team-a", wait: 60 });
  assert.equal(await next.release(), true);
});
