from test_server_fuzz import fuzz_server, api_schema, one_torch_thread  # noqa
import pytest
from test_server_helpers import metric_values
def test_zz_report(fuzz_server):
    v = metric_values(fuzz_server.url)
    for (n, l), val in sorted(v.items()):
        if n == "specdecode_requests_total": print(dict(l), val)
