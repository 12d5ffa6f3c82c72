// Every TypeScript example of the package's README and of docs/http-api.md type-checks against
// the built package (dist/index.d.ts, through the package's own name), under the strictness the
// package itself is built with, so an example cannot rot when the API or the docs change.
//
// Each ```ts block is a module of its own: what it uses of the package it imports. The names an
// application around it provides (the client made in an earlier block, the repository and commit
// a tool call names, a Worker's env and container, the application's own log) are declared once
// below, with the types the application would give them.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { mkdirSync, readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { it } from "node:test";
import { PACKAGE_DIR, REPO_ROOT } from "./helpers/index.js";

const DOCUMENTS = {
  "README": join(PACKAGE_DIR, "README.md"),
  "http-api": join(REPO_ROOT, "docs/http-api.md"),
};

/** What the application around an example provides (never a name of the package: those are imported). */
const AROUND = `import type { CheckoutCache, TokenSource } from "@checkoutcache/client";
declare global {
  /** The client an earlier example made. */
  const cache: CheckoutCache;
  /** What a tool call names. */
  const repo: string;
  const commit: string;
  const sha: string;
  /** The client's settings, as an earlier example gave them. */
  const baseUrl: string;
  const token: TokenSource;
  /** A Worker's bindings, its invocation's context and its container (Cloudflare's Sandbox SDK). */
  const env: { CHECKOUTCACHE_TOKEN: string };
  const ctx: { waitUntil(promise: Promise<unknown>): void };
  const container: { getTcpPort(port: number): { fetch(input: Request | string | URL, init?: RequestInit): Promise<Response> } };
  /** The application's own. */
  function log(...values: unknown[]): void;
  function report(...values: unknown[]): void;
  function run(path: string): void;
  function copyTree(path: string): Promise<void>;
}
export {};
`;

const TSCONFIG = {
  compilerOptions: {
    target: "ES2022", lib: ["ES2022"], module: "NodeNext", moduleResolution: "NodeNext", types: ["node"],
    strict: true, noUncheckedIndexedAccess: true, noImplicitOverride: true, skipLibCheck: false, noEmit: true,
  },
  include: ["*.ts"],
};

/** The ```ts (or ```typescript) blocks of a Markdown text, with the line each starts on. */
export function typeScriptBlocks(markdown: string): Array<{ line: number; code: string }> {
  const found: Array<{ line: number; code: string }> = [];
  let fence: { language: string; line: number; lines: string[] } | undefined;
  markdown.split("\n").forEach((text, index) => {
    if (fence === undefined) {
      const opening = /^\s*```\s*([A-Za-z]*)/.exec(text);
      if (opening) fence = { language: opening[1]!.toLowerCase(), line: index + 2, lines: [] };
    } else if (/^\s*```\s*$/.test(text)) {
      if (fence.language === "ts" || fence.language === "typescript") found.push({ line: fence.line, code: fence.lines.join("\n") });
      fence = undefined;
    } else {
      fence.lines.push(text);
    }
  });
  assert.equal(fence, undefined, "a fence is never closed");
  return found;
}

/** tsc over `files` (name: a module's text) in a directory of the package: its diagnostics, "" when none. */
export function typeCheck(files: Record<string, string>): string {
  const dir = join(PACKAGE_DIR, "build-test", `examples-${process.pid}-${Math.random().toString(36).slice(2)}`);
  mkdirSync(dir, { recursive: true });
  try {
    writeFileSync(join(dir, "tsconfig.json"), JSON.stringify(TSCONFIG));
    writeFileSync(join(dir, "around.d.ts"), AROUND);
    for (const [name, code] of Object.entries(files)) writeFileSync(join(dir, name), `${code}\nexport {};\n`);
    try {
      execFileSync(process.execPath, [join(PACKAGE_DIR, "node_modules/typescript/bin/tsc"), "-p", join(dir, "tsconfig.json")],
        { cwd: dir, encoding: "utf8", stdio: "pipe" });
      return "";
    } catch (error) {
      const failed = error as { stdout?: string; stderr?: string; status?: number };
      return `${failed.stdout ?? ""}${failed.stderr ?? ""}`.trim() || `tsc exited ${failed.status}`;
    }
  } finally {
    rmSync(dir, { recursive: true, force: true });
  }
}

it("every TypeScript example of the README and of docs/http-api.md type-checks against the built package", () => {
  const files: Record<string, string> = {};
  for (const [name, path] of Object.entries(DOCUMENTS)) {
    const blocks = typeScriptBlocks(readFileSync(path, "utf8"));
    assert.ok(blocks.length >= 3, `${path}: ${blocks.length} TypeScript blocks (a fence's language changed?)`);
    for (const block of blocks) files[`${name}-line-${block.line}.ts`] = block.code;
  }
  const examples = Object.values(files).join("\n");
  for (const shown of ["new CheckoutCache(", "waitReady(", "new RepositoryBreaker(", "hold("]) {
    assert.ok(examples.includes(shown), `the examples show ${shown}`);
  }
  assert.equal(typeCheck(files), "", "an example (file: document-line-N.ts, N its first line in the document) does not type-check");
});

it("the check fails for an example that does not type-check (an untyped parameter, a name not imported)", () => {
  const untyped = `const breaker = new RepositoryBreaker();
async function checkoutTool({ repo, commit }) {
  return breaker.run(repo, () => cache.waitReady({ repo, commit, wait: 90 }));
}`;
  const diagnostics = typeCheck({ "untyped.ts": untyped });
  assert.match(diagnostics, /untyped\.ts\(2,\d+\): error TS7031: Binding element 'repo' implicitly has an 'any' type/);
  assert.match(diagnostics, /untyped\.ts\(1,\d+\): error TS2304: Cannot find name 'RepositoryBreaker'/);
  assert.equal(typeCheck({ "typed.ts": `import { RepositoryBreaker } from "@checkoutcache/client";\n${untyped.replace("{ repo, commit })", "{ repo, commit }: { repo: string; commit: string })")}` }), "");
});
