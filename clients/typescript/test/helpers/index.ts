// Real parts for the tests, as tests/helpers/ makes them for the Python tests: a `checkoutcache
// serve` process with a real token file, a real `git daemon` on 127.0.0.1 serving repositories
// made with git, and a gated TCP proxy in front of the daemon that holds a clone in its fetch
// for as long as a test needs (tests/helpers/gate.py), so nothing waits on a time.
import { spawn, execFileSync, type ChildProcess } from "node:child_process";
import { existsSync, mkdirSync, mkdtempSync, openSync, readFileSync, renameSync, rmSync, writeFileSync, closeSync } from "node:fs";
import { createHash, createHmac } from "node:crypto";
import http from "node:http";
import net from "node:net";
import { tmpdir } from "node:os";
import { dirname, join, resolve } from "node:path";
import { fileURLToPath } from "node:url";

const here = dirname(fileURLToPath(import.meta.url));
/** The package (clients/typescript) and the repository root, from build-test/helpers/. */
export const PACKAGE_DIR = resolve(here, "../..");
export const REPO_ROOT = resolve(PACKAGE_DIR, "../..");
export const DOCUMENT = join(REPO_ROOT, "checkoutcache/serve/openapi.json");

export const TOKEN = "tok-" + "a".repeat(28); // every scope
export const SCOPED = "tok-" + "b".repeat(28); // scope team-a only
export const SHORT_BACKOFF = { CHECKOUTCACHE_BACKOFF: "0.1", CHECKOUTCACHE_BACKOFF_MAX: "0.2" };

export function tempDir(prefix: string): string {
  return mkdtempSync(join(tmpdir(), `cc-ts-${prefix}-`));
}

export async function sleep(ms: number): Promise<void> {
  await new Promise((done) => setTimeout(done, ms));
}

/** Poll until `predicate` gives something truthy (returned); fail naming `what` after timeoutMs. */
export async function waitUntil<T>(predicate: () => T | Promise<T>, timeoutMs: number, what: string): Promise<NonNullable<T>> {
  const deadline = Date.now() + timeoutMs;
  for (;;) {
    const value = await predicate();
    if (value) return value as NonNullable<T>;
    if (Date.now() >= deadline) throw new Error(`timed out after ${timeoutMs} ms waiting for ${what}`);
    await sleep(20);
  }
}

// Every process a test starts ends with the test's process, even when the runner ends it early
// (a test past --test-timeout is cancelled without its after() hooks): SIGTERM, which serve and
// git daemon answer by stopping cleanly.
const children = new Set<ChildProcess>();

export function track(child: ChildProcess): ChildProcess {
  children.add(child);
  child.once("exit", () => children.delete(child));
  return child;
}

function endChildren(): void {
  for (const child of children) child.kill("SIGTERM");
}

process.once("exit", endChildren);
for (const signal of ["SIGTERM", "SIGINT", "SIGHUP"] as const) {
  process.once(signal, () => {
    endChildren();
    process.exit(128 + ({ SIGHUP: 1, SIGINT: 2, SIGTERM: 15 } as const)[signal]);
  });
}

export async function freePort(): Promise<number> {
  return new Promise((done, fail) => {
    const server = net.createServer();
    server.once("error", fail);
    server.listen(0, "127.0.0.1", () => {
      const address = server.address();
      const port = typeof address === "object" && address ? address.port : 0;
      server.close(() => done(port));
    });
  });
}

async function connects(port: number): Promise<boolean> {
  return new Promise((done) => {
    const socket = net.connect(port, "127.0.0.1");
    socket.once("connect", () => { socket.destroy(); done(true); });
    socket.once("error", () => done(false));
  });
}

async function exited(child: ChildProcess, timeoutMs: number): Promise<number | null> {
  if (child.exitCode !== null || child.signalCode !== null) return child.exitCode;
  return new Promise((done) => {
    const timer = setTimeout(() => done(null), timeoutMs);
    child.once("exit", (code) => { clearTimeout(timer); done(code); });
  });
}

// ------------------------------------------------------------ git

const GIT_ENV: Record<string, string> = {
  GIT_AUTHOR_NAME: "Test", GIT_AUTHOR_EMAIL: "test@example.invalid",
  GIT_COMMITTER_NAME: "Test", GIT_COMMITTER_EMAIL: "test@example.invalid",
  GIT_CONFIG_NOSYSTEM: "1", HOME: "/nonexistent-home",
};

