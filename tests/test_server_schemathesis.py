"""Property-based requests generated from the served OpenAPI schema: none may get a 5xx."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings

from tests.server_process import running_server


def test_no_generated_request_gets_a_5xx(tmp_path: Path, default_model_dir: Path) -> None:
    # A short context bounds the work any generated request can ask for.
    with running_server(tmp_path, "--max-model-len", "96", "--kv-cache-memory-gib", "0.05") as server:
        schema = schemathesis.openapi.from_url(f"{server.url}/docs/openapi.json")
        operations = [result.ok() for result in schema.get_all_operations()]
        assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/v1/models"}
        statuses: dict[str, list[int]] = {op.label: [] for op in operations}
        for operation in operations:

            @given(case=operation.as_strategy())
            @settings(
                max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None
            )
            def no_5xx(case: Any) -> None:
                response = case.call(base_url=server.url, timeout=120)
                statuses[f"{case.method} {case.path}"].append(response.status_code)
                assert response.status_code < 500, (
                    f"{case.method} {case.path}: {response.status_code} {response.text[:500]}"
                )

            no_5xx()
        for route in ("POST /v1/completions", "POST /v1/chat/completions"):
            assert len(statuses[route]) >= 10
            assert 400 in statuses[route]
        assert server.process.poll() is None  # still alive
