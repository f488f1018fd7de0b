"""The Serve environment kvsparse applies is the one Ray Serve then runs in: every setting it
means to turn on reads as on inside a process that imports Ray Serve after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.ray

PROBE = """
from service.ray_env import apply_serve_environment
apply_serve_environment()
from ray.serve._private import constants as c
print(json.dumps({name: bool(getattr(c, name)) for name in NAMES}))
"""

# What throughput-optimized mode and the proxy's gRPC amount to in Serve's constants.
EXPECTED = {
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": True,  # between deployments
    "RAY_SERVE_PROXY_USE_GRPC": True,  # from the HTTP proxy to the ingress
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": True,
    "RAY_SERVE_RUN_USER_CODE_IN_SEPARATE_THREAD": False,
    "RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP": False,
}


def test_serve_environment_turns_on_grpc_for_the_proxy_too() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_SERVE_")}
    code = f"import json\nNAMES = {list(EXPECTED)!r}\n{PROBE}"
    result = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == EXPECTED
