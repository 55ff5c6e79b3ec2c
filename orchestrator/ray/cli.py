"""``specdec ray-up``: start specdec on a Ray cluster (the entry point for ``ray job submit``).

    ray job submit --address http://HEAD:8265 --working-dir . -- specdec ray-up --config F

connects to the cluster, starts the draft/target service actors where their resources are,
waits for the models, runs the Serve app, prints its HTTP address and stays in the foreground
until stopped (``ray job stop``, Ctrl-C), then removes what it started. ``--detach`` leaves
everything running and exits; ``--down`` removes a detached deployment.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import threading

log = logging.getLogger(__name__)


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "ray-up", help="run specdec on a Ray cluster: service actors + the Ray Serve app",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="YAML app config (see deploy/ray/config.yaml)")
    p.add_argument("--address", default="auto",
                   help="Ray cluster address (default: auto, the cluster this runs on)")
    p.add_argument("--detach", action="store_true",
                   help="exit once serving and leave the app running")
    p.add_argument("--down", action="store_true",
                   help="remove the config's Serve app and service actors, then exit")
    p.add_argument("--timeout-s", type=float, default=900.0,
                   help="how long to wait for the models to load (default: %(default)s)")
    p.set_defaults(func=cmd_ray_up)


def cmd_ray_up(args) -> int:
    import ray

    from orchestrator.ray import app as ray_app
    from orchestrator.ray.actors import start_services
    from orchestrator.ray.config import RayAppConfig

    try:
        cfg = RayAppConfig.load(args.config)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {exc}")
    ray.init(address=args.address, namespace=cfg.namespace)
    if args.down:
        ray_app.undeploy(cfg)
        print(f"specdec app {cfg.name!r} removed", flush=True)
        return 0

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    serving = False
    try:
        for info in start_services(cfg, args.timeout_s):
            print(f"{info['role']} {info['model']} at {info['address']} on node "
                  f"{info['node_id'][:12]} ({info['node_ip']})", flush=True)
        url = ray_app.deploy(cfg)
        serving = True
        print(f"specdec is serving at {url}", flush=True)
        print(json.dumps(dict(url=url, app=cfg.name, namespace=cfg.namespace)), flush=True)
        if not args.detach:
            while not stop.wait(1.0):  # a timeout keeps signal handlers running promptly
                pass
            print("stopping specdec", flush=True)
    finally:
        if not (args.detach and serving):
            ray_app.undeploy(cfg, wait=False)
    return 0
