"""Launchers: start the processes of a run (local subprocesses; Ray)."""

from __future__ import annotations

import importlib.util
from typing import Any

LAUNCHERS = ("local", "ray")


def make_launcher(kind: str, ray_address: str | None = None, **options: Any) -> Any:
    """A launcher by name.

    Args:
        kind: ``local`` (subprocesses of this process, the default of ``xtoken run``) or ``ray``
            (Ray actors in placement groups on a running cluster).
        ray_address: the Ray cluster (``HOST:PORT`` of its head, or ``auto`` for the cluster
            started on this machine); only for ``ray``, which needs one.
        **options: passed to the launcher's constructor (``LocalLauncher(parent_sentinel=...)``,
            ``RayLauncher(cpus_per_process=...)``).

    Returns:
        A :class:`services.launch.base.Launcher`.

    Raises:
        ValueError: an unknown kind, an address given to the local launcher, ``ray`` without an
            address or without Ray installed, or a Ray cluster that cannot be reached (with the
            address and the fix).
    """
    if kind == "local":
        if ray_address:
            raise ValueError(
                f"ray_address={ray_address!r} is only for the ray launcher; drop it or use "
                "launcher ray"
            )
        from services.launch.local import LocalLauncher

        return LocalLauncher(**options)
    if kind == "ray":
        if not ray_address:
            raise ValueError(
                "the ray launcher needs the cluster's address: pass --ray-address HOST:PORT (the "
                "head's `ray start --head --port PORT`), or auto for the cluster on this machine"
            )
        if importlib.util.find_spec("ray") is None:
            raise ValueError(
                "the ray launcher needs Ray, which is not installed: pip install 'xtoken[ray]' "
                "(./scripts/setup.sh test ray)"
            )
        from services.launch.ray import RayLauncher

        return RayLauncher(ray_address, **options)
    raise ValueError(f"launcher {kind!r} is unknown; use one of {', '.join(LAUNCHERS)}")
