// RepositoryBreaker's rules (src/breaker.ts), each driven by real calls of the built client against
// a real serve: an unavailable sidecar, a checkout that could not be started, missed waits, a
// success's reset, a call that succeeds after the breaker tripped, and a new breaker per turn.
import assert from "node:assert/strict";
import { after, before, describe, it } from "node:test";
import { mkdirSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { CheckoutCache, CheckoutCacheError, RepositoryBreaker, repositoryKey, type Answer } from "@checkoutcache/client";
import { SCOPED, TOKEN, Upstream, freePort, git, python, waitUntil, world, type World } from "./helpers/index.js";

const REVIEW = "tok-" + "d".repeat(28); // every scope, but only ensure and hold (the review's token of the shipped pod)

let w: World;
let client: CheckoutCache;
let nobody: CheckoutCache; // a sidecar that is not there: every call UNAVAILABLE

before(async () => {
  w = await world("breaker", { tokens: `${TOKEN}\n${SCOPED} team-a\n${REVIEW} * can=ensure,hold\n` });
  client = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: TOKEN });
  nobody = new CheckoutCache({ baseUrl: `http://127.0.0.1:${await freePort()}`, token: TOKEN });
  assert.equal((await client.ensure({ repo: w.repo, commit: w.upstream.shas[0]!, wait: 60 })).state, "ready");
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

/** run() refuses at once, without calling fn, with a next step to the read-only source tools. */
async function assertRefused(breaker: RepositoryBreaker, repo: string): Promise<CheckoutCacheError> {
  let called = 0;
  const error = await rejection(breaker.run(repo, async () => { called++; return client.ensure({ repo, commit: w.upstream.shas[0]! }); }));
  assert.equal(called, 0, "fn was not called");
  assert.equal(error.code, "REPOSITORY_DOWN");
  assert.match(error.next, /read-only source tools/);
  assert.equal(error.status, undefined);
  return error;
}

const missing = (n: number) => `${n}`.padStart(4, "0") + "456789abcdef0123456789abcdef01234567";

describe("a repository goes down", () => {
  it("when a call reports the sidecar unavailable", async () => {
    const breaker = new RepositoryBreaker();
    const error = await rejection(breaker.run(w.repo, () => nobody.ensure({ repo: w.repo, commit: w.upstream.shas[0]!, wait: 30 })));
    assert.equal(error.code, "UNAVAILABLE"); // the call's own error passes through
    assert.equal(breaker.isDown(w.repo), true);
    assert.equal(breaker.state(w.repo).reason, "UNAVAILABLE");
    const refused = await assertRefused(breaker, w.repo);
    assert.match(refused.message, /UNAVAILABLE/);
    // Only that repository: another one is asked as before.
    const other = w.gatedRepo; // the same project through the proxy: another host and port, another repository
    assert.equal((await breaker.run(other, () => client.ensure({ repo: other, commit: w.upstream.shas[0]!, wait: 60 }))).state, "ready");
    assert.equal(breaker.isDown(other), false);
  });

  it("for every spelling serve takes for that repository (the case of scheme and host, a trailing /, .git), and no other", async () => {
    const breaker = new RepositoryBreaker();
    const ask = (repo: string) => () => nobody.ensure({ repo, commit: w.upstream.shas[0]!, wait: 30 });
    await rejection(breaker.run("https://github.com/acme/app", ask("https://github.com/acme/app")));
    await rejection(breaker.run("git@github.com:acme/tools.git", ask("git@github.com:acme/tools.git")));
    const same = ["https://github.com/acme/app.git", "https://github.com/acme/app/", "https://GitHub.com/acme/app",
      "HTTPS://github.com:443/acme/app.git/", "https://user:secret@github.com/acme/app",
      "ssh://git@github.com/acme/tools", "git@GitHub.com:acme/tools/", "ssh://git@github.com:22/acme/tools.git", "git+ssh://git@github.com/acme/tools"];
    const others = ["https://github.com/acme/App", "https://github.com/acme/app2", "https://github.com:8443/acme/app",
      "https://github.com/acme/app.git.git", "ssh://git@github.com/acme/app", "git://github.com/acme/app",
      "https://github.com/acme/tools", "ssh://github.com/acme/tools", "ssh://other@github.com/acme/tools", "/srv/acme/app"];
    let called = 0;
    const refused: string[] = [];
    for (const spelling of same) {
      try {
        await breaker.run(spelling, async () => { called++; return "asked"; });
      } catch (error) {
        if (error instanceof CheckoutCacheError && error.code === "REPOSITORY_DOWN") refused.push(spelling);
      }
    }
    assert.deepEqual(refused, same, "refused at once");
    assert.equal(called, 0);
    assert.deepEqual(others.filter((spelling) => breaker.isDown(spelling)), [], "other repositories are not down");
    // Against serve's own reading (checkoutcache/repospec.py): two spellings are one key here only
    // where they are one repository there, and every spelling above that is one key is.
    const edges = ["HTTPS://GITHUB.COM/ACME/APP", "https://github.com/acme/%61pp", "https://github.com:0443/acme/app",
      "https://github.com:/acme/app", "ssh://git:pw@github.com/acme/tools", "git://user@github.com/acme/app",
      "git://github.com:9418/acme/app.git", "https://[::1]/r", "https://[::1]:443/r.git/", "git@[::1]:r", "/srv/acme/app/",
      "/srv/acme/app/.git", "file:///srv/acme/app", "ssh+git://git@github.com/acme/tools/.git"];
    const spellings = ["https://github.com/acme/app", "git@github.com:acme/tools.git", ...same, ...others, ...edges];
    const served = python("import json, sys\nfrom checkoutcache.repospec import parse_repo\n"
      + "json.dump([parse_repo(r).key for r in json.load(sys.stdin)], sys.stdout)", spellings) as string[];
    const merged: string[] = [];
    spellings.forEach((a, i) => spellings.forEach((b, j) => {
      if (i < j && repositoryKey(a) === repositoryKey(b)) {
        merged.push(`${a} = ${b}`);
        assert.equal(served[i], served[j], `one key here, two repositories to serve: ${a} and ${b}`);
      }
    }));
    assert.ok(merged.length >= same.length, merged.join("\n"));
  });

  it("when a call runs past its budget (the sidecar did not answer)", async () => {
    const breaker = new RepositoryBreaker();
    const sha = w.fresh();
    w.proxy.shut();
    const error = await rejection(breaker.run(w.gatedRepo, () => client.ensure({ repo: w.gatedRepo, commit: sha, wait: 300, budget: 0.5 })));
    assert.equal(error.code, "TIMEOUT");
    await assertRefused(breaker, w.gatedRepo);
    w.proxy.open();
    assert.equal((await client.waitReady({ repo: w.gatedRepo, commit: sha, wait: 120 })).state, "ready");
  });

  it("when its checkout could not be started: a failed answer, returned as it came", async () => {
    const breaker = new RepositoryBreaker();
    const answer = await breaker.run(w.repo, () => client.ensure({ repo: w.repo, commit: missing(1), wait: 60 }));
    assert.equal(answer.state, "failed");
    assert.equal((answer as { error: string }).error, "UNKNOWN_COMMIT");
    assert.equal(breaker.state(w.repo).reason, "UNKNOWN_COMMIT");
    await assertRefused(breaker, w.repo);
  });

  it("when a hold's checkout could not be started, or the repository is refused", async () => {
    const held = new RepositoryBreaker();
    await rejection(held.run(w.repo, () => client.hold({ repo: w.repo, commit: missing(2), wait: 60 })));
    assert.equal(held.state(w.repo).reason, "UNKNOWN_COMMIT");
    await assertRefused(held, w.repo);
    const refused = new RepositoryBreaker();
    const local = w.upstream.path; // serve runs without --allow-local: FORBIDDEN_REPOSITORY (403)
    assert.equal((await rejection(refused.run(local, () => client.ensure({ repo: local, commit: w.upstream.shas[0]! })))).status, 403);
    await assertRefused(refused, local);
    const unauthorized = new RepositoryBreaker();
    const wrong = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: "not-the-token-at-all-000" });
    assert.equal((await rejection(unauthorized.run(w.repo, () => wrong.ensure({ repo: w.repo, commit: w.upstream.shas[0]! })))).status, 401);
    assert.equal(unauthorized.isDown(w.repo), true);
  });

  it("after two missed waits (the checkout still cloning when each wait ended)", async () => {
    const breaker = new RepositoryBreaker();
    const sha = w.fresh();
    w.proxy.shut();
    const miss = () => breaker.run(w.gatedRepo, () => client.ensure({ repo: w.gatedRepo, commit: sha, wait: 0.2 }));
    assert.equal((await miss()).state, "cloning");
    assert.deepEqual(breaker.state(w.gatedRepo), { down: false, missed: 1, reason: undefined, detail: undefined });
    assert.equal((await miss()).state, "cloning");
    assert.equal(breaker.isDown(w.gatedRepo), true);
    assert.equal(breaker.state(w.gatedRepo).reason, "MISSED_WAITS");
    await assertRefused(breaker, w.gatedRepo);
    // A hold that ends still cloning (NOT_HELD) is a missed wait too.
    const holds = new RepositoryBreaker();
    for (let n = 0; n < 2; n++) assert.equal((await rejection(holds.run(w.gatedRepo, () => client.hold({ repo: w.gatedRepo, commit: sha, wait: 0.2 })))).code, "NOT_HELD");
    assert.equal(holds.state(w.gatedRepo).reason, "MISSED_WAITS");
    w.proxy.open();
    assert.equal((await client.waitReady({ repo: w.gatedRepo, commit: sha, wait: 120 })).state, "ready");
  });
});

