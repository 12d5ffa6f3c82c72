// The per-repository breaker of a tool executor, for one turn of a review.
//
// The failure this product began with: a review's tool calls each waited their full 90 s because
// the caller kept asking a sandbox that could not answer. A RepositoryBreaker keeps a turn from
// doing that: once a repository's checkout cannot be had, run() refuses it at once, without
// calling `fn`, with a next step that sends the review to its read-only source tools.
//
// Rules (each has a test in test/breaker.test.ts; the README lists every code's verdict):
// - a repository goes down when a call reports the sidecar unavailable (UNAVAILABLE, NOT_THE_WRITER,
//   TIMEOUT, SERVER_BUSY, SHUTTING_DOWN, INTERNAL_ERROR or any other 5xx), when its checkout could not be
//   started (a failed answer, but HISTORY_FAILED and NO_MERGE_BASE; the repository or the token
//   refused: 401, 403 but FORBIDDEN_SCOPE and FORBIDDEN_ENDPOINT, BAD_REPO, UNSAFE_TRANSPORT,
//   NOT_A_REPOSITORY), or after `missedWaits` (2) missed waits (a call that ended with the
//   checkout still cloning);
// - a success resets the count of missed waits (those counted before the call started: a miss
//   that happened while it was in flight stands), never a repository that is down: down is final
//   for the turn, so a call that started before the breaker tripped and succeeds after it changes
//   nothing;
// - what is the call's own (a bad commit id, a bad scope, a scope or an endpoint the token may not
//   use, a base with no merge base, ABORTED, TOO_MANY_HOLDS, UNKNOWN_HOLD, or a non-CheckoutCacheError
//   thrown by fn) and a history that could not be fetched (the checkout stays usable) count for
//   nothing and pass through;
// - a new breaker is a new turn: nothing is shared between instances;
// - a repository is one however it is spelled where serve's reading of the spelling is plain
//   (repositoryKey: the case of scheme and host, a default port, credentials, a trailing / or
//   .git, user@host:path as ssh://); anything else (local paths, percent-escapes) is keyed as given.
import { CheckoutCacheError, CLIENT_CODES } from "./errors.js";

export interface RepositoryBreakerOptions {
  /** Missed waits that put a repository down (default 2). */
  missedWaits?: number | undefined;
  /** The `next` of a refusal: where the review should go instead (default: its read-only source tools). */
  next?: string | ((repo: string) => string) | undefined;
}

export interface RepositoryState {
  down: boolean;
  /** Missed waits counted since the last success. */
  missed: number;
  /** Why it went down: the code that put it down, or MISSED_WAITS. */
  reason?: string | undefined;
  /** The message of what put it down. */
  detail?: string | undefined;
}

/** The breaker's verdict on one outcome of `fn`. */
export type Outcome = "success" | "missed" | "down" | "neutral";

// NOT_THE_WRITER: what answered could not prove it is the sidecar (a squatter on its address while
// serve is down): the sidecar is not there for this turn.
const UNAVAILABLE_CODES = new Set<string>([CLIENT_CODES.UNAVAILABLE, CLIENT_CODES.NOT_THE_WRITER, CLIENT_CODES.TIMEOUT,
  "SERVER_BUSY", "SHUTTING_DOWN", "INTERNAL_ERROR"]);
/** Input errors that say this repository's checkout cannot be started (not the call's other arguments). */
const REPOSITORY_REFUSED = new Set(["BAD_REPO", "UNSAFE_TRANSPORT", "NOT_A_REPOSITORY", "FORBIDDEN_REPOSITORY"]);
/**
 * Failed answers that are no failure of the checkout: HISTORY_FAILED (the checkout stays usable
 * with the history it has) and NO_MERGE_BASE (the call's base has no common history with the
 * commit; the checkout is there). Every other failed answer means it could not be had.
 */
const FAILED_NOT_THE_CHECKOUT = new Set(["HISTORY_FAILED", "NO_MERGE_BASE"]);
/** 403s for what the call asked of the token (another scope, an endpoint it may not call), not for the repository. */
const FORBIDDEN_THE_CALL = new Set(["FORBIDDEN_SCOPE", "FORBIDDEN_ENDPOINT"]);

const DEFAULT_NEXT = (repo: string) =>
  `do not ask for a checkout of ${repo} again in this turn: use the read-only source tools (read a file, search ` +
  `the code, list a directory) on the repository instead; a new turn tries the checkout again`;