export function git(args: string[], cwd?: string): string {
  const env: Record<string, string> = {};
  for (const [k, v] of Object.entries(process.env)) if (!k.startsWith("GIT_") && v !== undefined) env[k] = v;
  Object.assign(env, GIT_ENV);
  return execFileSync("git", ["-c", "safe.directory=*", ...args], { cwd, env, encoding: "utf8" }).trim();
}

/** A repository made with git: commit() writes files and returns the commit's id. */
export class Upstream {
  readonly shas: string[] = [];
  constructor(readonly path: string) {
    git(["init", "-q", "-b", "main", path]);
  }

  commit(files: Record<string, string>, message = "change"): string {
    for (const [name, data] of Object.entries(files)) {
      const full = join(this.path, name);
      mkdirSync(dirname(full), { recursive: true });
      writeFileSync(full, data);
    }
    git(["add", "-A"], this.path);
    git(["commit", "-q", "--allow-empty", "-m", message], this.path);
    const sha = git(["rev-parse", "HEAD"], this.path);
    this.shas.push(sha);
    return sha;
  }
}

/** `git daemon` on 127.0.0.1 serving every repository under `base`. */
export class GitDaemon {
  private constructor(readonly base: string, readonly port: number, private readonly child: ChildProcess) {}

  static async start(base: string): Promise<GitDaemon> {
    const port = await freePort();
    const child = track(spawn("git", ["daemon", "--reuseaddr", `--base-path=${base}`, "--export-all", "--listen=127.0.0.1",
      `--port=${port}`, base], { stdio: "ignore" }));
    const daemon = new GitDaemon(base, port, child);
    await waitUntil(async () => {
      if (child.exitCode !== null) throw new Error("git daemon exited");
      return connects(port);
    }, 10_000, "git daemon to listen");
    return daemon;
  }

  url(name: string): string {
    return `git://127.0.0.1:${this.port}/${name}`;
  }

  async stop(): Promise<void> {
    this.child.kill("SIGTERM");
    if ((await exited(this.child, 10_000)) === null && this.child.exitCode === null) this.child.kill("SIGKILL");
  }
}

/**
 * A TCP proxy in front of a server (the git daemon): while shut, connections are accepted and held
 * (nothing reaches the server), so a clone through it is stuck in its fetch until open(); `held`
 * counts connections that met the shut gate, so a test knows a fetch has begun without sleeping.
 */
export class GatedProxy {
  held = 0;
  private shutGate = false;
  private waiting: Array<() => void> = [];
  private readonly sockets = new Set<net.Socket>();

  private constructor(private readonly server: net.Server, readonly port: number, private readonly target: number) {}

  static async start(targetPort: number): Promise<GatedProxy> {
    const server = net.createServer();
    await new Promise<void>((done) => server.listen(0, "127.0.0.1", done));
    const address = server.address();
    const proxy = new GatedProxy(server, typeof address === "object" && address ? address.port : 0, targetPort);
    server.on("connection", (client) => proxy.accept(client));
    return proxy;
  }

  url(name: string): string {
    return `git://127.0.0.1:${this.port}/${name}`;
  }

  shut(): void {
    this.shutGate = true;
  }

  open(): void {
    this.shutGate = false;
    const waiting = this.waiting;
    this.waiting = [];
    for (const go of waiting) go();
  }

  private accept(client: net.Socket): void {
    this.sockets.add(client);
    client.on("close", () => this.sockets.delete(client));
    client.on("error", () => client.destroy());
    client.pause(); // its bytes wait here until the gate lets it through
    const through = () => {
      if (client.destroyed) return;
      const upstream = net.connect(this.target, "127.0.0.1");
      this.sockets.add(upstream);
      upstream.on("close", () => { this.sockets.delete(upstream); client.destroy(); });
      upstream.on("error", () => upstream.destroy());
      client.on("close", () => upstream.destroy());
      upstream.pipe(client);
      client.pipe(upstream);
      client.resume();
    };
    if (this.shutGate) {
      this.held += 1;
      this.waiting.push(through);
    } else {
      through();
    }
  }

