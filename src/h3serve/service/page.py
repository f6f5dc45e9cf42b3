"""The web page at `/` (docs/web.md): static files packaged in `service/web/`, plain HTML, CSS and JavaScript with no
build step and nothing fetched from elsewhere (these servers are often offline).

The page holds nothing private and adds no way in: every action it takes is a call to the public API, which the key
guards as it guards any client. So its files are served without a key, and under a Content-Security-Policy that
lets the page load only its own files and talk only to this server; the videos it plays are `blob:` URLs of MP4s it
fetched itself (a `<video src>` cannot send the bearer header).

The files are read once, when the app is built, into a fixed table: a request names a file of that table or gets a
404; nothing a client sends becomes a path.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from types import MappingProxyType

from fastapi.responses import Response

from h3serve.service.errors import ApiError, shown

INDEX = "index.html"
# The packaged files and their types; the HTML is served at /, the others at /web/{name}.
TYPES = {
    INDEX: "text/html; charset=utf-8",
    "page.css": "text/css; charset=utf-8",
    "page.js": "text/javascript; charset=utf-8",
}
CSP = "; ".join(
    (
        "default-src 'self'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' data: blob:",  # data: the empty favicon
        "media-src 'self' blob:",  # the fetched MP4s
        "connect-src 'self'",
        "object-src 'none'",
        "base-uri 'none'",
        "form-action 'none'",  # the forms are sent by the script, never by the browser
        "frame-ancestors 'none'",
    )
)
HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",  # revalidate: a server upgraded in place serves its new page at once
}


@dataclass(frozen=True)
class WebPage:
    """The page's files (name -> bytes), read once from the package."""

    files: Mapping[str, bytes]

    @classmethod
    def load(cls) -> WebPage:
        folder = resources.files("h3serve") / "service" / "web"
        return cls(MappingProxyType({name: (folder / name).read_bytes() for name in TYPES}))

    def response(self, name: str) -> Response:
        """One file with the page's headers; ApiError 404 for a name that is not one of the page's files."""
        body = self.files.get(name)
        if body is None:
            raise ApiError(404, "not_found", f"no file {shown(name)} here; the page's files: {', '.join(TYPES)}")
        return Response(body, media_type=TYPES[name], headers=HEADERS)
