"""An honest review's new commit while one token floods serve (issue 33, "Nothing bounds
concurrent clone workers"): the ratio of its answer time under the flood to its answer
time alone, in one run.

The flood: one token asks for FLOOD new commits of its repository at once (`wait: 0`),
every fetch held by a server that answers slowly (a gated proxy whose gate stays shut
for the whole measurement, as a tarpit would), and parks PARKED requests waiting on them
(`wait: 60`). The honest review: another token, another repository on a plain git
daemon, asks a new commit with `wait: 60`. Before the bound, the flood's workers and
parked waits took every worker and waiting slot (the honest request got SERVER_BUSY);
the bar is that the honest answer stays within its usual time (ratio about 1).

    python benchmarks/flood.py [--rounds 3] [--json-out flood.json]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import http.client
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from benchmarks.gitdaemon import GitDaemon, free_port  # noqa: E402
from tests.helpers.gate import GatedProxy  # noqa: E402
from tests.helpers.repos import Upstream  # noqa: E402

FLOOD, PARKED = 24, 64
FLOODER = "flood-" + "f" * 26
HONEST = "honest-" + "h" * 25


def ask(port: int, token: str, repo: str, sha: str, wait: float) -> tuple[int, dict, float]:
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=wait + 120)
    conn.request("POST", "/v1/ensure", json.dumps({"repo": repo, "commit": sha, "wait": wait}),
                 {"Authorization": f"Bearer {token}", "Content-Type": "application/json"})
    response = conn.getresponse()
    body = json.loads(response.read())
    conn.close()
    return response.status, body, time.perf_counter() - started


def start_serve(root: str, work: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    tokens = os.path.join(work, "tokens")
    with open(tokens, "w") as handle:
        handle.write(f"{FLOODER}\n{HONEST}\n")
    ready = os.path.join(work, f"ready-{port}")
    proc = subprocess.Popen([sys.executable, "-m", "checkoutcache", "--root", root, "serve", "--listen",
                             f"127.0.0.1:{port}", "--token-file", tokens, "--ready-file", ready,
                             "--gc-interval", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": os.path.dirname(HERE)})
    deadline = time.monotonic() + 30
    while not os.path.exists(ready):
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError("serve did not start")
        time.sleep(0.05)
    return proc, port


def one_round(work: str) -> dict:
    served = os.path.join(work, "served")
    os.makedirs(served)
    daemon = GitDaemon(served)
    flood = Upstream(os.path.join(served, "flood"))
    flood.standard_history(FLOOD + 2)
    honest = Upstream(os.path.join(served, "honest"))
    honest.standard_history(3)
    gate = GatedProxy(daemon.port)
    flood_url, honest_url = gate.url("flood"), daemon.url("honest")
    proc, port = start_serve(os.path.join(work, "cache"), work)
    try:
        # Both repositories' mirrors first (each new repository probes and makes a mirror once).
        assert ask(port, FLOODER, flood_url, flood.shas[0], 120)[0] == 200
        assert ask(port, HONEST, honest_url, honest.shas[0], 120)[0] == 200
        status, _, alone = ask(port, HONEST, honest_url, honest.shas[1], 60)
        assert status == 200, status
        gate.shut()
        answers = [ask(port, FLOODER, flood_url, sha, 0)[0] for sha in flood.shas[1:FLOOD + 1]]
        with concurrent.futures.ThreadPoolExecutor(PARKED) as pool:
            parked = [pool.submit(ask, port, FLOODER, flood_url, flood.shas[1 + i % FLOOD], 60)
                      for i in range(PARKED)]
            time.sleep(2)  # let the parked requests take what they can (this is a benchmark, not a test)
            status, body, flooded = ask(port, HONEST, honest_url, honest.shas[2], 60)
            gate.open()
            refused = sum(1 for f in parked if f.result()[0] == 503)
        return {"alone_s": round(alone, 3), "flooded_s": round(flooded, 3), "honest_status": status,
                "honest_state": body.get("state"), "honest_error": body.get("error"),
                "flood_answers": {str(s): answers.count(s) for s in sorted(set(answers))},
                "flood_waits_refused": refused, "ratio": round(flooded / alone, 2)}
    finally:
        gate.open()
        proc.terminate()
        proc.wait(30)
        gate.close()
        daemon.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json-out")
    options = parser.parse_args(argv)
    rounds = []
    for number in range(options.rounds):
        with tempfile.TemporaryDirectory(prefix="cc-flood-") as work:
            rounds.append(one_round(work))
            print(json.dumps(rounds[-1]), flush=True)
    summary = {"rounds": rounds, "median_ratio": statistics.median(r["ratio"] for r in rounds),
               "honest_ready": sum(1 for r in rounds if r["honest_state"] == "ready"), "of": len(rounds)}
    print(json.dumps({k: v for k, v in summary.items() if k != "rounds"}))
    if options.json_out:
        with open(options.json_out, "w") as handle:
            json.dump(summary, handle, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
