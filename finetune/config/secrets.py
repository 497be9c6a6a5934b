"""Secrets: which keys hold one, how they are shown, and credentials written into URLs.
A secret is never written to the run directory, a log or an error message. Torch-free,
imports nothing of finetune."""

from __future__ import annotations

import re
from typing import Any

REDACTED = "<redacted>"
_SECRET = re.compile(r"(^|_)(token|api_key|apikey|password|secret|access_key)$")
_NOT_SECRET = re.compile(r"^(pad|eos|bos|unk|sep|cls|mask)_token$")
# user:password@ (or a bare token@) after a URL scheme; one slash too, as a path
# normalisation leaves `https:/user:pw@host`.
CREDENTIALS = re.compile(r"(?i)\b([a-z][a-z0-9+.-]*:/{1,2})[^\s/@]+@")
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def is_secret(key: str) -> bool:
    return bool(_SECRET.search(key)) and not _NOT_SECRET.match(key)


def redact(value: Any) -> Any:
    """A copy with the values of secret keys replaced by REDACTED."""
    if isinstance(value, dict):
        return {k: (REDACTED if is_secret(str(k)) and v else redact(v)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    return value


def scrub(text: str) -> str:
    """Credentials out of a message; control characters escaped, so it stays one line."""
    text = CREDENTIALS.sub(r"\1<redacted>@", text)
    return _CONTROL.sub(lambda m: repr(m.group())[1:-1], text)
