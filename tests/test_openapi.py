"""The OpenAPI 3.1 document of serve's API is valid, says what the code does
(every error code, with its HTTP status), is what /openapi.json serves, and
a fuzzer (schemathesis) finds no undocumented answer against a live serve.

The fuzzed serve may name no repository at all (an --allow-repo pattern no
URL matches, no local paths): nothing it is sent can reach a network."""

from __future__ import annotations

import json
import os

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from openapi_spec_validator import validate
from schemathesis.specs.openapi.checks import positive_data_acceptance

from checkoutcache.errors import CODES

from .helpers import TOKEN, Serve

DOCUMENT = os.path.join(os.path.dirname(__file__), "..", "checkoutcache", "serve", "openapi.json")
SPEC = json.load(open(DOCUMENT))


def test_the_document_is_valid_openapi_3_1():
    validate(SPEC)
    assert SPEC["openapi"].startswith("3.1")


def test_every_error_code_is_documented_with_its_http_status():
    assert SPEC["components"]["schemas"]["Error"]["properties"]["error"]["enum"] == sorted(CODES)
    documented = {}
    for path in SPEC["paths"].values():
        for operation in path.values():
            for status, response in operation["responses"].items():
                for code in CODES:
                    if f"{code}" in response.get("description", ""):
                        documented.setdefault(code, set()).add(int(status))
    assert "405 (METHOD_NOT_ALLOWED)" in SPEC["info"]["description"]  # no operation can declare it
    for code, entry in CODES.items():
        if code != "METHOD_NOT_ALLOWED" and (entry.kind == "input" or code in ("TOO_MANY_HOLDS", "SERVER_BUSY")):
            assert entry.http_status in documented.get(code, set()), (code, entry.http_status, documented.get(code))


def test_serve_serves_the_checked_in_document(root, tmp_path):
    running = Serve(root, tmp_path)
    try:
        assert running.client(token=None).openapi() == SPEC
    finally:
        running.stop()


@pytest.fixture(scope="module")
def fuzzed_serve(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    running = Serve(str(base / "cache"), base, "--allow-repo", "nothing-matches-this", "--max-wait", "1s")
    yield running
    running.stop()


# A request too large for the server's limits (a body over 64 KiB: 413; a request line
# or head over the HTTP server's: 414, 431) is rejected too, before it is parsed.
REJECTIONS = ["400", "401", "403", "404", "405", "406", "409", "413", "414", "415", "422", "428", "429", "431",
              "5xx"]
schema = schemathesis.openapi.from_path(DOCUMENT, config=schemathesis.config.SchemathesisConfig.from_dict(
    {"checks": {"negative_data_rejection": {"expected-statuses": REJECTIONS}}}))
# Whether a repository string is acceptable cannot be said in a schema (it is
# parsed, then weighed against the policy): schema-valid requests may be
# answered 400, so that one check is left out; every other check runs.
NOT_EXPRESSIBLE = [positive_data_acceptance]


@schema.parametrize()
@settings(max_examples=30, derandomize=True, deadline=None,
          suppress_health_check=list(HealthCheck))
@pytest.mark.slow
def test_the_fuzzer_finds_no_undocumented_answer(case, fuzzed_serve):
    case.call_and_validate(base_url=f"http://127.0.0.1:{fuzzed_serve.port}",
                           headers={"Authorization": f"Bearer {TOKEN}"}, excluded_checks=NOT_EXPRESSIBLE)


def test_the_document_lists_exactly_the_routes_serve_has():
    from checkoutcache.serve.app import ROUTES

    assert {path: sorted(m.upper() for m in ops) for path, ops in SPEC["paths"].items()} == \
        {path: sorted(methods) for path, methods in ROUTES.items()}


def properties(name: str) -> set[str]:
    """The fields a schema names, through allOf (Held is a Ready answer with its hold)."""
    schema = SPEC["components"]["schemas"][name]
    named = set(schema.get("properties", {}))
    for part in schema.get("allOf", []):
        named |= properties(part["$ref"].rsplit("/", 1)[1]) if "$ref" in part else set(part.get("properties", {}))
    return named


def test_the_document_names_every_field_an_answer_and_a_report_carries(tmp_path):
    """Regression: a queued clone's `queue`, and gc's problems, disk and totals_after, were
    sent and not in the document, so generated clients (the TypeScript one) typed them unknown."""
    import attrs

    from checkoutcache.answers import Answer
    from checkoutcache.config import Config
    from checkoutcache.store.layout import RootPaths
    from checkoutcache.upkeep.gc import GcReport
    from checkoutcache.upkeep.status import build_status

    answers = {field.name for field in attrs.fields(Answer)}
    assert {"queue", "progress", "merge_base", "retry_after"} <= answers  # the list is the real one
    assert answers <= properties("Ready") | properties("Cloning") | properties("Error")
    assert {"queue", "progress", "pid", "started_at"} <= properties("Cloning")
    assert {"hold", "expires_in", "path", "history", "merge_base"} <= properties("Held")
    report = GcReport(dry_run=True).to_json()
    assert len(report) > 10 and set(report) <= properties("GcReport")
    root = str(tmp_path / "cache")
    os.makedirs(os.path.join(root, "repos"))
    status = build_status(RootPaths(root), Config.from_env({}))
    assert "unreachable" in status and set(status) <= properties("Status")
