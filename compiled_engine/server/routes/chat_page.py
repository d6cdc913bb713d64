"""`GET /` and `GET /chat/{name}`: the chat page (server/chat_page/), not behind the API key;
every call the page makes carries the key."""

from __future__ import annotations

from pathlib import Path

from litestar import Controller, Response, get
from litestar.params import FromPath

from compiled_engine.server.common.errors import ApiError

CHAT_PAGE_DIR = Path(__file__).parent.parent / "chat_page"
# The page's files (read once: they ship with the package), with their media types.
CHAT_PAGE_FILES = {
    name: ((CHAT_PAGE_DIR / name).read_bytes(), media_type)
    for name, media_type in (
        ("index.html", "text/html; charset=utf-8"),
        ("chat.js", "text/javascript; charset=utf-8"),
        ("chat.css", "text/css; charset=utf-8"),
    )
}


class ChatPageController(Controller):
    @get("/", sync_to_thread=False, media_type="text/html; charset=utf-8", include_in_schema=False)
    def chat_page(self) -> bytes:
        """The chat page (not behind the API key; every call it makes carries the key)."""
        return CHAT_PAGE_FILES["index.html"][0]

    @get("/chat/{name:str}", sync_to_thread=False, include_in_schema=False)
    def chat_page_file(self, name: FromPath[str]) -> Response[bytes]:
        if name not in CHAT_PAGE_FILES or name == "index.html":
            raise ApiError(404, f"no such file: {name}", "not_found_error")
        content, media_type = CHAT_PAGE_FILES[name]
        return Response(content, media_type=media_type)
