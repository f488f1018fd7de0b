"""`kvsparse serve` as a user starts it: a subprocess, flags, the API key from the environment."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from tests.service.servers import ServeProcess


@pytest.fixture(scope="module")
def served():
    server = ServeProcess(["dummy:tiny", "--host", "127.0.0.1", "--policy", "dense",
                           "--max-model-len", "256", "--kv-cache-memory-gb", "0.01",
                           "--served-model-name", "tiny", "org/tiny-alias", "--log-level", "warning",
                           "--kv-cache-dtype", "fp8"],
                          env={"KVSPARSE_API_KEY": "env-key"})  # fmt: skip
    try:
        yield server.wait_healthy().base_url
    finally:
        server.signal()
        server.process.wait(timeout=30)
        server.stop()


def test_serves_the_model_under_its_served_names_with_its_kv_cache_dtype(served):
    """Several --served-model-name names, as vLLM takes them: each listed, each answered under
    its own name; any other is a 404."""
    headers = {"Authorization": "Bearer env-key"}
    models = httpx.get(served + "/v1/models", headers=headers)
    assert [m["id"] for m in models.json()["data"]] == ["tiny", "org/tiny-alias"]
    card = models.json()["data"][0]
    assert card["max_model_len"] == 256
    assert (card["kvsparse"]["kv_cache_dtype"], card["kvsparse"]["quantization"]) == ("fp8", None)
    for name in ("tiny", "org/tiny-alias"):
        out = httpx.post(
            served + "/v1/completions",
            json={"model": name, "prompt": "Hello", "max_tokens": 3, "ignore_eos": True},
            headers=headers,
        )
        assert out.json()["usage"]["completion_tokens"] == 3 and out.json()["model"] == name
        assert httpx.get(served + f"/v1/models/{name}", headers=headers).json()["id"] == name
    other = httpx.post(served + "/v1/completions", headers=headers,
                       json={"model": "tinyy", "prompt": "Hello", "max_tokens": 1})  # fmt: skip
    assert (
        other.status_code == 404
        and "'tiny' or 'org/tiny-alias'" in other.json()["error"]["message"]
    )


def test_the_key_comes_from_the_environment(served):
    assert httpx.get(served + "/v1/models").status_code == 401


def test_bad_flags_exit_with_a_message():
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "dummy:tiny", "--pools", "snapkv:abc"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2
    assert "budget must be an integer" in result.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["dummy:tiny", "--model", "dummy:small"], "two models given"),
        (["--space-admissions", "false"], "looks like the value of a boolean flag"),
    ],
)
def test_a_model_given_twice_or_a_boolean_flag_given_a_value_is_refused(args, message):
    """Instead of serving one of the two models, or loading a model named `false`."""
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 2 and message in result.stderr


def test_a_server_spaces_admissions_and_takes_one_typical_prompt_per_step():
    """Unless its flags say otherwise; offline commands keep the engine's defaults."""
    from service.cli import build_parser
    from service.serve import serving_configs
    from sparse_core.cli import configs_from_args

    parser = build_parser()
    engine, _ = serving_configs(parser.parse_args(["serve", "--expected-input-len", "3000"]))
    assert engine.space_admissions and engine.max_num_batched_tokens == 3000
    flags = ["--no-space-admissions", "--max-num-batched-tokens", "9216"]
    engine, _ = serving_configs(parser.parse_args(["serve", *flags]))
    assert not engine.space_admissions and engine.max_num_batched_tokens == 9216
    engine, _ = configs_from_args(parser.parse_args(["generate", "hi"]))
    assert not engine.space_admissions and engine.max_num_batched_tokens == 8192


def test_a_serve_config_file_gets_the_same_defaults():
    from service.ray_app import RayAppConfig

    engine = RayAppConfig(engine={"expected_input_len": 3000}).engine_config()
    assert engine.space_admissions and engine.max_num_batched_tokens == 3000
    engine = RayAppConfig(engine={"space_admissions": False}).engine_config()
    assert not engine.space_admissions and engine.max_num_batched_tokens == 4000


@pytest.mark.parametrize(
    ("router", "message"),
    [
        ("nowhere.at_all:Router", "cannot be imported: No module named 'nowhere'"),
        ("service.router:NoSuchRouter", "cannot be imported"),
        ("service.router:PrefixOwners", "must name a ray.serve.request_router.RequestRouter"),
        (":KVCapacityRouter", "as 'module:Class' or 'module.Class'"),
    ],
)
def test_a_request_router_serve_cannot_use_is_refused_when_the_app_is_built(router, message):
    from service.ray_app import DEFAULT_REQUEST_ROUTER, RayAppConfig

    with pytest.raises(ValueError, match=message):
        RayAppConfig(request_router_class=router)
    for path in (DEFAULT_REQUEST_ROUTER, DEFAULT_REQUEST_ROUTER.replace(":", ".")):
        assert RayAppConfig(request_router_class=path).request_router_class == path


@pytest.mark.parametrize(
    ("flags", "env"),
    [(["--api-key", ""], {"KVSPARSE_API_KEY": "env-key"}), ([], {"KVSPARSE_API_KEY": " "})],
)
def test_an_empty_api_key_is_refused_at_start_up(flags, env):
    """Not authentication turned off: `--api-key "$KEY"` with KEY unset gives an empty key."""
    result = subprocess.run(
        [sys.executable, "-m", "service.cli", "serve", "dummy:tiny", *flags],
        capture_output=True, text=True, timeout=120, env={**os.environ, **env},
    )  # fmt: skip
    assert result.returncode == 2
    assert "API key" in result.stderr and "empty" in result.stderr
