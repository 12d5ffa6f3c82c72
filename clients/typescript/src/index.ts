// @checkoutcache/client: the sidecar's HTTP API (docs/http-api.md) for Workers and Node.
export { CheckoutCache } from "./client.js";
export type {
  Auth, CallOptions, CheckoutCacheOptions, EnsureOptions, Fetcher, FetchLike, GcOptions, Hold, HoldOptions, TokenSource, WaitReadyOptions,
} from "./client.js";
export { CheckoutCacheError, CLIENT_CODES, isCheckoutCacheError } from "./errors.js";
export type { CheckoutCacheErrorInit, ClientCode } from "./errors.js";
export { RepositoryBreaker, judge, repositoryKey } from "./breaker.js";
export type { Outcome, RepositoryBreakerOptions, RepositoryState } from "./breaker.js";
export { durationSeconds } from "./durations.js";
export type {
  Answer, AnswerState, CloningAnswer, Duration, EnsureRequest, ErrorCode, FailedAnswer, GcReport, GcRequest, Health,
  HeldAnswer, HoldRequest, Open, ReadyAnswer, Readiness, StatusReport, WorkspacesReport,
} from "./types.js";
export type { components, operations, paths } from "./generated/openapi.js";
