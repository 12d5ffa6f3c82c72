"""Pure decisions, tested without a repository: keys and normalization,
commit states, back-off, units, the layout, the config."""

from __future__ import annotations

import time

import attrs
import pytest
from freezegun import freeze_time

from checkoutcache.answers import State
from checkoutcache.clone.decide import (
    MAX_DEATHS,
    CommitFacts,
    NextStep,
    Step,
    backoff_seconds,
    next_failure,
    next_step_for_not_ready,
    state_of,
)
from checkoutcache.config import Config, options_table
from checkoutcache.credentials import redact
from checkoutcache.errors import CODES, CheckoutCacheError
from checkoutcache.repospec import parse_commit, parse_repo, repo_key
from checkoutcache.store.layout import RepoPaths, RootPaths, default_root
from checkoutcache.store.records import Failure
from checkoutcache.units import FreeTarget, parse_duration, parse_free, parse_size


@pytest.mark.parametrize("raw,normalized", [
    ("https://GitHub.com/Org/Repo.git/", "https://github.com/Org/Repo.git"),
    ("https://github.com:443/org/repo", "https://github.com/org/repo"),
    ("https://github.com:8443/org/repo", "https://github.com:8443/org/repo"),
    ("https://user:pw@github.com/org/repo", "https://github.com/org/repo"),
    ("ssh://git@Host.example:22/srv/repo.git", "ssh://git@host.example/srv/repo.git"),
    ("git+ssh://git@host.example/srv/repo.git", "ssh://git@host.example/srv/repo.git"),
    ("git@github.com:org/repo.git", "git@github.com:org/repo.git"),
    ("git://127.0.0.1:9418/repo", "git://127.0.0.1/repo"),
])
def test_urls_normalize(raw, normalized):
    assert parse_repo(raw).url == normalized


def test_key_is_a_hash_over_scope_and_url_never_a_path(tmp_path):
    spec = parse_repo(str(tmp_path))
    assert spec.is_local and spec.url == str(tmp_path.resolve())
    assert len(spec.key) == 32 and "/" not in spec.key
    assert spec.key == repo_key("default", spec.url)
    assert parse_repo(str(tmp_path), scope="other").key != spec.key
    assert parse_repo("https://a:b@h.example/r").key == parse_repo("https://h.example/r").key


def test_credentials_are_split_off_and_hidden():
    spec = parse_repo("https://me:tok3n@host.example/r.git")
    assert spec.credential.username == "me" and spec.credential.password == "tok3n"
    assert "tok3n" not in repr(spec) and "tok3n" not in spec.url
    assert redact("fatal: unable to access 'https://me:tok3n@host.example/r.git/'", ["me", "tok3n"]) == \
        "fatal: unable to access 'https://host.example/r.git/'"
    assert "tok3n" not in redact("token tok3n leaked", ["me", "tok3n"])


def test_bad_repo_messages_never_echo_credentials():
    with pytest.raises(CheckoutCacheError) as err:
        parse_repo("https://me:tok3n@host.example/a/../r.git")
    assert "tok3n" not in str(err.value) and err.value.code == "BAD_REPO"


@pytest.mark.parametrize("commit,fragment", [
    ("abc1234", "abbreviated"), ("main", "branch"), ("", "empty"), ("a" * 64, "SHA-256"), ("a" * 50, "too long"),
])
def test_commit_errors_say_what_to_pass(commit, fragment):
    with pytest.raises(CheckoutCacheError) as err:
        parse_commit(commit)
    assert fragment in err.value.message and "rev-parse" in err.value.next


def test_commit_ids_are_lowercased():
    assert parse_commit("ABCDEF0123456789ABCDEF0123456789ABCDEF01") == "abcdef0123456789abcdef0123456789abcdef01"


def failure(retry_at: float, attempts: int = 1) -> Failure:
    return Failure(code="UNREACHABLE", message="m", next="n", attempts=attempts, failed_at=0.0, retry_at=retry_at)


@pytest.mark.parametrize("marker,held,fail,now,expected", [
    (True, True, failure(100.0), 50.0, State.READY),
    (False, True, failure(100.0), 50.0, State.CLONING),
    (False, False, failure(100.0), 50.0, State.FAILED),
    (False, False, failure(100.0), 100.0, State.ABSENT),
    (False, False, None, 0.0, State.ABSENT),
])
def test_state_of(marker, held, fail, now, expected):
    assert state_of(CommitFacts(marker_present=marker, clone_lock_held=held, failure=fail, now=now)) is expected