  async close(): Promise<void> {
    this.waiting = [];
    for (const socket of this.sockets) socket.destroy();
    await new Promise<void>((done) => this.server.close(() => done()));
  }
}

// ------------------------------------------------------------ python

/** The Python that runs serve, with this repository's code first on its path (as the Python tests run). */
export function pythonCommand(): { python: string; env: NodeJS.ProcessEnv } {
  const python = process.env["CHECKOUTCACHE_PYTHON"] || "python3";
  const pythonPath = [REPO_ROOT, process.env["PYTHONPATH"]].filter(Boolean).join(":");
  return { python, env: { ...process.env, PYTHONPATH: pythonPath } };
}

/** Run a Python program of this repository's code with `input` as JSON on its stdin; its stdout as JSON. */
export function python(program: string, input: unknown): unknown {
  const { python, env } = pythonCommand();
  return JSON.parse(execFileSync(python, ["-c", program], { env, input: JSON.stringify(input), encoding: "utf8" }));
}

// ------------------------------------------------------------ serve

export interface ServeOptions {
  /** Extra arguments of `serve` (e.g. --max-waiting 1). */
  args?: string[];
  env?: Record<string, string>;
  /** The token file's text (default: TOKEN with every scope, SCOPED with team-a). */
  tokens?: string;
  /** The port to listen on (default a free one): a serve back where an earlier one listened. */
  port?: number;
}

/** A real `checkoutcache serve` on 127.0.0.1, from this repository's code (PYTHONPATH). */
export class Serve {
  private constructor(readonly dir: string, readonly port: number, readonly tokenFile: string,
                      readonly logFile: string, private readonly child: ChildProcess) {}

  get baseUrl(): string {
    return `http://127.0.0.1:${this.port}`;
  }

  static async start(dir: string, options: ServeOptions = {}): Promise<Serve> {
    const port = options.port ?? await freePort();
    const tokenFile = join(dir, `tokens-${port}`);
    writeFileSync(tokenFile, options.tokens ?? `${TOKEN}\n${SCOPED} team-a\n`);
    const readyFile = join(dir, `ready-${port}`);
    const logFile = join(dir, `serve-${port}.log`);
    rmSync(readyFile, { force: true }); // an earlier serve's on this port: serve writes it, never removes it
    const { python, env } = pythonCommand();
    const log = openSync(logFile, "w");
    const child = track(spawn(python, ["-m", "checkoutcache", "--root", join(dir, "root"), "serve",
      "--listen", `127.0.0.1:${port}`, "--token-file", tokenFile, "--ready-file", readyFile,
      "--gc-interval", "0", "--stop-timeout", "5s", ...(options.args ?? [])], {
      env: { ...env, ...(options.env ?? {}) },
      stdio: ["ignore", "ignore", log],
    }));
    closeSync(log);
    const serve = new Serve(dir, port, tokenFile, logFile, child);
    await waitUntil(() => {
      if (child.exitCode !== null) throw new Error(`serve exited ${child.exitCode}:\n${serve.log()}`);
      return existsSync(readyFile);
    }, 30_000, "serve to write its ready file");
    return serve;
  }

  /** Rewrite the token file as a Secret's rotation does (a new file renamed over the old). */
  rotate(text: string): void {
    const next = `${this.tokenFile}.next`;
    writeFileSync(next, text);
    renameSync(next, this.tokenFile);
  }

  log(): string {
    return existsSync(this.logFile) ? readFileSync(this.logFile, "utf8") : "";
  }

  /** One raw request with Node's fetch (not the client under test): status and parsed body. */
  async request(method: string, path: string, body?: unknown, token: string | null = TOKEN): Promise<{ status: number; body: unknown }> {
    const headers: Record<string, string> = {};
    if (token) headers["Authorization"] = `Bearer ${token}`;
    if (body !== undefined) headers["Content-Type"] = "application/json";
    const response = await fetch(this.baseUrl + path, { method, headers, body: body === undefined ? undefined : JSON.stringify(body) });
    const text = await response.text();
    const type = response.headers.get("content-type") ?? "";
    return { status: response.status, body: type.startsWith("application/json") ? JSON.parse(text) : text };
  }

