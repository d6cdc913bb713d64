"""`/docs`: the API's routes, rendered on the server from its OpenAPI schema, with nothing loaded
from another host (Litestar's own pages load their scripts and fonts from CDNs, so an offline
machine shows a blank page). `/docs/openapi.json` stays the schema itself."""

from __future__ import annotations

import html
import json
from typing import Any

from litestar import Request
from litestar.openapi.plugins import OpenAPIRenderPlugin

STYLE = (
    "body{font:15px/1.5 system-ui,sans-serif;margin:24px auto;max-width:960px;padding:0 16px;color:#1d1f21}"
    "h2{margin-top:28px;font-size:18px}code{background:#eef0f3;padding:1px 4px;border-radius:3px}"
    "details{margin:6px 0 14px}pre{background:#f6f7f9;padding:10px;overflow-x:auto;font-size:13px}"
    ".method{display:inline-block;min-width:56px;font-weight:bold}"
)


class PlainDocsRenderPlugin(OpenAPIRenderPlugin):
    """The routes, each with its summary, description and request body schema, as plain HTML."""

    def __init__(self) -> None:
        super().__init__(path="/", favicon="<link rel='icon' href='data:,'>", style=f"<style>{STYLE}</style>")

    def render(self, request: Request[Any, Any, Any], openapi_schema: dict[str, Any]) -> bytes:
        info = openapi_schema.get("info", {})
        title = html.escape(f"{info.get('title', 'API')} {info.get('version', '')}")
        parts = [
            f"<!doctype html><html><head><meta charset='utf-8'><title>{title}</title>{self.favicon}{self.style}</head><body>",
            f"<h1>{title}</h1><p>The OpenAPI schema: <a href='openapi.json'>openapi.json</a>. "
            "The fields each route takes are in the project's docs/api.md.</p>",
        ]
        for path, operations in openapi_schema.get("paths", {}).items():
            for method, operation in operations.items():
                if not isinstance(operation, dict):
                    continue
                summary = html.escape(operation.get("summary") or "")
                parts.append(
                    f"<h2><span class='method'>{html.escape(method.upper())}</span> <code>{html.escape(path)}</code></h2>"
                    f"<p>{summary}</p>"
                )
                description = operation.get("description")
                if description:
                    parts.append(f"<p>{html.escape(description)}</p>")
                body = operation.get("requestBody")
                if body:
                    schema = json.dumps(body, indent=2)
                    parts.append(f"<details><summary>request body</summary><pre>{html.escape(schema)}</pre></details>")
        parts.append("</body></html>")
        return "".join(parts).encode()
