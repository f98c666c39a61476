"""Which errors are the link's to the Hub, not the Hub's answer: the prefetch tries those again (train/prefetch.py), for
a model, a dataset and an attention kernel alike, and words them as the network's."""

from __future__ import annotations

# huggingface_hub 1.16's retry (utils/_http.py, _http_backoff_base) closes its shared HTTP client on a ConnectError and
# then retries with that closed client, so a file request that cannot connect (datasets' README, a model's file) ends
# in this RuntimeError instead of the connection's error; fixed upstream by 1.28, which needs a click newer than
# SkyPilot 0.14.1's pin (one lock holds both). The next request opens a new client, so the repo can be tried again.
CLOSED_CLIENT = "Cannot send a request, as the client has been closed"


def is_link(exc: BaseException) -> bool:
    """A timeout, a refused or dropped connection, or huggingface_hub's closed client."""
    import httpx

    if isinstance(exc, RuntimeError):
        return CLOSED_CLIENT in str(exc)
    return isinstance(exc, (httpx.TransportError, ConnectionError, TimeoutError))


def said(exc: BaseException, limit: int = 240) -> str:
    """What an error said, its first line with its whitespace folded and no trailing colon or period, at most `limit`
    characters ('' for an error that said nothing)."""
    lines = str(exc).strip().splitlines()
    return " ".join(lines[0].split()).rstrip(":.")[:limit] if lines else ""


def hub_failure(exc: BaseException) -> tuple[int, str] | None:
    """(status, what it said) of the Hub's own failure (a 5xx answer) in exc's chain, or None: the Hub answered
    otherwise (a publisher it does not know as an organization answers 404: the trust question stands) or was not
    reached (link_error)."""
    from huggingface_hub.errors import HfHubHTTPError

    seen: set[int] = set()
    found: BaseException | None = exc
    while found is not None and id(found) not in seen:
        response = getattr(found, "response", None) if isinstance(found, HfHubHTTPError) else None
        status = getattr(response, "status_code", 0) or 0
        if status >= 500:
            return status, " ".join(str(found).split("For more information")[0].split())[:200]  # not its link to MDN
        seen.add(id(found))
        found = found.__cause__ or found.__context__
    return None


def link_error(exc: BaseException) -> BaseException | None:
    """The first error in exc's chain (itself, then what caused it) that is the link's, or None: the Hub answered.
    Libraries above huggingface_hub wrap it (the kernels package's publisher check says 'could not verify publisher
    trust status' when the Hub cannot be reached at all)."""
    seen: set[int] = set()
    found: BaseException | None = exc
    while found is not None and id(found) not in seen:
        if is_link(found):
            return found
        seen.add(id(found))
        found = found.__cause__ or found.__context__
    return None
