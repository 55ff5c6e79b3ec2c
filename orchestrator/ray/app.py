"""specdec on a Ray cluster: the model services as Ray actors, the orchestrator as Ray Serve.

- ``DraftServer`` / ``TargetServer``: Ray actors that each run one gRPC model service (the same
  server as ``specdec serve-draft`` / ``serve-target``) in an event-loop thread of their own and
  publish its address (node IP + port). Custom resources place them: by default a draft needs
  ``draft_node`` and a target ``target_node``, so the draft lands on the small-GPU machine and
  the target on the large-GPU one; ``num_gpus`` adds GPUs.
- ``SpecdecIngress``: the Ray Serve deployment. Each replica makes its gRPC channels itself (in
  the replica, never pickled across processes), to every draft/target pair, and serves the HTTP
  front over a ``PairRouter``: each generation runs all its rounds on one pair.
- A service group either starts actors (``replicas`` of them) or uses running services
  (``addresses``: e.g. Kubernetes Services), so the same app runs under ``specdec ray-up`` and
  under a KubeRay RayService.

The config file (YAML, ``RayAppConfig``) is documented in deploy/ray/config.yaml; Serve's
``import_path: orchestrator.ray.app:app`` takes the same mapping as ``args``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import threading
from typing import Any

import fastapi
import pydantic
import ray
from ray import serve

from specdec.config import DEFAULT_RULE, ServiceConfig

log = logging.getLogger(__name__)

INGRESS_NAME = "SpecdecIngress"
ROLES = ("target", "draft")
# ServiceConfig fields the group sets itself (not through ``service``).
_GROUP_OWNED = {"model", "role", "host", "port"}


def _fields(cls, data: Any, where: str) -> dict:
    """Check a config mapping's keys against a dataclass; ValueError names the unknown ones."""
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}")
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"unknown key(s) in {where}: {', '.join(unknown)} "
                         f"(known: {', '.join(sorted(known))})")
    return dict(data)


@dataclasses.dataclass
class ServiceGroup:
    """The draft or target services: actors to start, or addresses of running ones."""

    role: str
    model: str
    replicas: int = 1
    addresses: list[str] = dataclasses.field(default_factory=list)  # HOST:PORT, no actors
    resources: dict[str, float] | None = None  # custom resources per actor; None = {ROLE_node: 1}
    num_gpus: float = 0
    num_cpus: float = 1
    bind_host: str = "0.0.0.0"
    port: int = 0  # 0 = any free port
    q_top_k: int = 64  # draft only: the top-N of its distribution it samples from and sends
    service: dict[str, Any] = dataclasses.field(default_factory=dict)  # more ServiceConfig fields

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        self.addresses = [str(a) for a in self.addresses]
        if self.addresses:
            self.replicas = len(self.addresses)
        if self.replicas < 1:
            raise ValueError(f"{self.role}.replicas must be >= 1, got {self.replicas}")
        if self.resources is None:
            self.resources = {f"{self.role}_node": 1}
        if not all(isinstance(v, (int, float)) and v >= 0 for v in self.resources.values()):
            raise ValueError(f"{self.role}.resources must map names to amounts >= 0")
        if self.num_gpus < 0 or self.num_cpus < 0:
            raise ValueError(f"{self.role}.num_gpus and num_cpus must be >= 0")
        owned = sorted(_GROUP_OWNED & set(self.service))
        if owned:
            raise ValueError(f"{self.role}.service may not set {', '.join(owned)}: use "
                             f"{self.role}.model / bind_host / port")
        self.service_config()  # validate now, not on a remote node later

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
            raise ValueError(f"{self.role}.service: {exc}") from None

    def actor_name(self, app_name: str, index: int) -> str:
        return f"{app_name}-{self.role}-{index}"


