"""Sizes are recorded at publish and measured again only after a use, so gc
and status cost grows with the number of checkouts, not of their files."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys

import pytest

from .helpers import make_idle, only_repo, run_cli, wait_ready, wait_until


def recorded_size(root: str, sha: str) -> dict:
    """The size record the worker writes just after the marker (readers never wait for its
    walk): a test that reads it right after a ready answer waits for it."""
    path = only_repo(root).size_record(sha)
    return wait_until(lambda: os.path.exists(path) and json.load(open(path)), what="the size record")


def checkout_sizes(report: dict) -> dict[str, int]:
    return {c["commit"]: c["size"] for r in report["repos"] for c in r["checkouts"]}


@pytest.mark.slow
def test_a_size_is_recorded_at_publish_and_measured_again_only_after_a_use(root, upstream):
    sha = upstream.shas[0]
    path = wait_ready(root, upstream.path, sha)["path"]
    record = recorded_size(root, sha)
    assert record["bytes"] > 0 and record["use_at_measure"] is not None
    make_idle(path, 3600)  # last used an hour ago
    # Files added without a use (no ready answer since): gc and status trust the record.
    with open(os.path.join(path, "build-output.bin"), "wb") as handle:
        handle.write(os.urandom(4 << 20))
    code, report, _ = run_cli("gc", root=root)
    assert code == 0 and report["totals_after"]["bytes"] == record["bytes"]
    assert checkout_sizes(run_cli("status", root=root)[1])[sha] == record["bytes"]
    # A use (the review that wrote them asks again): the next gc measures it anew.
    wait_ready(root, upstream.path, sha)
    code, report, _ = run_cli("gc", root=root)
    assert code == 0 and report["totals_after"]["bytes"] >= record["bytes"] + (4 << 20)
    assert checkout_sizes(run_cli("status", root=root)[1])[sha] == report["totals_after"]["bytes"]


@pytest.mark.slow
def test_a_missing_or_damaged_size_record_is_measured_again(root, upstream):
    sha = upstream.shas[1]
    wait_ready(root, upstream.path, sha)
    expected = recorded_size(root, sha)["bytes"]
    store = only_repo(root)
    with open(store.size_record(sha), "w") as handle:
        handle.write("{half a rec")
    assert checkout_sizes(run_cli("status", root=root)[1])[sha] == expected
    os.unlink(store.size_record(sha))
    code, report, _ = run_cli("gc", root=root)
    assert code == 0 and report["totals_after"]["bytes"] == expected
    assert json.load(open(store.size_record(sha)))["bytes"] == expected
    # An evicted checkout's record goes with it.
    code, report, _ = run_cli("gc", "--max-checkouts", "0", "--grace", "0", root=root)
    assert code == 0 and not os.path.exists(store.size_record(sha))


def hard_linked(directory: str, links: int = 300, size: int = 1 << 20) -> None:
    """One file of `size` bytes and `links` more names for it (a build's hard-linked outputs)."""
    os.makedirs(directory, exist_ok=True)
    first = os.path.join(directory, "blob.0")
    with open(first, "wb") as handle:
        handle.write(os.urandom(size))
    for number in range(1, links + 1):
        os.link(first, os.path.join(directory, f"blob.{number}"))


def test_a_file_hard_linked_300_times_is_measured_once(tmp_path):
    """Regression (issue 33): disk_usage counted a file once per link: 1 MiB with 300 links
    was 315 MB. A directory met again through a bind mount is the same inode too."""
    from checkoutcache.store.sizes import disk_usage

    hard_linked(str(tmp_path / "tree" / "out"))
    measured = disk_usage(str(tmp_path / "tree"))
    assert (1 << 20) <= measured < (1 << 20) + (64 << 10), measured
    # Two trees measured as one (a shared `seen`): the inode they share counts once.
    os.makedirs(tmp_path / "other")
    os.link(tmp_path / "tree" / "out" / "blob.0", tmp_path / "other" / "blob")
    seen: set = set()
    both = disk_usage(str(tmp_path / "tree"), seen) + disk_usage(str(tmp_path / "other"), seen)
    assert both < (1 << 20) + (64 << 10), both


@pytest.mark.slow
def test_hard_links_in_a_checkout_and_a_workspace_do_not_evict_idle_checkouts(root, upstream, monkeypatch):
    """Regression (issue 33): a workspace holding one 1 MiB file under 300 names counted
    315 MB against max-bytes, so every idle checkout was evicted, run after run. The same
    links in a checkout a review wrote into count 1 MiB too."""
    from checkoutcache.cache import Cache
    from checkoutcache.workspaces import make_workspace

    first, second = upstream.shas[0], upstream.shas[1]
    paths = {sha: wait_ready(root, upstream.path, sha)["path"] for sha in (first, second)}
    recorded = {sha: recorded_size(root, sha)["bytes"] for sha in (first, second)}
    # A review's build in the first checkout, then a use: gc measures it anew.
    hard_linked(os.path.join(paths[first], "build"))
    wait_ready(root, upstream.path, first)
    code, report, _ = run_cli("gc", root=root)
    assert code == 0, report
    grown = checkout_sizes(run_cli("status", root=root)[1])[first] - recorded[first]
    assert (1 << 20) <= grown < 2 << 20, grown
    monkeypatch.setenv("CHECKOUTCACHE_ROOT", root)
    with make_workspace(Cache(root), upstream.path, second) as made:
        assert made.made, made.answer
        hard_linked(os.path.join(made.path, "build"))
        for path in paths.values():
            make_idle(path, 3600)
        # Room for both checkouts and a workspace of a few MiB, far less than 300 MiB.
        limit = f"{recorded[first] + recorded[second] + (2 << 20) + (16 << 20)}B"
        code, report, _ = run_cli("gc", "--max-bytes", limit, "--grace", "0", root=root)
        assert code == 0, report
        assert report["workspaces"]["live"] == 1, report["workspaces"]
        assert (1 << 20) <= report["workspaces"]["bytes"] < 16 << 20, report["workspaces"]
        assert report["removed"] == [] and report["unmet"] == [], report
        assert all(os.path.isdir(path) for path in paths.values())


# Issue 33's review, findings 4 and 5: the walk of a tree a review controls (its live
# workspace, in a volume it writes while gc walks it) went by joined path names and listed
# each directory whole. The tests below failed before the walk went by descriptors.

MIB = 1 << 20


def files(directory, count: int, size: int = 0) -> None:
    os.makedirs(directory, exist_ok=True)
    payload = os.urandom(size)
    for number in range(count):
        fd = os.open(os.path.join(directory, f"{number:07d}"), os.O_CREAT | os.O_WRONLY, 0o644)
        try:
            os.write(fd, payload)
        finally:
            os.close(fd)


def reference_bytes(top: str) -> int:
    """What the tree holds, counted by the tests' own walker: each entry's st_blocks, an
    inode with several links once, nothing a symlink names."""
    from .helpers import walk

    seen, total = set(), 0
    for entry in walk(top):
        if entry.info.st_nlink > 1 and not entry.is_dir:
            if (entry.info.st_dev, entry.info.st_ino) in seen:
                continue
            seen.add((entry.info.st_dev, entry.info.st_ino))
        total += entry.info.st_blocks * 512
    return total


def test_a_tree_is_measured_as_the_disk_holds_it(tmp_path):
    """The writer's own trees (checkouts, spares, mirrors) measure what they did: nested
    directories, hard links, symlinks (to a big directory outside: its own blocks only),
    names of any bytes."""
    from checkoutcache.store.sizes import measure

    top = tmp_path / "tree"
    files(top / "a" / "b" / "c", 5, 20_000)
    hard_linked(str(top / "out"), links=20, size=MIB)
    files(tmp_path / "outside", 1, 4 * MIB)
    os.symlink(tmp_path / "outside", top / "a" / "link")
    odd = os.path.join(os.fsencode(top), b"\xff name\nwith a newline")
    os.mkdir(odd)
    with open(os.path.join(odd, b"file"), "wb") as handle:
        handle.write(os.urandom(50_000))
    usage = measure(str(top))
    assert usage.complete and usage.bytes == reference_bytes(str(top)), usage
    assert MIB + 5 * 20_000 < usage.bytes < 2 * MIB, usage


def swap_at(moment: str, top, monkeypatch) -> list[str]:
    """Make the walk meet what swap_walker.py made: when it opens x or y (moment "open"), the
    other is exchanged with `link` (as the review's inotify watch did); or (moment "stat")
    when it has stat'ed x or y as a directory, that very name is exchanged with `link`
    before the walk opens it. Returns the names swapped (the proof the swap happened)."""
    from .helpers import exchange

    swapped: list[str] = []
    real_open, real_scandir, real_stat = os.open, os.scandir, os.stat

    def name_of(path) -> str | None:
        return os.path.basename(os.fsdecode(path)) if isinstance(path, (str, bytes, os.PathLike)) else None

    def swap(name: str) -> None:
        exchange(os.path.join(top, name), os.path.join(top, "link"))
        swapped.append(name)

    if moment == "open":
        def other_of(path) -> None:
            if not swapped and name_of(path) in ("x", "y"):
                swap("y" if name_of(path) == "x" else "x")

        def opening(path, flags, *args, **kwargs):
            if flags & os.O_DIRECTORY:
                other_of(path)
            return real_open(path, flags, *args, **kwargs)

        def listing(path="."):
            other_of(path)
            return real_scandir(path)

        monkeypatch.setattr(os, "open", opening)
        monkeypatch.setattr(os, "scandir", listing)
    else:
        def stating(path, *args, dir_fd=None, follow_symlinks=True):
            info = real_stat(path, *args, dir_fd=dir_fd, follow_symlinks=follow_symlinks)
            if not swapped and dir_fd is not None and name_of(path) in ("x", "y") and stat.S_ISDIR(info.st_mode):
                swap(name_of(path))
            return info

        monkeypatch.setattr(os, "stat", stating)
    return swapped


@pytest.mark.parametrize("moment", ["open", "stat"])
def test_a_directory_swapped_for_a_symlink_while_the_walk_looks_is_never_followed(tmp_path, monkeypatch, moment):
    """Regression (review 33, finding 4): gc pushed x and y as paths, the review exchanged
    one with `link -> /usr` when gc opened the other, and gc listed /usr by name as the
    workspace's (6 GB counted, every checkout evicted for max-bytes). Here `link` names a
    directory of 8 MiB outside the tree; the tree holds 2 x 8 files of 16 KiB."""
    from checkoutcache.store.sizes import WORKSPACE_BOUNDS, measure

    files(tmp_path / "outside", 1, 8 * MIB)
    top = tmp_path / "ws" / "tree"
    for name in ("x", "y"):
        files(top / name, 8, 16 << 10)
    os.symlink(tmp_path / "outside", top / "link")
    swapped = swap_at(moment, str(top), monkeypatch)
    usage = measure(str(tmp_path / "ws"), bounds=WORKSPACE_BOUNDS)
    monkeypatch.undo()
    assert len(swapped) == 1, swapped  # the swap happened, in the walk's window
    assert 8 * (16 << 10) <= usage.bytes < 2 * MIB, usage  # one side at least, never what the link names
    assert os.path.islink(top / swapped[0])


@pytest.mark.slow
def test_a_directory_of_200000_entries_is_measured_in_bounded_memory(tmp_path):
    """Regression (review 33, finding 5): `list(os.scandir(dir))` held a whole listing: a
    review's million empty files took gc from 26 MB to 991 MB (serve's gc runs in a 2 GiB
    process: about two million OOM-killed it at each scheduled gc). 200,000 entries held
    158 MB of Python objects here; the walk keeps one entry at a time."""
    import tracemalloc

    from checkoutcache.store.sizes import measure

    top = tmp_path / "ws"
    files(top / "flat", 200_000)
    files(top / "flat" / "some", 10, 30_000)
    expected = reference_bytes(str(top))
    tracemalloc.start()
    try:
        usage = measure(str(top))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < MIB, f"{peak} bytes of Python objects at the walk's peak"
    assert usage.complete and usage.entries == 1 + 200_000 + 1 + 10 and usage.bytes == expected, usage


def in_a_mount_namespace(script: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh", *args],
                          capture_output=True, text=True, timeout=120)


MEASURE = ("import json, os, sys; from checkoutcache.store.sizes import measure; "
           "u = measure(sys.argv[1]); "
           "print(json.dumps({'bytes': u.bytes, 'partial': list(u.partial), "
           "'mounts': [p in {line.split()[4] for line in open('/proc/self/mountinfo')} for p in sys.argv[2:]]}))")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="mounts need root and unshare")
