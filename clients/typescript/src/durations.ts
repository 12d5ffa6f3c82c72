// Durations as the API takes them (checkoutcache/units.py): seconds, or a form such as "15m",
// "1h30m", "500ms". The client reads them only to size a call's budget and waitReady's deadline;
// the server stays the judge of what it accepts.
import type { Duration } from "./types.js";

const PART = /(\d+(?:\.\d+)?)(ms|s|m|h|d|w)/g;
const UNITS: Record<string, number> = { ms: 0.001, s: 1, m: 60, h: 3600, d: 86400, w: 604800 };

/** Seconds, or undefined when the server would refuse the value (it answers the error itself). */
export function durationSeconds(value: Duration | undefined): number | undefined {
  if (value === undefined) return 0;
  if (typeof value === "number") return Number.isFinite(value) && value >= 0 ? value : undefined;
  if (typeof value !== "string") return undefined;
  const text = value.trim().toLowerCase();
  if (!text || text.length > 32) return undefined;
  if (/^\d+(\.\d+)?$/.test(text)) return Number(text);
  if (text.replace(PART, "") !== "") return undefined;
  let seconds = 0;
  for (const match of text.matchAll(PART)) seconds += Number(match[1]) * (UNITS[match[2] ?? ""] ?? NaN);
  return Number.isFinite(seconds) ? seconds : undefined;
}
