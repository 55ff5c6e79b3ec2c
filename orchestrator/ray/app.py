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
import logging
import os

import fastapi
import ray
from ray import serve

from orchestrator.http.native import native_routes
from orchestrator.ray.actors import ensure_actors, group_addresses, stop_services
from orchestrator.ray.config import IngressOptions, RayAppConfig

log = logging.getLogger(__name__)

INGRESS_NAME = "SpecdecIngress"


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
    tls = opts.tls.model_dump() if opts.tls is not None else _env_tls()
    pairs, labels = [], []
    try:
        for i in range(max(len(targets), len(drafts))):
            t, d = targets[i % len(targets)], drafts[i % len(drafts)]
            pairs.append(await connect(t, d, tls=tls, tokenizer=tokenizer,
                                       ready_timeout_s=opts.ready_timeout_s,
                                       decode_on=opts.decode_on))
            labels.append(f"target={t} draft={d}")
    except BaseException:
        for orch in pairs:
            await close(orch)
        raise
    log.info("orchestrator replica connected to %d pair(s): %s", len(pairs), labels)
    return PairRouter(pairs, policy=opts.routing, labels=labels)


def build_front(router, opts: IngressOptions) -> fastapi.FastAPI:
    """The HTTP app of a replica: the OpenAI-compatible API plus the native routes."""
    from orchestrator.http.app import create_app

    api_key = opts.api_key or os.environ.get("SPECDEC_API_KEY") or None
    app = create_app(router, opts.model_name, api_key=api_key)
    app.include_router(native_routes(app.state.front))
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