def test_a_mount_inside_the_tree_is_neither_counted_nor_entered(tmp_path):
    """Regression (review 33, finding 4's fix: never leave the tree's st_dev): a tmpfs
    mounted inside a tree (another st_dev) and a bind mount of a directory elsewhere on the
    same file system (the same st_dev: only mountinfo tells it) were walked and counted."""
    top = tmp_path / "tree"
    files(top / "own", 4, 16 << 10)
    (top / "tmpfs").mkdir()
    (top / "bind").mkdir()
    files(tmp_path / "elsewhere", 1, 4 * MIB)
    script = ('set -e; mount -t tmpfs -o size=16m tmpfs "$1/tmpfs"; '
              'head -c 4194304 /dev/urandom > "$1/tmpfs/big"; mount --bind "$2" "$1/bind"; '
              f'exec {sys.executable} -c "$3" "$1" "$1/tmpfs" "$1/bind"')
    done = in_a_mount_namespace(script, str(top), str(tmp_path / "elsewhere"), MEASURE)
    assert done.returncode == 0, done.stderr
    measured = json.loads(done.stdout)
    assert measured["mounts"] == [True, True], measured  # both were mounted where the walk looked
    assert 4 * (16 << 10) <= measured["bytes"] < MIB and measured["partial"] == [], measured


