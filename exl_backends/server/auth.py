"""The API key: on by default. With no key given, one is generated at first start and stored in the user's config
directory ($XDG_CONFIG_HOME/exl-backends/api_key, else ~/.config/exl-backends/api_key; mode 0600), and reused
after. Clients send it as `Authorization: Bearer KEY` (what the openai client does) or `x-api-key: KEY`; it is
compared in constant time, and a 401 says exactly which header to send and where the key is."""
from __future__ import annotations

import hmac
import logging
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..paths import config_dir
from .errors import APIError

log = logging.getLogger(__name__)

KEY_PREFIX = "sk-exl-"


def key_file() -> Path:
    return config_dir() / "api_key"


@dataclass(frozen=True)
class ApiKey:
    value: str
    path: Path | None = None        # the file it is stored in; None: given when the server was started
    is_new: bool = False            # generated at this start


def load_or_create(path: Path | None = None) -> ApiKey:
    """The stored key; a new one (written with mode 0600, its folder 0700) when there is none yet."""
    path = path or key_file()
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:         # another server wrote it first: use that one
            return load_or_create(path)
        with os.fdopen(fd, "w") as f:
            f.write(key + "\n")
        return ApiKey(key, path, is_new=True)
    key = path.read_text().strip()
    if not key:
        raise ConfigError(f"{path} is empty: delete it to have a new key generated, or write a key into it")
    if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("%s can be read by other users: run `chmod 600 %s`", path, path)
    return ApiKey(key, path)


def masked(key: str) -> str:
    """Enough of a wrong key to recognise it, never the whole of it."""
    return key[:5] + "***" if len(key) >= 12 else "***"


class Auth:
    """Checks a request's key; None for both headers means the client sent none."""

    def __init__(self, key: ApiKey):
        self.key = key

    def check(self, bearer: str | None, x_api_key: str | None) -> None:
        given = [k for k in (bearer, x_api_key) if k]
        # compare_digest on bytes: constant time in the key's content (non-ASCII input is allowed too)
        if any(hmac.compare_digest(k.encode(), self.key.value.encode()) for k in given):
            return
        where = (f"is in {self.key.path}" if self.key.path is not None else
                 "is the one given with --api-key when the server started")
        how = f"send the header 'Authorization: Bearer <key>' (or 'x-api-key: <key>'); the key {where}"
        if given:
            message = f"Incorrect API key provided: {masked(given[0])}. To authenticate, {how}."
        else:
            message = f"Missing API key. To authenticate, {how}."
        raise APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
