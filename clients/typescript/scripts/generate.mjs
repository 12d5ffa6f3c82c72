#!/usr/bin/env node
// The package's types from the OpenAPI document that serve answers: one home for how they are
// made, used by `npm run generate` and by the test that fails when the committed file no longer
// matches the document (test/generated.test.ts).
//
//   node scripts/generate.mjs                       regenerate src/generated/openapi.ts
//   node scripts/generate.mjs --from DOC --out FILE  from another document, into another file
//   node scripts/generate.mjs --check                exit 1 when the committed file is stale
import { readFile, writeFile, mkdir } from "node:fs/promises";
import { dirname, resolve } from "node:path";
import { fileURLToPath } from "node:url";
import openapiTS, { astToString, COMMENT_HEADER } from "openapi-typescript";

const here = dirname(fileURLToPath(import.meta.url));
export const PACKAGE = resolve(here, "..");
export const DOCUMENT = resolve(PACKAGE, "../../checkoutcache/serve/openapi.json");
export const GENERATED = resolve(PACKAGE, "src/generated/openapi.ts");

// `{"type": "object"}` without properties (a clone's progress, status's totals) is an object of
// fields the document does not list: unknown, not openapi-typescript's default Record<string, never>.
export const OPTIONS = { emptyObjectsUnknown: true };

/** The TypeScript text for the OpenAPI document at `document` (a path). */
export async function generate(document = DOCUMENT) {
  const parsed = JSON.parse(await readFile(document, "utf8"));
  const nodes = await openapiTS(parsed, OPTIONS);
  return COMMENT_HEADER + `// From checkoutcache/serve/openapi.json by \`npm run generate\` (scripts/generate.mjs).\n\n`
    + astToString(nodes);
}

async function main(argv) {
  const flag = (name) => {
    const at = argv.indexOf(name);
    return at >= 0 ? argv[at + 1] : undefined;
  };
  const from = resolve(flag("--from") ?? DOCUMENT);
  const out = resolve(flag("--out") ?? GENERATED);
  const text = await generate(from);
  if (argv.includes("--check")) {
    const committed = await readFile(out, "utf8").catch(() => "");
    if (committed !== text) {
      process.stderr.write(`${out} does not match ${from}: run \`npm run generate\`\n`);
      process.exit(1);
    }
    return;
  }
  await mkdir(dirname(out), { recursive: true });
  await writeFile(out, text);
  process.stdout.write(`${from} -> ${out}\n`);
}

if (process.argv[1] && resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  await main(process.argv.slice(2));
}
