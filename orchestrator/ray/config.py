"""The Ray app's configuration (YAML, documented in deploy/ray/config.yaml), validated by
pydantic: unknown keys, wrong types and out-of-range values are refused, naming the key."""

from __future__ import annotations

from typing import Any, Literal

import pydantic
from pydantic import BaseModel, ConfigDict, Field

from orchestrator.generation import DECODE_ON
from orchestrator.routing import POLICIES
from specdec.config import MAX_DECODE_ON, ServiceConfig

# ServiceConfig fields the group sets itself (not through ``service``).
_GROUP_OWNED = {"model", "role", "host", "port"}


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServiceGroup(_Section):
    """The draft or target services: actors to start, or addresses of running ones."""

    role: Literal["target", "draft"]
    model: str
    replicas: int = Field(1, ge=1)
    addresses: list[str] = []  # HOST:PORT of running services: no actors
    resources: dict[str, float] | None = None  # custom resources per actor; None = {ROLE_node: 1}
    num_gpus: float = Field(0, ge=0)
    num_cpus: float = Field(1, ge=0)
    bind_host: str = "0.0.0.0"
    port: int = Field(0, ge=0, le=65535)  # 0 = any free port
    q_top_k: int = Field(64, ge=1)  # draft only: the top-N of its distribution it samples and sends
    service: dict[str, Any] = {}  # more ServiceConfig fields

    @pydantic.model_validator(mode="after")
    def _settle(self) -> "ServiceGroup":
        if self.addresses:
            self.replicas = len(self.addresses)
        if self.resources is None:
            self.resources = {f"{self.role}_node": 1}
        if any(v < 0 for v in self.resources.values()):
            raise ValueError("resources must map names to amounts >= 0")
        owned = sorted(_GROUP_OWNED & set(self.service))
        if owned:
            raise ValueError(f"service may not set {', '.join(owned)}: use {self.role}.model / "
                             "bind_host / port")
        self.service_config()  # validate now, not on a remote node later
        return self

    @property
    def uses_actors(self) -> bool:
        return not self.addresses

    def service_config(self) -> ServiceConfig:
        fields = dict(self.service)
        # A Ray actor may use num_cpus cores: give torch that many threads unless told.
        fields.setdefault("threads", max(1, int(self.num_cpus)))
        try:
            return ServiceConfig(model=self.model, role=self.role, host=self.bind_host,
                                 port=self.port, **fields)
        except TypeError as exc:
            raise ValueError(f"service: {exc}") from None

    def actor_name(self, app_name: str, index: int) -> str:
        """The name of the group's detached actor ``index`` (how replicas find the services
        ``ray-up`` started, and how ``--down`` stops them)."""
        return f"{app_name}-{self.role}-{index}"


class TlsOptions(_Section):
    """TLS of the orchestrator's channels to the services."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None
    server_name: str | None = None


class IngressOptions(_Section):
    """The Ray Serve deployment of the orchestrator."""

    replicas: int = Field(1, ge=1)
    ray_actor_options: dict[str, Any] = {"num_cpus": 1}
    max_ongoing_requests: int = Field(64, ge=1)
    routing: str = "least-loaded"  # or "hash"; see orchestrator.routing
    model_name: str = "specdec"  # the model name the HTTP API reports
    api_key: str | None = None  # None: $SPECDEC_API_KEY in the replica, if set
    tokenizer: str | None = None  # tokenizer for prompts; None = the target's model spec
    tls: TlsOptions | None = None  # None: $SPECDEC_TLS_* in the replica, if set
    ready_timeout_s: float = Field(900.0, gt=0)  # how long a replica waits for the services
    # plain target steps per call in a round with no draft block (--decode-on; 0: none)
    decode_on: int = Field(DECODE_ON, ge=0, le=MAX_DECODE_ON)

    @pydantic.field_validator("routing")
    @classmethod
    def _policy(cls, routing: str) -> str:
        if routing not in POLICIES:
            raise ValueError(f"must be one of {', '.join(POLICIES)}, got {routing!r}")
        return routing


class HttpOptions(_Section):
    host: str = "0.0.0.0"
    port: int = Field(8000, ge=1, le=65535)
    proxy_location: Literal["HeadOnly", "EveryNode"] = "HeadOnly"


class RayAppConfig(_Section):
    """Everything ``specdec ray-up`` and the Serve app builder need (see deploy/ray/config.yaml).

    No ``draft`` key: the default draft; ``draft: null``: no draft at all (target-only).
    """

    target: ServiceGroup
    draft: ServiceGroup | None
    orchestrator: IngressOptions = IngressOptions()
    http: HttpOptions = HttpOptions()
    name: str = "specdec"  # the Serve application name; actor names start with it
    namespace: str = "specdec"  # Ray namespace of the service actors
    route_prefix: str = "/"

    @pydantic.model_validator(mode="before")
    @classmethod
    def _roles(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for role, model in (("target", "default"), ("draft", "default-draft")):
            group = data.get(role, {})
            if role == "draft" and group is None:
                continue
            if isinstance(group, dict):
                data[role] = {"model": model, **group, "role": role}
        return data

    @classmethod
    def from_dict(cls, data: dict | None) -> "RayAppConfig":
        """Build and validate from a mapping (a parsed YAML file, or Serve's ``args``)."""
        try:
            return cls.model_validate({} if data is None else data)
        except pydantic.ValidationError as exc:
            raise ValueError(describe(exc)) from None

    @classmethod
    def load(cls, path: str) -> "RayAppConfig":
        import yaml

        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
        try:
            return cls.from_dict(data)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def to_dict(self) -> dict:
        return self.model_dump()

    @property
    def groups(self) -> list[ServiceGroup]:
        return [g for g in (self.target, self.draft) if g is not None]


def describe(exc: pydantic.ValidationError) -> str:
    """A validation error as one line per problem: the key's dotted path, then what is wrong."""
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "the config"
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        lines.append(f"{loc}: {msg.removeprefix('Value error, ')}")
    return "; ".join(lines)