@dataclasses.dataclass
class IngressOptions:
    """The Ray Serve deployment of the orchestrator."""

    replicas: int = 1
    ray_actor_options: dict[str, Any] = dataclasses.field(default_factory=lambda: {"num_cpus": 1})
    max_ongoing_requests: int = 64
    routing: str = "least-loaded"  # or "hash"; see orchestrator.routing
    model_name: str = "specdec"  # the model name the HTTP API reports
    api_key: str | None = None  # None: $SPECDEC_API_KEY in the replica, if set
    tokenizer: str | None = None  # tokenizer for prompts; None = the target's model spec
    tls: dict[str, str] | None = None  # channels: {ca, cert, key, server_name}; None = $SPECDEC_TLS_*
    ready_timeout_s: float = 900.0  # how long a replica waits for the services to load

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"orchestrator.replicas must be >= 1, got {self.replicas}")
        if self.max_ongoing_requests < 1:
            raise ValueError("orchestrator.max_ongoing_requests must be >= 1")
        from orchestrator.routing import POLICIES

        if self.routing not in POLICIES:
            raise ValueError(f"orchestrator.routing must be one of {', '.join(POLICIES)}, "
                             f"got {self.routing!r}")
        if self.tls is not None:
            unknown = sorted(set(self.tls) - {"ca", "cert", "key", "server_name"})
            if unknown:
                raise ValueError(f"unknown key(s) in orchestrator.tls: {', '.join(unknown)}")


@dataclasses.dataclass
class HttpOptions:
    host: str = "0.0.0.0"
    port: int = 8000
    proxy_location: str = "HeadOnly"  # or EveryNode: a Serve HTTP proxy on every node


@dataclasses.dataclass
class RayAppConfig:
    """Everything ``specdec ray-up`` and the Serve app builder need (see deploy/ray/config.yaml)."""

    target: ServiceGroup
    draft: ServiceGroup | None
    orchestrator: IngressOptions = dataclasses.field(default_factory=IngressOptions)
    http: HttpOptions = dataclasses.field(default_factory=HttpOptions)
    name: str = "specdec"  # the Serve application name; actor names start with it
    namespace: str = "specdec"  # Ray namespace of the service actors
    route_prefix: str = "/"

    @classmethod
    def from_dict(cls, data: dict) -> "RayAppConfig":
        """Build and validate from a mapping (a parsed YAML file, or Serve's ``args``)."""
        data = _fields(cls, data, "the config")
        target = _fields(ServiceGroup, data.pop("target", None), "target")
        target.setdefault("model", "default")
        target["role"] = "target"
        # No draft key: the default draft; ``draft: null``: no draft at all (target-only).
        with_draft = data.get("draft", {}) is not None
        draft_data = data.pop("draft", None)
        draft = _fields(ServiceGroup, draft_data, "draft") if with_draft else None
        if draft is not None:
            draft.setdefault("model", "default-draft")
            draft["role"] = "draft"
        orch = _fields(IngressOptions, data.pop("orchestrator", None), "orchestrator")
        http = _fields(HttpOptions, data.pop("http", None), "http")
        try:
            return cls(target=ServiceGroup(**target),
                       draft=ServiceGroup(**draft) if draft is not None else None,
                       orchestrator=IngressOptions(**orch), http=HttpOptions(**http), **data)
        except TypeError as exc:  # e.g. a list where a number belongs
            raise ValueError(f"bad config: {exc}") from None

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
        return dataclasses.asdict(self)

    @property
    def groups(self) -> list[ServiceGroup]:
        return [g for g in (self.target, self.draft) if g is not None]


# --------------------------------------------------------------------------- service actors