@pytest.mark.parametrize("fail,dead_owner_deaths,now,expected", [
    # A failure inside its back-off is answered as it is, whatever a dead owner left.
    (failure(100.0), None, 50.0, NextStep(Step.BACK_OFF)),
    (failure(100.0), MAX_DEATHS - 1, 99.9, NextStep(Step.BACK_OFF)),
    # No record of a dead owner: a first clone.
    (None, None, 0.0, NextStep(Step.CLONE, 0)),
    # A dead owner's record: clone again, telling the worker how many died before it.
    (None, 0, 0.0, NextStep(Step.CLONE, 1)),
    (None, MAX_DEATHS - 2, 0.0, NextStep(Step.CLONE, MAX_DEATHS - 1)),
    # The MAX_DEATHS-th death in a row: give up (record WORKER_DIED), never clone again in a loop.
    (None, MAX_DEATHS - 1, 0.0, NextStep(Step.GIVE_UP, MAX_DEATHS)),
    (None, MAX_DEATHS + 5, 0.0, NextStep(Step.GIVE_UP, MAX_DEATHS + 6)),
    # A failure whose retry time has passed (exactly, or long ago) is retried: a clone.
    (failure(100.0), None, 100.0, NextStep(Step.CLONE, 0)),
    (failure(100.0, attempts=4), 1, 1e9, NextStep(Step.CLONE, 2)),
    (failure(100.0), MAX_DEATHS - 1, 100.0, NextStep(Step.GIVE_UP, MAX_DEATHS)),
])
def test_next_step_for_not_ready(fail, dead_owner_deaths, now, expected):
    assert next_step_for_not_ready(fail, dead_owner_deaths, now) == expected


def test_next_step_gives_up_at_the_given_max_deaths():
    assert next_step_for_not_ready(None, 0, 0.0, max_deaths=1) == NextStep(Step.GIVE_UP, 1)
    assert next_step_for_not_ready(None, None, 0.0, max_deaths=1) == NextStep(Step.CLONE, 0)
    assert MAX_DEATHS == 3


def test_backoff_doubles_up_to_the_cap():
    assert [backoff_seconds(n, 30, 900) for n in range(0, 8)] == [0, 30, 60, 120, 240, 480, 900, 900]
    assert backoff_seconds(10_000, 1, 60) == 60


@freeze_time("2026-11-29 12:00:00")
def test_failure_back_off_with_a_frozen_clock():
    now = time.time()
    first = next_failure(None, "UNREACHABLE", "m", "n", now, 30, 900)
    assert (first.attempts, first.retry_at - now) == (1, 30)
    second = next_failure(first, "UNREACHABLE", "m", "n", now, 30, 900)
    assert (second.attempts, second.retry_at - now) == (2, 60)
    assert state_of(CommitFacts(False, False, second, time.time())) is State.FAILED
    assert Failure.from_record(second.to_record()) == second
    assert Failure.from_record({"code": "X"}) is None


@pytest.mark.parametrize("text,seconds", [
    ("900", 900), ("15m", 900), ("1h", 3600), ("1h30m", 5400), ("2d", 172800), ("500ms", 0.5), ("0", 0), (5, 5)])
def test_durations(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["soon", "-5", "1y", "", "15 m", "m"])
def test_bad_durations(text):
    with pytest.raises(CheckoutCacheError) as err:
        parse_duration(text)
    assert err.value.code == "BAD_ARGUMENT"


@pytest.mark.parametrize("text,size", [("1024B", 1024), ("500M", 500 << 20), ("20G", 20 << 30), ("1.5K", 1536),
                                       ("2GiB", 2 << 30), ("3gb", 3 << 30)])
def test_sizes(text, size):
    assert parse_size(text) == size


@pytest.mark.parametrize("text", ["lots", "-1", "5X", "1e9", "1024"])  # a bare number: no unit
def test_bad_sizes(text):
    with pytest.raises(CheckoutCacheError):
        parse_size(text)


def test_free_targets():
    assert parse_free("10%") == FreeTarget(percent=10.0)
    assert parse_free("10%").bytes_of(1000) == 100
    assert parse_free("5G").bytes_of(1) == 5 << 30
    with pytest.raises(CheckoutCacheError):
        parse_free("150%")


