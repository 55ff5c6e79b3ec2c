"""The model services as Ray actors: each runs one gRPC service (the same server as
``specdec serve-draft`` / ``serve-target``) in an event-loop thread of its own and publishes its
address (node IP + port); named and detached, so Serve replicas find them by name."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading

import ray

from orchestrator.ray.config import RayAppConfig, ServiceGroup
from specdec.config import ServiceConfig

log = logging.getLogger(__name__)


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