class _ServiceActor:
    """One gRPC model service inside a Ray actor, served by an event loop in its own thread.

    The actor's methods block (with timeouts) on that thread's progress; create it with
    ``max_concurrency`` > 1 so ``info`` answers while ``wait_ready`` waits.
    """

    role = ""

    def __init__(self, config: dict, **host_args):
        self.config = ServiceConfig(**config)
        self.host_args = host_args
        self.host = None
        self.error: BaseException | None = None
        self._bound = threading.Event()
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._main, name=f"specdec-{self.role}",
                                        daemon=True)
        self._thread.start()

    def _make_host(self):
        raise NotImplementedError

    def _main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._loop.run_forever()  # the gRPC server lives on this loop

    async def _start(self) -> None:
        try:
            # The aio server must be created inside the running loop.
            self.host = self._make_host()
            starting = asyncio.ensure_future(self.host.start())
            while not self.host.port and not starting.done():
                await asyncio.sleep(0.01)  # start() binds first, then loads the model
            self._bound.set()
            await starting
        except BaseException as exc:  # reported by wait_ready
            self.error = exc
            log.exception("%s service failed to start", self.role)
        finally:
            self._bound.set()
            self._ready.set()

    def _advertised_host(self) -> str:
        host = self.config.host
        if host in ("0.0.0.0", "::", ""):
            host = ray.util.get_node_ip_address()
        return f"[{host}]" if ":" in host else host

    def info(self) -> dict:
        """Where this service is: address (once bound), node, model, and whether it is ready."""
        ctx = ray.get_runtime_context()
        bound = bool(self.host is not None and self.host.port)
        return dict(
            role=self.role,
            model=self.config.model,
            address=f"{self._advertised_host()}:{self.host.port}" if bound else None,
            node_id=ctx.get_node_id(),
            node_ip=ray.util.get_node_ip_address(),
            ready=self._ready.is_set() and self.error is None,
            error=repr(self.error) if self.error else None,
        )

    def address(self, timeout_s: float = 120.0) -> str:
        """HOST:PORT, as soon as the server is bound (the model may still be loading)."""
        if not self._bound.wait(timeout_s) or self.host is None or not self.host.port:
            raise RuntimeError(f"{self.role} service did not bind: {self.error!r}")
        return self.info()["address"]

    def wait_ready(self, timeout_s: float = 900.0) -> dict:
        """Block until the model is loaded (or failed to); returns ``info()``."""
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"{self.role} model {self.config.model!r} not loaded after "
                               f"{timeout_s:.0f}s")
        if self.error is not None:
            raise RuntimeError(f"{self.role} model {self.config.model!r} failed to load: "
                               f"{self.error!r}")
        return self.info()


class TargetServer(_ServiceActor):
    role = "target"

    def _make_host(self):
        from target_service.server import make_host

        return make_host(self.config)


class DraftServer(_ServiceActor):
    role = "draft"

    def _make_host(self):
        from draft_service.server import make_host

        return make_host(self.config, **self.host_args)


def _actor_class(role: str):
    return ray.remote(TargetServer if role == "target" else DraftServer)


def ensure_actors(cfg: RayAppConfig, group: ServiceGroup) -> list:
    """Create the group's named, detached service actors, not waiting for them.

    An actor of the same name that already runs is reused as it is: remove a deployment
    (``specdec ray-up --down``) before changing its models or resources.
    """
    if not group.uses_actors:
        return []
    host_args = {}
    if group.role == "draft":
        host_args = dict(target=cfg.target.model, q_top_k=group.q_top_k)
    options = dict(
        namespace=cfg.namespace, lifetime="detached", get_if_exists=True, max_concurrency=4,
        num_cpus=group.num_cpus, num_gpus=group.num_gpus, resources=dict(group.resources),
    )
    config = dataclasses.asdict(group.service_config())
    return [
        _actor_class(group.role).options(name=group.actor_name(cfg.name, i), **options)
        .remote(config, **host_args)
        for i in range(group.replicas)
    ]


def start_services(cfg: RayAppConfig, timeout_s: float = 900.0) -> list[dict]:
    """Start every actor group and wait until all models are loaded; returns their infos.

    Needs ``ray.init`` first. An actor whose resources no node offers stays pending: that is
    reported as a timeout naming the resources.
    """
    pending = []
    for group in cfg.groups:
        for i, actor in enumerate(ensure_actors(cfg, group)):
            pending.append((group, i, actor.wait_ready.remote(timeout_s)))
    infos = []
    for group, i, ref in pending:
        try:
            infos.append(ray.get(ref, timeout=timeout_s + 30))
        except ray.exceptions.GetTimeoutError:
            raise TimeoutError(
                f"{group.role} actor {i} did not start within {timeout_s:.0f}s: is there a node "
                f"with resources {group.resources} (num_gpus {group.num_gpus}, num_cpus "
                f"{group.num_cpus}) free?") from None
    return infos


