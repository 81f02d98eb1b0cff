"""What a failed hub, network or disk operation means: a one-line explanation (message, hint) for
the user, with tokens scrubbed from anything shown. Sends no request and raises nothing of its
own; `hub.py` turns an explanation into its DownloadError.
"""

from __future__ import annotations

import errno
import re
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from urllib.parse import urlsplit

from huggingface_hub import constants
from huggingface_hub import errors as hf_errors

_TOKEN_LIKE = re.compile(r"hf_[A-Za-z0-9]{6,}")
_TOKEN_PAGE = "https://huggingface.co/settings/tokens"
# Exception class names (anywhere in the MRO) that mean "the network failed", across httpx,
# httpx2, requests and urllib3, without importing whichever of them this hub version uses.
_NETWORK_ERRORS = frozenset({
    "ConnectError", "ConnectTimeout", "ReadTimeout", "WriteTimeout", "PoolTimeout", "TimeoutException",
    "NetworkError", "ReadError", "WriteError", "RemoteProtocolError", "ProxyError", "SSLError",
    "ConnectionError", "ChunkedEncodingError", "ProtocolError", "NewConnectionError", "MaxRetryError",
})

Explanation = tuple[str, str]  # (one-line message, hint)


@dataclass(frozen=True)
class HubRequest:
    """What an explanation may mention about the failed request (never the token)."""

    repo_id: str
    revision: str = "main"
    filename: str | None = None
    endpoint: str | None = None


def explain_failure(exc: BaseException, req: HubRequest, has_token: bool) -> Explanation | None:
    """(message, hint) for a hub, network or disk failure; None for anything else (a bug)."""
    return _explain_hub(exc, req, has_token) or _explain_os(exc, req)


def _explain_hub(exc: BaseException, req: HubRequest, has_token: bool) -> Explanation | None:
    status = getattr(getattr(exc, "response", None), "status_code", None)
    if isinstance(exc, hf_errors.GatedRepoError):
        return _explain_gated(req, status, has_token)
    if isinstance(exc, hf_errors.RepositoryNotFoundError):
        fix = "make sure HF_TOKEN can read it" if has_token else "set HF_TOKEN"
        return (f"repo {req.repo_id} not found on {host(req.endpoint)}",
                f"check the name (aliases: 20b, 120b); if the repo is private, {fix}")
    if isinstance(exc, hf_errors.RevisionNotFoundError):
        return (f"revision '{req.revision}' not found in {req.repo_id}",
                "use a branch, tag or commit that exists (the default is main)")
    if isinstance(exc, hf_errors.LocalEntryNotFoundError):  # the library could not reach the hub
        return _explain_network(exc, req)
    if isinstance(exc, hf_errors.EntryNotFoundError):
        return (f"file {req.filename or '(unknown)'} not found in {req.repo_id} at revision {req.revision}",
                "the repo may have changed since it was listed; run the download again")
    if isinstance(exc, hf_errors.HfHubHTTPError) and status is not None:
        return _explain_status(status, req, has_token)
    return None


def _explain_gated(req: HubRequest, status: int | None, has_token: bool) -> Explanation:
    page = f"{public_base(req.endpoint)}/{req.repo_id}"
    if status == 403:
        return (f"your Hugging Face account has not been granted access to the gated repo {req.repo_id}",
                f"accept the licence at {page} while logged in as the owner of HF_TOKEN, then re-run")
    if has_token:
        return (f"the token was not accepted for the gated repo {req.repo_id}",
                f"check that HF_TOKEN is valid ({_TOKEN_PAGE}) and that its account accepted the licence at {page}")
    return (f"{req.repo_id} is a gated repo and no Hugging Face token was sent",
            f"accept the licence at {page}, create a read token at {_TOKEN_PAGE} and set HF_TOKEN")


def _explain_status(status: int, req: HubRequest, has_token: bool) -> Explanation:
    if status == 401 and has_token:
        return ("the Hugging Face token was rejected (401 Unauthorized)",
                f"HF_TOKEN is invalid or expired: create a new read token at {_TOKEN_PAGE}")
    if status == 401:
        return ("the hub requires authentication (401 Unauthorized)",
                f"create a read token at {_TOKEN_PAGE} and set HF_TOKEN")
    if status == 403:
        return (f"access to {req.repo_id} was refused (403 Forbidden)",
                "a fine-grained token needs read access to this repo; a gated repo needs its licence accepted")
    if status == 429:
        return ("the hub is rate-limiting this machine (429 Too Many Requests)",
                "wait a few minutes and run the download again; complete files are kept")
    if status >= 500:
        return (f"the hub answered with a server error ({status})", "try again later; complete files are kept")
    return (f"the hub answered HTTP {status} for {req.repo_id}", "run the download again; complete files are kept")


def _explain_os(exc: BaseException, req: HubRequest) -> Explanation | None:
    chain = list(_chain(exc))
    if any(isinstance(e, hf_errors.OfflineModeIsEnabled) for e in chain):
        return ("HF_HUB_OFFLINE is set, so nothing can be downloaded",
                "unset HF_HUB_OFFLINE, or use a model that is already downloaded")
    disk_full = next((e for e in chain if isinstance(e, OSError) and e.errno == errno.ENOSPC), None)
    if disk_full is not None:
        where = getattr(disk_full, "filename", None) or req.filename or "the download folder"
        return (f"disk full while writing {where}",
                "free some space, or download to another disk with --local-dir DIR (or HF_HUB_CACHE=DIR)")
    if any(_is_network_error(e) for e in chain):
        return _explain_network(exc, req)
    return None


def _explain_network(exc: BaseException, req: HubRequest) -> Explanation:
    return (f"connection to {host(req.endpoint)} failed ({_short_reason(exc)})",
            "check the connection (offline? proxy?), or set HF_ENDPOINT to a mirror; re-running resumes")


def _is_network_error(exc: BaseException) -> bool:
    if isinstance(exc, (ConnectionError, TimeoutError, socket.gaierror)):
        return True
    return any(cls.__name__ in _NETWORK_ERRORS for cls in type(exc).__mro__)


def _chain(exc: BaseException | None) -> Iterator[BaseException]:
    """`exc` and what caused it, outermost first (cycles and runaway chains cut off)."""
    seen: list[BaseException] = []
    while exc is not None and len(seen) < 16 and not any(exc is s for s in seen):
        seen.append(exc)
        yield exc
        exc = exc.__cause__ or exc.__context__


def _short_reason(exc: BaseException) -> str:
    root = list(_chain(exc))[-1]
    lines = str(root).strip().splitlines()
    return (f"{type(root).__name__}: {lines[0]}" if lines else type(root).__name__)[:120]


def scrub(text: str, secret: str | None) -> str:
    """Mask the token, and anything shaped like an HF token, in text a user will see."""
    if secret:
        text = text.replace(secret, "***")
    return _TOKEN_LIKE.sub("hf_***", text)


def public_base(endpoint: str | None) -> str:
    """The endpoint URL without any user:password part (a mirror URL may carry credentials)."""
    parts = urlsplit((endpoint or constants.ENDPOINT).rstrip("/"))
    name = parts.hostname or ""
    netloc = f"{name}:{parts.port}" if parts.port else name
    return f"{parts.scheme}://{netloc}{parts.path}"


def host(endpoint: str | None) -> str:
    return urlsplit(public_base(endpoint)).netloc
