"""The Serve application exactly as the Helm chart deploys it, on a machine without Kubernetes.

    python3 scripts/serve_chart.py render DIR [--set KEY=VALUE ...] [--set-json KEY=JSON ...]
    python3 scripts/serve_chart.py run DIR [--port 8000] [--metrics-port 8080] [--step-log PATH]

`render` (needs helm) runs `helm template` on deploy/helm/kvsparse with the given values and
writes what the RayService holds: the Serve config (`serve_config.json`: import path and builder
arguments) and the plain environment of the Ray containers (`env.json`). `run` starts a local Ray
cluster in that environment and runs that application, as KubeRay would from the RayService; it
serves until interrupted. The GPU benchmarks serve through it (`CHART_CONFIG=DIR bash
scripts/bench_gpu.sh serve-chart`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART = ROOT / "deploy" / "helm" / "kvsparse"


def render(out: Path, values: list[str], json_values: list[str]) -> None:
    helm = ROOT / ".tools" / "bin" / "helm"
    helm_cmd = str(helm) if helm.exists() else shutil.which("helm")
    if helm_cmd is None:
        sys.exit("helm not found (scripts/install_tools.sh installs it into .tools/bin)")
    sets = [arg for v in values for arg in ("--set", v)]
    sets += [arg for v in json_values for arg in ("--set-json", v)]
    text = subprocess.run(
        [helm_cmd, "template", "kvsparse", str(CHART), "--skip-tests", *sets],
        check=True, capture_output=True, text=True,
    ).stdout  # fmt: skip
    (service,) = [d for d in yaml.safe_load_all(text) if d and d["kind"] == "RayService"]
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    head = service["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]
    env = {e["name"]: e["value"] for e in head["containers"][0]["env"] if "value" in e}
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_config.json").write_text(json.dumps(app, indent=2))
    (out / "env.json").write_text(json.dumps(env, indent=2))
    print(f"wrote {out}/serve_config.json and env.json")


def run(config_dir: Path, port: int, metrics_port: int, step_log: str | None) -> None:
    app = json.loads((config_dir / "serve_config.json").read_text())
    os.environ.update(json.loads((config_dir / "env.json").read_text()))
    # The application's modules, for this process and the cluster's (which inherit the variable).
    sys.path.insert(0, str(ROOT))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])
    )
    args = app["args"]
    if step_log:
        args["engine"]["step_log"] = os.path.abspath(step_log)
    import ray
    from ray import serve
    from ray._common.utils import import_attr
    from ray.serve._private.api import call_user_app_builder_with_args_if_necessary

    ray.init(_metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000})
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        builder = import_attr(app["import_path"])
        application = call_user_app_builder_with_args_if_necessary(builder, args)
        serve.run(application, name=app["name"], route_prefix=app["route_prefix"], blocking=True)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("render")
    r.add_argument("dir", type=Path)
    r.add_argument("--set", action="append", default=[], dest="values")
    r.add_argument("--set-json", action="append", default=[], dest="json_values")
    s = sub.add_parser("run")
    s.add_argument("dir", type=Path)
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--metrics-port", type=int, default=8080)
    s.add_argument("--step-log", default=None)
    args = parser.parse_args()
    if args.command == "render":
        render(args.dir, args.values, args.json_values)
    else:
        run(args.dir, args.port, args.metrics_port, args.step_log)


if __name__ == "__main__":
    main()
