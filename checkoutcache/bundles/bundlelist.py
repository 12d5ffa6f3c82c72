"""git's bundle list format, and the decisions made from a list. Pure.

A list, as git documents it (gitformat-bundle, "bundle lists") and writes it:

    [bundle]
    	version = 1
    	mode = all
    	heuristic = creationToken
    [bundle "1764523000-9f2c4e1a"]
    	uri = 1764523000-9f2c4e1a.bundle
    	creationToken = 1764523000

Our publisher keeps one chain per list: the entry with the lowest token is a
full bundle, and each later one holds what changed since the ones before it.
A seeder applies them in token order and stops at the first that fails.

Only entries whose uri is a plain object name in the list's own folder are
followed: a list cannot send a node to another host or path.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from checkoutcache.bundles.location import BUNDLE_SUFFIX, HEADS_SUFFIX, RETIRED_SUFFIX, TMP_PREFIX, parse_object_name

MAX_LIST_BYTES = 1 << 20
MAX_ENTRIES = 1000
_SECTION = re.compile(r'\[\s*bundle\s*(?:"(?P<id>[^"\\]*)")?\s*\]')
_ENTRY = re.compile(r"(?P<key>[A-Za-z][A-Za-z0-9-]*)\s*(?:=\s*(?P<value>.*))?")


class BundleEntry(NamedTuple):
    id: str
    uri: str
    token: int


class BundleList(NamedTuple):
    entries: tuple[BundleEntry, ...]  # by increasing creationToken
    mode: str = "all"
    heuristic: str = "creationToken"

    @property
    def newest_token(self) -> int:
        return self.entries[-1].token if self.entries else 0


class MalformedList(ValueError):
    pass


def _value(raw: str | None) -> str:
    text = (raw or "").strip()
    if len(text) >= 2 and text[0] == text[-1] == '"':
        text = text[1:-1]
    return text


def parse_list(text: str) -> BundleList:
    """The list's usable entries (sorted by token); MalformedList if it is not a bundle list."""
    if len(text) > MAX_LIST_BYTES:
        raise MalformedList(f"the list is larger than {MAX_LIST_BYTES} bytes")
    header: dict[str, str] = {}
    sections: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    for number, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line[0] in "#;":
            continue
        if line.startswith("["):
            match = _SECTION.fullmatch(line)
            if match is None:
                current = None  # another section: not ours to read
                continue
            if match["id"] is None:
                current = header
            else:
                if len(sections) >= MAX_ENTRIES:
                    raise MalformedList(f"the list names more than {MAX_ENTRIES} bundles")
                current = sections.setdefault(match["id"], {})
            continue
        match = _ENTRY.fullmatch(line)
        if match is None:
            raise MalformedList(f"line {number} is not `key = value`")
        if current is not None:
            current[match["key"].lower()] = _value(match["value"])
    if header.get("version") != "1":
        raise MalformedList(f"bundle.version is {header.get('version')!r}, not 1")
    entries = []
    for bundle_id, fields in sections.items():
        uri, token = fields.get("uri", ""), fields.get("creationtoken", "")
        parsed = parse_object_name(uri)
        if parsed is None or parsed[2] != BUNDLE_SUFFIX or not (token.isascii() and token.isdigit()):
            continue  # not one of ours (absolute, another folder, no token): never followed
        entries.append(BundleEntry(bundle_id, uri, int(token)))
    entries.sort(key=lambda e: (e.token, e.id))
    return BundleList(tuple(entries), header.get("mode", "all"), header.get("heuristic", ""))


def render_list(entries: list[BundleEntry] | tuple[BundleEntry, ...]) -> str:
    lines = ["[bundle]", "\tversion = 1", "\tmode = all", "\theuristic = creationToken"]
    for entry in sorted(entries, key=lambda e: (e.token, e.id)):
        lines += [f'[bundle "{entry.id}"]', f"\turi = {entry.uri}", f"\tcreationToken = {entry.token}"]
    return "\n".join(lines) + "\n"


class PublishPlan(NamedTuple):
    full: bool  # a new chain (the list is replaced by this one bundle) or one more increment
    why: str


def plan_publish(current: BundleList | None, now: float, max_increments: int, full_every: float,
                 force_full: bool = False) -> PublishPlan:
    """Whether the next bundle starts a new chain, and why."""
    if force_full:
        return PublishPlan(True, "--full")
    if current is None or not current.entries:
        return PublishPlan(True, "no bundle list yet")
    if len(current.entries) - 1 >= max_increments:
        return PublishPlan(True, f"the chain has {len(current.entries) - 1} increments (at most {max_increments})")
    if now - current.entries[0].token >= full_every:
        return PublishPlan(True, f"the full bundle is older than {full_every:g}s")
    return PublishPlan(False, "an increment on the current chain")


def next_token(current: BundleList | None, now: float) -> int:
    """The publish time in whole seconds, kept above every token of the list (clocks of
    two publishers may disagree; git applies bundles by increasing token)."""
    return max(int(now), (current.newest_token + 1) if current is not None else 0)


class PrunePlan(NamedTuple):
    retire: list[str]  # bundles no list names, not yet marked: write their .retired marker
    delete: list[str]  # objects to delete now
    relisted: list[str]  # .retired markers of bundles a list names again: delete them


def plan_prune(stored: list[tuple[str, float]], listed: set[str], now: float, prune_after: float) -> PrunePlan:
    """What to retire and delete. A bundle no list names and older than prune_after (a
    younger one may be another publisher's, its list not written yet) is first marked
    retired; it and its heads go prune_after after the mark (not after its own age: a
    publisher that read the list naming it may still write a list naming it within its
    run). Temp files of a publisher that died go once older than prune_after."""
    retire, delete, relisted = [], [], []
    by_stem: dict[str, dict[str, float]] = {}
    for name, modified in stored:
        if name.startswith(TMP_PREFIX):
            if now - modified >= prune_after:
                delete.append(name)
            continue
        parsed = parse_object_name(name)
        if parsed is not None:
            by_stem.setdefault(f"{parsed[0]}-{parsed[1]}", {})[parsed[2]] = modified
    for stem, parts in by_stem.items():
        bundle = stem + BUNDLE_SUFFIX
        marked = parts.get(RETIRED_SUFFIX)
        if bundle in listed:
            if marked is not None:
                relisted.append(stem + RETIRED_SUFFIX)
        elif marked is None:
            if now - parts.get(BUNDLE_SUFFIX, now) >= prune_after:  # a young one may be listed any moment
                retire.append(bundle)
        elif now - marked >= prune_after:
            delete += [stem + suffix for suffix in (BUNDLE_SUFFIX, HEADS_SUFFIX, RETIRED_SUFFIX) if suffix in parts]
    return PrunePlan(sorted(retire), sorted(delete), sorted(relisted))


def parse_heads(text: str) -> dict[str, str]:
    heads = {}
    for line in text.splitlines():
        sha, _, ref = line.strip().partition(" ")
        if re.fullmatch(r"[0-9a-f]{40}", sha) and ref.startswith("refs/"):
            heads[ref] = sha
    return heads


def render_heads(heads: dict[str, str]) -> str:
    return "".join(f"{sha} {ref}\n" for ref, sha in sorted(heads.items()))