def test_layout_paths_and_default_root(fs, monkeypatch):
    # pyfakefs: the layout is pure path arithmetic plus listing.
    monkeypatch.delenv("CHECKOUTCACHE_ROOT", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", "/home/u/.cache")
    assert default_root() == "/home/u/.cache/checkoutcache"
    monkeypatch.setenv("CHECKOUTCACHE_ROOT", "/srv/cc")
    assert default_root() == "/srv/cc"
    paths = RootPaths("/srv/cc").repo("k" * 32)
    sha = "a" * 40
    assert paths.checkout(sha) == f"/srv/cc/repos/{'k' * 32}/checkouts/{sha}"
    assert paths.ready_marker(sha).endswith(f"checkouts/{sha}/.git/checkoutcache-ready")
    assert paths.scratch_dir_for(42, "ab12").endswith("scratch/.clone-42-ab12")
    assert RepoPaths.scratch_pid(".clone-42-ab12") == 42 and RepoPaths.scratch_pid("other") is None
    fs.create_dir(paths.checkout(sha))
    fs.create_dir(paths.checkout("b" * 40))
    fs.create_file(paths.checkouts_dir + "/stray.txt")
    assert paths.checkout_names() == ["a" * 40, "b" * 40]
    assert RootPaths("/srv/cc").repo_keys() == ["k" * 32]


def test_config_from_env_and_overrides():
    config = Config.from_env({"CHECKOUTCACHE_GRACE": "5m", "CHECKOUTCACHE_MAX_CHECKOUTS": "3"}, max_checkouts="7")
    assert config.grace == 300 and config.max_checkouts == 7
    assert Config.from_env(config.to_env()) == config
    with pytest.raises(CheckoutCacheError):
        Config.from_env({"CHECKOUTCACHE_TRANSPORT": "carrier-pigeon"})
    table = options_table()
    for field in attrs.fields(Config):
        assert field.metadata["env"] in table


def test_every_error_code_has_a_message_and_next_step():
    for entry in CODES.values():
        assert entry.message and entry.next and entry.kind in ("input", "failure")


# ------------------------------------------------------------ cones (sparse checkouts)

def test_a_cone_has_one_spelling_and_its_own_digest():
    from checkoutcache.cones import cone_digest, parse_cone

    assert parse_cone(None) == parse_cone([]) == ()
    assert parse_cone(["b/", "a", "a/x/y", "b"]) == ("a", "b")  # sorted, unique, nested ones folded in
    assert parse_cone(["services/alpha/"]) == parse_cone(["services/alpha", "services/alpha/src"])
    assert cone_digest(("a", "b")) == cone_digest(parse_cone(["b", "a/"]))
    assert len({cone_digest(("a",)), cone_digest(("b",)), cone_digest(("a", "b")), cone_digest(("ab",))}) == 4
    assert parse_cone(["ab", "a"]) == ("a", "ab")  # "ab" is not inside "a"


@pytest.mark.parametrize("bad", [["/x"], ["a/../b"], [".."], ["./a"], ["a//b"], [".git"], ["x/.GIT/y"], [""],
                                 ["/"], ["a\tb"], ["a\x7f"], ["caf\udce9"], "a", [b"a"], [1], ["a" * 1025],
                                 ["d"] * 257])
def test_a_bad_cone_is_refused(bad):
    from checkoutcache.cones import parse_cone

    with pytest.raises(CheckoutCacheError) as err:
        parse_cone(bad)
    assert err.value.code == "BAD_ARGUMENT"


def test_what_a_cone_holds_is_what_git_cone_mode_checks_out():
    from checkoutcache.cones import contains, pathspecs

    cone = ("a/b/c", "d")
    inside = [b"top.txt", b"a/x.txt", b"a/b/y.txt", b"a/b/c/z.txt", b"a/b/c/deep/w", b"d/e/f", b".gitmodules"]
    outside = [b"a/q/r.txt", b"a/b/cc/z.txt", b"e/f", b"dd/x"]
    assert all(contains(cone, p) for p in inside) and not any(contains(cone, p) for p in outside)
    assert contains((), b"any/where")
    assert pathspecs(cone) == [":(glob)*", ":(glob)a/*", ":(glob)a/b/*", ":(literal)a/b/c/", ":(literal)d/"]