def stop_services(cfg: RayAppConfig) -> int:
    """Kill the config's named service actors; returns how many there were."""
    killed = 0
    for group in cfg.groups:
        if not group.uses_actors:
            continue
        for i in range(group.replicas):
            try:
                actor = ray.get_actor(group.actor_name(cfg.name, i), namespace=cfg.namespace)
            except ValueError:
                continue
            ray.kill(actor)
            killed += 1
    return killed


async def group_addresses(cfg: RayAppConfig, group: ServiceGroup) -> list[str]:
    """The group's service addresses: configured ones, or those its actors publish."""
    if not group.uses_actors:
        return list(group.addresses)
    timeout = cfg.orchestrator.ready_timeout_s
    refs = []
    for i in range(group.replicas):
        name = group.actor_name(cfg.name, i)
        try:
            actor = ray.get_actor(name, namespace=cfg.namespace)
        except ValueError:
            raise RuntimeError(f"no actor {name!r} in namespace {cfg.namespace!r}: start the "
                               "services first (specdec ray-up)") from None
        refs.append(actor.wait_ready.remote(timeout))
    return [info["address"] for info in await asyncio.gather(*refs)]


# --------------------------------------------------------------------------- the orchestrator


def _env_tls() -> dict | None:
    ca = os.environ.get("SPECDEC_TLS_CA")
    if not ca:
        return None
    return dict(ca=ca, cert=os.environ.get("SPECDEC_TLS_CERT"),
                key=os.environ.get("SPECDEC_TLS_KEY"),
                server_name=os.environ.get("SPECDEC_TLS_SERVER_NAME"))


async def connect_pairs(cfg: RayAppConfig):
    """Channels to every draft/target pair, made in the calling process; a PairRouter over them.

    With different replica counts, pair i is (target i mod T, draft i mod D), i < max(T, D).
    """
    from orchestrator.pair import close, connect
    from orchestrator.routing import PairRouter
    from specdec.models.hub import load_tokenizer

    opts = cfg.orchestrator
    targets = await group_addresses(cfg, cfg.target)
    drafts = await group_addresses(cfg, cfg.draft) if cfg.draft is not None else [None]
    tokenizer = await asyncio.get_running_loop().run_in_executor(
        None, load_tokenizer, opts.tokenizer or cfg.target.model)
    tls = opts.tls or _env_tls()
    pairs, labels = [], []
    try:
        for i in range(max(len(targets), len(drafts))):
            t, d = targets[i % len(targets)], drafts[i % len(drafts)]
            pairs.append(await connect(t, d, tls=tls, tokenizer=tokenizer,
                                       ready_timeout_s=opts.ready_timeout_s))
            labels.append(f"target={t} draft={d}")
    except BaseException:
        for orch in pairs:
            await close(orch)
        raise
    log.info("orchestrator replica connected to %d pair(s): %s", len(pairs), labels)
    return PairRouter(pairs, policy=opts.routing, labels=labels)


