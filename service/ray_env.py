"""The environment Ray Serve runs kvsparse in (no Ray import here: it must be set first)."""

from __future__ import annotations

import os

# Environment of every process of the Ray cluster (controller, proxies, replicas), read when Ray
# Serve is imported there: `kvsparse serve --ray` sets it before it starts its cluster, the Helm
# chart and k8s/ in every Ray container. Throughput-optimized mode runs replica code on the event
# loop instead of a thread, buffers access logs, sends requests between deployments over gRPC and
# gives each ingress replica an HTTP port of its own ("direct ingress"). Its gRPC does not reach
# the HTTP proxy (Ray 2.60 reads RAY_SERVE_PROXY_USE_GRPC before the mode's defaults apply), so
# it is set here too: the proxy then hands requests to the ingress over gRPC instead of Ray actor
# calls, which under many streams shortens the ingress-to-engine hop's tail (docs/serving.md).
# Serve's HAProxy mode (RAY_SERVE_ENABLE_HA_PROXY=1) is left to the user: it takes the Python
# proxy out of the way in, but lets an abandoned non-streamed request run to its end
# (docs/serving.md, "Ray Serve at full speed").
SERVE_ENVIRONMENT = {"RAY_SERVE_THROUGHPUT_OPTIMIZED": "1", "RAY_SERVE_PROXY_USE_GRPC": "1"}


def apply_serve_environment() -> None:
    """SERVE_ENVIRONMENT in this process's environment (what it starts inherits it), where the
    user has not set a variable already."""
    for name, value in SERVE_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