  /** A sample of the Prometheus exposition (e.g. "checkoutcache_holds"), or undefined. */
  async sample(name: string): Promise<number | undefined> {
    const { body } = await this.request("GET", "/metrics");
    for (const line of String(body).split("\n")) {
      const [key, value] = line.split(" ");
      if (key === name && value !== undefined) return Number(value);
    }
    return undefined;
  }

  /** The sum of a labelled metric's samples that carry every label given (e.g. state="cloning"). */
  async total(name: string, labels: Record<string, string>): Promise<number> {
    const { body } = await this.request("GET", "/metrics");
    let sum = 0;
    for (const line of String(body).split("\n")) {
      if (!line.startsWith(`${name}{`)) continue;
      const [series, value] = [line.slice(0, line.lastIndexOf(" ")), line.slice(line.lastIndexOf(" ") + 1)];
      if (Object.entries(labels).every(([k, v]) => series.includes(`${k}="${v}"`))) sum += Number(value);
    }
    return sum;
  }

  /** SIGTERM, then its exit status (SIGKILL if it does not end in time). */
  async stop(): Promise<number | null> {
    if (this.child.exitCode !== null) return this.child.exitCode;
    this.child.kill("SIGTERM");
    const code = await exited(this.child, 30_000);
    if (code === null && this.child.exitCode === null) {
      this.child.kill("SIGKILL");
      await exited(this.child, 10_000);
    }
    return code;
  }
}

/** The parts most tests need: a serve, a git daemon with one repository, a gated proxy to it. */
export interface World {
  dir: string;
  serve: Serve;
  daemon: GitDaemon;
  proxy: GatedProxy;
  upstream: Upstream;
  /** The repository through the daemon directly (clones at once). */
  repo: string;
  /** The same repository through the gated proxy (fetches only while the gate is open); its store exists. */
  gatedRepo: string;
  /** A new commit, which no mirror has yet: its clone must fetch (through the gate, for gatedRepo). */
  fresh(): string;
  close(): Promise<void>;
}

export async function world(name: string, options: ServeOptions = {}): Promise<World> {
  const dir = tempDir(name);
  const upstream = new Upstream(join(dir, "git", "project"));
  for (let n = 0; n < 6; n++) upstream.commit({ "README.md": `# project\nversion ${n}\n`, [`src/module_${n}.ts`]: `export const n = ${n};\n` }, `commit ${n}`);
  const daemon = await GitDaemon.start(join(dir, "git"));
  const proxy = await GatedProxy.start(daemon.port);
  const serve = await Serve.start(dir, { ...options, env: { ...SHORT_BACKOFF, ...(options.env ?? {}) } });
  const gatedRepo = proxy.url("project");
  // A repository's first contact probes it before anything is written (clone/coordinator.py): made
  // here with the gate open, so that later clones through the gate are held in their fetch.
  const first = await serve.request("POST", "/v1/ensure", { repo: gatedRepo, commit: upstream.shas[0], wait: 60 });
  if ((first.body as { state?: string }).state !== "ready") throw new Error(`first contact: ${JSON.stringify(first.body)}`);
  let made = 0;
  return {
    dir, serve, daemon, proxy, upstream, repo: daemon.url("project"), gatedRepo,
    fresh: () => upstream.commit({ [`new/${++made}.txt`]: `made after the mirror ${made}\n` }, `fresh ${made}`),
    async close() {
      await proxy.close(); // held clones fail at once rather than waiting for serve's stop timeout
      const code = await serve.stop();
      await daemon.stop();
      if (code !== 0) throw new Error(`serve exited ${code}:\n${serve.log().slice(-4000)}`);
      rmSync(dir, { recursive: true, force: true });
    },
  };
}

/**
 * A process on the API's port while serve is down (port 0: any free one): it answers every request
 * `ready` with a path of its own, and keeps every byte it received.
 */
export class Squatter {
  readonly received: Buffer[] = [];
  port = 0;
  private readonly sockets = new Set<net.Socket>();
  private constructor(private readonly server: http.Server) {}