const DEFAULT_PORTS: Record<string, number> = { https: 443, ssh: 22, git: 9418 };
const SCHEME_ALIASES: Record<string, string> = { "git+ssh": "ssh", "ssh+git": "ssh" };
const URL_FORM = /^([A-Za-z][A-Za-z0-9+.-]*):\/\/([^/?#]*)(\/[^?#]*)$/;
const HOST_PORT = /^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+)(?::(\d*))?$/;
const SCP_FORM = /^(?:([^@/:\s]+)@)?([A-Za-z0-9.-]+|\[[0-9A-Fa-f:.]+\]):(.+)$/;

/**
 * The key a breaker files a repository under: the spellings serve takes for one repository
 * (checkoutcache/repospec.py, identity()) are one key where that is plain from the string alone:
 * scheme and host in lower case, no default port, no https credentials, no trailing `/` or
 * `.git`, `user@host:path` as `ssh://user@host/path`. Anything else (a local path, whose real
 * path only serve sees; `file://`; percent-escapes; what serve refuses) is its own key, as given:
 * two spellings are never one key unless serve takes them for one repository.
 */
export function repositoryKey(repo: string): string {
  const url = URL_FORM.exec(repo);
  if (url) {
    const given = url[1]!.toLowerCase();
    const scheme = SCHEME_ALIASES[given] ?? given;
    const defaultPort = DEFAULT_PORTS[scheme];
    const authority = url[2]!;
    const at = authority.lastIndexOf("@");
    const hostPort = HOST_PORT.exec(authority.slice(at + 1));
    if (defaultPort === undefined || !hostPort) return repo;
    const port = hostPort[2] ? Number(hostPort[2]) : defaultPort;
    // An ssh login is part of the repository's address; https credentials and a git:// user are not (serve drops them).
    const login = scheme === "ssh" && at >= 0 ? authority.slice(0, at).split(":")[0] : "";
    const user = login ? `${login}@` : "";
    return withoutSuffix(`${scheme}://${user}${hostPort[1]!.toLowerCase()}${port === defaultPort ? "" : `:${port}`}${url[3]}`);
  }
  const scp = repo.includes("://") || repo.split(":", 1)[0]!.includes("/") ? null : SCP_FORM.exec(repo);
  if (scp) {
    const user = scp[1] ? `${scp[1]}@` : "";
    return withoutSuffix(`ssh://${user}${scp[2]!.toLowerCase()}/${scp[3]!.replace(/^\/+/, "")}`);
  }
  return repo;
}

/** No trailing `/`, then no `.git` (and the `/` before it): as serve's identity() does. */
function withoutSuffix(url: string): string {
  const trimmed = url.replace(/\/+$/, "");
  return trimmed.endsWith(".git") ? trimmed.slice(0, -".git".length).replace(/\/+$/, "") : trimmed;
}

/** What one outcome of a call says about its repository (pure: the rules above). */
export function judge(outcome: { value: unknown } | { error: unknown }): { verdict: Outcome; reason?: string; detail?: string } {
  if ("value" in outcome) {
    const state = stateOf(outcome.value);
    if (state === "cloning") return { verdict: "missed" };
    if (state === "failed") {
      const answer = outcome.value as { error?: unknown; message?: unknown };
      if (typeof answer.error === "string" && FAILED_NOT_THE_CHECKOUT.has(answer.error)) return { verdict: "neutral" };
      return { verdict: "down", reason: String(answer.error ?? "FAILED"), detail: String(answer.message ?? "") };
    }
    return { verdict: "success" };
  }
  const error = outcome.error;
  if (!(error instanceof CheckoutCacheError)) return { verdict: "neutral" };
  // A breaker's own refusal (REPOSITORY_DOWN, no HTTP status: no answer was asked for) counts for
  // nothing; the same code in an answer is whatever answered saying it, judged as any answer.
  if (error.code === CLIENT_CODES.REPOSITORY_DOWN && error.status === undefined) return { verdict: "neutral" };
  const said = { reason: error.code, detail: error.message };
  if (error.answer?.state === "cloning") return { verdict: "missed" }; // hold(): NOT_HELD, still cloning
  if (error.answer?.state === "failed" && error.status === 503 && !UNAVAILABLE_CODES.has(error.code)) {
    // hold(): the checkout failed
    return FAILED_NOT_THE_CHECKOUT.has(error.code) ? { verdict: "neutral" } : { verdict: "down", ...said };
  }
  if (UNAVAILABLE_CODES.has(error.code)) return { verdict: "down", ...said };
  if (error.status === 403 && FORBIDDEN_THE_CALL.has(error.code)) return { verdict: "neutral" };
  if (error.status === 401 || error.status === 403 || REPOSITORY_REFUSED.has(error.code)) return { verdict: "down", ...said };
  if (error.status !== undefined && error.status >= 500) return { verdict: "down", ...said };
  return { verdict: "neutral" };
}

function stateOf(value: unknown): unknown {
  return typeof value === "object" && value !== null ? (value as { state?: unknown }).state : undefined;
}

interface Repository {
  down: boolean;
  missed: number;
  /** Bumped at each missed wait: a success resets only the misses it saw when it started. */
  epoch: number;
  reason?: string | undefined;
  detail?: string | undefined;
}

export class RepositoryBreaker {
  private readonly repos = new Map<string, Repository>();
  private readonly missedWaits: number;
  private readonly next: (repo: string) => string;

  constructor(options: RepositoryBreakerOptions = {}) {
    const missed = options.missedWaits ?? 2;
    if (!Number.isInteger(missed) || missed < 1) throw new TypeError("RepositoryBreaker: missedWaits must be a positive whole number");
    this.missedWaits = missed;
    const next = options.next;
    this.next = typeof next === "function" ? next : typeof next === "string" ? () => next : DEFAULT_NEXT;
  }

  /**
   * Run `fn` for `repo` unless the repository is down (then throw REPOSITORY_DOWN at once, fn not
   * called); judge what it returned or threw, and pass that on unchanged.
   */
  async run<T>(repo: string, fn: () => Promise<T> | T): Promise<T> {
    const key = repositoryKey(repo);
    const entry = this.entry(key);
    if (entry.down) throw this.refusal(repo, entry);
    const startedAt = entry.epoch;
    let outcome: { value: T } | { error: unknown };
    try {
      outcome = { value: await fn() };
    } catch (error) {
      outcome = { error };
    }
    this.record(key, judge(outcome), startedAt);
    if ("error" in outcome) throw outcome.error;
    return outcome.value;
  }

  /** Whether run() would refuse `repo` (any spelling of it) now. */
  isDown(repo: string): boolean {
    return this.repos.get(repositoryKey(repo))?.down ?? false;
  }

  /** What the breaker knows of `repo` (any spelling of it). */
  state(repo: string): RepositoryState {
    const entry = this.repos.get(repositoryKey(repo));
    if (!entry) return { down: false, missed: 0 };
    return { down: entry.down, missed: entry.missed, reason: entry.reason, detail: entry.detail };
  }

  /** The repositories that are down (as repositoryKey() spells them), with why. */
  downRepositories(): Array<{ repo: string; reason: string | undefined }> {
    return [...this.repos].filter(([, e]) => e.down).map(([repo, e]) => ({ repo, reason: e.reason }));
  }

  private entry(repo: string): Repository {
    let entry = this.repos.get(repo);
    if (!entry) {
      entry = { down: false, missed: 0, epoch: 0 };
      this.repos.set(repo, entry);
    }
    return entry;
  }

  private record(repo: string, judged: ReturnType<typeof judge>, startedAt: number): void {
    const entry = this.entry(repo);
    if (entry.down) return; // final for the turn: nothing that comes back later changes it
    if (judged.verdict === "down") {
      entry.down = true;
      entry.reason = judged.reason;
      entry.detail = judged.detail;
    } else if (judged.verdict === "missed") {
      entry.missed += 1;
      entry.epoch += 1;
      if (entry.missed >= this.missedWaits) {
        entry.down = true;
        entry.reason = "MISSED_WAITS";
        entry.detail = `the checkout was still cloning when ${entry.missed} waits ended`;
      }
    } else if (judged.verdict === "success" && entry.epoch === startedAt) {
      entry.missed = 0;
    }
  }

  private refusal(repo: string, entry: Repository): CheckoutCacheError {
    return new CheckoutCacheError({
      code: CLIENT_CODES.REPOSITORY_DOWN,
      message: `no checkout of ${repo} in this turn: ${entry.reason ?? "down"}${entry.detail ? ` (${entry.detail})` : ""}`,
      next: this.next(repo),
    });
  }
}