class GenerateBody(pydantic.BaseModel):
    """POST /generate: specdec's native request (the OpenAI routes are the API module's)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    prompt: str | None = None
    prompt_ids: list[int] | None = None
    chat: bool = False  # apply the chat template to ``prompt``
    max_new_tokens: int = 128
    mode: str = "pipelined"
    k: int | None = None
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh seed, as on the OpenAI routes
    rule: str = DEFAULT_RULE  # acceptance rule of sampled decoding: coupled | rejection
    stop: list[str] = []
    session: str | None = None  # routing key: equal keys go to one pair under ``hash`` routing


def native_routes(router, api_key: str | None) -> fastapi.APIRouter:
    """POST /generate (summary JSON with token ids, and the pair that ran it), GET /pairs."""
    from orchestrator.cli import encode_prompt
    from orchestrator.http.app import api_key_matches, request_seed
    from orchestrator.loop import GenerationRequest
    from specdec.config import SamplingParams

    def authorize(authorization: str | None = fastapi.Header(default=None)) -> None:
        if api_key and not api_key_matches(authorization, api_key):
            raise fastapi.HTTPException(401, "missing or wrong API key")

    routes = fastapi.APIRouter(dependencies=[fastapi.Depends(authorize)])

    @routes.post("/generate")
    async def generate(body: GenerateBody) -> dict:
        try:
            if (body.prompt is None) == (body.prompt_ids is None):
                raise ValueError("give exactly one of prompt and prompt_ids")
            ids = body.prompt_ids
            if ids is None:
                ids = encode_prompt(router.tokenizer, body.prompt, body.chat)
            req = GenerationRequest(
                ids, body.max_new_tokens,
                SamplingParams(body.temperature, body.top_k, body.top_p,
                               request_seed(body.seed), body.rule),
                body.stop, body.mode, body.k)
            result, i = await router.generate_on_pair(req, body.session)
        except ValueError as exc:
            raise fastapi.HTTPException(400, str(exc)) from None
        return dict(result.summary(), pair=router.labels[i])

    @routes.get("/pairs")
    async def pairs() -> list[dict]:
        return router.describe()

    return routes


def build_front(router, opts: IngressOptions) -> fastapi.FastAPI:
    """The HTTP app of a replica: the OpenAI-compatible API plus the native routes."""
    from orchestrator.http.app import create_app

    api_key = opts.api_key or os.environ.get("SPECDEC_API_KEY") or None
    app = create_app(router, opts.model_name, api_key=api_key)
    app.include_router(native_routes(router, api_key))
    return app


@serve.deployment(name=INGRESS_NAME)
@serve.ingress()
class SpecdecIngress:
    """The orchestrator as a Serve replica: gRPC channels to all pairs, and the HTTP front."""

    async def __init__(self, config: dict):
        self.config = RayAppConfig.from_dict(config)
        self.router = await connect_pairs(self.config)

    def __serve_build_asgi_app__(self):
        # Called by Serve after __init__, inside the replica: routes close over this router.
        return build_front(self.router, self.config.orchestrator)


def build_app(cfg: RayAppConfig) -> serve.Application:
    """The Serve application; starts the service actors (not waiting for them) if it uses any."""
    for group in cfg.groups:
        ensure_actors(cfg, group)
    opts = cfg.orchestrator
    return SpecdecIngress.options(
        num_replicas=opts.replicas, ray_actor_options=dict(opts.ray_actor_options),
        max_ongoing_requests=opts.max_ongoing_requests,
    ).bind(cfg.to_dict())


def app(args: dict) -> serve.Application:
    """Serve's application builder (``import_path: orchestrator.ray.app:app``): ``args`` is the
    config mapping, or ``{config_file: PATH}`` for a file on the cluster."""
    args = dict(args or {})
    path = args.pop("config_file", None)
    if path:
        if args:
            raise ValueError("give either config_file or the config itself in args, not both")
        return build_app(RayAppConfig.load(path))
    return build_app(RayAppConfig.from_dict(args))


def deploy(cfg: RayAppConfig) -> str:
    """Start Serve's HTTP proxy and run the app (ray.init first); returns the HTTP address."""
    serve.start(proxy_location=cfg.http.proxy_location,
                http_options=dict(host=cfg.http.host, port=cfg.http.port))
    serve.run(build_app(cfg), name=cfg.name, route_prefix=cfg.route_prefix, blocking=False)
    host = cfg.http.host
    if host in ("0.0.0.0", "::", ""):
        host = ray.util.get_node_ip_address()
    if ":" in host:
        host = f"[{host}]"
    return f"http://{host}:{cfg.http.port}{cfg.route_prefix.rstrip('/')}"


def undeploy(cfg: RayAppConfig, wait: bool = True) -> None:
    """Kill the service actors this config started and delete the Serve app.

    The actors go first and ``wait=False`` does not wait for Serve: ``ray job stop`` gives a
    job 3 s (RAY_JOB_STOP_WAIT_TIME_S) between SIGTERM and SIGKILL.
    """
    try:
        stop_services(cfg)
    finally:
        serve.delete(cfg.name, _blocking=wait)