def test_past_a_bound_the_bytes_are_a_lower_bound_and_say_why(tmp_path):
    """Work per measurement is bounded when the caller says so: entries, time (0 s: the first
    look at the clock stops it), depth (directories deeper than MAX_DEPTH are counted as
    directories, not entered)."""
    from checkoutcache.store import sizes

    top = tmp_path / "ws"
    files(top / "many", 1200, 5000)
    whole = sizes.measure(str(top))
    assert whole.complete and whole.entries == 1201, whole
    by_entries = sizes.measure(str(top), bounds=sizes.Bounds(entries=400))
    assert by_entries.partial == (sizes.ENTRIES,) and by_entries.entries == 400, by_entries
    assert 0 < by_entries.bytes < whole.bytes / 2, (by_entries, whole)
    by_time = sizes.measure(str(top), bounds=sizes.Bounds(seconds=0))
    assert by_time.partial == (sizes.TIME,) and by_time.entries == sizes.TIME_CHECK_EVERY, by_time
    deep = tmp_path / "deep"
    bottom = os.path.join(deep, *["d"] * (sizes.MAX_DEPTH + 5))
    files(bottom, 1, 2 * MIB)
    shallow = sizes.measure(str(deep))
    assert shallow.partial == (sizes.DEPTH,) and shallow.bytes < MIB, shallow
    assert sizes.measure(os.path.join(deep, *["d"] * 10)).complete  # within the bound again: whole


