"""Which errors are the link's to the Hub, not the Hub's answer: the prefetch tries those again (train/prefetch.py), for
a model, a dataset and an attention kernel alike, and words them as the network's."""

from __future__ import annotations

# huggingface_hub 1.16's retry (utils/_http.py, _http_backoff_base) closes its shared HTTP client on a ConnectError and
# then retries with that closed client, so a file request that cannot connect (datasets' README, a model's file) ends
# in this RuntimeError instead of the connection's error; fixed upstream in 1.27 (the client taken on each try), which
# needs a click newer than SkyPilot 0.14.1's pin (one lock holds both). The next request opens a new client, so the
# repo can be tried again (the prefetch's tries); a training rank mends the retry itself (mend_retries).
CLOSED_CLIENT = "Cannot send a request, as the client has been closed"


FIXED_IN = (1, 27)  # huggingface_hub's first release whose retry takes the shared client anew in its loop


def mend_retries() -> bool:
    """Make huggingface_hub 1.16's own retries work in this process (a training rank's loads of the model, the dataset
    and their files): the shared client it makes is one that, once closed, sends through the shared client that
    replaced it, so the retry after a ConnectError reaches the Hub again (5 tries, 1-8 s apart), as 1.27 does, instead
    of ending on CLOSED_CLIENT at once. False where there is nothing to mend (a fixed release, no huggingface_hub, done
    already). The launch side keeps the library as it is: it fails fast there and says the Hub cannot be reached."""
    try:
        import httpx
        import huggingface_hub
        from huggingface_hub.utils import _http
    except ImportError:
        return False
    try:
        version = tuple(int(part) for part in huggingface_hub.__version__.split(".")[:2])
    except ValueError:
        return False
    made = getattr(_http, "_GLOBAL_CLIENT_FACTORY", None)
    if version >= FIXED_IN or made is None or getattr(made, "orch_mended", False):
        return False

    class Reopening(httpx.Client):
        def send(self, request, **kwargs):
            if self.is_closed:  # closed by the retry's close_session(): the shared client that replaced it sends
                return _http.get_session().send(request, **kwargs)
            return super().send(request, **kwargs)

    def factory():
        client = made()
        if type(client) is httpx.Client:  # the library's own (a factory of the user's is left as it is)
            client.__class__ = Reopening
        return client

    factory.orch_mended = True  # type: ignore[attr-defined] - a mark on the function, read back above
    huggingface_hub.set_client_factory(factory)
    return True


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
