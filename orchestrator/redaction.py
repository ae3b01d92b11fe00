"""Secrets never reach logs, error messages or MLflow params: one place that hides them.

    redact_text("at postgresql://bob:p@ss/w0rd@db:5432/x, Authorization: Bearer abc")
        -> "at postgresql://***@db:5432/x, Authorization: ***"
    redact({"mlflow": {"tracking_uri": "https://u:pw@h/"}, "hf_token": "t", "headers": ["Cookie: s=1"]})
        -> {"mlflow.tracking_uri": "https://***@h/", "hf_token": "***", "headers": "['Cookie: ***']"}

A URI's userinfo runs from `scheme://` to the *last* `@` of the URI, since passwords may hold `@`, `/` or `:`
unescaped. An `@` after the first `/` counts only when the part before that `/` already shows userinfo (a `:`
or an `@`), so `https://host/users/@me` is left alone; `https://host:8080/a@b` is over-redacted, never leaked.
"""

from __future__ import annotations

import re
from typing import Any

# A secret-looking name: a secret word anywhere (words split by _ . - or camelCase), or a name ending in token or
# an api/access/secret/private key. `hf_token`, `aws_secret_access_key`, `apiKey`, `X-Api-Key` are secret;
# `max_new_tokens`, `stop_token_ids`, `tokenizer`, `s3_key` are not.
_SECRET_NAME = (
    r"(?:[A-Za-z0-9]+[_.-]|(?-i:[a-z0-9]+(?=[A-Z])))*"
    r"(?:(?:secret|password|passwd|passphrase|pass|pwd|credentials?|authorization|auth|cookie|private)"
    r"(?:[_.-][A-Za-z0-9]+)*|token|(?:api|access|secret|private)[_-]?key)"
)
_SECRET_KEY = re.compile(_SECRET_NAME, re.IGNORECASE)
_URI = re.compile(r"(?P<scheme>(?<![A-Za-z0-9+.-])[A-Za-z][A-Za-z0-9+.-]*://)(?P<rest>[^\s\"'`<>]+)")
_HEADER = re.compile(
    r"(?<![\w-])(?P<name>(?:proxy-)?authorization|(?:set-)?cookie|x-api-key|api-key|x-auth-token)"
    r"(?P<sep>\s*:\s*)[^\r\n\"']+",
    re.IGNORECASE,
)
_ASSIGNMENT = re.compile(
    rf"(?<![A-Za-z0-9_.])(?=[\w.-]{{1,80}}[\"']?\s*[=:])"  # an identifier start, at most 80 chars to the sign
    rf"(?P<key>{_SECRET_NAME})(?P<sep>[\"']?\s*[=:]\s*[\"']?)"
    r"(?:(?:bearer|basic)\s+)?[^\s\"'&;,]+",
    re.IGNORECASE,
)
_AUTH_SCHEME = re.compile(r"(?<![A-Za-z0-9])(?P<scheme>(?i:bearer)|Basic)\s+[A-Za-z0-9._~+/=-]+")
MAX_PARAM_CHARS = 6000


def is_secret_name(name: str) -> bool:
    """True for a config key or header name whose value is a secret (`password`, `hf_token`, `apiKey`)."""
    return _SECRET_KEY.fullmatch(name) is not None


def _userinfo(match: re.Match) -> str:
    scheme, rest = match["scheme"], match["rest"]
    at = rest.rfind("@")
    authority = re.split(r"[/?#]", rest, maxsplit=1)[0]
    if at < 0 or (at > len(authority) and ":" not in authority and "@" not in authority):
        return match[0]
    return f"{scheme}***@{rest[at + 1 :]}"


def redact_text(text: str) -> str:
    """`text` (an error message, a log line, a URI) with URI passwords, Authorization / Cookie header values,
    `Bearer` / `Basic` credentials and `secret_name=value` pairs replaced by `***`."""
    text = _URI.sub(_userinfo, text)
    text = _HEADER.sub(r"\g<name>\g<sep>***", text)
    text = _ASSIGNMENT.sub(r"\g<key>\g<sep>***", text)
    return _AUTH_SCHEME.sub(r"\g<scheme> ***", text)


def _scrub(value: Any, secret: bool = False) -> Any:
    """The same structure with every secret replaced: values under secret names, and secrets inside strings."""
    if secret and value not in (None, ""):
        return "***"
    if isinstance(value, dict):
        return {k: _scrub(v, is_secret_name(str(k))) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub(v) for v in value]
    if isinstance(value, str):
        return redact_text(value)
    return value


def redact_tree(value: Any) -> Any:
    """The same nested structure with every secret replaced by `***` (a config kept as JSON beside an artifact)."""
    return _scrub(value)


def redact(params: dict, prefix: str = "") -> dict[str, str]:
    """Flatten a nested config to dotted keys (lists stay one value) with every secret replaced by `***`, so
    nothing secret reaches MLflow params or logged configs."""
    out: dict[str, str] = {}
    for key, value in params.items():
        name, secret = f"{prefix}{key}", is_secret_name(str(key))
        if isinstance(value, dict) and not secret:
            out.update(redact(value, f"{name}."))
        else:
            out[name] = str(_scrub(value, secret))[:MAX_PARAM_CHARS]
    return out