def test_the_identities_a_measurement_keeps_are_capped(tmp_path, monkeypatch):
    """Only directories and files with several links are remembered, at most REMEMBERED of
    them; past that a multi-link file counts its share per link met, so a hard-link bomb
    still counts its blocks once and the memory stays bounded."""
    from checkoutcache.store import sizes

    monkeypatch.setattr(sizes, "REMEMBERED", 10)
    top = tmp_path / "tree"
    for number in range(40):  # 40 files of 64 KiB, each under two names
        files(top / f"d{number}", 1, 64 << 10)
        os.link(top / f"d{number}" / "0000000", top / f"d{number}" / "again")
    hard_linked(str(top / "out"), links=300, size=MIB)
    seen: set = set()
    usage = sizes.measure(str(top), seen)
    assert len(seen) == 10, len(seen)
    expected = reference_bytes(str(top))
    assert usage.complete and expected - (64 << 10) <= usage.bytes <= expected, (usage, expected)


def live_workspace(root, upstream, monkeypatch):
    """A real workspace of the upstream's first commit (made through the library), held."""
    from checkoutcache.cache import Cache
    from checkoutcache.workspaces import make_workspace

    monkeypatch.setenv("CHECKOUTCACHE_ROOT", root)
    made = make_workspace(Cache(root), upstream.path, upstream.shas[0], wait=60)
    assert made.made, made.answer
    return made