describe("what does not put it down, and what never brings it back", () => {
  it("a success resets the count of missed waits", async () => {
    const breaker = new RepositoryBreaker();
    const sha = w.fresh();
    w.proxy.shut();
    const miss = () => breaker.run(w.gatedRepo, () => client.ensure({ repo: w.gatedRepo, commit: sha, wait: 0.2 }));
    assert.equal((await miss()).state, "cloning");
    assert.equal((await breaker.run(w.gatedRepo, () => client.ensure({ repo: w.gatedRepo, commit: w.upstream.shas[0]! }))).state, "ready");
    assert.equal(breaker.state(w.gatedRepo).missed, 0);
    assert.equal((await miss()).state, "cloning");
    assert.deepEqual(breaker.state(w.gatedRepo), { down: false, missed: 1, reason: undefined, detail: undefined });
    w.proxy.open();
    assert.equal((await breaker.run(w.gatedRepo, () => client.waitReady({ repo: w.gatedRepo, commit: sha, wait: 120 }))).state, "ready");
    assert.equal(breaker.isDown(w.gatedRepo), false);
  });

  it("a call that started before the breaker tripped and succeeded after does not reset it", async () => {
    const breaker = new RepositoryBreaker();
    const sha = w.fresh();
    w.proxy.shut();
    const heldBefore = w.proxy.held;
    let progressed = 0;
    const early = breaker.run(w.gatedRepo, () => client.waitReady({ repo: w.gatedRepo, commit: sha, wait: 120, every: 0.2,
      onProgress: () => { progressed++; } }));
    await waitUntil(() => w.proxy.held > heldBefore && progressed > 0, 30_000, "the early call to be waiting on its clone");
    await rejection(breaker.run(w.gatedRepo, () => nobody.status())); // the sidecar unavailable: down
    assert.equal(breaker.isDown(w.gatedRepo), true);
    w.proxy.open();
    const answer: Answer = await early;
    assert.equal(answer.state, "ready"); // its own result is passed on...
    assert.equal(breaker.isDown(w.gatedRepo), true); // ...but down stays down for the turn
    await assertRefused(breaker, w.gatedRepo);
  });

  it("a miss while a success was in flight is not reset by it", async () => {
    const breaker = new RepositoryBreaker();
    const sha = w.fresh();
    let finish: (answer: Answer) => void = () => undefined;
    const inFlight = breaker.run(w.gatedRepo, () => new Promise<Answer>((done) => { finish = done; }));
    w.proxy.shut();
    assert.equal((await breaker.run(w.gatedRepo, () => client.ensure({ repo: w.gatedRepo, commit: sha, wait: 0.2 }))).state, "cloning");
    finish(await client.ensure({ repo: w.gatedRepo, commit: w.upstream.shas[0]! }));
    assert.equal((await inFlight).state, "ready");
    assert.equal(breaker.state(w.gatedRepo).missed, 1); // the success started before the miss
    assert.equal((await breaker.run(w.gatedRepo, () => client.ensure({ repo: w.gatedRepo, commit: sha, wait: 0.2 }))).state, "cloning");
    assert.equal(breaker.isDown(w.gatedRepo), true);
    w.proxy.open();
    assert.equal((await client.waitReady({ repo: w.gatedRepo, commit: sha, wait: 120 })).state, "ready");
  });

  it("a failed answer about the call's own arguments, or one that leaves the checkout usable, counts for nothing", async () => {
    // Two histories with no common commit: a base on the other one has no merge base (NO_MERGE_BASE).
    const two = new Upstream(join(w.daemon.base, "two-roots"));
    const main = two.commit({ "a.txt": "main\n" }, "main");
    git(["checkout", "-q", "--orphan", "unrelated"], two.path);
    const unrelated = two.commit({ "b.txt": "unrelated\n" }, "unrelated");
    const twoRoots = w.daemon.url("two-roots");
    // A server that sends a commit without its parent (info/grafts, as tests/test_partial_history.py):
    // the shallow first answer is ready, the whole history cannot come (HISTORY_FAILED).
    const work = new Upstream(join(w.dir, "lying-work"));
    const parent = work.commit({ "p.txt": "parent\n" }, "P");
    const child = work.commit({ "c.txt": "child\n" }, "C");
    git(["checkout", "-q", "-b", "other", parent], work.path);
    const sibling = work.commit({ "d.txt": "sibling\n" }, "D");
    const served = join(w.daemon.base, "lying.git");
    git(["clone", "-q", "--bare", work.path, served]);
    mkdirSync(join(served, "info"), { recursive: true });
    writeFileSync(join(served, "info", "grafts"), `${child}\n${sibling}\n`);
    const lying = w.daemon.url("lying.git");
    assert.equal((await client.ensure({ repo: lying, commit: child, wait: 60 })).state, "ready");

    const breaker = new RepositoryBreaker();
    const noBase = await breaker.run(twoRoots, () => client.ensure({ repo: twoRoots, commit: main, base: unrelated, history: "full", wait: 60 }));
    assert.equal(noBase.state === "failed" && noBase.error, "NO_MERGE_BASE", JSON.stringify(noBase));
    const noHistory = await breaker.run(lying, () => client.ensure({ repo: lying, commit: child, history: "full", wait: 60 }));
    assert.equal(noHistory.state === "failed" && noHistory.error, "HISTORY_FAILED", JSON.stringify(noHistory));
    const up = { down: false, missed: 0, reason: undefined, detail: undefined };
    assert.deepEqual([breaker.state(twoRoots), breaker.state(lying)], [up, up]);
    // The checkouts are there all along: asked without the argument, each is ready through the same breaker.
    assert.equal((await breaker.run(twoRoots, () => client.ensure({ repo: twoRoots, commit: main }))).state, "ready");
    const usable = await breaker.run(lying, () => client.ensure({ repo: lying, commit: child }));
    assert.deepEqual([usable.state, usable.history], ["ready", "shallow"]);
  });

  it("a 403 for the call's scope or endpoint counts for nothing; one for the repository puts it down", async () => {
    const breaker = new RepositoryBreaker();
    const scoped = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: SCOPED }); // team-a only
    const scope = await rejection(breaker.run(w.repo, () => scoped.ensure({ repo: w.repo, commit: w.upstream.shas[0]!, scope: "team-b" })));
    assert.deepEqual([scope.code, scope.status], ["FORBIDDEN_SCOPE", 403]);
    const review = new CheckoutCache({ baseUrl: w.serve.baseUrl, token: REVIEW }); // can=ensure,hold
    const endpoint = await rejection(breaker.run(w.repo, () => review.gc({ dry_run: true })));
    assert.deepEqual([endpoint.code, endpoint.status], ["FORBIDDEN_ENDPOINT", 403]);
    assert.deepEqual(breaker.state(w.repo), { down: false, missed: 0, reason: undefined, detail: undefined });
    assert.equal((await breaker.run(w.repo, () => review.ensure({ repo: w.repo, commit: w.upstream.shas[0]! }))).state, "ready");
    const local = w.upstream.path; // serve runs without --allow-local
    const refused = await rejection(breaker.run(local, () => review.ensure({ repo: local, commit: w.upstream.shas[0]! })));
    assert.deepEqual([refused.code, refused.status], ["FORBIDDEN_REPOSITORY", 403]);
    await assertRefused(breaker, local);
  });

  it("the caller's own errors count for nothing and pass through", async () => {
    const breaker = new RepositoryBreaker();
    const bad = await rejection(breaker.run(w.repo, () => client.ensure({ repo: w.repo, commit: "not-a-commit" })));
    assert.equal(bad.code, "BAD_COMMIT");
    const aborted = new AbortController();
    aborted.abort();
    assert.equal((await rejection(breaker.run(w.repo, () => client.status({ signal: aborted.signal })))).code, "ABORTED");
    await assert.rejects(breaker.run(w.repo, async () => { throw new RangeError("the tool's own bug"); }), RangeError);
    assert.deepEqual(breaker.state(w.repo), { down: false, missed: 0, reason: undefined, detail: undefined });
    assert.equal((await breaker.run(w.repo, () => client.ensure({ repo: w.repo, commit: w.upstream.shas[0]! }))).state, "ready");
  });

  it("a new breaker is a new turn", async () => {
    const turn1 = new RepositoryBreaker();
    await rejection(turn1.run(w.repo, () => nobody.status()));
    await assertRefused(turn1, w.repo);
    const turn2 = new RepositoryBreaker();
    assert.equal(turn2.isDown(w.repo), false);
    assert.equal((await turn2.run(w.repo, () => client.ensure({ repo: w.repo, commit: w.upstream.shas[0]! }))).state, "ready");
    await assertRefused(turn1, w.repo); // the old turn's breaker is unchanged
  });

  it("takes the executor's own next step and number of misses", async () => {
    const breaker = new RepositoryBreaker({ missedWaits: 1, next: (repo) => `read ${repo} with the read-only source tools: read_file, grep` });
    const sha = w.fresh();
    w.proxy.shut();
    assert.equal((await breaker.run(w.gatedRepo, () => client.ensure({ repo: w.gatedRepo, commit: sha, wait: 0.2 }))).state, "cloning");
    const refused = await assertRefused(breaker, w.gatedRepo);
    assert.match(refused.next, /read_file, grep/);
    w.proxy.open();
    assert.equal((await client.waitReady({ repo: w.gatedRepo, commit: sha, wait: 120 })).state, "ready");
  });
});
