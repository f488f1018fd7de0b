"""The Helm chart: lint, render with several value sets, validate every object offline."""

from __future__ import annotations

import base64
import copy
import gzip
import importlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from sparse_core.engine_args import SETTINGS, Setting
from tests.config_samples import Configs, sample, value_of, with_companions
from tests.deploy.helpers import CHART, ROOT, render, run_helm, set_args
from tests.service.servers import PREFIX_CACHE_AFFINITY_ROUTER

K8S_VERSION = "1.33.0"
# KubeRay's RayService CRD (schemas/SOURCE says which commit), gzipped.
CRD = Path(__file__).resolve().parent / "schemas" / "ray.io_rayservices.yaml.gz"
CUSTOM_KINDS = {"RayService", "PodMonitor", "ServiceMonitor", "PrometheusRule"}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "tp2": {"tensorParallelSize": 2, "worker": {"resources": {"requests": {"cpu": "16"}}}},
    "autoscaling-off": {"autoscaling": {"enabled": False}, "replicas": 2},
    "ingress-on": {
        "ingress": {
            "enabled": True,
            "className": "nginx",
            "tls": [{"secretName": "kvsparse-tls", "hosts": ["kvsparse.example.com"]}],
        },
        "service": {"type": "ClusterIP"},
    },
    "monitors-off": {
        "monitoring": {
            "podMonitor": {"enabled": False},
            "dashboards": {"enabled": False},
            "prometheusRule": {"enabled": False},
        }
    },
    "servicemonitor": {
        "monitoring": {"podMonitor": {"enabled": False}, "serviceMonitor": {"enabled": True}}
    },
    "secrets-pvc-pools": {
        "model": {
            "path": "/models/llama-3-8b",
            "hfRepo": "",
            "servedModelName": "llama-3-8b",
            "hfTokenSecret": {"name": "hf-token"},
            "cache": {"existingClaim": "model-cache"},
        },
        "serve": {
            "apiKeySecret": {"name": "kvsparse-api-key"},
            "maxOngoingRequests": 48,
            "requestRouterClass": PREFIX_CACHE_AFFINITY_ROUTER,
        },
        "pools": "snapkv,dense",
        "rayAuth": {"mode": "disabled"},
    },
    "vllm-engine": {"engineKind": "vllm"},
    "layer-budgets": {"sparsity": {"layer_budgets": "auto", "target_compression": 4}},
}


@pytest.fixture(scope="module", params=sorted(VALUE_SETS))
def rendered(request: pytest.FixtureRequest, helm: str) -> tuple[str, list[dict[str, Any]]]:
    return request.param, render(helm, VALUE_SETS[request.param])


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_helm_lint(helm: str, name: str) -> None:
    # --strict: warnings fail too.
    run_helm(helm, "lint", "--strict", str(CHART), *set_args(VALUE_SETS[name]))


def test_core_kinds_validate_strictly(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    _, docs = rendered
    core = [d for d in docs if d["kind"] not in CUSTOM_KINDS]
    assert {"Service", "Pod"} <= {d["kind"] for d in core}
    for doc in core:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _closed(schema: Any) -> Any:
    """The CRD schema with unknown fields refused (the API server would prune them silently)."""
    if isinstance(schema, dict):
        schema = {k: _closed(v) for k, v in schema.items()}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_closed(v) for v in schema]
    return schema


@pytest.fixture(scope="module")
def rayservice_schema() -> dict[str, Any]:
    crd = yaml.load(
        gzip.decompress(CRD.read_bytes()), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    )
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1" and v["served"]]
    return _closed(copy.deepcopy(version["schema"]["openAPIV3Schema"]))