@pytest.mark.slow
def test_gc_counts_a_workspace_measured_in_part_as_its_bytes_and_says_so(root, upstream, monkeypatch):
    """Regression (review 33, findings 4 and 5: a bounded walk says when it stopped short):
    a workspace holding 4 MiB below MAX_DEPTH levels. gc's report lists it under
    workspaces.partial and problems, and the bytes it counted stand as the workspace's
    against max-bytes: nothing is evicted for what it could not see."""
    from checkoutcache.cli.output import gc_text
    from checkoutcache.store.sizes import MAX_DEPTH

    with live_workspace(root, upstream, monkeypatch) as made:
        name = os.path.basename(os.path.dirname(made.path))
        files(os.path.join(made.path, *["deep"] * (MAX_DEPTH + 2)), 1, 4 * MIB)
        recorded = recorded_size(root, upstream.shas[0])["bytes"]
        make_idle(made.source, 3600)
        code, report, err = run_cli("gc", "--grace", "0", "--max-bytes", f"{recorded + 2 * MIB}B", root=root)
        assert code == 0, err
        spaces = report["workspaces"]
        assert spaces["live"] == 1 and spaces["bytes"] < 2 * MIB, spaces
        assert spaces["partial"] == [{"workspace": name, "bytes": spaces["bytes"], "why": ["depth"],
                                      "entries": spaces["partial"][0]["entries"]}], spaces
        assert [p["error"] for p in report["problems"] if p["path"] == os.path.dirname(made.path)] == \
            ["SIZE_AT_LEAST"], report["problems"]
        assert report["removed"] == [] and report["unmet"] == [], report
        assert f"workspace {name} measured in part (depth): at least" in gc_text(report)  # gc's text says it too


@pytest.mark.slow
def test_gc_stops_a_workspace_walk_at_its_entries_bound(root, upstream, monkeypatch):
    """Regression (review 33, finding 5): the walk of a live workspace is bounded (a million
    entries by default: 3000 here), and gc says so."""
    from checkoutcache.cache import Cache
    from checkoutcache.config import Config
    from checkoutcache.store.sizes import Bounds
    from checkoutcache.upkeep import gc, workspace_upkeep

    with live_workspace(root, upstream, monkeypatch) as made:
        files(os.path.join(made.path, "build"), 5000, 4096)
        monkeypatch.setattr(workspace_upkeep, "WORKSPACE_BOUNDS", Bounds(entries=3000))
        report = gc.run_gc(Cache(root).paths, Config.from_env())
        (partial,) = report.workspaces["partial"]
        assert partial["why"] == ["entries"] and partial["entries"] == 3000, partial
        assert 0 < report.workspaces["bytes"] == partial["bytes"] < 5000 * 4096, report.workspaces
        assert "SIZE_AT_LEAST" in {p["error"] for p in report.problems}, report.problems


@pytest.mark.slow
def test_one_gc_run_walks_all_workspaces_within_one_budget(root, upstream, monkeypatch):
    """Regression (second review of issue 33, finding 4): only each workspace's walk was bounded,
    so a review's eight workspaces of a million hard links each held gc (and gc.lock) for 28 s,
    and more workspaces for longer. All of one run's walks share one budget (3000 entries
    here): the first workspace is walked whole, the second until the budget is spent, the third
    not at all, and gc says so for both."""
    from checkoutcache.cache import Cache
    from checkoutcache.config import Config
    from checkoutcache.store.sizes import Bounds
    from checkoutcache.upkeep import gc, workspace_upkeep

    with live_workspace(root, upstream, monkeypatch) as first, live_workspace(root, upstream, monkeypatch) as second, \
            live_workspace(root, upstream, monkeypatch) as third:
        for made in (first, second, third):
            files(os.path.join(made.path, "build"), 2000, 16)
        monkeypatch.setattr(workspace_upkeep, "WORKSPACES_BUDGET", Bounds(entries=3000))
        report = gc.run_gc(Cache(root).paths, Config.from_env())
        spaces = report.workspaces
        assert spaces["live"] == 3, spaces
        partial = sorted(spaces["partial"], key=lambda p: p["entries"], reverse=True)
        assert [p["why"] for p in partial] == [["entries"], ["budget"]], spaces
        assert partial[1]["entries"] == 0 and partial[1]["bytes"] == 0, spaces
        assert [p["error"] for p in report.problems].count("SIZE_AT_LEAST") == 2, report.problems
