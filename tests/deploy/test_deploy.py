"""``deploy/``: every manifest valid for Kubernetes, and consistent with the code it runs.

Each document is checked against Kubernetes' own OpenAPI schemas (kubernetes-validate,
strict: an unknown field is an error) for the oldest and the newest version we
name. Each ``epd-trio`` container's arguments are parsed by the real CLI into its
config, with what the downward API would give; its ports, probes and shutdown budget
must agree with that config; every selector must select; the autoscaler's metric
must be one a running encoder exports.
"""

from __future__ import annotations

import copy
import re
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from epd_trio.cli import build_parser
from epd_trio.config import (
    BootstrapConfig,
    EncoderConfig,
    EngineConfig,
    config_from_args,
    env_name,
)

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())
POD_IP = "10.42.0.7"  # what status.podIP would give


def documents() -> Iterator[tuple[str, int, dict[str, Any]]]:
    for path in sorted(DEPLOY.glob("*.yaml")):
        for index, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc is not None:
                yield path.name, index, doc


DOCS = list(documents())


def of_kind(kind: str) -> list[dict[str, Any]]:
    return [doc for _, _, doc in DOCS if doc["kind"] == kind]


def epd_containers() -> list[tuple[str, dict[str, Any], dict[str, Any]]]:
    """(deployment name, pod spec, container) for every container running epd-trio."""
    found = []
    for deployment in of_kind("Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        for container in pod["containers"]:
            if "epd-trio" in container["image"]:
                found.append((deployment["metadata"]["name"], pod, container))
    return found


def test_every_kind_the_layout_needs_is_there() -> None:
    kinds = sorted({doc["kind"] for _, _, doc in DOCS})
    assert kinds == ["Deployment", "HorizontalPodAutoscaler", "PodDisruptionBudget", "Service"]
    assert {path.name for path in DEPLOY.glob("*.yaml")} == {
        "registry.yaml", "encoders.yaml", "autoscaling.yaml", "sglang.yaml", "vllm.yaml"}


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("name", "index", "doc"), DOCS, ids=[f"{n}#{i}" for n, i, _ in DOCS])
def test_each_manifest_is_valid_for_kubernetes(name: str, index: int, doc: dict[str, Any],
                                               version: str) -> None:
    kubernetes_validate.validate(doc, version, strict=True)


def test_the_validator_rejects_what_kubernetes_would() -> None:
    """The check above can fail: a misspelt field, a wrong type."""
    deployment = copy.deepcopy(of_kind("Deployment")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)
    deployment = copy.deepcopy(of_kind("Deployment")[0])
    deployment["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, VERSIONS[-1], strict=True)


def environment(container: dict[str, Any]) -> dict[str, str]:
    """The container's variables as the pod would see them (a Secret's value stands in)."""
    env = {}
    for var in container.get("env", []):
        source = var.get("valueFrom", {})
        if "fieldRef" in source:
            assert source["fieldRef"]["fieldPath"] == "status.podIP", var
            env[var["name"]] = POD_IP
        elif "secretKeyRef" in source:
            env[var["name"]] = "a-secret-token"
        else:
            env[var["name"]] = var["value"]
    return env


def parsed(container: dict[str, Any]) -> EncoderConfig | BootstrapConfig:
    """The container's command line as ``epd-trio`` reads it, $(VAR)s expanded as the kubelet does."""
    env = environment(container)
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], arg) for arg in container["args"]]
    namespace = build_parser().parse_args(args)
    cls = EncoderConfig if args[0] == "encoder" else BootstrapConfig
    return config_from_args(cls, namespace, environ=env)


def ports(container: dict[str, Any]) -> dict[str, int]:
    return {p["name"]: p["containerPort"] for p in container["ports"]}


CONTAINERS = [pytest.param(name, pod, container, id=f"{name}/{container['name']}")
              for name, pod, container in epd_containers()]


@pytest.mark.parametrize(("name", "pod", "container"), CONTAINERS)
def test_each_epd_trio_container_runs_a_valid_command(name: str, pod: dict[str, Any],
                                                      container: dict[str, Any]) -> None:
    config = parsed(container)
    listed = ports(container)
    assert config.host == "0.0.0.0"  # reachable on the pod IP
    assert listed["http" if "http" in listed else next(iter(listed))] == config.port
    if isinstance(config, BootstrapConfig):
        return
    if config.register_url:  # registries are told the pod IP, never a wildcard
        assert config.advertise_url == f"http://{POD_IP}:{config.port}"
    if config.grpc_port is not None:
        assert listed["grpc"] == config.grpc_port
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        check = container[probe]
        assert check["httpGet"]["path"] == "/health"
        assert listed[check["httpGet"]["port"]] == config.port
        assert check["timeoutSeconds"] > config.health_timeout  # a probe encode may take that long
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300  # a large model's load
    assert container["readinessProbe"]["failureThreshold"] == 1  # out of rotation at once
    pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert pre_stop[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] > int(pre_stop[1]) + config.drain_timeout
    assert "nvidia.com/gpu" in container["resources"]["limits"] and config.engine.device == "cuda"


