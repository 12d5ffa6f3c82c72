// The shapes of requests and answers, all from the generated types (src/generated/openapi.ts,
// `npm run generate`), so a regenerated document is picked up without editing this file.
import type { components, operations } from "./generated/openapi.js";

type Schemas = components["schemas"];

/**
 * An object as the server sent it: the fields the document names, typed, and whatever else a
 * newer server adds (kept as they came, typed unknown until the types are regenerated).
 */
export type Open<T> = T & { [field: string]: unknown };

export type ReadyAnswer = Open<Schemas["Ready"]>;
export type CloningAnswer = Open<Schemas["Cloning"]>;
export type FailedAnswer = Open<Schemas["Error"]>;
/** What ensure answers, as the library and the CLI do: a union discriminated on `state`. */
export type Answer = ReadyAnswer | CloningAnswer | FailedAnswer;
export type AnswerState = Answer["state"];
/** The documented error codes (docs/errors.md) as the document lists them. */
export type ErrorCode = Schemas["Error"]["error"];

export type HeldAnswer = Open<Schemas["Held"]>;
export type StatusReport = Open<Schemas["Status"]>;
export type WorkspacesReport = Open<Schemas["Workspaces"]>;
export type GcReport = Open<Schemas["GcReport"]>;
export type Health = Open<Schemas["Health"]>;
export type Readiness = Open<Schemas["Readiness"]>;

type JsonBody<Op extends keyof operations> = operations[Op] extends {
  requestBody?: { content: { "application/json": infer B } };
}
  ? B
  : never;

export type EnsureRequest = JsonBody<"ensure">;
export type HoldRequest = JsonBody<"hold">;
export type GcRequest = NonNullable<JsonBody<"gc">>;

/** Seconds, or a form such as "15m", "1h30m", "500ms" (as the API takes). */
export type Duration = number | string;
