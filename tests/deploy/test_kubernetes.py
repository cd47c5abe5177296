"""deploy/: every manifest parses, and each flag, port, path, environment variable and metric it names exists in
this repository (the launcher's flags, the engine's parameters, the metric families the server exports, the
routes it serves)."""
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from backend import LLMEngine
from backend.serving.heartbeat import CORE_KEY_VAR
from backend.serving.metrics import FAMILIES, LORA_INFO, gauges
from tests.helpers import ROOT

DEPLOY = ROOT / "deploy"
KUBE = DEPLOY / "kubernetes"


def documents() -> list[dict]:
    resources = yaml.safe_load((KUBE / "kustomization.yaml").read_text())["resources"]
    assert sorted(resources) == sorted(p.name for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")
    return [doc for name in resources for doc in yaml.safe_load_all((KUBE / name).read_text()) if doc]


def find(kind: str, name: str) -> dict:
    [doc] = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def container(deployment: str) -> dict:
    [c] = find("Deployment", deployment)["spec"]["template"]["spec"]["containers"]
    return c


def flags(c: dict) -> dict[str, str]:
    return dict(arg.removeprefix("--").partition("=")[::2] for arg in c["args"])


@pytest.fixture(scope="module")
def launcher_flags() -> set[str]:
    help_text = subprocess.run([sys.executable, str(ROOT / "scripts" / "launch_server.py"), "--help"],
                               capture_output=True, text=True, check=True).stdout
    return set(re.findall(r"--([a-z][a-z_\-]+)", help_text))


def test_every_manifest_parses_with_a_kind_and_a_name():
    for doc in documents():
        assert doc["apiVersion"] and doc["kind"] and doc["metadata"]["name"]


def test_the_server_uses_only_the_launchers_flags_and_declares_its_ports(launcher_flags):
    c = container("lora-llm")
    args = flags(c)
    assert set(args) <= launcher_flags, set(args) - launcher_flags
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"http": int(args["http-port"]), "grpc": int(args["grpc-port"]),
                     "metrics": int(args["metrics-port"]), "openai": int(args["openai-port"])}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert c[probe]["httpGet"]["port"] in ports
    assert "expose-core" in args, "the kubelet probes tritonserver's own port, off the pod's loopback"
    service_ports = {p["targetPort"] for p in find("Service", "lora-llm")["spec"]["ports"]}
    assert service_ports == set(ports)


def test_the_pool_is_ready_when_the_api_is_and_the_keys_are_required():
    c = container("lora-llm")
    probe = c["readinessProbe"]["httpGet"]
    assert (probe["path"], probe["port"]) == ("/health", "openai")      # the port the pool routes to
    keys = [e for e in c["env"] if e["name"] in ("LORA_LLM_OPENAI_API_KEY", "LORA_LLM_OPENAI_ADMIN_KEY",
                                                 CORE_KEY_VAR)]                     # (--expose-core asks for it)
    assert len(keys) == 3 and not any(e["valueFrom"]["secretKeyRef"].get("optional") for e in keys)


def test_the_server_reads_its_paths_from_mounted_volumes():
    c = container("lora-llm")
    mounts = [m["mountPath"] for m in c["volumeMounts"]]
    for flag in ("model-dir", "adapter-store"):
        assert any(flags(c)[flag].startswith(m) for m in mounts), flag
    claims = {v["persistentVolumeClaim"]["claimName"] for v in find("Deployment", "lora-llm")["spec"]["template"][
        "spec"]["volumes"] if "persistentVolumeClaim" in v}
    assert claims == {d["metadata"]["name"] for d in documents() if d["kind"] == "PersistentVolumeClaim"}


def test_environment_variables_are_engine_parameters_or_the_keys():
    parameters = set(re.findall(r'key: "(\w+)"', (ROOT / "model_repository/lora_llm/config.pbtxt").read_text()))
    frontend = (ROOT / "frontend/__main__.py").read_text()
    for env in container("lora-llm")["env"]:
        name = env["name"]
        assert name.removeprefix("LORA_LLM_").lower() in parameters or f'"{name}"' in frontend or \
            name == CORE_KEY_VAR, name


def test_the_pool_targets_the_openai_port_and_its_picker():
    pool = find("InferencePool", "lora-llm")["spec"]
    assert pool["selector"]["matchLabels"] == find("Deployment", "lora-llm")["spec"]["selector"]["matchLabels"]
    assert [p["number"] for p in pool["targetPorts"]] == [int(flags(container("lora-llm"))["openai-port"])]
    picker = pool["endpointPickerRef"]
    service = find("Service", picker["name"])["spec"]
    [port] = [p for p in service["ports"] if p["port"] == picker["port"]["number"]]
    epp = container("lora-llm-epp")
    assert int(flags(epp)["grpc-port"]) == next(p["containerPort"] for p in epp["ports"] if p["name"] == port[
        "targetPort"])
    assert flags(epp)["pool-name"] == find("InferencePool", "lora-llm")["metadata"]["name"]
    route = find("HTTPRoute", "lora-llm")["spec"]["rules"][0]["backendRefs"][0]
    assert (route["kind"], route["name"]) == ("InferencePool", "lora-llm")


def test_the_pickers_metrics_are_ones_the_server_exports(tiny_model_dir):
    engine = LLMEngine(tiny_model_dir, dtype="float32", kernel_backend="torch", kv_cache_memory_bytes=1 << 20)
    exported = gauges(engine, alive=True)
    names = {f.name for f in FAMILIES}
    specs = {k: v for k, v in flags(container("lora-llm-epp")).items() if k.endswith("-metric")}
    assert set(specs) == {"total-queued-requests-metric", "total-running-requests-metric",
                          "kv-cache-usage-percentage-metric", "lora-info-metric"}
    for spec in specs.values():                      # the picker's format: name{label=value,...}
        name, _, labels = spec.partition("{")
        assert name in names, spec
        if labels:
            pairs = tuple(tuple(pair.split("=")) for pair in labels.rstrip("}").split(","))
            assert (name, pairs) in exported, spec
    assert specs["lora-info-metric"] == LORA_INFO


def test_the_pickers_scrape_path_is_served_by_the_openai_api():
    from frontend.app import FrontendConfig, create_app
    app = create_app(FrontendConfig(model_dir=str(ROOT / "models" / "smollm2-135m-instruct")))
    assert "/metrics" in {route.path for route in app.routes}


def test_the_image_copies_what_exists_and_runs_the_launcher():
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    for source in re.findall(r"^COPY (\S+) ", dockerfile, re.M):
        assert (ROOT / source).exists(), source
    entry = re.search(r'^ENTRYPOINT \[(.*)\]', dockerfile, re.M)[1]
    assert '"scripts/launch_server.py"' in entry and (ROOT / "scripts/launch_server.py").exists()
    launcher = (ROOT / "scripts/launch_server.py").read_text() + (ROOT / "scripts/server_process.py").read_text()
    for name in re.findall(r"(LORA_LLM_\w+)=", dockerfile):
        assert name in launcher, name
    def pins(path: Path) -> dict[str, str]:
        return {re.sub(r"\[.*\]", "", name): version for name, version in
                (line.split("==") for line in path.read_text().splitlines() if "==" in line)}
    ours = pins(ROOT / "requirements.txt")
    for name, version in pins(DEPLOY / "requirements-gpu.txt").items():
        assert ours.get(name) == version, name