def test_every_epd_variable_is_a_setting() -> None:
    names = {env_name(f) for cls in (EncoderConfig, EngineConfig, BootstrapConfig)
             for f in cls.__dataclass_fields__}
    used = {var["name"] for _, _, container in epd_containers() for var in container.get("env", [])
            if var["name"].startswith("EPD_")}
    assert used and used <= names, used - names


def test_every_selector_selects() -> None:
    labels = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"]
              for d in of_kind("Deployment")}
    for deployment in of_kind("Deployment"):
        selector = deployment["spec"]["selector"]["matchLabels"]
        assert selector.items() <= labels[deployment["metadata"]["name"]].items()
    pods = list(labels.values())
    for doc in of_kind("Service") + of_kind("PodDisruptionBudget"):
        selector = doc["spec"]["selector"]
        selector = selector.get("matchLabels", selector)
        assert any(selector.items() <= pod.items() for pod in pods), doc["metadata"]["name"]
    for hpa in of_kind("HorizontalPodAutoscaler"):
        assert hpa["spec"]["scaleTargetRef"]["name"] in labels


def test_the_encoders_headless_service_is_what_discovery_dns_needs() -> None:
    (service,) = [s for s in of_kind("Service") if s["metadata"]["name"] == "epd-encoders"]
    assert service["spec"]["clusterIP"] == "None"
    assert not service["spec"].get("publishNotReadyAddresses")  # ready pods only
    assert {p["name"]: p["port"] for p in service["spec"]["ports"]} == {"http": 8000, "grpc": 50051}


async def test_the_autoscalers_metric_is_one_an_encoder_exports(encoder: Any) -> None:
    (hpa,) = of_kind("HorizontalPodAutoscaler")
    (metric,) = hpa["spec"]["metrics"]
    name = metric["pods"]["metric"]["name"]
    async with encoder() as (_, http):
        response = await http.get("/metrics")
    assert response.status_code == 200
    assert re.search(rf"^{name} \d", response.text, re.MULTILINE), name


def test_the_image_recipe_has_both_variants_and_runs_epd_trio() -> None:
    recipe = (DEPLOY / "Containerfile").read_text()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert 'ENTRYPOINT ["epd-trio"]' in recipe and "epd-trio" in project["scripts"]
    for variant, extra in (("gpu", "mooncake"), ("cpu", "mooncake-cpu")):
        stage = recipe.split(f"AS base-{variant}\n", 1)[1].split("\nFROM ", 1)[0]
        assert f"EPD_EXTRA={extra}" in stage and extra in project["optional-dependencies"]
    assert "FROM base-${VARIANT}" in recipe
    copied = re.findall(r"^COPY (.+) /src/", recipe, re.MULTILINE)
    assert all((ROOT / path).exists() for line in copied for path in line.split())



def test_the_vllm_encoder_names_items_as_its_consumer_does() -> None:
    """vLLM's mm_hash takes the consumer's --model string: the encoder beside it must use the
    same (--vllm-model, default --model-path as given), and share its EC directory."""
    (deployment,) = [d for d in of_kind("Deployment") if d["metadata"]["name"] == "vllm-epd"]
    containers = {c["name"]: c for c in deployment["spec"]["template"]["spec"]["containers"]}
    config = parsed(containers["encoder"])
    assert isinstance(config, EncoderConfig) and config.api == "vllm"
    consumer_model = containers["vllm"]["command"][2]
    assert (config.vllm_model or config.engine.model_path) == consumer_model
    shared = {c: {m["mountPath"] for m in containers[c]["volumeMounts"] if m["name"] == "ec-cache"}
              for c in ("encoder", "vllm")}
    assert shared["encoder"] == shared["vllm"] == {"/ec-cache"}
    for name in ("encoder", "vllm"):
        (flag,) = [a for a in containers[name]["args"] if a.startswith("--ec-transfer-config=")]
        assert '"shared_storage_path":"/ec-cache"' in flag
