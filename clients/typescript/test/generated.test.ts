// The committed types must be what the document makes: regenerated into a temporary file and
// compared. The same check must fail for a document that says something else.
import assert from "node:assert/strict";
import { execFileSync } from "node:child_process";
import { readFileSync, rmSync, writeFileSync } from "node:fs";
import { join } from "node:path";
import { after, it } from "node:test";
import { DOCUMENT, PACKAGE_DIR, tempDir } from "./helpers/index.js";

const dir = tempDir("generated");
after(() => rmSync(dir, { recursive: true, force: true }));
const committed = readFileSync(join(PACKAGE_DIR, "src/generated/openapi.ts"), "utf8");

function generate(document: string): string {
  const out = join(dir, `${Math.random().toString(36).slice(2)}.ts`);
  execFileSync(process.execPath, [join(PACKAGE_DIR, "scripts/generate.mjs"), "--from", document, "--out", out]);
  return readFileSync(out, "utf8");
}

it("src/generated/openapi.ts is what checkoutcache/serve/openapi.json makes (else: npm run generate)", () => {
  assert.equal(generate(DOCUMENT), committed, "the generated types do not match the document: run `npm run generate`");
});

it("a changed document makes other types, so the comparison above can fail", () => {
  const document = JSON.parse(readFileSync(DOCUMENT, "utf8"));
  document.components.schemas.Ready.properties.named_by_a_newer_document = { enum: ["one", "other"], type: "string" };
  const changed = join(dir, "changed.json");
  writeFileSync(changed, JSON.stringify(document));
  const text = generate(changed);
  assert.notEqual(text, committed);
  assert.match(text, /named_by_a_newer_document\?: "one" \| "other";/);
});

it("--check exits 1 for a stale file and 0 for a fresh one", () => {
  const stale = join(dir, "stale.ts");
  writeFileSync(stale, committed.replace("export interface paths", "export interface pathz"));
  const check = (out: string) => {
    try {
      execFileSync(process.execPath, [join(PACKAGE_DIR, "scripts/generate.mjs"), "--check", "--out", out], { stdio: "pipe" });
      return 0;
    } catch (error) {
      return (error as { status: number }).status;
    }
  };
  assert.equal(check(stale), 1);
  assert.equal(check(join(PACKAGE_DIR, "src/generated/openapi.ts")), 0);
});
