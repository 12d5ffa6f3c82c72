"""benchmarks/fleet.py counts objects at the upstream (benchmarks/countingproxy.py
reads pack headers out of upload-pack responses) and judges its bars: the reader is tested on
made-up streams cut at every byte and on real clones through its proxy (git
daemon, protocol v0 and v2), the bars on canned reports."""

from __future__ import annotations

import copy
import subprocess

import pytest

from .helpers import daemons  # noqa: F401 - puts benchmarks/ on the path

import countingproxy  # noqa: E402  (benchmarks/countingproxy.py)
import fleet  # noqa: E402  (benchmarks/fleet.py)



def pkt(payload: bytes) -> bytes:
    return b"%04x" % (len(payload) + 4) + payload


def pack(count: int, body: bytes = b"\x95\x0bxx-compressed-objects-xx" * 40) -> bytes:
    return b"PACK" + (2).to_bytes(4, "big") + count.to_bytes(4, "big") + body


def sideband(data: bytes, size: int = 7) -> bytes:
    """Pack data in channel-1 pkt-lines of `size` bytes (small, so the header spans several), with
    progress lines in between."""
    out = b""
    for start in range(0, len(data), size):
        out += pkt(b"\x01" + data[start:start + size])
        if start == size:
            out += pkt(b"\x02Counting objects: 50% (1/2)\r")
    return out


V2_FETCH = (pkt(b"version 2\n") + pkt(b"agent=git/2.39.5\n") + pkt(b"ls-refs=unborn\n") + pkt(b"fetch=shallow\n")
            + b"0000"
            + pkt(b"acknowledgments\n") + pkt(b"NAK\n") + b"0001"  # a first round: no pack yet
            + pkt(b"packfile\n") + pkt(b"\x02Enumerating objects: 7\n") + sideband(pack(1234)) + b"0000")
V0_FETCH = (pkt(b"a" * 40 + b" HEAD\0multi_ack side-band-64k ofs-delta\n") + pkt(b"a" * 40 + b" refs/heads/main\n")
            + b"0000" + pkt(b"NAK\n") + sideband(pack(70000), size=65515) + b"0000")
V0_RAW = pkt(b"a" * 40 + b" refs/heads/main\0ofs-delta\n") + b"0000" + pkt(b"NAK\n") + pack(5)
TWO_PACKS = (pkt(b"packfile\n") + sideband(pack(3)) + b"0000"
             + pkt(b"packfile\n") + sideband(pack(2 ** 32 - 1)) + b"0000")


@pytest.mark.parametrize("stream,counts", [(V2_FETCH, [1234]), (V0_FETCH, [70000]), (V0_RAW, [5]),
                                           (TWO_PACKS, [3, 2 ** 32 - 1]),
                                           (pkt(b"a" * 40 + b" refs/heads/main\n") + b"0000", [])])
@pytest.mark.slow
def test_pack_headers_whole_and_cut_at_every_byte(stream, counts):
    whole = countingproxy.PackHeaders()
    whole.feed(stream)
    assert (whole.counts, whole.unparsed) == (counts, False)
    for cut in range(1, len(stream)):
        parts = countingproxy.PackHeaders()
        parts.feed(stream[:cut])
        parts.feed(stream[cut:])
        assert (parts.counts, parts.unparsed) == (counts, False), cut
    one_by_one = countingproxy.PackHeaders()
    for index in range(len(stream)):
        one_by_one.feed(stream[index:index + 1])
    assert one_by_one.counts == counts


def test_a_stream_that_is_not_pkt_lines_is_flagged_not_counted():
    reader = countingproxy.PackHeaders()
    reader.feed(b"HTTP/1.1 200 OK\r\n\r\n" + pack(9))
    assert reader.unparsed and reader.counts == []
    reader = countingproxy.PackHeaders()
    reader.feed(pkt(b"packfile\n") + pkt(b"\x01NOTAPACKHEADER"))
    assert reader.unparsed and reader.counts == []


@pytest.mark.parametrize("version", ["0", "2"])
def test_proxy_counts_the_objects_a_clone_receives(tmp_path, version):
    import make_repo  # benchmarks/ is on the path once fleet.py is loaded
    from gitdaemon import GitDaemon

    served = tmp_path / "served"
    make_repo.generate(str(served / "repo"), commits=20, files=30, file_size=512, depth=1, changes=3, seed=4)
    daemon = GitDaemon(str(served))
    proxy = countingproxy.CountingProxy(daemon.port, "test")
    try:
        proxy.label = "clone"
        target = tmp_path / "clone.git"
        subprocess.run(["git", "-c", f"protocol.version={version}", "clone", "-q", "--mirror",
                        f"git://127.0.0.1:{proxy.port}/repo", str(target)], check=True)
        proxy.wait_idle()
        tally = proxy.tally("clone")
    finally:
        proxy.stop()
        daemon.stop()
    stored = subprocess.run(["git", "-C", str(target), "count-objects", "-v"], capture_output=True, text=True,
                            check=True).stdout
    in_pack = int(dict(line.split(": ") for line in stored.splitlines())["in-pack"])
    assert tally["objects"] == in_pack > 0 and tally["packs"] == [in_pack]
    assert tally["unparsed"] == 0 and tally["still_open"] == 0 and tally["bytes"] > in_pack


def summary(objects_max: float, first_median: float, errors: int = 0) -> dict:
    return {"objects_per_node": {"mean": objects_max, "max": objects_max},
            "first_ready_s": {"median": first_median}, "errors": errors}


GOOD = {"full_clone": {"objects": 10000},
        "summary": {"unseeded": summary(9990, 2.0), "seeded": summary(500, 1.5)}}


def test_bars_met():
    results = fleet.bars(GOOD)
    assert [bar["met"] for bar in results] == [True, True, True]
    assert fleet.exit_status(results, check=True) == 0


def test_a_bar_exactly_at_its_limit_is_met():
    report = copy.deepcopy(GOOD)
    report["summary"]["seeded"] = summary(500, 2.0)  # 5% of 10000 objects; 1.0x the time
    assert all(bar["met"] for bar in fleet.bars(report))


@pytest.mark.parametrize("seeded,unseeded_errors", [(summary(501, 1.5), 0), (summary(500, 2.01), 0),
                                                    (summary(500, 1.5, errors=1), 0), (summary(500, 1.5), 2)])
def test_a_missed_bar_fails_only_under_check(seeded, unseeded_errors):
    report = copy.deepcopy(GOOD)
    report["summary"]["seeded"] = seeded
    report["summary"]["unseeded"]["errors"] = unseeded_errors
    results = fleet.bars(report)
    assert [bar["met"] for bar in results].count(False) == 1
    assert fleet.exit_status(results, check=True) == 1
    assert fleet.exit_status(results, check=False) == 0


def test_without_seeding_the_seeding_bars_are_not_run():
    report = copy.deepcopy(GOOD)
    del report["summary"]["seeded"]
    results = fleet.bars(report)
    assert [bar["met"] for bar in results] == [None, None, True]
    assert fleet.exit_status(results, check=True) == 0
