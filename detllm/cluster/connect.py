"""Reaching a Ray cluster: `--ray ADDRESS` (or `auto`, read from RAY_ADDRESS) checked and probed with a
short TCP connect before ray is imported and a gRPC handshake before ray.init, so an unreachable
cluster (or a port that is not a GCS) is one line and exit 4 within seconds with nothing written; a missing `ray` is a usage error naming the extra. Owns nothing else.
"""

from __future__ import annotations

import os
import socket
import warnings
from typing import Any

from ..core.errors import BackendUnavailableError, UsageError

PROBE_S = 3.0  # the TCP connect to the GCS; ray.init's own wait for an absent cluster is far longer
GRPC_S = 5.0  # then its gRPC handshake: PROBE_S + GRPC_S stay under the 10 s an unreachable cluster may take


def resolve_address(address: str) -> str:
    """host:port of the cluster's GCS; `auto` reads RAY_ADDRESS (a ray:// client address is refused)."""
    addr = os.environ.get("RAY_ADDRESS", "") if address == "auto" else address
    if not addr:
        raise UsageError("--ray auto reads RAY_ADDRESS, which is not set", hint="give the head's address, e.g. --ray 10.0.0.1:6379")
    if addr.startswith("ray://"):
        raise UsageError(f"--ray {addr!r} is a Ray Client address; detllm connects as a driver to the GCS",
                         hint="run detllm on a node of the cluster (or in a RayJob) and give the head's host:6379")
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise UsageError(f"--ray expects HOST:PORT of the cluster's head (GCS), got {addr!r}")
    return addr


def import_ray() -> Any:
    try:
        import ray
    except ImportError as exc:
        raise UsageError("--ray needs Ray, which is not installed", hint="pip install 'detllm[ray]'") from exc
    return ray


def disconnect(ray: Any, owned: bool) -> None:
    """Leave the cluster if connect() joined it; a caller's own ray.init stays as it was."""
    if owned:
        ray.shutdown()


def connect(address: str) -> tuple[Any, bool]:
    """(ray connected as a driver to the cluster at `address` (resolve_address'd), whether this call
    connected it). Unreachable: BackendUnavailableError (exit 4) within PROBE_S + GRPC_S, before
    anything is written. A process already connected (a Python caller's ray.init) is used as it is."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S).close()
    except OSError as exc:
        raise BackendUnavailableError(f"cannot reach the Ray cluster at {address} ({type(exc).__name__}: {exc})",
                                      hint="nothing was written; is the head up and --ray its GCS address (port 6379 by default)?") from exc
    ray = import_ray()
    if ray.is_initialized():
        return ray, False
    _answers_grpc(address)
    try:
        with warnings.catch_warnings():  # Ray's FutureWarning about accelerator variables at num_gpus=0: not ours to print
            warnings.simplefilter("ignore", FutureWarning)
            ray.init(address=address, log_to_driver=False, logging_level="ERROR", configure_logging=False)
    except (ConnectionError, RuntimeError) as exc:
        raise BackendUnavailableError(f"cannot connect to the Ray cluster at {address} ({type(exc).__name__}: {str(exc)[:200]})",
                                      hint="nothing was written; check the address and that this Ray matches the cluster's") from exc
    return ray, True


def _answers_grpc(address: str) -> None:
    """The port speaks gRPC (HTTP/2) within GRPC_S: ray.init would wait for minutes on a port that takes
    the connection and is not a GCS (measured: over 60 s against an HTTP server)."""
    import grpc  # Ray's own dependency

    channel = grpc.insecure_channel(address)
    try:
        grpc.channel_ready_future(channel).result(timeout=GRPC_S)
    except grpc.FutureTimeoutError as exc:
        raise BackendUnavailableError(f"{address} takes connections but does not answer as a Ray GCS (gRPC) within {GRPC_S:g} s",
                                      hint="nothing was written; is --ray the head's GCS port (6379 by default), not the dashboard or client port?") from exc
    finally:
        channel.close()


__all__ = ["connect", "disconnect", "import_ray", "resolve_address"]