def test_rayservice_matches_kuberay_crd(
    rendered: tuple[str, list[dict[str, Any]]], rayservice_schema: dict[str, Any]
) -> None:
    _, docs = rendered
    (rs,) = by_kind(docs, "RayService")
    assert rs["apiVersion"] == "ray.io/v1"
    jsonschema.validate(rs, rayservice_schema)
    # The pod templates are core PodSpecs: validate them strictly too.
    cluster = rs["spec"]["rayClusterConfig"]
    for group in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]:
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "x"}}
        pod["spec"] = group["template"]["spec"]
        kubernetes_validate.validate(pod, K8S_VERSION, strict=True)


def serve_app(rs: dict[str, Any]) -> dict[str, Any]:
    (app,) = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"]
    return app


def test_serve_config_builds_our_app(rendered: tuple[str, list[dict[str, Any]]]) -> None:
    name, docs = rendered
    (rs,) = by_kind(docs, "RayService")
    app = serve_app(rs)
    module, attr = app["import_path"].split(":")
    builder = getattr(importlib.import_module(module), attr)
    from service.ray_app import DEFAULT_REQUEST_ROUTER, RayAppConfig, build_app

    assert builder is build_app
    cfg = RayAppConfig.from_dict(app["args"])
    assert cfg.engine_config().space_admissions  # a server's default: the chart leaves it unset
    cfg.sparsity_config()
    build_app(app["args"])  # builds the deployment graph; needs no running cluster

    values = VALUE_SETS[name]
    tp = values.get("tensorParallelSize", 1)
    assert cfg.engine["tensor_parallel_size"] == tp
    (worker,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    (container,) = worker["template"]["spec"]["containers"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == str(tp)
    assert (worker["minReplicas"], worker["maxReplicas"]) == (cfg.min_replicas, cfg.max_replicas)
    if name == "autoscaling-off":
        assert cfg.min_replicas == cfg.max_replicas == 2
        assert rs["spec"]["rayClusterConfig"]["enableInTreeAutoscaling"] is False
    env = {e["name"]: e for e in container["env"]}
    assert env["NCCL_P2P_DISABLE"]["value"] == "1"
    if name == "secrets-pvc-pools":
        assert env["KVSPARSE_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "kvsparse-api-key"
        assert env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "hf-token"
        assert "api_key" not in app["args"]
        assert cfg.pools == "snapkv,dense" and cfg.max_ongoing_requests == 48
    custom = name == "secrets-pvc-pools"
    router = PREFIX_CACHE_AFFINITY_ROUTER if custom else DEFAULT_REQUEST_ROUTER
    assert cfg.request_router_class == router
    assert cfg.engine_kind == ("vllm" if name == "vllm-engine" else "native")


def test_serve_runs_at_the_engines_capacity(
    rendered: tuple[str, list[dict[str, Any]]],
) -> None:
    """Nothing in front of the engines holds requests back: the ingress takes as many as every
    engine replica can run (and more, to queue them itself), and every Ray container runs Serve
    in the environment `kvsparse serve --ray` sets."""
    from service.ray_app import RayAppConfig, ingress_options
    from service.ray_env import SERVE_ENVIRONMENT
    from service.settings import parse_pools

    _, docs = rendered
    (rs,) = by_kind(docs, "RayService")
    cfg = RayAppConfig.from_dict(serve_app(rs)["args"])
    engine = cfg.engine_config()
    pools = len(parse_pools(cfg.pools, cfg.sparsity_config()))
    inflight = cfg.ingress_max_inflight(engine, pools)
    capacity = engine.max_num_seqs * cfg.max_replicas * pools
    assert inflight * cfg.ingress_replicas >= capacity
    assert ingress_options(cfg, inflight)["max_ongoing_requests"] == inflight
    assert cfg.stream_interval == 4
    cluster = rs["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]] + cluster["workerGroupSpecs"]
    for pod in pods:
        (container,) = pod["template"]["spec"]["containers"]
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert SERVE_ENVIRONMENT.items() <= env.items(), container["name"]


def test_defaults_serve_fp8_at_the_kv_caches_capacity_with_a_key(helm: str) -> None:
    """What `helm install` with nothing set runs: FP8 weights and KV cache, enough sequence slots
    that the KV cache bounds admission rather than max_num_seqs, and an API key from a Secret the
    chart generates (random, kept on upgrades), the same Secret for the ingress and `helm
    test`."""
    from service.ray_app import RayAppConfig

    docs = render(helm, {})
    (rs,) = by_kind(docs, "RayService")
    engine = RayAppConfig.from_dict(serve_app(rs)["args"]).engine_config()
    assert (engine.quantization, engine.kv_cache_dtype) == ("fp8", "fp8")
    assert engine.max_num_seqs >= 128
    (secret,) = by_kind(docs, "Secret")
    key = base64.b64decode(secret["data"]["api-key"]).decode()
    assert len(key) >= 32 and key.isalnum()
    assert secret["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    (ref,) = [
        e["valueFrom"]["secretKeyRef"] for e in head["env"] if e["name"] == "KVSPARSE_API_KEY"
    ]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-key"}
    test_pod = by_kind(
        render(helm, {}, "--show-only", "templates/tests/test-openai-request.yaml"), "Pod"
    )
    assert "Bearer $KVSPARSE_API_KEY" in json.dumps(test_pod)
    # Two renders (an install and an upgrade without a cluster to read back from) draw new keys;
    # with generate off and no Secret named, no key at all.
    assert by_kind(render(helm, {}), "Secret")[0]["data"] != secret["data"]
    open_docs = render(helm, {"serve": {"apiKeySecret": {"generate": False}}})
    assert not by_kind(open_docs, "Secret")
    assert "KVSPARSE_API_KEY" not in json.dumps(open_docs)


def test_engine_replicas_share_a_gpu_through_extra_args(helm: str) -> None:
    """`--set serve.extraArgs.num_gpus_per_replica=0.5` (helm hands the number over as a string)
    runs engine replicas on half a GPU each, two to a card; a value that is no number is refused
    naming the argument."""
    from service.ray_app import RayAppConfig, engine_options

    extra = ("--set", "serve.extraArgs.num_gpus_per_replica=0.5")
    (rs,) = by_kind(render(helm, {"engine": {"device": "cuda"}}, *extra), "RayService")
    args = serve_app(rs)["args"]
    assert args["num_gpus_per_replica"] == "0.5"
    cfg = RayAppConfig.from_dict(args)
    options = engine_options(cfg, cfg.engine_config())
    assert options["ray_actor_options"]["num_gpus"] == 0.5
    with pytest.raises(ValueError, match="num_gpus_per_replica"):
        RayAppConfig.from_dict({**args, "num_gpus_per_replica": "half"})


def test_values_schema_is_generated_from_the_config_fields() -> None:
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "values_schema.py"), "--check"],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    ("values", "complaint"),
    [
        ({"engine": {"max_num_seq": 8}}, "Additional property max_num_seq is not allowed"),
        ({"sparsity": {"policy": "snapkvv"}}, "sparsity.policy must be one of"),
        ({"engine": {"max_num_seqs": [8]}}, "engine.max_num_seqs"),
        ({"engine": {"model": "other"}}, "Additional property model is not allowed"),
        ({"serve": {"apiKeySecrets": {"name": "k"}}}, "Additional property apiKeySecrets"),
        ({"serve": {"extraArgs": {"stream_intervall": 2}}}, "stream_intervall"),
        ({"engineKind": "vllms"}, "engineKind must be one of"),
    ],
)
def test_mistyped_values_fail_on_the_schema(helm: str, values: dict, complaint: str) -> None:
    proc = subprocess.run([helm, "template", "kvsparse", str(CHART), *set_args(values)],
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode != 0 and "schema" in proc.stderr, proc.stderr
    assert complaint in proc.stderr, proc.stderr


def test_default_pod_placement(helm: str) -> None:
    (rs,) = by_kind(render(helm, {}), "RayService")
    spec = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert spec["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-GeForce-RTX-4090"}
    assert any(t["key"] == "nvidia.com/gpu" for t in spec["tolerations"])
    shm = [v for v in spec["volumes"] if v["name"] == "dshm"]
    assert shm and shm[0]["emptyDir"]["medium"] == "Memory"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in spec["containers"][0]["volumeMounts"]


def test_optional_objects(helm: str) -> None:
    kinds = {n: {d["kind"] for d in render(helm, v)} for n, v in VALUE_SETS.items()}
    assert {"PodMonitor", "PrometheusRule", "ConfigMap", "Service", "RayService"} <= kinds[
        "default"
    ]
    assert "Ingress" not in kinds["default"] and "Ingress" in kinds["ingress-on"]
    assert not kinds["monitors-off"] & {
        "PodMonitor",
        "ServiceMonitor",
        "PrometheusRule",
        "ConfigMap",
    }
    assert {"ServiceMonitor"} <= kinds["servicemonitor"] and "PodMonitor" not in kinds[
        "servicemonitor"
    ]


def test_service_and_helm_test_pod(helm: str) -> None:
    docs = render(helm, {})
    (svc,) = by_kind(docs, "Service")
    assert svc["spec"]["type"] == "LoadBalancer"
    assert svc["spec"]["ports"][0]["port"] == 8000
    (pod,) = by_kind(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    cmd = " ".join(pod["spec"]["containers"][0]["args"])
    assert f"http://{svc['metadata']['name']}:8000/v1/chat/completions" in cmd
    body = json.loads(cmd.split("-d '", 1)[1].rstrip("'"))
    assert body["model"] == "meta-llama/Meta-Llama-3-8B-Instruct"


def test_model_download_feeds_the_engine(helm: str) -> None:
    """The init container downloads the repository into the directory the engines load."""
    (rs,) = by_kind(render(helm, {}), "RayService")
    args = serve_app(rs)["args"]
    (worker,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    init, _ = worker["template"]["spec"]["initContainers"]
    assert init["name"] == "download-model"
    env = {e["name"]: e.get("value") for e in init["env"]}
    assert env["MODEL_REPO"] == args["served_model_name"] == "meta-llama/Meta-Llama-3-8B-Instruct"
    assert env["MODEL_PATH"] == args["model"]
    assert {"name": "model-cache", "mountPath": "/models"} in init["volumeMounts"]
    assert args["model"].startswith("/models/")
    compile(init["args"][0], "download-model", "exec")  # the script is Python

    (rs,) = by_kind(render(helm, VALUE_SETS["secrets-pvc-pools"]), "RayService")
    spec = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["calibrate-layers"]
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for v in spec["volumes"]
        if v["name"] == "model-cache"
    ]
    assert claims == ["model-cache"]


def test_download_needs_the_cache(helm: str) -> None:
    with pytest.raises(AssertionError, match=r"model\.cache\.enabled"):
        render(helm, {"model": {"cache": {"enabled": False}}})
    # Without the cache there is nowhere to keep a profile: no calibration step.
    (rs,) = by_kind(render(helm, {"model": {"cache": {"enabled": False}, "hfRepo": ""}}),
                    "RayService")  # fmt: skip
    spec = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert "initContainers" not in spec


def test_calibration_step_writes_where_the_engines_read(helm: str, tmp_path: Path) -> None:
    """The init container runs `kvsparse calibrate` (arguments our own parser takes) on the
    model the engines load, in their number formats, into the profile directory every Ray
    container is given; the engines leave full_layers to it."""
    from service.cli import build_parser  # the `kvsparse` command

    (rs,) = by_kind(render(helm, {"calibration": {"extraArgs": ["--samples=3"]}}), "RayService")
    args = serve_app(rs)["args"]
    assert args["sparsity"]["full_layers"] is None
    (worker,) = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    spec = worker["template"]["spec"]
    _, calibrate = spec["initContainers"]
    shell, flag, script, name = calibrate["command"]
    assert (shell, flag) == ("sh", "-c") and script.startswith('kvsparse calibrate "$@" ||')
    parsed = build_parser().parse_args(["calibrate", *calibrate["args"]])
    assert parsed.model == args["model"] and parsed.skip_existing and parsed.samples == 3
    assert (parsed.quantization, parsed.kv_cache_dtype) == ("fp8", "fp8")
    assert parsed.compare_ratios == ""
    assert calibrate["resources"]["limits"]["nvidia.com/gpu"] == "1"

    def profile_dir(container: dict) -> str | None:
        env = {e["name"]: e.get("value") for e in container["env"]}
        return env.get("KVSPARSE_PROFILE_DIR")

    (engine,) = spec["containers"]
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert profile_dir(calibrate) == profile_dir(engine) == profile_dir(head)
    assert profile_dir(engine) == "/models/kvsparse-profiles"

    # The step never keeps the pod from starting: a failed calibration is logged, and the
    # engines keep the first 3 layers whole. Run with a `kvsparse` that fails:
    fake = tmp_path / "kvsparse"
    fake.write_text('#!/bin/sh\necho "$@" > "$0.args"\nexit 1\n')
    fake.chmod(0o755)
    env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    run = subprocess.run([shell, flag, script, name, *calibrate["args"]], env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 0 and "kvsparse calibrate failed" in run.stderr
    assert (tmp_path / "kvsparse.args").read_text().split() == ["calibrate", *calibrate["args"]]

    (rs,) = by_kind(render(helm, {"calibration": {"enabled": False}}), "RayService")
    spec = rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["template"]["spec"]
    assert [c["name"] for c in spec["initContainers"]] == ["download-model"]
    assert profile_dir(spec["containers"][0]) is None


def test_replicas_drain_within_the_pods_grace_period(helm: str) -> None:
    """Serve's graceful shutdown of a replica ends before Kubernetes kills its pod."""
    (rs,) = by_kind(render(helm, {}), "RayService")
    cluster = rs["spec"]["rayClusterConfig"]
    pods = [cluster["headGroupSpec"]["template"]["spec"]]
    pods += [group["template"]["spec"] for group in cluster["workerGroupSpecs"]]
    grace = {pod["terminationGracePeriodSeconds"] for pod in pods}
    assert serve_app(rs)["args"]["graceful_shutdown_timeout_s"] < min(grace) == 45
    with pytest.raises(AssertionError, match=r"gracefulShutdownTimeoutS must be below"):
        render(helm, {"serve": {"gracefulShutdownTimeoutS": 45}})
    # Direct ingress keeps a stopping ingress replica 30 + 5 s whatever its own timeout says.
    with pytest.raises(AssertionError, match=r"terminationGracePeriodSeconds must be above 35"):
        render(helm, {"terminationGracePeriodSeconds": 30})
    direct_off = {"RAY_SERVE_ENABLE_DIRECT_INGRESS": "0"}
    render(helm, {"terminationGracePeriodSeconds": 30, "serve": {"rayServeEnv": direct_off}})
    haproxy = {"RAY_SERVE_ENABLE_HA_PROXY": "1", **direct_off}  # HAProxy needs direct ingress
    with pytest.raises(AssertionError, match=r"terminationGracePeriodSeconds must be above 35"):
        render(helm, {"terminationGracePeriodSeconds": 30, "serve": {"rayServeEnv": haproxy}})


def test_dockerfile_matches_chart(helm: str) -> None:
    """The image the chart runs: KubeRay starts `ray start` itself, as uid 1000."""
    text = (ROOT / "Dockerfile").read_text()
    assert not [line for line in text.splitlines() if line.startswith("ENTRYPOINT")]
    assert "--uid 1000" in text
    # The serving extra (it brings ray[serve]) is in the default extras the image installs.
    extras = re.search(r"^ARG EXTRAS=(\S+)$", text, re.M)
    assert extras and "serve" in extras.group(1).split(",")
    assert '-c constraints.txt ".[${EXTRAS}]"' in text
    # The calibration step's English text is in the image, where the step looks for it.
    assert "ENV KVSPARSE_EVAL_DATA=" in text and "english_text()" in text
    # Ubuntu 24.04's own uid-1000 user makes way for ours.
    assert text.index("userdel --remove ubuntu") < text.index("useradd --create-home --uid 1000")
    for line in text.splitlines():
        if line.startswith("COPY "):
            for src in line.split()[1:-1]:
                assert (ROOT / src).exists(), src
    (rs,) = by_kind(render(helm, {}), "RayService")
    head = rs["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    assert head["securityContext"]["runAsUser"] == 1000
    assert "command" not in head["containers"][0]


def test_image_and_tests_install_the_same_pinned_versions(helm: str) -> None:
    """constraints.txt pins every dependency the image's and the tests' extras name (torch and
    triton aside: the host's build), Ray at the version the chart tells KubeRay, and `make
    setup` installs with it."""
    import tomllib

    from packaging.requirements import Requirement

    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    named = project["dependencies"] + [
        r for e in ("gpu", "serve", "bench", "test") for r in extras[e]
    ]
    names = {re.sub(r"[-_.]+", "-", Requirement(r).name).lower() for r in named}
    assert names - {"kvsparse", "torch", "triton"} <= set(pins), names - set(pins)
    for r in named:
        req = Requirement(r)
        key = re.sub(r"[-_.]+", "-", req.name).lower()
        if key in pins:
            assert req.specifier.contains(pins[key], prereleases=True), (r, pins[key])
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    assert pins["ray"] == values["rayVersion"]
    assert "-c constraints.txt" in (ROOT / "Makefile").read_text()


def test_crd_check_refuses_unknown_fields(helm: str, rayservice_schema: dict[str, Any]) -> None:
    (rs,) = by_kind(render(helm, {}), "RayService")
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 4  # a typo
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(rs, rayservice_schema)


# Where the chart's values hold the EngineConfig fields it does not take under `engine:`.
HELM_VALUES = {"model": ("model", "path"), "tensor_parallel_size": ("tensorParallelSize",)}


def helm_values(setting: Setting, value: Any) -> dict[str, Any]:
    """Values that set one config field: `engine.<field>` or `sparsity.<field>`, but for the
    two fields above."""
    section = "engine" if setting.config.__name__ == "EngineConfig" else "sparsity"
    *path, last = HELM_VALUES.get(setting.name, (section, setting.name))
    values = {last: value}
    for key in reversed(path):
        values = {key: values}
    return values


def chart_configs(docs: list[dict[str, Any]]) -> Configs:
    from service.ray_app import RayAppConfig

    (rs,) = by_kind(docs, "RayService")
    cfg = RayAppConfig.from_dict(serve_app(rs)["args"])
    return cfg.engine_config(), cfg.sparsity_config()


@pytest.fixture(scope="module")
def chart_defaults(helm: str) -> Configs:
    return chart_configs(render(helm, {}))


@pytest.mark.parametrize("setting", SETTINGS, ids=lambda s: s.dest)
def test_every_config_field_reaches_the_engines_from_the_values(
    helm: str, chart_defaults: Configs, setting: Setting
) -> None:
    """Each EngineConfig and SparsityConfig field, set in the values to something other than
    the chart's default, is what the Serve application's engines get."""
    value = sample(setting, value_of(chart_defaults, setting))
    values: dict[str, Any] = {}
    for s, v in with_companions(setting, value).items():
        for key, part in helm_values(s, v).items():
            values[key] = {**values.get(key, {}), **part} if isinstance(part, dict) else part
    assert value_of(chart_configs(render(helm, values)), setting) == value
