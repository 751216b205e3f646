"""The Kubernetes manifests under docker/k8s validate offline against the Kubernetes schemas
(kubernetes-validate, strict: unknown fields fail) and agree with the code: settings they set exist, metrics
they scale on are ours."""

from __future__ import annotations

import kubernetes_validate
import pytest
import yaml

from config.settings import Settings
from tests import REPO

K8S = REPO / "docker" / "k8s"
KUBE_VERSION = "1.33.0"


def documents() -> list[dict]:
    docs = []
    for path in sorted(K8S.glob("*.yaml")):
        if path.name != "kustomization.yaml":
            docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def by_kind(kind: str) -> list[dict]:
    return [d for d in documents() if d["kind"] == kind]


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_every_manifest_is_valid_against_the_kubernetes_schema(doc: dict) -> None:
    kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


def test_the_validator_catches_a_bad_manifest() -> None:
    bad = dict(by_kind("Deployment")[0])
    bad["spec"] = dict(bad["spec"], replicas="three")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, KUBE_VERSION, strict=True)


def test_kustomization_lists_every_manifest() -> None:
    listed = yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"]
    assert sorted(listed) == sorted(p.name for p in K8S.glob("*.yaml") if p.name != "kustomization.yaml")


def test_the_deployment_shape() -> None:
    (redis,) = [s for s in by_kind("StatefulSet") if s["metadata"]["name"] == "redis"]
    assert "--appendonly" in redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert redis["spec"]["volumeClaimTemplates"]  # persistent
    (gateway,) = by_kind("Deployment")
    assert gateway["spec"]["replicas"] >= 2
    (worker,) = [s for s in by_kind("StatefulSet") if s["metadata"]["name"] == "switchyard-worker"]
    resources = worker["spec"]["template"]["spec"]["containers"][0]["resources"]
    assert resources["requests"]["nvidia.com/gpu"] == 1 == resources["limits"]["nvidia.com/gpu"]
    assert {s["metadata"]["name"] for s in by_kind("Service")} == {"redis", "switchyard-gateway",
                                                                   "switchyard-worker"}
    (secret,) = by_kind("Secret")
    assert set(secret["stringData"]) == {"cluster-secret-key", "hash-secret", "metrics-token"}
    assert all(v == "" for v in secret["stringData"].values())  # no key ships in the repository


def test_settings_and_metrics_named_exist() -> None:
    for doc in by_kind("Deployment") + by_kind("StatefulSet"):
        for container in doc["spec"]["template"]["spec"]["containers"]:
            for env in container.get("env", []):
                name = env["name"]
                if not name.startswith("SWITCHYARD_"):
                    continue
                parts = name.removeprefix("SWITCHYARD_").lower().split("__")
                fields = Settings.model_fields
                if len(parts) == 2:
                    fields = fields[parts[0]].annotation.model_fields
                assert parts[-1] in fields, f"{name} sets no setting"
    hpa = next(h for h in by_kind("HorizontalPodAutoscaler") if h["metadata"]["name"] == "switchyard-worker")
    names = {m.get("pods", m.get("external", {})).get("metric", {}).get("name")
             for m in hpa["spec"]["metrics"]}
    assert names == {"switchyard_worker_waiting_requests", "switchyard_ttft_p95_seconds"}
    rules = yaml.safe_load(next(c for c in by_kind("ConfigMap"))["data"]["config.yaml"])
    queries = " ".join(r["seriesQuery"] for r in rules["rules"] + rules["externalRules"])
    # the module defining switchyard_ttft_seconds
    from gateway.telemetry.gateway_metrics import TTFT_BUCKETS  # noqa: F401
    from worker.server.telemetry.worker_metrics import WAITING

    assert WAITING._name in queries and "switchyard_ttft_seconds_bucket" in queries


def test_gateway_replicas_share_one_files_volume() -> None:
    (gw,) = [d for d in by_kind("Deployment") if d["metadata"]["name"] == "switchyard-gateway"]
    pod = gw["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    mount = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}["files"]
    assert env["SWITCHYARD_GATEWAY__FILES_DIR"] == mount
    claim = {v["name"]: v for v in pod["volumes"]}["files"]["persistentVolumeClaim"]["claimName"]
    (pvc,) = [d for d in by_kind("PersistentVolumeClaim") if d["metadata"]["name"] == claim]
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # every replica writes and reads it
