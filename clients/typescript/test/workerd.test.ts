// The client in the Workers runtime itself: workerd (the `workerd` package ships its binary) runs
// test/workerd/worker.js with the built dist/ as its modules, and reaches the real serve only
// through a service binding, as a Worker reaches its container's port: signed (workerd's
// WebCrypto), and with auth "bearer".
import assert from "node:assert/strict";
import { spawn, type ChildProcess } from "node:child_process";
import { copyFileSync, mkdirSync, readdirSync, readFileSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { fileURLToPath } from "node:url";
import { after, before, it } from "node:test";
import { PACKAGE_DIR, Squatter, TOKEN, freePort, track, waitUntil, world, type World } from "./helpers/index.js";

let w: World;
let squatter: Squatter;
let workerd: ChildProcess;
let workerUrl: string;
let log = "";

/** The worker's modules: its script, every file of dist/ under its own name, openapi-fetch under its package name. */
function lay(dir: string): string[] {
  const modules: string[] = [];
  copyFileSync(join(PACKAGE_DIR, "test/workerd/worker.js"), join(dir, "worker.js"));
  modules.push(`(name = "worker.js", esModule = embed "worker.js")`);
  const walk = (from: string, prefix: string) => {
    for (const entry of readdirSync(from, { withFileTypes: true })) {
      if (entry.isDirectory()) {
        mkdirSync(join(dir, prefix, entry.name), { recursive: true });
        walk(join(from, entry.name), `${prefix}${entry.name}/`);
      } else if (entry.name.endsWith(".js")) {
        copyFileSync(join(from, entry.name), join(dir, prefix, entry.name));
        modules.push(`(name = "${prefix}${entry.name}", esModule = embed "${prefix}${entry.name}")`);
      }
    }
  };
  walk(join(PACKAGE_DIR, "dist"), "");
  copyFileSync(fileURLToPath(import.meta.resolve("openapi-fetch")), join(dir, "openapi-fetch.mjs"));
  modules.push(`(name = "openapi-fetch", esModule = embed "openapi-fetch.mjs")`);
  return modules;
}

before(async () => {
  w = await world("workerd");
  const dir = join(w.dir, "worker");
  mkdirSync(dir);
  const modules = lay(dir);
  const port = await freePort();
  const dead = await freePort();
  squatter = await Squatter.start(0, "/tmp/the-squatters-tree");
  writeFileSync(join(dir, "config.capnp"), `using Workerd = import "/workerd/workerd.capnp";
const config :Workerd.Config = (
  services = [
    (name = "main", worker = .worker),
    (name = "sidecar", external = (address = "127.0.0.1:${w.serve.port}", http = ())),
    (name = "dead", external = (address = "127.0.0.1:${dead}", http = ())),
    (name = "squatter", external = (address = "127.0.0.1:${squatter.port}", http = ())),
  ],
  sockets = [ (name = "http", address = "127.0.0.1:${port}", http = (), service = "main") ],
);
const worker :Workerd.Worker = (
  modules = [
    ${modules.join(",\n    ")},
  ],
  compatibilityDate = "2024-09-23",
  bindings = [ (name = "SIDECAR", service = "sidecar"), (name = "DEAD", service = "dead"), (name = "SQUATTER", service = "squatter") ],
);
`);
  workerd = track(spawn(join(PACKAGE_DIR, "node_modules/.bin/workerd"), ["serve", "config.capnp"], { cwd: dir, stdio: ["ignore", "pipe", "pipe"] }));
  workerd.stdout?.on("data", (chunk) => { log += chunk; });
  workerd.stderr?.on("data", (chunk) => { log += chunk; });
  workerUrl = `http://127.0.0.1:${port}`;
  await waitUntil(async () => {
    if (workerd.exitCode !== null) throw new Error(`workerd exited ${workerd.exitCode}: ${log}`);
    return fetch(`${workerUrl}/none`, { method: "POST", body: "{}" }).then((r) => r.status === 404, () => false);
  }, 30_000, "workerd to serve the worker");
});

after(async () => {
  if (workerd && workerd.exitCode === null) {
    workerd.kill("SIGTERM");
    await new Promise((done) => workerd.once("exit", done));
  }
  await squatter?.close();
  await w?.close();
});

async function scenario(name: string, config: Record<string, unknown>): Promise<Record<string, any>> {
  const response = await fetch(`${workerUrl}/${name}`, { method: "POST", body: JSON.stringify({ baseUrl: w.serve.baseUrl, token: TOKEN, ...config }) });
  const body = await response.json() as Record<string, any>;
  assert.equal(response.status, 200, `${JSON.stringify(body)}\n${log}`);
  return body;
}

for (const auth of [undefined, "bearer"] as const) {
it(`drives every call of the built package from inside workerd through a service binding (auth ${auth ?? "signed, the default"})`, async () => {
  const missing = "3123456789abcdef0123456789abcdef01234567";
  const before = squatter.received.length;
  const out = await scenario("calls", { repo: w.repo, sha: w.upstream.shas[0], missing, auth });
  assert.equal(out.auth, auth ?? "signed");
  assert.equal(out.ready.value.state, "ready", JSON.stringify(out.ready));
  assert.equal(out.ready.value.commit, w.upstream.shas[0]);
  assert.match(readFileSync(join(out.ready.value.path, "README.md"), "utf8"), /version 0/);
  assert.equal(out.readyAgain.value.path, out.ready.value.path);
  assert.ok(Array.isArray(out.fetcherForm.value.repos));
  assert.equal(out.failed.value.state, "failed");
  assert.equal(out.failed.value.error, "UNKNOWN_COMMIT");
  assert.ok(out.failed.value.retry_after >= 1);
  assert.deepEqual([out.badInput.error.code, out.badInput.error.status], ["BAD_COMMIT", 400]);
  assert.deepEqual([out.wrongToken.error.code, out.wrongToken.error.status], ["UNAUTHORIZED", 401]);
  assert.equal(out.hold.state, "ready");
  assert.equal(out.hold.expires_in, 600);
  assert.equal(out.hold.path, out.ready.value.path);
  assert.equal(out.release.value, true);
  assert.equal(out.releaseAgain.value, false);
  assert.deepEqual([out.releaseUnknown.error.code, out.releaseUnknown.error.status], ["UNKNOWN_HOLD", 404]);
  assert.ok(Array.isArray(out.status.value.repos) && typeof out.status.value.totals.checkouts === "number");
  assert.ok(Array.isArray(out.workspaces.value.workspaces));
  assert.equal(out.gc.value.dry_run, true);
  assert.equal(out.health.value.ok, true);
  assert.equal(out.readyz.value.ok, true);
  assert.equal(out.openapi.value.openapi, JSON.parse(readFileSync(join(PACKAGE_DIR, "../../checkoutcache/serve/openapi.json"), "utf8")).openapi);
  assert.ok(out.openapi.value.paths.includes("/v1/ensure"));
  assert.equal(out.metrics.value, "checkoutcache_holds 0.0");
  assert.equal(out.timeout.error.code, "TIMEOUT");
  assert.equal(out.aborted.error.code, "ABORTED");
  assert.equal(out.unavailable.error.code, "UNAVAILABLE", JSON.stringify(out.unavailable));
  assert.match(out.unavailable.error.message, /Network connection lost/);
  assert.equal(out.unbound.error.code, "UNAVAILABLE");
  assert.match(out.unbound.error.message, /Illegal invocation/);
  assert.equal(out.breakerFirst.error.code, "UNAVAILABLE");
  assert.equal(out.breakerRefused.error.code, "REPOSITORY_DOWN");
  assert.match(out.breakerRefused.error.next, /read-only source tools/);
  assert.equal(out.breakerCalled, 1, "the refused call's fn was never called");
  assert.equal(out.breakerFailed.value.state, "failed");
  assert.equal(out.breakerFailedDown.down, true);
  assert.equal(out.nextTurn.value.state, "ready");
  const toSquatter = Buffer.concat(squatter.received.slice(before)).toString("latin1");
  assert.match(toSquatter, /^POST \/v1\/ensure HTTP\/1\.1\r\n/, "the squatter was asked");
  if (auth === "bearer") {
    assert.deepEqual(out.sent.schemes, ["Bearer", null]); // public endpoints without it
    assert.equal(out.sent.tokenSent, true);
    assert.equal(out.stripped.value.state, "ready"); // nothing to prove: taken as it came
    assert.equal(out.squatter.value.path, "/tmp/the-squatters-tree"); // believed...
    assert.ok(toSquatter.includes(`Bearer ${TOKEN}`)); // ...and handed the token
  } else {
    assert.deepEqual(out.sent.schemes, ["CheckoutCache-HMAC"]); // every request, public ones included
    assert.equal(out.sent.count, 13); // ensure x3, hold, release x2, status, workspaces, gc, healthz, readyz, openapi, metrics
    assert.equal(out.sent.tokenSent, false);
    assert.equal(out.stripped.error.code, "NOT_THE_WRITER");
    assert.equal(out.squatter.error.code, "NOT_THE_WRITER");
    assert.equal(out.squatter.error.status, null);
    assert.ok(!toSquatter.includes(TOKEN), "the token never reached the squatter");
  }
});
}

it("waits for a clone from inside workerd, with progress, until ready", async () => {
  const sha = w.fresh();
  w.proxy.shut();
  const heldBefore = w.proxy.held;
  const cloningBefore = await w.serve.total("checkoutcache_answers_total", { state: "cloning" });
  const pending = scenario("wait", { repo: w.gatedRepo, sha });
  // The first ask and at least two progress answers, with the clone held in its fetch: then open.
  await waitUntil(async () => w.proxy.held > heldBefore
    && (await w.serve.total("checkoutcache_answers_total", { state: "cloning" })) >= cloningBefore + 3, 30_000, "the worker waiting on the clone");
  w.proxy.open();
  const out = await pending;
  assert.equal(out.first.value.state, "cloning");
  assert.equal(out.answer.value.state, "ready", JSON.stringify(out.answer));
  assert.equal(out.answer.value.commit, sha);
  assert.ok(out.progress.length >= 2 && out.progress.every((s: string) => s === "cloning"), JSON.stringify(out.progress));
});
