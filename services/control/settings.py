"""Settings of the control plane, from ``XTOKEN_CONTROL_*`` environment variables and CLI flags."""

from __future__ import annotations

import ipaddress
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from services.control.body import BodyLimits


class Settings(BaseSettings):
    """The control plane's settings (env ``XTOKEN_CONTROL_<NAME>``, e.g. ``XTOKEN_CONTROL_TOKEN``)."""

    model_config = SettingsConfigDict(env_prefix="XTOKEN_CONTROL_", extra="ignore")

    host: str = Field("127.0.0.1", description="address to bind (non-loopback needs a token)")
    port: int = Field(8000, ge=0, le=65535, description="port to bind (0: any free port)")
    token: str | None = Field(
        None,
        description="bearer token that mutating calls must present (None: no check); from the "
        "environment or token_file only, never a flag: every local user can read a process's "
        "command line",
    )
    token_file: Path | None = Field(
        None,
        description="file holding the bearer token (its first line; surrounding whitespace "
        "dropped), instead of XTOKEN_CONTROL_TOKEN",
    )
    runs_root: Path = Field(Path("runs"), description="run directories live under it")
    data_root: Annotated[list[Path], NoDecode] = Field(
        default_factory=lambda: [Path("data")],
        description="roots of data, models, tokenizers and projections (comma-separated)",
    )
    db: Path | None = Field(None, description="SQLite file; None: RUNS_ROOT/control.db")
    launcher: str = Field("local", description="launcher of run processes: local or ray")
    ray_address: str | None = Field(None, description="Ray cluster address (launcher=ray)")
    max_body_bytes: int = Field(1 << 20, gt=0, description="largest request body accepted")
    max_config_depth: int = Field(
        32, gt=0, le=500, description="most levels of nesting of a submitted config"
    )
    max_config_aliases: int = Field(
        64, ge=0, description="most YAML aliases (*name) in a submitted config"
    )
    max_config_nodes: int = Field(
        100_000, gt=0, description="most values of a submitted config, its aliases expanded"
    )
    max_run_processes: int = Field(
        64,
        gt=0,
        description="most processes of one run (queue, collator workers, teachers, trainers)",
    )
    max_processes: int = Field(
        256, gt=0, description="most processes of all active runs of this control plane"
    )
    allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="Host names (comma-separated) that reads without the token may use "
        "besides loopback names and the bound address, when bound beyond loopback",
    )
    tick_s: float = Field(0.2, gt=0, description="seconds between two looks at a run")
    dead_after_s: float = Field(
        5.0, gt=0, description="a process without a heartbeat this long is dead"
    )
    queue: str | None = Field(
        None,
        description="address of a running queue server (tcp://HOST:PORT) that runs use when "
        "their config names none; None: each run starts its own queue",
    )

    @field_validator("token_file")
    @classmethod
    def _token_file_readable(cls, value: Path | None) -> Path | None:
        if value is not None:
            _read_token(value)  # ValueError names the file and what to do
        return value

    @model_validator(mode="after")
    def _token_from_file(self) -> Settings:
        if self.token_file is None:
            return self
        if self.token:
            raise ValueError(
                "both XTOKEN_CONTROL_TOKEN and XTOKEN_CONTROL_TOKEN_FILE (--token-file) are set; "
                "keep one"
            )
        self.token = _read_token(self.token_file)
        return self

    @field_validator("queue")
    @classmethod
    def _queue_address(cls, value: str | None) -> str | None:
        if not value:
            return None
        from services.supervise.config import QueueConfig

        QueueConfig(address=value)  # ValueError names the forms accepted
        return value

    @field_validator("data_root", "allowed_hosts", mode="before")
    @classmethod
    def _split_roots(cls, value: object) -> object:
        if isinstance(value, str):
            return [p for p in value.split(",") if p.strip()]
        return value

    @field_validator("launcher")
    @classmethod
    def _known_launcher(cls, value: str) -> str:
        if value not in ("local", "ray"):
            raise ValueError(f"launcher={value!r}: use local or ray")
        return value

    def body_limits(self) -> BodyLimits:
        """The limits of a submitted config's body."""
        return BodyLimits(self.max_config_depth, self.max_config_aliases, self.max_config_nodes)

    def host_allowed(self, host: str) -> bool:
        """A ``Host`` header's name is loopback, the bound address or an allowed host."""
        name = (urlsplit(f"//{host}").hostname or "") if host else ""
        if is_loopback(name):
            return True
        names = {h.strip().lower().strip("[]") for h in self.allowed_hosts if h.strip()}
        if self.host not in ("0.0.0.0", "::", ""):
            names.add(self.host.lower().strip("[]"))
        return name.lower() in names

    def db_path(self) -> Path:
        """The SQLite file."""
        return self.db or self.runs_root / "control.db"

    def check_bind(self) -> None:
        """Refuse to listen beyond loopback without a token.

        Raises:
            ValueError: a non-loopback host and no token (says how to fix it).
        """
        if self.token or is_loopback(self.host):
            return
        raise ValueError(
            f"refusing to bind {self.host!r} without a token: anyone who reaches it could start "
            "processes; set XTOKEN_CONTROL_TOKEN or XTOKEN_CONTROL_TOKEN_FILE (--token-file), "
            "or bind 127.0.0.1"
        )


def _read_token(path: Path) -> str:
    """The token in a token file: its first line, stripped.

    Raises:
        ValueError: the file cannot be read or holds no token (names it and the fix).
    """
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise ValueError(
            f"token_file={str(path)!r}: cannot read it ({reason}); give a readable file "
            "holding the token"
        ) from None
    lines = text.strip().splitlines()
    token = lines[0].strip() if lines else ""
    if not token:
        raise ValueError(f"token_file={str(path)!r} is empty; write the token into it")
    return token


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