  static async start(port: number, path: string): Promise<Squatter> {
    const server = http.createServer();
    const squatter = new Squatter(server);
    server.on("connection", (socket) => {
      squatter.sockets.add(socket);
      socket.on("close", () => squatter.sockets.delete(socket));
      socket.on("data", (chunk: Buffer) => squatter.received.push(chunk)); // the bytes as they came
    });
    server.on("request", (request, response) => {
      request.resume();
      request.on("end", () => {
        const body = JSON.stringify({ state: "ready", repo: "anything", commit: "0".repeat(40), path });
        // A proof as one without the token can make it: the right string, under a guessed key.
        const mac = /mac=([0-9a-f]{64})/.exec(request.headers.authorization ?? "")?.[1] ?? "";
        const digest = createHash("sha256").update(body).digest("hex");
        const proof = createHmac("sha256", "a-guessed-token-0000").update(`checkoutcache-answer-v1\n${mac}\n200\n${digest}`).digest("hex");
        response.writeHead(200, { "content-type": "application/json", "x-checkoutcache-proof": proof });
        response.end(body);
      });
    });
    await new Promise<void>((done, fail) => { server.once("error", fail); server.listen(port, "127.0.0.1", done); });
    const address = server.address();
    squatter.port = typeof address === "object" && address ? address.port : 0;
    return squatter;
  }

  bytes(): string {
    return Buffer.concat(this.received).toString("latin1");
  }

  async close(): Promise<void> {
    for (const socket of this.sockets) socket.destroy();
    await new Promise<void>((done) => this.server.close(() => done()));
  }
}

/**
 * Whatever holds an address and answers as it likes (a squatter on a stopped serve's port, a
 * proxy's page): each request gets the status, headers and body `answer` gives, with no proof.
 */
export class Impostor {
  requests = 0;
  private readonly sockets = new Set<net.Socket>();
  private constructor(private readonly server: http.Server, readonly port: number) {}

  static async start(answer: () => { status: number; headers?: Record<string, string>; body: unknown }): Promise<Impostor> {
    const server = http.createServer();
    await new Promise<void>((done, fail) => { server.once("error", fail); server.listen(0, "127.0.0.1", done); });
    const address = server.address();
    const impostor = new Impostor(server, typeof address === "object" && address ? address.port : 0);
    server.on("connection", (socket) => {
      impostor.sockets.add(socket);
      socket.on("close", () => impostor.sockets.delete(socket));
    });
    server.on("request", (request, response) => {
      impostor.requests++;
      request.resume();
      request.on("end", () => {
        const { status, headers, body } = answer();
        response.writeHead(status, { "content-type": "application/json", ...(headers ?? {}) });
        response.end(JSON.stringify(body));
      });
    });
    return impostor;
  }

  get baseUrl(): string {
    return `http://127.0.0.1:${this.port}`;
  }

  async close(): Promise<void> {
    for (const socket of this.sockets) socket.destroy();
    await new Promise<void>((done) => this.server.close(() => done()));
  }
}

/** The row of docs/errors.md's error table for `code`: its HTTP status and next step. */
export function errorTableRow(code: string): { http: string; next: string } {
  const table = readFileSync(join(REPO_ROOT, "docs/errors.md"), "utf8");
  for (const line of table.split("\n")) {
    const cells = line.split("|").map((cell) => cell.trim());
    if (cells[1] === `\`${code}\``) return { http: cells[4] ?? "", next: cells[5] ?? "" };
  }
  throw new Error(`docs/errors.md has no row for ${code}`);
}

/** A fetch that records what it sends and may change what comes back (an injected fetch). */
export interface Recorded {
  method: string;
  url: string;
  authorization: string | null;
  body: string | null;
  status?: number;
  aborted?: boolean;
}

export function recordingFetch(rewrite?: (json: Record<string, unknown>, response: Response) => Record<string, unknown>) {
  const calls: Recorded[] = [];
  const signals: AbortSignal[] = [];
  const fetcher = async (request: Request): Promise<Response> => {
    const call: Recorded = { method: request.method, url: request.url, authorization: request.headers.get("authorization"),
      body: request.method === "POST" ? await request.clone().text() : null };
    calls.push(call);
    signals.push(request.signal);
    const response = await fetch(request);
    call.status = response.status;
    if (!rewrite || !(response.headers.get("content-type") ?? "").startsWith("application/json")) return response;
    const json = rewrite((await response.json()) as Record<string, unknown>, response);
    const headers = new Headers(response.headers);
    headers.delete("content-length");
    return new Response(JSON.stringify(json), { status: response.status, headers });
  };
  return { fetch: fetcher, calls, signals };
}
