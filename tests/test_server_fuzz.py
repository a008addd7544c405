"""Schema fuzzing: schemathesis generates valid and invalid requests for every operation of /openapi.json and sends
them to a live server. None may get a 5xx; responses must have the documented status codes, content types and
bodies; invalid data must be rejected (4xx) and valid data accepted."""

from __future__ import annotations

import hypothesis
import pytest

schemathesis = pytest.importorskip("schemathesis")

from schemathesis.checks import not_a_server_error  # noqa: E402
from schemathesis.specs.openapi.checks import (content_type_conformance, negative_data_rejection,  # noqa: E402
                                               response_schema_conformance, status_code_conformance)

from test_server_helpers import one_torch_thread  # noqa: F401,E402  (an autouse fixture)
from test_server_helpers import metric_values, serve  # noqa: E402

MAX_EXAMPLES = 30


@pytest.fixture(scope="module")
def fuzz_server(tiny_pair, tokenizer):
    # A small max_tokens limit keeps every valid generation short.
    srv = serve(tiny_pair, tokenizer, max_tokens_limit=8, max_batch_size=4, request_timeout=30)
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("POST", "/predict"),
              ("GET", "/v1/models"), ("GET", "/v1/models/{model}"), ("GET", "/health"), ("GET", "/metrics")]


def test_schema_lists_every_operation(api_schema):
    found = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


# schemathesis' own pytest integration (from_fixture / parametrize) does not run under this pytest version, so
# each operation is fuzzed with its Hypothesis strategy directly: the same generation and the same checks.
# Negative data needs something to break: a JSON body (a string path parameter has no invalid value).
CASES = [(m, p, "positive") for m, p in OPERATIONS] + [(m, p, "negative") for m, p in OPERATIONS if m == "POST"]


@pytest.mark.parametrize("method,path,mode", CASES, ids=[f"{m} {p} {mode}" for m, p, mode in CASES])
def test_openapi_fuzz(api_schema, fuzz_server, method, path, mode):
    from schemathesis import GenerationMode

    operation = api_schema[path][method]
    strategy = operation.as_strategy(GenerationMode(mode))

    statuses = []

    @hypothesis.given(case=strategy)
    @hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, derandomize=True, database=None,
                         suppress_health_check=list(hypothesis.HealthCheck), phases=[hypothesis.Phase.generate])
    def fuzz(case):
        if mode == "positive" and isinstance(case.body, dict):
            case.body.pop("timeout", None)  # a valid deadline may pass: its documented answer is a 504
        # stream=true answers text/event-stream, which the schema describes only in words
        checks = [not_a_server_error, status_code_conformance]
        if mode == "negative":
            checks.append(negative_data_rejection)
        if not (isinstance(case.body, dict) and case.body.get("stream") is True):
            checks += [content_type_conformance, response_schema_conformance]
        response = case.call_and_validate(base_url=fuzz_server.url, checks=checks, timeout=30)
        statuses.append(response.status_code)

    fuzz()
    if mode == "positive" and method == "POST":
        # the schema documents the server's limits, so most valid data really is generated from
        ok = sum(200 <= code < 300 for code in statuses)
        assert ok >= len(statuses) // 2, statuses


def test_fuzzing_left_no_5xx(fuzz_server):
    """The server's own count agrees: no request, however malformed, got a 5xx."""
    values = metric_values(fuzz_server.url)
    errors = {labels: v for (name, labels), v in values.items()
              if name == "specdecode_requests_total" and dict(labels)["status"].startswith("5")}
    assert not errors, errors
